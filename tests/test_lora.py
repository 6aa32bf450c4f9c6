"""LoRA on the experts (issue 50) in one process: a LoRA'd MoELayer equals a naive per-expert
float64 reference (x W + dropout(x) A B * alpha / r per expert and projection, per token) in
outputs, the input gradient and every adapter gradient, with base weights frozen (no
gradient), at awkward sizes, with capacity drops, expert choice, shared experts, recompute,
replicas, biases, on the torch, Triton (interpreter on CPU) and FP8 kernels; bad settings are
one ValueError; merge folds the adapters."""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # (before any Triton kernel module is imported)

import moe  # noqa: E402
from moe.capacity import capacity_factor_for, expert_capacity  # noqa: E402
from moe.lora import LoRAConfig, adapter_parameters, adapter_state_dict, add_lora, merge  # noqa: E402
from moe.lora import kernel as lora_kernel  # noqa: E402
from tests import reference as ref  # noqa: E402
from tests.fp8_reference import RefFP8Gemm  # noqa: E402
from tests.tolerance import assert_close_in  # noqa: E402

E, D, F_, R = 5, 7, 9, 3
P_DROP = 0.25


def sign_dropout(x, p):
    """A known dropout mask (a function of the values, so the reference applies the same one):
    keep positive entries, scaled by 1 / (1 - p). Positive row weights keep the mask."""
    return x * (x > 0) / (1 - p) if p > 0 else x


def build(seed=0, dtype=torch.float64, lora=None, **options):
    torch.manual_seed(seed)
    opts = {"top_k": 2, "activation": "swiglu", **options}
    layer = moe.MoELayer(D, F_, E, dtype=dtype, **opts)
    layer.router.double()  # (the router computes in float32 unless cast: exact comparisons)
    add_lora(layer, lora or LoRAConfig(rank=R, alpha=5.0, dropout=P_DROP))
    with torch.no_grad():  # B = 0 at init: give every adapter a value that shows
        for n, p in adapter_parameters(layer):
            if "lora_B" in n:
                p.copy_(torch.randn_like(p) * 0.5)
        for p in layer.experts.parameters():  # replicas hold their expert's values
            if p.dim() >= 2 and p.shape[0] == layer.num_slots:
                p.copy_(p[layer.expert_of_slot_S])
    return layer


def _pairs(layer, routing, T):
    """(token, canonical expert, combine weight) of every kept pair."""
    c = layer.config
    if routing.token_ids_EC is not None:
        return [
            (int(t), e, routing.weights_EC[e, j])
            for e in range(c.num_experts)
            for j, t in enumerate(routing.token_ids_EC[e])
        ]
    ids = routing.expert_ids_TK.tolist()
    cap = expert_capacity(
        T, c.num_experts, c.top_k, capacity_factor_for(c, layer.training), c.min_capacity
    )
    keep = ref.keep_mask(ids, routing.weights_TK.detach(), c.num_experts, cap, c.drop_policy)
    return [
        (t, ids[t][j], routing.weights_TK[t, j])
        for t in range(T)
        for j in range(c.top_k)
        if keep[t][j]
    ]


def reference(layer, x_TD, drop, gemm=None):
    """Per token and kept (expert, weight) pair, float64: rw * MLP_e with each adapted
    projection v W + scale * drop(v) A B. `gemm(v, W)`: the base GEMM (FP8: quantized)."""
    gemm = gemm or (lambda v, w: v @ w)
    c, s = layer.config, layer.config.lora.scale
    ex = layer.experts
    P = {
        n: p.detach().double().clone().requires_grad_(p.requires_grad)
        for n, p in ex.named_parameters(recurse=False)
    }
    x = x_TD.detach().double().clone().requires_grad_()
    routing = layer.router(x)

    def proj(v, name, e):
        y = gemm(v, P[name][e].double())
        if f"lora_A_{name}" in P:
            y = y + s * (drop(v) @ P[f"lora_A_{name}"][e] @ P[f"lora_B_{name}"][e])
        return y

    rows = [torch.zeros(D, dtype=torch.float64) for _ in range(x.shape[0])]
    for t, e, w in _pairs(layer, routing, x.shape[0]):
        v = x[t : t + 1]
        h = proj(v, "w1", e) + (P["b1"][e] if "b1" in P else 0)
        g = proj(v, "w3", e) if c.activation == "swiglu" else None
        a = F.silu(h) * g if g is not None else ref.ACT[c.activation](h)
        y = proj(a, "w2", e) + (P["b2"][e] if "b2" in P else 0)
        rows[t] = rows[t] + w * y[0]  # (the FP8 kernel weights its output rows, not a)
    y = torch.stack(rows)
    if layer.shared_experts is not None:
        y = y + shared_reference(layer.shared_experts, x, drop, s)
    return y, x, P


