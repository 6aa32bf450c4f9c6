"""swap_ffn: detection, upcycling equivalence, refusals, state_dict round trip."""

import io

import pytest
import torch
from torch import nn

import moe


class GPT2MLP(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.c_fc, self.c_proj, self.act = nn.Linear(d, f), nn.Linear(f, d), nn.GELU("tanh")

    def forward(self, x):
        return self.c_proj(self.act(self.c_fc(x)))


class LlamaMLP(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, d, mlp):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.mlp = mlp

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


def tiny_transformer(d=16, f=40):
    torch.manual_seed(0)
    return nn.Sequential(
        Block(d, nn.Sequential(nn.Linear(d, f), nn.ReLU(), nn.Linear(f, d))),
        Block(d, GPT2MLP(d, f)),
        Block(d, LlamaMLP(d, f)),
        nn.Linear(d, 3),
    )


@pytest.mark.parametrize("top_k,router", [(2, "topk"), (1, "switch"), (2, "prototype")])
def test_upcycled_model_computes_the_dense_function(top_k, router):
    model = tiny_transformer()
    x = torch.randn(2, 7, 16)
    with torch.no_grad():
        dense_y = model(x)
    moe.swap_ffn(model, num_experts=4, top_k=top_k, router=router, upcycle=True)
    layers = moe.moe_layers(model)
    assert [n for n, _ in layers] == ["0.mlp", "1.mlp", "2.mlp"]
    assert [m.config.activation for _, m in layers] == ["relu", "gelu_tanh", "swiglu"]
    assert layers[0][1].config.bias and not layers[2][1].config.bias
    with torch.no_grad():
        torch.testing.assert_close(model(x), dense_y, rtol=1e-5, atol=1e-5)
    model.train()
    model(x).sum().backward()  # the converted model trains
    assert layers[1][1].experts.w1.grad is not None


def test_predicate_selects_and_refuses():
    model = tiny_transformer()
    moe.swap_ffn(model, num_experts=2, top_k=1, predicate=lambda n, m: n == "1.mlp")
    assert [n for n, _ in moe.moe_layers(model)] == ["1.mlp"]
    with pytest.raises(moe.ConversionError, match="0.attn: cannot convert MultiheadAttention"):
        moe.swap_ffn(tiny_transformer(), predicate=lambda n, m: n == "0.attn")
    with pytest.raises(moe.ConversionError, match="no dense FFN"):
        moe.swap_ffn(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="top_k=9 exceeds"):
        moe.swap_ffn(tiny_transformer(), num_experts=4, top_k=9)


def test_state_dict_round_trip_is_exact_and_safe():
    model = moe.swap_ffn(tiny_transformer(), num_experts=4, top_k=2)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)  # no arbitrary unpickling
    assert any(k.endswith("router.expert_bias") for k in state)
    fresh = moe.swap_ffn(tiny_transformer(), num_experts=4, top_k=2)
    for p in fresh.parameters():
        nn.init.normal_(p)
    fresh.load_state_dict(state)
    x = torch.randn(3, 5, 16)
    model.eval(), fresh.eval()
    assert torch.equal(model(x), fresh(x))


