"""Save the MoE settings of a converted model next to its weights, and rebuild from them.

`moe_config.json` lists every MoELayer: where it sits, which dense block it replaced and how
(see moe.convert.ffn_match), and its full MoEConfig. A model rebuilt from it computes the same
function as the saved one once the weights are loaded; a model converted by hand is checked
against it, and any difference is a ValueError naming the layer and the field.
"""

import json
import os
from dataclasses import asdict
from pathlib import Path

from torch import nn

from moe.config import MoEConfig, upgrade_saved
from moe.convert.ffn_match import ConversionError, match_ffn
from moe.convert.swap import build_layer, install
from moe.layer import MoELayer, moe_layers
from moe.untrusted import read_json

SETTINGS_FILE = "moe_config.json"
FORMAT = "moe.swap_ffn"
VERSION = 1
_MAX_BYTES = 16 << 20  # a settings file is small; refuse anything larger before reading it
# Read as an untrusted file (moe.untrusted): regular, bounded size and depth, no duplicate keys.
_ENTRY_KEYS = {"path", "block", "kind", "config"}


def save_moe_settings(model: nn.Module, directory: str | Path) -> Path:
    """Write `directory/moe_config.json` describing every MoELayer of `model`; returns its path."""
    layers = moe_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no MoELayer: nothing to save")
    entries = []
    for path, layer in layers:
        swapped = layer.swapped_from or {"block": path, "kind": "layer"}
        entries.append({"path": path, **swapped, "config": asdict(layer.config)})
    out = Path(directory) / SETTINGS_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"format": FORMAT, "version": VERSION, "layers": entries}, indent=1)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(out)
    return out


def read_moe_settings(directory: str | Path) -> list[dict]:
    """The validated layer entries of `directory/moe_config.json` (untrusted input)."""
    path = Path(directory) / SETTINGS_FILE
    if not os.path.lexists(path):
        raise ValueError(f"{path}: no MoE settings file (write it with moe.save_moe_settings)")
    data = read_json(path, _MAX_BYTES, root=directory, error=ValueError, what="MoE settings")
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: 'format' must be {FORMAT!r}")
    if data.get("version") != VERSION:
        raise ValueError(f"{path}: unsupported 'version' {data.get('version')!r}")
    entries = data.get("layers")
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: 'layers' must be a non-empty list")
    fields = MoEConfig.field_names()
    for i, entry in enumerate(entries):
        where = f"{path}: layers[{i}]"
        if not isinstance(entry, dict) or set(entry) != _ENTRY_KEYS:
            raise ValueError(f"{where} must have exactly the keys {sorted(_ENTRY_KEYS)}")
        for key in ("path", "block", "kind"):
            if not isinstance(entry[key], str):
                raise ValueError(f"{where}.{key} must be a string")
        config = entry["config"]
        if not isinstance(config, dict):
            raise ValueError(f"{where}.config must be an object")
        if set(config) != fields:
            missing, unknown = sorted(fields - set(config)), sorted(set(config) - fields)
            raise ValueError(f"{where}.config: missing fields {missing}, unknown fields {unknown}")
        try:
            MoEConfig(**config)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{where}.config: {e}") from None
    _refuse_duplicates(path, entries)
    return entries


def _refuse_duplicates(path: Path, entries: list[dict]) -> None:
    """One entry per module: with two, readers would disagree on which one applies."""
    for key in ("path", "block"):
        first: dict[str, int] = {}
        for i, entry in enumerate(entries):
            j = first.setdefault(entry[key], i)
            if j != i:
                raise ValueError(
                    f"{path}: layers[{j}] and layers[{i}] both describe the module "
                    f"{entry[key]!r} ({key}); a settings file has one entry per module"
                )


def check_moe_settings(model: nn.Module, directory: str | Path) -> None:
    """Raise ValueError naming the layer and field where `model`'s MoE layers differ from the
    settings saved in `directory` (a missing or extra layer is an error too)."""
    entries = read_moe_settings(directory)
    layers = dict(moe_layers(model))
    for entry in entries:
        layer = layers.get(entry["path"])
        if layer is None:
            raise ValueError(f"{entry['path']}: saved as an MoE layer but the model has none there")
        _compare(entry, layer)
    extra = sorted(set(layers) - {e["path"] for e in entries})
    if extra:
        raise ValueError(f"MoE layers {extra} are not in the saved settings of {directory}")


def swap_ffn_from_settings(model: nn.Module, directory: str | Path) -> nn.Module:
    """Convert a freshly built dense `model` exactly as the saved one was (in place; returns
    it), ready for load_state_dict. Layers already present are checked instead (ValueError
    naming the field on any difference). Nothing changes unless every entry is valid."""
    entries = read_moe_settings(directory)
    modules = dict(model.named_modules())
    todo = []
    for entry in entries:
        path, block = entry["path"], entry["block"]
        if isinstance(modules.get(path), MoELayer):
            _compare(entry, modules[path])
            continue
        if block not in modules or not block:
            raise ValueError(f"{block!r}: saved MoE block not found in {type(model).__name__}")
        parent = modules.get(block.rpartition(".")[0])
        ffn = match_ffn(block, modules[block], parent)
        if ffn is None or (ffn.kind, ffn.layer_path) != (entry["kind"], path):
            found = (
                "no FFN" if ffn is None else f"a {ffn.kind!r} FFN with layer at {ffn.layer_path}"
            )
            raise ConversionError(
                f"{block}: saved as a {entry['kind']!r} FFN with layer at {path}, found {found} "
                f"({type(modules[block]).__name__})"
            )
        options = dict(entry["config"])
        dense = {"d_model": ffn.d_model, "d_ff": ffn.d_ff, "activation": ffn.activation}
        dense["bias"] = ffn.up.bias is not None
        for key, value in dense.items():
            if options.pop(key) != value:
                raise ValueError(
                    f"{block}: saved {key}={entry['config'][key]!r} but the dense block has "
                    f"{key}={value!r}"
                )
        todo.append((ffn, entry, options))
    layers = [build_layer(ffn, False, options) for ffn, _, options in todo]  # validate first
    for (ffn, entry, _), layer in zip(todo, layers):
        _compare(entry, layer)
        install(model, ffn, layer)
    return model


def _compare(entry: dict, layer: MoELayer) -> None:
    # through JSON, as the saved copy comes back (a settings tuple: a list); old values read
    # as today's (upgrade_saved: weight_format="lora" beside lora=)
    built = json.loads(json.dumps(asdict(layer.config)))
    for key, saved in upgrade_saved(entry["config"]).items():
        if built[key] != saved:
            raise ValueError(
                f"{entry['path']}: MoE setting {key}={built[key]!r} differs from the saved "
                f"{key}={saved!r}"
            )
