"""Session-wide test settings.

MOE_TRITON_AUTOTUNE=0: the Triton kernels compile one config (the first their pruning keeps),
so a CUDA run of the suite compiles once per shape instead of benchmarking every config at
every small test shape (moe.kernels.triton.common.autotune_prune). Read once, when the
process's KernelConfig is built (before any kernel runs), and inherited by the ranks and
subprocesses the tests start; a test that wants another value sets a KernelConfig in code.

QUICK: the quick tier (`bash .ci/run --quick`, or `python -m pytest -m quick`), one check of
each layer of the stack in a few minutes on 2 cores; the full suite runs everything.
"""

import os

import pytest
import torch

os.environ.setdefault("MOE_TRITON_AUTOTUNE", "0")
# Without a GPU every Triton kernel runs in Triton's interpreter. @triton.jit picks compiled or
# interpreted when a kernel's module is imported, so the variable is set here, before any test
# module imports one (the test files that set it themselves run later in collection order).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Test ids (a file, or a file::test covering its parameters) marked `quick`.
QUICK = (
    "tests/test_layer.py",  # the layer against the per-token float64 reference
    "tests/test_routers.py",
    "tests/test_dispatch_plan.py",
    "tests/test_triton_kernels.py::test_expert_mlp_fp32",  # a Triton kernel, TRITON_INTERPRET=1
    "tests/test_m6.py::test_two_ranks_match_single_process",  # EP on 2 gloo ranks
    "tests/test_quick_pipeline.py",  # a pipeline step on 2 stages
    "tests/test_checkpoint.py::test_bit_exact_continuation",  # a checkpoint round trip
    "tests/test_m6.py::test_tiny_trains_and_loss_falls",  # the M6 smoke run
    "tests/test_hf_parity.py::test_from_hf_matches_transformers",  # HF conversion
    "tests/test_hf_contract_export.py",  # contract families: train, export, reload
    "tests/test_plan_cli.py",  # the planner's command line, every bad value refused
    "tests/test_convert.py",  # swap_ffn, saved settings, the public names
    "tests/test_untrusted.py",
    "tests/test_layering.py",
    "tests/test_docs.py::test_every_command_and_snippet_is_classified",
    "tests/test_docs.py::test_every_prose_command_is_classified",
)


def pytest_collection_modifyitems(items):
    for item in items:
        if item.nodeid.startswith(QUICK):
            item.add_marker(pytest.mark.quick)
