"""The support table of docs/hf-contract.md, from the matrix test's own check
(tests/hf_matrix.py): every family on transformers' experts contract in the installed
transformers, its layout flags, the measured worst relative error on
experts_implementation="moe" and through moe.from_hf, or the refusal's reason.

    python -m tools.hf_support_table            # rewrites the table in docs/hf-contract.md
"""

import argparse
import re
from pathlib import Path

import torch

from moe.interop.hf_experts import layout_flags
from tests.hf_matrix import TABLE_TOL, check_family
from tests.hf_tiny import NOT_BUILT, contract_families, tiny_model

BEGIN, END = "<!-- support table: begin -->", "<!-- support table: end -->"
FLAGS = {
    "has_gate": (False, "not gated"),
    "is_concatenated": (False, "interleaved gate/up"),
    "is_transposed": (True, "transposed"),
    "has_bias": (True, "biases"),
    "has_post_expert_norm": (True, "post-expert norm"),
    "default_gate": (False, "own _apply_gate"),
}


def _flags(family: str) -> str:
    model = tiny_model(family)
    experts = [m for m in model.modules() if hasattr(m, "_is_expert_parallel")]
    multimodal = model.config.get_text_config() is not model.config
    flags = layout_flags(experts[0])
    words = [text for key, (value, text) in FLAGS.items() if flags[key] == value]
    return ("multimodal; " if multimodal else "") + (", ".join(words) or "plain SwiGLU")


def _row(family: str) -> str:
    if family in NOT_BUILT:
        return f"| {family} | not built by tests/hf_tiny.py's shrinker (listed) | | |"
    r = check_family(family)
    dtype = str(r.dtype).removeprefix("torch.")
    ok = r.ran_eager and r.ran_moe == r.ran_eager and r.moe_ran_all
    impl = f"{r.worst(r.impl_errors):.1e} ({dtype})" if ok else "MISMATCH: calls differ"
    if r.converted is None:
        reason = re.sub(r"^from_hf: ", "", r.refusal).split("; run it")[0]
        conv = f"refused: {reason}"
    else:
        tol = max(r.tol, TABLE_TOL) if r.converted == "table" else r.tol
        err = r.worst(r.conversion_errors)
        exact = "to_hf exact" if r.state_dict_exact else "to_hf DIFFERS"
        conv = f"{err:.1e} ({r.converted}; {exact})" + ("" if err <= tol else " OVER TOLERANCE")
    return f"| {family} | {_flags(family)} | {impl} | {conv} |"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--doc", default="docs/hf-contract.md")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = [_row(f) for f in contract_families()]
    head = [
        '| family | experts layout | experts_implementation="moe" | moe.from_hf |',
        "|---|---|---|---|",
    ]
    table = "\n".join([BEGIN, *head, *rows, END])
    doc = Path(args.doc)
    text = doc.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    doc.write_text(text[:start] + table + text[end:])
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
