"""swap_ffn: replace the dense FFN blocks of any model with MoELayers, optionally upcycled."""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moe.layer import MoELayer

_ACTIVATION_MODULES = {nn.GELU: "gelu", nn.ReLU: "relu", nn.SiLU: "silu"}
_ACTIVATION_FUNCTIONS = {F.gelu: "gelu", F.relu: "relu", F.silu: "silu", torch.relu: "relu"}
# (up, down) and (gate, up, down) child names of common MLP implementations.
_TWO_LINEAR = (
    ("fc1", "fc2"),
    ("c_fc", "c_proj"),
    ("w1", "w2"),
    ("linear1", "linear2"),
    ("up_proj", "down_proj"),
    ("dense_h_to_4h", "dense_4h_to_h"),
    ("lin1", "lin2"),
)
_THREE_LINEAR = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
_ACT_NAMES = ("act", "act_fn", "activation", "activation_fn", "gelu", "relu")


@dataclass
class DenseFFN:
    """What was found: the Linears of one FFN and its activation."""

    up: nn.Linear  # d_model -> d_ff (the gate projection for swiglu)
    down: nn.Linear  # d_ff -> d_model
    activation: str
    gate_up: nn.Linear | None = None  # swiglu's second d_model -> d_ff projection


class ConversionError(ValueError):
    """A block the user asked to convert is not an FFN that swap_ffn understands."""


def _activation_name(act) -> str | None:
    if isinstance(act, nn.GELU):
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    for cls, name in _ACTIVATION_MODULES.items():
        if isinstance(act, cls):
            return name
    return _ACTIVATION_FUNCTIONS.get(act)


def _find_activation(module: nn.Module) -> str | None:
    for attr in _ACT_NAMES:
        name = _activation_name(getattr(module, attr, None))
        if name is not None:
            return name
    names = {_activation_name(c) for c in module.children()} - {None}
    return names.pop() if len(names) == 1 else None


def _is_pair(up, down) -> bool:
    return (
        isinstance(up, nn.Linear)
        and isinstance(down, nn.Linear)
        and up.in_features == down.out_features
        and up.out_features == down.in_features
    )


def match_ffn(module: nn.Module) -> DenseFFN | None:
    """Recognise Linear-act-Linear Sequentials, GPT-2/BERT style two-Linear MLPs and Llama
    style gated (SwiGLU) MLPs; None if `module` is none of these."""
    if isinstance(module, nn.Sequential) and len(module) == 3:
        up, act, down = module
        act_name = _activation_name(act)
        if _is_pair(up, down) and act_name is not None:
            return DenseFFN(up, down, act_name)
        return None
    for gate, up, down in _THREE_LINEAR:
        g, u, d = (getattr(module, n, None) for n in (gate, up, down))
        if _is_pair(g, d) and _is_pair(u, d) and _find_activation(module) == "silu":
            return DenseFFN(g, d, "swiglu", gate_up=u)
    for up, down in _TWO_LINEAR:
        u, d = getattr(module, up, None), getattr(module, down, None)
        linears = [c for c in module.children() if isinstance(c, nn.Linear)]
        if _is_pair(u, d) and len(linears) == 2:
            act_name = _find_activation(module)
            if act_name is not None:
                return DenseFFN(u, d, act_name)
    return None


def _build_layer(ffn: DenseFFN, name: str, upcycle: bool, options: dict) -> MoELayer:
    w = ffn.up.weight
    has_bias = ffn.up.bias is not None
    if ffn.gate_up is not None and has_bias:
        raise ConversionError(f"{name}: gated MLP with biases is not supported")
    if upcycle:
        options.setdefault("normalize_weights", True)  # weights sum to 1: same function
    layer = MoELayer(
        ffn.up.in_features,
        ffn.up.out_features,
        activation=ffn.activation,
        bias=has_bias,
        name=name,
        device=w.device,
        dtype=w.dtype,
        **options,
    )
    if upcycle:
        with torch.no_grad():
            ex = layer.experts
            ex.w1.copy_(ffn.up.weight.t().expand_as(ex.w1))
            ex.w2.copy_(ffn.down.weight.t().expand_as(ex.w2))
            if ffn.gate_up is not None:
                ex.w3.copy_(ffn.gate_up.weight.t().expand_as(ex.w3))
            if has_bias:
                ex.b1.copy_(ffn.up.bias.expand_as(ex.b1))
                ex.b2.copy_(ffn.down.bias.expand_as(ex.b2))
    return layer


def swap_ffn(
    model: nn.Module,
    num_experts: int = 8,
    top_k: int = 2,
    *,
    upcycle: bool = False,
    predicate: Callable[[str, nn.Module], bool] | None = None,
    verbose: bool = False,
    **options,
) -> nn.Module:
    """Replace dense FFN blocks of `model` with MoELayers, in place; returns `model`.

    Without `predicate`, every recognised FFN is converted; with it, exactly the blocks for
    which predicate(name, module) is True, and any of those that is not a recognisable FFN
    raises ConversionError. upcycle=True copies the dense weights into every expert and
    normalises the combine weights, so (dropless) the model computes the same function as
    before. The converted names are listed by moe.moe_layers(model).
    """
    found: list[tuple[str, DenseFFN]] = []
    for name, module in model.named_modules():
        if isinstance(module, MoELayer) or any(name.startswith(n + ".") for n, _ in found):
            continue
        wanted = predicate(name, module) if predicate is not None else None
        ffn = match_ffn(module) if wanted is not False else None
        if wanted and ffn is None:
            raise ConversionError(
                f"{name or type(module).__name__}: cannot convert {type(module).__name__}; "
                "expected Sequential(Linear, activation, Linear), a two-Linear MLP with an "
                "activation, or a gate/up/down SiLU MLP"
            )
        if ffn is not None and name:
            found.append((name, ffn))
    if predicate is not None and not found:
        raise ConversionError("predicate matched no module")
    if not found:
        raise ConversionError(f"no dense FFN block found in {type(model).__name__}")
    for name, ffn in found:
        layer = _build_layer(
            ffn, name, upcycle, dict(options, num_experts=num_experts, top_k=top_k)
        )
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, layer)
        if verbose:
            print(
                f"swap_ffn: {name}: {ffn.activation} FFN "
                f"{ffn.up.in_features}->{ffn.up.out_features} -> {num_experts} experts, "
                f"top-{top_k}"
            )
    return model
