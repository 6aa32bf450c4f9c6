"""load_hf_checkpoint / save_hf_checkpoint against transformers' own save_pretrained and
from_pretrained: the hub's per-expert layout, the fused layout, expert parallelism on 2 gloo
ranks (each rank opens only its own experts' tensors), and every error case."""

import copy
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import moe
from moe.interop import HFCheckpointError
from moe.parallel import init_mesh, parallelize
from tests.distributed import run_ranks
from tests.test_hf_parity import fresh

transformers = pytest.importorskip("transformers")
FAMILIES = ["mixtral", "qwen2_moe", "deepseek_v3"]


def logits(model, ids):
    return model.eval()(ids).logits


def saved(family: str, directory) -> torch.nn.Module:
    reference = fresh(family)
    reference.save_pretrained(directory)  # the hub's per-expert layout
    return reference


def converted_from_config(family: str) -> torch.nn.Module:
    torch.manual_seed(123)  # other weights than the saved ones
    model = transformers.AutoModelForCausalLM.from_config(fresh(family).config)
    return moe.from_hf(model.float())


@pytest.mark.parametrize("family", FAMILIES)
def test_load_hub_layout_then_save_for_transformers(family, tmp_path):
    reference = saved(family, tmp_path / "hub")
    model = converted_from_config(family)
    ids = torch.randint(0, 97, (2, 9))
    assert not torch.allclose(logits(model, ids), logits(reference, ids))
    moe.load_hf_checkpoint(model, str(tmp_path / "hub"))
    torch.testing.assert_close(logits(model, ids), logits(reference, ids), rtol=1e-5, atol=1e-6)
    moe.save_hf_checkpoint(model, str(tmp_path / "out"))
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    torch.testing.assert_close(logits(again, ids), logits(reference, ids), rtol=1e-5, atol=1e-6)
    assert set(load_file(tmp_path / "hub" / "model.safetensors")) == set(
        k for f in (tmp_path / "out").glob("*.safetensors") for k in load_file(f)
    )


def test_load_fused_layout(tmp_path):
    reference = fresh("qwen2_moe")
    state = {k: v.contiguous() for k, v in reference.state_dict().items()}  # fused in memory
    (tmp_path / "fused").mkdir()
    save_file(state, tmp_path / "fused" / "model.safetensors")
    model = converted_from_config("qwen2_moe")
    moe.load_hf_checkpoint(model, str(tmp_path / "fused"))
    ids = torch.randint(0, 97, (2, 9))
    torch.testing.assert_close(logits(model, ids), logits(reference, ids), rtol=1e-5, atol=1e-6)


def _ep_body(rank, world, directory, out_dir, data_parallel):
    import safetensors

    opened = []
    real = safetensors.safe_open

    class Counting:
        def __init__(self, *a, **k):
            self.f = real(*a, **k)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_slice(self, key):
            return self.inner.get_slice(key)

        def get_tensor(self, key):
            opened.append(key)
            return self.inner.get_tensor(key)

    safetensors.safe_open = Counting
    model = converted_from_config("mixtral")
    parallelize(model, init_mesh(dp=1, ep=2), data_parallel, sync_params=False)
    moe.load_hf_checkpoint(model, directory)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(rank))
    model.eval()
    y = model(ids).logits
    moe.save_hf_checkpoint(model, out_dir)
    experts = sorted(
        {int(k.split(".experts.")[1].split(".")[0]) for k in opened if ".experts." in k}
    )
    return y, experts


@pytest.mark.parametrize("data_parallel", ["ddp", "fsdp"])
def test_expert_parallel_load_reads_only_local_experts(tmp_path, data_parallel):
    reference = saved("mixtral", tmp_path / "hub")
    hub, out = str(tmp_path / "hub"), str(tmp_path / "out")
    results = run_ranks(_ep_body, 2, hub, out, data_parallel, timeout=60)
    E = reference.config.num_local_experts
    assert results[0][1] == list(range(E // 2)) and results[1][1] == list(range(E // 2, E))
    for rank, (y, _) in enumerate(results):
        ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(rank))
        torch.testing.assert_close(y, logits(reference, ids), rtol=1e-5, atol=1e-6)
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    ids = torch.randint(0, 97, (2, 9))
    torch.testing.assert_close(logits(again, ids), logits(reference, ids), rtol=1e-5, atol=1e-6)


def test_errors_name_the_key_and_change_nothing(tmp_path):
    saved("mixtral", tmp_path / "hub")
    good = load_file(tmp_path / "hub" / "model.safetensors")
    model = converted_from_config("mixtral")
    before = copy.deepcopy(model.state_dict())
    key = "model.layers.1.block_sparse_moe.experts.2.w3.weight"

    def attempt(state, match, index=None):
        d = tmp_path / f"case{len(os.listdir(tmp_path))}"
        d.mkdir()
        save_file(state, d / "model.safetensors")
        if index is not None:
            (d / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(HFCheckpointError, match=match):
            moe.load_hf_checkpoint(model, str(d))
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k]), k

    attempt({k: v for k, v in good.items() if k != key}, f"missing key {key}")
    attempt(
        {**good, "model.layers.0.extra.weight": torch.zeros(2)},
        "unexpected key model.layers.0.extra",
    )
    attempt({**good, key: torch.zeros(3, 3)}, rf"{key}: checkpoint shape \(3, 3\)")
    attempt(good, "not a plain file", {"weight_map": {key: "../../etc/passwd"}})
    with pytest.raises(HFCheckpointError, match="neither"):
        moe.load_hf_checkpoint(model, str(tmp_path))
    with pytest.raises(HFCheckpointError, match="call moe.from_hf"):
        moe.load_hf_checkpoint(torch.nn.Linear(2, 2), str(tmp_path / "hub"))
