"""The Hopper-era kernel paths against float64 references, under TRITON_INTERPRET=1 on CPU
(compiled with CUDA): dW1 and dW3 in one launch (gathered or from the pre-permuted copy of x)
and the opt-in tensor-descriptor (TMA) path of the rows kernel. Helpers and the interpreter
switch are test_triton_kernels.py's."""

import sys

import pytest
import torch

from tests.test_triton_kernels import DEVICE, assert_close, check_case, make_case

# ----------------------------------------------------------------------------- weight gradients
WGRAD_CASES = {
    # id: (counts per expert, dropped tail rows, I, J)
    "empty-expert-tail": ([7, 0, 12], 3, 24, 40),
    "M=1": ([0, 1], 0, 5, 7),
    "one-expert-takes-all": ([0, 0, 33, 0], 4, 24, 18),
    "E=1": ([37], 0, 17, 16),
    "all-dropped": ([0, 0], 6, 8, 8),
}


@pytest.mark.parametrize("name", list(WGRAD_CASES))
@pytest.mark.parametrize("prepermute", [False, True])
def test_ragged_reduce_two_outputs(name, prepermute):
    """dW1 and dW3 in one launch (out2: B = [B1 | B2]), gathered or from the pre-permuted copy,
    with the bias gradient of the first half, against a float64 per-expert reference."""
    from moe.kernels.triton.grouped_mm_wgrad import ragged_reduce_mm

    counts, tail, I, J = WGRAD_CASES[name]
    g = torch.Generator().manual_seed(len(counts) * 7 + I)
    E, M = len(counts), sum(counts) + tail
    T = max(M // 2, 1)
    a = torch.randn(T, I, generator=g)
    b = torch.randn(M, 2 * J, generator=g)
    ids = torch.randint(0, T, (M,), generator=g)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    out = torch.full((E, I, J), float("nan")).to(DEVICE)
    out2 = torch.full((E, I, J), float("nan")).to(DEVICE)
    db = torch.full((E, J), float("nan")).to(DEVICE)
    ragged_reduce_mm(a.to(DEVICE), b.to(DEVICE), offsets.to(DEVICE), out, idx_M=ids.to(DEVICE),
                     dbias_EJ=db, out2_EIJ=out2, prepermute=prepermute)  # fmt: skip
    ends = offsets.tolist()
    for e in range(E):
        lo, hi = (ends[e - 1] if e else 0), ends[e]
        a_e, b_e = a.double()[ids[lo:hi]], b.double()[lo:hi]
        assert_close(out[e], a_e.T @ b_e[:, :J], torch.float32, f"out[{e}]")
        assert_close(out2[e], a_e.T @ b_e[:, J:], torch.float32, f"out2[{e}]")
        assert_close(db[e], b_e[:, :J].sum(0), torch.float32, f"db[{e}]")
        if hi == lo:
            assert torch.all(out[e] == 0) and torch.all(out2[e] == 0) and torch.all(db[e] == 0)


TMA_CASES = {
    # aligned rows (TMA taken) with empty experts, a dropped tail, one expert taking all rows
    "swiglu-bias-aligned": ([5, 0, 17, 2], 2, 24, 40, "swiglu", True, True),
    "gelu-no-gather-aligned": ([0, 0, 33, 0], 4, 16, 20, "gelu", False, False),
    "M=1-aligned": ([0, 1], 0, 8, 12, "swiglu", False, True),
    "unaligned-falls-back": ([3, 9], 1, 5, 7, "swiglu", True, True),
    "bf16-swiglu-aligned": ([6, 0, 11], 3, 16, 24, "swiglu", False, True),
}


@pytest.mark.parametrize("name", list(TMA_CASES))
def test_expert_mlp_tma_path(name, monkeypatch):
    """KernelConfig(tma=True) (or MOE_TRITON_TMA=1 when the config is built): weight (and
    contiguous activation) tiles through tensor descriptors (the sm_90 path, run here by the
    interpreter); outputs and every gradient vs float64."""
    from moe.kernels import KernelConfig
    from moe.kernels.triton import grouped_mm

    # the process's kernel config, in code (the variable is read once); restored after the test
    monkeypatch.setattr(sys.modules["moe.kernels.kernel_config"], "_config", KernelConfig(tma=True))
    taken = []
    real = grouped_mm.tma_ok
    monkeypatch.setattr(grouped_mm, "tma_ok", lambda *a: taken.append(real(*a)) or taken[-1])
    counts, tail, D, F, act, bias, gather = TMA_CASES[name]
    dtype = torch.bfloat16 if name.startswith("bf16") else torch.float32
    check_case(make_case(counts, tail, D, F, act, bias, gather, dtype=dtype), dtype)
    if name == "unaligned-falls-back":
        assert taken and not any(taken)
    else:
        assert sum(taken) >= 3, taken  # up (or down), dact, dx all took TMA


def test_tma_allocator_is_set_on_the_launching_thread():
    """Triton keeps its allocator in a ContextVar and autograd runs the backward on its own
    thread: a setting made by the forward's thread is not seen there (the first GPU run's TMA
    backwards all raised "no allocator was set"), so every launch sets it on its own thread."""
    import threading

    from triton.runtime import _allocation

    from moe.kernels.triton import tma

    tma.ensure_allocator()
    seen = {}

    def backward_thread():
        seen["before"] = _allocation._allocator.get()
        tma.ensure_allocator()
        seen["after"] = _allocation._allocator.get()

    t = threading.Thread(target=backward_thread)
    t.start()
    t.join()
    assert seen["before"] is not tma._cuda_scratch  # the forward thread's setting is not seen
    assert seen["after"] is tma._cuda_scratch
