"""One home per setting (issue 39 item 6, issue 41 items 7 and 11): every setting is a field of
ExchangeConfig or KernelConfig; code > environment > default; the environment is read once,
when the config is built, through one parser that names the variable; under parallelize the
ranks agree on what was read, and a variable changed later on one rank changes nothing (it
hung or aborted before)."""

import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import moe
from moe import settings
from moe.comm import NVLINK_IB, ExchangeConfig, save_profile
from moe.comm.alltoall import cost_model, hierarchical_threshold, pipeline_chunks
from moe.comm.exchange_config import overlap_cuda_stream
from moe.comm.topology import ranks_per_node_setting
from moe.kernels import KernelConfig, kernel_config, set_kernel_config
from tests.distributed import run_ranks

ROOT = Path(__file__).resolve().parent.parent
BIG = 64 << 20


@pytest.fixture
def clean_env(monkeypatch):
    for name in settings.ENV.values():
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch
    set_kernel_config(None)  # the next kernel builds its config from the restored environment


def test_defaults_then_code_beats_environment_beats_default(clean_env, tmp_path):
    profile = tmp_path / "p.json"
    save_profile(NVLINK_IB, profile)
    default = ExchangeConfig()
    assert (default.pipeline_min_bytes, default.overlap_cuda_stream) == (2 << 20, False)
    assert default.hierarchical_max_bytes is None and default.ranks_per_node is None
    assert pipeline_chunks(BIG, 2) == pipeline_chunks(BIG, 2, default) == 4
    assert hierarchical_threshold(None, "gloo") == 0 and cost_model("gloo") is None
    for name, raw in [
        ("MOE_A2A_PIPELINE_MIN_BYTES", "0"),
        ("MOE_A2A_HIERARCHICAL_MAX_BYTES", "7"),
        ("MOE_RANKS_PER_NODE", "2"),
        ("MOE_OVERLAP_CUDA_STREAM", "yes"),
        ("MOE_A2A_COST_PROFILE", str(profile)),
    ]:
        clean_env.setenv(name, raw)
    env = ExchangeConfig()
    assert pipeline_chunks(BIG, 2, env) == 1 and hierarchical_threshold(None, "gloo", env) == 7
    assert cost_model("gloo", env) == NVLINK_IB and overlap_cuda_stream(env)
    assert ranks_per_node_setting(None, 8, env) == (2, "env")
    assert ranks_per_node_setting(4, 8, env) == (4, "argument")  # code beats the variable
    code = ExchangeConfig(pipeline_min_bytes=1 << 20, hierarchical_max_bytes=5,
                          ranks_per_node=4, overlap_cuda_stream=False)  # fmt: skip
    assert pipeline_chunks(BIG, 2, code) == 4 and hierarchical_threshold(None, "gloo", code) == 5
    assert ranks_per_node_setting(None, 8, code) == (4, "config")
    assert not overlap_cuda_stream(code)
    with pytest.raises(ValueError, match="ranks_per_node=2 and ExchangeConfig.ranks_per_node=4"):
        ranks_per_node_setting(2, 8, code)  # two values given in code: refused, not guessed


def test_a_variable_changed_after_the_config_was_built_changes_nothing(clean_env, tmp_path):
    """Read once, at construction (parallelize builds the config when given none)."""
    config = ExchangeConfig()
    clean_env.setenv("MOE_A2A_PIPELINE_MIN_BYTES", "1")
    clean_env.setenv("MOE_RANKS_PER_NODE", "4")
    clean_env.setenv("MOE_OVERLAP_CUDA_STREAM", "1")
    assert pipeline_chunks(BIG, 2, config) == 4 and not overlap_cuda_stream(config)
    assert ranks_per_node_setting(None, 8, config) is None
    assert ExchangeConfig().pipeline_min_bytes == 1  # a new config reads it
    profile = tmp_path / "p.json"
    save_profile(NVLINK_IB, profile)
    config = ExchangeConfig(cost_profile=str(profile))
    assert cost_model("gloo", config) == NVLINK_IB
    profile.write_text("not a profile")  # the file is read once per config too
    assert cost_model("gloo", config) == NVLINK_IB
    with pytest.raises(ValueError, match="cost profile"):
        cost_model("gloo", ExchangeConfig(cost_profile=str(profile)))
    set_kernel_config(None)
    clean_env.setenv("MOE_TRITON_TMA", "on")
    clean_env.setenv("MOE_TRITON_AUTOTUNE", "0")
    first = kernel_config()
    assert (first.autotune, first.tma) == (False, True)
    clean_env.setenv("MOE_TRITON_TMA", "off")  # the process's config was built: no effect
    assert kernel_config() is first
    set_kernel_config(None)  # built again from the environment when next asked
    assert kernel_config().tma is False
    set_kernel_config(KernelConfig(tma=True))  # code beats the variable
    assert kernel_config().tma is True and kernel_config().autotune is False


