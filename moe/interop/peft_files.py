"""Reading a PEFT adapter folder, which is untrusted (moe.untrusted): adapter_config.json (a
regular file inside the folder, bounded, no duplicate keys) validated field by field, and
adapter_model.safetensors' header (length checked against the file, every entry's dtype,
shape and byte span checked) before any tensor is read; every problem is a PeftAdapterError
naming the file and what is wrong."""

import math
import os
import re
from dataclasses import dataclass

from moe.interop.hf_files import HFCheckpointError, headers_of, inside
from moe.untrusted import UntrustedFileError, read_json

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
PLAIN = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")
# the key PEFT writes when it converts transformers v4 targets (gate_proj + up_proj, w1 + w3)
# to a fused parameter: rf".*\.{re.escape(name)}", any name ending in ".<name>", which is what
# the plain key <name> matches too
REWRITTEN = re.compile(r"\.\*\\\.(?P<name>[A-Za-z0-9_]+(\\\.[A-Za-z0-9_]+)*)")
FLOATS = ("F32", "F16", "BF16", "F64")
# adapter_config fields that change what the adapter computes in a way moe.lora does not hold:
# each must be absent, null, false, empty or "none"
UNSUPPORTED = (
    "use_dora", "lora_bias", "fan_in_fan_out", "modules_to_save", "trainable_token_indices",
    "layer_replication", "alora_invocation_tokens", "use_qalora", "use_bdlora", "velora_config",
    "kasa_config", "arrow_config", "monteclora_config", "exclude_modules",
)  # fmt: skip


class PeftAdapterError(ValueError):
    """A PEFT adapter that this library cannot read into the model (nothing was changed)."""


@dataclass(frozen=True)
class AdapterConfig:
    """What adapter_config.json says, validated."""

    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    target_parameters: tuple[str, ...]
    target_modules: tuple[str, ...]
    base_model_class: str | None
    fused_by_peft: bool = False  # rank_pattern holds PEFT's v4 -> v5 rewrite (REWRITTEN)

    def pattern(self, name: str, table: dict, default):
        """PEFT's get_pattern_key for a parameter key (model.layers.0.mlp.experts.gate_up_proj):
        the first pattern, in file order, matching the key's tail (the patterns are plain
        names, checked by read_config, so the match is linear)."""
        hit = next((k for k in table if re.match(rf"(.*\.)?({k})$", name)), None)
        return default if hit is None else table[hit]

    def rank_of(self, name: str) -> int:
        return self.pattern(name, self.rank_pattern, self.r)

    def scaling_of(self, name: str) -> float:
        r, alpha = self.rank_of(name), self.pattern(name, self.alpha_pattern, self.lora_alpha)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def _number(value, what: str, where: str, *, integer: bool) -> float:
    ok = type(value) is int or (not integer and type(value) is float and math.isfinite(value))
    if not ok or value <= 0:
        kind = "a positive integer" if integer else "a positive finite number"
        raise PeftAdapterError(f"{where}: {what} must be {kind}, got {value!r:.60}")
    return value


def _pattern(doc: dict, field: str, where: str, *, integer: bool) -> dict:
    table = doc.get(field) or {}
    if not isinstance(table, dict) or not all(isinstance(k, str) for k in table):
        raise PeftAdapterError(f"{where}: {field} must map parameter names to numbers")
    plain = {}
    for k, v in table.items():  # PEFT reads the keys as regular expressions
        rewritten = REWRITTEN.fullmatch(k)
        if rewritten:  # PEFT's own v4 -> v5 rewrite: read as the plain name it ends in
            name = rewritten["name"].replace("\\.", ".")
        elif PLAIN.fullmatch(k):
            name = k
        else:
            raise PeftAdapterError(
                f"{where}: {field} key {k!r:.100} is a regular expression, not read: only plain "
                "dotted names and the key PEFT writes when it fuses transformers v4 targets "
                r"(.*\.gate_up_proj for gate_proj + up_proj) say which parameters they reach"
            )
        plain.setdefault(name, _number(v, f"{field}[{k!r:.60}]", where, integer=integer))
    return plain


def read_config(folder: str) -> AdapterConfig:
    """adapter_config.json of `folder`, validated: a LoRA adapter on parameters only (PEFT's
    target_parameters), nothing moe.lora cannot hold."""
    where = f"{folder}/{CONFIG}"
    try:
        doc = read_json(
            os.path.join(folder, CONFIG), MAX_CONFIG_BYTES, root=folder, what="PEFT adapter config"
        )
    except UntrustedFileError as e:
        raise PeftAdapterError(str(e)) from None
    if not isinstance(doc, dict):
        raise PeftAdapterError(f"{where}: not a JSON object")
    if doc.get("peft_type") != "LORA":
        raise PeftAdapterError(f"{where}: peft_type {doc.get('peft_type')!r:.60} is not 'LORA'")
    modules = doc.get("target_modules") or []
    if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
        raise PeftAdapterError(
            f"{where}: target_modules={modules!r:.200} must be a list of module names (a "
            "regular expression is not read)"
        )
    for field in UNSUPPORTED:
        if doc.get(field) not in (None, False, [], {}, ""):
            raise PeftAdapterError(f"{where}: {field}={doc[field]!r:.100} is not supported")
    if doc.get("bias", "none") != "none":
        raise PeftAdapterError(f"{where}: bias={doc['bias']!r:.60} is not supported (only 'none')")
    targets = doc.get("target_parameters") or []
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise PeftAdapterError(f"{where}: target_parameters must be a list of names")
    if not targets and not modules:
        raise PeftAdapterError(f"{where}: targets nothing (target_parameters, target_modules)")
    auto = doc.get("auto_mapping")
    base_class = auto.get("base_model_class") if isinstance(auto, dict) else None
    return AdapterConfig(
        r=int(_number(doc.get("r"), "r", where, integer=True)),
        lora_alpha=_number(doc.get("lora_alpha"), "lora_alpha", where, integer=False),
        use_rslora=bool(doc.get("use_rslora", False)),
        rank_pattern=_pattern(doc, "rank_pattern", where, integer=True),
        alpha_pattern=_pattern(doc, "alpha_pattern", where, integer=False),
        target_parameters=tuple(targets),
        target_modules=tuple(modules),
        base_model_class=base_class if isinstance(base_class, str) else None,
        fused_by_peft=any(REWRITTEN.fullmatch(k) for k in doc.get("rank_pattern") or {}),
    )


def read_headers(folder: str) -> tuple[str, dict[str, tuple[tuple, str]]]:
    """(the weights file's real path, key -> (shape, dtype)) from adapter_model.safetensors'
    header alone (no tensor data read); floating-point tensors only."""
    try:
        path = inside(folder, WEIGHTS)
        headers, _ = headers_of({path}, folder)
    except HFCheckpointError as e:
        raise PeftAdapterError(str(e).replace("safetensors file", "PEFT adapter weights")) from None
    for k, (_, dtype) in headers.items():
        if dtype not in FLOATS:
            raise PeftAdapterError(f"{folder}/{WEIGHTS}: {k!r:.100} has dtype {dtype}, not float")
    return path, headers
