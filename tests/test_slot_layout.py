"""Replicas as a layout (issue 46 item 2): callers of a slot layout never branch on whether it
holds copies; a layout without copies is the identity case of every layout operation."""

import ast
import pathlib

import pytest
import torch

from moe import MoELayer
from moe.slots.layout import SlotLayout

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "moe"
# Where knowing about copies is the point: the field and its validation, the layout, the guard.
ALLOWED = {"config.py", "slots/layout.py", "slots/guard.py"}
NAMES = {"has_copies", "spare_slots"}


def _mentions(node: ast.AST) -> bool:
    return any(
        (isinstance(n, ast.Name) and n.id in NAMES)
        or (isinstance(n, ast.Attribute) and n.attr in NAMES)
        for n in ast.walk(node)
    )


def copy_branches(source: str) -> list[int]:
    """Lines that read `.has_copies` / `.spare_slots`, mention `has_copies` at all, or branch
    (if, conditional expression, while, comprehension filter, assert) on either name."""
    lines = set()
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in NAMES
            or isinstance(node, ast.Name)
            and node.id == "has_copies"
            or isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert))
            and _mentions(node.test)
        ):
            lines.add(node.lineno)
        elif isinstance(node, ast.comprehension) and any(_mentions(c) for c in node.ifs):
            lines.add(node.iter.lineno)
    return sorted(lines)


def test_the_check_finds_the_branches_it_bans():
    found = copy_branches(
        "if layer.has_copies:\n    pass\n"
        "x = [l for l in ls if l.config.spare_slots]\n"
        "def f(spare_slots=0):\n    return 1 if spare_slots else 0\n"
        "def g(spare_slots=0):\n    return h(spare_slots=spare_slots)\n"
    )
    assert found == [1, 3, 5]


def test_no_branch_on_copies_outside_config_layout_and_guard():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel not in ALLOWED:
            bad += [f"moe/{rel}:{line}" for line in copy_branches(path.read_text())]
    assert not bad, "branches on has_copies / spare_slots outside the layout:\n" + "\n".join(bad)


def test_identity_layout_is_a_no_op_of_every_layout_method():
    layout = SlotLayout.of_placement([2, 0, 1, 3])
    t = torch.arange(8.0).view(4, 2)
    layout.fill_copies(t)
    assert torch.equal(t, torch.arange(8.0).view(4, 2))
    assert layout.for_canonical_load() == SlotLayout.of_placement(range(4))
    assert SlotLayout(4, (0, 1, 2, 3, 0, 1)).for_canonical_load().num_slots == 6
    assert SlotLayout(4, (0, 1, 2, 3, 0, 1)).experts_read(3, 3) == (0, 4)


@pytest.mark.parametrize("spare", [0, 2])
def test_state_dict_keys_are_those_every_version_wrote(spare):
    layer = MoELayer(8, 12, 4, backend="torch", spare_slots=spare)
    keys = {k for k in layer.state_dict() if k.endswith(("_of_expert_E", "_of_slot_S"))}
    assert keys == ({"slot_of_expert_E", "expert_of_slot_S"} if spare else {"slot_of_expert_E"})