# docs/reference.md's "Public names: one path each" table (moved from the README), path by path.
README_PUBLIC_NAMES = {
    "moe": ["MoELayer", "MoEConfig", "GroupedExperts", "aux_loss", "moe_layers",
            "update_router_biases", "reset_global_balance", "swap_ffn", "ConversionError",
            "save_moe_settings", "swap_ffn_from_settings", "check_moe_settings", "from_hf",
            "to_hf", "load_hf_checkpoint", "save_hf_checkpoint", "record_routing",
            "replay_routing", "recompute_context", "Routes", "RoutingTrace", "read_trace"],
    "moe.parallel": ["init_mesh", "parallelize", "ParallelConfig", "clip_grad_norm_", "rebalance_experts",
                     "RebalanceReport", "choose_placement", "Placement", "choose_replicas",
                     "ReplicaPlacement", "sum_replica_grads", "expert_parameters",
                     "dense_parameters", "is_expert_parameter"],
    "moe.memory": ["GroupedApply", "LossScaler", "recompute_blocks", "estimate_memory", "MemoryEstimate"],
    "moe.checkpoint": ["save_checkpoint", "load_checkpoint", "checkpoint_dir", "CheckpointError",
                       "CheckpointNotFoundError"],
    "moe.dispatch": ["all_to_all", "Dispatcher", "DispatchContext", "register_dispatcher",
                     "build_dispatcher", "DISPATCHERS", "LocalDispatcher",
                     "ExpertParallelDispatcher", "OverlappedDispatcher", "RowMap",
                     "token_choice_rows", "expert_choice_rows", "expert_capacity",
                     "capacity_factor_for", "gather_tokens", "permute_rows",
                     "sort_rows_by_expert", "weighted_sum_rows", "RowFormat", "RowWire",
                     "register_row_format", "wire_for"],
    "moe.comm": ["ExchangeConfig", "exchange", "exchange_counts", "AllToAllSplits", "all_to_all_splits",
                 "gather_count_matrix", "set_hierarchical_threshold", "Topology", "get_topology",
                 "check_same_across_ranks", "raise_if_any_rank_failed",
                 "same_error_on_every_rank", "CrossRankError", "set_cost_model", "CostModel",
                 "NVLINK_IB",
                 "load_profile", "save_profile"],
    "moe.gating": ["ROUTERS", "Router", "Routing", "register_router", "build_router",
                   "load_balance_loss", "z_loss", "cv_squared", "sequence_balance_loss",
                   "GlobalBalance"],
    "moe.kernels": ["expert_mlp", "combine", "grouped_mm_torch", "apply_activation",
                    "ACTIVATIONS", "BACKENDS", "resolve_backend", "KernelConfig",
                    "set_kernel_config", "kernel_config", "ExpertKernel", "ExpertWeights",
                    "register_kernel", "get_kernel", "resolve_kernel", "TorchKernel",
                    "TritonKernel", "WeightFormat", "register_weight_format"],
    "moe.fp8": ["FP8Config", "FP8Kernel", "FP8Rows", "fp8_expert_mlp", "fp8_grouped_mm",
                "fp8_dispatch", "fp8_combine"],
    "moe.lora": ["LoRAConfig", "add_lora", "merge", "adapter_state_dict", "adapter_parameters",
                 "is_adapter_name", "LoRAFormat"],
    "moe.interop": ["to_peft", "from_peft", "peft_lora_config", "PeftAdapterError"],
    "moe.pipeline": ["Pipeline", "PipelineConfig", "PipelineStepError", "init_pipeline_mesh",
                     "hf_stack", "save_hf", "features"],
    "moe.plan": ["search", "SearchSpace", "Layout", "Prediction", "predict", "Cluster", "preset",
                 "load_model", "ModelSpec"],
}  # fmt: skip

# Old paths (CHANGELOG.md, "One public path per name"), removed in 0.1.0, and their new paths.
MOVED = {
    "moe.parallel.GroupedApply": "moe.memory.GroupedApply",
    "moe.parallel.LossScaler": "moe.memory.LossScaler",
    "moe.parallel.MemoryPlan": "moe.memory.MemoryPlan",
    "moe.parallel.plan": "moe.memory.plan_memory",
    "moe.parallel.auto_checkpoint": "moe.memory.recompute_blocks",
    "moe.parallel.save_checkpoint": "moe.checkpoint.save_checkpoint",
    "moe.parallel.load_checkpoint": "moe.checkpoint.load_checkpoint",
    "moe.memory.plan": "moe.memory.plan_memory",
    "moe.memory.auto_checkpoint": "moe.memory.recompute_blocks",
    "moe.comm.all_to_all": "moe.dispatch.all_to_all",
    **{f"moe.dispatch.{n}": f"moe.comm.{n}" for n in [
        "AllToAllPlan", "Topology", "check_same_across_ranks", "exchange", "exchange_counts",
        "gather_count_matrix", "get_topology", "plan_all_to_all", "set_hierarchical_threshold"]},
    # issue 33: one path each for the router registry, the parameter split and the capacity
    "moe.gating.base.ROUTERS": "moe.gating.ROUTERS",
    "moe.gating.base.register_router": "moe.gating.register_router",
    **{f"moe.parallel.mesh.{n}": f"moe.parallel.{n}" for n in [
        "expert_parameters", "dense_parameters", "is_expert_parameter"]},
    "moe.dispatch.capacity.expert_capacity": "moe.dispatch.expert_capacity",
    "moe.dispatch.capacity.capacity_factor_for": "moe.dispatch.capacity_factor_for",
    "moe.dispatch.capacity.count_ids": "moe.capacity.count_ids",
    "moe.dispatch.overlap_degree.validate_overlap": "moe.dispatch.overlap_option.validate_overlap",
    **{f"moe.dispatch.overlap_degree.{n}": f"moe.dispatch.overlap_clock.{n}" for n in [
        "Stopwatch", "ExpertClock", "ForwardTimes", "RECENT", "EXPLORE"]},
}  # fmt: skip


