"""Stage f of the GPU check (issue 61 item 5): bench.gpu_fp8's rows on CPU (every layer variant,
the budget's floor beside each), the FP8 goal and floor rules on synthetic records, and the
tests stage f and stage b select."""

import json
from pathlib import Path

import pytest

from bench import gpu_check, gpu_check_stages, gpu_decide, gpu_fp8
from moe.fp8 import weight_cache

SHAPE = "40/32/3/2/24"


def test_fp8_rows_smoke_on_cpu(tmp_path, capsys):
    """bench.gpu_fp8 on CPU: every GEMM and layer row present, FP8's SQNR in the e4m3 range,
    the float32 stand-in for bf16 far above it; each layer row has bench.budget's floor (the
    H100's in a smoke run) and the measured / floor and speed-up figures (None: nothing timed)."""
    out = tmp_path / "rows.json"
    assert gpu_fp8.main(["--smoke-cpu", "--shapes", SHAPE, "--json", str(out)]) == 0
    rows = {
        (r["candidate"], r["figure"]): r["value"] for r in json.loads(out.read_text())["records"]
    }
    for label in ("y", "dx", "dw"):
        assert 26 <= rows[("gemm fp8 rowwise", f"sqnr_{label}_db")] <= 32
        assert rows[("gemm bf16", f"sqnr_{label}_db")] > 100
    assert rows[("gemm fp8 rowwise", "fwd_bwd_ms")] is None  # CPU: nothing timed
    for variant in gpu_fp8.LAYERS:
        name = f"layer {variant}"
        for label in ("y", "dx"):  # issue 40: >= 22 dB for the FP8 layer at real sizes
            sqnr = rows[(name, f"sqnr_{label}_db")]
            assert (20 <= sqnr <= 30) if "fp8" in variant else sqnr > 100, (name, sqnr)
        assert rows[(name, "floor_ms_H100")] > 0
        assert rows[(name, "fwd_bwd_ms")] is None and rows[(name, "measured_over_floor")] is None
        for figure in ("fwd_bwd_ms_cached", "speedup_vs_bf16"):  # FP8 rows only
            assert ((name, figure) in rows) == ("fp8" in variant)
    text = capsys.readouterr().out
    assert "| floor_ms_H100 | measured / floor | speed-up vs bf16 |" in text
    assert f"| {SHAPE} | layer fp8 blockwise +dispatch |" in text
    assert "FP8 vs bf16 layer at DeepSeek-V3 slice: not measured" in text
    with pytest.raises(SystemExit):
        gpu_fp8.main(["--smoke-cpu", "--shapes", "mixtral"])  # too big for the CPU smoke run


def test_each_fp8_rows_forms_are_freed_after_it(monkeypatch):
    """The weight cache holds a row's e4m3 forms and its weights' storage (~11 GB a layer row at
    the DeepSeek-V3 shape): none are left when the next row is built, nor after the GEMM rows
    (bench.budget's optimizer step, which also drops them, patched out here)."""
    monkeypatch.setattr(gpu_fp8, "floor_ms", lambda variant, s, gpu: 1.0)
    monkeypatch.setattr(gpu_fp8, "LAYERS", ("fp8 rowwise", "fp8 blockwise"))
    left, options = [], gpu_fp8.variant_options
    monkeypatch.setattr(
        gpu_fp8, "variant_options", lambda v: left.append(len(weight_cache._FORMS)) or options(v)
    )
    assert gpu_fp8.main(["--smoke-cpu", "--shapes", SHAPE]) == 0
    assert left == [0, 0] and not weight_cache._FORMS


def test_a_floor_not_counted_is_said_and_the_row_still_measured(monkeypatch, tmp_path):
    """bench.budget's stand-in failing on the GPU machine's torch costs the floor, not the row;
    a GPU the budget has no bandwidth for gets no floor."""
    from bench import budget

    def broken(variant, s, micro_batches=1):
        raise RuntimeError("no stand-in here")

    monkeypatch.setattr(budget, "measure", broken)
    monkeypatch.setattr(gpu_fp8, "LAYERS", ("fp8 rowwise",))
    out = tmp_path / "rows.json"
    assert gpu_fp8.main(["--smoke-cpu", "--shapes", SHAPE, "--json", str(out)]) == 0
    rows = {(r["candidate"], r["figure"]): r for r in json.loads(out.read_text())["records"]}
    floor = rows[("layer fp8 rowwise", "floor_ms_H100")]
    assert floor["value"] == "not counted: RuntimeError: no stand-in here" and floor["unit"] == ""
    assert 20 <= rows[("layer fp8 rowwise", "sqnr_y_db")]["value"] <= 30
    monkeypatch.setattr(gpu_fp8.torch.cuda, "get_device_name", lambda: "NVIDIA A100-SXM4-80GB")
    assert "not an H100 SXM or H200" in gpu_fp8.floor_ms("fp8 rowwise", None, None)


def _ms(shape, candidate, value, figure="fwd_bwd_ms"):
    return {"shape": shape, "candidate": candidate, "figure": figure, "value": value}