@pytest.mark.parametrize("raw", ["1", "true", "TRUE", "On", "yes", " 1", "1 "])
def test_flags_accept_the_documented_spellings(clean_env, raw):
    for name in ("MOE_TRITON_TMA", "MOE_OVERLAP_CUDA_STREAM", "MOE_TRITON_AUTOTUNE"):
        clean_env.setenv(name, raw)
    assert KernelConfig().tma is True and KernelConfig().autotune is True
    assert ExchangeConfig().overlap_cuda_stream is True
    for name in ("MOE_TRITON_TMA", "MOE_OVERLAP_CUDA_STREAM", "MOE_TRITON_AUTOTUNE"):
        clean_env.setenv(name, {"1": "0", "true": "false", "On": "off", "yes": "no"}.get(
            raw.strip(), "0"))  # fmt: skip
    assert KernelConfig().tma is False and KernelConfig().autotune is False
    assert ExchangeConfig().overlap_cuda_stream is False


@pytest.mark.parametrize(
    "name, raw, message",
    [
        ("MOE_TRITON_AUTOTUNE", "garbage", "MOE_TRITON_AUTOTUNE='garbage' is not a flag"),
        ("MOE_TRITON_TMA", "2", "MOE_TRITON_TMA='2' is not a flag"),
        ("MOE_OVERLAP_CUDA_STREAM", "enable", "MOE_OVERLAP_CUDA_STREAM='enable' is not a flag"),
        ("MOE_A2A_PIPELINE_MIN_BYTES", "abc", "MOE_A2A_PIPELINE_MIN_BYTES='abc' is not an int"),
        ("MOE_A2A_PIPELINE_MIN_BYTES", "-1", "MOE_A2A_PIPELINE_MIN_BYTES='-1' is not an integer"),
        ("MOE_A2A_HIERARCHICAL_MAX_BYTES", "-5", "MOE_A2A_HIERARCHICAL_MAX_BYTES='-5' is not"),
        ("MOE_A2A_HIERARCHICAL_MAX_BYTES", "1e6", "MOE_A2A_HIERARCHICAL_MAX_BYTES='1e6' is not"),
        ("MOE_RANKS_PER_NODE", "0", "MOE_RANKS_PER_NODE='0' is not an integer >= 1"),
        ("MOE_RANKS_PER_NODE", "-2", "MOE_RANKS_PER_NODE='-2' is not an integer >= 1"),
        ("MOE_A2A_PIPELINE_MIN_BYTES", "9" * 20, "is not an integer >= 0"),
    ],
)
def test_garbage_is_refused_naming_the_variable(clean_env, name, raw, message):
    clean_env.setenv(name, raw)
    config = KernelConfig if name.startswith("MOE_TRITON") else ExchangeConfig
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        config()


def test_code_values_are_checked_and_every_variable_is_documented():
    with pytest.raises(ValueError, match="KernelConfig.tma must be a bool"):
        KernelConfig(tma=1)
    with pytest.raises(ValueError, match="ExchangeConfig.pipeline_min_bytes"):
        ExchangeConfig(pipeline_min_bytes=-1)
    reference = (ROOT / "docs/reference.md").read_text()  # the table moved from the README
    assert all(f"| `{name}` | `{key}` |" in reference for key, name in settings.ENV.items())
    assert set(settings.ENV) == set(settings.KIND)


def _same_step_after_a_change(rank: int, overlap: int | None) -> bool:
    """One step before and one after rank 3 changes the exchange's variables: equal outputs
    and gradients, and the exchange still 2 nodes x 2 ranks on every rank."""
    os.environ["MOE_RANKS_PER_NODE"] = "2"  # 2 nodes x 2 ranks, on every rank
    os.environ.pop("MOE_A2A_PIPELINE_MIN_BYTES", None)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), moe.MoELayer(8, 16, 4, top_k=2, backend="torch"))
    model = moe.parallel.parallelize(
        model, moe.parallel.init_mesh(dp=1, ep=4), algorithm="hierarchical", overlap=overlap
    )
    x = torch.randn(40, 8, generator=torch.Generator().manual_seed(rank))
    before = model(x)
    before.square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    if rank == 3:
        os.environ["MOE_RANKS_PER_NODE"] = "4"
        os.environ["MOE_A2A_PIPELINE_MIN_BYTES"] = "1"
    model.zero_grad()
    after = model(x)
    after.square().mean().backward()
    config = model[1].dispatcher.exchange_config
    return (
        torch.equal(before, after)
        and all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
        and (config.ranks_per_node, config.pipeline_min_bytes) == (2, 2 << 20)
    )


