"""Rebalance records in the routing trace: one line per layer each time
moe.parallel.rebalance_experts re-places experts (and their copies), beside the routing lines
(RoutingTrace.record_rebalance writes them; read_trace checks them):

    {"kind": "rebalance", "step": 200, "layer": "blocks.1.ffn", "ep": 8,
     "copies_per_expert": [1, 2, ...], "max_over_mean_before": 1.43,
     "max_over_mean_after": 1.0, "slots_moved": 12, "call_bytes_sent": 123456}

copies_per_expert: copies of each canonical expert after the call (all 1 without spare
slots); max_over_mean_*: largest / mean EP-rank load of the loads the plan used, before and
after; slots_moved: expert slots whose expert changed; call_bytes_sent: bytes the writing
rank sent in the call's one exchange (weights and optimizer state, all layers together).
"""

KIND = "rebalance"
FIELDS = {
    "kind": str,
    "step": int,
    "layer": str,
    "ep": int,
    "copies_per_expert": list,
    "max_over_mean_before": float,
    "max_over_mean_after": float,
    "slots_moved": int,
    "call_bytes_sent": int,
}


def rebalance_lines(step: int, report, ep: dict[str, int]) -> list[dict]:
    """The records of one rebalance_experts call (its RebalanceReport), one per layer;
    `ep[name]` is the layer's expert-parallel size."""
    out = []
    for name, p in report.layers.items():
        copies = list(getattr(p, "copies", ()))
        if not copies:  # a placement without spare slots: one copy of each expert
            copies = [1] * len(p.slot_of_expert)
        moved = getattr(p, "moved_slots", None)
        out.append(
            {
                "kind": KIND,
                "step": int(step),
                "layer": name,
                "ep": int(ep[name]),
                "copies_per_expert": [int(c) for c in copies],
                "max_over_mean_before": p.max_before / p.mean if p.mean else 0.0,
                "max_over_mean_after": p.max_after / p.mean if p.mean else 0.0,
                "slots_moved": len(p.moved if moved is None else moved),
                "call_bytes_sent": int(report.bytes_sent),
            }
        )
    return out


def check_field_types(record: dict, fields: dict, where: str) -> None:
    """Each field of `fields` present in `record` with its type (float takes an int; bool is
    no number); a ValueError names `where` and the field."""
    for field, kind in fields.items():
        value = record.get(field)
        ok = isinstance(value, (int, float) if kind is float else kind)
        if not ok or isinstance(value, bool):
            raise ValueError(
                f"{where}: field {field!r} must be {kind.__name__}, got {value!r:.100}"
            )


def check_rebalance_line(record: dict, where: str, max_name: int) -> dict:
    """A parsed rebalance record checked field by field (types, no negatives, no unknown
    field, at least one copy of each expert, copies <= ep); a ValueError names `where`."""
    unknown = sorted(set(record) - set(FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r:.100} in a rebalance record")
    check_field_types(record, FIELDS, where)
    for field, kind in FIELDS.items():
        if kind in (int, float) and record[field] < 0:
            raise ValueError(f"{where}: field {field!r} must not be negative")
    if len(record["layer"]) > max_name:
        raise ValueError(f"{where}: layer name longer than {max_name} characters")
    copies, ep = record["copies_per_expert"], record["ep"]
    if ep < 1:
        raise ValueError(f"{where}: ep must be >= 1, got {ep}")
    if not copies or not all(
        isinstance(c, int) and not isinstance(c, bool) and 1 <= c <= ep for c in copies
    ):
        raise ValueError(
            f"{where}: copies_per_expert must hold integers from 1 to ep={ep} (one per expert)"
        )
    return record
