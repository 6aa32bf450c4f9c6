"""FP8 in the planner's roofline: what FP8 dispatch and FP8 experts cost and save, so the
search chooses FP8 per layout and shape by predicted time and memory, and says why.

The recipe modelled is FP8Config's default, rowwise with power-of-two scales, on its CUDA path
(moe/fp8/expert_mlp_fn.py, operands.py, rows.py: one Triton launch per operand). A Layout
does not choose the recipe: the blockwise layer, its SwiGLU and down-input quantization in the
up / gate GEMMs' epilogue, moves 4-11% fewer bytes outside the GEMMs than rowwise's at the
four GPU-table shapes (bench.budget, 4 micro-batches), so this is its upper bound.

Per MoE block of a pp rank, with t tokens a micro-batch, R = t k c rows (x the busiest rank's
routing imbalance), d = d_model, f = d_ff_expert, g = 3 gated (2 not), n = E / ep local
experts (x (E + spare) / E), X the experts' input elements (t d at ep 1: quantized per token,
gathered as codes; R d under expert parallelism, the rows received):
  GEMMs       every expert GEMM (forward, input and weight gradients: all read e4m3 codes) at
              the cluster's FP8 rate instead of bf16 (moe.plan.predict:
              cluster.gemm_rate(rows, fp8=True); Cluster.fp8_gemm_efficiency)
  quantize    the quantization launches' bytes at cluster.hbm_bw (bf16 read at 2 B, e4m3
              written at 1 B, codes re-read at 1 B; not the scales: under 0.6% at the
              GPU-table shapes). Per micro-batch: forward x (3 X) and the down GEMM's input
              (3 R f, its codes kept for the weight gradient), again where recomputed; backward
              the output gradient's row and column codes from one read (4 R d), each
              pre-activation gradient's likewise (4 (g - 1) R f), the kept codes re-laid out as
              the weight gradient's column codes (down input 2 R f, x X + R d). Per optimizer
              step each expert weight once, both forms from one read (4 g n d f: the weight
              cache, not per micro-batch). FP8 dispatch (ep > 1): the payload written in one
              launch (2 B read + 1.03 B per element of the forward dispatch), then on arrival
              requantized into the GEMM's scaling from the codes (1.03 + 1 B, replacing the
              experts' 3 X) or, without FP8 experts, decoded to bf16 (1.03 + 2 B)
  all-to-all  the forward dispatch's payload at 1.03 B an element instead of 2 (1 x 128 fp32
              scales; moe.plan.predict); the combine and the backward exchanges stay bf16
  activations the expert MLP keeps x once per token and the down GEMM's input as e4m3 codes
              (+ a 4 B row scale) instead of the k c gathered bf16 input rows and the bf16
              down input (moe.memory.activations' 4 h k c + 6 f k c, of which those are
              2 h k c + 2 f k c): saved per token and MoE block not recomputed
              2 h k c - (h + 4) + k c (f - 4)
  all-gather  not credited: FSDP gathers the bf16 weights (moe has no FP8 all-gather)
The quantize term is held to bench.budget's counted bytes of those launches
(tests/test_plan_fp8.py).
"""

from __future__ import annotations

FP8_ROW_BYTES = 1.03  # an e4m3 element + its share of a 1 x 128 fp32 scale (dispatch payload)
ROW_SCALE = 4  # bytes of a row's fp32 scale (rowwise GEMM operands)
QUANTIZE = 3  # read bf16, write e4m3
BOTH_FORMS = 4  # read bf16, write the row-wise and the transposed (column) codes
RELAYOUT = 2  # read codes, write them as the weight gradient's column codes
GIB = 2**30


def activation_saving(spec, cf: float) -> float:
    """Bytes per token saved by FP8 experts in one MoE block's saved activations (kept: x once
    per token and the down GEMM's input as e4m3 codes + a row scale; not kept: the k c
    gathered bf16 input rows and the bf16 down input)."""
    h, f, kc = spec.d_model, spec.d_ff_expert, spec.top_k * cf
    return max(2 * h * kc - (h + ROW_SCALE) + kc * (f - ROW_SCALE), 0.0)


def quantize_bytes(S, recomputed: float) -> tuple[float, float]:
    """(bytes per micro-batch, bytes per optimizer step) of one MoE block's FP8 quantization
    launches (layout S.L, S a moe.plan.predict setup; `recomputed`: the share of the forward
    run again)."""
    L, spec = S.L, S.spec
    d, f, g = spec.d_model, spec.d_ff_expert, 3 if spec.gated else 2
    rows = S.t * spec.top_k * S.cf * S.imb
    x = S.t * d if L.ep == 1 else rows * d
    dispatch = L.fp8_dispatch and L.ep > 1
    forward = backward = step = 0.0
    if L.fp8_experts:
        forward = (0 if dispatch else QUANTIZE * x) + QUANTIZE * rows * f
        backward = BOTH_FORMS * (rows * d + (g - 1) * rows * f) + RELAYOUT * rows * f + x + rows * d
        step = BOTH_FORMS * g * spec.num_experts * S.spare / L.ep * d * f
    if dispatch:
        arrival = 1 if L.fp8_experts else 2  # requantized codes, or decoded bf16
        forward += (2 + FP8_ROW_BYTES + FP8_ROW_BYTES + arrival) * S.a2a_bytes
    return forward * (1 + recomputed) + backward, step


def quantize_seconds(S, mine, recomputed: float) -> tuple[float, float]:
    """(seconds per micro-batch, seconds per optimizer step) of the rank's MoE blocks' FP8
    quantization launches (quantize_bytes) at the HBM bandwidth."""
    if not (S.L.fp8_experts or S.L.fp8_dispatch) or not mine.moe_blocks:
        return 0.0, 0.0
    per_mb, step = quantize_bytes(S, recomputed)
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
