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
CUTLASS GEMM roles); every other layout runs moe's grouped GEMM op (moe::grouped_mm) twice with
the module's own activation between them.
"""

import torch
import torch.nn.functional as F

from moe.kernels.expert_weights import ExpertWeights
from moe.kernels.registry import resolve_kernel
from moe.kernels.torch_grouped_mm import grouped_mm_torch

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


def _generic_rows(experts, x_RD, ends_E, ids_R):
    """Every pair's expert output: moe's grouped GEMM op (moe::grouped_mm), the module's own
    gate / activation, the GEMM again, biases and the post-expert norm as the module declares
    them."""
    up_EDN, down_EFD = gemm_weights(experts)
    ids_R = ids_R.clamp(max=experts.num_experts - 1)  # EP sentinels: tail rows, weight 0
    h_RN = grouped_mm_torch(x_RD, up_EDN, ends_E)
    if experts.has_bias:
        bias = experts.gate_up_proj_bias if experts.has_gate else experts.up_proj_bias
        h_RN = h_RN + bias[ids_R]
    h_RF = experts._apply_gate(h_RN) if experts.has_gate else experts.act_fn(h_RN)
    out_RD = grouped_mm_torch(h_RF, down_EFD, ends_E)
    if experts.has_bias:
        out_RD = out_RD + experts.down_proj_bias[ids_R]
    if experts.has_post_expert_norm:
        out_RD = experts.post_expert_norm(out_RD)
    return out_RD


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
        out_RD = _generic_rows(experts, x_RD, ends_E, ids_P[order_R])
    row_of_pair_P = torch.empty_like(order_R)
    row_of_pair_P[order_R] = torch.arange(len(order_R), device=order_R.device)
    weights_TK = top_k_weights.masked_fill(top_k_index >= E, 0).to(out_RD.dtype)
    y_TD = kernel.combine(out_RD, row_of_pair_P.view(T, K), weights_TK)
    return y_TD.to(hidden_states.dtype)


def register_experts_implementation() -> None:
    """Make "moe" a value of transformers' `experts_implementation` (ExpertsInterface)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(NAME, moe_experts_forward)
