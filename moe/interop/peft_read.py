"""from_peft: a PEFT adapter trained with transformers + PEFT (LoraConfig(target_parameters=
[".../experts.gate_up_proj", ".../experts.down_proj"])) read into a model converted by
moe.from_hf and adapted by moe.lora.add_lora, so that it computes what the PeftModel computes
(the table's blocks, and layers converted through the experts contract: peft_contract.py).

Checked before any tensor is read or any weight changes: adapter_config.json (peft_files), the
model class it names, every target_parameters entry matching an expert parameter of the
model's MoE layers, the file holding exactly the keys those targets give, and each key's shape
against the layer (expert count, widths, rank). The mapping (peft_layout) is exact; where
PEFT's scaling differs from the model's alpha / rank, B is multiplied by their ratio. The
model's adapted projections the adapter does not adapt get B = 0 (they add nothing, as in the
PeftModel).
"""

import torch
from torch import nn

from moe.interop import peft_contract as C
from moe.interop import peft_layout as L
from moe.interop.hf import HFMoELayer
from moe.interop.hf_contract import HFExpertsLayer
from moe.interop.peft_files import (
    WEIGHTS,
    AdapterConfig,
    PeftAdapterError,
    read_config,
    read_headers,
)

PARAMS = (L.GATE_UP, L.DOWN)


def _layers(model: nn.Module) -> dict[str, HFMoELayer]:
    layers = {n: m for n, m in model.named_modules() if isinstance(m, (HFMoELayer, HFExpertsLayer))}
    if not any(getattr(m.config, "lora", None) is not None for m in layers.values()):
        raise PeftAdapterError(
            f"from_peft: {type(model).__name__} has no MoE layer with expert LoRA: convert it "
            "with moe.from_hf(model), then moe.lora.add_lora(model, LoRAConfig(...)) "
            "(moe.interop.peft_lora_config(folder) gives the LoRAConfig the adapter needs)"
        )
    return layers


def _matches(name: str, targets: tuple[str, ...]) -> bool:
    """PEFT's rule for target_parameters: the full name, or a tail after a dot."""
    return any(name == t or name.endswith(f".{t}") for t in targets)


def _plan(model, folder: str, cfg: AdapterConfig, headers: dict) -> dict:
    """(layer path, param) -> (full parameter name, A key, B key), every check done."""
    where = f"{folder}/{WEIGHTS}"
    name = L.model_class(model).__name__
    if cfg.base_model_class not in (None, name):
        raise PeftAdapterError(
            f"{folder}: the adapter is for a {cfg.base_model_class}, the model is a {name}"
        )
    layers = _layers(model)
    plan, hit = {}, set()
    for path in layers:
        if isinstance(layers[path], HFExpertsLayer):  # the experts module's own parameters
            hit |= _plan_contract(plan, path, layers[path], cfg)
            continue
        wanted = [p for p in PARAMS if _matches(f"{path}.experts.{p}", cfg.target_parameters)]
        hit |= {t for p in wanted for t in cfg.target_parameters
                if _matches(f"{path}.experts.{p}", (t,))}  # fmt: skip
        for p in wanted:
            nested = p == L.GATE_UP and L.DOWN in wanted
            plan[path, p] = (
                f"{path}.experts.{p}",
                L.key(path, nested, "A"),
                L.key(path, nested, "B"),
            )
        router = f"{path}.{L.ROUTER}"
        if _matches(router, cfg.target_parameters):
            hit |= {t for t in cfg.target_parameters if _matches(router, (t,))}
            plan[path, L.ROUTER] = (router, L.router_key(path, "A"), L.router_key(path, "B"))
        hit |= _plan_shared(plan, path, layers[path], cfg, where)
    _check_other_modules(model, layers, cfg.target_modules, where)
    missed = [t for t in (*cfg.target_parameters, *cfg.target_modules) if t not in hit]
    if missed:
        raise PeftAdapterError(
            f"{folder}: targets {missed} match no adapted parameter or module of the model's "
            f"MoE layers {sorted(layers)[:4]} (experts' gate_up_proj / down_proj, the router's "
            "gate.weight, the shared experts' projections): an adapter for another model, or "
            "for what moe.lora does not hold"
        )
    expected = {k for _, a, b in plan.values() for k in (a, b)}
    extra, lacking = sorted(set(headers) - expected), sorted(expected - set(headers))
    if extra or lacking:
        raise PeftAdapterError(
            f"{where}: keys {extra[:3]} are not the expert LoRA of this model's layers"
            if extra
            else f"{where}: lacks {lacking[:3]}, which its target_parameters promise"
        )
    for (path, p), (name, a, b) in plan.items():
        _check_shapes(where, name, layers[path], p, headers[a][0], headers[b][0], cfg)
    return plan


