"""PEFT adapters of layers converted through transformers' experts contract (HFExpertsLayer):
which of the experts module's own 3-D parameters moe.lora's adapters map onto, read from the
module (its template), never from a per-family table.

    gate_up_proj  (has_gate)      w1 (gate rows) and w3 (up rows): one PEFT A per expert, exported
                                  at rank 2r with a block-diagonal B (peft_layout.gate_up_to_peft);
                                  is_concatenated=False (gate / up interleaved, as GPT-OSS) puts
                                  the rows in the module's own order
    up_proj       (no gate)       w1
    down_proj                     w2
PEFT's ParamWrapper reads the module's `is_transposed`, so its lora_A [E*r, in] / lora_B
[out, r*E] are the same in either storage orientation. Two targeted parameters of one module
nest in the order the module registers them (PEFT walks named_parameters(recurse=False)): the
first is wrapped first, so its keys carry one more `base_layer.`. The family's router, shared
experts and dense MLPs stay its own modules and are not adapted by moe.lora.
"""

import torch

from moe.interop import peft_layout as L
from moe.interop.hf_contract import HFExpertsLayer, gate_up_columns

UP = "up_proj"
PROJECTIONS = {L.GATE_UP: ("w1", "w3"), UP: ("w1",), L.DOWN: ("w2",)}  # parameter -> moe.lora's


def adapted(layer: HFExpertsLayer, targets) -> list[str]:
    """The experts module's parameters that moe.lora targets `targets` reach, in the order the
    module registers them (the order PEFT nests its wrappers in)."""
    names = [n for n, _ in layer.hf_template[0].named_parameters(recurse=False)]
    return [n for n in names if set(PROJECTIONS.get(n, ())) & set(targets)]


def key(path: str, params: list[str], param: str, ab: str) -> str:
    """adapter_model.safetensors key of one factor of `param`, one of the module's targeted
    `params` (registration order)."""
    nest = "base_layer." * (len(params) - 1 - params.index(param))
    return f"{L.PREFIX}{path}.{nest}lora_{ab}.weight"


def fused_order(layer: HFExpertsLayer) -> torch.Tensor | None:
    """gate_up_proj's output rows in gate-then-up order (index j: the module's row holding
    gate row j, then up row j - F; hf_contract.gate_up_columns); None when the module stores
    them so already."""
    template = layer.hf_template[0]
    if not template.has_gate:
        return None
    rows = torch.arange(2 * layer.config.d_ff)
    gate, up = gate_up_columns(template, layer.config.d_ff)
    order = torch.cat([rows[gate], rows[up]])
    return None if torch.equal(order, rows) else order


def export(path: str, layer: HFExpertsLayer, factors: dict) -> dict[str, dict]:
    """full parameter name -> {adapter key: tensor} for the layer's adapters (`factors`: target
    -> (A [E, in, r], B [E, r, out]) in canonical expert order)."""
    params = adapted(layer, factors)
    out = {}
    for p in params:
        if p == L.GATE_UP:
            a, b = L.gate_up_to_peft(
                *factors.get("w1", (None, None)), *factors.get("w3", (None, None))
            )
            order = fused_order(layer)
            if order is not None:
                b = torch.empty_like(b).index_copy_(0, order.to(b.device), b)
        else:
            a, b = L.down_to_peft(*factors[PROJECTIONS[p][0]])  # one projection: as down_proj
        out[f"{path}.{p}"] = {key(path, params, p, "A"): a, key(path, params, p, "B"): b}
    return out


def check_base(base_model, path: str, layer: HFExpertsLayer) -> None:
    """The base transformers model's experts module at `path` has the converted module's
    parameters and shapes (else: an adapter for another model, one ValueError)."""
    template = layer.hf_template[0]
    want = {n: tuple(p.shape) for n, p in template.named_parameters(recurse=False)}
    try:
        module = base_model.get_submodule(path)
    except AttributeError:
        module = None
    got = {n: tuple(p.shape) for n, p in module.named_parameters(recurse=False)} if module else {}
    if got != want:
        raise ValueError(
            f"to_peft: the base model's {path} holds {got or 'no experts module'}, the converted "
            f"model's {want} (an adapter for another model)"
        )


def check_renamings(model, keys) -> None:
    """PEFT (0.22) applies the model's transformers v4 -> v5 checkpoint renamings to an adapter's
    keys when it loads them; where one of them renames a key this writes (Mistral-Large-4's
    `.experts.` -> `.mlp.experts.`), PEFT would silently load nothing there (PEFT's own saved
    adapters of the model too): one ValueError instead, naming the key and its renaming."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, apply_renamings
    except ImportError:  # a transformers without checkpoint conversions: nothing is renamed
        return
    renamings = [r for r in get_model_conversion_mapping(model) if isinstance(r, WeightRenaming)]
    for k in keys:
        name = k.removeprefix(L.PREFIX)
        renamed = apply_renamings(name, renamings)
        if renamed != name:
            raise ValueError(
                f"to_peft: {type(model).__name__}'s transformers checkpoint conversion renames "
                f"{name} to {renamed} when PEFT loads an adapter, so PEFT would not load it "
                "(its own saved adapters of this model neither); merge the adapters "
                "(moe.lora.merge) and export with moe.to_hf instead"
            )
