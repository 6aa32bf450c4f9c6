"""The support table of docs/hf-contract.md, measured by the matrix tests' own checks: every
family on transformers' experts contract in the installed transformers, its layout, and per
column the measured worst relative error (logits, loss and every gradient) or the reason it
is refused:
    experts_implementation="moe"   tests/hf_matrix.check_family (against eager experts)
    moe.from_hf                    the same check, converted (to_hf exact or not)
    EP = 2                         tests/hf_matrix_ranks (ddp; FSDP2 for a few), gloo
    pipeline pp = 2                tests/hf_matrix_ranks (moe.pipeline.hf_stack, 1F1B)
    FP8 experts                    tests/hf_matrix.fp8_error (approximate: the logits' error)
    LoRA -> PEFT                   tests/hf_lora_peft.check_lora_peft (to_peft, PEFT's reload)

    python -m tools.hf_support            # measure everything, write the JSON and the docs
    python -m tools.hf_support --render   # the docs table from the JSON only

The figures go to tests/data/hf_support.json; the tests compare what they measure with it
(tests/hf_matrix.agrees) and the docs table with its rendering (tests/test_hf_contract.py).
"""

import argparse
import json
import re
from pathlib import Path

import torch

from moe.interop.hf_experts import layout_flags
from tests.hf_matrix import SUPPORT, TABLE_TOL, check_family, fp8_error
from tests.hf_tiny import NOT_BUILT, contract_families, tiny_model

BEGIN, END = "<!-- support table: begin -->", "<!-- support table: end -->"
DOC = Path(__file__).resolve().parent.parent / "docs" / "hf-contract.md"
FLAGS = {
    "has_gate": (False, "not gated"),
    "is_concatenated": (False, "interleaved gate/up"),
    "is_transposed": (True, "transposed"),
    "has_bias": (True, "biases"),
    "has_post_expert_norm": (True, "post-expert norm"),
    "default_gate": (False, "own _apply_gate"),
}
COLUMNS = {  # JSON key -> header
    "moe": 'experts_implementation="moe"',
    "convert": "moe.from_hf",
    "ep": "EP = 2 (ddp)",
    "ep_fsdp": "EP = 2 (fsdp)",
    "pipeline": "pipeline pp = 2",
    "fp8": "FP8 experts (logits, approx.)",
    "lora_peft": "LoRA -> PEFT",
}


def _layout(model) -> str:
    experts = [m for m in model.modules() if hasattr(m, "_is_expert_parallel")]
    multimodal = model.config.get_text_config() is not model.config
    flags = layout_flags(experts[0])
    words = [text for key, (value, text) in FLAGS.items() if flags[key] == value]
    shared = any("shared_expert" in n for n, _ in model.named_modules())
    words = (words or ["plain SwiGLU"]) + (["shared experts"] if shared else [])
    return ("multimodal; " if multimodal else "") + ", ".join(words)


def _single(family: str) -> dict:
    """One family's one-process cells."""
    if family in NOT_BUILT:
        return {"layout": f"not checked: {NOT_BUILT[family]}"}
    r = check_family(family)
    row = {"layout": _layout(tiny_model(family)), "dtype": str(r.dtype).removeprefix("torch.")}
    same_calls = r.ran_eager and r.ran_moe == r.ran_eager and r.moe_ran_all
    row["moe"] = r.worst(r.impl_errors) if same_calls else "MISMATCH: the experts calls differ"
    if r.converted is None:
        row["convert"] = "refused: " + re.sub(r"^from_hf: ", "", r.refusal).split("; run it")[0]
        return row
    err = r.worst(r.conversion_errors)
    tol = max(r.tol, TABLE_TOL) if r.converted == "table" else r.tol
    row["convert"] = err if err <= tol and r.state_dict_exact else f"MISMATCH: {err:.1e}"
    row["how"] = r.converted
    row["fp8"] = fp8_error(family)
    row["lora_peft"] = _lora_peft(family)
    return row


def _lora_peft(family: str) -> float | str:
    """PEFT's logits against moe's LoRA model (tests/hf_lora_peft.py), or the refusal."""
    from tests.hf_lora_peft import check_lora_peft

    r = check_lora_peft(family)
    if r.refusal is not None:
        return "refused: " + r.refusal.split("; ")[0]
    worst = max(r.error or 0.0, r.read_back or 0.0)
    return worst if r.passed else f"MISMATCH: {worst:.1e}"


def measure() -> dict:
    from tests import hf_matrix_ranks as ranks_
    from tests.distributed import run_ranks

    rows = {family: _single(family) for family in contract_families()}
    families = [f for f, row in rows.items() if isinstance(row.get("convert"), float)]
    cases = [(f, "ddp") for f in families] + [(f, "fsdp") for f in ranks_.FSDP if f in families]
    results = run_ranks(ranks_.body, 2, cases, families, timeout=600)
    for family, data_parallel in cases:
        errors = ranks_.ep_errors(family, data_parallel, results)
        worst = errors if isinstance(errors, str) else max(errors.values())
        rows[family]["ep" if data_parallel == "ddp" else "ep_fsdp"] = worst
    for family in families:
        errors = ranks_.pp_errors(family, results)
        rows[family]["pipeline"] = errors if isinstance(errors, str) else max(errors.values())
    import transformers

    return {"transformers": transformers.__version__, "families": rows}


def _cell(row: dict, key: str) -> str:
    value = row.get(key)
    if value is None:
        return "" if "convert" not in row or isinstance(row["convert"], str) else "-"
    if isinstance(value, str):  # hf_stack's refusal: the reason after the model's name
        return re.sub(r"^hf_stack: \w+ cannot be split into stages: ", "refused: ", value)
    text = f"{value:.1e}"
    if key == "convert":
        text += f" ({row['how']}; to_hf exact)"
    return text


def render(data: dict) -> str:
    """The docs table (between the markers) of the JSON's figures."""
    head = ["| family | experts layout | dtype | " + " | ".join(COLUMNS.values()) + " |"]
    head.append("|---" * (3 + len(COLUMNS)) + "|")
    rows = [
        f"| {family} | {row['layout']} | {row.get('dtype', '')} | "
        + " | ".join(_cell(row, key) for key in COLUMNS)
        + " |"
        for family, row in data["families"].items()
    ]
    return "\n".join([BEGIN, *head, *rows, END])


def doc_table(doc: Path = DOC) -> str:
    text = doc.read_text()
    return text[text.index(BEGIN) : text.index(END) + len(END)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--render", action="store_true", help="render the JSON, measure nothing")
    args = p.parse_args(argv)
    if not args.render:
        torch.set_num_threads(1)
        SUPPORT.write_text(json.dumps(measure(), indent=1) + "\n")
    table = render(json.loads(SUPPORT.read_text()))
    text = DOC.read_text()
    DOC.write_text(text.replace(doc_table(), table))
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
