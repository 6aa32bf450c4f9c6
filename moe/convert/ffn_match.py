"""Recognise dense FFN blocks (plain PyTorch and transformers' own classes) for swap_ffn.

A match says where the MoELayer goes and which modules become nn.Identity so that the
surrounding code (dropout, LayerNorm, residual) still runs exactly as before:

- "module": the whole block is replaced (Sequential(Linear, act, Linear), Llama/Mistral/Qwen2
  gated MLPs, ViT/T5 two-projection MLPs).
- "inplace": the block keeps its forward; its up projection becomes the MoELayer and its
  activation and down projection become Identity (GPT-2's MLP, whose dropout follows c_proj).
- "split": BERT/RoBERTa's FFN spread over `intermediate` (dense + act) and `output` (dense +
  dropout + LayerNorm(h + input)): `intermediate` becomes the MoELayer, `output.dense` Identity.

Activations are recognised by what they compute (a float64 probe), so transformers'
SiLUActivation, NewGELUActivation, GELUActivation, ... count like nn.SiLU / nn.GELU.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

_PROBE = torch.linspace(-6.0, 6.0, 121, dtype=torch.float64)
_CANDIDATES = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}
_FUNCTIONS = {F.gelu: "gelu", F.relu: "relu", F.silu: "silu", torch.relu: "relu"}
_BY_NAME = {
    f"transformers.activations.{cls}": name
    for cls, name in (
        ("SiLUActivation", "silu"),
        ("GELUActivation", "gelu"),
        ("NewGELUActivation", "gelu_tanh"),
        ("GELUTanh", "gelu_tanh"),
        ("FastGELUActivation", "gelu_tanh"),
    )
}
# (up, down) and (gate, up, down) child names of common MLP implementations.
_TWO = (
    ("fc1", "fc2"),
    ("c_fc", "c_proj"),
    ("w1", "w2"),
    ("wi", "wo"),
    ("linear1", "linear2"),
    ("up_proj", "down_proj"),
    ("dense_h_to_4h", "dense_4h_to_h"),
    ("lin1", "lin2"),
)
_THREE = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"), ("wi_0", "wi_1", "wo"))
_ACT_NAMES = (
    "act",
    "act_fn",
    "activation",
    "activation_fn",
    "intermediate_act_fn",
    "gelu",
    "relu",
)
# Blocks known to apply their dropout after the down projection (kept by an "inplace" swap).
_DROPOUT_AFTER = {"transformers.models.gpt2.modeling_gpt2.GPT2MLP"}


@dataclass
class DenseFFN:
    """One recognised FFN: its projections (child paths relative to the model), activation and
    how it is swapped (see the module docstring)."""

    block: str  # path the predicate saw (and the block's own name)
    kind: str  # "module" | "inplace" | "split"
    layer_path: str  # where the MoELayer goes
    up: nn.Module  # d_model -> d_ff (the gate projection for swiglu)
    down: nn.Module  # d_ff -> d_model
    activation: str
    gate_up: nn.Module | None = None  # swiglu's second d_model -> d_ff projection
    identities: list[str] = field(default_factory=list)  # paths set to nn.Identity

    @property
    def d_model(self) -> int:
        return proj_dims(self.up)[0]

    @property
    def d_ff(self) -> int:
        return proj_dims(self.up)[1]


class ConversionError(ValueError):
    """A block the user asked to convert is not an FFN that swap_ffn understands."""


def proj_dims(m) -> tuple[int, int] | None:
    """(in, out) of a Linear or of transformers' Conv1D (weight stored [in, out]); else None."""
    if isinstance(m, nn.Linear):
        return m.in_features, m.out_features
    w = getattr(m, "weight", None)
    conv1d = type(m).__name__ == "Conv1D" and isinstance(w, torch.Tensor) and w.dim() == 2
    return tuple(w.shape) if conv1d and w.shape[1] == getattr(m, "nf", -1) else None


def weight_IO(m: nn.Module) -> torch.Tensor:
    """A projection's weight as [in, out] (the experts' layout)."""
    return m.weight.t() if isinstance(m, nn.Linear) else m.weight


def activation_name(act) -> str | None:
    """The moe activation `act` computes, recognised numerically; None if none matches."""
    if not isinstance(act, nn.Module):
        try:
            return _FUNCTIONS.get(act)
        except TypeError:  # unhashable
            return None
    if next(act.children(), None) is not None or next(act.parameters(), None) is not None:
        return None
    if next(act.buffers(), None) is not None or isinstance(act, (nn.Dropout, nn.Identity)):
        return None
    for dtype, atol in ((torch.float64, 1e-6), (torch.float32, 1e-5)):
        probe = _PROBE.to(dtype)
        try:
            with torch.no_grad():
                y = act(probe)
        except Exception:  # not a function of one tensor (or not of this dtype / device)
            continue
        if not isinstance(y, torch.Tensor) or y.shape != probe.shape:
            return None
        for name, fn in _CANDIDATES.items():
            if torch.allclose(y.double(), fn(probe).double(), rtol=0.0, atol=atol):
                return name
        return None
    # the probe could not run (e.g. a device-only kernel): transformers' classes by name
    return _BY_NAME.get(f"{type(act).__module__}.{type(act).__name__}")


