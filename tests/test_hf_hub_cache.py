"""Hugging Face hub-cache folders (issue 32 item 3): `<cache>/models--org--name/snapshots/<hash>/`
holds links to `../../blobs/<sha>`. The layout is built here from transformers' own
save_pretrained output, and transformers itself loads it (by repository id from the cache, and
by folder); load_hf_checkpoint and swap_ffn_from_settings read it too, while a link that leads
out of the cache repository (a file elsewhere, another repository's blob) stays refused."""

import hashlib
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import torch as safetensors_torch

import moe
from moe.interop import HFCheckpointError
from tests.test_hf_checkpoint import converted_from_config, logits
from tests.test_hf_parity import fresh
from tests.test_swap_hf import build, run

transformers = pytest.importorskip("transformers")
REPO = "tiny-org/tiny-moe"


def hub_cache(source: Path, cache: Path, repo: str = REPO, commit: str = "ab" * 20) -> Path:
    """The files of `source` laid out as transformers' hub cache: each file's bytes in
    blobs/<sha256>, snapshots/<commit>/<name> a relative link to it, refs/main naming the
    commit. Returns the snapshot folder."""
    repository = cache / f"models--{repo.replace('/', '--')}"
    snapshot = repository / "snapshots" / commit
    (repository / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for file in sorted(source.iterdir()):
        data = file.read_bytes()
        sha = hashlib.sha256(data).hexdigest()
        (repository / "blobs" / sha).write_bytes(data)
        os.symlink(f"../../blobs/{sha}", snapshot / file.name)
    (repository / "refs").mkdir(exist_ok=True)
    (repository / "refs" / "main").write_text(commit)
    return snapshot


def escaping_copy(snapshot: Path, name: str, target: Path, commit: str) -> Path:
    """Another snapshot of the same repository whose `name` links to `target` (outside it)."""
    other = snapshot.parent / commit
    other.mkdir()
    for link in snapshot.iterdir():
        os.symlink(os.readlink(link), other / link.name)
    (other / name).unlink()
    os.symlink(target, other / name)
    return other


@pytest.mark.parametrize("shards", ["single", "sharded"])
def test_hub_cache_folder_loads_like_transformers_loads_it(tmp_path, shards):
    reference = fresh("mixtral")
    source = tmp_path / "saved"
    reference.save_pretrained(source, max_shard_size="20KB" if shards == "sharded" else "5GB")
    assert (source / "model.safetensors.index.json").exists() == (shards == "sharded")
    snapshot = hub_cache(source, tmp_path / "hub")
    assert all(p.is_symlink() for p in snapshot.iterdir())
    ids = torch.randint(0, 97, (2, 9))
    want = logits(reference, ids)
    by_id = transformers.AutoModelForCausalLM.from_pretrained(
        REPO, cache_dir=tmp_path / "hub", local_files_only=True
    )  # transformers resolves refs/main -> snapshots/<commit> -> ../../blobs/<sha>
    torch.testing.assert_close(logits(by_id, ids), want, rtol=1e-5, atol=1e-6)
    by_folder = transformers.AutoModelForCausalLM.from_pretrained(snapshot)
    torch.testing.assert_close(logits(by_folder, ids), want, rtol=1e-5, atol=1e-6)

    for folder in (snapshot, source):  # the hub cache, and the plain save_pretrained folder
        model = converted_from_config("mixtral")
        assert not torch.allclose(logits(model, ids), want)
        moe.load_hf_checkpoint(model, str(folder))
        torch.testing.assert_close(logits(model, ids), want, rtol=1e-5, atol=1e-6)

    weights = sorted(p.name for p in snapshot.iterdir() if p.suffix == ".safetensors")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copy(source / weights[0], outside / weights[0])
    neighbour = hub_cache(source, tmp_path / "hub", repo="tiny-org/neighbour", commit="cd" * 20)
    blob = os.path.realpath(neighbour / weights[0])
    model = converted_from_config("mixtral")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for i, target in enumerate([outside / weights[0], Path(blob)]):
        escaping = escaping_copy(snapshot, weights[0], target, commit=f"{i}" * 40)
        with pytest.raises(HFCheckpointError, match="outside"):
            moe.load_hf_checkpoint(model, str(escaping))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_swap_ffn_from_settings_reads_a_hub_cache_folder(tmp_path):
    model = moe.swap_ffn(build("llama"), num_experts=4, top_k=2, capacity_factor=1.5)
    source = tmp_path / "saved"
    model.save_pretrained(source)
    moe.save_moe_settings(model, source)
    snapshot = hub_cache(source, tmp_path / "hub")
    fresh_model = build("llama", tie_word_embeddings=model.config.tie_word_embeddings)
    moe.swap_ffn_from_settings(fresh_model, snapshot)
    safetensors_torch.load_model(fresh_model, str(snapshot / "model.safetensors"))
    model.eval(), fresh_model.eval()
    with torch.no_grad():
        assert torch.equal(run(fresh_model, "llama"), run(model, "llama"))

    outside = tmp_path / "elsewhere.json"
    shutil.copy(source / "moe_config.json", outside)
    escaping = escaping_copy(snapshot, "moe_config.json", outside, commit="ef" * 20)
    with pytest.raises(ValueError, match="outside"):
        moe.swap_ffn_from_settings(build("llama"), escaping)
