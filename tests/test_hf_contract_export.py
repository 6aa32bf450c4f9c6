"""Families converted through the experts contract, trained, exported: one SGD step on the
converted model, then to_hf -> save_pretrained -> transformers' from_pretrained gives the same
logits as the trained converted model, and the same weights bit for bit; save_hf_checkpoint
writes what from_pretrained and load_hf_checkpoint load (also under EP = 2, where to_peft's
adapter is checked in PEFT too)."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the `hf` extra; .ci/run installs it

import moe  # noqa: E402
from moe.interop import to_peft  # noqa: E402
from moe.lora import LoRAConfig, add_lora  # noqa: E402
from tests.distributed import run_ranks  # noqa: E402
from tests.hf_tiny import relative_error, run, tiny_model  # noqa: E402

peft = pytest.importorskip("peft")

FAMILIES = ["qwen3_vl_moe", "glm4_moe", "minimax_m2"]  # multimodal; shared + dense; router bias


@pytest.mark.parametrize("family", FAMILIES)
def test_trained_export_reloads_exactly(family, tmp_path):
    model = moe.from_hf(tiny_model(family))
    assert moe.moe_layers(model)
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(3))
    run(model, ids)
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.5 * p.grad
    model.eval()
    want = model(input_ids=ids).logits
    exported = moe.to_hf(copy.deepcopy(model))
    exported.save_pretrained(tmp_path)
    reloaded = type(exported).from_pretrained(tmp_path).eval()
    reloaded.set_experts_implementation("eager")
    state = exported.state_dict()
    before = tiny_model(family).state_dict()
    assert any(not torch.equal(state[k], before[k]) for k in state if ".experts." in k), family
    for name, t in reloaded.state_dict().items():
        assert torch.equal(t, state[name]), (family, name)
    assert relative_error(reloaded(input_ids=ids).logits, want) <= 1e-5, family


# transposed (Aria), interleaved gate/up with biases (GPT-OSS), a post-expert norm (MuseSpark),
# multimodal (Qwen3-VL-MoE), shared experts + dense layers (GLM-4.5 MoE)
SAVED = ["aria", "gpt_oss", "muse_spark", "qwen3_vl_moe", "glm4_moe"]


@pytest.mark.parametrize("family", SAVED)
def test_save_hf_checkpoint_reloads_in_transformers(family, tmp_path):
    """save_hf_checkpoint writes a contract family under its experts modules' own names (read
    from the module, no per-family table): transformers' from_pretrained loads every tensor
    (to_hf's state dict, bit for bit) and computes the converted model's logits."""
    model = moe.from_hf(tiny_model(family))
    with torch.no_grad():  # weights (biases, norms) away from their init
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model.eval()(input_ids=ids).logits
    moe.save_hf_checkpoint(model, str(tmp_path))
    # MuseSpark's tiny config fails transformers' own validation when read back from JSON
    config = {"config": model.config} if family == "muse_spark" else {}
    reloaded = type(model).from_pretrained(tmp_path, **config).eval()
    reloaded.set_experts_implementation("eager")
    state = moe.to_hf(copy.deepcopy(model)).state_dict()
    got = reloaded.state_dict()
    assert got.keys() == state.keys(), family
    for name, t in got.items():
        assert torch.equal(t, state[name]), (family, name)
    assert relative_error(reloaded(input_ids=ids).logits, want) <= 1e-5, family
    # and load_hf_checkpoint reads it back into a converted model holding other weights
    again = moe.from_hf(tiny_model(family, seed=1))
    assert relative_error(again.eval()(input_ids=ids).logits, want) > 1e-3, family
    moe.load_hf_checkpoint(again, str(tmp_path))
    back = moe.to_hf(copy.deepcopy(again)).state_dict()
    assert all(torch.equal(back[k], state[k]) for k in state), family


def _adapted(family: str):
    """The family converted, with LoRA, base and adapters moved the same way in every process."""
    model = add_lora(moe.from_hf(tiny_model(family)), LoRAConfig(rank=2, alpha=3.0))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _ep_body(rank, world, cases, out):
    from moe.parallel import init_mesh, parallelize

    logits = {}
    for family, data_parallel in cases:
        model = _adapted(family)
        parallelize(model, init_mesh(dp=1, ep=2), data_parallel, sync_params=False)
        moe.save_hf_checkpoint(model, f"{out}/{family}-{data_parallel}-hf")
        to_peft(model, f"{out}/{family}-{data_parallel}-peft")
        again = moe.from_hf(tiny_model(family, seed=1))  # other weights, then the saved ones
        parallelize(again, init_mesh(dp=1, ep=2), data_parallel, sync_params=False)
        moe.load_hf_checkpoint(again, f"{out}/{family}-{data_parallel}-hf")
        ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(8))
        with torch.no_grad():
            logits[family, data_parallel] = again.eval()(input_ids=ids).logits
    return logits


EP_CASES = [("glm4_moe", "ddp"), ("glm4_moe", "fsdp"), ("gpt_oss", "ddp")]


def test_expert_parallel_save_and_peft_export(tmp_path):
    """EP = 2 on gloo (experts sharded, DTensors gathered): save_hf_checkpoint's folder loads in
    transformers with the one-process model's tensors, and to_peft's adapter gives the
    one-process LoRA model's logits in PEFT."""
    loaded = run_ranks(_ep_body, 2, EP_CASES, str(tmp_path), timeout=120)
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(8))
    for family, data_parallel in EP_CASES:
        model = _adapted(family).eval()
        base = moe.to_hf(copy.deepcopy(model))  # the base weights, adapters left out
        with torch.no_grad():
            want = model(input_ids=ids).logits
        folder = tmp_path / f"{family}-{data_parallel}"
        reloaded = type(base).from_pretrained(f"{folder}-hf").eval()
        state = base.state_dict()
        for name, t in reloaded.state_dict().items():
            assert torch.equal(t, state[name]), (family, data_parallel, name)
        pm = peft.PeftModel.from_pretrained(copy.deepcopy(base), f"{folder}-peft").eval()
        with torch.no_grad():
            got, plain = pm(input_ids=ids).logits, base(input_ids=ids).logits
        assert relative_error(plain, want) > 1e-3, family  # the adapters change the function
        assert relative_error(got, want) <= 1e-5, (family, data_parallel)
        for rank in (0, 1):  # load_hf_checkpoint into EP = 2: each rank its experts
            got = loaded[rank][family, data_parallel]
            assert relative_error(got, plain) <= 1e-5, (family, data_parallel, rank)


def test_every_converting_family_saves_and_reloads_exactly(tmp_path):
    """save_hf_checkpoint -> transformers' from_pretrained for every family moe.from_hf
    converts (the support table's): every tensor is to_hf's, bit for bit. Tiny configs are
    handed over as objects: some fail transformers' own validation when read back from JSON."""
    from tests.hf_matrix import support

    families = [f for f, row in support().items() if not isinstance(row.get("convert"), str)]
    families = [f for f in families if "convert" in support()[f]]
    assert len(families) >= 24
    for family in families:
        model = moe.from_hf(tiny_model(family))
        with torch.no_grad():  # weights (biases, norms) away from their init
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        out = tmp_path / family
        moe.save_hf_checkpoint(model, str(out))
        reloaded = type(model).from_pretrained(out, config=model.config)
        state = moe.to_hf(model).state_dict()
        got = reloaded.state_dict()
        assert got.keys() == state.keys(), family
        assert all(torch.equal(t, state[n]) for n, t in got.items()), family
