"""GEMM-role table of the GPU layer benchmark: each grouped GEMM of a SwiGLU expert MLP timed
alone, moe's Triton kernel against CUTLASS (torch._grouped_mm) at the same shape and routing.

Roles (M = T*k rows sorted by expert): up [M,d]x[d,2F] (gathered, SwiGLU epilogue), down
[M,F]x[F,d], dact [M,d]x[d,F]^T (activation backward epilogue), dx [M,2F]x[2F,d],
wgrad13 x^T dh / x^T dg ([d,M]x[M,2F] per expert), wgrad2 act^T dout ([F,M]x[M,d]).
Two CUTLASS figures per role: "cutlass" is the role as moe runs it when moe/kernels/gemm_roles.py
sends it there (moe/kernels/triton/cutlass_roles.py: the GEMM plus its epilogue's work as row
passes: gather, activation, activation backward), which the decision rule compares with the
Triton kernel; "cutlass-gemm" is the GEMM alone on the permuted rows (no gather, no epilogue),
a lower bound.
"""

import torch

ROLES = ("up", "down", "dact", "dx", "wgrad13", "wgrad2")
# Triton-only variants timed beside them: the opt-in TMA path, and the weight gradient as it was
# before the rebuild (x gathered in the loop, dW1 and dW3 in two launches).
VARIANTS = {"up TMA": "up", "down TMA": "down", "dact TMA": "dact", "dx TMA": "dx",
            "wgrad13 gathered, 2 launches": "wgrad13"}  # fmt: skip


def role_flops(role: str, M: int, d: int, F: int) -> int:
    role = VARIANTS.get(role, role)
    n = {"up": 2 * F, "down": d, "dact": F, "dx": d, "wgrad13": 2 * F, "wgrad2": d}[role]
    k = {"up": d, "down": F, "dact": d, "dx": 2 * F, "wgrad13": d, "wgrad2": F}[role]
    return 2 * M * k * n


