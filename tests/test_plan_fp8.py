"""moe.plan chooses FP8 per shape (issue 61 item 3): the quantization passes' bytes at the
memory bandwidth against the expert GEMMs at the FP8 rate, the dispatch payload and the
experts' saved inputs in e4m3 (moe/plan/fp8.py), by hand; the choice flips between a tiny and
a large shape; the reason is in the search's notes and the command line's output."""

import importlib.util
from dataclasses import replace

import pytest

from bench.budget import measure, per_micro_batch
from bench.titan_style import Shape
from moe.plan import Layout, ModelSpec, SearchSpace, predict, preset, search
from moe.plan.cli import main
from moe.plan.fp8 import FP8_ROW_BYTES, activation_saving
from moe.plan.stages import chunks

SMALL = ModelSpec("small", 2, 64, 4, 256, 8, 2, 32, 128)  # d 64, f 32: bytes-bound
LARGE = ModelSpec("large", 4, 4096, 32, 32000, 8, 2, 14336, 14336)  # Mixtral's widths


def test_quantize_and_activation_terms_by_hand():
    cl, seq = preset("h100"), 512
    bf16 = Layout(1, 1, 8, "ddp", microbatches=2, micro_batch_seqs=2)
    t, d, f, k = 2 * seq, LARGE.d_model, LARGE.d_ff_expert, LARGE.top_k
    c = chunks(LARGE, seq, 1, None)[0]
    off = predict(LARGE, cl, bf16, seq, 8 * 4 * seq)
    on = predict(LARGE, cl, replace(bf16, fp8_experts=True), seq, 8 * 4 * seq)
    rows = t * k  # dropless, uniform routing
    x = rows * d  # ep 8: the experts' input is the rows received (t d at ep 1)
    # forward: x (3 B: read bf16, write e4m3), the down input (3 B); backward: dy and the two
    # pre-activation gradients' row + column codes (4 B), the kept codes re-laid out for the
    # weight gradients (read 1 B, write 1 B: the down input's, x's)
    forward = 3 * x + 3 * rows * f
    backward = 4 * (rows * d + 2 * rows * f) + 2 * rows * f + x + rows * d
    per_mb = (forward + backward) * c.moe_blocks
    weights = 4 * 3 * LARGE.num_experts / 8 * d * f * c.moe_blocks  # once a step, both forms
    want = (2 * per_mb + weights) / cl.hbm_bw
    assert on.parts["quantize"] == pytest.approx(want, rel=1e-12)
    assert off.parts["quantize"] == 0
    # compute moves by exactly the GEMM saving plus the quantization
    d_gemm = on.parts["routed_gemm"] - off.parts["routed_gemm"]
    assert d_gemm < 0
    assert on.time["compute"] - off.time["compute"] == pytest.approx(d_gemm + want, rel=1e-9)
    # FP8 GEMMs at fp8_gemm_efficiency x the FP8 peak: 1.3x bf16's rate in the presets
    assert off.parts["routed_gemm"] / on.parts["routed_gemm"] == pytest.approx(1.3)
    # the experts keep x once per token and the down input as e4m3 + a 4 B row scale, not the
    # k gathered bf16 rows and the bf16 down input: 2 h k - (h + 4) + k (f - 4) per token
    saved = activation_saving(LARGE, 1.0) * c.moe_blocks * t
    assert saved == pytest.approx((2 * d * k - (d + 4) + k * (f - 4)) * c.moe_blocks * t)
    assert off.memory["activations"] - on.memory["activations"] == pytest.approx(saved)
    moe_rc = replace(bf16, recompute="moe")  # the MoE FFN keeps only its input: nothing saved
    assert predict(LARGE, cl, replace(moe_rc, fp8_experts=True), seq, 8 * 4 * seq).memory[
        "activations"
    ] == pytest.approx(predict(LARGE, cl, moe_rc, seq, 8 * 4 * seq).memory["activations"])
    # FP8 dispatch alone: the payload in one launch (read 2 B, write 1.03 B), decoded to bf16
    # on arrival (read 1.03 B, write 2 B); the send at 1.03 B an element
    disp = predict(LARGE, cl, replace(bf16, fp8_dispatch=True), seq, 8 * 4 * seq)
    payload = t * k * d
    assert disp.parts["quantize"] == pytest.approx(
        2 * c.moe_blocks * (2 + 2 * FP8_ROW_BYTES + 2) * payload / cl.hbm_bw, rel=1e-12
    )
    assert disp.time["all_to_all"] < off.time["all_to_all"]


QUANT_LAUNCHES = {"_quant_kernel", "_payload_kernel", "_requant_kernel"}  # moe/fp8/triton_*


