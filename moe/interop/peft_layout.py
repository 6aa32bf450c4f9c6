"""How PEFT (0.21, `LoraConfig(target_parameters=[...])`) stores LoRA on transformers 5's fused
3-D expert parameters, and the exact mapping to moe.lora's per-projection adapters.

PEFT's lora.ParamWrapper on a parameter W [E, out, in] (transformers' `experts.gate_up_proj`
[E, 2F, d] and `experts.down_proj` [E, d, F]; `is_transposed` False) holds, for rank r,
    lora_A.weight [E*r, in]   expert e's A_e [r, in]  = rows e*r .. e*r+r-1 (expert-major)
    lora_B.weight [out, r*E]  expert e's B_e [out, r] = columns j*E + e (expert-minor)
and adds scaling * B_e @ A_e to W[e] (scaling = lora_alpha / r, or / sqrt(r) with rslora):
each expert has its own A and B (an independent rank-r adapter per expert, as moe.lora's).
Two parameters of one module nest: the one registered first (gate_up_proj) is wrapped first,
so its keys are `experts.base_layer.lora_{A,B}.weight` and down_proj's `experts.lora_{A,B}.weight`.

moe.lora holds w1 (gate), w3 (up) [E, d, F] and w2 (down) [E, F, d] with A_w1 [E, d, r],
B_w1 [E, r, F], ... and adds scaling * A @ B in the x @ W orientation. So
    down_proj:    A_e = A_w2[e]^T [r, F],   B_e = B_w2[e]^T [d, r]                  (exact)
    gate_up_proj: PEFT has ONE A per expert for gate and up together; moe.lora one for each.
      export: rank 2r, A_e = [A_w1[e]^T; A_w3[e]^T] [2r, d], B_e = blockdiag(B_w1[e]^T,
              B_w3[e]^T) [2F, 2r], lora_alpha 2*alpha (the same scaling)            (exact)
      import: PEFT rank r -> A_w1 = A_w3 = A_e^T, B_w1 = B_e[:F]^T, B_w3 = B_e[F:]^T at rank r
              (exact); PEFT rank 2r with a block-diagonal B (what export writes) -> split back.
Everything here is plain tensor algebra on whole [E, ...] stacks (no per-expert loop).
"""

import re

import torch

GATE_UP, DOWN, ROUTER = "gate_up_proj", "down_proj", "gate.weight"
PREFIX = "base_model.model."  # PeftModel's prefix of the wrapped transformers model's keys
# <block path>.experts.[base_layer.]lora_A.weight (adapter name already stripped by PEFT)
KEY = re.compile(r"^(?P<block>.+)\.experts\.(?P<nest>(?:base_layer\.)*)lora_(?P<ab>[AB])\.weight$")


def key(block: str, nested: bool, ab: str) -> str:
    """The adapter_model.safetensors key of one factor of one block's expert parameter."""
    return f"{PREFIX}{block}.experts.{'base_layer.' if nested else ''}lora_{ab}.weight"


def model_class(model) -> type:
    """The model's transformers class: parallelize's wrappers (FSDP2's and replicate's dynamic
    subclasses, FSDPQwen3MoeForCausalLM) name their base class, not themselves."""
    return next(
        (c for c in type(model).__mro__ if c.__module__.startswith("transformers.")), type(model)
    )


SHARED = ("gate_proj", "up_proj", "down_proj")


def shared_modules(block: str, layer) -> list[tuple[str, object]]:
    """(the transformers module name, moe's nn.Linear) of each adapted shared-expert
    projection of a converted layer: Qwen2-MoE's `<block>.shared_expert.gate_proj`,
    DeepSeek-V3's `<block>.shared_experts.gate_proj`, ... (PEFT's LoRA on the nn.Linear,
    targeted as a module or as its `.weight`, with the same keys: lora_A [r, in], lora_B
    [out, r], moe.lora's shared-expert adapter as it is)."""
    from moe.interop.hf_families import FAMILIES

    shared = getattr(layer, "shared_experts", None)
    if shared is None:
        return []
    hub = FAMILIES[layer.hf_block_class.__name__].shared_name
    return [
        (f"{block}.{hub}.{n}", getattr(shared, n))
        for n in SHARED
        if hasattr(getattr(shared, n, None), "lora_A")
    ]


def module_key(module: str, ab: str) -> str:
    return f"{PREFIX}{module}.lora_{ab}.weight"


def router_key(block: str, ab: str) -> str:
    """The key of one factor of the router's LoRA (PEFT's 2-D parameter LoRA on the block's
    `gate.weight` [E, d]: lora_A [r, d], lora_B [E, r], moe.lora's router adapter as it is)."""
    return f"{PREFIX}{block}.gate.lora_{ab}.weight"


def pack_A(a_Eri: torch.Tensor) -> torch.Tensor:
    """Per-expert A [E, r, in] -> PEFT lora_A.weight [E*r, in]."""
    E, r, n = a_Eri.shape
    return a_Eri.reshape(E * r, n).contiguous()


