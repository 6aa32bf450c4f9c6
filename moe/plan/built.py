"""Parameter counts read from the model itself: a transformers config built on the meta device
(no memory, no weights), so the planner's counts equal `model.num_parameters()` for any family
transformers knows, multimodal ones with their vision / audio towers included.

    BuiltCounts.layers[i]  (dense, routed-expert) parameters of decoder block i: the experts
                           are the modules on transformers' experts contract
                           (@use_experts_implementation), everything else in the block dense
    BuiltCounts.head       the output projection (0 when tied to the input embedding)
    BuiltCounts.embedding  every other parameter: embeddings, final norm, vision tower, ...
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


def _decoder_blocks(model, n_layers: int):
    """The ModuleList of the model's decoder blocks: the largest list of n_layers modules."""
    from torch import nn

    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == n_layers]
    if not lists:
        raise ValueError(f"no list of {n_layers} decoder blocks in {type(model).__name__}")
    return max(lists, key=lambda m: _numel(m.parameters()))


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
    fields = {k: v for k, v in doc.items() if k != "model_type"}
    config = transformers.AutoConfig.for_model(model_type, **fields)
    composite = config.get_text_config() is not config
    auto = transformers.AutoModelForImageTextToText if composite else None
    auto = auto or transformers.AutoModelForCausalLM
    with torch.device("meta"):
        try:
            model = auto.from_config(config)
        except ValueError:  # no head class for this config: the bare model
            model = transformers.AutoModel.from_config(config)
    blocks = _decoder_blocks(model, config.get_text_config().num_hidden_layers)
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
