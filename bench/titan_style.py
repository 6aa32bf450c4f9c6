"""Pieces of the GPU layer benchmark that run anywhere: benchmark shapes, FLOP counts, a SwiGLU
FFN, and a torchtitan-style MoE layer (written here, after torchtitan's MoE: argsort permute with
groups padded to 8 rows, `torch._grouped_mm` for the expert GEMMs, scatter_add to combine).

The titan-style layer reuses a moe.MoELayer's router (so both choose the same experts) and holds
its own w1 / w3 / w2 in the MoELayer's layout, loaded from the MoELayer's state dict.
"""

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

ALIGN_M = 8  # torchtitan's TOKEN_GROUP_ALIGN_SIZE_M for bf16: 16-byte group starts


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    T: int  # tokens
    d: int  # model width
    E: int  # experts
    k: int  # experts per token
    F: int  # expert width (SwiGLU: w1, w3 [d, F], w2 [F, d])


PRESETS = {
    "mixtral": Shape("Mixtral", 8192, 4096, 8, 2, 14336),
    "olmoe": Shape("OLMoE", 16384, 2048, 64, 8, 1024),
    "qwen3": Shape("Qwen3-30B-A3B", 16384, 2048, 128, 8, 768),
    "deepseek": Shape("DeepSeek-V3 slice", 8192, 7168, 64, 8, 2048),
}


def parse_shapes(spec: str) -> list[Shape]:
    """'mixtral,qwen3' or 'all' or 'T/d/E/k/F' entries (e.g. '512/256/8/2/384'), comma-separated."""
    shapes = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        if item.lower() == "all":
            shapes.extend(PRESETS.values())
        elif item.lower() in PRESETS:
            shapes.append(PRESETS[item.lower()])
        else:
            parts = item.split("/")
            if len(parts) != 5 or not all(p.isdigit() and int(p) > 0 for p in parts):
                raise ValueError(
                    f"--shapes: {item!r} is neither a preset {tuple(PRESETS)} nor T/d/E/k/F "
                    "with five positive integers"
                )
            T, d, E, k, Fw = map(int, parts)
            if k > E:
                raise ValueError(f"--shapes: {item!r} has k={k} > E={E}")
            shapes.append(Shape(item, T, d, E, k, Fw))
    if not shapes:
        raise ValueError("--shapes: no shape given")
    return shapes


def expert_flops(s: Shape, backward: bool = True) -> int:
    """FLOPs of the expert GEMMs of one SwiGLU MoE layer (router excluded): 3 GEMMs of
    2*T*k*d*F forward; backward does twice the forward (input and weight gradients)."""
    fwd = 3 * 2 * s.T * s.k * s.d * s.F
    return 3 * fwd if backward else fwd


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x): the dense FFN (width k*F for equal active FLOPs) and the expert
    module given to DeepSpeed-MoE."""

    def __init__(self, d: int, f: int, **kw):
        super().__init__()
        self.w1 = nn.Linear(d, f, bias=False, **kw)
        self.w3 = nn.Linear(d, f, bias=False, **kw)
        self.w2 = nn.Linear(f, d, bias=False, **kw)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def grouped_mm(a_MK: torch.Tensor, b_EKN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """out[group e rows] = a[rows] @ b[e]: CUTLASS's torch._grouped_mm on CUDA; on CPU (the
    tests, any dtype) one matmul per group, rows past offs[-1] zero."""
    if a_MK.is_cuda:
        return torch._grouped_mm(a_MK, b_EKN, offs=offs_E)
    pieces, start = [], 0
    for e, end in enumerate(offs_E.tolist()):
        pieces.append(a_MK[start:end] @ b_EKN[e])
        start = end
    pieces.append(a_MK.new_zeros(a_MK.shape[0] - start, b_EKN.shape[2]))
    return torch.cat(pieces)


def padded_permutation(expert_ids_TK: torch.Tensor, E: int, align: int = ALIGN_M):
    """(gather_MP, dest_P, offs_E): the argsort permute of torchtitan with each expert's group
    padded to `align` rows. P = T*k pairs sorted by expert; dest_P = their rows in the padded
    buffer; gather_MP[row] = the token read into that row (T = the zero row for padding);
    offs_E = int32 padded group ends. The buffer has the static bound T*k + E*(align-1) rows."""
    T, k = expert_ids_TK.shape
    flat = expert_ids_TK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    padded = (counts + align - 1) // align * align
    pad_ends = torch.cumsum(padded, 0)
    sorted_e = flat[order]
    rank = torch.arange(T * k, device=flat.device) - (torch.cumsum(counts, 0) - counts)[sorted_e]
    dest = (pad_ends - padded)[sorted_e] + rank
    gather = torch.full((T * k + E * (align - 1),), T, dtype=torch.long, device=flat.device)
    gather[dest] = order // k
    return gather, dest, order, pad_ends.to(torch.int32)


class TitanStyleMoE(nn.Module):
    """Dropless top-k SwiGLU MoE the torchtitan way, sharing `router` with a moe.MoELayer."""

    def __init__(self, router: nn.Module, E: int, d: int, f: int, **kw):
        super().__init__()
        self.router, self.E = router, E
        self.w1 = nn.Parameter(torch.empty(E, d, f, **kw))
        self.w3 = nn.Parameter(torch.empty(E, d, f, **kw))
        self.w2 = nn.Parameter(torch.empty(E, f, d, **kw))

    def load_from_moe(self, layer: nn.Module) -> "TitanStyleMoE":
        with torch.no_grad():
            for name in ("w1", "w2", "w3"):
                getattr(self, name).copy_(getattr(layer.experts, name))
        return self

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        routing = self.router(x_TD)
        ids_TK, weights_TK = routing.expert_ids_TK, routing.weights_TK
        T, d = x_TD.shape
        gather, dest, order, offs = padded_permutation(ids_TK, self.E)
        x_pad = torch.cat([x_TD, x_TD.new_zeros(1, d)])[gather]
        h = grouped_mm(x_pad, self.w1, offs)
        g = grouped_mm(x_pad, self.w3, offs)
        out_pad = grouped_mm(F.silu(h) * g, self.w2, offs)
        acc = torch.promote_types(x_TD.dtype, torch.float32)  # combine in fp32 (or wider)
        w_P = weights_TK.reshape(-1)[order].to(acc)
        vals = (out_pad[dest].to(acc) * w_P[:, None]).to(x_TD.dtype)
        tokens = (order // ids_TK.shape[1])[:, None].expand(-1, d)
        return x_TD.new_zeros(T, d).scatter_add(0, tokens, vals)
