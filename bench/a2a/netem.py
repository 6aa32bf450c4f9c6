"""Emulated two-tier network: N network namespaces joined by tbf-shaped veth links (root)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ENTRY = "-mbench.alltoall"  # python -mbench.alltoall: run from the repository root
NS_PREFIX = "moe-n"
NS_SWITCH = "moe-sw"
SUBNET = "10.77.0"


def _sh(cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd.split(), check=check, capture_output=True, text=True)


def netns_available() -> str | None:
    """None if network namespaces can be created here, else the reason."""
    if os.geteuid() != 0:
        return "not root (needs CAP_NET_ADMIN for ip netns / tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (apt-get install iproute2)"
    probe = f"{NS_PREFIX}probe"
    if _sh(f"ip netns add {probe}", check=False).returncode != 0:
        return "`ip netns add` failed (no privilege for network namespaces)"
    _sh(f"ip netns del {probe}", check=False)
    return None


def teardown_network(num_nodes: int) -> None:
    for k in range(num_nodes):
        _sh(f"ip netns del {NS_PREFIX}{k}", check=False)
    _sh(f"ip netns del {NS_SWITCH}", check=False)


def setup_network(
    num_nodes: int, rate_mbit: int, burst_kb: int, latency_ms: float, mtu: int = 1500
) -> None:
    """Namespaces moe-n0.. (one per node) on a bridge in moe-sw; tbf both ways on each link
    (tbf shapes each direction of a link on its own: the links are full duplex). mtu: of the
    veth links and the bridge."""
    teardown_network(num_nodes)  # leftovers of an interrupted run of this script
    tbf = f"tbf rate {rate_mbit}mbit burst {burst_kb}kb latency {latency_ms}ms"
    _sh(f"ip netns add {NS_SWITCH}")
    _sh(f"ip -n {NS_SWITCH} link add moe-br0 type bridge")
    _sh(f"ip -n {NS_SWITCH} link set moe-br0 up")
    for k in range(num_nodes):
        ns, node_if, sw_if = f"{NS_PREFIX}{k}", f"moe-v{k}", f"moe-b{k}"
        _sh(f"ip netns add {ns}")
        _sh(f"ip -n {ns} link set lo up")
        _sh(f"ip -n {ns} link add {node_if} type veth peer name {sw_if} netns {NS_SWITCH}")
        _sh(f"ip -n {ns} addr add {SUBNET}.{k + 1}/24 dev {node_if}")
        _sh(f"ip -n {ns} link set {node_if} mtu {mtu}")
        _sh(f"ip -n {NS_SWITCH} link set {sw_if} mtu {mtu}")
        _sh(f"ip -n {ns} link set {node_if} up")
        _sh(f"ip -n {NS_SWITCH} link set {sw_if} master moe-br0")
        _sh(f"ip -n {NS_SWITCH} link set {sw_if} up")
        _sh(f"tc -n {ns} qdisc add dev {node_if} root {tbf}")  # node -> network
        _sh(f"tc -n {NS_SWITCH} qdisc add dev {sw_if} root {tbf}")  # network -> node


def tbf_stats(num_nodes: int) -> str:
    out = []
    for k in range(num_nodes):
        for ns, dev in ((f"{NS_PREFIX}{k}", f"moe-v{k}"), (NS_SWITCH, f"moe-b{k}")):
            text = _sh(f"tc -s -n {ns} qdisc show dev {dev}", check=False).stdout
            out.append(f"{ns}/{dev}: " + " ".join(text.split()))
    return "\n".join(out)


def run_emulated(cfg: dict, entry: str = ENTRY) -> dict:
    """Run `entry --worker-config` (default: the all-to-all sweep) with N x L ranks in N
    namespaces joined by tbf-shaped veth links; returns the JSON rank 0 wrote to cfg['json']."""
    N, L = cfg["emulate"]
    setup_network(N, cfg["rate_mbit"], cfg["burst_kb"], cfg["latency_ms"], cfg.get("mtu", 1500))
    procs: list[subprocess.Popen] = []
    try:
        worker_cfg = {**cfg, "ranks_per_node": L}
        for rank in range(N * L):
            node = rank // L
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(N * L),
                "LOCAL_RANK": str(rank % L),
                "LOCAL_WORLD_SIZE": str(L),
                "MASTER_ADDR": f"{SUBNET}.1",
                "MASTER_PORT": "29611",
                "TORCH_CPP_LOG_LEVEL": "ERROR",
                "GLOO_SOCKET_IFNAME": f"moe-v{node}",
                "OMP_NUM_THREADS": "1",
            }
            cmd = [
                "ip",
                "netns",
                "exec",
                f"{NS_PREFIX}{node}",
                sys.executable,
                entry,
                "--worker-config",
                json.dumps(worker_cfg),
            ]
            out = None if rank == 0 else subprocess.DEVNULL
            procs.append(subprocess.Popen(cmd, env=env, stdout=out))
        deadline = time.monotonic() + cfg["wall_limit"]
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        stats = tbf_stats(N)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        teardown_network(N)
    bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    if bad:
        raise RuntimeError(f"emulated ranks failed (rank, exit code): {bad}")
    result = json.loads(Path(cfg["json"]).read_text())
    result["meta"]["tbf_stats"] = stats
    return result
