"""The stages of bench/gpu_check.py. Each `stage_X(check, limit)` returns (status, detail) and
adds its figures to the check; under `check.rehearse` it runs the same plumbing on CPU."""

import glob
import json
import re
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path

from bench import gpu_decide, gpu_fp8

PY = sys.executable
POINTER_TESTS = [
    "tests/test_cuda.py",
    "tests/test_triton_kernels.py",
    "tests/test_cutlass_roles.py",
    "tests/test_fused_passes.py",  # its Triton kernels on the GPU when there is one
]
TMA_TESTS = ["tests/test_triton_hopper.py", "tests/test_triton_kernels.py"]
# every FP8 test file; stage f selects the tests that need CUDA (the rest run in CPU CI): those
# named for it (-k cuda) and every test of a file that runs on the GPU when there is one
_TESTS = Path(__file__).resolve().parent.parent / "tests"
FP8_TESTS = sorted(f"tests/{p.name}" for p in _TESTS.glob("test_fp8_*.py"))
ON_THE_GPU = re.compile(r"""["']cuda["'] if torch\.cuda\.is_available\(\)""")
FP8_SHAPES = "deepseek,mixtral,olmoe,qwen3"
REHEARSAL_SHAPE = "32/16/4/2/16"  # the smallest shape every candidate and role accepts
M6_SECONDS = 45  # issue 35: the GPU preset for a fixed 45 s
# The first GPU run's pointer-path tests took 66 s for 26 tests, mostly Triton compiles, one at a
# time; the GPU machine has 16 CPUs and pytest-xdist
XDIST_WORKERS = 8


def run_logged(log: Path, label: str, argv, limit: float, env: dict, cwd) -> tuple:
    """(exit status, or None when it ran past `limit`; its output), appended to `log`."""
    try:
        p = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=limit)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc = None
        out = "".join(
            x.decode() if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr)
        )
    with log.open("a") as f:
        f.write(f"\n===== {label}: {' '.join(map(str, argv))} -> {rc}\n{out[-20000:]}\n")
    return rc, out


def _site(check) -> Path:
    return check.work / "site"


def _wheels(check) -> list[str]:
    return sorted(glob.glob(str(check.carry / "wheels" / "*.whl")))


IMPORT_NAMES = {"py_cpuinfo": "cpuinfo"}  # wheel name -> module, where they differ


def _missing(wheels: list[str]) -> list[str]:
    """The wheels whose module this Python lacks (PYTHONPATH would shadow installed ones)."""
    keep = []
    for w in wheels:
        dist = Path(w).name.split("-")[0]
        if dist == "deepspeed" or find_spec(IMPORT_NAMES.get(dist, dist)) is None:
            keep.append(w)
    return keep


def stage_a(check, limit: float):
    """Versions; the carried peers installed; the AOT facts compiled with this triton."""
    import torch
    import triton

    cuda = torch.cuda.is_available()
    gpu = torch.cuda.get_device_name() if cuda else "none"
    cap = ".".join(map(str, torch.cuda.get_device_capability())) if cuda else "-"
    for name, value in (("gpu", gpu), ("capability", cap), ("torch", torch.__version__),
                        ("cuda", torch.version.cuda), ("triton", triton.__version__),
                        ("python", sys.version.split()[0])):  # fmt: skip
        check.figure("a", name, value)
    if not cuda and not check.rehearse:
        check.abort = "no CUDA (stage a)"
        return "failed", "CUDA is not available to torch: nothing to check on a GPU"
    notes = [_install_peers(check, limit / 3)]
    if check.rehearse:  # CI compiles the AOT facts just before the rehearsal: import them only
        rc, out = check.run("aot import", [PY, "-c", "import tools.triton_aot_check"], limit / 3)
        if rc != 0:
            check.problem(f"tools.triton_aot_check does not import: {out[-300:]}")
        return ("passed" if not check.problems else "failed"), "; ".join(notes)
    arch = "".join(cap.split("."))
    env = dict(check.env, TRITON_DEFAULT_FP_FUSION="1")  # as CI runs it
    argv = [PY, "-m", "tools.triton_aot_check", "--arch", arch]
    rc, out = check.run("AOT check", argv, limit / 2, env)
    check.figure("a", "aot_check_exit", rc)
    notes.append(f"AOT check sm_{arch}: exit {rc}")
    return ("passed" if rc == 0 else "failed"), "; ".join(notes)


