"""Ragged grouped GEMM on the torch backend (CPU, or CUDA without Triton), as torch.library
custom ops (`moe::grouped_mm`, `moe::grouped_mm_wgrad`) with fake and autograd registrations,
so torch.compile treats each as one opaque node (host reads inside cause no graph break).

Rows of `x_MK` are sorted by group; group e owns rows [offsets[e-1], offsets[e]). Rows past
offsets[-1] (dropped pairs at the tail of the buffer) come out exactly zero, and so do their
input gradients: torch._grouped_mm leaves them uninitialised. Weight gradients of empty groups
are exactly zero. Deterministic: no atomics.

Compute path: torch._grouped_mm where it runs (float32/bf16/fp16 with 16-byte aligned widths on
CPU; bf16 on Hopper+); otherwise (float64, unaligned widths) per-expert matmuls as the fallback.
"""

import torch

_DTYPES = {"cpu": (torch.float32, torch.bfloat16, torch.float16), "cuda": (torch.bfloat16,)}


def _layout_ok(t: torch.Tensor) -> bool:
    """torch._grouped_mm's operand rule (aten GroupedMMUtils.h): 16-byte aligned data, one unit
    stride in the last two dims and the other a multiple of 16 bytes."""
    if t.data_ptr() % 16:
        return False
    align = 16 // t.element_size()
    s, n = t.stride(), t.shape
    if s[-1] == 1 and s[-2] >= max(1, n[-1]):
        return s[-2] % align == 0
    if s[-2] == 1 and s[-1] >= max(1, n[-2]):
        return s[-1] % align == 0
    return False


def fits(*mats: torch.Tensor) -> bool:
    """torch._grouped_mm runs on these operands: its dtypes on the device (bf16 on sm_90+ on
    CUDA, where it is CUTLASS), and every operand's layout."""
    dev = mats[0].device
    if not hasattr(torch, "_grouped_mm") or mats[0].dtype not in _DTYPES.get(dev.type, ()):
        return False
    if dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] < 9:
        return False
    return all(_layout_ok(m) for m in mats)


def wgrad_fits(R: int, a_NK: torch.Tensor, *b_RN: torch.Tensor) -> bool:
    """The weight-gradient form (a_rows^T @ b per expert, a_rows = R rows of a or gathered from
    it) also needs the row count R 16-byte aligned."""
    return R * a_NK.element_size() % 16 == 0 and fits(a_NK.t(), *b_RN)


