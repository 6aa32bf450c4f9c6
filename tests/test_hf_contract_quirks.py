"""Family quirks of transformers' experts contract converted by moe.from_hf (moe.quirks): an
overridden `_apply_gate` (GPT-OSS's clamped SwiGLU with interleaved gate / up and biases, the
clamped, soft-capped and (up + 1) gates of the others), squared ReLU without a gate
(NemotronH), a post-expert norm (MuseSpark). Per family, the converted experts module against
the family's own eager module on random routed rows (empty experts, spare slots): output and
every gradient (x, the combine weights, each weight, bias and norm weight) in float64 within
1e-10 (float32 / 1e-5 where the family computes in float32), the quirks read from the module,
to_hf exact. Whole models of every family: tests/test_hf_contract.py's walk. Here also the
kernel contract on rows with a dropped tail, LoRA on quirk layers (equal to the merged model),
a DCP checkpoint round trip, EP = 2 on gloo equal to one process, and the refusals."""

import copy
import importlib
import json
from dataclasses import asdict

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")  # the `hf` extra; .ci/run installs it

import moe  # noqa: E402
from moe.interop import hf_contract  # noqa: E402
from tests.distributed import run_ranks  # noqa: E402
from tests.hf_matrix import SETTINGS, TOL, hf_named_grads  # noqa: E402
from tests.hf_tiny import experts_modules, relative_error, run, shrink, tiny_model  # noqa: E402

GATE, ACT = "_apply_gate", "act_fn"
# family -> (function, interleaved, up_bias, post_norm): what its experts module declares
QUIRKS = {
    "gpt_oss": (GATE, True, True, False),
    "beam": (GATE, False, False, False),
    "deepseek_v4": (GATE, False, False, False),
    "glm5_next": (GATE, False, False, False),
    "hy_v4": (GATE, False, False, False),
    "hy_v4_vl": (GATE, False, False, False),
    "inkling2": (GATE, False, False, False),
    "inkling2_loop": (GATE, False, False, False),
    "minimax_m3_vl": (GATE, False, False, False),
    "nemotron_h": (ACT, False, False, False),
    "muse_spark": (GATE, False, False, True),
    "openai_privacy_filter": (GATE, False, True, False),
    "step3p7": (GATE, False, False, False),
}
# OpenAI-Privacy-Filter's eager experts compute in float32 whatever the weights' dtype
EXPERTS_SETTINGS = {**SETTINGS, "openai_privacy_filter": (torch.float32, 1e-5)}
# families whose whole tiny model tests/hf_tiny.py does not build: their experts class alone,
# from the family's own (shrunk) config, with its extra constructor arguments
EXPERTS_ONLY = {
    "openai_privacy_filter": ("OpenAIPrivacyFilterExperts", ()),
    "step3p7": ("Step3p7Experts", (0,)),
}


def _experts(family: str, dtype) -> nn.Module:
    """The family's first experts module, every tensor random (biases and norms too)."""
    if family in EXPERTS_ONLY:
        from transformers import CONFIG_MAPPING

        name, args = EXPERTS_ONLY[family]
        config = CONFIG_MAPPING[family]()
        shrink(config)
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        experts = getattr(module, name)(config.get_text_config(), *args).to(dtype)
    else:
        experts = experts_modules(tiny_model(family, dtype))[0]
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.2)
    return experts


def _inputs(experts, dtype, T=9):
    """Rows routed to a few experts only (the others empty), top-2, random combine weights."""
    g = torch.Generator().manual_seed(4)
    D = (experts.gate_up_proj if experts.has_gate else experts.up_proj).shape[
        1 if experts.is_transposed else 2
    ]
    x = torch.randn(T, D, generator=g, dtype=dtype) * 2
    E = experts.num_experts
    ids = torch.stack([torch.randperm(E - 3, generator=g)[:2] for _ in range(T)])
    w = torch.rand(T, 2, generator=g, dtype=dtype)
    return x, ids, w


