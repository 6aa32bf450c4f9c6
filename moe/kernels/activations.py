"""Expert activations shared by every backend (the torch path and the Triton epilogues)."""

import torch
import torch.nn.functional as F

from moe.names import ACTIVATIONS, GATED_ACTIVATIONS

GATED = GATED_ACTIVATIONS  # the name the kernels use


def check_activation(name: str) -> None:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation={name!r} is not supported; choose one of {ACTIVATIONS}")


def apply_activation(h: torch.Tensor, name: str, gate: torch.Tensor | None = None) -> torch.Tensor:
    """act(h); for swiglu `h` is the w1 projection and `gate` the w3 projection: silu(h) * gate."""
    if name == "gelu":
        return F.gelu(h)
    if name == "gelu_tanh":
        return F.gelu(h, approximate="tanh")
    if name == "relu":
        return F.relu(h)
    if name == "silu":
        return F.silu(h)
    if name == "swiglu":
        return F.silu(h) * gate
    raise ValueError(f"activation={name!r} is not supported; choose one of {ACTIVATIONS}")


def activation_backward(
    da: torch.Tensor, h: torch.Tensor, name: str, gate: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dh, dgate) of a = apply_activation(h, name, gate), given da; dgate is None unless
    gated. Uses the same aten derivative kernels autograd would."""
    aten = torch.ops.aten
    if name == "gelu":
        return aten.gelu_backward(da, h), None
    if name == "gelu_tanh":
        return aten.gelu_backward(da, h, approximate="tanh"), None
    if name == "relu":
        return aten.threshold_backward(da, h, 0), None
    if name == "silu":
        return aten.silu_backward(da, h), None
    if name == "swiglu":
        return aten.silu_backward(da * gate, h), da * F.silu(h)
    raise ValueError(f"activation={name!r} is not supported; choose one of {ACTIVATIONS}")


def activation_backward_(
    da: torch.Tensor,
    h: torch.Tensor,
    name: str,
    gate: torch.Tensor | None = None,
    silu_h: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """activation_backward without new buffers: dh is written into da's buffer and, for
    swiglu, dgate into silu_h's (silu(h), which the caller computed for the activation and
    no longer needs). Same kernels, same bits as activation_backward; two passes per output."""
    aten = torch.ops.aten
    if name == "swiglu":
        dgate = silu_h.mul_(da) if silu_h is not None else da * F.silu(h)
        aten.silu_backward.grad_input(da.mul_(gate), h, grad_input=da)
        return da, dgate
    if name in ("gelu", "gelu_tanh"):
        approximate = "tanh" if name == "gelu_tanh" else "none"
        return aten.gelu_backward.grad_input(da, h, approximate=approximate, grad_input=da), None
    if name == "relu":
        return aten.threshold_backward.grad_input(da, h, 0, grad_input=da), None
    if name == "silu":
        return aten.silu_backward.grad_input(da, h, grad_input=da), None
    raise ValueError(f"activation={name!r} is not supported; choose one of {ACTIVATIONS}")
