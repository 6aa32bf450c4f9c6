"""Alpha-beta cost model of one all-to-all, flat vs hierarchical (2D), and the "auto" choice.

Per rank and per exchange of S bytes (the rank's whole send buffer) over N nodes x L ranks
(W = N * L):
  flat:          a_coll + (L-1) a_intra + (W-L) a_inter + S (L-1)/W / bw_intra
                 + S (W-L)/W / bw_inter
  hierarchical:  2 a_coll + (L-1) a_intra + (N-1) a_inter + S (L-1)/L / bw_intra
                 + 2 S / bw_copy (two re-layouts) + S (N-1)/N / bw_inter
The count exchange adds one collective of W messages to flat, and a ring all_gather (one
collective of W-1 steps of a_ring) to hierarchical. Hierarchical saves per-message costs and
pays extra intra-node bytes and copies, so it wins only below a crossover size.

A model comes from documented defaults (NVLINK_IB) or from a benchmark run (CostModel.fit on
measured times, saved with save_profile / read back with load_profile: a small JSON file).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from moe.settings import check_path
from moe.untrusted import read_json

PROFILE_VERSION = 1
_MAX_PROFILE_BYTES = 1 << 16


# Physical ranges of a profile's values. A latency of a second per message or call is far
# beyond any interconnect (NCCL: microseconds) and a bandwidth of 1 kB/s is far below any; the
# upper bound, 100 TB/s, is about ten times an HBM3e stack's read + write rate. Values outside
# are a broken or hostile profile: 1e308 or 1e-320 would turn the crossover into inf - inf.
MAX_LATENCY_S = 1.0
MIN_BANDWIDTH = 1e3
MAX_BANDWIDTH = 1e14


def check_physical_ranges(values: dict[str, object]) -> None:
    """Raise ValueError naming the first field that is not a finite number in its range:
    alphas (a_*) are seconds in [0, MAX_LATENCY_S], bandwidths (bw_*) bytes/s in
    [MIN_BANDWIDTH, MAX_BANDWIDTH]. Used on every CostModel, built, fitted or loaded."""
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"CostModel.{name} must be a finite number, got {v!r}")
        if name.startswith("bw"):
            if not MIN_BANDWIDTH <= v <= MAX_BANDWIDTH:
                raise ValueError(
                    f"CostModel.{name}={v!r} B/s is outside the physical range "
                    f"[{MIN_BANDWIDTH:g}, {MAX_BANDWIDTH:g}] B/s"
                )
        elif not 0 <= v <= MAX_LATENCY_S:
            raise ValueError(
                f"CostModel.{name}={v!r} s is outside the physical range [0, {MAX_LATENCY_S:g}] s"
            )


@dataclass(frozen=True)
class CostModel:
    """Alpha (seconds per call or message) and beta (bytes per second) terms of one rank.

    a_coll: fixed cost per collective call; a_intra / a_inter: per message inside a node /
    across nodes; bw_intra / bw_inter: bytes/s one rank gets inside a node / on the network;
    bw_copy: bytes/s of a local re-layout; a_ring: one step of a ring all_gather.
    Every value must lie in its physical range (check_physical_ranges): alphas in
    [0, MAX_LATENCY_S], bandwidths in [MIN_BANDWIDTH, MAX_BANDWIDTH].
    """

    a_coll: float
    a_intra: float
    bw_intra: float
    a_inter: float
    bw_inter: float
    bw_copy: float
    a_ring: float

    def __post_init__(self) -> None:
        check_physical_ranges({f.name: getattr(self, f.name) for f in fields(self)})

    def vector(self) -> np.ndarray:
        """Unknowns in the order of flat_terms / hier_terms (bandwidths inverted)."""
        return np.array(
            [
                self.a_coll,
                self.a_intra,
                1 / self.bw_intra,
                self.a_inter,
                1 / self.bw_inter,
                1 / self.bw_copy,
                self.a_ring,
            ]
        )

    def flat_time(self, S: float, N: int, L: int, counts: bool = False) -> float:
        """Predicted seconds of a flat exchange of S bytes per rank (counts: + count exchange)."""
        return float(flat_terms(S, N, L, counts) @ self.vector())

    def hier_time(self, S: float, N: int, L: int, K: int = 1, counts: bool = False) -> float:
        """Predicted seconds of the 2D exchange with K pipeline chunks (stages overlap)."""
        fixed, intra, inter = (t @ self.vector() for t in hier_terms(S, N, L, K, counts))
        return float(fixed + max(intra, inter) + min(intra, inter) / K)

    def crossover_bytes(self, N: int, L: int) -> int:
        """Largest S (bytes per rank) at which hierarchical (1 chunk, data only) is predicted
        to be at least as fast as flat; 0 when it never is, and for a single node or L = 1."""
        if N < 2 or L < 2:
            return 0
        diff0 = self.hier_time(0, N, L) - self.flat_time(0, N, L)  # fixed-cost difference
        slope = self.hier_time(1, N, L) - self.flat_time(1, N, L) - diff0  # per byte
        if diff0 > 0:
            return 0
        if slope <= 0:
            return 1 << 62
        return int(-diff0 / slope)

    def choose(self, nbytes: int, N: int, L: int) -> str:
        """ "hierarchical" when 0 < crossover_bytes(N, L) and S <= it, else "flat". A pure
        function of values every rank shares (nbytes: the same on all ranks, e.g. max over ranks)."""
        c = self.crossover_bytes(N, L)
        return "hierarchical" if c > 0 and nbytes <= c else "flat"

    @classmethod
    def fit(cls, samples: Iterable[tuple[np.ndarray, float]]) -> CostModel:
        """Non-negative least-squares fit from (coefficient row, measured seconds) pairs.

        Rows come from flat_terms / hier_terms (hierarchical: sum of the three parts, i.e. one
        chunk, nothing overlapped). Rows are weighted by 1/time (relative error). Unknowns no
        sample exercises come out 0 (alphas) or MAX_BANDWIDTH (bandwidths); a fit outside the
        physical ranges is a ValueError naming the field.
        """
        pairs = list(samples)
        if not pairs:
            raise ValueError("CostModel.fit needs at least one sample")
        A = np.array([np.asarray(row, dtype=np.float64) for row, _ in pairs])
        b = np.array([float(t) for _, t in pairs])
        if A.ndim != 2 or A.shape[1] != 7:
            raise ValueError(f"each sample row must have 7 coefficients, got shape {A.shape}")
        if np.any(~np.isfinite(b)) or np.any(b <= 0):
            raise ValueError("measured times must be positive and finite")
        theta = nnls(A / b[:, None], np.ones_like(b))
        inv = [max(float(v), 1 / MAX_BANDWIDTH) for v in theta]
        return cls(
            float(theta[0]), float(theta[1]), 1 / inv[2], float(theta[3]), 1 / inv[4],
            1 / inv[5], float(theta[6]),
        )  # fmt: skip


def flat_terms(S: float, N: int, L: int, counts: bool = False) -> np.ndarray:
    """Coefficients of [a_coll, a_intra, 1/bw_intra, a_inter, 1/bw_inter, 1/bw_copy, a_ring]."""
    W = N * L
    row = np.array([1.0, L - 1, S * (L - 1) / W, W - L, S * (W - L) / W, 0.0, 0.0])
    if counts:
        row += np.array([1.0, L - 1, 0, W - L, 0, 0, 0])
    return row


def hier_terms(S: float, N: int, L: int, K: int = 1, counts: bool = False):
    """(fixed, intra-node, network) coefficient rows of the hierarchical exchange."""
    W = N * L
    fixed = K * np.array([2.0, L - 1, 0, N - 1, 0, 0, 0])
    if counts:
        fixed = fixed + np.array([1.0, 0, 0, 0, 0, 0, W - 1])
    intra = np.array([0.0, 0, S * (L - 1) / L, 0, 0, 2 * S, 0])
    inter = np.array([0.0, 0, 0, 0, S * (N - 1) / N, 0, 0])
    return fixed, intra, inter


def nnls(A: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares by trying every support (7 unknowns: 127 subsets)."""
    best, best_err = np.zeros(A.shape[1]), float(np.sum(b**2))
    for k in range(1, A.shape[1] + 1):
        for support in itertools.combinations(range(A.shape[1]), k):
            sol, *_ = np.linalg.lstsq(A[:, support], b, rcond=None)
            if np.any(sol < 0):
                continue
            err = float(np.sum((A[:, support] @ sol - b) ** 2))
            if err < best_err:
                best_err, best = err, np.zeros(A.shape[1])
                best[list(support)] = sol
    return best