def _install_peers(check, limit: float) -> str:
    """DeepSpeed and its dependency wheels into check.work/site; Tutel's build started."""
    wheels, tutel = _wheels(check), check.carry / "tutel"
    if not wheels and not tutel.is_dir():
        msg = f"no carried peers in {check.carry} (scripts/gpu_carry.sh): DeepSpeed, Tutel not run"
        if check.rehearse and check.carry.exists():
            check.problem(msg)
        return msg
    notes = []
    if wheels:
        tags = []
        if check.rehearse and sys.version_info[:2] != (3, 12):
            # the wheels are for the GPU machine's CPython 3.12: unpack them for 3.12; import
            # them here with this Python's own pydantic (the carried pydantic_core is cp312-only;
            # msgpack falls back to pure Python)
            tags = [
                "--python-version",
                "3.12",
                "--platform",
                "manylinux2014_x86_64",
                "--only-binary=:all:",
            ]
            wheels = [w for w in wheels if not Path(w).name.startswith("pydantic")]
            notes.append("pydantic, pydantic_core: cp312 wheels, their import checked on 3.12 only")
        elif not check.rehearse:
            wheels = _missing(wheels)
        argv = [PY, "-m", "pip", "install", "-q", "--no-index", "--no-deps", *tags,
                "--target", str(_site(check)), *wheels]  # fmt: skip
        rc, out = check.run("peer wheels", argv, limit)
        check.env["PYTHONPATH"] += f":{_site(check)}"
        notes.append(f"{len(wheels)} wheels installed (exit {rc})")
        if rc != 0:
            check.problem(f"carried wheels do not install: {out[-300:]}")
        notes.append(_import_deepspeed(check, limit))
    if tutel.is_dir():
        if not (tutel / "setup.py").is_file():
            check.problem(f"{tutel} has no setup.py: not a Tutel source snapshot")
        elif check.rehearse:
            notes.append("Tutel snapshot found (its CUDA build runs on the GPU machine only)")
        else:
            argv = [PY, "-m", "pip", "install", "-q", "--no-index", "--no-build-isolation", "--no-deps",
                    "--target", str(check.work / "tutel"), str(tutel)]  # fmt: skip
            log = (check.work / "tutel-build.log").open("w")
            check.background = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=check.env
            )
            check.env["PYTHONPATH"] += f":{check.work / 'tutel'}"
            notes.append("Tutel build started in the background")
    return "; ".join(notes)


def _import_deepspeed(check, limit: float) -> str:
    code = "import deepspeed.moe.layer, deepspeed; print(deepspeed.__version__)"
    rc, out = check.run("import deepspeed", [PY, "-c", code], limit)
    if rc == 0:
        return f"DeepSpeed {out.strip().splitlines()[-1]} imports"
    check.problem(f"carried DeepSpeed does not import: {out.strip()[-300:]}")
    return "DeepSpeed does not import"


def stop_background(check) -> None:
    if check.background is not None and check.background.poll() is None:
        check.background.kill()
        check.background.wait()


def _pytest(check, stage, label, files, limit, tma, select=()) -> bool | None:
    env = dict(check.env, MOE_TRITON_TMA="1" if tma else "0")
    # -v: each test's outcome is printed as it ends, so a run cut off by its limit still names
    # its failures (the first GPU run's 10 were nameless F's)
    args = ["--collect-only", "-q"] if check.rehearse else ["-v", "-p", "no:cacheprovider"]
    if not check.rehearse and find_spec("xdist") is not None:  # Triton compiles on 8 CPUs
        args += ["-n", str(XDIST_WORKERS)]
    rc, out = check.run(label, [PY, "-m", "pytest", *args, *select, *files], limit, env)
    failed = sorted(set(re.findall(r"(?:FAILED|ERROR) (tests/\S+)", out)))
    if failed:
        check.figure(stage, f"{label} failing tests", ", ".join(failed))
    counts = {
        k: int(v)
        for v, k in re.findall(
            r"(\d+) (passed|failed|errors?|skipped|deselected|tests? collected)", out
        )
    }
    for k, v in counts.items():
        check.figure(stage, f"{label} {k}", v, "tests")
    if check.rehearse:
        collected = sum(v for k, v in counts.items() if "collected" in k)
        collected -= counts.get("deselected", 0)  # -k: only what it selects
        if rc != 0 or collected <= 0:
            check.problem(f"{label}: the test selection does not collect (exit {rc})")
        return rc == 0
    return None if rc is None else rc == 0


def stage_b(check, limit: float):
    if check.rehearse:  # one collection of both selections (pytest's start-up is slow here)
        ok = _pytest(
            check, "b", "CUDA selection", sorted({*POINTER_TESTS, *TMA_TESTS}), limit, tma=True
        )
        return ("passed" if ok else "failed"), "collected only (no CUDA here)"
    pointer = _pytest(check, "b", "pointer path", POINTER_TESTS, limit * 2 / 3, tma=False)
    tma = _pytest(check, "b", "TMA path", TMA_TESTS, limit / 3, tma=True)
    check.tma_passed, check.pointer_passed = tma, pointer
    ok = pointer and tma
    word = {True: "passed", False: "failed", None: "timed out"}
    return ("passed" if ok else "failed"), f"pointer {word[pointer]}, TMA {word[tma]}"


