"""Every launch command and python snippet of README.md, examples/m6/README.md and
examples/hf/README.md, run as written so the docs cannot drift from the code.

Test-only rewrites (the only ones): training launches run at a tiny step count: an M6 or
examples/hf/multimodal.py `--steps N` (or none: the default) becomes `--steps 2 --stop-after 1`
(one step and its checkpoint, no final evaluation), `--steps 3 --stop-after 2` after
`--resume`; an HF launch (finetune.py, lora.py) gets `--steps 2`. Commands run in a
temporary working directory, in document order (so `--resume` continues the run above it), in process; `torchrun --nproc-per-node N`
commands on N gloo ranks (tests/distributed.py), all of one N in one rank start. Commands that
need what CI has not (a GPU, several nodes, the network, the suite itself) are listed in SKIP
with the reason; a command or snippet the docs gain is a failure here until it is classified.

Commands written inline in the prose (`python -m bench.rebalance`) are classified in PROSE:
run at a tiny size (the arguments added are listed), run with `--help` where the command is
too big for CI (its module and parser still must load), or skipped with the reason. They run
in process from a temporary directory (any directory: nothing relies on the repository root
as the working directory). What the docs show a command printing (an output block, an inline
printed line) is compared with what the command prints, at the documented size where it fits
CI, else marked so in OUTPUTS (issue 49 items 17 and 24).
"""

import ast
import io
import json
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from tests.distributed import run_ranks
from tests.docs_blocks import DOCS, ROOT, blocks, commands, inline_commands, outputs

