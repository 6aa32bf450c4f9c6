"""tools.token_path counts functions, files and returns to a file already left, on a tiny
hand-made call chain (two files, a known path), and runs on the real layer."""

import json
import os
import pathlib
import subprocess
import sys

from tools.token_path import TokenPath

ROOT = pathlib.Path(__file__).resolve().parents[1]

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


CHAIN = """
import json, sys
from tools.token_path import trace
from pkg import a
path = trace(lambda: a.outer(2) and len("outside"), sys.argv[1])
print(json.dumps([path.files, path.functions, path.visits, path.returns]))
"""


def test_counts_a_known_chain(tmp_path):
    """Traced in a fresh interpreter: sys.setprofile is process-wide state, and in one
    long pytest process (the full suite) the trace once stalled after other tests."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(A)
    (pkg / "b.py").write_text(B)
    files, functions, visits, returns = _fresh(CHAIN, str(pkg), pythonpath=(str(tmp_path),))
    # a.outer, b.helper, b._private x2, a.inner, b.helper, b._private x2, a.inner x2
    assert files == ["pkg/a.py", "pkg/b.py"]
    assert [f.split("@")[0] for f in functions] == [
        "pkg/a.py:outer",
        "pkg/b.py:helper",
        "pkg/b.py:_private",
        "pkg/a.py:inner",
    ]
    assert visits == ["pkg/a.py", "pkg/b.py", "pkg/a.py", "pkg/b.py", "pkg/a.py"]
    assert returns == 3


def test_returns_counts_each_visit_back():
    calls = [("x", "f"), ("y", "g"), ("y", "h"), ("z", "i"), ("x", "j"), ("z", "k"), ("z", "k")]
    path = TokenPath(calls)
    assert path.visits == ["x", "y", "z", "x", "z"]
    assert (len(path.functions), len(path.files), path.returns) == (6, 3, 2)


LAYER = """
import json
from tools.token_path import measure_layer
path = measure_layer()
print(json.dumps([path.files, path.functions, path.visits, path.returns]))
"""


def _fresh(script: str, *args: str, pythonpath: tuple[str, ...] = ()) -> list:
    """The script's JSON output, run in a fresh interpreter (see test_counts_a_known_chain)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*pythonpath, str(ROOT)]))
    out = subprocess.run(
        [sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
        timeout=300, check=True,
    ).stdout  # fmt: skip
    return json.loads(out)


def test_measures_the_layer():
    files, functions, visits, returns = _fresh(LAYER)
    assert functions[0].startswith("moe/layer.py:MoELayer.forward@")
    assert "moe/layer.py" in files and returns <= len(visits)


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
