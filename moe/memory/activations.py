"""Saved activation bytes of a decoder-style transformer (a `PlannerModel`) per micro-batch,
per block and for the whole model: the activations term of moe.memory.estimate_memory, and the
per-block figure the layout planner (moe.plan) scales by the micro-batches a schedule keeps.

  activations  per micro-batch of s tokens x b sequences, hidden h, heads a, FFN width f,
               bytes for 2-byte activations (Korthikanti et al. 2022, "Reducing Activation
               Recomputation", Sec. 4.1, whose 34sbh + 5as^2b is the f = 4h, dropout case):
                 attention  10sbh + 2as^2b     (+ sbh + as^2b dropout masks)
                            flash attention: 10sbh + 4asb (fp32 log-sum-exp, no s^2 term)
                 layernorms 4sbh
                 dense FFN  2sbh + 4sbf        (+ sbh dropout mask; 6sbf gated)
                 MoE FFN    sb * [k c (4h + 4f + 16) + 8E]: the k*c routed copies of each
                            token (c = capacity factor, 1 dropless) keep their gathered
                            input, the activation's input and output and the expert output
                            for the weighted combine, plus int64 permutation indices; the
                            router keeps fp32 logits and probabilities (E experts).
                 head       s_text * b * V * 6 (logits in the activation dtype + fp32
                            log-softmax for the loss)
               scaled by b/2 for other activation dtypes. checkpointing keeps only each
               block's input (2sbh) and recomputes one block at a time in backward:
               L * 2sbh + the largest block + head.
"""

from moe.memory.model_counts import PlannerModel, optional
from moe.names import GATED_ACTIVATIONS


def block_activation_bytes(
    cfg: PlannerModel,
    tokens: int,
    moe: bool,
    act_bytes: int,
    flash_attention: bool,
    dropout: bool,
    fused_experts: bool = False,
) -> float:
    """Saved activations of one transformer block for `tokens` = s * b (formula above).
    fused_experts: the local torch path (moe::expert_mlp with the combine folded in) keeps only
    the layer input and each pair's pre-activation, no [pairs, h] rows."""
    s, h, a, f = cfg.seq_len, cfg.d_model, cfg.n_heads, cfg.d_ff
    sb = tokens
    b = tokens / s
    gated = optional(cfg, "activation") in GATED_ACTIVATIONS
    attn = 10 * sb * h + (4 * a * sb if flash_attention else 2 * a * s * s * b)
    if dropout:
        attn += sb * h + (0 if flash_attention else a * s * s * b)
    ln = 4 * sb * h
    if moe:
        k = cfg.top_k
        c = cfg.capacity_factor or 1.0
        if fused_experts:
            ffn = sb * (2 * h + k * c * ((4 if gated else 2) * f + 16) + 8 * cfg.num_experts)
        else:
            ffn = sb * (k * c * (4 * h + (6 if gated else 4) * f + 16) + 8 * cfg.num_experts)
    else:
        ffn = 2 * sb * h + (6 if gated else 4) * sb * f + (sb * h if dropout else 0)
    return (attn + ln + ffn) * act_bytes / 2


def activation_bytes(
    cfg: PlannerModel,
    tokens: int,
    act_bytes: int = 2,
    checkpointing: bool = False,
    flash_attention: bool = False,
    dropout: bool = False,
    fused_experts: bool = False,
) -> int:
    """Peak saved activations of the whole model for one micro-batch of `tokens` tokens
    (fused_experts: see block_activation_bytes)."""
    every = optional(cfg, "moe_every")
    blocks = [
        block_activation_bytes(
            cfg,
            tokens,
            cfg.num_experts > 0 and (i + 1) % every == 0,
            act_bytes,
            flash_attention,
            dropout,
            fused_experts,
        )
        for i in range(cfg.n_layers)
    ]
    text = optional(cfg, "text_len")
    head = tokens * text / cfg.seq_len * cfg.vocab_size * (act_bytes + 4)
    if checkpointing:
        return int(cfg.n_layers * tokens * cfg.d_model * act_bytes + max(blocks) + head)
    return int(sum(blocks) + head)