def _grads(module, x, ids, w):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = module(x, ids, w)
    (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("family", sorted(QUIRKS))
def test_quirk_experts_equal_the_family(family):
    dtype, tol = EXPERTS_SETTINGS.get(family, (torch.float64, TOL))
    experts = _experts(family, dtype)
    reference = copy.deepcopy(experts)
    quirks = hf_contract.experts_options(experts)["quirks"]
    got = (quirks.function, quirks.interleaved, quirks.up_bias, quirks.post_norm)
    assert got == QUIRKS[family], (family, got)
    assert type(experts).__qualname__ in quirks.experts_class
    model = nn.Module()
    model.experts = experts
    hf_contract.convert(model, "experts", experts, spare_slots=2)
    layer = model.experts
    assert isinstance(layer, hf_contract.HFExpertsLayer) and layer.config.quirks == quirks
    saved = json.loads(json.dumps(asdict(layer.config)))  # as checkpoints record it
    assert moe.MoEConfig(**saved).quirks == quirks

    back = moe.to_hf(copy.deepcopy(model)).experts.state_dict()
    want_state = reference.state_dict()
    assert back.keys() == want_state.keys()
    assert all(torch.equal(back[k], want_state[k]) for k in want_state), family

    x, ids, w = _inputs(reference, dtype)
    want = _grads(reference, x, ids, w)
    layer.train()
    got = _grads(layer, x, ids, w)
    for name, a, b in zip(("y", "x.grad", "weights.grad"), got, want):
        assert relative_error(a, b) <= tol, (family, name, relative_error(a, b))
    moe.parallel.sum_replica_grads(model)  # the spare slots' copies share their expert's rows
    grads = hf_named_grads(model)
    for name, p in reference.named_parameters():
        err = relative_error(grads[f"experts.{name}"], p.grad)
        assert err <= tol, (family, name, err)
        assert p.grad.abs().sum() > 0, (family, name)  # biases and norm weights learn too


class _PlusOne(nn.Module):
    """A family whose activation and post-expert norm map a zero row to a non-zero one."""

    def act_fn(self, h):
        return h * h + 1

    def post_expert_norm(self, y):
        return y + 1


def test_the_kernel_contract_on_quirk_rows():
    """family_mlp keeps the kernels' contract: rows past offsets_L[-1] exactly zero (whatever
    the family's function makes of a zero row), gather ids, row weights and sum_to_tokens."""
    from moe.kernels.expert_rows import ExpertRows
    from moe.kernels.registry import get_kernel
    from moe.quirks import Quirks, QuirkWeights, family_mlp

    g = torch.Generator().manual_seed(5)
    L, D, F, T = 3, 5, 4, 6
    w = QuirkWeights(
        w1_LDF=torch.randn(L, D, F, generator=g, dtype=torch.float64),
        w2_LFD=torch.randn(L, F, D, generator=g, dtype=torch.float64),
        b2_LD=torch.randn(L, D, generator=g, dtype=torch.float64),
        family=_PlusOne(),
        quirks=Quirks(experts_class="tests.PlusOne", function=ACT, post_norm=True),
    )
    x_TD = torch.randn(T, D, generator=g, dtype=torch.float64)
    ids_R = torch.tensor([4, 0, 0, 5, 2, 1, 3, 3])  # 8 rows; expert 1 empty; 2 dropped rows
    offsets_L = torch.tensor([2, 2, 6], dtype=torch.int32)
    kernel = get_kernel("torch")
    out_RD = family_mlp(kernel, x_TD[ids_R], offsets_L, w, rows=ExpertRows())
    assert torch.equal(out_RD[6:], torch.zeros(2, D, dtype=torch.float64))
    for r, e in enumerate([0, 0, 2, 2, 2, 2]):
        want = (x_TD[ids_R[r]] @ w.w1_LDF[e]) ** 2 + 1
        assert torch.allclose(out_RD[r], want @ w.w2_LFD[e] + w.b2_LD[e] + 1, rtol=1e-12)
    weights_R = torch.rand(8, generator=g, dtype=torch.float64)
    rows = ExpertRows(gather_ids_R=ids_R, row_weights_R=weights_R, sum_to_tokens=True)
    y_TD = family_mlp(kernel, x_TD, offsets_L, w, rows=rows)
    want_TD = torch.zeros(T, D, dtype=torch.float64).index_add(
        0, ids_R, out_RD * weights_R[:, None]
    )
    assert torch.allclose(y_TD, want_TD, rtol=1e-12, atol=0)


def test_a_module_that_wraps_the_contract_is_refused():
    """Ergo's experts run the contract's forward inside their own (a per-expert norm keyed by
    expert id, which no flag declares): one error naming the class and the tensor."""
    experts = experts_modules(tiny_model("ergo"))[0]
    with pytest.raises(ValueError, match=r"ErgoExperts cannot be converted.*post_expert_norm"):
        hf_contract.experts_options(experts)
    contract_class = type(experts).__mro__[1]  # ErgoExpertProjections: on the contract

    class OwnForward(contract_class):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return super().forward(hidden_states, top_k_index, top_k_weights)

    hf_contract.experts_options(contract_class(experts.config))  # squared ReLU: converts
    with pytest.raises(ValueError, match=r"its own forward \(.*OwnForward.forward\)"):
        hf_contract.experts_options(OwnForward(experts.config))


def test_lora_on_quirk_layers():
    """moe.lora on converted quirk layers (GPT-OSS: interleaved, biased, clamped SwiGLU): the
    adapters change each projection of the family's MLP (QuirkKernel around LoRA's kernel):
    with B random the model equals the merged one (W + scale A B), gradients reach the
    adapters only, and the family's b3 is kept through add_lora and merge."""
    from moe.lora import LoRAConfig, add_lora, merge

    model = moe.from_hf(tiny_model("gpt_oss", torch.float64))
    b3 = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith(".b3")}
    add_lora(model, LoRAConfig(rank=2, alpha=4.0))
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    ids = _ids(0)
    got = run(model, ids)
    trained = {n for n, p in model.named_parameters() if p.grad is not None}
    assert trained and all("lora_" in n for n in trained), trained
    assert len(trained) == 2 * 3 * len(b3)  # A and B of w1, w2, w3 in every layer
    merged = merge(copy.deepcopy(model))
    want = merged(input_ids=ids).logits
    assert relative_error(got.logits, want) <= TOL
    plain = moe.from_hf(tiny_model("gpt_oss", torch.float64))
    assert relative_error(plain(input_ids=ids).logits, want) > 1e-3  # the adapters count
    for n, p in merged.named_parameters():
        if n in b3:
            assert torch.equal(p, b3[n]), n


