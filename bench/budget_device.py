"""A CUDA stand-in for counting the CUDA code path on a CPU-only PyTorch (issue 61).

Tensors live on the `meta` device (shapes, dtypes and strides, no data), so forward and
backward run through the same Python as on a GPU. They report `device` "cuda:0" and `is_cuda`
True to Python (a subclass property; autograd's C++ still sees meta), so every branch that asks
`x.device.type == "cuda"` takes the CUDA side. Factory calls with device="cuda" land on meta.

`StandInMode` (a TorchDispatchMode) does three things for every aten op: unwraps the stand-ins
to plain meta, moves device="cuda" to meta, and wraps meta results back; it hands every op to
`on_op` (the counter). An op on a wrapper tensor subclass (one holding tensors of its own,
e.g. the FP8 dispatch rows' QuantizedRows) runs the subclass's __torch_dispatch__ under the
mode, so the ops it issues on its inner stand-ins are the ones counted. torch.library custom
ops of the project (namespace "moe") are not run as one opaque op: their Python body runs on
the stand-ins under a nested mode, so the ops inside are counted with the CUDA branches they
take (what torch.profiler shows on a GPU).

Patched while `cuda_stand_in()` is active, and put back after:
- torch.cuda's lazy init (skipped: a CPU build has no driver), get_device_capability and
  get_device_properties (an H100 SXM: sm_90, 132 SMs);
- triton's JITFunction.run, Autotuner.run and (under TRITON_INTERPRET=1) InterpretedFunction.run:
  a launch is handed to `on_triton` (kernel name, grid, tensor arguments) and not run (meta
  tensors have no data);
- `_local_scalar_dense` (.item(), int(t), torch.equal) and copies to the CPU (.tolist(),
  .cpu()): a host sync on a GPU; reported to the counter and answered with `SYNC_VALUE`, or for
  a copy with what `host_values` makes of it (e.g. balanced expert offsets: the per-expert loop
  a host read feeds then runs once per expert, as with real routing).
"""

import contextlib
from collections.abc import Callable
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves, tree_map

CUDA = torch.device("cuda", 0)
META = torch.device("meta")
SYNC_VALUE = 1  # what a host read of one element of a stand-in tensor returns


def ones_on_host(t: torch.Tensor) -> torch.Tensor:
    return torch.full(t.shape, SYNC_VALUE, dtype=t.dtype)


HOST_VALUES = [ones_on_host]  # what a copy of a stand-in to the host reads (host_values)
H100 = SimpleNamespace(
    name="stand-in H100 SXM", major=9, minor=0, multi_processor_count=132, total_memory=80 << 30
)


class StandIn(torch.Tensor):
    """A meta tensor that tells Python it is on cuda:0."""

    @property
    def device(self):
        return CUDA

    @property
    def is_cuda(self):
        return True

    def data_ptr(self):
        return 0  # aligned: the CUDA path's layout checks pass as for a fresh allocation

    __torch_function__ = torch._C._disabled_torch_function_impl


def stand_in(t):
    """A meta tensor as a stand-in (anything else as it is)."""
    if isinstance(t, torch.Tensor) and not isinstance(t, StandIn) and t.is_meta:
        return t.as_subclass(StandIn)
    return t


def _plain(t):
    if isinstance(t, StandIn):
        return t.as_subclass(torch.Tensor)
    if isinstance(t, torch.device) and t.type == "cuda":
        return META
    return t


def _custom_body(func):
    """The Python body of a project custom op (moe::...), or None."""
    if func.namespace != "moe":
        return None
    from torch._library.custom_ops import OPDEFS

    opdef = OPDEFS.get(func._schema.name)
    return None if opdef is None else opdef._init_fn


def _wrapper_subclass(tree):
    """The type of the first tensor subclass in tree that holds tensors of its own (a
    traceable wrapper, e.g. moe.fp8.rows.QuantizedRows), or None."""
    for t in tree_leaves(tree):
        if is_traceable_wrapper_subclass(t):
            return type(t)
    return None


