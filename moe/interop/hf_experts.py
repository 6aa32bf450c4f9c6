"""`experts_implementation="moe"`: moe's expert kernels behind transformers' experts contract.

transformers 5 declares every family's experts with `@use_experts_implementation`
(transformers/integrations/moe.py): 3-D `gate_up_proj` (or `up_proj` when `has_gate` is False)
and `down_proj` parameters, `forward(hidden_states, top_k_index, top_k_weights)`, and layout
flags. `moe.interop.register_experts_implementation()` (an explicit call: importing moe does
not import transformers) adds `moe_experts_forward` to transformers' `ExpertsInterface` under
the name "moe", so

    moe.interop.register_experts_implementation()
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="moe")
    model.set_experts_implementation("moe")          # or on a built model

runs the experts on moe's kernels with no conversion. Every flag is honoured as transformers'
own grouped_mm path honours it:
    is_transposed      the GEMM operands are views of the stored weights (no copy)
    has_gate           False: `up_proj` and the module's `act_fn`
    is_concatenated    False (GPT-OSS interleaves gate and up): the module's own `_apply_gate`
                       splits them, as in transformers
    _apply_gate        the module's own (clamped SwiGLU, ...), called between the two GEMMs
    has_bias           `*_proj_bias` rows gathered per pair and added after each GEMM
    has_post_expert_norm  the module's `post_expert_norm` on each pair's output
    _is_expert_parallel   ids >= num_experts (EP sentinels) sort to the tail: no compute, 0
A plain SwiGLU layout (gate rows first, the default `_apply_gate` with SiLU, no bias, no post
norm) runs moe's fused expert MLP on the kernel backend="auto" picks (torch, Triton, the
CUTLASS GEMM roles); every other layout runs moe.quirks' family MLP on the torch kernel's
grouped GEMMs (moe::grouped_mm) with the module's own gate / activation, biases and post norm:
the computation a converted layer with MoEConfig.quirks runs (module_weights: the module's
tensors as moe's, views in its own layout).
"""

import torch
import torch.nn.functional as F

from moe.kernels.expert_rows import NO_ROWS_INFO
from moe.kernels.expert_weights import ExpertWeights
from moe.kernels.registry import get_kernel, resolve_kernel
from moe.quirks import Quirks, QuirkWeights, family_mlp

NAME = "moe"


def layout_flags(experts) -> dict:
    """The experts module's declared layout (the contract's flags), as data."""
    from transformers.integrations.moe import _default_apply_gate

    return dict(
        has_gate=experts.has_gate,
        is_concatenated=experts.is_concatenated,
        is_transposed=experts.is_transposed,
        has_bias=experts.has_bias,
        has_post_expert_norm=experts.has_post_expert_norm,
        default_gate=type(experts)._apply_gate is _default_apply_gate,
    )


def activation_name(act_fn) -> str | None:
    """moe's name of the module's activation, checked on values (not by class): act_fn equals
    that activation exactly on a probe spanning [-30, 30]; None when none matches (or act_fn
    is no one-argument activation, e.g. a gated module taking gate and up)."""
    probe = torch.linspace(-30.0, 30.0, 1201, dtype=torch.float64)
    try:
        got = act_fn(probe)
    except TypeError:
        return None
    candidates = {
        "silu": F.silu,
        "gelu": F.gelu,
        "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "relu": F.relu,
    }
    return next((n for n, f in candidates.items() if torch.equal(got, f(probe))), None)


def is_plain_swiglu(experts) -> bool:
    """Gate rows then up rows, SiLU on the gate (the default `_apply_gate`), no biases and no
    post-expert norm: what moe's fused expert MLP computes (activation="swiglu")."""
    flags = layout_flags(experts)
    plain = flags["has_gate"] and flags["is_concatenated"] and flags["default_gate"]
    plain = plain and not flags["has_bias"] and not flags["has_post_expert_norm"]
    return plain and activation_name(experts.act_fn) == "silu"


def module_quirks(experts) -> Quirks:
    """What the module computes between and after its GEMMs, as data (MoEConfig.quirks): its
    own `_apply_gate` (gated) or `act_fn`, interleaved or not, an up bias, a post norm, and its
    plain attributes (the scalars its function reads)."""
    cls, gated = type(experts), experts.has_gate
    public = [(k, v) for k, v in sorted(vars(experts).items()) if not k.startswith("_")]
    scalars = [(k, v) for k, v in public if k != "training"]  # (nn.Module's mode)
    return Quirks(
        experts_class=f"{cls.__module__}.{cls.__qualname__}",
        function="_apply_gate" if gated else "act_fn",
        interleaved=gated and not experts.is_concatenated,
        up_bias=gated and experts.has_bias,
        post_norm=experts.has_post_expert_norm,
        scalars=tuple(p for p in scalars if type(p[1]) in (bool, int, float, str)),
    )


