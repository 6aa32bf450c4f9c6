"""Session-wide test settings.

MOE_TRITON_AUTOTUNE=0: the Triton kernels compile their first (default) config only, so a CUDA
run of the suite compiles once per shape instead of benchmarking every config at every small
test shape (moe.kernels.triton.common.autotune_configs). Set before any kernel module is
imported: the autotuner's config list is fixed at import.
"""

import os

os.environ.setdefault("MOE_TRITON_AUTOTUNE", "0")
