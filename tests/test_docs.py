"""Every launch command and python snippet of README.md, examples/m6/README.md and
examples/hf/README.md, run as written so the docs cannot drift from the code.

Test-only rewrites (the only ones): training launches run at a tiny step count: an M6
`--steps N` (or none: the default 500) becomes `--steps 2 --stop-after 1` (one step and its
checkpoint, no final evaluation), `--steps 3 --stop-after 2` after `--resume`; a finetune
launch gets `--steps 2`. Commands run in a temporary working directory, in document order
(so `--resume` continues the run above it), in process; `torchrun --nproc-per-node N`
commands on N gloo ranks (tests/distributed.py), all of one N in one rank start. Commands that
need what CI has not (a GPU, several nodes, the network, the suite itself) are listed in SKIP
with the reason; a command or snippet the docs gain is a failure here until it is classified.
"""

import ast
import io
import json
import os
import re
import shlex
from contextlib import redirect_stdout

import pytest
import torch

from tests.distributed import run_ranks
from tests.docs_blocks import DOCS, blocks, commands

GPU = "needs a GPU (run by tests/test_cuda.py and scripts/gpu_check.sh on GPU machines)"
SKIP = {
    "bash scripts/quickstart.sh": "installs packages (the network); its M6 run is run below",
    "bash .ci/run": "is CI itself",
    "python3 -m venv .venv && . .venv/bin/activate": "a new environment (quickstart.sh's)",
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
# Python snippets that continue a program the reader has (named by a line they hold): each
# must still parse; the calls they make are tested where noted.
FRAGMENTS = {
    'dist.init_process_group("nccl"': "8 ranks on NCCL (tests/test_fsdp.py runs parallelize)",
    "report = moe.parallel.rebalance_experts": "a training loop on EP ranks (test_rebalance.py)",
    "moe.parallel.sum_replica_grads(model)": "a training loop with replicas (test_replicas.py)",
    "AutoModelForCausalLM.from_pretrained(path)": "a hub folder (tests/test_hf_example.py)",
    "loss = cross_entropy + moe.aux_loss(model)": "a line of examples/m6/train.py",
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
    if script.endswith("m6/train.py") and not {"--plan", "--help"} & set(argv):
        if "--steps" in argv:
            i = argv.index("--steps")
            del argv[i : i + 2]
        argv += ["--steps", "3", "--stop-after", "2"] if after_resume else ["--steps", "2",
                                                                           "--stop-after", "1"]  # fmt: skip
    elif script.endswith("hf/finetune.py") and "--steps" not in argv:
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
        assert known, f"{doc}: a command tests/test_docs.py does not know: {command}"
        if command.startswith("torchrun ") and command not in SKIP:
            assert re.match(r"torchrun --nproc-per-node [24] examples/", command), command
    for doc, i, code in _snippets():
        ast.parse(code, f"{doc} python block {i}")  # every snippet parses, fragments too
    for line in FRAGMENTS:  # each listed fragment is still in the docs
        assert any(line in code for _, _, code in _snippets()), line


def test_single_process_commands_run_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    _my_folder(tmp_path / "my_folder")
    ran = []
    for _, command in _all_commands():
        if command in SKIP or not command.startswith("python examples/"):
            continue
        script, argv = _argv(command, after_resume="--resume" in command)
        if "./my-mixtral" in argv:  # a local checkpoint: the first finetune's saved model
            os.replace(tmp_path / "runs" / "hf-finetune", tmp_path / "my-mixtral")
        out = _launch(script, argv)
        if "--resume" in argv:
            assert "resuming from step 1 " in out, out
        if "--help" in argv:
            assert "--offload" in out and "--spare-slots" in out
        ran.append(command)
    assert len(ran) >= 12, ran


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
def test_python_snippets_run_as_written(doc, i, tmp_path, monkeypatch):
    code = blocks(doc, "python")[i]
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    exec(compile(code, f"{doc} python block {i}", "exec"), {"__name__": "__docs__"})