def stage_c(check, limit: float):
    if check.background is not None:  # Tutel's build: give it until a fifth of this stage
        try:
            check.background.wait(timeout=max(limit / 5, 1))
        except subprocess.TimeoutExpired:
            stop_background(check)
        check.figure("c", "tutel build exit", check.background.returncode)
        with check.log.open("a") as f:
            f.write("\n===== Tutel build\n" + (check.work / "tutel-build.log").read_text()[-5000:])
    out_json = check.work / "gpu-layer.json"
    if check.rehearse:
        argv = ["--smoke-cpu", "--shapes", REHEARSAL_SHAPE]
    else:
        argv = ["--shapes", "all", "--no-compile", "--max-minutes", f"{(limit - 60) / 60:.1f}"]
    argv = [PY, "-m", "bench.gpu_layer", *argv, "--profile", "--json", str(out_json)]
    # pinned Triton configs (check.env): autotuning 6 configs per kernel and shape costs minutes
    check.figure("c", "triton configs", "pinned (MOE_TRITON_AUTOTUNE=0)")
    rc, out = check.run("gpu_layer", argv, limit, dict(check.env, OUT=str(check.out)))
    records = json.loads(out_json.read_text())["records"] if out_json.is_file() else []
    for r in records:
        check.figure("c", f"{r['candidate']} {r['figure']}", r["value"], r["unit"],
                     shape=r["shape"], d=r["d"], F=r["F"])  # fmt: skip
    check.layer_records = records
    failed = [r for r in records if r["figure"] == "failed"]
    if check.rehearse and (rc != 0 or failed or not records):
        check.problem(f"bench.gpu_layer smoke: exit {rc}, {len(failed)} failed rows")
    status = "passed" if rc == 0 and not failed else "failed"
    return status, f"exit {rc}; {len(records)} figures, {len(failed)} failed rows"


def fp8_selection(files=FP8_TESTS) -> str:
    """pytest -k for stage f: tests named for CUDA, and every test of a file that puts its
    tensors on the GPU when there is one (a module's name is one of its tests' keywords)."""
    whole = [Path(f).stem for f in files if ON_THE_GPU.search((_TESTS.parent / f).read_text())]
    return " or ".join(["cuda", *whole])


FP8_TESTS_SHARE = 0.35  # of stage f's limit; gpu_fp8 gets what the tests leave
FP8_ROW_S = 20  # the longest layer row on the GPU (first Triton compiles, a profile): no new
# row starts later than this before the stage's end


def stage_f(check, limit: float):
    """The FP8 CUDA tests, then bench.gpu_fp8 (FP8 against bf16 grouped GEMMs and every FP8
    layer variant, each beside bench.budget's floor) at the four shapes; in the rehearsal: the
    tests collected, every row on CPU at a tiny shape."""
    start = time.monotonic()
    ok = _pytest(check, "f", "FP8 CUDA tests", FP8_TESTS, limit * FP8_TESTS_SHARE, tma=False,
                 select=("-k", fp8_selection()))  # fmt: skip
    left = limit - (time.monotonic() - start) - 2
    out_json = check.work / "gpu-fp8.json"
    if check.rehearse:
        argv = ["--smoke-cpu", "--shapes", REHEARSAL_SHAPE]
    else:
        # the FP8 goal's shapes first (the first run reached two shapes of four)
        argv = ["--shapes", FP8_SHAPES, "--max-seconds", f"{max(left - FP8_ROW_S, 1):.0f}"]
    argv += ["--profile"]
    argv = [PY, "-m", "bench.gpu_fp8", *argv, "--json", str(out_json)]
    rc, out = check.run("gpu_fp8", argv, left)
    records = json.loads(out_json.read_text())["records"] if out_json.is_file() else []
    for r in records:
        check.figure("f", f"{r['candidate']} {r['figure']}", r["value"], r["unit"],
                     shape=r["shape"], d=r["d"], F=r["F"])  # fmt: skip
    check.fp8_records = records
    failed = [r for r in records if r["figure"] == "failed"]
    skipped = [f"{r['shape']} {r['candidate']}" for r in records if r["figure"] == "skipped"]
    if check.rehearse:
        floors = {r["candidate"] for r in records
                  if r["figure"].startswith("floor_ms") and isinstance(r["value"], float)}  # fmt: skip
        missing = [v for v in gpu_fp8.LAYERS if f"layer {v}" not in floors]
        if rc != 0 or failed or skipped or not records or missing:
            check.problem(f"bench.gpu_fp8 smoke: exit {rc}, {len(failed) + len(skipped)} bad "
                          f"rows, layer rows without a floor: {', '.join(missing) or 'none'}")  # fmt: skip
    word = {True: "passed", False: "failed", None: "timed out"}[ok]
    status = "passed" if ok and rc == 0 and not failed else "failed"
    late = f", rows skipped for time: {', '.join(skipped)}" if skipped else ""
    return status, f"FP8 CUDA tests {word}; gpu_fp8 exit {rc}, {len(records)} figures{late}"


