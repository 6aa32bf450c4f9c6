"""One family's check on moe (the matrix of tests/test_hf_contract.py and of the support table
tools/hf_support.py writes): its tiny model built once, run on transformers' eager
experts, on experts_implementation="moe", and converted by moe.from_hf."""

import copy
import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

import moe
from moe.interop import hf_experts
from tests.hf_tiny import gradient_errors, relative_error, run, tiny_model

TOL = 1e-10
# (dtype, tolerance) where float64 at 1e-10 does not apply: families whose float64 model
# computes parts in float32 (MuseSpark's post-expert norm, Beam's logits) and families
# transformers does not run in float64 (a float32 tensor meets float64 rows: Inkling2's gate,
# NemotronH's mamba mixer, the privacy filter's experts and attention softmax)
SETTINGS = {
    "muse_spark": (torch.float64, 1e-5),
    "beam": (torch.float64, 1e-5),
    "inkling2": (torch.float32, 1e-5),
    "inkling2_loop": (torch.float32, 1e-5),
    "nemotron_h": (torch.float32, 1e-5),
    "openai_privacy_filter": (torch.float32, 1e-5),
}
TABLE_TOL = 1e-5  # the five table families' converted routers compute in float32
SUPPORT = Path(__file__).parent / "data" / "hf_support.json"  # tools/hf_support.py writes it


@functools.cache
def support() -> dict:
    """The support table's measured cells (family -> column -> a figure or a reason)."""
    return json.loads(SUPPORT.read_text())["families"]


def agrees(measured, recorded) -> bool:
    """A measured cell agrees with the table's: the same reason, or figures within a factor
    of 10 (rounding differs between machines and thread counts; below 1e-17 counts as 1e-17)."""
    if isinstance(measured, str) or isinstance(recorded, str):
        return measured == recorded
    a, b = (max(float(v), 1e-17) for v in (measured, recorded))
    return abs(math.log10(a) - math.log10(b)) <= 1.0


@dataclass
class Result:
    family: str
    dtype: torch.dtype
    tol: float
    ran_eager: list = field(default_factory=list)  # experts modules each run called
    ran_moe: list = field(default_factory=list)
    moe_ran_all: bool = False  # moe's experts forward ran for each call of ran_moe, only
    impl_errors: dict = field(default_factory=dict)  # "logits", "loss", gradient names
    converted: str | None = None  # "table" or "contract"; None: refused
    refusal: str | None = None
    state_dict_exact: bool | None = None
    conversion_errors: dict = field(default_factory=dict)

    def worst(self, errors: dict) -> float:
        return max(errors.values()) if errors else 0.0


def _ran_experts(model) -> list:
    """Names of the experts modules a forward of `model` runs (recorded by hooks)."""
    names = []
    for name, m in model.named_modules():
        if hasattr(m, "_is_expert_parallel"):
            m.register_forward_hook(lambda m, a, o, name=name: names.append(name))
    return names


def hf_named_grads(model) -> dict:
    """Every gradient of a converted model under transformers' names: to_hf of a copy whose
    parameters hold their gradients (zeros where none)."""
    for _, layer in moe.moe_layers(model):  # its graph is spent: a leaf deepcopy takes
        layer.aux_loss = layer.aux_loss.detach()
    copy_ = copy.deepcopy(model)
    grads = {n: p.grad for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in copy_.named_parameters():
            p.copy_(torch.zeros_like(p) if grads[n] is None else grads[n])
    return {n: p.detach() for n, p in moe.to_hf(copy_).named_parameters()}


def _errors(got, want, grads: dict, reference) -> dict:
    errors = {"logits": relative_error(got.logits, want.logits)}
    errors["loss"] = relative_error(got.loss, want.loss)
    errors.update(gradient_errors(grads, {n: p.grad for n, p in reference.named_parameters()}))
    return errors


def check_family(family: str) -> Result:
    hf_experts.register_experts_implementation()
    dtype, tol = SETTINGS.get(family, (torch.float64, TOL))
    result = Result(family, dtype, tol)
    reference = tiny_model(family, dtype)
    with torch.no_grad():  # biases, norms and routers away from their zero / one init
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    on_moe, to_convert = copy.deepcopy(reference), copy.deepcopy(reference)
    on_moe.set_experts_implementation("moe")
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(2))
    result.ran_eager, result.ran_moe = _ran_experts(reference), _ran_experts(on_moe)
    want = run(reference, ids)
    calls = []

    def counted(experts, *args):
        calls.append(experts)
        return hf_experts.moe_experts_forward(experts, *args)

    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(hf_experts.NAME, counted)
    try:
        got = run(on_moe, ids)
    finally:
        hf_experts.register_experts_implementation()
    modules = dict(on_moe.named_modules())
    result.moe_ran_all = [id(c) for c in calls] == [id(modules[n]) for n in result.ran_moe]
    grads = {n: p.grad for n, p in on_moe.named_parameters()}
    result.impl_errors = _errors(got, want, grads, reference)

    try:
        model = moe.from_hf(to_convert)
    except ValueError as e:
        result.refusal = str(e)
        return result
    result.converted = "table" if moe.interop.hf_blocks(reference) else "contract"
    back = moe.to_hf(copy.deepcopy(model)).state_dict()
    want_state = reference.state_dict()
    result.state_dict_exact = back.keys() == want_state.keys() and all(
        torch.equal(back[k], want_state[k]) for k in want_state
    )
    if any(hasattr(m, "_is_expert_parallel") for m in model.modules()):
        result.state_dict_exact = False  # an experts module left unconverted
    got = run(model, ids)
    result.conversion_errors = _errors(got, want, hf_named_grads(model), reference)
    return result


def fp8_error(family: str) -> float | str:
    """The converted model with moe's FP8 experts (`moe.from_hf(model, fp8=FP8Config(experts=
    True))`, rowwise e4m3) against transformers' float32 model: the logits' relative error (FP8
    is approximate: a figure, not a check of equality), or why it was not run."""
    from moe.fp8 import FP8Config

    reference = tiny_model(family, torch.float32)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn_like(p, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    try:
        model = moe.from_hf(copy.deepcopy(reference), fp8=FP8Config(experts=True))
    except ValueError as e:
        return f"not converted: {str(e).split(';')[0]}"
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = reference(input_ids=ids).logits
        try:
            got = model(input_ids=ids).logits
        except ValueError as e:
            return f"refused: {e}"
    return relative_error(got, want)
