"""FP8 in the planner's roofline: what FP8 dispatch and FP8 experts cost and save, so the
search chooses FP8 per layout and shape by predicted time and memory, and says why.

Per MoE block of a pp rank, with t tokens a micro-batch, R = t k c rows (x the busiest rank's
routing imbalance), d = d_model, f = d_ff_expert, g = 3 gated (2 not), n = E / ep local
experts (x (E + spare) / E):
  GEMMs       the routed experts' GEMM FLOPs at the cluster's FP8 rate instead of bf16
              (moe.plan.predict: cluster.gemm_rate(rows, fp8=True); the presets' FP8 peak is 2x
              bf16, a profile keeps that ratio: it cannot time e4m3 on a CPU)
  quantize    bytes outside the GEMMs at cluster.hbm_bw, each quantized element read in bf16
              (2 B) and written as the row-wise and the transposed e4m3 copies (1 B each, one
              launch: QUANT_BYTES = 4): per micro-batch the GEMMs' activation operands,
              forward x (t d, per token) and the down input (R f), backward the output
              gradient (R d) and the pre-activations' gradients (R (g - 1) f), the forward ones
              again where recomputed; per optimizer step the experts' weights once (g n d f,
              the weight cache: not per micro-batch). FP8 dispatch adds DISPATCH_QUANT_BYTES per
              element of the forward dispatch (quantize 2 B -> 1.03 B, dequantize on arrival)
  all-to-all  the forward dispatch's payload at 1.03 B an element instead of 2 (1 x 128 fp32
              scales; moe.plan.predict); the combine and the backward exchanges stay bf16
  activations the expert MLP keeps its input once per token as e4m3 + scales (h + h / 32 B)
              instead of the k c gathered bf16 rows (4 h k c B in the bf16 formula of
              moe.memory.activations, of which the input copies are 2 h k c): saved per token
              and MoE block that is not recomputed, 2 h k c - 1.03 h
  all-gather  not credited: FSDP gathers the bf16 weights (moe has no FP8 all-gather)
"""

from __future__ import annotations

QUANT_BYTES = 4  # read bf16, write the row-wise and the transposed e4m3 copies
DISPATCH_QUANT_BYTES = 2 + 1.03 + 1.03 + 2  # quantize (read, write), dequantize (read, write)
FP8_ROW_BYTES = 1.03  # an e4m3 element + its share of a 1 x 128 fp32 scale
GIB = 2**30


def activation_saving(spec, cf: float) -> float:
    """Bytes per token saved by FP8 experts in one MoE block's saved activations (kept:
    its input once per token in e4m3 + scales; not kept: the k c gathered bf16 input rows)."""
    return max(2 * spec.d_model * spec.top_k * cf - FP8_ROW_BYTES * spec.d_model, 0.0)


def quantize_seconds(S, mine, recomputed: float) -> tuple[float, float]:
    """(seconds per micro-batch, seconds per optimizer step) of the FP8 quantization passes of
    the rank's MoE blocks (layout S.L, S a moe.plan.predict setup); `recomputed`: the share of
    the forward run again."""
    L, spec = S.L, S.spec
    if not (L.fp8_experts or L.fp8_dispatch) or not mine.moe_blocks:
        return 0.0, 0.0
    d, f, g = spec.d_model, spec.d_ff_expert, 3 if spec.gated else 2
    rows = S.t * spec.top_k * S.cf * S.imb
    per_mb = step = 0.0
    if L.fp8_experts:
        forward = S.t * d + rows * f
        backward = rows * d + rows * (g - 1) * f
        per_mb += QUANT_BYTES * (forward * (1 + recomputed) + backward)
        step += QUANT_BYTES * g * spec.num_experts * S.spare / L.ep * d * f
    if L.fp8_dispatch and L.ep > 1:
        per_mb += DISPATCH_QUANT_BYTES * S.a2a_bytes * (1 + recomputed)
    bw = S.cluster.hbm_bw
    return mine.moe_blocks * per_mb / bw, mine.moe_blocks * step / bw


def choices(space_fp8: bool, ep: int) -> list[tuple[bool, bool]]:
    """(fp8 dispatch, fp8 experts) pairs to compare: bf16 only unless asked (FP8 changes the
    numerics); dispatch only and dispatch + experts under expert parallelism, else experts."""
    if not space_fp8:
        return [(False, False)]
    return [(False, False), *([(True, False), (True, True)] if ep > 1 else [(False, True)])]


def name(layout) -> str:
    on = [n for n, x in (("dispatch", layout.fp8_dispatch), ("experts", layout.fp8_experts)) if x]
    return "fp8 " + "+".join(on) if on else "bf16"


def reason(chosen, other) -> str:
    """One line: why `chosen` (a Prediction) is FP8 or bf16 against the best `other` kind (a
    Prediction or None where it fits nowhere): predicted speed-up and the terms that differ."""
    if other is None:
        kind = "bf16" if chosen.layout.fp8_experts or chosen.layout.fp8_dispatch else "fp8"
        return f"{name(chosen.layout)}: {kind} fits no memory setting of this layout"
    ms = lambda x: f"{x * 1e3:+,.0f} ms" if abs(x) >= 0.1 else f"{x * 1e3:+.3g} ms"  # noqa: E731
    fp8, bf16 = (chosen, other) if name(chosen.layout) != "bf16" else (other, chosen)
    d_gemm = fp8.parts["routed_gemm"] - bf16.parts["routed_gemm"]
    d_quant = fp8.parts["quantize"] - bf16.parts["quantize"]
    d_a2a = fp8.time["all_to_all"] - bf16.time["all_to_all"]
    d_act = (fp8.memory["activations"] - bf16.memory["activations"]) / GIB
    terms = f"GEMM {ms(d_gemm)}, quantize {ms(d_quant)}, all-to-all {ms(d_a2a)}"
    terms += f", activations {d_act:+.3g} GiB"
    speed = bf16.step_time / fp8.step_time
    if fp8 is chosen:
        return f"{name(fp8.layout)}: {speed:.3g}x faster than bf16 predicted ({terms})"
    return f"bf16: {name(fp8.layout)} predicted {speed:.3g}x ({terms})"
