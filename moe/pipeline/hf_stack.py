"""A transformers decoder LM as a stack the pipeline splits (moe.pipeline.hf_stack).

    stack = moe.pipeline.hf_stack(model)   # any transformers decoder LM, from_hf'd or not
    pipe = Pipeline(stack, mesh, PipelineConfig(split="params"), loss_fn)

The stack is an nn.Sequential of Rooted children (moe.pipeline.split) that run in order and
pass one tensor: "embed" (token ids -> the first layer's input), "layer_<i>" (one decoder layer)
and "head" (the last layer's output -> the logits). Nothing is taken from a table of families:
`model.get_decoder()` (the text decoder of a multimodal model) gives the layers, and each child
runs the model's own forward around them (moe.pipeline.hf_layer_inputs.ModelRunner): "embed" up
to the first layer (embeddings, their scale), "head" after the last one (final norm, lm_head,
a logit scale or cap), and each layer child its layer's other inputs (mask, position ids, rotary
cos / sin, ...) as the decoder computes them for that shape. The modules each part runs, read
when the stack is built, are the children's: they hold the original modules (no copies) at
their paths in the model, so a stage's parameter names are the model's own
(`model.layers.3.mlp.experts.w1`, `lm_head.weight`).

Full sequences from position 0, no padding mask, no KV cache: the training forward. Refused,
each with one ValueError naming why: tied input / output embeddings (they would sit on the first
and the last stage at once), a forward that does more between the layers than the stack
carries (hf_layer_inputs.probe), and parameters outside what the stack runs (a multimodal
model's vision tower runs before the text stack, on inputs the stages do not carry) unless
text_only=True.
"""

from collections import OrderedDict

import torch
from torch import nn

from moe.pipeline.hf_layer_inputs import ModelRunner, probe
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
    """Token ids [B, S] -> the first layer's input: the model's forward up to its first layer."""

    def __init__(self, paths: dict, runner: ModelRunner):
        super().__init__(paths)
        self.runner = runner

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.runner.embed(ids)


class Layer(Rooted):
    """One decoder layer on a full sequence: its other inputs as the decoder's forward gives
    them for this shape (ModelRunner.layer_inputs), then the layer."""

    def __init__(self, paths: dict, index: int, runner: ModelRunner, dtype: torch.dtype):
        super().__init__(paths)
        self.index, self.runner, self.dtype = index, runner, dtype

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        args, kwargs = self.runner.layer_inputs(hidden, self.dtype)[self.index]
        out = self.parts[0](hidden, *args, **kwargs)
        return out[0] if isinstance(out, tuple) else out


class Head(Rooted):
    """The last layer's output -> logits: what the model's forward does after its last layer
    (final norm, lm_head, a logit scale or cap, ...)."""

    def __init__(self, paths: dict, runner: ModelRunner, dtype: torch.dtype):
        super().__init__(paths)
        self.runner, self.dtype = runner, dtype

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.runner.head(hidden, self.dtype)


def _refuse(model: nn.Module, why: str):
    raise ValueError(f"hf_stack: {type(model).__name__} cannot be split into stages: {why}")


def _parts(model: nn.Module):
    """(decoder, input embeddings) read from the model's structure."""
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
    return decoder, embed


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

    decoder, embed = _parts(model)
    path_of = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    base = path_of[id(decoder)]
    runner = ModelRunner(model, decoder, embed)
    ran = probe(model, runner, embed)

    def owning(modules, params: bool) -> dict:
        """path -> module of those holding parameters (params) or only buffers themselves."""
        out = {}
        for m in modules:
            own = any(True for _ in m.parameters(recurse=False))
            keep = own if params else not own and any(True for _ in m.buffers(recurse=False))
            path = path_of.get(id(m))
            if keep and path is not None and not f"{base}.".startswith(f"{path}."):
                out[path] = m  # (a module holding the decoder: its own tensors stay out)
        # a module inside another kept one (Inkling's embedding norm) is the outer one's
        return {p: m for p, m in out.items() if not any(p.startswith(f"{q}.") for q in out)}

    shared = owning(ran["before"] + ran["after"], params=False)  # rotary embeddings, ...
    front, back = owning(ran["before"], params=True), owning(ran["after"], params=True)
    both = sorted(set(front) & set(back))
    if both:
        _refuse(model, f"its forward runs {both} both before and after its layers")
    inside = sorted(p for p in {**front, **back, **shared} if p.startswith(f"{base}.layers."))
    if inside:
        _refuse(model, f"its forward runs {inside[0]} (a decoder layer's) outside the layers")
    dtype = ran["dtype"]
    children: OrderedDict[str, nn.Module] = OrderedDict(embed=Embed({**front, **shared}, runner))
    for i, layer in enumerate(decoder.layers):
        paths = {f"{base}.layers.{i}": layer, **shared}
        children[f"layer_{i}"] = Layer(paths, i, runner, dtype)
    children["head"] = Head({**back, **shared}, runner, dtype)
    stack = HFStack(children)
    outside = _outside(model, {id(p) for p in stack.parameters()})
    if outside and not text_only:
        _refuse(model, f"parameters outside what the stack runs ({', '.join(outside)}) run before "
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