GPU = "needs a GPU (run by tests/test_cuda.py and scripts/gpu_check.sh on GPU machines)"
SKIP = {
    "bash scripts/quickstart.sh": "installs packages (the network); its M6 run is run below",
    "bash .ci/run --quick": "is CI itself (the quick tier)",
    "python -m moe.plan --model qwen3-30b-a3b --nodes 2 --gpus-per-node 8 --gpu-mem 80 "
    "--tokens 4M": "the same command written in the README's prose runs (PROSE)",
    "python3 -m venv .venv && . .venv/bin/activate": "a new environment (quickstart.sh's)",
    ". .venv/bin/activate": "activates quickstart.sh's environment (this suite runs in CI's)",
    'pip install -e ".[examples]"': "installs packages (CI installs these extras)",
    "pip install torch --index-url https://download.pytorch.org/whl/cu128": "the network",
    "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu": "the network",
    'pip install -e ".[examples,hf,test]"': "installs packages (CI installs these extras)",
    'pip install -e ".[hf]"': "installs packages (CI installs these extras)",
    "python examples/m6/train.py --config m6-tiny-gpu": GPU,
    "torchrun --nproc-per-node 8 examples/m6/train.py --ep 8": GPU + " (8 GPUs, NCCL)",
    "python examples/hf/finetune.py --device cuda:1": GPU,
    "python examples/hf/finetune.py --device cuda": GPU,
    "python -m pytest -q tests": "is the suite itself",
    "scripts/gpu_check.sh": GPU,
    "scripts/gpu_check.sh --out results/": GPU,
    "scripts/gpu_carry.sh ~/src/tutel": "the network and a Tutel checkout",
    "scripts/gpu_check.sh --rehearse": "run by .ci/run before the suite",
    "torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:29500 examples/m6/train.py "
    "--config m6-base --experts 16 --ep 16 --data my_folder": "2 nodes x 8 ranks of m6-base",
}
TOO_BIG = "too big for CI: --help here (the module and its parser load)"
# Commands written inline in the prose -> ("run", extra arguments for a tiny size),
# ("help", why) or ("skip", why).
PROSE = {
    "python -m pytest tests/test_hf_contract.py -k qwen3_moe": ("skip", "the suite's own test"),
    "python -m tools.hf_support": ("help", "measures every family for minutes: " + TOO_BIG),
    "python3 -m venv": ("skip", "a fragment of the fenced venv command"),
    "bash .ci/run": ("skip", "is CI itself (the full run)"),
    "bash .ci/run tests/test_layer.py -x": ("skip", "is CI itself"),
    "python -m bench.alltoall": ("help", "spawns 8 ranks, minutes per size: " + TOO_BIG),
    "torchrun --nproc-per-node 8 -m bench.alltoall": ("skip", "8 ranks, minutes per size"),
    "python -m bench.alltoall --emulate 2x4": ("skip", "root: network namespaces and tc"),
    "python -m bench.alltoall --model-only": ("run", []),  # a projection: no ranks
    "python -m tools.token_path": ("skip", "tests/test_token_path.py runs it"),
    "python -m bench.budget": ("help", "every variant's step, a report: " + TOO_BIG),
    "torchrun --nproc-per-node 4 examples/m6/train.py --pp 2 --ep 2": (
        "skip",
        "4 pipeline ranks of M6: tests/test_m6_pipeline.py runs the example at --pp 2",
    ),
    "python -m bench.pipeline --ep2 --out bench/results/DATE-cpu-pipeline": (
        "help",
        "an emulated network (root, ip netns, tc), minutes",
    ),
    "python -m bench.plan_published": ("skip", "tests/test_plan.py runs its cases"),
    "python -m bench.plan_measured --emulate 2x2 --rates 100,400 --out "
    "bench/results/2026-12-06-cpu-plan-measured": ("skip", "an emulated network (root), hours"),
    "scripts/gpu_check.sh": ("skip", GPU),
    "python -m bench.alltoall --suite": ("help", "spawns 8 ranks, minutes per size: " + TOO_BIG),
    "python -m bench.rebalance": (
        "run",
        ["--ranks", "2", "--tokens", "32", "--d-model", "16", "--d-ff", "32"],
    ),  # fmt: skip
    "python -m bench.overlap": ("help", "an emulated network (root, ip netns, tc), minutes"),
    "python -m moe.trace.plot trace.jsonl out.png": ("run", []),  # the M6 run's trace, copied
    "torchrun --nproc-per-node 2 ... --ep 2": (
        "skip",
        "the fenced `torchrun --nproc-per-node 2 examples/hf/finetune.py --ep 2`, abbreviated",
    ),
    "python -m bench.hf_blocks": ("help", "times 3 shapes, writes bench/results/: " + TOO_BIG),
    "torchrun --nproc-per-node 4 examples/m6/train.py --dp 2 --ep 2": (
        "skip",
        "also fenced in examples/m6/README.md: run by test_torchrun_commands_run_on_gloo_ranks",
    ),
    "python examples/m6/train.py --config m6-1t --plan --world-size 480 --device-memory-gb 32 "
    "--offload optimizer --checkpointing": ("run", []),  # meta device: as written
    "python -m bench.NAME": ("skip", "a template (each bench module named in the docs runs)"),
    "torchrun --nproc-per-node N -m bench.NAME": ("skip", "a template"),
    "python -m bench.gpu_layer": ("help", GPU),
    "python -m tools.triton_aot_check": ("skip", "run by .ci/run (tests/test_aot_check.py)"),
    "torchrun --nproc-per-node 4 train.py --dp 2 --ep 2": (
        "skip",
        "the fenced `torchrun --nproc-per-node 4 examples/m6/train.py --dp 2 --ep 2`; its "
        "agreement with one process: tests/test_m6.py::test_two_ranks_match_single_process",
    ),
    "python train.py --micro-batch 16": ("run", []),  # examples/m6/train.py, tiny steps
    "python -m moe.trace.plot runs/m6-tiny/routing_trace.jsonl out.png": ("run", []),
    "python -m bench.pipeline": ("help", "an emulated network (root, ip netns, tc), minutes"),
    "python examples/m6/bench.py": ("help", "trains 4 models x 500 steps: " + TOO_BIG),
    "python -m moe.plan --model qwen3-30b-a3b --nodes 2 --gpus-per-node 8 --gpu-mem 80 "
    "--tokens 4M": ("run", []),  # a search on paper: seconds
    "python -m moe.plan profile --out cluster.json": ("run", ["--d-model", "64", "--d-ff", "64"]),
    "python -m bench.m6_fp8": ("help", "trains m6-tiny 500 steps x 3 seeds x 2: " + TOO_BIG),
    "python -m examples.launch": ("help", "torchrun's launcher: tests/test_launch.py runs it"),
    "python -m examples.launch --nproc-per-node 2 examples/m6/train.py --ep 2": (
        "skip",
        "2 M6 ranks under the launcher: tests/test_launch.py runs it (M6 and HF, a failing rank)",
    ),
}
# Python snippets that continue a program the reader has (named by a line they hold): each
# must still parse; the calls they make are tested where noted.
FRAGMENTS = {
    'dist.init_process_group("nccl"': "8 ranks on NCCL (tests/test_fsdp.py runs parallelize)",
    "report = moe.parallel.rebalance_experts": "a training loop on EP ranks (test_rebalance.py)",
    "moe.parallel.sum_replica_grads(model)": "a training loop with replicas (test_replicas.py)",
    "AutoModelForCausalLM.from_pretrained(path)": "a hub folder (tests/test_hf_example.py)",
    "loss = cross_entropy + moe.aux_loss(model)": "a line of examples/m6/train.py",
    "mesh = moe.pipeline.init_pipeline_mesh(pp=2": "4 ranks: tests/test_pipeline*.py run it",
    "AutoPeftModelForCausalLM.from_pretrained(folder)": "after examples/hf/lora.py: "
    "tests/test_hf_lora_example.py runs it as a file in a fresh process",
}


