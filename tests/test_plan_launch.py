"""The code moe.plan prints for a layout runs (issue 48): plan a 2-device cluster, then run the
top layout's printed calls on 2 gloo ranks, with pp = 1 on a transformers Mixtral converted by
from_hf and with pp = 2 on an nn.Sequential MoE stack, one training step each."""

from collections import OrderedDict
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moe
from moe.plan import SearchSpace, load_model, preset, search
from tests.distributed import run_ranks

transformers = pytest.importorskip("transformers")

SEQ, V, D = 16, 64, 16


def _codes():
    """The top layout's code with pp = 1 and with pp = 2 on 1 node of 2 devices."""
    spec = load_model("mixtral-tiny")
    cluster = preset("h100", 1, gpus_per_node=2)
    out = {}
    for pp in (1, 2):
        space = SearchSpace(pp=(pp,), schedules=("1F1B", "GPipe"))
        best = search(spec, cluster, 8 * SEQ, SEQ, space=space).best()
        out[pp] = best.layout
    return out


def _hf_model():
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=V, hidden_size=D, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    return moe.interop.from_hf(transformers.MixtralForCausalLM(cfg))


def _stack(**moe_settings):
    torch.manual_seed(0)
    blocks = [(f"b{i}", moe.MoELayer(D, 24, 4, top_k=2, **moe_settings)) for i in range(2)]
    head = nn.Linear(D, V)
    return nn.Sequential(OrderedDict([("embed", nn.Embedding(V, D)), *blocks, ("head", head)]))


def _body(rank, world, layouts):
    results = {}
    lay = layouts[1]
    model = _hf_model()
    names = {"model": model}  # the printed code imports what it needs
    exec(lay.code(), names)  # as printed
    x = torch.randint(V, (lay.micro_batch_seqs, SEQ), generator=torch.Generator().manual_seed(rank))
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    names["opt"].step()
    results["pp1"] = (lay.short(), float(loss.detach()))
    lay = layouts[2]

    def loss_fn(out, y):
        return F.cross_entropy(out.reshape(-1, V), y.reshape(-1))

    names = {"model": _stack(), "loss_fn": loss_fn}
    exec(lay.code(), names)  # as printed
    pipe = names["pipe"]
    rows = lay.microbatches * lay.micro_batch_seqs
    x = torch.randint(V, (rows, SEQ), generator=torch.Generator().manual_seed(1))
    out, losses = pipe.step(x, x)
    results["pp2"] = (lay.short(), None if losses is None else float(sum(losses)))
    # the other things a pp > 1 layout prints: recompute of this rank's first block, MoE-only
    # recompute, the overlapped exchange, FP8 dispatch (the model built with moe_settings)
    for i, change in enumerate(VARIANTS):
        varied = replace(lay, **change)
        names = {"loss_fn": loss_fn}
        lines = varied.code().splitlines()
        upto = next(i for i, line in enumerate(lines) if line.startswith("moe_settings"))
        exec("\n".join(lines[: upto + 1]), names)  # the imports and moe_settings
        names["model"] = _stack(**names["moe_settings"])
        exec(varied.code(), names)  # as printed
        out, losses = names["pipe"].step(x, x)
        results[f"variant{i}"] = None if losses is None else float(sum(losses))
    return results


VARIANTS = (
    {"recompute": "blocks:1"},
    {"recompute": "moe", "overlap": 2, "fp8_dispatch": True, "capacity_factor": 2.0},
    {"recompute": "full", "split": "params"},
)


def _public(code: str) -> list[str]:
    """The moe names the code uses that are not in their module's __all__."""
    import importlib
    import re
    import sys

    bad = []
    for module, name in re.findall(r"from (moe[\w.]*) import (\w+)", code):
        if name not in importlib.import_module(module).__all__:
            bad.append(f"{module}.{name}")
    for chain in re.findall(r"\b(moe(?:\.\w+)+)", code):
        *module, name = chain.split(".")
        if chain in sys.modules:  # a package the code imports (moe.memory, moe.pipeline)
            continue
        if name not in importlib.import_module(".".join(module)).__all__:
            bad.append(chain)
    return bad


def test_the_printed_code_names_public_names_only():
    base = _codes()
    for lay in [base[1], base[2]] + [replace(base[p], **c) for p in (1, 2) for c in VARIANTS]:
        assert _public(lay.code()) == [], lay.code()


def test_the_printed_launch_runs():
    layouts = _codes()
    assert layouts[1].pp == 1 and layouts[2].pp == 2
    got = run_ranks(_body, 2, layouts, timeout=120)
    for rank in range(2):
        short, loss = got[rank]["pp1"]
        assert short == layouts[1].short() and torch.isfinite(torch.tensor(loss))
    last = [got[r]["pp2"][1] for r in range(2)]
    assert last[0] is None and torch.isfinite(torch.tensor(last[1]))  # the last stage's loss
    for i in range(len(VARIANTS)):
        assert got[0][f"variant{i}"] is None and torch.isfinite(torch.tensor(got[1][f"variant{i}"]))
