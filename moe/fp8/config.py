"""The FP8 settings (FP8Config, defined in the leaf moe/fp8_config.py so MoEConfig can hold one)
and their cross-rank check."""

from dataclasses import fields

from moe.comm.consistency import check_same_across_ranks
from moe.fp8_config import DISPATCH_SCALE_FORMATS, GEMM_SCALE_FORMATS, RECIPES, FP8Config

__all__ = [
    "DISPATCH_SCALE_FORMATS",
    "GEMM_SCALE_FORMATS",
    "RECIPES",
    "FP8Config",
    "agree_across_ranks",
]


def agree_across_ranks(config: FP8Config, group=None) -> None:
    """The same FP8Config on every rank of `group` (a collective: every rank calls it, before
    the first exchange), or the same ValueError on every rank naming the first field that
    differs, e.g. "FP8Config.scale_format differs across ranks: rank 0 has fp32, ..."."""
    values = {f"FP8Config.{f.name}": getattr(config, f.name) for f in fields(config)}
    check_same_across_ranks(values, group)
