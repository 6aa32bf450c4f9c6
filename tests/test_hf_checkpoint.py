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


def _ep_body(rank, world, directory, out_dir, modes):
    """For each data-parallel mode in turn on the same 2 ranks (one start): the logits of the
    expert-parallel model loaded from `directory`, and the experts whose tensors it read."""
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
    out = {}
    for data_parallel in modes:
        opened.clear()
        model = converted_from_config("mixtral")
        parallelize(model, init_mesh(dp=1, ep=2), data_parallel, sync_params=False)
        moe.load_hf_checkpoint(model, directory)
        ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(rank))
        model.eval()
        y = model(ids).logits
        moe.save_hf_checkpoint(model, f"{out_dir}-{data_parallel}")
        experts = sorted(
            {int(k.split(".experts.")[1].split(".")[0]) for k in opened if ".experts." in k}
        )
        out[data_parallel] = (y, experts)
    return out


def test_expert_parallel_load_reads_only_local_experts(tmp_path):
    """ddp and fsdp: each rank reads only its own experts, computes the reference logits, and
    the saved folder loads in transformers."""
    reference = saved("mixtral", tmp_path / "hub")
    hub, out = str(tmp_path / "hub"), str(tmp_path / "out")
    modes = ["ddp", "fsdp"]
    results = run_ranks(_ep_body, 2, hub, out, modes, timeout=60)
    E = reference.config.num_local_experts
    for mode in modes:
        assert results[0][mode][1] == list(range(E // 2)), mode
        assert results[1][mode][1] == list(range(E // 2, E)), mode
        for rank, result in enumerate(results):
            ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(rank))
            want = logits(reference, ids)
            torch.testing.assert_close(
                result[mode][0], want, rtol=1e-5, atol=1e-6, msg=lambda m, mode=mode: f"{mode}: {m}"
            )
        again = transformers.AutoModelForCausalLM.from_pretrained(f"{out}-{mode}")
        ids = torch.randint(0, 97, (2, 9))
        torch.testing.assert_close(
            logits(again, ids),
            logits(reference, ids),
            rtol=1e-5,
            atol=1e-6,
            msg=lambda m, mode=mode: f"{mode} saved: {m}",
        )


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


# ---- issue 26: saves keep other files; duplicate keys, untrusted index and headers


def _listing(directory) -> dict:
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}


def test_save_leaves_other_files_and_replaces_only_its_own(tmp_path):
    reference = saved("mixtral", tmp_path / "hub")
    model = converted_from_config("mixtral")
    moe.load_hf_checkpoint(model, str(tmp_path / "hub"))
    out = tmp_path / "out"
    out.mkdir()
    (out / "tokenizer.json").write_text('{"version": "1.0"}')
    (out / "README.md").write_text("# my model")
    moe.save_hf_checkpoint(model, str(out))
    first = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    moe.save_hf_checkpoint(model, str(out))
    second = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert (out / "tokenizer.json").read_text() == '{"version": "1.0"}'
    assert (out / "README.md").read_text() == "# my model"
    shards = {p.name for p in out.glob("*.safetensors")}
    assert shards == set(second.values()) and not shards & set(first.values())
    assert not [p for p in out.iterdir() if p.is_dir()]  # no staging left behind
    again = converted_from_config("mixtral")
    moe.load_hf_checkpoint(again, str(out))
    ids = torch.randint(0, 97, (2, 9))
    torch.testing.assert_close(logits(again, ids), logits(reference, ids), rtol=1e-5, atol=1e-6)

    foreign = tmp_path / "foreign"  # weights this function did not write: refused, untouched
    reference.save_pretrained(foreign)
    (foreign / "tokenizer.json").write_text("{}")
    before = _listing(foreign)
    with pytest.raises(HFCheckpointError, match=r"holds \['model.safetensors'\], which"):
        moe.save_hf_checkpoint(model, str(foreign))
    assert _listing(foreign) == before and not [p for p in foreign.iterdir() if p.is_dir()]


def test_concurrent_hf_save_is_refused(tmp_path):
    from moe.checkpoint.folder import FolderLock

    model = converted_from_config("mixtral")
    lock = FolderLock(str(tmp_path / "out"))
    lock.acquire()
    try:
        with pytest.raises(HFCheckpointError, match="another save into"):
            moe.save_hf_checkpoint(model, str(tmp_path / "out"))
        assert os.listdir(tmp_path / "out") == [".moe-save.lock"]  # nothing was written
    finally:
        lock.release()
    assert os.listdir(tmp_path / "out") == []


def test_duplicate_keys_and_untrusted_files_are_refused(tmp_path):
    saved("mixtral", tmp_path / "hub")
    good = load_file(tmp_path / "hub" / "model.safetensors")
    model = converted_from_config("mixtral")
    before = copy.deepcopy(model.state_dict())
    key = "model.layers.1.block_sparse_moe.experts.2.w3.weight"

    def attempt(match, write):
        d = tmp_path / f"case{len(os.listdir(tmp_path))}"
        d.mkdir()
        write(d)
        with pytest.raises(HFCheckpointError, match=match):
            moe.load_hf_checkpoint(model, str(d))
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k]), k

    def two_shards(d):  # the key in both shards, the index pointing at the [1] copy
        save_file(good, d / "a.safetensors")
        save_file({key: torch.randn(1)}, d / "b.safetensors")
        weight_map = {**{k: "a.safetensors" for k in good}, key: "b.safetensors"}
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    attempt(f"key '{key}' is stored in both 'a.safetensors' and 'b.safetensors'", two_shards)

    def listed_twice(d):
        save_file(good, d / "a.safetensors")
        entries = ", ".join(f'"{k}": "a.safetensors"' for k in [*good, key])
        (d / "model.safetensors.index.json").write_text('{"weight_map": {' + entries + "}}")

    attempt(f"key '{key}' appears twice", listed_twice)

    def bad_header(d):
        (d / "model.safetensors").write_bytes(
            (20).to_bytes(8, "little") + b'{"x": [1, 2' + b" " * 9
        )

    attempt(r"safetensors file '.*model.safetensors': not valid JSON", bad_header)

    def huge_header(d):
        (d / "model.safetensors").write_bytes((1 << 40).to_bytes(8, "little") + b"{}")

    attempt("header length 1099511627776 does not fit the file", huge_header)

    def fifo_index(d):
        os.mkfifo(d / "model.safetensors.index.json")

    attempt("safetensors index .*: is a FIFO", fifo_index)

    def nested_index(d):
        (d / "model.safetensors.index.json").write_text("[" * 3000 + "]" * 3000)

    attempt("JSON nested 3000 levels deep", nested_index)

    def zero_link(d):
        os.symlink("/dev/zero", d / "model.safetensors")

    attempt("'model.safetensors' resolves to '/dev/zero', outside", zero_link)
