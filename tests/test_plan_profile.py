"""moe.plan profile (issue 48): under torchrun it measures the ranks, and its figures are
the ranks' agreed statistics (the repeat counts every rank runs, the median over ranks)."""

import os
import subprocess
import sys

from moe.plan import preset
from moe.plan.cluster import Cluster
from tests.distributed import free_port, run_ranks


def test_profile_under_torchrun_measures_the_ranks(tmp_path):
    """`python -m moe.plan profile` launched by torchrun joins a process group itself: the
    link between its 2 ranks and a collective call are measured, not kept from the preset.
    It says what it measures as it goes (rank 0) and no warning reaches the user."""
    out = tmp_path / "cluster.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), "-m", "moe.plan", "profile", "--out", str(out),
           "--d-model", "32", "--d-ff", "32", "--tokens", "16"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")  # (else torchrun warns that it sets it)
    done = subprocess.run(cmd, check=True, timeout=300, capture_output=True, text=True, env=env)
    steps = [line for line in done.stdout.splitlines() if line.startswith("moe.plan profile: ")]
    assert [s.split()[2] for s in steps[:4]] == ["1/4", "2/4", "3/4", "4/4"], done.stdout
    assert "wrote" in steps[4] and len(steps) == 5, done.stdout
    assert "Warning" not in done.stderr, done.stderr
    cluster = Cluster.load(out)
    assert (cluster.nodes, cluster.gpus_per_node) == (1, 2)
    assert "intra-node link" not in cluster.source and cluster.collective_latency > 0
    assert cluster.intra_bw != preset("h100").intra_bw


def _statistics_body(rank: int, world: int) -> tuple:
    from moe.plan import profile
    from moe.plan.overhead import _median_over_ranks

    medians = _median_over_ranks({"a": float(rank), "b": 10.0 * (world - rank) ** 2})
    profile._timed = lambda fn, repeats: 0.25 * (rank + 1)  # this rank's seconds per call
    return medians, profile._repeats_for(lambda: None, 1.0), profile._repeats_for(int, 1e-9)


def test_profile_figures_are_agreed_over_the_ranks():
    """Each overhead figure is its median over the ranks (the mean of the middle two of an
    even count), the same on every rank; a GEMM round's call count is the largest any rank
    asks for (1 s at 0.25 s a call: 4; at 0.5, 0.75, 1 s: 2, 2, 1), at least 1, so the
    ranks' barriers and collectives stay matched."""
    got = run_ranks(_statistics_body, 4, timeout=30)
    b = sorted(10.0 * (4 - r) ** 2 for r in range(4))
    assert all(g == ({"a": 1.5, "b": (b[1] + b[2]) / 2}, 4, 1) for g in got), got


def test_profile_figures_of_one_process_are_its_own():
    from moe.plan.overhead import _median_over_ranks

    figures = {"block_overhead": 1e-3, "moe_overhead": 2e-3}
    assert _median_over_ranks(figures) == figures