def test_readme_public_names_are_its_table_and_resolve_after_import_moe():
    """Every path of the public-name table (docs/reference.md) is in it and resolves after a plain
    `import moe` without a warning (a subprocess: fresh imports, DeprecationWarning an error)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "docs/reference.md").read_text()
    table = readme[readme.index("## Public names: one path each") :]
    table = table[: table.index("\n## ")]
    rows = {line.split("|")[1].strip(" `."): line.split("|")[2] for line in table.splitlines()
            if line.startswith("| `moe")}  # fmt: skip
    assert set(rows) == set(README_PUBLIC_NAMES)
    for path, names in README_PUBLIC_NAMES.items():
        assert re.findall(r"`(\w+)`", rows[path]) == names, path
    paths = [f"{p}.{n}" for p, names in README_PUBLIC_NAMES.items() for n in names]
    code = "import moe\n" + "\n".join(f"assert {p} is not None, '{p}'" for p in paths)
    subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", code], check=True)


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_old_paths_are_removed(old, new):
    """The aliases said "until 0.1"; the version is 0.1.0, so they are gone (issue 39 item 6):
    the old path is an AttributeError (or its module is gone), the new one resolves."""
    import importlib

    owner, _, name = old.rpartition(".")
    new_owner, _, new_name = new.rpartition(".")
    assert getattr(importlib.import_module(new_owner), new_name) is not None
    try:
        module = importlib.import_module(owner)
    except ModuleNotFoundError:
        assert owner == "moe.dispatch.capacity"
        return
    with pytest.raises(AttributeError):
        getattr(module, name)


def test_only_documented_re_exports_across_packages():
    """No package of the table hands out another table package's name, except the README's one
    cross-package re-export (moe.dispatch.all_to_all); the top-level `moe.` names are the
    README's own list."""
    import importlib

    packages = [p for p in README_PUBLIC_NAMES if p != "moe"]
    for path in packages:
        package = importlib.import_module(path)
        for name in README_PUBLIC_NAMES[path]:
            home = getattr(getattr(package, name), "__module__", None) or path
            others = [q for q in packages if q != path and (home + ".").startswith(q + ".")]
            if f"{path}.{name}" != "moe.dispatch.all_to_all":
                assert not others, (path, name, home)


def test_settings_with_two_entries_for_one_module_are_refused_by_every_reader(tmp_path):
    """swap_ffn_from_settings used to apply the last of two conflicting entries, while
    check_moe_settings rejected the file."""
    import json

    model = moe.swap_ffn(tiny_transformer(), num_experts=4, top_k=2)
    path = moe.save_moe_settings(model, tmp_path)
    doc = json.loads(path.read_text())
    twin = json.loads(json.dumps(doc["layers"][1]))
    twin["config"]["top_k"] = 1
    doc["layers"].append(twin)
    path.write_text(json.dumps(doc))
    match = r"layers\[1\] and layers\[3\] both describe the module '1.mlp'"
    dense = tiny_transformer()
    with pytest.raises(ValueError, match=match):
        moe.swap_ffn_from_settings(dense, tmp_path)
    assert not moe.moe_layers(dense)  # nothing changed
    with pytest.raises(ValueError, match=match):
        moe.check_moe_settings(model, tmp_path)
    path.write_text('{"format": "moe.swap_ffn", "version": 1, "layers": ' + "[" * 200 + "]" * 201)
    with pytest.raises(ValueError, match="moe_config.json.: JSON nested 201 levels deep"):
        moe.swap_ffn_from_settings(tiny_transformer(), tmp_path)


def test_recompute_is_the_field_and_its_old_name_is_gone(tmp_path):
    """MoEConfig.checkpoint meant recompute (issue 33); its alias said "until 0.1" and is
    removed: the old keyword is a TypeError, the old attribute gone, a settings file with the
    old name a ValueError naming it (issue 39 item 6)."""
    import json

    assert "recompute" in moe.MoEConfig.field_names()
    assert "checkpoint" not in moe.MoEConfig.field_names()
    with pytest.raises(TypeError, match="checkpoint"):
        moe.MoEConfig(16, 40, 4, checkpoint=True)
    assert not hasattr(moe.MoEConfig(16, 40, 4, recompute=True), "checkpoint")
    model = moe.swap_ffn(tiny_transformer(), num_experts=4, top_k=2, recompute=True)
    path = moe.save_moe_settings(model, tmp_path)
    doc = json.loads(path.read_text())
    for entry in doc["layers"]:  # as a file written before the rename
        entry["config"]["checkpoint"] = entry["config"].pop("recompute")
    path.write_text(json.dumps(doc))
    with pytest.raises(
        ValueError, match=r"missing fields \['recompute'\], unknown fields \['checkpoint'\]"
    ):
        moe.swap_ffn_from_settings(tiny_transformer(), tmp_path)


def test_expert_mlp_backend_keyword_is_kernel_with_a_warning():
    """moe.kernels.expert_mlp(backend=) was renamed kernel= (issue 39): the old keyword warns
    until 0.2 and computes what kernel= computes."""
    torch.manual_seed(0)
    x, w1, w2 = torch.randn(7, 4), torch.randn(2, 4, 6), torch.randn(2, 6, 4)
    offsets = torch.tensor([3, 7], dtype=torch.int32)
    want = moe.kernels.expert_mlp(x, offsets, w1, w2, kernel="torch")
    with pytest.warns(DeprecationWarning, match="use kernel="):
        got = moe.kernels.expert_mlp(x, offsets, w1, w2, backend="torch")
    assert torch.equal(got, want)