def _plan_contract(plan, path: str, layer: HFExpertsLayer, cfg: AdapterConfig) -> set[str]:
    """The experts module's parameters the adapter targets (PEFT nests their wrappers in the
    module's registration order: peft_contract.key); the targets they hit."""
    names = [n for n, _ in layer.hf_template[0].named_parameters(recurse=False)]
    wanted = [n for n in names if n in C.PROJECTIONS]
    wanted = [n for n in wanted if _matches(f"{path}.{n}", cfg.target_parameters)]
    for p in wanted:
        plan[path, p] = (f"{path}.{p}", C.key(path, wanted, p, "A"), C.key(path, wanted, p, "B"))
    return {t for p in wanted for t in cfg.target_parameters if _matches(f"{path}.{p}", (t,))}


def _plan_shared(plan, path: str, layer: HFMoELayer, cfg: AdapterConfig, where) -> set[str]:
    """The shared-expert nn.Linear modules the adapter targets (in target_modules, or their
    `.weight` in target_parameters: the same keys); the targets they hit. A named projection
    without a moe.lora adapter is refused."""
    if layer.shared_experts is None:
        return set()
    from moe.interop.hf_families import FAMILIES

    hub = FAMILIES[layer.hf_block_class.__name__].shared_name
    hit = set()
    for n in L.SHARED:
        name = f"{path}.{hub}.{n}"
        hits = {t for t in cfg.target_modules if _matches(name, (t,))}
        hits |= {t for t in cfg.target_parameters if _matches(f"{name}.weight", (t,))}
        if not hits:
            continue
        if not hasattr(getattr(layer.shared_experts, n, None), "lora_A"):
            raise PeftAdapterError(
                f"{where}: {name} is adapted; the model's shared experts have no LoRA "
                "(LoRAConfig(shared_experts=True))"
            )
        hit |= hits
        plan[path, ("shared", n)] = (name, L.module_key(name, "A"), L.module_key(name, "B"))
    return hit


def _check_other_modules(model, layers, targets, where) -> None:
    """A target_modules entry matching a module outside the MoE blocks (attention, a dense
    MLP) adapts what moe.lora does not hold: refused."""
    for name, _ in model.named_modules():
        inside = any(name == p or name.startswith(p + ".") for p in layers)
        if not inside and name and _matches(name, targets):
            raise PeftAdapterError(
                f"{where}: target_modules adapt {name}, outside the MoE blocks; moe.lora holds "
                "the experts', routers' and shared experts' adapters only"
            )