def shared_reference(shared, x, drop, s):
    def lin(m, v):
        y = v @ m.weight.detach().double().t()
        y = y if m.bias is None else y + m.bias.detach().double()
        m.ref_A = m.lora_A.detach().double().requires_grad_()
        m.ref_B = m.lora_B.detach().double().requires_grad_()
        return y + s * (drop(v) @ m.ref_A.t() @ m.ref_B.t())

    h = F.silu(lin(shared.gate_proj, x)) * lin(shared.up_proj, x)
    return lin(shared.down_proj, h)


def check(layer, T=11, tol=None, monkeypatch=None, gemm=None, dtype=torch.float64):
    """The layer's output, x grad and adapter grads (copies summed into their expert) equal the
    reference's; every base parameter frozen, without a gradient."""
    p = layer.config.lora.dropout if layer.training else 0.0
    drop = lambda v: sign_dropout(v, p)  # noqa: E731
    if monkeypatch is not None:
        monkeypatch.setattr(lora_kernel, "adapter_dropout", sign_dropout)
    x = torch.randn(T, D, dtype=dtype, generator=torch.Generator().manual_seed(7))
    y_ref, x_ref, P = reference(layer, x, drop, gemm)
    x = x.clone().requires_grad_()
    y = layer(x)
    g = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    (y.double() * g).sum().backward()
    (y_ref * g).sum().backward()
    tol = tol or {"rtol": 1e-9, "atol": 1e-10}
    close = tol if callable(tol) else lambda a, b: torch.testing.assert_close(a, b, **tol)
    close(y.double(), y_ref)
    close(x.grad.double(), x_ref.grad)
    slots = layer.expert_of_slot_S
    n_grads = 0
    for n, p in layer.named_parameters():
        if "lora_" not in n:
            assert not p.requires_grad and p.grad is None, n
            continue
        assert p.grad is not None, n
        if n.startswith("router."):  # the reference routes with the live router: its own test
            continue
        if not n.startswith("experts."):  # a shared expert's: the reference's leaf
            mod = layer.get_submodule(n.rpartition(".")[0])
            want = getattr(mod, "ref_" + n.rpartition("_")[2]).grad
            close(p.grad.double(), want)
            continue
        name = n.removeprefix("experts.")
        got = torch.zeros_like(P[name].grad).index_add_(0, slots, p.grad.double())
        close(got[:E], P[name].grad[:E])
        n_grads += 1
    assert n_grads == 2 * len(layer.config.lora.targets)


CASES = {
    "swiglu_dropless_dropout": {},
    "gelu_capacity_drops_bias": {
        "activation": "gelu",
        "capacity_factor": 0.6,
        "min_capacity": 1,
        "bias": True,
        "lora": LoRAConfig(rank=R, alpha=2.0, dropout=P_DROP, targets=("w2", "w1")),
    },
    "expert_choice": {"router": "expert_choice", "capacity_factor": 1.0},
    "shared_experts": {
        "num_shared_experts": 1,
        "lora": LoRAConfig(rank=2, alpha=3.0, dropout=P_DROP, shared_experts=True),
    },
    "recompute": {"recompute": True},
    "router_adapter": {"lora": LoRAConfig(rank=2, alpha=3.0, dropout=P_DROP, router=True)},
    "replicas": {"spare_slots": 2},
    "up_only_rank_1": {"lora": LoRAConfig(rank=1, alpha=0.5, targets=("w3",))},
}


@pytest.mark.parametrize("case", CASES)
def test_lora_layer_equals_per_expert_reference(case, monkeypatch):
    check(build(**CASES[case]), monkeypatch=monkeypatch)