# H100-class cluster. Bandwidths: NVLink 4 is 900 GB/s bidirectional per H100 = 450 GB/s per
# direction (NVIDIA H100 datasheet); one 400 Gb/s ConnectX-7 NDR NIC per GPU = 50 GB/s (NVIDIA
# ConnectX-7 datasheet); HBM3 3.35 TB/s read + write = ~1.5 TB/s re-layout. The alphas are
# assumptions of typical NCCL overheads, not measurements; fit a profile for your cluster.
NVLINK_IB = CostModel(
    a_coll=15e-6,  # NCCL launch + group synchronisation per collective
    a_intra=1.5e-6,  # per NVLink peer message
    bw_intra=450e9,
    a_inter=4e-6,  # per RDMA message incl. NCCL proxy overhead
    bw_inter=50e9,
    bw_copy=1.5e12,
    a_ring=4e-6,  # one ring step of NCCL all_gather across nodes
)


def save_profile(model: CostModel, path: str | Path, meta: dict | None = None) -> None:
    """Write the model as a small JSON profile (with optional metadata, e.g. the machine)."""
    doc = {"version": PROFILE_VERSION, "model": asdict(model), "meta": meta or {}}
    Path(path).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def load_profile(path: str | Path) -> CostModel:
    """Read a profile written by save_profile; every field checked (ValueError naming it)."""
    check_path("cost profile", str(path))  # one ValueError, not a raw OSError (too long, NUL)
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"cost profile {str(p)!r} is not a file")
    doc = read_json(p, _MAX_PROFILE_BYTES, error=ValueError, what="cost profile")  # untrusted
    if not isinstance(doc, dict) or doc.get("version") != PROFILE_VERSION:
        raise ValueError(f"cost profile {str(p)!r}: 'version' must be {PROFILE_VERSION}")
    model = doc.get("model")
    names = {f.name for f in fields(CostModel)}
    if not isinstance(model, dict) or set(model) != names:
        raise ValueError(f"cost profile {str(p)!r}: 'model' must have exactly {sorted(names)}")
    return CostModel(**model)