def _composite(name: str) -> bool:
    """An op with no kernel of its own (CompositeImplicitAutograd only): its parts are what
    runs. An op that also has a device kernel (silu_backward) runs as that one kernel; the CPU
    kernel stands for the CUDA one this build does not have."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return has(name, "CompositeImplicitAutograd") and not has(name, "CPU")


class StandInMode(TorchDispatchMode):
    """on_op(func, args, kwargs, out, depth) after each aten op (args and out as plain meta);
    on_custom(func, depth) before a custom op's body runs; depth counts enclosing custom ops."""

    def __init__(self, on_op: Callable, on_custom: Callable, depth: int = 0):
        super().__init__()
        self.on_op, self.on_custom, self.depth = on_op, on_custom, depth

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        wrapper = _wrapper_subclass((args, kwargs))
        if wrapper is not None:  # its own ops (e.g. on its inner stand-ins) are what runs
            with StandInMode(self.on_op, self.on_custom, self.depth):
                return wrapper.__torch_dispatch__(func, types, args, kwargs)
        body = _custom_body(func)
        if body is not None:
            self.on_custom(func, self.depth)
            with StandInMode(self.on_op, self.on_custom, self.depth + 1):
                return tree_map(stand_in, body(*tree_map(stand_in, args), **kwargs))
        if _composite(func.name()):
            with StandInMode(self.on_op, self.on_custom, self.depth):  # its parts are counted
                return func.decompose(*args, **kwargs)
        a, k = tree_map(_plain, (args, kwargs))
        if func is torch.ops.aten._local_scalar_dense.default:
            self.on_op(func, a, k, None, self.depth)
            return torch.tensor(SYNC_VALUE, dtype=a[0].dtype).item()
        if func is torch.ops.aten._to_copy.default and str(k.get("device")) == "cpu":
            self.on_op(func, a, k, None, self.depth)  # a copy to the host (.tolist(), .cpu())
            return HOST_VALUES[0](a[0]).to(k.get("dtype") or a[0].dtype)
        out = func(*a, **k)
        self.on_op(func, a, k, out, self.depth)
        return tree_map(stand_in, out)


def _patch_triton(on_triton: Callable) -> list:
    """Replace triton's launchers by on_triton(name, grid, args, kwargs); the undo list."""
    try:
        from triton.runtime.autotuner import Autotuner
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:
        return []

    def launch(self, *args, grid=None, warmup=False, **kwargs):
        fn = self
        while hasattr(fn, "fn"):  # an Autotuner / Heuristics wraps the JITFunction
            fn = fn.fn
        on_triton(fn.__name__, grid, args, kwargs)

    undo = []
    for cls in (JITFunction, Autotuner, InterpretedFunction):  # (TRITON_INTERPRET=1: the last)
        undo.append((cls, "run", cls.__dict__["run"]))
        cls.run = launch
    return undo


@contextlib.contextmanager
def cuda_stand_in(
    on_op: Callable, on_custom: Callable, on_triton: Callable, host_values=ones_on_host
):
    """Run the block on the stand-in device; every op, custom op and Triton launch reported."""
    undo = _patch_triton(on_triton)
    HOST_VALUES[0] = host_values
    cuda = torch.cuda
    saved = cuda._initialized, cuda.get_device_capability, cuda.get_device_properties
    cuda._initialized = True
    cuda.get_device_capability = lambda device=None: (H100.major, H100.minor)
    cuda.get_device_properties = lambda device=None: H100
    try:
        with StandInMode(on_op, on_custom):
            yield
    finally:
        cuda._initialized, cuda.get_device_capability, cuda.get_device_properties = saved
        HOST_VALUES[0] = ones_on_host
        for cls, name, fn in undo:
            setattr(cls, name, fn)


def to_stand_in(module: torch.nn.Module) -> torch.nn.Module:
    """The module's parameters and buffers as stand-ins (built on meta first), in place."""
    for sub in module.modules():
        for name, p in list(sub.named_parameters(recurse=False)):
            sub._parameters[name] = torch.nn.Parameter(stand_in(p.detach()), p.requires_grad)
        for name, b in list(sub.named_buffers(recurse=False)):
            if b is not None:
                sub._buffers[name] = stand_in(b)
    return module
