"""FP8Config: every FP8 setting of a MoE layer in one typed, validated value (issue 40), and its
cross-rank check.

MoEConfig.fp8 holds one. moe.config never imports this module: the field's type is resolved
only when a value is given (moe.config's settings types), so a layer without FP8 loads nothing
of moe.fp8.

Nothing here changes a layer by itself: the layer (or whoever builds the exchange and picks the
expert kernel) reads it. Each field is checked when the config is built; a bad value raises one
ValueError naming the field.
"""

from dataclasses import dataclass, fields

from moe.comm.consistency import check_same_across_ranks
from moe.fp8.quant import AMAX_FLOOR

RECIPES = ("rowwise", "blockwise")
DISPATCH_SCALE_FORMATS = ("fp32", "pow2", "ue8m0")
GEMM_SCALE_FORMATS = ("fp32", "pow2")
# amax_floor: from the smallest amax whose scale (amax / 448) is a normal float32 (below it a
# scale underflows: 1e-50 is 0 in float32, and 0 / 0 turns a row of zeros to NaN; UE8M0 has no
# exponent for it) to 1 (above it the floor coarsens blocks of ordinary O(1) values: 1e29 zeroes
# every output).
AMAX_FLOOR_RANGE = (AMAX_FLOOR, 1.0)
# block_size: a block wider than d_model is the whole row; above 2^20 no layer has such rows.
BLOCK_SIZE_RANGE = (1, 2**20)


@dataclass(frozen=True, kw_only=True)
class FP8Config:
    """FP8 settings (e4m3 = torch.float8_e4m3fn everywhere; masters stay bf16/fp32).

    dispatch: send dispatched token rows as e4m3 bytes plus one scale per 1 x block_size block
        of each row (DeepEP's format), dequantized on arrival. The combine stays bf16.
    experts: run every expert GEMM (up, gate, down and their input- and weight-gradient GEMMs)
        in e4m3 with the scales of `recipe`.
    recipe: the expert GEMMs' scaling. "rowwise" (torchao's): activations one scale per row,
        weights one per output column, weight gradients scaled along the tokens of each expert.
        "blockwise" (DeepSeek-V3's): activations and gradients one scale per 1 x 128 block,
        weights per 128 x 128 block, weight gradients per 128-token tile of each expert
        (emulated on every device: torch._scaled_grouped_mm takes only the rowwise form).
    scale_format: the dispatch scales. "fp32": amax / 448; "pow2": that rounded up to a power
        of two (still sent as fp32); "ue8m0": a power of two sent as its 1-byte biased exponent
        (4x fewer scale bytes on the wire).
    gemm_scale_format: the expert GEMMs' scales, "pow2" (torchao's rowwise recipe) or "fp32".
    block_size: elements per dispatch scale block along d_model (the last block of a row is
        partial when d_model % block_size != 0).
    grad_before_down_fp8: also send the activation gradient before the down-projection (the
        combine's backward exchange) in FP8, as DeepSeek-V3 does; off: bf16 gradients.
    save_fp8_inputs: the expert MLP keeps its input x for the backward as e4m3 (1 byte per
        element plus the row scales, once for the up and gate GEMMs) instead of x itself, and
        (FP8 weight gradient) the down GEMM's e4m3 input as the forward quantized it; without
        it the down GEMM's input is recomputed from h and g.
    wgrad_bf16: the expert MLP's weight-gradient GEMMs take their operands unquantized, in
        the activations' dtype (bf16 tensor cores; torchao's rowwise_with_gw_hp): the FP8
        weight gradient runs at ~30% of peak on H100 and its quantizations (two operands per
        GEMM, scaled along each expert's tokens) are most of the backward's passes. x is the
        forward's x as kept (e4m3-rounded with save_fp8_inputs). Forward and dgrad unchanged.
    amax_floor: the smallest amax a scale is computed from (scale = max(amax, floor) / 448),
        so a block of zeros gets a finite scale and stays zero. Default 448 * 2^-126 (~5.3e-36),
        the smallest allowed: every scale a normal float32, so blocks (gradients included) keep
        e4m3's precision at any float32 / bf16 magnitude. At most 1; a larger floor (DeepEP's
        1e-4) quantizes every block whose amax is below it with the floor's coarser scale.

    At least one of dispatch, experts and grad_before_down_fp8 must be on (else the config
    changes nothing: pass fp8=None for no FP8).
    """

    dispatch: bool = False
    experts: bool = False
    recipe: str = "rowwise"
    scale_format: str = "fp32"
    gemm_scale_format: str = "pow2"
    block_size: int = 128
    grad_before_down_fp8: bool = False
    save_fp8_inputs: bool = True
    wgrad_bf16: bool = False
    amax_floor: float = AMAX_FLOOR

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in (bool, "bool") and not isinstance(value, bool):
                raise ValueError(f"FP8Config.{f.name} must be a bool, got {value!r}")
        _choice("recipe", self.recipe, RECIPES)
        _choice("scale_format", self.scale_format, DISPATCH_SCALE_FORMATS)
        _choice("gemm_scale_format", self.gemm_scale_format, GEMM_SCALE_FORMATS)
        lo, hi = BLOCK_SIZE_RANGE
        if type(self.block_size) is not int or not lo <= self.block_size <= hi:
            raise ValueError(
                f"FP8Config.block_size must be an int >= 1 and <= 2**20 ({hi}), got "
                f"{self.block_size!r}"
            )
        floor = self.amax_floor
        lo, hi = AMAX_FLOOR_RANGE
        if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not lo <= floor <= hi:
            raise ValueError(
                f"FP8Config.amax_floor must be a float in [448 * 2**-126 ({lo:.4g}), {hi:g}] "
                f"(the smallest amax with a normal float32 scale, to 1), got {floor!r}"
            )
        if not (self.dispatch or self.experts or self.grad_before_down_fp8):
            raise ValueError(
                "FP8Config turns nothing on: set FP8Config.dispatch, experts or "
                "grad_before_down_fp8 to True (fp8=None is a layer without FP8)"
            )

    @property
    def pow2_dispatch_scales(self) -> bool:
        return self.scale_format != "fp32"

    @property
    def pow2_gemm_scales(self) -> bool:
        return self.gemm_scale_format == "pow2"


def _choice(name: str, value, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ValueError(f"FP8Config.{name} must be one of {options}, got {value!r}")


def agree_across_ranks(config: FP8Config, group=None) -> None:
    """The same FP8Config on every rank of `group` (a collective: every rank calls it, before
    the first exchange), or the same ValueError on every rank naming the first field that
    differs, e.g. "FP8Config.scale_format differs across ranks: rank 0 has fp32, ..."."""
    values = {f"FP8Config.{f.name}": getattr(config, f.name) for f in fields(config)}
    check_same_across_ranks(values, group)
