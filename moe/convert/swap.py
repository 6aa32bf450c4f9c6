"""swap_ffn: replace the dense FFN blocks of any model with MoELayers, optionally upcycled."""

from collections.abc import Callable

import torch
from torch import nn

from moe.convert.ffn_match import ConversionError, DenseFFN, describe, match_ffn, weight_IO
from moe.layer import MoELayer

EXPECTED = (
    "expected Sequential(Linear, activation, Linear), a two-projection MLP with an activation "
    "(Linear or transformers' Conv1D), a gate/up/down SiLU MLP, or a BERT-style "
    "intermediate (dense + activation) whose sibling output.dense projects back"
)


def find_ffns(
    model: nn.Module, predicate: Callable[[str, nn.Module], bool] | None = None
) -> list[DenseFFN]:
    """The FFN blocks swap_ffn would convert (see swap_ffn for the predicate's meaning)."""
    modules = dict(model.named_modules())
    found: list[DenseFFN] = []
    for name, module in modules.items():
        if isinstance(module, MoELayer) or any(name.startswith(f.block + ".") for f in found):
            continue
        wanted = predicate(name, module) if predicate is not None else None
        if wanted and not name:
            raise ConversionError(
                f"predicate matched the root module ({type(module).__name__}): swap_ffn "
                "replaces blocks in place inside their parent, and the root has no parent; "
                "wrap the model (e.g. nn.Sequential(model)) or match its FFN children instead"
            )
        if wanted is False:
            continue
        parent = modules.get(name.rpartition(".")[0]) if name else None
        ffn = match_ffn(name, module, parent) if name else None
        if wanted and ffn is None:
            raise ConversionError(
                f"{name}: cannot convert {type(module).__name__} ({describe(module)}); {EXPECTED}"
            )
        if ffn is not None:
            found.append(ffn)
    if predicate is not None and not found:
        raise ConversionError(f"predicate matched no module of {type(model).__name__}")
    if not found:
        raise ConversionError(
            f"no dense FFN block found in {type(model).__name__}; {EXPECTED}. "
            "Pass predicate=lambda name, module: ... to name the blocks"
        )
    return found


def build_layer(ffn: DenseFFN, upcycle: bool, options: dict) -> MoELayer:
    """An MoELayer with the FFN's shapes, dtype and device; upcycle copies the dense weights
    into every expert."""
    w = ffn.up.weight
    has_bias = ffn.up.bias is not None
    if ffn.gate_up is not None and has_bias:
        raise ConversionError(f"{ffn.block}: gated MLP with biases is not supported")
    if (ffn.down.bias is not None) != has_bias:
        raise ConversionError(f"{ffn.block}: bias on only one of the two projections")
    layer = MoELayer(
        ffn.d_model,
        ffn.d_ff,
        activation=ffn.activation,
        bias=has_bias,
        name=ffn.block,
        device=w.device,
        dtype=w.dtype,
        **options,
    )
    if upcycle:
        with torch.no_grad():
            ex = layer.experts
            ex.w1.copy_(weight_IO(ffn.up).expand_as(ex.w1))
            ex.w2.copy_(weight_IO(ffn.down).expand_as(ex.w2))
            if ffn.gate_up is not None:
                ex.w3.copy_(weight_IO(ffn.gate_up).expand_as(ex.w3))
            if has_bias:
                ex.b1.copy_(ffn.up.bias.expand_as(ex.b1))
                ex.b2.copy_(ffn.down.bias.expand_as(ex.b2))
    return layer


def install(model: nn.Module, ffn: DenseFFN, layer: MoELayer) -> None:
    """Put `layer` at the FFN's layer_path and Identity at its other swapped paths; the layer
    remembers what it replaced (moe.save_moe_settings stores it)."""
    layer.swapped_from = {"block": ffn.block, "kind": ffn.kind}
    for path, module in [(ffn.layer_path, layer)] + [(p, nn.Identity()) for p in ffn.identities]:
        parent_name, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent_name), child, module)


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
    raises ConversionError saying what was found. Works on transformers' own dense models
    (Llama, Mistral, Qwen2, GPT-2, BERT, RoBERTa, ViT, T5): see moe.convert.ffn_match for how each is
    swapped so that dropout, LayerNorm and residuals still run as before. `options` are
    MoEConfig fields.

    upcycle=True copies the dense weights into every expert. For the model to compute the same
    function the k combine weights must sum to 1, so upcycle sets normalize_weights=True unless
    the caller passes it (passing False is an error); the value is part of each layer's
    config, which moe.save_moe_settings stores. The converted names are listed by
    moe.moe_layers(model).
    """
    if upcycle:
        if options.get("normalize_weights", True) is not True:
            raise ValueError(
                "upcycle=True needs normalize_weights=True (combine weights summing to 1 "
                "reproduce the dense output); got normalize_weights="
                f"{options['normalize_weights']!r}"
            )
        options["normalize_weights"] = True
    found = find_ffns(model, predicate)
    layers = [
        build_layer(ffn, upcycle, dict(options, num_experts=num_experts, top_k=top_k))
        for ffn in found
    ]  # every layer is built (and its config validated) before the model changes
    for ffn, layer in zip(found, layers):
        install(model, ffn, layer)
        if verbose:
            print(
                f"swap_ffn: {ffn.block} ({ffn.kind}): {ffn.activation} FFN "
                f"{ffn.d_model}->{ffn.d_ff} -> {num_experts} experts, top-{top_k}"
            )
    return model