def test_router_adapter_logits_and_gradients(monkeypatch):
    """logits = x W^T + scale * drop(x) A^T B^T (fp32 math, here float64), differentiable in
    x, A and B; the router's weight frozen. A switch router (jitter off) takes it as well."""
    monkeypatch.setattr(lora_kernel, "adapter_dropout", sign_dropout)
    for router in ("topk", "switch"):
        top_k = 1 if router == "switch" else 2
        cfg = LoRAConfig(rank=2, alpha=3.0, dropout=P_DROP, router=True)
        layer = build(router=router, top_k=top_k, jitter_eps=0.0, lora=cfg)
        r = layer.router
        with torch.no_grad():
            r.lora_B.normal_()
        x = torch.randn(6, D, dtype=torch.float64, requires_grad=True)
        got = r.logits(x)
        a, b = (t.detach().clone().requires_grad_() for t in (r.lora_A, r.lora_B))
        x_ref = x.detach().clone().requires_grad_()
        want = x_ref @ r.weight.detach().t() + 1.5 * sign_dropout(x_ref, P_DROP) @ a.t() @ b.t()
        g = torch.randn_like(want)
        (got * g).sum().backward()
        (want * g).sum().backward()
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        for mine, ref_t in ((x, x_ref), (r.lora_A, a), (r.lora_B, b)):
            torch.testing.assert_close(mine.grad, ref_t.grad, rtol=1e-12, atol=1e-12)
        assert r.weight.grad is None and not r.weight.requires_grad


def test_lora_layer_in_eval_has_no_dropout(monkeypatch):
    layer = build().eval()
    check(layer, monkeypatch=monkeypatch)  # the reference without a mask


def test_real_dropout_acts_in_training_only():
    layer = build(lora=LoRAConfig(rank=R, alpha=5.0, dropout=0.5))
    x = torch.randn(13, D, dtype=torch.float64)
    torch.manual_seed(1)
    y_a = layer(x)
    torch.manual_seed(2)
    y_b = layer(x)
    assert not torch.equal(y_a, y_b)  # another mask
    layer.eval()
    assert torch.equal(layer(x), layer(x))


def test_dense_adapters_drop_in_training_only():
    """The shared experts' and the router's adapters (moe.lora.linear.DenseAdapter) drop their
    input in training only, as the experts' do (their B non-zero: a zero B hides any mask)."""
    cfg = LoRAConfig(rank=2, alpha=3.0, dropout=0.5, targets=("w1",), shared_experts=True,
                     router=True)  # fmt: skip
    layer = build(num_shared_experts=1, lora=cfg)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "lora_B" in name and "experts.lora" not in name:  # the dense adapters only
                p.normal_()
            elif "lora_B" in name:
                p.zero_()
    x = torch.randn(13, D, dtype=torch.float64)
    torch.manual_seed(1)
    y_a = layer(x)
    torch.manual_seed(2)
    assert not torch.equal(y_a, layer(x))  # another mask
    layer.eval()
    torch.manual_seed(1)
    y_a = layer(x)
    torch.manual_seed(2)
    assert torch.equal(y_a, layer(x))


@pytest.mark.parametrize("T", [1, 6])
def test_triton_kernel(T, monkeypatch):
    pytest.importorskip("triton")
    layer = build(dtype=torch.float32, backend="triton")
    tol = {"rtol": 2e-4, "atol": 2e-5}
    check(layer, T=T, tol=tol, monkeypatch=monkeypatch, dtype=torch.float32)


def _fp8_gemm(v, w):
    return RefFP8Gemm.apply(v, w, True, True, "rowwise")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_experts_with_adapters(dtype, monkeypatch):
    """FP8 base GEMMs (the reference quantizes the same way), adapters in the weights' dtype."""
    from moe.fp8 import FP8Config

    layer = build(dtype=dtype, fp8=FP8Config(experts=True))
    assert layer.experts.kernel_for(torch.zeros(1)).name == "fp8"
    tol = {"rtol": 1e-4, "atol": 1e-5}
    if dtype == torch.bfloat16:  # bf16 roundings of the values' scale (FP8 steps shared with
        # the reference): measured 3.0 eps on y, 4.8 on dx (its bf16 gradient quantized to FP8
        # a step apart from the float64 one's here and there), 1.4 on the adapters' gradients
        tol = lambda a, b: assert_close_in(torch.bfloat16, a, b, ulps=6)  # noqa: E731
    check(layer, tol=tol, monkeypatch=monkeypatch, gemm=_fp8_gemm, dtype=dtype)