def _all_commands():
    return [(doc, c) for doc in DOCS for c in commands(doc)]


def _snippets():
    return [(doc, i, code) for doc in DOCS for i, code in enumerate(blocks(doc, "python"))]


def _argv(command: str, after_resume: bool = False) -> tuple[str, list[str]]:
    """(the script, its arguments with the step rewrite) of a python or torchrun command."""
    words = shlex.split(command)
    words = words[words.index(next(w for w in words if w.endswith(".py"))) :]
    script, argv = words[0], words[1:]
    resumable = script.endswith(("m6/train.py", "hf/multimodal.py"))
    if resumable and not {"--plan", "--help"} & set(argv):
        if "--steps" in argv:
            i = argv.index("--steps")
            del argv[i : i + 2]
        argv += ["--steps", "3", "--stop-after", "2"] if after_resume else ["--steps", "2",
                                                                           "--stop-after", "1"]  # fmt: skip
    elif script.endswith(("hf/finetune.py", "hf/lora.py")) and "--steps" not in argv:
        argv += ["--steps", "2"]
    return script, argv


def _launch(script: str, argv: list[str]) -> str:
    """Run one example command in process; its standard output."""
    out = io.StringIO()
    with redirect_stdout(out):
        if script.endswith("m6/train.py"):
            from examples.m6 import train

            if argv == ["--help"]:
                with pytest.raises(SystemExit) as done:
                    train.parse_args(argv)
                assert done.value.code == 0
            else:
                train.run(argv)
        elif script.endswith("hf/multimodal.py"):
            from examples.hf import multimodal

            multimodal.run(argv)
        elif script.endswith("hf/lora.py"):
            from examples.hf import lora

            assert lora.main(argv).get("same_tokens", True), "PEFT generated other tokens"
        else:
            from examples.hf import finetune

            finetune.main(argv)
    return out.getvalue()


def _my_folder(path) -> None:
    """The `--data my_folder` of the docs: a few images and a captions.jsonl."""
    from PIL import Image

    path.mkdir()
    lines = []
    for i in range(6):
        Image.new("RGB", (16, 12), color=(40 * i, 0, 255 - 40 * i)).save(path / f"{i}.png")
        lines.append(json.dumps({"image": f"{i}.png", "caption": f"a square number {i}"}))
    (path / "captions.jsonl").write_text("\n".join(lines) + "\n")