def _check_shapes(where, name, layer: HFMoELayer, p, a_shape, b_shape, cfg) -> None:
    E, d, F = layer.config.num_experts, layer.config.d_model, layer.config.d_ff
    lora = layer.config.lora
    if lora is None:
        raise PeftAdapterError(f"{where}: {name} is adapted; the model's {name} has no LoRA")
    rp = cfg.rank_of(name)
    if isinstance(p, tuple):  # a shared expert's nn.Linear: lora_A [r, in], lora_B [out, r]
        linear = getattr(layer.shared_experts, p[1])
        want = (tuple(linear.lora_A.shape), tuple(linear.lora_B.shape))
        if (tuple(a_shape), tuple(b_shape)) != want:
            raise PeftAdapterError(
                f"{where}: {name} has lora_A {list(a_shape)}, lora_B {list(b_shape)} (rank "
                f"{rp}); the model's adapter there is {list(want[0])}, {list(want[1])}"
            )
        return
    if p == L.ROUTER:
        if not lora.router:
            raise PeftAdapterError(
                f"{where}: {name} (the router) is adapted; the model's LoRAConfig has router=False"
            )
        if (tuple(a_shape), tuple(b_shape)) != ((lora.rank, d), (E, lora.rank)):
            raise PeftAdapterError(
                f"{where}: {name} has lora_A {list(a_shape)}, lora_B {list(b_shape)}; the "
                f"model's router LoRA needs [{lora.rank}, {d}] and [{E}, {lora.rank}] (rank "
                f"{lora.rank}, {E} experts, width {d})"
            )
        return
    n_in, n_out = {L.GATE_UP: (d, 2 * F), C.UP: (d, F)}.get(p, (F, d))
    if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[1] != n_in or b_shape[0] != n_out:
        raise PeftAdapterError(
            f"{where}: {name} has lora_A {list(a_shape)}, lora_B {list(b_shape)}; this model's "
            f"{p} needs [E*r, {n_in}] and [{n_out}, r*E] (an adapter for another model)"
        )
    if a_shape[0] != rp * E or b_shape[1] != rp * E:
        experts, left = divmod(a_shape[0], rp)
        held = (
            f"{experts} experts"
            if not left and b_shape[1] == a_shape[0]
            else f"not a whole number of experts (lora_B {list(b_shape)})"
        )
        raise PeftAdapterError(
            f"{where}: {name} holds lora_A {list(a_shape)} at rank {rp} (adapter_config.json's "
            f"rank for it): {held}; the model's layer has {E} experts, {rp * E} rows at that rank"
        )
    need = (lora.rank, 2 * lora.rank) if p == L.GATE_UP else range(1, lora.rank + 1)
    if rp not in need:
        raise PeftAdapterError(
            f"{where}: {name} has rank {rp}; the model's expert LoRA has rank {lora.rank} "
            f"(moe.interop.peft_lora_config(folder) gives the LoRAConfig this adapter needs)"
        )
    covers = HUB_TARGETS[p] & set(lora.targets)
    if not covers:
        raise PeftAdapterError(
            f"{where}: {name} is adapted; the model's LoRAConfig.targets {lora.targets} "
            f"hold none of {sorted(HUB_TARGETS[p])}"
        )


HUB_TARGETS = {p: set(targets) for p, targets in C.PROJECTIONS.items()}


def peft_lora_config(folder: str) -> dict:
    """The moe.lora.LoRAConfig keyword arguments (rank, alpha, targets, router) that read the PEFT
    adapter in `folder` exactly: rank of PEFT's r (gate and up share PEFT's A, so each gets a
    copy at PEFT's rank), alpha giving PEFT's scaling."""
    cfg = read_config(folder)
    targets, router, shared = set(), False, bool(cfg.target_modules)
    for t in cfg.target_parameters:
        if t.endswith(tuple(f"{n}.weight" for n in L.SHARED)):
            shared = True  # a shared expert's nn.Linear weight
        elif t.endswith(L.ROUTER):
            router = True
        elif t.endswith(L.GATE_UP):
            targets |= {"w1", "w3"}
        elif _matches(t, (C.UP,)):  # a contract family's experts without a gate
            targets.add("w1")
        elif t.endswith(L.DOWN):
            targets.add("w2")
    every = (*cfg.target_parameters, *cfg.target_modules)
    ranks = {cfg.rank_of(t) for t in every}
    scales = {cfg.scaling_of(t) for t in every}
    down = {cfg.rank_of(t) for t in every if not t.endswith(L.GATE_UP)}
    if len(ranks) == 2 and len(down) == 1 and ranks == {*down, 2 * next(iter(down))}:
        # to_peft's layout: gate_up_proj at twice the rank, block-diagonal, split when read;
        # PEFT's fusion of v4 targets: one rank-2r adapter, read at 2r (the rest zero-padded)
        ranks = {max(ranks)} if cfg.fused_by_peft else down
    if len(ranks) != 1 or len(scales) != 1:
        raise PeftAdapterError(
            f"{folder}: its targets have ranks {sorted(ranks)} and scalings {sorted(scales)}; "
            "one LoRAConfig holds one rank and one alpha (an adapter written by to_peft reads "
            "back at its own rank: gate_up_proj at twice the rank is split)"
        )
    (r,), (s,) = ranks, scales
    kept = tuple(t for t in ("w1", "w2", "w3") if t in targets)
    return {
        "rank": r,
        "alpha": s * r,
        "targets": kept,
        "router": router,
        "shared_experts": shared,
    }


