"""No host sync in a training step: the M6 example reads its metrics once per --log-every, and
the MoE layer's forward and backward (default local dispatcher, every router, the torch expert
path) read nothing back to the host.

On the CPU every tensor is a host tensor, so a sync is counted as a call of the methods that
would read a device tensor back (item, tolist, cpu, numpy, bool/int/float of a tensor). The
few reads that only run for CPU tensors (guarded by a device check, with a no-read branch for
CUDA) are listed in CPU_ONLY; `test_cpu_only_reads_have_a_device_branch` runs those
functions on the meta device, where any read fails. On CUDA, `test_cuda_step_has_no_sync`
uses torch.cuda.set_sync_debug_mode("error") instead.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import moe
from examples.m6 import metrics as m6metrics
from examples.m6 import train
from moe.gating import ROUTERS

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")
ROOT = Path(__file__).resolve().parents[1]
# (file, function): host reads that run only for CPU tensors; on CUDA the same function takes
# a branch that reads nothing (checked on the meta device below).
CPU_ONLY = {
    ("moe/kernels/expert_chunks.py", "chunks"),  # chunk bounds from CPU offsets
    ("moe/kernels/torch_grouped_mm.py", "zero_tail_rows"),  # slice the CPU tail
    ("moe/layer.py", "_check_finite"),  # raise at once on CPU; torch._assert_async elsewhere
}
# The torch backend's fallback where torch._grouped_mm does not run (float64, widths or row
# counts that are not 16-byte aligned, CUDA before Hopper or not bf16) reads the offsets: the
# documented exception besides the expert-parallel split sizes. On CUDA the default backend
# ("auto") is Triton, which reads nothing.
FALLBACK = {("moe/kernels/torch_grouped_mm.py", "_segments")}
# torch's optimizers keep their step counters as CPU scalars (unless capturable) and read
# them on the host: no device sync on CUDA either.
HOST_STATE = ("torch/optim/",)


class HostReads:
    """Calls of READS on tensors while `active`, as (file:line function method)."""

    def __init__(self):
        self.active = False
        self.calls: list[str] = []

    def record(self, method: str) -> None:
        if not self.active:
            return
        frame = sys._getframe(2)
        path = Path(frame.f_code.co_filename).resolve()
        name = frame.f_code.co_name
        rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.as_posix()
        if (rel, name) in CPU_ONLY | FALLBACK or any(part in rel for part in HOST_STATE):
            return
        self.calls.append(f"{rel}:{frame.f_lineno} {name} {method}")


@contextmanager
def counting_host_reads():
    """Patch torch.Tensor's host-read methods to record their callers while reads.active."""
    reads = HostReads()
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name, original):
        def method(self, *args, **kwargs):
            reads.record(name)
            return original(self, *args, **kwargs)

        return method

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:
        yield reads
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def test_counter_sees_a_read():
    """The counter itself: a read in an active window is recorded with its caller."""
    x = torch.randn(3)
    with counting_host_reads() as reads:
        x.sum().item()  # inactive: not recorded
        reads.active = True
        x.sum().item()
        bool(x[0] > 0)
        reads.active = False
    assert [c.split()[-1] for c in reads.calls] == ["item", "__bool__"]
    assert reads.calls[0].startswith("tests/test_host_sync.py:")


def test_m6_steps_between_log_intervals_read_nothing(tmp_path, monkeypatch):
    """Every step after the first, up to each log read (MetricsLog.flush), reads no tensor."""
    with counting_host_reads() as reads:
        step_fn, flush_fn = train.train_step, m6metrics.MetricsLog.flush
        counted = []

        def train_step(model, opt, data, enc, step, args, rt):
            reads.active = step >= 1  # step 0 is warm-up (lazy state, first-call caches)
            counted.append(step) if reads.active else None
            return step_fn(model, opt, data, enc, step, args, rt)

        def reading(flush_fn):  # the log interval's reads: metrics and the routing trace
            def flush(self, *args, **kwargs):
                reads.active = False
                return flush_fn(self, *args, **kwargs)

            return flush

        monkeypatch.setattr(train, "train_step", train_step)
        monkeypatch.setattr(m6metrics.MetricsLog, "flush", reading(flush_fn))
        monkeypatch.setattr(moe.RoutingTrace, "flush", reading(moe.RoutingTrace.flush))
        argv = ["--steps", "9", "--log-every", "4", "--global-batch", "16", "--micro-batch", "8"]
        summary = train.run(
            [*argv, "--eval-every", "1000", "--quiet", "--no-plots", "--run-dir", str(tmp_path)]
        )
    assert counted == list(range(1, 9))
    assert reads.calls == [], "\n".join(reads.calls)
    assert len(summary["losses"]) == 9  # every step's metrics still reach the history


LAYER_CASES = [(router, 1.25) for router in sorted(ROUTERS)] + [("topk", None)]


@pytest.mark.parametrize("router, capacity_factor", LAYER_CASES)
def test_layer_forward_backward_read_nothing(router, capacity_factor):
    """MoELayer forward and backward with the default local dispatcher and torch experts."""
    torch.manual_seed(0)
    top_k = 1 if router == "switch" else 2
    layer = moe.MoELayer(
        24, 40, 6, top_k=top_k, router=router, capacity_factor=capacity_factor, bias=True
    )
    calls = layer_step_reads(layer, after=lambda: moe.update_router_biases(layer))
    assert calls == [], "\n".join(calls)


def layer_step_reads(layer, after=lambda: None) -> list[str]:
    """The host reads of one forward + backward of `layer` (and `after`) after a warm-up step."""
    x = torch.randn(3, 7, layer.config.d_model, requires_grad=True)
    layer(x).sum().backward()  # warm-up
    with counting_host_reads() as reads:
        reads.active = True
        y = layer(x)
        (y.square().sum() + layer.aux_loss).backward()
        after()
        reads.active = False
    return reads.calls


def test_cpu_only_reads_have_a_device_branch():
    """The functions of CPU_ONLY on the meta device (any host read raises there)."""
    from moe.kernels.expert_chunks import chunks
    from moe.kernels.torch_grouped_mm import zero_tail_rows

    offsets_E = torch.tensor([2, 5, 5, 9], dtype=torch.int32, device="meta")
    assert len(chunks(offsets_E, 11, 64)) == 1
    y = zero_tail_rows(torch.empty(11, 4, device="meta"), offsets_E)
    assert y.shape == (11, 4)
    layer = moe.MoELayer(8, 16, 4, top_k=2).to("meta")
    layer._check_finite(torch.empty(5, 4, device="meta"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (sync debug mode)")
def test_cuda_step_has_no_sync(tmp_path, monkeypatch):
    """On a GPU: torch raises on any synchronising call inside steps between log reads."""
    step_fn, flush_fn = train.train_step, m6metrics.MetricsLog.flush

    def train_step(model, opt, data, enc, step, args, rt):
        torch.cuda.set_sync_debug_mode("error" if step >= 1 else "default")
        return step_fn(model, opt, data, enc, step, args, rt)

    def flush(self, *args, **kwargs):
        torch.cuda.set_sync_debug_mode("default")
        return flush_fn(self, *args, **kwargs)

    monkeypatch.setattr(train, "train_step", train_step)
    monkeypatch.setattr(m6metrics.MetricsLog, "flush", flush)
    try:
        summary = train.run(
            ["--steps", "9", "--log-every", "4", "--device", "cuda", "--global-batch", "16"]
            + ["--eval-every", "1000", "--quiet", "--no-plots", "--run-dir", str(tmp_path)]
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(summary["losses"]) == 9