def test_every_command_and_snippet_is_classified():
    for doc, command in _all_commands():
        known = command in SKIP or command.startswith(("python examples/", "torchrun "))
        if command.startswith("pip install") and "-e ." in command.replace('"', ""):
            # an install line of the docs is run from the repository root inside the quick
            # start's environment: the line before it activates that (issue 49 item 16)
            before = commands(doc)[: commands(doc).index(command)]
            assert any("bin/activate" in c for c in before), f"{doc}: {command} without a venv"
        assert known, f"{doc}: a command tests/test_docs.py does not know: {command}"
        if command.startswith("torchrun ") and command not in SKIP:
            assert re.match(r"torchrun --nproc-per-node [24] examples/", command), command
    for doc, i, code in _snippets():
        ast.parse(code, f"{doc} python block {i}")  # every snippet parses, fragments too
    for line in FRAGMENTS:  # each listed fragment is still in the docs
        assert any(line in code for _, _, code in _snippets()), line


@pytest.fixture(scope="module")
def single_process_runs(tmp_path_factory):
    """Every single-process launch of the docs, run as written (with the step rewrite) in one
    temporary directory in document order: (that directory, {command: what it printed})."""
    tmp_path = tmp_path_factory.mktemp("docs")
    printed = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        mp.delenv("WORLD_SIZE", raising=False)
        _my_folder(tmp_path / "my_folder")
        for _, command in _all_commands():
            if command in SKIP or not command.startswith("python examples/"):
                continue
            script, argv = _argv(command, after_resume="--resume" in command)
            if "./my-mixtral" in argv:  # a local checkpoint: the first finetune's saved model
                os.replace(tmp_path / "runs" / "hf-finetune", tmp_path / "my-mixtral")
            printed[command] = _launch(script, argv)
    return tmp_path, printed


def test_single_process_commands_run_as_written(single_process_runs):
    _, printed = single_process_runs
    for command, out in printed.items():
        if "--resume" in command:
            assert "resuming from step 1 " in out, out
        if "--help" in command:
            assert "--offload" in out and "--spare-slots" in out
    assert len(printed) >= 12, list(printed)


# -- commands written inline in the prose (issue 49 item 17) ----------------------------------
def _prose_commands():
    return [(doc, c) for doc in DOCS for c in inline_commands(doc)]


def test_every_prose_command_is_classified():
    fenced = {c for _, c in _all_commands()}
    for doc, command in _prose_commands():
        assert command in PROSE, (
            f"{doc}: a prose command tests/test_docs.py does not know: {command}"
        )
        how, what = PROSE[command]
        assert how in ("run", "help", "skip"), command
        if how == "skip" and "also fenced" in what:
            assert command in fenced, command
        twin = re.match(r"the fenced `([^`]+)`", what) if how == "skip" else None
        if twin:
            assert twin.group(1) in fenced, (command, twin.group(1))
    for command in PROSE:  # no stale entries
        assert any(command == c for _, c in _prose_commands()), (
            f"not in the docs any more: {command}"
        )


def _run_main(target: str, argv: list[str], script: bool = False) -> str:
    """`python -m target argv` (or `python target argv` with script=True) in this process, as
    its __main__; what it printed. Exit status 0 (or none) required."""
    out = io.StringIO()
    saved = sys.argv
    sys.argv = [target, *argv]
    try:
        with redirect_stdout(out):
            try:
                if script:
                    runpy.run_path(str(ROOT / target), run_name="__main__")
                else:
                    runpy.run_module(target, run_name="__main__", alter_sys=True)
            except SystemExit as e:
                assert e.code in (0, None), (target, argv, e.code, out.getvalue())
    finally:
        sys.argv = saved
    return out.getvalue()


def test_prose_commands_run(single_process_runs, monkeypatch):
    """Each "run" command at a tiny size and each "help" one with --help, from the directory
    the docs' own M6 and finetune runs used (their trace is what the plot commands read)."""
    tmp_path, _ = single_process_runs
    monkeypatch.chdir(tmp_path)
    shutil.copy(tmp_path / "runs" / "m6-tiny" / "routing_trace.jsonl", tmp_path / "trace.jsonl")
    done = []
    for _, command in _prose_commands():
        how, extra = PROSE[command]
        if how == "skip" or command in done:
            continue
        words = shlex.split(command)
        if words[1] == "-m":
            target, argv, script = words[2], words[3:], False
        else:  # python train.py (from examples/m6) is examples/m6/train.py from anywhere
            path = words[1] if "/" in words[1] else f"examples/m6/{words[1]}"
            target, argv, script = path, words[2:], True
        if how == "help":
            out = _run_main(target, ["--help"], script)
            assert out.startswith("usage:"), (command, out[:200])
        elif target.endswith("m6/train.py"):
            out = _launch(*_argv(f"python {target} {' '.join(argv)}"))
            assert "parameters" in out, (command, out[:300])
        else:
            out = _run_main(target, [*argv, *extra], script)
            if target == "moe.trace.plot":
                png = Path(argv[1])
                assert png.stat().st_size > 1000, command
                png.unlink()
            if target == "bench.rebalance":
                assert "| load | E | W | max/mean before |" in out, out[:300]
        done.append(command)
    assert len(done) >= 10, done