@torch.no_grad()
def from_peft(model: nn.Module, folder: str) -> nn.Module:
    """Read the PEFT adapter in `folder` into `model`'s expert LoRA (see the module doc); in
    place, returns the model. Everything is checked before the model changes."""
    from safetensors import safe_open

    cfg = read_config(folder)
    path, headers = read_headers(folder)
    plan = _plan(model, folder, cfg, headers)
    layers = _layers(model)
    new = {}  # (layer path, target) -> (A, B) canonical order, all computed before any write
    with safe_open(path, framework="pt") as f:
        for (lpath, p), (name, ka, kb) in plan.items():
            layer = layers[lpath]
            lora, E = layer.config.lora, layer.config.num_experts
            a, b = f.get_tensor(ka).double(), f.get_tensor(kb).double()
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise PeftAdapterError(f"{folder}/{WEIGHTS}: {name}: NaN or Inf in its factors")
            if isinstance(p, tuple) or p == L.ROUTER:  # stored as moe.lora stores them
                got = {p: (a, b)}
            elif p == L.GATE_UP:
                order = C.fused_order(layer) if isinstance(layer, HFExpertsLayer) else None
                b = b if order is None else b[order]  # gate rows, then up rows
                got = L.gate_up_from_peft(a, b, E, layer.config.d_ff, lora.rank, set(lora.targets))
            else:
                got = L.down_from_peft(a, b, E, lora.rank)
                got = got if isinstance(got, str) else {C.PROJECTIONS[p][0]: got}
            if isinstance(got, str):
                raise PeftAdapterError(f"{folder}/{WEIGHTS}: {name}: {got}")
            ratio = cfg.scaling_of(name) / lora.scale
            for t, (A, B) in got.items():
                new[lpath, t] = (A, B if ratio == 1.0 else B * ratio)
    for lpath, layer in layers.items():
        if layer.config.lora is None:
            continue
        if layer.config.lora.router:  # [E, d]: not per slot
            A, B = new.get((lpath, L.ROUTER), (None, None))
            if A is not None:
                _assign(layer.router.lora_A, A)
            pb = layer.router.lora_B
            _assign(pb, B if B is not None else torch.zeros(pb.shape, dtype=torch.float64))
        for n in L.SHARED:
            linear = getattr(layer.shared_experts, n, None) if layer.shared_experts else None
            if hasattr(linear, "lora_A"):
                A, B = new.get((lpath, ("shared", n)), (None, None))
                if A is not None:
                    _assign(linear.lora_A, A)
                pb = linear.lora_B
                _assign(pb, B if B is not None else torch.zeros(pb.shape, dtype=torch.float64))
        slot_S = layer.expert_of_slot()
        for t in layer.config.lora.targets:
            pa = getattr(layer.experts, f"lora_A_{t}", None)
            if pa is None:
                continue
            pb = getattr(layer.experts, f"lora_B_{t}")
            if (lpath, t) in new:
                A, B = new[lpath, t]
                _assign(pa, A[slot_S.to(A.device)])
                _assign(pb, B[slot_S.to(B.device)])
            else:  # not adapted by the adapter: adds nothing, as in the PeftModel
                _assign(pb, torch.zeros(pb.shape, dtype=torch.float64))
    return model


def _assign(param: torch.Tensor, full: torch.Tensor) -> None:
    """param (a plain tensor, or a DTensor sharded over experts) <- the whole stack `full`."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        full = distribute_tensor(
            full.to(param.device, param.dtype), param.device_mesh, param.placements,
            src_data_rank=None,
        )  # fmt: skip
        param.copy_(full)
    else:
        param.copy_(full.to(param.device, param.dtype))