def test_add_lora_freezes_keeps_output_and_inits_like_peft():
    torch.manual_seed(0)
    layer = moe.MoELayer(D, F_, E, top_k=2, activation="swiglu", num_shared_experts=1)
    x = torch.randn(9, D)
    y0 = layer(x)
    add_lora(layer, LoRAConfig(rank=R, alpha=6.0, shared_experts=True))
    assert torch.equal(layer(x), y0)  # B = 0
    ex = layer.experts
    assert ex.lora_A_w1.shape == (E, D, R) and ex.lora_B_w1.shape == (E, R, F_)
    assert ex.lora_A_w2.shape == (E, F_, R) and ex.lora_B_w2.shape == (E, R, D)
    assert ex.lora_A_w3.shape == (E, D, R) and ex.lora_B_w3.shape == (E, R, F_)
    assert ex.lora_A_w2.abs().max() <= F_**-0.5 and ex.lora_A_w2.std() > 0
    assert layer.config.lora.rank == R and layer.config.weight_format == "dense"
    trainable = {n for n, p in layer.named_parameters() if p.requires_grad}
    assert trainable == set(adapter_state_dict(layer))
    assert "shared_experts.up_proj.lora_A" in trainable
    assert layer.shared_experts.up_proj.lora_A.shape == (R, D)
    # a config built from a dict (JSON) records the same settings
    cfg = moe.MoEConfig(**{**layer.config.__dict__, "lora": layer.config.lora.__dict__})
    assert cfg.lora == layer.config.lora


def test_merge_folds_the_adapters():
    cfg = LoRAConfig(rank=R, alpha=4.0, shared_experts=True, router=True)
    layer = build(num_shared_experts=1, lora=cfg)
    with torch.no_grad():
        layer.router.lora_B.normal_()
    x = torch.randn(10, D, dtype=torch.float64)
    y = layer(x)
    merge(layer)
    assert layer.config.lora is None and layer.config.weight_format == "dense"
    assert not adapter_state_dict(layer)
    assert not any("lora" in n for n, _ in layer.named_parameters())
    assert layer.router.logit_term is None
    torch.testing.assert_close(layer(x), y, rtol=1e-12, atol=1e-12)


def test_one_setting_chooses_lora():
    """MoEConfig.lora alone builds a LoRA layer; weight_format="lora", as releases before
    recorded it beside lora=, still reads (as "dense"), and alone is refused."""
    layer = moe.MoELayer(D, F_, E, lora={"rank": 2, "alpha": 1.0})
    assert layer.experts.lora_B_w2.shape == (E, 2, D) and not layer.experts.w1.requires_grad
    assert layer.config.weight_format == "dense"
    old = moe.MoELayer(D, F_, E, weight_format="lora", lora={"rank": 2, "alpha": 1.0})
    assert old.config == layer.config
    with pytest.raises(ValueError, match="weight_format='lora' is retired"):
        moe.MoELayer(D, F_, E, weight_format="lora")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"rank": 0, "alpha": 1.0}, "rank must be a positive int"),
        ({"rank": 2.0, "alpha": 1.0}, "rank must be a positive int"),
        ({"rank": 2, "alpha": 0.0}, "alpha must be > 0"),
        ({"rank": 2, "alpha": float("nan")}, "alpha must be a finite"),
        ({"rank": 2, "alpha": 1.0, "dropout": 1.0}, r"dropout must be in \[0, 1\)"),
        ({"rank": 2, "alpha": 1.0, "dropout": -0.1}, r"dropout must be in \[0, 1\)"),
        ({"rank": 2, "alpha": 1.0, "targets": ("w4",)}, "targets must be distinct"),
        ({"rank": 2, "alpha": 1.0, "targets": ()}, "targets must be distinct"),
        ({"rank": 2, "alpha": 1.0, "targets": "w1"}, "targets must be a tuple"),
    ],
)
def test_bad_config_is_one_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LoRAConfig(**kwargs)