def gate_up_columns(experts, F: int) -> tuple[slice, slice | None]:
    """(gate, up) columns of the up GEMM's output [..., N] in the module's order: gate ones
    first, or interleaved (g0 u0 g1 u1 ...); without a gate all F columns and None."""
    if not experts.has_gate:
        return slice(None), None
    if experts.is_concatenated:
        return slice(0, F), slice(F, 2 * F)
    return slice(0, None, 2), slice(1, None, 2)


def module_weights(experts, quirks: Quirks | None = None) -> QuirkWeights:
    """The module's tensors as moe's, views of its own (written through by copy_): w1 / w3 the
    gate / up columns, w2, b1 / b3 / b2 the biases; the module itself as the family."""
    up_EDN, down_EFD = gemm_weights(experts)
    gate, up = gate_up_columns(experts, down_EFD.shape[1])
    bias = None
    if experts.has_bias:
        bias = experts.gate_up_proj_bias if experts.has_gate else experts.up_proj_bias
    return QuirkWeights(
        w1_LDF=up_EDN[..., gate],
        w2_LFD=down_EFD,
        w3_LDF=None if up is None else up_EDN[..., up],
        b1_LF=None if bias is None else bias[:, gate],
        b2_LD=experts.down_proj_bias if experts.has_bias else None,
        b3_LF=None if bias is None or up is None else bias[:, up],
        family=experts,
        quirks=quirks,
    )


def gemm_weights(experts) -> tuple[torch.Tensor, torch.Tensor]:
    """(up [E, D, N], down [E, F, D]) as views of the stored weights, N = 2F (or F without a
    gate): the operands x @ w of moe's grouped GEMM, whatever `is_transposed` says."""
    up = experts.gate_up_proj if experts.has_gate else experts.up_proj
    down = experts.down_proj
    if experts.is_transposed:
        return up, down
    return up.transpose(1, 2), down.transpose(1, 2)


def _fused_rows(experts, kernel, x_RD, ends_E):
    """Every pair's expert output on moe's fused SwiGLU MLP (w1 / w3: the gate / up halves)."""
    up_EDN, down_EFD = gemm_weights(experts)
    F_ = down_EFD.shape[1]
    weights = ExpertWeights(w1_LDF=up_EDN[..., :F_], w2_LFD=down_EFD, w3_LDF=up_EDN[..., F_:])
    reason = kernel.refuse(x_RD, weights)
    if reason is not None:
        raise ValueError(f"experts_implementation='moe': kernel {kernel.name!r}: {reason}")
    return kernel(x_RD, ends_E, weights, activation="swiglu")


def _generic_rows(experts, x_RD, ends_E):
    """Every pair's expert output as a converted layer with MoEConfig.quirks computes it
    (moe.quirks.family_mlp on the torch kernel's moe::grouped_mm): the module's own gate /
    activation, biases and post-expert norm. EP sentinels are tail rows: exactly zero."""
    weights = module_weights(experts, module_quirks(experts))
    return family_mlp(get_kernel("torch"), x_RD, ends_E, weights, rows=NO_ROWS_INFO)


def moe_experts_forward(experts, hidden_states, top_k_index, top_k_weights):
    """The experts contract's forward on moe's kernels: pairs sorted by expert (stable), one
    grouped computation over every expert, then moe's combine (y_t = sum_j w_tj out_tj)."""
    T, K = top_k_index.shape
    E = experts.num_experts
    ids_P = top_k_index.reshape(-1)
    order_R = torch.argsort(ids_P, stable=True)  # sentinels (>= E) sort to the tail
    ends_E = torch.bincount(ids_P, minlength=E)[:E].cumsum(0).to(torch.int32)
    kernel = resolve_kernel("auto", hidden_states.device)
    dtype = (experts.down_proj).dtype
    x_RD = hidden_states[order_R // K].to(dtype)
    if is_plain_swiglu(experts):
        out_RD = _fused_rows(experts, kernel, x_RD, ends_E)
    else:
        out_RD = _generic_rows(experts, x_RD, ends_E)
    row_of_pair_P = torch.empty_like(order_R)
    row_of_pair_P[order_R] = torch.arange(len(order_R), device=order_R.device)
    weights_TK = top_k_weights.masked_fill(top_k_index >= E, 0).to(out_RD.dtype)
    y_TD = kernel.combine(out_RD, row_of_pair_P.view(T, K), weights_TK)
    return y_TD.to(hidden_states.dtype)


def register_experts_implementation() -> None:
    """Make "moe" a value of transformers' `experts_implementation` (ExpertsInterface)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(NAME, moe_experts_forward)
