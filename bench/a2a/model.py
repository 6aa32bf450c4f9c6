"""Fit of the library's cost model (moe.comm.cost_model) to a benchmark run, the model check
against the emulated network, and the projection for real fabrics."""

from __future__ import annotations

import numpy as np

from bench.a2a.tables import busbw
from moe.comm.alltoall import pipeline_chunks
from moe.comm.cost_model import MAX_BANDWIDTH, NVLINK_IB, CostModel, flat_terms, hier_terms, nnls

GPU_CLUSTER = NVLINK_IB


def predict_flat(m: CostModel, S: float, N: int, L: int, counts: bool = False) -> float:
    return m.flat_time(S, N, L, counts)


def predict_hier(m: CostModel, S: float, N: int, L: int, K: int = 1, counts: bool = False):
    return m.hier_time(S, N, L, K, counts)


def fit_model(loopback: dict, emulated: dict) -> CostModel:
    """Fit on the loopback run (raw, hier*, full flat and hier) and emulated raw only; every
    hierarchical and every full-call measurement of the emulated run is left for the check.

    On one host both 2D stages are loopback traffic on the same CPU, so their network terms
    move to the intra-node columns and nothing overlaps. Rows are weighted by 1/time, so the
    fit minimises relative error.
    """
    A, b = [], []
    Wl, Ll = loopback["meta"]["world_size"], loopback["meta"]["ranks_per_node"]

    def one_host(row: np.ndarray) -> np.ndarray:
        return np.array([row[0], row[1] + row[3], row[2] + row[4], 0, 0, row[5], row[6]])

    for row in loopback["rows"]:
        S, t, K = row["size"], row["time_us"], row["chunks"]
        A.append(flat_terms(S, 1, Wl, False))
        b.append(t["raw"])
        A.append(flat_terms(S, 1, Wl, True))
        b.append(t["flat"])
        for counts, name in ((False, "hier*"), (True, "hier")):
            A.append(one_host(sum(hier_terms(S, Wl // Ll, Ll, K, counts))))
            b.append(t[name])
    We, Le = emulated["meta"]["world_size"], emulated["meta"]["ranks_per_node"]
    for row in emulated["rows"]:
        A.append(flat_terms(row["size"], We // Le, Le, False))
        b.append(row["time_us"]["raw"])
    A_, b_ = np.array(A), np.array(b) * 1e-6
    theta = nnls(A_ / b_[:, None], np.ones_like(b_))
    inv = [max(v, 1 / MAX_BANDWIDTH) for v in theta]  # unexercised: at the physical bound
    return CostModel(theta[0], theta[1], 1 / inv[2], theta[3], 1 / inv[4], 1 / inv[5], theta[6])


def model_check(model: CostModel, emulated: dict) -> list[dict]:
    """Predicted vs measured flat/hier time ratio (= hier/flat busbw) at every emulated size."""
    N = emulated["meta"]["world_size"] // emulated["meta"]["ranks_per_node"]
    L = emulated["meta"]["ranks_per_node"]
    out = []
    for row in emulated["rows"]:
        S, t, K = row["size"], row["time_us"], row["chunks"]
        entry = {"size": S, "chunks": K}
        for label, counts, f, h in (
            ("data", False, "flat*", "hier*"),
            ("full", True, "flat", "hier"),
        ):
            pf = predict_flat(model, S, N, L, counts)
            ph = predict_hier(model, S, N, L, K, counts)
            measured = t[f] / t[h]
            entry[label] = {
                "pred_flat_us": pf * 1e6,
                "pred_hier_us": ph * 1e6,
                "pred_ratio": pf / ph,
                "meas_ratio": measured,
                "rel_err": (pf / ph) / measured - 1,
            }
        out.append(entry)
    return out


def projection(model: CostModel, N: int, L: int, sizes: list[int]) -> list[dict]:
    rows = []
    for S in sizes:
        K = pipeline_chunks(S, N)
        r = {"size": S, "chunks": K}
        for counts, tag in ((False, "data"), (True, "full")):
            f = predict_flat(model, S, N, L, counts)
            h = predict_hier(model, S, N, L, K, counts)
            r[tag] = (f * 1e6, h * 1e6, f / h)
        rows.append(r)
    return rows


def projection_table(model: CostModel, N: int, L: int, sizes: list[int]) -> str:
    """Predicted busbw of flat and hierarchical (reused plan) per size; a projection."""
    W = N * L
    lines = [
        f"Projection for {N} nodes x {L} GPUs (W = {W}):",
        "",
        "| size (B) | flat busbw (GB/s) | hier busbw (GB/s) | hier/flat | chunks | auto |",
        "|" + "---:|" * 6,
    ]
    for r in projection(model, N, L, sizes):
        f, h, ratio = r["data"]
        lines.append(
            f"| {r['size']} | {busbw(r['size'], f, W)[1]:.2f} | {busbw(r['size'], h, W)[1]:.2f} "
            f"| {ratio:.2f} | {r['chunks']} | {model.choose(r['size'], N, L)} |"
        )
    return "\n".join(lines)
