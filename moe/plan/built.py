"""Parameter counts read from the model itself: a transformers config built on the meta device
(no memory, no weights), so the planner's counts equal `model.num_parameters()` for any family
transformers knows, multimodal ones with their vision / audio towers included.

    BuiltCounts.layers[i]  (dense, routed-expert) parameters of decoder block i: the experts
                           are the modules on transformers' experts contract
                           (@use_experts_implementation), everything else in the block dense
    BuiltCounts.head       the output projection (0 when tied to the input embedding)
    BuiltCounts.embedding  every other parameter: embeddings, final norm, vision tower (its
                           experts too, Dots3-Note's: dense to the planner), ...
A config transformers cannot build (an unknown model_type, transformers not installed) is one
ValueError naming why: the planner never falls back to an estimate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class BuiltCounts:
    layers: tuple[tuple[int, int], ...]
    embedding: int
    head: int
    total: int  # the model's num_parameters()


def _numel(params) -> int:
    return sum(p.numel() for p in {id(p): p for p in params}.values())


def _decoder_blocks(model, where: str):
    """The ModuleList of the model's decoder blocks: the outermost list holding experts in its
    text decoder (a vision tower's blocks, with or without experts, are not: Unlimited-OCR's,
    Dots3-Note's; LongCat-Flash's blocks are two layers each)."""
    from torch import nn

    def has_experts(m) -> bool:
        return any(hasattr(b, "_is_expert_parallel") for b in m.modules())

    decoder = model.get_decoder()
    lists = [m for m in decoder.modules() if isinstance(m, nn.ModuleList) and has_experts(m)]
    inner = {id(b) for m in lists for b in m.modules() if b is not m}
    outermost = [m for m in lists if id(m) not in inner]
    if len(outermost) != 1:
        raise ValueError(
            f"{where}: {len(outermost)} lists of decoder blocks hold experts in "
            f"{type(decoder).__name__} (the planner plans a decoder of one list of blocks with "
            "experts); its parameters are not counted"
        )
    return outermost[0]


def _model_class(config, architectures):
    """The class a config.json's model is: the one its `architectures` names (transformers
    writes it; a class of this config's), else the auto causal-LM (image-text-to-text for a
    composite config) class, else its family's only *ForCausalLM / *ForConditionalGeneration
    class (Mistral4's is not in the auto map); never the bare model, which lacks the head."""
    import importlib

    import transformers
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    def ours(cls) -> bool:
        base = transformers.PreTrainedModel
        return isinstance(cls, type) and issubclass(cls, base) and cls.config_class is type(config)

    if isinstance(architectures, list) and architectures and isinstance(architectures[0], str):
        cls = getattr(transformers, architectures[0], None)
        if ours(cls):
            return cls
    composite = config.get_text_config() is not config
    auto = transformers.AutoModelForImageTextToText if composite else None
    mapping = (auto or transformers.AutoModelForCausalLM)._model_mapping
    if type(config) in mapping:
        return mapping[type(config)]
    name = model_type_to_module_name(config.model_type)
    module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    heads = [
        cls
        for n, cls in vars(module).items()
        if n.endswith(("ForCausalLM", "ForConditionalGeneration")) and ours(cls)
    ]
    if len(heads) != 1:
        raise ValueError(
            f"{len(heads)} causal-LM or conditional-generation classes for {config.model_type}: "
            "name the model's class in the config's architectures"
        )
    return heads[0]


def build_config(doc: dict):
    """The transformers config a config.json's fields describe (completed with its defaults)."""
    from transformers import AutoConfig

    fields = {k: v for k, v in doc.items() if k != "model_type"}
    return AutoConfig.for_model(doc["model_type"], **fields)


def count_params(doc: dict, where: str) -> BuiltCounts:
    """The counts of the model a config.json describes (see the module docstring)."""
    return _count(json.dumps(doc, sort_keys=True), where)


@lru_cache(maxsize=32)
def _count(text: str, where: str) -> BuiltCounts:
    try:
        import torch
        import transformers
    except ImportError:
        raise ValueError(
            f"{where}: counting a config's parameters builds it with transformers (the hf "
            "extra), which is not installed"
        ) from None
    doc = json.loads(text)
    model_type = doc.get("model_type")
    if model_type not in transformers.CONFIG_MAPPING:
        raise ValueError(
            f"{where}: model_type {model_type!r} is not a transformers model type here "
            f"(transformers {transformers.__version__}); its parameters cannot be counted"
        )
    try:  # transformers' own validation of the config (a strict dataclass error, a ValueError)
        config = build_config(doc)
        cls = _model_class(config, doc.get("architectures"))
        with torch.device("meta"):
            model = cls(config)
    except Exception as e:  # on one line: strict dataclass errors span several
        why = " ".join(str(e).split())
        raise ValueError(
            f"{where}: transformers {transformers.__version__} cannot build this {model_type} "
            f"config, so its parameters cannot be counted ({type(e).__name__}: {why})"
        ) from None
    blocks = _decoder_blocks(model, where)
    layers = []
    for block in blocks:
        experts = [m for m in block.modules() if hasattr(m, "_is_expert_parallel")]
        routed = _numel(p for m in experts for p in m.parameters())
        layers.append((_numel(block.parameters()) - routed, routed))
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    head = 0
    if out is not None and (inp is None or out.weight is not inp.weight):
        head = _numel(out.parameters())
    total = model.num_parameters()
    embedding = total - head - sum(d + e for d, e in layers)
    return BuiltCounts(tuple(layers), embedding, head, total)