def _find_activation(module: nn.Module) -> str | None:
    for attr in _ACT_NAMES:
        name = activation_name(getattr(module, attr, None))
        if name is not None:
            return name
    names = {activation_name(c) for c in module.children()} - {None}
    return names.pop() if len(names) == 1 else None


def _is_pair(up, down) -> bool:
    u, d = proj_dims(up), proj_dims(down)
    return u is not None and d is not None and u == d[::-1]


def _join(prefix: str, child: str) -> str:
    return f"{prefix}.{child}" if prefix else child


def _has_dropout(module: nn.Module, projections: set[str]) -> bool:
    """True if `module` has a Dropout child with p > 0 (its place in forward matters)."""
    return any(
        isinstance(c, nn.Dropout) and c.p > 0
        for n, c in module.named_children()
        if n not in projections
    )


def match_ffn(name: str, module: nn.Module, parent: nn.Module | None = None) -> DenseFFN | None:
    """Recognise `module` (at path `name`, child of `parent`) as a dense FFN; None if it is not
    one. Raises ConversionError for an FFN that cannot be swapped without changing what the
    model computes (e.g. a dropout of unknown place, a gated MLP that is not SiLU)."""
    if isinstance(module, nn.Sequential) and len(module) == 3:
        up, act, down = module
        act_name = activation_name(act)
        if _is_pair(up, down) and act_name is not None:
            return DenseFFN(name, "module", name, up, down, act_name)
        return None
    split = _match_split(name, module, parent)
    if split is not None:
        return split
    for gate, up, down in _THREE:
        g, u, d = (getattr(module, n, None) for n in (gate, up, down))
        if _is_pair(g, d) and _is_pair(u, d):
            act_name = _find_activation(module)
            if act_name != "silu":
                raise ConversionError(
                    f"{name}: {type(module).__name__} is a gated MLP ({gate}/{up}/{down}) with "
                    f"activation {act_name or describe_activation(module)}; only SiLU gates "
                    "(swiglu experts) are supported"
                )
            if _has_dropout(module, {gate, up, down}):
                raise _dropout_error(name, module)
            return DenseFFN(name, "module", name, g, d, "swiglu", gate_up=u)
    projections = [n for n, c in module.named_children() if proj_dims(c) is not None]
    for up, down in _TWO:
        u, d = getattr(module, up, None), getattr(module, down, None)
        if not (_is_pair(u, d) and len(projections) == 2):
            continue
        act_name = _find_activation(module)
        if act_name is None:
            return None
        cls = type(module)
        known_order = f"{cls.__module__}.{cls.__name__}" in _DROPOUT_AFTER  # whatever its p
        if not known_order and not _has_dropout(module, {up, down}):
            return DenseFFN(name, "module", name, u, d, act_name)
        if not known_order:
            raise _dropout_error(name, module)
        act_child = next(n for n, c in module.named_children() if activation_name(c))
        return DenseFFN(
            name,
            "inplace",
            _join(name, up),
            u,
            d,
            act_name,
            identities=[_join(name, act_child), _join(name, down)],
        )
    return None


def _match_split(name: str, module: nn.Module, parent: nn.Module | None) -> DenseFFN | None:
    """BERT-style `intermediate` (dense + act) whose sibling `output.dense` projects back."""
    if parent is None or getattr(parent, "intermediate", None) is not module:
        return None
    up, down = (
        getattr(module, "dense", None),
        getattr(getattr(parent, "output", None), "dense", None),
    )
    projections = [c for c in module.children() if proj_dims(c) is not None]
    if not _is_pair(up, down) or len(projections) != 1:
        return None
    act_name = _find_activation(module)
    if act_name is None:
        raise ConversionError(
            f"{name}: {type(module).__name__} has no recognised activation "
            f"(found {describe_activation(module)})"
        )
    parent_name = name.rpartition(".")[0]
    return DenseFFN(
        name, "split", name, up, down, act_name, identities=[_join(parent_name, "output.dense")]
    )


def _dropout_error(name: str, module: nn.Module) -> ConversionError:
    drops = {n: c.p for n, c in module.named_children() if isinstance(c, nn.Dropout)}
    return ConversionError(
        f"{name}: {type(module).__name__} has dropout {drops} at a place in its forward that "
        "swap_ffn cannot keep; set its p to 0 (e.g. the model config's dropout rate) to convert"
    )


def describe_activation(module: nn.Module) -> str:
    seen = [f"{n}={type(c).__name__}" for n, c in module.named_children() if proj_dims(c) is None]
    return ", ".join(seen) or "no activation child"


def describe(module: nn.Module) -> str:
    """What a module holds, for error messages: its children with classes and shapes."""
    parts = []
    for n, c in module.named_children():
        dims = proj_dims(c)
        act = activation_name(c)
        extra = f"[{dims[0]}->{dims[1]}]" if dims else f"(computes {act})" if act else ""
        parts.append(f"{n}: {type(c).__name__}{extra}")
    return "found " + (", ".join(parts) if parts else "no children")