@pytest.mark.parametrize("variant", ["fp8 rowwise", "fp8 rowwise +dispatch ep2"])
def test_quantize_bytes_match_the_budget(variant):
    """The planner's FP8 quantization bytes of one layer per micro-batch (its weights' once a
    step shared by the step's micro-batches) against bench.budget's count of the quantization
    launches the CUDA code path makes, within 3% (the planner leaves out the fp32 row scales,
    the weight gradient's 16-row padding and the offsets: 1.9% and 1.2% here, under 0.6% at
    the four GPU-table shapes). What FP8 adds to the bf16 layer's bytes outside the GEMMs is at
    least that much over bf16 Triton's and at most that much over bf16 torch's (the FP8 path
    gathers codes, not bf16 rows: it moves fewer bytes than torch's outside its quantization)."""
    s, M, ep = Shape("test", 1024, 256, 8, 2, 384), 2, 2 if variant.endswith(" ep2") else 1
    b = measure(variant, s, M)
    counted = sum(
        n
        for p in (b.first, b.later, b.optimizer)
        for op, n in p.op_bytes.items()
        if op.split()[-1] in QUANT_LAUNCHES
    )
    spec = ModelSpec("one layer", 1, s.d, 4, 256, s.E, s.k, s.F, s.F)
    cl = preset("h100")
    lay = Layout(1, 1, ep, "ddp", microbatches=M, fp8_dispatch=ep > 1, fp8_experts=True)
    planned = predict(spec, cl, lay, s.T, s.T * M).parts["quantize"] * cl.hbm_bw / M
    assert planned == pytest.approx(counted / M, rel=0.03)
    suffix = " ep2" if ep > 1 else ""
    added = per_micro_batch(b)[1] - per_micro_batch(measure("bf16 torch" + suffix, s, M))[1]
    assert 0 < added < planned
    if ep == 1:
        assert planned < per_micro_batch(b)[1] - per_micro_batch(measure("bf16 triton", s, M))[1]


@pytest.mark.parametrize("spec, fp8", [(SMALL, False), (LARGE, True)])
def test_the_choice_flips_with_the_shape_and_says_why(spec, fp8):
    cl, seq = preset("h100"), 1024
    space = SearchSpace(fp8=True, pp=(1,), micro_batch_seqs=(1, 4))
    result = search(spec, cl, 8 * 16 * seq, seq, space=space, top=3)
    for pred in result.fits:
        lay = pred.layout
        assert lay.fp8_experts == fp8, (lay.short(), pred.notes)
        (note,) = pred.notes
        if fp8:  # the GEMMs' saving outweighs the quantization passes
            assert note.startswith("fp8 dispatch+experts: ") and "x faster than bf16" in note
            assert "GEMM -" in note and "activations -" in note, note
        else:  # the best FP8 variant is slower
            assert note.startswith("bf16: fp8 ") and " predicted 0." in note, note
        assert "quantize +" in note and "all-to-all " in note, note
    # not asked: bf16 only, and nothing to say
    plain = search(spec, cl, 8 * 16 * seq, seq, space=replace(space, fp8=False), top=3)
    assert not any(p.layout.fp8_experts or p.layout.fp8_dispatch for p in plain.fits)
    assert all(p.notes == [] for p in plain.fits)


def test_fp8_that_only_fits_is_chosen_and_says_bf16_does_not():
    """The e4m3 saved inputs can make a layout fit where bf16 does not at any memory setting
    the space allows: FP8 is chosen for memory, and the note says so."""
    cl, seq = preset("h100"), 4096
    space = SearchSpace(fp8=True, pp=(1,), micro_batch_seqs=(8,), recompute=("none",),
                        offload=("all",), groups=(16,), data_parallel=("fsdp",))  # fmt: skip
    lay = Layout(1, 1, 8, "fsdp", microbatches=1, micro_batch_seqs=8, offload="all", groups=16)
    bf16 = predict(LARGE, cl, lay, seq, 8 * 8 * seq)
    fp8 = predict(LARGE, cl, replace(lay, fp8_experts=True, fp8_dispatch=True), seq, 8 * 8 * seq)
    memory = (bf16.peak_memory + fp8.peak_memory) / 2 / 2**30
    small = replace(cl, device_memory_gib=memory)
    best = search(LARGE, small, 8 * 8 * seq, seq, space=space, top=1).best()
    assert best.layout.fp8_experts
    assert best.notes == ["fp8 dispatch+experts: bf16 fits no memory setting of this layout"]


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_cli_prints_the_reason(capsys):
    argv = ["--model", "mixtral-tiny", "--tokens", "64K", "--top", "2"]
    assert main([*argv, "--fp8"]) == 0
    out = capsys.readouterr().out
    assert out.count("# bf16: fp8 experts predicted") + out.count("x faster than bf16") == 2, out
    assert main(argv) == 0
    assert "bf16" not in capsys.readouterr().out.split("| 1 |")[1]
