"""Bit-identity of the layer across a refactor: dump outputs and every gradient, then compare.

    PYTHONPATH=. python -m tools.bit_identity dump OUT.safetensors     # in each tree
    python -m tools.bit_identity compare OLD.safetensors NEW.safetensors
    python -m tools.bit_identity against REV [--keep DIR]   # the three steps, in one

`against REV` checks the working tree against a commit: it adds a temporary git worktree at
REV, runs this file (the working tree's copy) there and here, compares, and removes the
worktree; the two dumps stay in DIR (default /tmp/bitid: base.safetensors, new.safetensors).

Only public names are used, so the same file runs on an old commit and a new one. The cases:
six single-process configurations (both kernels, recompute, capacity drops, expert choice,
shared experts), a replicated layer (spare slots), FP8 dispatch and FP8 experts in one
process, and on 2 gloo ranks `parallelize(ep=2)` plain and overlapped, a replicated layer
under ddp and fsdp, FP8 dispatch and FP8 experts (each rank feeds its own batch; gradients
gathered to full tensors). FP8 cases run in float32 only (FP8 takes no float64 weights).
LoRA (moe.lora.add_lora, every adapter's B set non-zero) in one process on the torch, Triton
and FP8 kernels, with router and shared-expert adapters and dropout, and on 2 gloo ranks under
ddp, fsdp and FP8 experts; a pipeline (moe.pipeline.Pipeline, pp=2 on 2 gloo ranks, a stack
of MoE blocks, plain and with LoRA): each stage's output, losses and gradients.
"""

import os
import subprocess
import sys
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: CPU kernels

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import moe  # noqa: E402

D, F, E, T = 24, 40, 6, 37

LORA = {"rank": 3, "alpha": 5.0, "dropout": 0.25, "router": True, "targets": ("w1", "w2", "w3")}
LORA_SHARED = {"rank": 2, "alpha": 3.0, "targets": ("w2", "w1"), "shared_experts": True}
SINGLE = {
    "torch": {"backend": "torch"},
    "triton": {"backend": "triton"},
    "recompute": {"backend": "torch", "recompute": True},
    "drops": {"backend": "torch", "capacity_factor": 0.5, "min_capacity": 1},
    "expert_choice": {"backend": "torch", "router": "expert_choice", "capacity_factor": 1.5},
    "shared": {"backend": "torch", "num_shared_experts": 1},
    "replicas": {"backend": "torch", "spare_slots": 2},
    "fp8_dispatch": {"backend": "torch", "fp8": {"dispatch": True}},
    "fp8_experts": {"backend": "auto", "fp8": {"experts": True}},
    "lora": {"backend": "torch", "lora": LORA},
    "lora_shared": {"backend": "torch", "num_shared_experts": 1, "lora": LORA_SHARED},
    "lora_triton": {"backend": "triton", "lora": LORA},
    "lora_fp8_experts": {"backend": "auto", "fp8": {"experts": True}, "lora": LORA},
}
RANKS = {  # name -> (layer options, parallelize keywords)
    "ep2": ({"backend": "torch"}, {"data_parallel": "ddp"}),
    "ep2_overlap": ({"backend": "torch"}, {"data_parallel": "ddp", "overlap": 2}),
    "ep2_replicas_ddp": ({"backend": "torch", "spare_slots": 2}, {"data_parallel": "ddp"}),
    "ep2_replicas_fsdp": ({"backend": "torch", "spare_slots": 2}, {"data_parallel": "fsdp"}),
    "ep2_fp8_dispatch": ({"backend": "torch", "fp8": {"dispatch": True}}, {"data_parallel": "ddp"}),
    "ep2_fp8_experts": ({"backend": "auto", "fp8": {"experts": True}}, {"data_parallel": "ddp"}),
    "ep2_lora_ddp": ({"backend": "torch", "lora": LORA}, {"data_parallel": "ddp"}),
    "ep2_lora_fsdp": ({"backend": "torch", "lora": LORA}, {"data_parallel": "fsdp"}),
    "ep2_lora_fp8_experts": (
        {"backend": "auto", "fp8": {"experts": True}, "lora": LORA},
        {"data_parallel": "ddp"},
    ),
}
PIPELINES = {"pp2": {}, "pp2_lora": LORA}  # name -> the LoRA settings of its MoE blocks


def _dtypes(options: dict, wanted: tuple) -> tuple:
    """The dtypes a case runs in: the Triton kernel and FP8 take no float64."""
    if options["backend"] == "triton" or "fp8" in options:
        return tuple(dt for dt in wanted if dt != torch.float64) or (torch.float32,)
    return wanted


def _layer(options: dict, dtype: torch.dtype) -> moe.MoELayer:
    options = dict(options)
    lora = options.pop("lora", None)
    if "fp8" in options:
        from moe.fp8 import FP8Config

        options["fp8"] = FP8Config(**options["fp8"])
    torch.manual_seed(0)
    layer = moe.MoELayer(D, F, E, top_k=2, activation="swiglu", dtype=dtype, **options)
    return layer if lora is None else _with_lora(layer, lora)