def _inputs(T, d, E, k, F, device, dtype):
    g = torch.Generator(device=device).manual_seed(0)
    r = lambda *s, scale=1.0: torch.randn(*s, device=device, dtype=dtype, generator=g) * scale
    ids_TK = torch.rand(T, E, device=device, generator=g).topk(k, dim=-1).indices
    flat = ids_TK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offsets = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    M = T * k
    return dict(
        x=r(T, d),
        token=(order // k),
        offsets=offsets,
        w1=r(E, d, F, scale=d**-0.5),
        w3=r(E, d, F, scale=d**-0.5),
        w2=r(E, F, d, scale=F**-0.5),
        act=r(M, F),
        pre=r(M, 2 * F),
        dout=r(M, d),
    )


def _triton_calls(t, E, d, F):
    from moe.kernels.triton.common import ensure_mode

    ensure_mode()  # kernel modules built for the mode TRITON_INTERPRET now asks for
    from moe.kernels.triton.activations import ACT_CODES
    from moe.kernels.triton.grouped_mm import EPI_ACT, EPI_ACT_BWD, ragged_mm
    from moe.kernels.triton.grouped_mm_wgrad import ragged_reduce_mm

    sw = ACT_CODES["swiglu"]
    M = t["token"].shape[0]
    act, pre, dpre = (t["x"].new_empty(M, n) for n in (F, 2 * F, 2 * F))
    out, dx = t["x"].new_empty(M, d), t["x"].new_empty(M, d)
    dw13, dw2 = t["x"].new_empty(E, d, 2 * F), t["x"].new_empty(E, F, d)  # dW1 | dW3 views
    off, w1, w3, w2 = t["offsets"], t["w1"], t["w3"], t["w2"]
    dw1, dw3 = dw13[:, :, :F], dw13[:, :, F:]
    calls = {}
    for tma, suffix in ((False, ""), (True, " TMA")):
        calls.update(
            {
                "up" + suffix: lambda tma=tma: ragged_mm(
                    t["x"],
                    w1,
                    off,
                    act,
                    epilogue=EPI_ACT,
                    act=sw,
                    b2_EKN=w3,
                    idx_M=t["token"],
                    pre=pre,
                    save_pre=True,
                    gated=True,
                    tma=tma,
                ),
                "down" + suffix: lambda tma=tma: ragged_mm(t["act"], w2, off, out, tma=tma),
                "dact" + suffix: lambda tma=tma: ragged_mm(
                    t["dout"],
                    w2.transpose(1, 2),
                    off,
                    dpre,
                    epilogue=EPI_ACT_BWD,
                    act=sw,
                    pre=t["pre"],
                    gated=True,
                    tma=tma,
                ),
                "dx" + suffix: lambda tma=tma: ragged_mm(
                    t["pre"],
                    w1.transpose(1, 2),
                    off,
                    dx,
                    b2_EKN=w3.transpose(1, 2),
                    gated=True,
                    tma=tma,
                ),
            }
        )
    calls["wgrad13"] = lambda: ragged_reduce_mm(
        t["x"], t["pre"], off, dw1, idx_M=t["token"], out2_EIJ=dw3
    )
    calls["wgrad13 gathered, 2 launches"] = lambda: (
        ragged_reduce_mm(t["x"], t["pre"][:, :F], off, dw1, idx_M=t["token"], prepermute=False),
        ragged_reduce_mm(t["x"], t["pre"][:, F:], off, dw3, idx_M=t["token"], prepermute=False),
    )
    calls["wgrad2"] = lambda: ragged_reduce_mm(t["act"], t["dout"], off, dw2)
    return calls  # fmt: skip


def _cutlass_calls(t, E, d, F):
    gm = torch._grouped_mm
    off = t["offsets"]
    xp = t["x"][t["token"]]
    w13 = torch.cat([t["w1"], t["w3"]], dim=2)
    w13_t = w13.transpose(1, 2)
    w2_t = t["w2"].transpose(1, 2)
    return {
        "up": lambda: gm(xp, w13, offs=off),
        "down": lambda: gm(t["act"], t["w2"], offs=off),
        "dact": lambda: gm(t["dout"], w2_t, offs=off),
        "dx": lambda: gm(t["pre"], w13_t, offs=off),
        "wgrad13": lambda: gm(xp.t(), t["pre"], offs=off),
        "wgrad2": lambda: gm(t["act"].t(), t["dout"], offs=off),
    }


def _wired_calls(t, E, d, F):
    """Each role as the Triton expert MLP runs it on CUTLASS (GEMM + row passes)."""
    from moe.kernels.triton import cutlass_roles as cr

    off, w1, w3, w2 = t["offsets"], t["w1"], t["w3"], t["w2"]
    return {
        "up": lambda: cr.up(t["x"], w1, w3, off, t["token"], None, "swiglu", True),
        "down": lambda: cr.down(t["act"], w2, off),
        "dact": lambda: cr.dact(t["dout"], w2, off, t["pre"], None, "swiglu"),
        "dx": lambda: cr.dx(t["pre"], w1, w3, off),
        "wgrad13": lambda: cr.wgrad13(t["x"], t["pre"], off, t["token"], F, True),
        "wgrad2": lambda: cr.wgrad2(t["act"], t["dout"], off),
    }


def role_table(shape, time_fn, device, dtype=torch.bfloat16, records=None) -> list[str]:
    """Markdown rows: role, ms and TFLOP/s of moe triton, of the role on CUTLASS as moe runs it,
    and of the CUTLASS GEMM alone; triton as % of the former. With `records` (a list), one dict
    per timing is appended: role, backend, ms (or the failure)."""
    records = [] if records is None else records
    where = {"shape": shape.name, "T": shape.T, "d": shape.d, "E": shape.E, "k": shape.k,
             "F": shape.F}  # fmt: skip
    s = shape
    t = _inputs(s.T, s.d, s.E, s.k, s.F, device, dtype)
    M = s.T * s.k
    rows = []
    try:
        ours = _triton_calls(t, s.E, s.d, s.F)
    except Exception as e:  # noqa: BLE001 - the report says why
        records.append({**where, "candidate": "role all triton", "figure": "failed",
                        "value": f"{type(e).__name__}: {e}", "unit": ""})  # fmt: skip
        return [f"| {s.name} | all | triton unavailable: {type(e).__name__}: {e} | | | | | | |"]
    wired, bare = _wired_calls(t, s.E, s.d, s.F), _cutlass_calls(t, s.E, s.d, s.F)
    for role in (*ROLES, *VARIANTS):
        fl = role_flops(role, M, s.d, s.F)
        base = VARIANTS.get(role, role)
        cells = []
        for backend, fn in (("triton", ours[role]), ("cutlass", wired[base]),
                            ("cutlass-gemm", bare[base])):  # fmt: skip
            rec = {**where, "candidate": f"role {role} {backend}", "unit": "ms"}
            try:
                ms = time_fn(fn)
                cells.append((ms, fl / ms / 1e9))
                records.append({**rec, "figure": "ms", "value": None if ms != ms else ms})
            except Exception as e:  # noqa: BLE001
                msg = f"{type(e).__name__}: {str(e).splitlines()[0][:60]}"
                cells.append((None, msg))
                records.append({**rec, "figure": "failed", "value": msg, "unit": ""})
        fmt = lambda c: f"{c[0]:.3f} | {c[1]:.0f}" if c[0] is not None else f"– | {c[1]}"
        pct = (
            f"{100 * cells[0][1] / cells[1][1]:.0f}%"
            if cells[0][0] is not None and cells[1][0] is not None
            else "–"
        )
        rows.append(
            f"| {s.name} | {role} | {fmt(cells[0])} | {fmt(cells[1])} | {pct} | {fmt(cells[2])} |"
        )
    return rows