def pack_B(b_Eor: torch.Tensor) -> torch.Tensor:
    """Per-expert B [E, out, r] -> PEFT lora_B.weight [out, r*E] (column j*E + e)."""
    E, o, r = b_Eor.shape
    return b_Eor.permute(1, 2, 0).reshape(o, r * E).contiguous()


def unpack_A(w: torch.Tensor, E: int) -> torch.Tensor:
    """PEFT lora_A.weight [E*r, in] -> per-expert A [E, r, in]."""
    return w.reshape(E, -1, w.shape[-1])


def unpack_B(w: torch.Tensor, E: int) -> torch.Tensor:
    """PEFT lora_B.weight [out, r*E] -> per-expert B [E, out, r]."""
    return w.reshape(w.shape[0], -1, E).permute(2, 0, 1)


def gate_up_to_peft(
    a1: torch.Tensor | None,
    b1: torch.Tensor | None,
    a3: torch.Tensor | None,
    b3: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """moe.lora's w1 / w3 factors (A [E, d, r], B [E, r, F]; None where not targeted) ->
    PEFT's (lora_A.weight, lora_B.weight) of gate_up_proj: rank 2r with both, r with one."""
    ref_a, ref_b = (a1, b1) if a1 is not None else (a3, b3)
    E, _, r = ref_a.shape
    F = ref_b.shape[-1]
    parts = [(a, b) for a, b in ((a1, b1), (a3, b3))]
    A_Erd = torch.cat([a.transpose(1, 2) for a, _ in parts if a is not None], dim=1)
    B_E2FR = ref_b.new_zeros(E, 2 * F, A_Erd.shape[1])
    col = 0
    for half, (_, b) in enumerate(parts):  # two halves, not experts: gate rows, then up rows
        if b is not None:
            B_E2FR[:, half * F : (half + 1) * F, col : col + r] = b.transpose(1, 2)
            col += r
    return pack_A(A_Erd), pack_B(B_E2FR)


def down_to_peft(a2: torch.Tensor, b2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """moe.lora's w2 factors (A [E, F, r], B [E, r, d]) -> PEFT's down_proj (lora_A, lora_B)."""
    return pack_A(a2.transpose(1, 2)), pack_B(b2.transpose(1, 2))


def gate_up_from_peft(
    lora_A: torch.Tensor, lora_B: torch.Tensor, E: int, F: int, rank: int, targets: set[str]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | str:
    """PEFT's gate_up_proj factors -> {"w1": (A [E, d, rank], B [E, rank, F]), "w3": ...} for
    a model whose adapters have rank `rank` on `targets`; or, when no exact mapping exists, a
    sentence saying why (the caller raises it with the file's name)."""
    A_Erd, B_E2FR = unpack_A(lora_A, E), unpack_B(lora_B, E)
    rp = A_Erd.shape[1]
    halves = {"w1": B_E2FR[:, :F], "w3": B_E2FR[:, F:]}  # gate rows, up rows
    if rp == rank:  # one shared A: each projection gets a copy
        out = {t: (A_Erd.transpose(1, 2), halves[t].transpose(1, 2)) for t in ("w1", "w3")}
    elif rp == 2 * rank and not (halves["w1"][..., rank:].any() or halves["w3"][..., :rank].any()):
        out = {  # block-diagonal B (what to_peft writes): gate uses A's first r rows, up the rest
            "w1": (A_Erd[:, :rank].transpose(1, 2), halves["w1"][..., :rank].transpose(1, 2)),
            "w3": (A_Erd[:, rank:].transpose(1, 2), halves["w3"][..., rank:].transpose(1, 2)),
        }
    else:
        return (
            f"gate_up_proj has rank {rp}, the model's expert LoRA rank {rank}: PEFT's one A per "
            f"expert for gate and up maps exactly onto moe.lora rank {rp} (LoRAConfig(rank={rp})), "
            f"or onto rank {rp // 2 or 1} only when its B is block-diagonal (as to_peft writes it)"
        )
    for t in ("w1", "w3"):
        if t not in targets:
            if out[t][1].any():
                return f"gate_up_proj adapts {t}, which the model's LoRAConfig.targets leave out"
            del out[t]
    return out


def down_from_peft(
    lora_A: torch.Tensor, lora_B: torch.Tensor, E: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor] | str:
    """PEFT's down_proj factors -> moe.lora's w2 (A [E, F, rank], B [E, rank, d]), or why not.
    A lower PEFT rank is zero-padded (exact: the extra directions add nothing)."""
    A_ErF, B_Edr = unpack_A(lora_A, E), unpack_B(lora_B, E)
    rp = A_ErF.shape[1]
    if rp > rank:
        return f"down_proj has rank {rp}, above the model's expert LoRA rank {rank}"
    pad = rank - rp
    A = torch.cat([A_ErF, A_ErF.new_zeros(E, pad, A_ErF.shape[2])], 1)
    B = torch.cat([B_Edr, B_Edr.new_zeros(E, B_Edr.shape[1], pad)], 2)
    return A.transpose(1, 2), B.transpose(1, 2)
