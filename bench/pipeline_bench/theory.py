"""The bubble each of PyTorch's pipeline schedules reaches in theory: the idle share of one
step on a pp rank, (idle time) / (step time), for p pp ranks, m micro-batches and v stages
per rank, with every stage equally fast and communication free.

For the zero-bubble schedules the usual assumption of their papers is taken: a stage's
forward F, its backward for inputs B_in and its backward for weights W take equal time
(T_F = T_B = T_W, a full backward B = B_in + W = 2F), so one micro-batch costs 3F per stage.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bubble:
    """value: the idle share of a step in [0, 1); formula: how it is computed; source: the
    paper (and, where the number is this module's derivation, what it assumes)."""

    value: float
    formula: str
    source: str


GPIPE = "GPipe (Huang et al. 2019, arXiv:1811.06965)"
ONE_F_ONE_B = "1F1B / PipeDream-Flush (Narayanan et al. 2021, arXiv:2006.09503)"
MEGATRON = "interleaved 1F1B (Narayanan et al. 2021, arXiv:2104.04473, Sec. 2.2.2)"
ZB = "Zero Bubble PP (Qi et al. 2024, arXiv:2401.10241)"
DUALPIPE = "DualPipe (DeepSeek-V3, arXiv:2412.19437; github.com/deepseek-ai/DualPipe)"


def theoretical_bubble(schedule: str, p: int, m: int, v: int = 1) -> Bubble:
    """The ideal bubble of `schedule` (a moe.pipeline.SCHEDULES name) at p ranks, m
    micro-batches, v stages per rank (1 for GPipe / 1F1B, 2 for the V schedules)."""
    for name, value in (("p", p), ("m", m), ("v", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if schedule in ("GPipe", "1F1B"):
        if v != 1:
            raise ValueError(f"{schedule} runs one stage per rank, got v={v}")
        source = GPIPE if schedule == "GPipe" else ONE_F_ONE_B
        return Bubble((p - 1) / (m + p - 1), "(p-1)/(m+p-1)", source)
    if schedule == "Interleaved1F1B":
        return Bubble(
            (p - 1) / (v * m + p - 1),
            "(p-1)/(v*m+p-1)",
            f"{MEGATRON}: bubble (p-1)/(v*m) of the ideal time",
        )
    if schedule == "InterleavedZeroBubble":
        return Bubble(
            (p - 1) / (3 * v * m + p - 1),
            "(p-1)/(3*v*m+p-1)",
            f"{ZB}, ZB-H1 (PyTorch implements ZB1P): bubble (p-1)(F+B-2W), 1/3 of 1F1B's at "
            "T_F=T_B=T_W; interleaving over v stages divides it by v (derived here)",
        )
    if schedule == "ZBVZeroBubble":
        if v != 2:
            raise ValueError(f"ZBVZeroBubble runs two stages per rank, got v={v}")
        return Bubble(0.0, "0", f"{ZB}, Sec. 6 (ZB-V): no bubble when T_F=T_B=T_W")
    if schedule == "DualPipeV":
        if v != 2:
            raise ValueError(f"DualPipeV runs two stages per rank, got v={v}")
        return Bubble(
            (p - 1) / (3 * m + p - 1),
            "(p-1)/(3*m+p-1)",
            f"{DUALPIPE}: bubble (S/2-1)(F&B+B-3W) over S = 2p stages (chunk times), with "
            "F&B = F+B (PyTorch runs an overlapped F/B pair one after the other) and "
            "T_F=T_B=T_W; a perfect F&B overlap would give (p-1)/(6m+p-1) (derived here)",
        )
    raise ValueError(f"unknown schedule {schedule!r}")
