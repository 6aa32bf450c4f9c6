"""Fault injection: bad configuration values, and ranks that built different models.

Every case must end in a clear error naming what is wrong, on every rank, within seconds.
"""

import math
from dataclasses import fields

import pytest
import torch
import torch.distributed as dist
from torch import nn

import moe
from moe.fp8 import FP8Config
from moe.lora import LoRAConfig
from moe.parallel import init_mesh, parallelize
from moe.quirks import Quirks
from tests.distributed import run_ranks
from tests.toy_formats import INT8, SCALED

BASE = dict(
    d_model=8, d_ff=12, num_experts=8, top_k=2, num_groups=2, topk_groups=1, num_shared_experts=1
)

# One valid value per MoEConfig field that differs from BASE's (or the default). A new field
# must be added here: test_every_field_has_an_alternative fails until it is.
ALTERNATIVES = {
    "d_model": 16,
    "d_ff": 24,
    "num_experts": 16,
    "top_k": 1,
    "router": "noisy_topk",
    "capacity_factor": 1.25,
    "eval_capacity_factor": 2.0,
    "min_capacity": 2,
    "drop_policy": "probs",
    "score_func": "sigmoid",
    "softmax_before_topk": False,
    "normalize_weights": True,
    "route_scale": 2.5,
    "num_groups": 4,
    "topk_groups": 2,
    "jitter_eps": 0.05,
    "aux_loss_coef": 0.02,
    "balance_loss": "sequence",
    "z_loss_coef": 1e-3,
    "bias_update_rate": 1e-3,
    "activation": "relu",
    "bias": True,
    "backend": "torch",
    "num_shared_experts": 2,
    "shared_d_ff": 20,
    "shared_expert_gate": True,
    "recompute": True,
    "check_finite": True,
    "spare_slots": 2,
    "fp8": FP8Config(dispatch=True, experts=True),
    "weight_format": SCALED.name,  # registered from outside moe/ (tests/toy_formats.py)
    "row_format": INT8.name,
    "lora": LoRAConfig(rank=2, alpha=4.0),
    "quirks": Quirks(experts_class="tests.FamilyExperts", function="act_fn"),
}


def _changed(name: str) -> dict:
    return {name: ALTERNATIVES[name]}


def test_every_field_has_an_alternative():
    assert {f.name for f in fields(moe.MoEConfig)} == set(ALTERNATIVES)
    for name in ALTERNATIVES:  # each alternative is itself a valid config
        moe.MoEConfig(**{**BASE, **_changed(name)})


BAD_VALUES = [
    ("route_scale", math.nan, "route_scale must be a finite number"),
    ("route_scale", math.inf, "route_scale must be a finite number"),
    ("bias_update_rate", math.nan, "bias_update_rate must be a finite number"),
    ("aux_loss_coef", math.nan, "aux_loss_coef must be a finite number"),
    ("z_loss_coef", -math.inf, "z_loss_coef must be a finite number"),
    ("capacity_factor", math.inf, "capacity_factor must be a finite number"),
    ("capacity_factor", "1.0", "capacity_factor must be float or None, got '1.0'"),
    ("capacity_factor", -1.0, "capacity_factor must be > 0"),
    ("eval_capacity_factor", math.nan, "eval_capacity_factor must be a finite number"),
    ("jitter_eps", math.nan, "jitter_eps must be a finite number"),
    ("top_k", True, "top_k must be int, got True"),
    ("top_k", 2.0, "top_k must be int, got 2.0"),
    ("min_capacity", 2.5, "min_capacity must be int"),
    ("normalize_weights", 1, "normalize_weights must be bool, got 1"),
    ("bias", "yes", "bias must be bool"),
    ("router", None, "router must be str, got None"),
    ("route_scale", 0.0, "route_scale must be > 0"),
    ("aux_loss_coef", -0.1, "aux_loss_coef must be >= 0"),
]


@pytest.mark.parametrize("name, value, message", BAD_VALUES)
def test_bad_config_values_name_the_field(name, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        moe.MoEConfig(**{**BASE, name: value})
    with pytest.raises(ValueError, match=name):  # the layer validates before building anything
        moe.MoELayer(**{**BASE, name: value})


def _build(**changes) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), moe.MoELayer(**{**BASE, **changes}))


def _parallelize_error(model) -> str:
    try:
        parallelize(model, init_mesh(dp=1, ep=2))
    except ValueError as e:
        return str(e)
    return "no error"


def _mismatch_body(rank, world):
    """Rank 1 differs in one thing at a time; every rank must name it."""
    out = {}
    for name in ALTERNATIVES:
        changes = _changed(name) if rank == 1 else {}
        out[name] = _parallelize_error(_build(**changes))
    out["dtype"] = _parallelize_error(_build().to(torch.bfloat16) if rank == 1 else _build())
    out["no_moe_layer"] = _parallelize_error(nn.Sequential(nn.Linear(8, 8)) if rank else _build())
    out["layer_count"] = _parallelize_error(
        nn.Sequential(_build(), moe.MoELayer(**BASE)) if rank else _build()
    )
    dist.barrier()  # still in step after every failed check
    return out


def test_every_mismatch_is_an_error_on_every_rank():
    results = run_ranks(_mismatch_body, 2, timeout=20, deadline=120)
    for rank, out in enumerate(results):
        for name in ALTERNATIVES:
            message = out[name]
            named = [f"1.{n} differs across ranks" for n in _changed(name)]
            assert any(n in message for n in named), (rank, name, message)
            assert "rank 0 has" in message and "rank 1 has" in message, message
        assert "tensor 0.weight differs" in out["dtype"] and "bfloat16" in out["dtype"]
        assert "rank 1: ValueError: the model has no MoELayer" in out["no_moe_layer"]
        assert "moe_layers differs across ranks" in out["layer_count"], out["layer_count"]
