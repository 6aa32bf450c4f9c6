"""tools.token_path counts functions, files and returns to a file already left, on a tiny
hand-made call chain (two files, a known path), and runs on the real layer."""

import importlib
import sys

from tools.token_path import TokenPath, measure_layer, trace

A = """
from pkg import b

def outer(n):
    b.helper(n)
    inner()
    b.helper(n)
    for _ in range(n):
        inner()
    return True

def inner():
    return 1
"""

B = """
def helper(n):
    return _private(n) + _private(n)

def _private(n):
    return n
"""


def test_counts_a_known_chain(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(A)
    (pkg / "b.py").write_text(B)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("pkg", "pkg.a", "pkg.b"):
        sys.modules.pop(name, None)
    a = importlib.import_module("pkg.a")
    path = trace(lambda: a.outer(2) and len("outside"), str(pkg))
    # a.outer, b.helper, b._private x2, a.inner, b.helper, b._private x2, a.inner x2
    assert path.files == ["pkg/a.py", "pkg/b.py"]
    assert [f.split("@")[0] for f in path.functions] == [
        "pkg/a.py:outer",
        "pkg/b.py:helper",
        "pkg/b.py:_private",
        "pkg/a.py:inner",
    ]
    assert path.visits == ["pkg/a.py", "pkg/b.py", "pkg/a.py", "pkg/b.py", "pkg/a.py"]
    assert path.returns == 3


def test_returns_counts_each_visit_back():
    calls = [("x", "f"), ("y", "g"), ("y", "h"), ("z", "i"), ("x", "j"), ("z", "k"), ("z", "k")]
    path = TokenPath(calls)
    assert path.visits == ["x", "y", "z", "x", "z"]
    assert (len(path.functions), len(path.files), path.returns) == (6, 3, 2)


def test_measures_the_layer():
    path = measure_layer()
    assert path.functions[0].startswith("moe/layer.py:MoELayer.forward@")
    assert "moe/layer.py" in path.files and path.returns <= len(path.visits)


def test_one_forward_builds_the_weights_once(monkeypatch):
    """The kernel's refusal is checked at the first call and again only when the kernel, the
    device type or the weights' dtype changes, so a forward builds the experts' weights once."""
    import torch

    import moe
    from moe.experts import GroupedExperts
    from moe.kernels.registry import ExpertKernel

    built, asked = [], []
    weights, refuse = GroupedExperts.weights, ExpertKernel.refuse
    monkeypatch.setattr(GroupedExperts, "weights", lambda self: built.append(1) or weights(self))
    monkeypatch.setattr(ExpertKernel, "refuse", lambda *a: asked.append(1) or refuse(*a))
    layer = moe.MoELayer(8, 12, 4, backend="torch")
    x = torch.randn(5, 8)
    layer(x)
    assert (len(built), len(asked)) == (2, 1)  # the first call: the refusal check, the experts
    layer(x)
    assert (len(built), len(asked)) == (3, 1)
    layer.double()  # another dtype: asked again
    layer(x.double())
    assert (len(built), len(asked)) == (5, 2)