def _after_parallelize_body(rank, world):
    """Rank 3 changes MOE_RANKS_PER_NODE and MOE_A2A_PIPELINE_MIN_BYTES after parallelize
    (plain and overlapped dispatcher): every rank still runs the exchange it agreed on (it
    hung, or aborted rank 3, before). Then a garbage variable on one rank, and a kernel setting
    on one rank: the same error, naming it, on every rank."""
    out = {"same": [_same_step_after_a_change(rank, overlap) for overlap in (None, 2)]}
    os.environ.pop("MOE_A2A_PIPELINE_MIN_BYTES", None)
    os.environ["MOE_RANKS_PER_NODE"] = "2"
    if rank == 1:
        os.environ["MOE_A2A_PIPELINE_MIN_BYTES"] = "abc"
    out["garbage"] = _parallelize_error()
    os.environ.pop("MOE_A2A_PIPELINE_MIN_BYTES", None)
    set_kernel_config(None)  # the kernels' config is built again at the next parallelize
    if rank == 2:
        os.environ["MOE_TRITON_TMA"] = "on"
    out["kernel"] = _parallelize_error()
    dist.barrier()  # still in step
    return out


def _parallelize_error() -> str:
    try:
        fresh = nn.Sequential(moe.MoELayer(8, 16, 4, top_k=2, backend="torch"))
        moe.parallel.parallelize(fresh, moe.parallel.init_mesh(dp=1, ep=4))
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_variable_changed_on_one_rank_after_parallelize_changes_nothing():
    env = {"MOE_RANKS_PER_NODE": "2", "MOE_A2A_PIPELINE_MIN_BYTES": None, "MOE_TRITON_TMA": None}
    for out in run_ranks(_after_parallelize_body, 4, timeout=60, env=env):
        assert out["same"] == [True, True]
        assert "setup failed on 1 rank(s): rank 1" in out["garbage"]
        assert "MOE_A2A_PIPELINE_MIN_BYTES='abc' is not an integer" in out["garbage"]
        assert (
            "kernel.tma differs across ranks: ranks 0-1, 3 have False, rank 2 has True"
            in (out["kernel"])
        )


# Issue 49 item 13: misspelled names, integer bounds, paths as written, long paths.


def test_a_misspelled_variable_is_warned_about_once_naming_the_known_ones(clean_env):
    clean_env.setattr(settings, "_warned", set())
    clean_env.setenv("MOE_RANK_PER_NODE", "2")  # MOE_RANKS_PER_NODE misspelled
    with pytest.warns(UserWarning, match="MOE_RANK_PER_NODE is not a setting") as caught:
        assert ExchangeConfig().ranks_per_node is None  # ignored, but said
    message = str(caught[0].message)
    assert "did you mean MOE_RANKS_PER_NODE?" in message
    assert all(name in message for name in settings.ENV.values())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: a second config warns no more
        ExchangeConfig()
        KernelConfig()


def test_a_known_variable_in_another_case_is_refused_naming_it(clean_env):
    clean_env.setattr(settings, "_warned", set())
    clean_env.setenv("moe_ranks_per_node", "2")  # was ignored without a word
    with pytest.raises(ValueError, match="moe_ranks_per_node is set, but the variable is MOE_R"):
        ExchangeConfig()
    clean_env.delenv("moe_ranks_per_node")
    clean_env.setenv("Moe_Triton_Tma", "1")
    with pytest.raises(ValueError, match="Moe_Triton_Tma is set, but the variable is MOE_TRITON"):
        KernelConfig()
    clean_env.delenv("Moe_Triton_Tma")
    clean_env.setenv("moe_rank_per_node", "2")  # an unknown name in lowercase: warned about
    with pytest.warns(UserWarning, match="moe_rank_per_node is not a setting"):
        ExchangeConfig()


@pytest.mark.parametrize(
    "raw, value",
    [("000000000000000000001", 1), ("0" * 30 + "7", 7), (str(2**63 - 1), 2**63 - 1), (" 5 ", 5)],
)
def test_integers_with_leading_zeros_are_their_value(clean_env, raw, value):
    clean_env.setenv("MOE_A2A_PIPELINE_MIN_BYTES", raw)
    assert ExchangeConfig().pipeline_min_bytes == value


@pytest.mark.parametrize("raw", [str(2**63), "9" * 19, "1" + "0" * 19])
def test_integers_above_int64_are_refused(clean_env, raw):
    clean_env.setenv("MOE_A2A_HIERARCHICAL_MAX_BYTES", raw)
    with pytest.raises(
        ValueError, match="MOE_A2A_HIERARCHICAL_MAX_BYTES=.* <= 9223372036854775807"
    ):
        ExchangeConfig()


def test_a_path_is_taken_as_written(clean_env, tmp_path):
    spaced = tmp_path / " p.json "  # a file name with spaces around it is a file name
    save_profile(NVLINK_IB, spaced)
    clean_env.setenv("MOE_A2A_COST_PROFILE", str(spaced))
    config = ExchangeConfig()
    assert config.cost_profile == str(spaced) and config.profile() == NVLINK_IB


@pytest.mark.parametrize("length", [300, 5000])
def test_a_too_long_path_is_one_clear_error(clean_env, length):
    clean_env.setenv("MOE_A2A_COST_PROFILE", "/tmp/" + "p" * length)
    with pytest.raises(ValueError, match=r"MOE_A2A_COST_PROFILE=.*is not a path: .*longer than"):
        ExchangeConfig()