def zero_tail_rows(y: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """Zero rows at or past offsets_E[-1] in place (dropped pairs at the buffer's tail): the
    one tail zeroing of every kernel. On CPU (also under Triton's interpreter) the tail slice
    (reading a CPU tensor is no device sync). Elsewhere the tail length stays on the device:
    Triton's tail pass where Triton is installed (it touches only the tail's blocks), else one
    masked pass over the rows."""
    if offsets_E.numel() == 0:
        return y.zero_()
    if y.device.type == "cpu":
        y[int(offsets_E[-1]) :].zero_()
        return y
    if y.device.type == "cuda" and y.dim() == 2 and y.stride(1) == 1:
        try:
            from moe.kernels.triton.row_passes import zero_tail_blocks
        except ImportError:
            pass
        else:
            return zero_tail_blocks(y, offsets_E)
    rows = torch.arange(y.shape[0], device=y.device)
    return y.masked_fill_((rows >= offsets_E[-1]).unsqueeze(1), 0)


def _segments(offsets_E: torch.Tensor) -> list[tuple[int, int]]:
    # Fallback only (float64, unaligned widths, no _grouped_mm): reads the offsets on the host.
    ends = offsets_E.tolist()
    starts = [0] + ends[:-1]
    return list(zip(starts, ends))


def mm_groups(
    x_MK: torch.Tensor, w_EKN: torch.Tensor, offsets_E: torch.Tensor, zero_tail: bool = True
) -> torch.Tensor:
    """y[rows of e] = x[rows of e] @ w[e]; tail rows zero (with zero_tail=False they are left
    as torch._grouped_mm leaves them, for callers that never read them). Plain (no autograd):
    the body of moe::grouped_mm, also called inside moe::expert_mlp."""
    if fits(x_MK, w_EKN):
        y = torch._grouped_mm(x_MK, w_EKN, offs=offsets_E)
        return zero_tail_rows(y, offsets_E) if zero_tail else y
    y = x_MK.new_zeros(x_MK.shape[0], w_EKN.shape[2])
    for e, (s, t) in enumerate(_segments(offsets_E)):
        if t > s:
            torch.matmul(x_MK[s:t], w_EKN[e], out=y[s:t])
    return y


@torch.library.custom_op("moe::grouped_mm", mutates_args=())
def _grouped_mm_op(
    x_MK: torch.Tensor, w_EKN: torch.Tensor, offsets_E: torch.Tensor
) -> torch.Tensor:
    """y[rows of e] = x[rows of e] @ w[e]; tail rows zero."""
    return mm_groups(x_MK, w_EKN, offsets_E)


@_grouped_mm_op.register_fake
def _(x_MK, w_EKN, offsets_E):
    return x_MK.new_empty(x_MK.shape[0], w_EKN.shape[2])


def wgrad_groups(x_MK: torch.Tensor, dy_MN: torch.Tensor, offsets_E: torch.Tensor):
    """dw[e] = x[rows of e]^T @ dy[rows of e]: the ragged-reduction GEMM; empty groups give 0.
    Plain (no autograd): the body of moe::grouped_mm_wgrad."""
    num_groups = offsets_E.shape[0]
    if wgrad_fits(x_MK.shape[0], x_MK, dy_MN):
        return torch._grouped_mm(x_MK.t(), dy_MN, offs=offsets_E)
    dw = x_MK.new_empty(num_groups, x_MK.shape[1], dy_MN.shape[1])
    for e, (s, t) in enumerate(_segments(offsets_E)):
        if t > s:
            torch.matmul(x_MK[s:t].t(), dy_MN[s:t], out=dw[e])
        else:
            dw[e].zero_()
    return dw


@torch.library.custom_op("moe::grouped_mm_wgrad", mutates_args=())
def _grouped_mm_wgrad_op(
    x_MK: torch.Tensor, dy_MN: torch.Tensor, offsets_E: torch.Tensor
) -> torch.Tensor:
    """dw[e] = x[rows of e]^T @ dy[rows of e]; empty groups give 0."""
    return wgrad_groups(x_MK, dy_MN, offsets_E)


@_grouped_mm_wgrad_op.register_fake
def _(x_MK, dy_MN, offsets_E):
    return x_MK.new_empty(offsets_E.shape[0], x_MK.shape[1], dy_MN.shape[1])


def _setup_context(ctx, inputs, output):
    x_MK, w_EKN, offsets_E = inputs
    ctx.save_for_backward(x_MK, w_EKN, offsets_E)


def _backward(ctx, dy_MN):
    x_MK, w_EKN, offsets_E = ctx.saved_tensors
    dy_MN = dy_MN.contiguous()
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx = _grouped_mm_op(dy_MN, w_EKN.transpose(1, 2), offsets_E)
    if ctx.needs_input_grad[1]:
        dw = _grouped_mm_wgrad_op(x_MK, dy_MN, offsets_E)  # rows past the offsets are ignored
    return dx, dw, None


_grouped_mm_op.register_autograd(_backward, setup_context=_setup_context)


def _wgrad_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _wgrad_backward(ctx, ddw_EKN):
    """dw = x^T dy is bilinear: d x = dy @ ddw^T per group, d dy = x @ ddw per group."""
    x_MK, dy_MN, offsets_E = ctx.saved_tensors
    ddw_EKN = ddw_EKN.contiguous()
    dx = dd = None
    if ctx.needs_input_grad[0]:
        dx = _grouped_mm_op(dy_MN, ddw_EKN.transpose(1, 2), offsets_E)
    if ctx.needs_input_grad[1]:
        dd = _grouped_mm_op(x_MK, ddw_EKN, offsets_E)
    return dx, dd, None


_grouped_mm_wgrad_op.register_autograd(_wgrad_backward, setup_context=_wgrad_setup_context)


def grouped_mm_torch(
    x_MK: torch.Tensor, w_EKN: torch.Tensor, offsets_E: torch.Tensor
) -> torch.Tensor:
    """Ragged grouped GEMM, torch backend. offsets_E: int32 cumulative row ends, on x's device."""
    return _grouped_mm_op(x_MK.contiguous(), w_EKN.contiguous(), offsets_E.to(torch.int32))
