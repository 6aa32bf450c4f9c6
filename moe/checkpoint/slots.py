"""Slot layouts in checkpoints (moe.slots.layout.SlotLayout): checked before anything
changes, and carried so that a resumed replicated run continues bit-exactly.

Tensors stay canonical (moe/checkpoint/replicas.py: E expert rows, identity placement), so a
checkpoint loads at any (dp, ep), with or without spare slots. Beside them the metadata's
objects hold `slot_layouts`: {layer prefix: expert_of_slot} of every layer with copies. A
layer whose live slots and EP size fit the saved layout adopts it at load (every slot takes its
expert's canonical row, the copies' optimizer state their expert's), so the dispatch plan, the
split of rows over copies and hence every reduction order are those of the run that saved;
a layer where it does not fit (another spare_slots or ep) keeps its live layout.

A stored placement (`<prefix>slot_of_expert_E`) must be a permutation of the layer's experts,
and a saved replica layout must fit; both are checked on every rank, and agreed, before any
tensor of the model or optimizer changes (save refuses to write a broken live layout).
"""

from torch import nn

from moe.checkpoint.errors import CheckpointError
from moe.layer import MoELayer, moe_layers
from moe.slots.layout import SlotLayout, with_copies

KEY = "slot_layouts"


def _prefixed(model: nn.Module) -> dict[str, MoELayer]:
    return {(f"{name}." if name else ""): layer for name, layer in moe_layers(model)}


def _ep(layer: MoELayer) -> int:
    return layer.num_slots // layer.experts.num_experts


def placement_problem(key: str, value, num_experts: int) -> str | None:
    """Why `value` (a stored slot_of_expert_E) is not a permutation of the experts, or None."""
    ids = value.tolist() if hasattr(value, "tolist") else value
    if not isinstance(ids, list) or len(ids) != num_experts:
        return f"{key}: expected {num_experts} expert slots, got {str(ids)[:80]}"
    if sorted(ids) != list(range(num_experts)):
        bad = sorted({s for s in ids if not 0 <= s < num_experts} or set(ids))[:8]
        return (
            f"{key}: not a permutation of the {num_experts} expert slots 0..{num_experts - 1} "
            f"(ids {bad} are out of range or repeated); the checkpoint's placement is damaged"
        )
    return None


def layouts_to_save(model: nn.Module) -> dict[str, list[int]]:
    """{prefix: expert_of_slot} of the layers with copies; refuses a broken live layout
    (every layer's, checked before its state dict is read)."""
    layouts = {prefix: layer.slot_layout() for prefix, layer in _prefixed(model).items()}
    for prefix, layer in _prefixed(model).items():
        try:
            layouts[prefix].check(_ep(layer))
        except ValueError as e:
            raise CheckpointError(
                f"save_checkpoint: {prefix}expert_of_slot_S: {e} (nothing was written)"
            ) from None
    copied = with_copies(_prefixed(model).items())  # a permutation is stored as tensors
    return {prefix: list(layouts[prefix].expert_of_slot) for prefix, _ in copied}


def _saved_layout(layer: MoELayer, prefix: str, value, problems: list) -> SlotLayout | None:
    """A saved replica layout if it fits the live layer (None: keep the live one)."""
    where = f"objects.{KEY}[{prefix!r}]"
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        problems.append(f"{where}: expected a list of expert ids")
        return None
    E = layer.config.num_experts
    try:
        SlotLayout(E, tuple(value)).check(1)
    except ValueError as e:
        problems.append(f"{where}: {e}")
        return None
    if len(value) != layer.num_slots:
        return None  # saved with another spare_slots: canonical rows, the live layout
    layout = SlotLayout(E, tuple(value))
    try:
        layout.check(_ep(layer))
    except ValueError:
        return None  # fits no rank split of this EP size: the live layout
    return layout


def check_objects(model: nn.Module, objects: dict, problems: list) -> None:
    """The saved replica layouts (JSON, read before any tensor): well-formed, every expert."""
    saved = objects.get(KEY, {})
    if not isinstance(saved, dict):
        problems.append(f"objects.{KEY}: expected a JSON object")
        return
    layers = _prefixed(model)
    for prefix, value in saved.items():
        if prefix in layers:
            _saved_layout(layers[prefix], prefix, value, problems)


def check_loaded(model: nn.Module, loaded: dict, problems: list) -> None:
    """Every stored placement read into `loaded` is a permutation (before it is applied)."""
    for prefix, layer in _prefixed(model).items():
        key = f"model/{prefix}slot_of_expert_E"
        if key in loaded:
            why = placement_problem(key, loaded[key], layer.config.num_experts)
            if why is not None:
                problems.append(why)


def restore(model: nn.Module, objects: dict) -> None:
    """Adopt each fitting saved replica layout (validated by check_objects)."""
    saved = objects.get(KEY, {})
    for prefix, layer in with_copies(_prefixed(model).items()):
        layout = _saved_layout(layer, prefix, saved[prefix], []) if prefix in saved else None
        if layout is not None:
            layer.set_slot_layout(layout)