def test_bad_add_lora_is_refused_before_any_change():
    layer = moe.MoELayer(D, F_, E, top_k=2, activation="gelu")
    before = {n: p.requires_grad for n, p in layer.named_parameters()}
    for cfg, match in [
        (LoRAConfig(rank=8, alpha=1.0), r"rank=8 exceeds min\(in, out\)=7 of model.experts.w1"),
        (LoRAConfig(rank=2, alpha=1.0, targets=("w3",)), "match no expert projection"),
        (LoRAConfig(rank=2, alpha=1.0, shared_experts=True), "has no shared experts"),
    ]:
        with pytest.raises(ValueError, match=match):
            add_lora(layer, cfg)
        assert {n: p.requires_grad for n, p in layer.named_parameters()} == before
        assert layer.config.lora is None
    with pytest.raises(ValueError, match="no moe.MoELayer"):
        add_lora(torch.nn.Linear(2, 2), LoRAConfig(rank=1, alpha=1.0))
    add_lora(layer, LoRAConfig(rank=2, alpha=1.0))
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        add_lora(layer, LoRAConfig(rank=2, alpha=1.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_adapted_path_with_zero_adapters_is_the_fp8_kernel_exactly(dtype):
    """B = 0: the adapted path (base GEMMs on moe::fp8_grouped_mm) gives the fused FP8 expert
    MLP's output bit for bit (the same quantizations in the same order) and its input gradient
    to the rounding of one order of sums: the fused MLP adds the up and gate dgrads into the
    tokens one GEMM after the other, the adapted path adds them per row first."""
    from moe.fp8 import FP8Config

    torch.manual_seed(0)
    layer = moe.MoELayer(
        D, F_, E, top_k=2, activation="swiglu", dtype=dtype, fp8=FP8Config(experts=True)
    )
    x = torch.randn(13, D, dtype=dtype, generator=torch.Generator().manual_seed(1))
    out = []
    for adapt in (False, True):
        if adapt:
            add_lora(layer, LoRAConfig(rank=R, alpha=2.0))
        xg = x.clone().requires_grad_()
        y = layer(xg)
        y.float().square().sum().backward()
        out.append((y.detach(), xg.grad))
    assert torch.equal(out[0][0], out[1][0])
    dx, adapted_dx = out[0][1].float(), out[1][1].float()
    assert adapted_dx.abs().sum() > 0
    # three roundings of sums of two terms each at most |dx|'s scale
    atol = 4 * torch.finfo(dtype).eps * float(dx.abs().max())
    torch.testing.assert_close(adapted_dx, dx, rtol=0, atol=atol)


def test_triton_ragged_mm_ops_pass_opcheck():
    """The adapted MLP's Triton GEMMs are custom ops whose schema, fake and autograd
    registrations agree with them (torch.compile's view), and equal a per-group reference."""
    pytest.importorskip("triton")
    from moe.kernels.triton.ragged_mm_fn import ragged_mm_triton

    offsets = torch.tensor([3, 3, 7], dtype=torch.int32)  # group ends: an empty group, a tail row
    x = torch.randn(8, 5, requires_grad=True)  # float32: the Triton GEMMs' widest dtype
    w = torch.randn(3, 5, 6, requires_grad=True)
    utils = ("test_schema", "test_faketensor", "test_autograd_registration")
    torch.library.opcheck(torch.ops.moe.ragged_mm_triton, (x, w, offsets), test_utils=utils)
    y = ragged_mm_triton(x, w, offsets)
    dy = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    rows = [x64[0:3] @ w64[0], x64[3:3] @ w64[1], x64[3:7] @ w64[2], x64[7:] * 0 @ w64[0]]
    want = torch.cat(rows)
    want_dx, want_dw = torch.autograd.grad(want, (x64, w64), dy.double())
    for got, ref_ in ((y, want), (dx, want_dx), (dw, want_dw)):
        torch.testing.assert_close(got.double(), ref_, rtol=1e-5, atol=1e-5)