def _ranks_body(rank, world, cwd, launches):
    os.makedirs(cwd, exist_ok=True)
    os.chdir(cwd)
    for script, argv in launches:
        _launch(script, argv)
    return len(launches)


@pytest.mark.parametrize("procs", [2, 4])
def test_torchrun_commands_run_on_gloo_ranks(tmp_path, procs):
    launches = [
        _argv(c)
        for _, c in _all_commands()
        if c not in SKIP and c.startswith(f"torchrun --nproc-per-node {procs} ")
    ]
    assert launches
    done = run_ranks(_ranks_body, procs, str(tmp_path), launches, timeout=300)
    assert done == [len(launches)] * procs


def _is_fragment(code: str) -> bool:
    return any(line in code for line in FRAGMENTS)


@pytest.mark.parametrize("doc, i", [(d, i) for d, i, code in _snippets() if not _is_fragment(code)])
def test_python_snippets_run_as_files(doc, i, tmp_path):
    """Each snippet saved as a file and run by a new python in an empty directory without
    PYTHONPATH, as from a fresh clone (moe installed, as the quick start installs it). The
    examples' READMEs are read inside the checkout: their snippets run as a file in the
    repository root would, with the checkout's examples/ beside them."""
    code = blocks(doc, "python")[i]
    (tmp_path / "snippet.py").write_text(code)
    if doc.startswith("examples/"):
        (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "snippet.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, f"{doc} python block {i}:\n{done.stderr[-4000:]}"


# -- what the docs show a command printing (issue 49 item 24) ----------------------------------
M6_PLAN = (
    "python examples/m6/train.py --config m6-1t --plan --world-size 480 --device-memory-gb 32 "
    "--offload optimizer --checkpointing --groups 4"
)


def _output_block(doc: str, first: str) -> list[str]:
    found = [b for b in outputs(doc) if b.startswith(first)]
    assert len(found) == 1, f"{doc}: {len(found)} output blocks start with {first!r}"
    return [" ".join(line.split()) for line in found[0].splitlines()]


def _missing_in_order(shown: list[str], printed: str) -> str | None:
    """The first line the docs show that the output lacks (in order; '...' lines skip), or
    None. Lines compare with whitespace collapsed."""
    lines = iter(" ".join(line.split()) for line in printed.splitlines())
    for want in shown:
        if want in ("...", ""):
            continue
        if not any(line == want for line in lines):
            return want
    return None


def test_the_m6_1t_plan_block_is_what_the_command_prints(single_process_runs):
    """At the documented size (meta device: nothing allocated): every line of the block."""
    _, printed = single_process_runs
    shown = _output_block("examples/m6/README.md", "m6-1t:")
    assert M6_PLAN in printed, "the block's command is no longer in the docs"
    missing = _missing_in_order(shown, printed[M6_PLAN])
    assert missing is None, f"documented, not printed: {missing!r}\n{printed[M6_PLAN]}"


def test_the_m6_1t_plan_figures_are_what_the_command_prints(single_process_runs):
    """Every number of the block (counts, GiB, the fit) is printed, line by line, in order."""
    _, printed = single_process_runs
    shown = _output_block("examples/m6/README.md", "m6-1t:")
    lines = iter(printed[M6_PLAN].splitlines())
    for want in shown:
        numbers = re.findall(r"\d[\d,.]*", want)
        if not numbers:
            continue
        assert any(re.findall(r"\d[\d,.]*", line) == numbers for line in lines), want


def test_the_m6_quick_start_output_block(single_process_runs):
    """The run's first lines (its settings, sizes and data) at the documented size. The rest of
    the block (500 steps: losses, tokens/s, the 95.8 % accuracy, the step-500 checkpoint) is not
    at CI's size: one step runs here; tests/test_m6.py checks accuracy above chance at 120 steps."""
    _, printed = single_process_runs
    shown = _output_block("examples/m6/README.md", "settings:")
    out = printed["python examples/m6/train.py"]
    lines = [" ".join(line.split()) for line in out.splitlines()]
    assert shown[0] in lines and shown[1].startswith("m6-tiny:") and shown[1] in lines, (
        shown[:2],
        out,
    )
    accuracy = re.search(r"held-out caption accuracy ([\d.]+)% \((\d+)/(\d+)\)", "\n".join(shown))
    assert accuracy and float(accuracy[1]) == pytest.approx(
        100 * int(accuracy[2]) / int(accuracy[3]), abs=0.05
    )


def _hf_said() -> str:
    return " ".join((ROOT / "examples/hf/README.md").read_text().split())


def test_the_finetune_first_loss_is_the_documented_one(single_process_runs):
    """ "the loss falling (4.2 -> 0.1 ...)": the first loss at any step count; the last one
    needs the documented ~200 steps (not at CI size: 2 steps here)."""
    _, printed = single_process_runs
    said = re.search(r"loss falling \((\d+\.\d) -> (\d+\.\d)", _hf_said())
    got = re.search(r"loss (\d+\.\d+) -> (\d+\.\d+)", printed["python examples/hf/finetune.py"])
    assert said and got, printed["python examples/hf/finetune.py"]
    assert f"{float(got[1]):.1f}" == said[1]


def test_the_finetune_reload_line_is_the_documented_one(single_process_runs):
    """The reload against our weights in transformers' own blocks is exact at any step count
    (0.00e+00, as documented); the difference to moe's layers is float32 rounding (its
    documented figure is from the ~200-step run)."""
    _, printed = single_process_runs
    said = re.search(
        r"`(transformers reloads it: max \|logit difference\| \S+ against our weights in "
        r"transformers' blocks)",
        _hf_said(),
    )
    assert said and "0.00e+00" in said[1], "the documented line is gone"
    out = " ".join(printed["python examples/hf/finetune.py"].split())
    assert said[1] in out, out
    rounding = re.search(r"(\S+) against moe's layers \(float32 rounding\)", out)
    assert rounding and float(rounding[1]) < 1e-4, out


EXTRAS = {"hf": ("transformers", "safetensors"), "examples": ("sklearn", "matplotlib")}


def _section_before(doc: str, code: str) -> str:
    """The doc's text from the heading above the block to the block's end."""
    text = (ROOT / doc).read_text()
    end = text.index(code) + len(code)
    start = text.rfind("\n#", 0, text.index(code))
    return text[max(start, 0) : end]


@pytest.mark.parametrize("doc, i", [(d, i) for d, i, _ in _snippets()])
def test_snippets_name_what_they_need(doc, i):
    """A snippet importing an extra's package (transformers, safetensors: [hf]; scikit-learn,
    matplotlib: [examples]) names that extra in its section or its own lines; one importing
    the checkout's `examples` package (not installed) says to run from the repository root,
    except in the examples' own READMEs, read inside the checkout. The snippets themselves run
    from a temporary directory (test_python_snippets_run_as_written)."""
    code = blocks(doc, "python")[i]
    section = _section_before(doc, code)
    imported = set(re.findall(r"^\s*(?:from|import)\s+(\w+)", code, re.M))
    for extra, packages in EXTRAS.items():
        if imported & set(packages) or (extra == "hf" and "from_pretrained" in code):
            named = re.search(rf"\[[\w,]*\b{extra}\b[\w,]*\]", section)
            assert named, f"{doc} python block {i} needs the [{extra}] extra and does not say so"
    if "examples" in imported and not doc.startswith("examples/"):
        assert "repository root" in section, f"{doc} python block {i} imports examples"
