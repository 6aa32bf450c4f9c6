"""The `overlap=` argument of `parallelize` / `OverlappedDispatcher(degree=)`: its check."""


def validate_overlap(overlap: int | str | None) -> int | str | None:
    """None (plain dispatcher), an int >= 1 (the degree) or "auto"; ValueError otherwise."""
    if overlap is None or overlap == "auto":
        return overlap
    if isinstance(overlap, bool) or not isinstance(overlap, int) or overlap < 1:
        raise ValueError(f"overlap must be None, an int >= 1 or 'auto', got {overlap!r}")
    return overlap