def _with_lora(model: torch.nn.Module, lora: dict) -> torch.nn.Module:
    """moe.lora.add_lora, then every adapter's B (zero at init) given values that show."""
    from moe.lora import LoRAConfig, adapter_parameters, add_lora

    add_lora(model, LoRAConfig(**lora))
    with torch.no_grad():
        for name, p in adapter_parameters(model):
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.5)
    return model


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _step(layer: torch.nn.Module, seed: int, dtype: torch.dtype, prefix: str) -> dict:
    """One forward and backward on fresh inputs; the output, x's gradient and every
    parameter gradient (full tensors), keyed by prefix."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g, dtype=dtype, requires_grad=True)
    dy = torch.randn(T, D, generator=g, dtype=dtype)
    y = layer(x)
    (y * dy).sum().backward()
    if layer.config.spare_slots:
        moe.parallel.sum_replica_grads(layer)
    out = {f"{prefix}/y": y.detach(), f"{prefix}/dx": x.grad}
    for name, p in layer.named_parameters():
        if p.grad is not None:
            out[f"{prefix}/grad/{name}"] = _full(p.grad).detach()
    return {k: v.contiguous() for k, v in out.items()}


def dump_single() -> dict:
    out = {}
    for name, options in SINGLE.items():
        for dtype in _dtypes(options, (torch.float32, torch.float64)):
            out.update(_step(_layer(options, dtype), 1, dtype, f"{name}/{dtype}"))
    return out


def _rank_body(rank: int, world_size: int) -> dict:
    out = {}
    for name, (options, kw) in RANKS.items():
        (dtype,) = _dtypes(options, (torch.float64,))
        layer = _layer(options, dtype)
        mesh = moe.parallel.init_mesh(dp=1, ep=world_size)
        moe.parallel.parallelize(layer, mesh, **kw)
        out.update(_step(layer, 10 + rank, dtype, f"{name}/rank{rank}"))
    return out


class _Block(torch.nn.Module):
    """x + MoE(LayerNorm(x)): one pipeline block."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(D)
        self.ffn = moe.MoELayer(D, F, E, top_k=2, activation="swiglu", backend="torch")

    def forward(self, x):
        return x + self.ffn(self.norm(x))


def _pipeline_loss(y, target):
    return ((y - target) ** 2).sum()


def _pipeline_body(rank: int, lora: dict, prefix: str) -> dict:
    """pp=2 over the 2 ranks (2 blocks a stage, 2 micro-batches), float64: this rank's
    stage's output and losses (the last stage) and its parameters' gradients."""
    from moe.pipeline import Pipeline, PipelineConfig, init_pipeline_mesh

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_Block() for _ in range(4)]).double()
    if lora:
        _with_lora(model, lora)
    pipe = Pipeline(model, init_pipeline_mesh(pp=2), PipelineConfig(microbatches=2), _pipeline_loss)
    g = torch.Generator().manual_seed(20)
    x = torch.randn(4, 5, D, generator=g, dtype=torch.float64)
    target = torch.randn(4, 5, D, generator=g, dtype=torch.float64)
    y, losses = pipe.step(x, target)
    out = {}
    if y is not None:
        out[f"{prefix}/y"] = y.detach()
        out[f"{prefix}/losses"] = torch.stack([t.detach() for t in losses])
    for name, p in pipe.named_parameters():
        if p.grad is not None:
            out[f"{prefix}/grad/{name}"] = _full(p.grad).detach()
    return {k: v.contiguous() for k, v in out.items()}


def _pipelines_body(rank: int, world_size: int) -> dict:
    out = {}
    for name, lora in PIPELINES.items():
        out.update(_pipeline_body(rank, lora, f"{name}/rank{rank}"))
    return out


def dump_ranks() -> dict:
    from tests.distributed import run_ranks

    out = {}
    for body in (_rank_body, _pipelines_body):
        for part in run_ranks(body, 2, timeout=300):
            out.update(part)
    return out


def compare(old: dict, new: dict) -> int:
    bad = sorted(set(old) ^ set(new))
    for key in sorted(set(old) & set(new)):
        if old[key].dtype != new[key].dtype or not torch.equal(old[key], new[key]):
            diff = (old[key].double() - new[key].double()).abs().max().item()
            bad.append(f"{key} (max |diff| {diff:.3g})")
    print(f"{len(set(old) & set(new))} tensors compared; {len(bad)} differ or are missing")
    for line in bad:
        print("  ", line)
    return 1 if bad else 0


def against(rev: str, keep: str = "/tmp/bitid") -> int:
    """Dump at `rev` (a temporary worktree running this file) and here, then compare."""
    os.makedirs(keep, exist_ok=True)
    base, new = os.path.join(keep, "base.safetensors"), os.path.join(keep, "new.safetensors")
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip
    tree = tempfile.mkdtemp(prefix="bitid-")
    os.rmdir(tree)
    subprocess.run(["git", "-C", root, "worktree", "add", "--detach", tree, rev], check=True)
    try:
        with (
            open(__file__) as src,
            open(os.path.join(tree, "tools", "bit_identity.py"), "w") as dst,
        ):
            dst.write(src.read())
        env = {**os.environ, "PYTHONPATH": tree}
        run = [sys.executable, "-m", "tools.bit_identity", "dump"]
        subprocess.run([*run, base], cwd=tree, env=env, check=True)
    finally:
        subprocess.run(["git", "-C", root, "worktree", "remove", "--force", tree], check=True)
    subprocess.run([*run, new], cwd=root, env={**os.environ, "PYTHONPATH": root}, check=True)
    print(f"dumps: {base} (at {rev}), {new} (working tree)")
    return compare(load_file(base), load_file(new))


def main(argv: list[str]) -> int:
    if argv[:1] == ["against"] and len(argv) in (2, 4) and argv[2:3] in ([], ["--keep"]):
        return against(argv[1], *argv[3:])
    if len(argv) == 2 and argv[0] == "dump":
        save_file({**dump_single(), **dump_ranks()}, argv[1])
        return 0
    if len(argv) == 3 and argv[0] == "compare":
        return compare(load_file(argv[1]), load_file(argv[2]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
