"""Session-wide test settings.

MOE_TRITON_AUTOTUNE=0: the Triton kernels compile one config (the first their pruning keeps),
so a CUDA run of the suite compiles once per shape instead of benchmarking every config at
every small test shape (moe.kernels.triton.common.autotune_prune). Read once, when the
process's KernelConfig is built (before any kernel runs), and inherited by the ranks and
subprocesses the tests start; a test that wants another value sets a KernelConfig in code.
"""

import os

os.environ.setdefault("MOE_TRITON_AUTOTUNE", "0")
