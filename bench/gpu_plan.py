"""The MoE layer on an H100, on paper: bytes moved and FLOPs per token for each stage of the
forward pass, the time bound each implies, and the ratio to a dense FFN of equal active FLOPs.

A projection from arithmetic, not a measurement (no GPU is lent to this project). Shape: the
fine-grained Qwen3-30B-A3B proportion (d=2048, F=768 SiLU-gated experts, E=128, k=8) over
T=32768 tokens in bf16, the shape whose public figures REFERENCE.md quotes. H100 SXM: 3.35 TB/s
HBM3, ~990 dense bf16 TFLOP/s.
"""

BW, FLOPS = 3.35e12, 990e12  # bytes/s, FLOP/s
D, F, E, K, T, B = 2048, 768, 128, 8, 32768, 2  # B: bytes per bf16 element


def stages() -> list[tuple[str, float, float]]:
    """(stage, FLOPs per token, bytes per token) of the forward pass, Triton path."""
    weights = lambda n: n * B / T  # a weight matrix read once per layer, shared by all tokens
    return [
        ("router logits + top-k (fp32)", 2 * D * E, D * B + 2 * 4 * E),
        ("sort / plan (int32 ids, offsets)", 0, K * 3 * 4),
        (
            "gather on load + GEMM1 (gate, up)",
            2 * K * D * 2 * F,
            K * D * B + weights(E * D * 2 * F),
        ),
        ("SiLU * up (GEMM1 epilogue)", 3 * K * F, K * F * B),  # written once, read by GEMM2
        ("GEMM2 (down)", 2 * K * F * D, K * F * B + weights(E * F * D) + K * D * B),
        ("combine (weighted gather-sum)", 2 * K * D, K * D * B + D * B),
    ]


def dense_stages() -> list[tuple[str, float, float]]:
    width = K * F
    weights = lambda n: n * B / T
    return [
        ("dense GEMM1 (gate, up)", 2 * D * 2 * width, D * B + weights(D * 2 * width) + width * B),
        ("dense GEMM2 (down)", 2 * width * D, width * B + weights(width * D) + D * B),
    ]


def _bound(flops: float, nbytes: float) -> float:
    return max(flops / FLOPS, nbytes / BW)


def gpu_plan_table() -> str:
    rows = [
        "| stage | FLOP/token | bytes/token | bound | us per 32k tokens |",
        "|---|---|---|---|---|",
    ]
    total = 0.0
    for name, flops, nbytes in stages():
        t = _bound(flops, nbytes) * T
        total += t
        kind = "compute" if flops / FLOPS >= nbytes / BW else "memory"
        rows.append(f"| {name} | {flops:,.0f} | {nbytes:,.0f} | {kind} | {t * 1e6:.1f} |")
    dense = sum(_bound(f, b) * T for _, f, b in dense_stages())
    gemm = sum(_bound(f, b) * T for n, f, b in stages() if n.startswith(("gather", "GEMM2")))
    rows.append(f"| **moe layer, forward** | | | | **{total * 1e6:.1f}** |")
    rows.append(f"| dense FFN of width k*F, forward | | | | {dense * 1e6:.1f} |")
    return (
        "\n".join(rows)
        + f"\n\nProjected moe / dense: **{total / dense:.2f}** (forward; backward runs the same "
        "GEMMs twice more: the input-gradient GEMM and the ragged-reduction weight-gradient "
        "GEMM, with the activation derivative fused into the first, so the ratio carries over). "
        "The expert GEMMs bound the layer: at 768-wide experts and ~2048 rows per expert they "
        "are compute-bound on tensor cores. The memory-bound rest (router, activation, combine) "
        f"is {1 - gemm / total:.0%} of the bound; the combine is its largest part, which is why "
        "folding the combine weights into GEMM2's epilogue is the next kernel to write. What the "
        "bound leaves out, and what real kernels "
        "lose: per-group tile quantisation (2048 rows per expert fill 128-row tiles exactly "
        "here, but skewed loads do not), launch and scheduling overhead, and the ~85% of "
        "cuBLAS that grouped GEMMs reach in public figures (TransformerEngine, REFERENCE.md)."
    )


if __name__ == "__main__":
    print(gpu_plan_table())
