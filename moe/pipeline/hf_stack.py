"""A transformers decoder LM as a stack the pipeline splits (moe.pipeline.hf_stack).

    stack = moe.pipeline.hf_stack(model)   # any transformers decoder LM, from_hf'd or not
    pipe = Pipeline(stack, mesh, PipelineConfig(split="params"), loss_fn)

The stack is an nn.Sequential of Rooted children (moe.pipeline.split) that run in order and
pass one tensor: "embed" (token ids -> the input embeddings), "layer_<i>" (one decoder layer)
and "head" (the decoder's final norm, then the output embeddings: the logits). The structure is
read from the model, not from a table of families: `model.get_decoder()` (the text decoder of
a multimodal model), its `layers`, the input / output embeddings, the one decoder child with
parameters besides them (the final norm) and the parameter-free ones (rotary embeddings).
Pipeline stages only exchange the hidden state, so each layer child takes the rest of its
layer's inputs (mask, position ids, rotary cos / sin, ...) from the decoder's own forward,
recorded once per input shape (moe.pipeline.hf_layer_inputs). Every child holds the original
modules (no copies) at their paths in the model, so a stage's parameter names are the model's
own (`model.layers.3.mlp.experts.w1`, `lm_head.weight`).

Full sequences from position 0, no padding mask, no KV cache: the training forward. Refused,
each with one ValueError naming why: tied input / output embeddings (they would sit on the first
and the last stage at once), a forward that does more between the parts than the stack carries
(hf_layer_inputs.check_split), and parameters outside the decoder (a multimodal model's vision
tower runs before the text stack, on inputs the stages do not carry) unless text_only=True.
"""

from collections import OrderedDict

import torch
from torch import nn

from moe.pipeline.hf_layer_inputs import LayerInputs, check_split
from moe.pipeline.split import Rooted


class HFStack(nn.Sequential):
    """hf_stack's result: the children, plus what an export needs to rebuild the model
    (hf_class, hf_config; converted: whether it holds from_hf layers, and hf_options: the
    from_hf keywords that rebuild them, their spare expert slots; text_only: the stack leaves
    parameters of the model out, e.g. a vision tower)."""

    hf_class: type
    hf_config: object
    converted: bool
    hf_options: dict
    text_only: bool


class Embed(Rooted):
    """Token ids [B, S] -> hidden states [B, S, d] (the model's input embeddings)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        (embed,) = self.parts
        return embed(ids)


class Layer(Rooted):
    """One decoder layer on a full sequence: its other inputs as the decoder's forward gives
    them for this shape (LayerInputs), then the layer."""

    def __init__(self, paths: dict, index: int, inputs: LayerInputs):
        super().__init__(paths)
        self.index, self.inputs = index, inputs

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        args, kwargs = self.inputs(hidden)[self.index]
        out = self.parts[0](hidden, *args, **kwargs)
        return out[0] if isinstance(out, tuple) else out


class Head(Rooted):
    """Hidden states -> logits: the decoder's final norm, then the output embeddings."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        norm, lm_head = self.parts
        return lm_head(norm(hidden))


def _refuse(model: nn.Module, why: str):
    raise ValueError(f"hf_stack: {type(model).__name__} cannot be split into stages: {why}")


def _parts(model: nn.Module):
    """(decoder, embed, norm name, lm_head, parameter-free decoder children) read from the
    model's structure."""
    get = getattr(model, "get_decoder", None)
    decoder = get() if callable(get) else None
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(getattr(decoder, "layers", None), nn.ModuleList) or lm_head is None:
        raise ValueError(
            f"hf_stack: {type(model).__name__} is not a supported causal LM (a transformers "
            "model whose get_decoder() holds a `layers` ModuleList, with output embeddings)"
        )
    embed = model.get_input_embeddings()
    if getattr(lm_head, "weight", None) is embed.weight:
        raise ValueError(
            "hf_stack: lm_head.weight is the input embeddings' weight (tie_word_embeddings): "
            "the embedding and the head sit on different pipeline stages; untie them first"
        )
    others = [(n, m) for n, m in decoder.named_children() if m is not embed and n != "layers"]
    weighted = [n for n, m in others if any(True for _ in m.parameters())]
    if len(weighted) != 1:
        _refuse(model, f"its decoder holds {weighted or 'no'} modules with parameters besides "
                "the embeddings and the layers; the stack takes one, the final norm")  # fmt: skip
    free = [m for n, m in others if n not in weighted]
    return decoder, embed, weighted[0], lm_head, free


def _outside(model: nn.Module, held: set) -> list[str]:
    """The largest modules of `model` holding parameters and none of `held` (the stack's)."""
    out: list[str] = []
    for name, p in model.named_parameters():
        if id(p) in held or any(name.startswith(o + ".") for o in out):
            continue
        parts = name.split(".")
        for n in range(1, len(parts)):
            path = ".".join(parts[:n])
            if not any(id(q) in held for q in model.get_submodule(path).parameters()):
                if path not in out:
                    out.append(path)
                break
    return out


def hf_stack(model: nn.Module, *, text_only: bool = False) -> HFStack:
    """The transformers decoder LM `model` (converted by moe.from_hf or not) as an HFStack:
    "embed", "layer_0".."layer_<L-1>", "head", holding the model's own modules at their paths
    (the model keeps them too). text_only=True: a multimodal model's text path (token ids in;
    the vision / audio towers stay out of the stages, and save_hf refuses the stack). Refused
    with one ValueError naming why: see the module docstring."""
    from moe.interop.hf import HFMoELayer
    from moe.interop.hf_contract import HFExpertsLayer

    decoder, embed, norm_name, lm_head, free = _parts(model)
    path_of = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    base = path_of[id(decoder)]
    inputs = LayerInputs(decoder, norm_name)
    norm = getattr(decoder, norm_name)
    check_split(model, decoder, embed, norm, lm_head, inputs)
    shared = {path_of[id(m)]: m for m in free}  # rotary embeddings: every layer's
    children: OrderedDict[str, nn.Module] = OrderedDict(embed=Embed({path_of[id(embed)]: embed}))
    for i, layer in enumerate(decoder.layers):
        children[f"layer_{i}"] = Layer({f"{base}.layers.{i}": layer, **shared}, i, inputs)
    children["head"] = Head({f"{base}.{norm_name}": norm, path_of[id(lm_head)]: lm_head})
    stack = HFStack(children)
    outside = _outside(model, {id(p) for p in stack.parameters()})
    if outside and not text_only:
        _refuse(model, f"parameters outside its text decoder ({', '.join(outside)}) run before "
                "or beside the text stack on inputs the stages do not carry (a vision tower "
                "on images); hf_stack(model, text_only=True) pipelines the text path alone")  # fmt: skip
    converted = [m for m in model.modules() if isinstance(m, (HFMoELayer, HFExpertsLayer))]
    stack.hf_class, stack.hf_config = type(model), model.config
    stack.converted = bool(converted)  # from_hf's options to rebuild it: the slots per layer
    stack.hf_options = (
        {"spare_slots": converted[0].num_slots - converted[0].config.num_experts}
        if converted
        else {}
    )
    stack.text_only = bool(outside)
    return stack
