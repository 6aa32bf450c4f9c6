"""Starting the ranks of one layout: on the emulated two-tier network of bench/a2a (one node
namespace per pipeline stage, its dp x ep ranks on the node's loopback, stages joined by
tbf-shaped links), or on this machine's loopback."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from bench.a2a import netem
from bench.common import wait_ranks

ENTRY = "-mbench.pipeline"
REPO = Path(__file__).resolve().parents[2]

# names of this benchmark's namespaces and subnet, apart from those of bench.overlap /
# bench.alltoall (netem's defaults), so the benchmarks do not tear down each other's network
_OWN = {"NS_PREFIX": "moe-pp", "NS_SWITCH": "moe-ppsw", "SUBNET": "10.78.0"}


@contextlib.contextmanager
def _own_namespaces():
    saved = {k: getattr(netem, k) for k in _OWN}
    for k, v in _OWN.items():
        setattr(netem, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(netem, k, v)


def run_emulated(cfg: dict) -> dict:
    """The layout's ranks in pp namespaces (one per stage) joined by tbf links (root)."""
    pp, dp, ep = cfg["layout"]
    cfg = {**cfg, "emulate": (pp, dp * ep)}
    old = os.getcwd()
    os.chdir(REPO)  # `python -mbench.pipeline` in every namespace
    try:
        with _own_namespaces():
            return netem.run_emulated(cfg, entry=ENTRY)
    finally:
        os.chdir(old)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_loopback(cfg: dict) -> dict:
    """The layout's ranks as processes on this machine's loopback (gloo)."""
    pp, dp, ep = cfg["layout"]
    world = pp * dp * ep
    port = str(_free_port())
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(world):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "GLOO_SOCKET_IFNAME": "lo",
                "TORCH_CPP_LOG_LEVEL": "ERROR",
                "OMP_NUM_THREADS": "1",
            }
            cmd = [sys.executable, ENTRY, "--worker-config", json.dumps(cfg)]
            out = None if rank == 0 else subprocess.DEVNULL
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, cwd=REPO))
    except BaseException:
        for p in procs:
            p.kill()
        raise
    wait_ranks(procs, cfg["wall_limit"], "pipeline benchmark")
    return json.loads(Path(cfg["json"]).read_text())