def test_fp8_goal_takes_the_fastest_rows_and_judges_the_goal_shapes():
    """The fastest FP8 row over the fastest bf16 row per shape: >= 1.2x meets the stretch at a
    goal shape, 1.0-1.2x the goal, below 1.0 misses; other shapes have no goal; a goal shape
    without both rows is not measured."""
    recs = [_ms("Mixtral", "layer bf16 torch", 30.0), _ms("Mixtral", "layer bf16 triton", 40.0),
            _ms("Mixtral", "layer fp8 rowwise", 25.0), _ms("Mixtral", "layer fp8 blockwise", 35.0),
            _ms("Mixtral", "layer fp8 rowwise", 20.0, "fwd_bwd_ms_cached"),
            _ms("Mixtral", "gemm fp8 rowwise", 1.0),
            _ms("OLMoE", "layer bf16 torch", 10.0), _ms("OLMoE", "layer fp8 rowwise", 20.0),
            _ms("DeepSeek-V3 slice", "layer bf16 torch", 30.0)]  # fmt: skip
    base, base_ms, by = gpu_decide.fp8_speedups(recs)["Mixtral"]
    assert (base, base_ms) == ("layer bf16 torch", 30.0)
    assert by == {"layer fp8 rowwise": 1.2, "layer fp8 blockwise": 30 / 35}
    ds, mx, olmoe = gpu_decide.fp8_decision(recs)
    assert ds.startswith("FP8 vs bf16 layer at DeepSeek-V3 slice: not measured")
    assert mx.startswith("FP8 vs bf16 layer at Mixtral: fp8 rowwise 1.20x bf16 torch (30.00 ms): "
                         "meets the stretch")  # fmt: skip
    assert "fp8 rowwise 1.20x (forms reused 1.50x); fp8 blockwise 0.86x" in mx
    assert "OLMoE: fp8 rowwise 0.50x bf16 torch (10.00 ms): no goal at this shape" in olmoe
    recs[2]["value"] = 29.0  # 1.03x
    assert "meets the goal" in gpu_decide.fp8_decision(recs)[1]
    recs[2]["value"] = 31.0
    assert "misses the goal" in gpu_decide.fp8_decision(recs)[1]


def test_floor_rule_names_the_rows_over_twice_their_floor():
    recs = [_ms("Mixtral", "layer bf16 torch", 1.5, "measured_over_floor"),
            _ms("Mixtral", "layer fp8 rowwise", 2.5, "measured_over_floor"),
            _ms("OLMoE", "layer fp8 rowwise", None, "measured_over_floor")]  # fmt: skip
    line = gpu_decide.floor_decision(recs)
    assert "1 of 2 layer rows within 2x of the floor; over it: Mixtral fp8 rowwise 2.50x" in line
    assert "not measured" in gpu_decide.floor_decision(recs[2:])
    table = gpu_fp8.report(recs, "NVIDIA H100 80GB HBM3", "H100")
    assert "| Mixtral | layer fp8 rowwise |  |  |  |  |  | 2.5 (> 2x) |  |" in table
    assert "| Mixtral | layer bf16 torch |  |  |  |  |  | 1.5 |  |" in table


def test_the_floor_is_the_gpus_only_for_a_known_gpu():
    assert gpu_fp8.gpu_kind("NVIDIA H100 80GB HBM3") == "H100"
    assert gpu_fp8.gpu_kind("NVIDIA H200") == "H200"
    for other in ("NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB", "NVIDIA GB200"):
        assert gpu_fp8.gpu_kind(other) is None


def test_stage_f_selects_every_fp8_test_file_and_stage_b_the_fused_passes():
    """Every tests/test_fp8_*.py (today's new ones too) is given to stage f's pytest; a file
    that runs on the GPU when there is one is selected whole, the others' tests named cuda."""
    tests = Path(gpu_check_stages.__file__).resolve().parent.parent / "tests"
    files = sorted(f"tests/{p.name}" for p in tests.glob("test_fp8_*.py"))
    assert files == gpu_check_stages.FP8_TESTS
    selected = gpu_check_stages.fp8_selection().split(" or ")
    assert selected[0] == "cuda" and "test_fp8_triton_quant" in selected
    assert "test_fp8_block_gemm" in selected and "test_fp8_layer" not in selected
    assert "tests/test_fused_passes.py" in gpu_check_stages.POINTER_TESTS


@pytest.mark.parametrize("rehearse", [False, True])
def test_stage_f_names_rows_skipped_for_time_and_decides(tmp_path, monkeypatch, rehearse):
    """On the GPU a row bench.gpu_fp8 skipped for time is named, not a failure; in the
    rehearsal (tiny shape) it is a problem, as is a layer row without a floor. The FP8 goal and
    floor rules read stage f's records."""
    check = gpu_check.Check(tmp_path, 420, rehearse=rehearse, carry=tmp_path)
    monkeypatch.setattr(gpu_check_stages, "_pytest", lambda *a, **k: True)

    def run(label, argv, limit, env=None):
        rows = [{"shape": "Mixtral", "d": 4096, "F": 14336, "candidate": c, "figure": f,
                 "value": v, "unit": "ms"}
                for c, f, v in (("layer bf16 torch", "fwd_bwd_ms", 30.0),
                                ("layer fp8 rowwise", "fwd_bwd_ms", 24.0),
                                ("layer fp8 rowwise", "measured_over_floor", 2.2),
                                ("layer fp8 blockwise", "skipped", "past --max-seconds 14"))]  # fmt: skip
        (check.work / "gpu-fp8.json").write_text(json.dumps({"records": rows}))
        return 0, ""

    monkeypatch.setattr(check, "run", run)
    status, detail = gpu_check_stages.stage_f(check, 40)
    assert status == "passed" and "rows skipped for time: Mixtral layer fp8 blockwise" in detail
    assert bool(check.problems) == rehearse
    if rehearse:
        assert "layer rows without a floor: bf16 torch" in check.problems[0]
    decided = "\n".join(gpu_check_stages.decide(check))
    assert "FP8 vs bf16 layer at Mixtral: fp8 rowwise 1.25x bf16 torch" in decided
    assert "over it: Mixtral fp8 rowwise 2.20x" in decided
