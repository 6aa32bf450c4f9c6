"""python -m moe.plan: the top layouts of a model on a cluster, with the code for each.

  python -m moe.plan --model qwen3-30b-a3b --nodes 2 --gpus-per-node 8 --gpu-mem 80 --tokens 4M
  python -m moe.plan profile --out cluster.json      # under torchrun: measure this cluster
  python -m moe.plan --model m6-tiny --cluster cluster.json --tokens 14K  # 512 x its 28

Every flag is checked before any work (a bad value: one error naming the flag and its bounds,
exit status 2), the model config and the --json / --plot destinations included.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from moe.plan.checks import bounded, output_problem, positive
from moe.plan.cluster import PRESETS, Cluster, preset
from moe.plan.models import default_seq_len, load_model
from moe.plan.report import figures_line, plot, table
from moe.plan.search import SearchSpace, search

_SUFFIX = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
MAX_TOKENS = 2**50  # a step's global batch


def tokens(text: str) -> int:
    """'4M' -> 4 * 2**20, '65536' -> 65536 (K, M, G: powers of 1024), in [1, 2**50]."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a token count like 4M or 65536: {text!r}")
    if (
        len(m.group(1).lstrip("0")) > 20
        or not 1 <= int(m.group(1)) * _SUFFIX[m.group(2)] <= MAX_TOKENS
    ):
        raise argparse.ArgumentTypeError(f"must be in [1, 2**50], got {text!r}")
    return int(m.group(1)) * _SUFFIX[m.group(2)]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m moe.plan", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="config.json path or a preset name")
    p.add_argument("--preset", default="h100", choices=sorted(PRESETS), help="datasheet node")
    p.add_argument("--cluster", help="a cluster file (python -m moe.plan profile) instead")
    p.add_argument("--nodes", type=positive(int, 2**16), default=1, help="in [1, 65536]")
    p.add_argument("--gpus-per-node", type=positive(int, 1024),
                   help="in [1, 1024]; default: the preset's (8)")  # fmt: skip
    p.add_argument("--gpu-mem", type=positive(float, 2**20),
                   help="GiB per device, in (0, 2**20] (default: the preset's)")  # fmt: skip
    p.add_argument("--tokens", type=tokens, required=True,
                   help="global batch tokens a step, in [1, 2**50]")  # fmt: skip
    p.add_argument("--seq-len", type=positive(int, 2**22),
                   help="tokens per sequence; default: an M6 config's own, else 4096")  # fmt: skip
    p.add_argument("--top", type=positive(int, 100), default=5, help="layouts to print (<= 100)")
    p.add_argument("--fp8", action="store_true",
                   help="also FP8 dispatch / experts, chosen per layout by predicted time (the "
                   "GEMMs at the FP8 rate against the quantization passes' bytes); each layout "
                   "says why FP8 or bf16")  # fmt: skip
    p.add_argument("--skew", type=bounded(float, 0, 10, open_low=False),
                   help="Zipf skew of expert loads, in [0, 10] (0: uniform)")  # fmt: skip
    p.add_argument("--capacity-factor", type=bounded(float, 0.1, 1e4, open_low=False),
                   action="append", help="also try this capacity factor, in [0.1, 1e4] "
                   "(tokens past it are dropped)")  # fmt: skip
    p.add_argument("--json", help="write the predictions as JSON here")
    p.add_argument("--plot", help="write the breakdown plot (PNG) here")
    return p


def cluster_of(args) -> Cluster:
    if args.cluster:
        c = Cluster.load(args.cluster)
        return c.with_nodes(args.nodes if args.nodes != 1 else c.nodes, args.gpus_per_node)
    changes = {"device_memory_gib": args.gpu_mem} if args.gpu_mem else {}
    return preset(args.preset, args.nodes, args.gpus_per_node, **changes)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["profile"]:
        from moe.plan.profile import main as profile_main

        return profile_main(argv[1:])
    p = parser()
    args = p.parse_args(argv)
    for flag in ("json", "plot"):
        problem = getattr(args, flag) and output_problem(f"--{flag}", getattr(args, flag))
        if problem:
            p.error(problem)
    try:
        spec = load_model(args.model)
        cluster = cluster_of(args)
        seq_len = args.seq_len or default_seq_len(args.model)
        space = SearchSpace(fp8=args.fp8, capacity_factors=(None, *(args.capacity_factor or ())))
        result = search(spec, cluster, args.tokens, seq_len, space=space, skew=args.skew,
                        top=args.top)  # fmt: skip
    except ValueError as e:
        p.error(str(e))
    print(f"moe.plan: {spec.name} ({spec.total_params():,} = {spec.total_params() / 1e9:.3g}B "
          "parameters, "
          f"{spec.active_params() / 1e9:.3g}B active) on {cluster.nodes} x "
          f"{cluster.gpus_per_node} {cluster.name}, {args.tokens:,} tokens "
          f"a step in sequences of {seq_len}; {result.searched:,} predictions")  # fmt: skip
    print(figures_line(cluster, args.cluster))
    print(table(result.fits))
    for i, pred in enumerate(result.fits, 1):
        print(f"\n# {i}: {pred.layout.short()}\n{pred.layout.code()}")
        print(f"# M6 example flags: {pred.layout.m6_flags()}")
        for note in pred.notes:  # with --fp8: why FP8 or bf16 (moe/plan/fp8.py)
            print(f"# {note}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([x.record() for x in result.fits], f, indent=1)
    if args.plot:
        plot(result.fits, args.plot, f"{spec.name} on {cluster.world} x {cluster.name}")
    return 0