def test_checkpoint_round_trip(tmp_path):
    """moe.checkpoint saves and loads a converted quirk model (b3, the layer's post norm, the
    Quirks settings it records); a model whose family computes otherwise is refused."""
    model = moe.from_hf(tiny_model("gpt_oss", torch.float64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run(model, _ids(0))
    opt.step()
    moe.checkpoint.save_checkpoint(tmp_path, model, opt)
    fresh = moe.from_hf(tiny_model("gpt_oss", torch.float64, seed=5))
    moe.checkpoint.load_checkpoint(tmp_path, fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))
    want, got = model.state_dict(), fresh.state_dict()
    assert any(k.endswith(".b3") for k in want) and got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    other = tiny_model("gpt_oss", torch.float64)
    for m in experts_modules(other):
        m.limit = m.limit / 2  # another clamp: the recorded scalars differ
    other = moe.from_hf(other)
    with pytest.raises(ValueError, match="quirks=.* in the checkpoint"):
        moe.checkpoint.load_checkpoint(tmp_path, other, torch.optim.SGD(other.parameters()))


def _ids(rank: int) -> torch.Tensor:
    return torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(10 + rank))


def _converted(family: str):
    dtype = SETTINGS.get(family, (torch.float64, TOL))[0]
    model = tiny_model(family, dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    return moe.from_hf(model)


def _ranks_body(rank, world, cases):
    from moe.parallel import init_mesh, parallelize
    from moe.shards import local

    out = {}
    for family, data_parallel in cases:
        model = _converted(family)
        data_parallel, _, overlap = data_parallel.partition("+overlap")  # the overlapped one
        overlap = {"overlap": 2} if _ else {}
        parallelize(model, init_mesh(dp=1, ep=2), data_parallel, sync_params=False, **overlap)
        degrees = {getattr(layer.dispatcher, "degree", 1) for _, layer in moe.moe_layers(model)}
        assert degrees == {2 if overlap else 1}, degrees
        got = run(model, _ids(rank))
        grads = {n: None if p.grad is None else local(p.grad).detach().clone()
                 for n, p in model.named_parameters()}  # fmt: skip
        out[family, data_parallel + _] = (got.logits.detach(), got.loss.detach(), grads)
    return out


# clamped SwiGLU, interleaved, biased (GPT-OSS); the shared post-expert norm, a dense parameter
# fed by rows of both ranks (MuseSpark); squared ReLU (NemotronH, float32); ddp and fsdp;
# GPT-OSS under the overlapped dispatcher
EP_CASES = [(f, dp) for f in ("gpt_oss", "muse_spark") for dp in ("ddp", "fsdp")]
EP_CASES += [("nemotron_h", "ddp"), ("gpt_oss", "fsdp+overlap")]  # the overlapped dispatcher


def test_expert_parallel_equals_one_process():
    results = run_ranks(_ranks_body, 2, EP_CASES, timeout=120)
    for family, data_parallel in EP_CASES:
        tol = 1e-6 if SETTINGS.get(family, (torch.float64,))[0] == torch.float64 else 2e-5
        model = _converted(family)
        want = run(model, torch.cat([_ids(0), _ids(1)]))
        for rank in range(2):
            logits, loss, grads = results[rank][family, data_parallel]
            rows = want.logits[2 * rank : 2 * rank + 2]
            assert relative_error(logits, rows) <= tol, (family, data_parallel, rank)
            for name, p in model.named_parameters():
                if p.grad is None:
                    assert grads[name] is None, (family, rank, name)
                    continue
                g = p.grad if grads[name].shape == p.grad.shape else p.grad.chunk(2, 0)[rank]
                err = relative_error(grads[name], g, 1e-12)
                assert err <= tol, (family, data_parallel, rank, name, err)
        losses = [float(results[r][family, data_parallel][1]) for r in range(2)]
        assert abs(sum(losses) / 2 - float(want.loss.detach())) <= tol * abs(
            float(want.loss.detach())
        ), family


def test_quirk_layer_under_recompute_and_accumulation():
    """GPT-OSS's quirk layer (interleaved, biased, clamped SwiGLU), its batch taken as 2
    accumulated micro-batches, each checkpointed (the recompute a converted model takes: its
    decoder layers, moe.memory.recompute_blocks): the output and every gradient equal the plain
    layer's on the whole batch (float64). MoEConfig.recompute, which would route again in
    backward without the family's choice, is one error before any work."""
    from torch.utils.checkpoint import checkpoint

    experts = _experts("gpt_oss", torch.float64)
    options = hf_contract.experts_options(experts)
    x, ids, w = _inputs(experts, torch.float64, T=10)

    def build(recompute=False):
        layer = hf_contract.HFExpertsLayer(
            experts,
            hf_contract.family_module(experts),
            name="experts",
            dtype=torch.float64,
            **{**options, "recompute": recompute},
        ).train()
        hf_contract._copy_in(layer, experts)
        return layer

    with pytest.raises(ValueError, match="MoEConfig.recompute on a layer the family's router"):
        build(recompute=True)(x, ids, w)
    c = torch.randn(x.shape, generator=torch.Generator().manual_seed(5), dtype=x.dtype)

    def step(layer, x, ids, w, c, recompute):
        x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = checkpoint(layer, x, ids, w, use_reentrant=False) if recompute else layer(x, ids, w)
        (y * c).sum().backward()
        return y.detach(), x.grad, w.grad

    results = []
    for parts in (1, 2):
        layer = build()
        chunks = zip(*(t.chunk(parts) for t in (x, ids, w, c)))
        outs = [step(layer, *chunk, recompute=parts > 1) for chunk in chunks]
        grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
        results.append(([torch.cat(t) for t in zip(*outs)], grads))
    (plain, g0), (accumulated, g1) = results
    for a, b in zip(accumulated, plain):
        assert relative_error(a, b) <= TOL
    assert g0.keys() == g1.keys() and any(n.endswith("b3") for n in g0)
    for name in g0:
        assert relative_error(g1[name], g0[name]) <= TOL, name
        assert g0[name].abs().sum() > 0, name