def cpu_m6_tokens_per_s():
    """The 1-rank MoE m6-tiny tokens/s of the newest bench/results/*-cpu-m6.md, and the file."""
    files = sorted(Path(__file__).parent.glob("results/*-cpu-m6.md"))
    for path in reversed(files):
        for line in path.read_text().splitlines():
            cells = [c.strip() for c in line.split("|")]
            if len(cells) > 7 and cells[1] == "MoE" and cells[2] == "1":
                return float(cells[6].replace(",", "")), path.name
    return None, None


def stage_d(check, limit: float):
    run_dir = check.work / "m6"
    if check.rehearse:
        extra = ["--device", "cpu", "--global-batch", "64", "--max-seconds", "2"]
    else:
        extra = ["--device", "cuda", "--max-seconds", str(M6_SECONDS)]
    argv = [PY, "examples/m6/train.py", "--config", "m6-tiny-gpu", *extra, "--count-syncs",
            "--no-plots", "--quiet", "--eval-every", "1000000", "--run-dir", str(run_dir)]  # fmt: skip
    rc, out = check.run("M6 GPU preset", argv, limit)
    summary_path = run_dir / "summary.json"
    if rc != 0 or not summary_path.is_file():
        if check.rehearse:
            check.problem(f"M6 preset run: exit {rc}")
        return "failed", f"exit {rc}"
    s = json.loads(summary_path.read_text())
    steps = s["steps_this_run"]
    syncs = s["host_syncs"] / steps if s["host_syncs"] is not None and steps else None
    cpu, source = cpu_m6_tokens_per_s()
    check.figure(
        "d",
        "m6-tiny-gpu tokens/s",
        s["tokens_per_s"],
        "tokens/s",
        seconds=round(s["time_s"], 1),
        steps=steps,
    )
    steady = s.get("steady_tokens_per_s")
    check.figure("d", "m6-tiny-gpu tokens/s after the first read-back", steady, "tokens/s",
                 excludes="the first steps' kernel compiles")  # fmt: skip
    check.figure("d", "m6-tiny-gpu held-out caption accuracy", s["caption_accuracy"], "fraction")
    check.figure(
        "d", "m6-tiny-gpu host syncs per step", syncs, "syncs", counted="cuda sync debug mode"
    )
    check.figure("d", "m6-tiny (CPU preset) tokens/s, 2-core CPU", cpu, "tokens/s", source=source)
    check.m6 = (steady or s["tokens_per_s"], cpu, syncs)
    if cpu is None:
        check.problem("no CPU M6 figure in bench/results/*-cpu-m6.md")
    return "passed", f"{steps} steps in {s['time_s']:.0f} s"


def decide(check) -> list[str]:
    """The decision rules (bench/gpu_decide.py) on what was measured; nothing in a rehearsal."""
    records = getattr(check, "layer_records", [])
    tma, why = gpu_decide.tma_decision(records, getattr(check, "tma_passed", None))
    lines = [f"TMA default on sm_90: {'yes' if tma else 'no'} ({why})"]
    passed = getattr(check, "pointer_passed", None)
    table, changes = gpu_decide.role_decision(records, passed, tma)
    lines.append("GEMM roles (moe/kernels/gemm_roles.py): " + ("; ".join(changes) or "no change"))
    layer = gpu_decide.cutlass_layer_rows(records)
    lines.append("Layer with every role on CUTLASS: " + ("; ".join(layer) or "not measured"))
    keep, why = gpu_decide.m6_decision(*getattr(check, "m6", (None, None, None)))
    lines.append(f"M6 GPU preset batch and width: {'keep' if keep else 'review'} ({why})")
    fp8 = getattr(check, "fp8_records", [])
    lines += [*gpu_decide.fp8_decision(fp8), gpu_decide.floor_decision(fp8)]
    if check.rehearse:
        lines = [f"(rehearsal: no timings) {line}" for line in lines]
    return lines
