"""The expert weights' e4m3 forms are made once per optimizer step and reused by every
micro-batch, forward and dgrad (moe/fp8/weight_cache.py, issue 61), and dropped by everything
that changes a weight: the optimizer step, in-place writes (no_grad, load_state_dict, row
copies as rebalancing and replica copies make them), `p.data = t`, checkpoint loads, and
`weights_changed()` for `.data` writes between the micro-batches of one step."""

import pytest
import torch

import moe
from bench import budget
from moe.fp8 import FP8Config
from moe.fp8.weight_cache import weights_changed

RECIPES = ("rowwise", "blockwise")


def _layer(recipe: str, seed: int = 0) -> moe.MoELayer:
    torch.manual_seed(seed)
    return moe.MoELayer(32, 48, 4, top_k=2, activation="swiglu",
                        fp8=FP8Config(experts=True, recipe=recipe))  # fmt: skip


def _x(seed: int = 1) -> torch.Tensor:
    return torch.randn(24, 32, generator=torch.Generator().manual_seed(seed))


def _fresh(layer, x) -> torch.Tensor:
    """The output with every weight quantized anew."""
    weights_changed()
    with torch.no_grad():
        return layer(x)


def _cached(layer, x) -> torch.Tensor:
    with torch.no_grad():
        return layer(x)


@pytest.mark.parametrize("recipe", RECIPES)
def test_weights_quantized_once_per_step(recipe):
    """Counted on the CUDA stand-in: 3 micro-batches + the step write each weight's e4m3 forms
    once (rowwise: fprop, already column-major, and dgrad; blockwise: one 128 x 128 form
    serving both), micro-batches 2 and 3 none."""
    b = budget.measure(f"fp8 {recipe}", budget.TINY, 3)
    assert b.weight_casts == {"rowwise": 6, "blockwise": 3}[recipe]
    assert b.later.e4m3["weights"] == 0 and b.optimizer.e4m3["weights"] == 0


@pytest.mark.parametrize("recipe", RECIPES)
def test_cached_forms_give_the_fresh_values(recipe):
    """Forward and every gradient of a second micro-batch (cached forms) equal a run that
    quantizes anew, bit for bit."""
    layer, x = _layer(recipe), _x()
    layer(x).sum().backward()  # fills the cache

    def run(fresh: bool):
        if fresh:
            weights_changed()
        layer.zero_grad()
        xg = x.clone().requires_grad_()
        y = layer(xg)
        y.square().sum().backward()
        return [y, xg.grad] + [p.grad for p in layer.parameters()]

    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)


def _edit_optimizer_step(layer):
    for p in layer.experts.parameters():
        p.grad = torch.ones_like(p)
    torch.optim.SGD(layer.experts.parameters(), lr=0.1).step()


def _edit_no_grad(layer):
    with torch.no_grad():
        layer.experts.w1.mul_(2)


def _edit_replace_data(layer):
    layer.experts.w2.data = layer.experts.w2.data * 2


def _edit_load_state_dict(layer):
    layer.load_state_dict(_layer(layer.config.fp8.recipe, seed=7).state_dict())


def _edit_rows(layer):
    """Expert 0's rows overwritten in place through byte views, as rebalance_experts and the
    replica copies move experts between slots."""
    with torch.no_grad():
        for p in layer.experts.parameters():
            p[0].reshape(-1).view(torch.uint8).copy_(p[1].reshape(-1).view(torch.uint8))


def _edit_data_then_step(layer):
    """A .data write (no version bump) before the step: seen from the step on (issue 49)."""
    layer.experts.w3.data.mul_(2)
    torch.optim.SGD(layer.experts.parameters(), lr=0.0).step()


def _edit_data_then_changed(layer):
    layer.experts.w1.data.copy_(torch.randn_like(layer.experts.w1))
    weights_changed()


EDITS = [_edit_optimizer_step, _edit_no_grad, _edit_replace_data, _edit_load_state_dict,
         _edit_rows, _edit_data_then_step, _edit_data_then_changed]  # fmt: skip


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("edit", EDITS, ids=lambda f: f.__name__.removeprefix("_edit_"))
def test_weight_changes_drop_the_cached_forms(recipe, edit):
    layer, x = _layer(recipe), _x()
    before = _cached(layer, x)  # fills the cache
    edit(layer)
    after = _cached(layer, x)
    assert not torch.equal(after, before), "the edit did not change the layer"
    assert torch.equal(after, _fresh(layer, x)), "a stale e4m3 weight was used"


@pytest.mark.parametrize("recipe", RECIPES)
def test_checkpoint_load_drops_the_cached_forms(recipe, tmp_path):
    from moe.checkpoint import load_checkpoint, save_checkpoint

    layer, other, x = _layer(recipe), _layer(recipe, seed=5), _x()
    save_checkpoint(str(tmp_path / "ckpt"), other)
    before = _cached(layer, x)
    load_checkpoint(str(tmp_path / "ckpt"), layer)
    after = _cached(layer, x)
    assert not torch.equal(after, before)
    assert torch.equal(after, _fresh(layer, x))
