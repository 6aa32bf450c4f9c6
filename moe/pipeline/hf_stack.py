"""A transformers causal-LM decoder as a stack the pipeline splits (moe.pipeline.hf_stack).

    stack = moe.pipeline.hf_stack(model)   # model: e.g. Qwen3MoeForCausalLM, from_hf'd or not
    pipe = Pipeline(stack, mesh, PipelineConfig(split="params"), loss_fn)

The stack is an nn.Sequential of Rooted children (moe.pipeline.split) that run in order and
pass one tensor: "embed" (token ids -> model.embed_tokens), "layer_<i>" (one decoder layer)
and "head" (model.norm, then lm_head: the logits). Pipeline stages only exchange the hidden
state, so each layer child computes the position ids, rotary embeddings (the model's own
rotary module) and causal mask (the modeling file's own mask functions, chosen as the model's
forward chooses them) from the hidden state's shape, then calls the original decoder layer.
Every child holds the original modules (no copies) at their paths in the model, so a
stage's parameter names are the model's own (`model.layers.3.mlp.experts.w1`, `lm_head.weight`).

Full sequences from position 0, no padding mask, no KV cache: the training forward.
"""

import sys
from collections import OrderedDict

import torch
from torch import nn

from moe.pipeline.split import Rooted

# How each family's decoder forward picks a layer's mask (read from transformers 5's modeling
# files): "window" a sliding-window mask when config.sliding_window is set, else causal;
# "types" by config.layer_types[i]; "causal" always causal.
MASKS = {
    "MixtralModel": "window",
    "Qwen3MoeModel": "window",
    "Qwen2MoeModel": "types",
    "OlmoeModel": "causal",
    "DeepseekV3Model": "causal",
}


class HFStack(nn.Sequential):
    """hf_stack's result: the children, plus what an export needs to rebuild the model
    (hf_class, hf_config; converted: whether it holds from_hf layers, and hf_options: the
    from_hf keywords that rebuild them, their spare expert slots)."""

    hf_class: type
    hf_config: object
    converted: bool
    hf_options: dict


class Embed(Rooted):
    """Token ids [B, S] -> hidden states [B, S, d] (model.embed_tokens)."""

    def __init__(self, base_path: str, embed: nn.Module):
        super().__init__({f"{base_path}.embed_tokens": embed})

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        (embed,) = self.parts
        return embed(ids)


class Layer(Rooted):
    """One decoder layer on a full sequence: positions 0..S-1, the model's rotary embedding
    and causal mask for this layer, computed from the hidden state."""

    def __init__(self, base_path, index, layer, rotary, config, mask_fn):
        super().__init__({f"{base_path}.layers.{index}": layer, f"{base_path}.rotary_emb": rotary})
        self.config, self.mask_fn = config, mask_fn

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        layer, rotary = self.parts
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = self.mask_fn(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=None,
            cache=None,
            position_ids=position_ids,
        )
        out = layer(
            hidden,
            attention_mask=mask,
            position_ids=position_ids,
            cache=None,
            use_cache=False,
            position_embeddings=rotary(hidden, position_ids),
        )
        return out[0] if isinstance(out, tuple) else out


class Head(Rooted):
    """Hidden states -> logits: the model's final norm, then lm_head."""

    def __init__(self, base_path: str, norm: nn.Module, lm_head: nn.Module):
        super().__init__({f"{base_path}.norm": norm, "lm_head": lm_head})

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        norm, lm_head = self.parts
        return lm_head(norm(hidden))


def _mask_fns(base: nn.Module, config) -> list:
    """Each decoder layer's mask function, as the model's forward picks it, taken from the
    model's own modeling module."""
    name = type(base).__name__
    modeling = sys.modules[type(base).__module__]
    causal = modeling.create_causal_mask
    layers = config.num_hidden_layers
    if MASKS[name] == "causal":
        return [causal] * layers
    window = modeling.create_sliding_window_causal_mask
    if MASKS[name] == "window":
        return [causal if config.sliding_window is None else window] * layers
    by_type = {"full_attention": causal, "sliding_attention": window}
    return [by_type[config.layer_types[i]] for i in range(layers)]


def hf_stack(model: nn.Module) -> HFStack:
    """The transformers causal LM `model` (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3;
    converted by moe.from_hf or not) as an HFStack: "embed", "layer_0".."layer_<L-1>", "head",
    holding the model's own modules at their paths (the model keeps them too). Refused with a
    ValueError: another architecture, and tied input / output embeddings (they would sit on the
    first and the last stage at once)."""
    from moe.interop.hf import HFMoELayer

    base, lm_head = getattr(model, "model", None), getattr(model, "lm_head", None)
    if base is None or lm_head is None or type(base).__name__ not in MASKS:
        raise ValueError(
            f"hf_stack: {type(model).__name__} is not a supported causal LM (a .model of one of "
            f"{sorted(MASKS)} and an .lm_head)"
        )
    config = base.config
    embed = base.embed_tokens
    if getattr(lm_head, "weight", None) is embed.weight:
        raise ValueError(
            "hf_stack: lm_head.weight is model.embed_tokens.weight (tie_word_embeddings): the "
            "embedding and the head sit on different pipeline stages; untie them first"
        )
    layers = list(base.layers[: config.num_hidden_layers])
    children: OrderedDict[str, nn.Module] = OrderedDict(embed=Embed("model", embed))
    for i, (layer, mask_fn) in enumerate(zip(layers, _mask_fns(base, config))):
        children[f"layer_{i}"] = Layer("model", i, layer, base.rotary_emb, config, mask_fn)
    children["head"] = Head("model", base.norm, lm_head)
    stack = HFStack(children)
    converted = [m for m in model.modules() if isinstance(m, HFMoELayer)]
    stack.hf_class, stack.hf_config = type(model), model.config
    stack.converted = bool(converted)  # from_hf's options to rebuild it: the slots per layer
    stack.hf_options = (
        {"spare_slots": converted[0].num_slots - converted[0].config.num_experts}
        if converted
        else {}
    )
    return stack
