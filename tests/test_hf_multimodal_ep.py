"""Multimodal MoE families end to end with an image + text batch (Qwen3-VL-MoE, GLM-4.5V MoE,
ERNIE-4.5-VL-MoE; tiny, float64): pixels through the vision tower, image tokens into the MoE
language model (ERNIE's into its vision experts), image tokens left out of the loss.
- one process: the converted model's logits, loss and every gradient (the vision tower's
  included) equal transformers' within 1e-10;
- EP = 2 x FSDP2 on gloo (one start of the ranks for every family, each rank half the global
  batch: one image and its text): one SGD step, then the logits equal one process's after its
  step on the global batch within 1e-6 (measured 1e-16; ERNIE 2e-9: the routers compute in
  float32, whose rounding depends on the batch); save_hf_checkpoint from the EP model loads in
  transformers' from_pretrained with the trained one-process model's logits on the image
  batch, and greedy generation with the image (its first logits are the prompt's, which the
  image changes) gives the tokens moe's trained converted model generates."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the `hf` extra; .ci/run installs it

import moe  # noqa: E402
from tests.distributed import run_ranks  # noqa: E402
from tests.hf_matrix import hf_named_grads  # noqa: E402
from tests.hf_matrix_ranks import EP_TOL, converted  # noqa: E402
from tests.hf_tiny import gradient_errors, relative_error, tiny_model  # noqa: E402

FAMILIES = ["qwen3_vl_moe", "glm4v_moe", "ernie4_5_vl_moe"]
IMAGE = 120  # the image token id inside the tiny vocabulary
# ERNIE-4.5-VL routes image tokens to its vision experts: the processor's moe_mm_token_type_ids
# (its mm_token_type_ids, here without image start/end tokens)
VISION_EXPERTS = {"ernie4_5_vl_moe"}
LR = 0.5


def image_batch(family: str, config, rows: int = 2, seed: int = 5) -> dict:
    """`rows` sequences of 3 text tokens, one 4 x 4-patch image (merged 2 x 2 into 4 image
    tokens) and 4 text tokens, as the family's processor gives them: flattened patches
    (channels x temporal patch x patch x patch where the family has a temporal patch),
    image_grid_thw, mm_token_type_ids (1 on image tokens: the M-RoPE positions)."""
    g = torch.Generator().manual_seed(seed)
    v = config.vision_config
    h = w = 4
    tokens = h * w // v.spatial_merge_size**2
    width = v.in_channels * (getattr(v, "temporal_patch_size", None) or 1) * v.patch_size**2
    text = [torch.randint(0, 97, (rows, n), generator=g) for n in (3, 4)]
    ids = torch.cat([text[0], torch.full((rows, tokens), IMAGE), text[1]], 1)
    batch = dict(
        input_ids=ids,
        pixel_values=torch.randn(rows * h * w, width, generator=g, dtype=torch.float64),
        image_grid_thw=torch.tensor([[1, h, w]] * rows),
        mm_token_type_ids=(ids == IMAGE).int(),
    )
    if family in VISION_EXPERTS:
        batch["moe_mm_token_type_ids"] = batch["mm_token_type_ids"]
    return batch


def rows_of(batch: dict, rank: int) -> dict:
    """Sequence `rank` of a 2-sequence batch, with its image's patches and grid."""
    patches = len(batch["pixel_values"]) // 2
    out = {k: v[rank : rank + 1] for k, v in batch.items() if k != "pixel_values"}
    out["pixel_values"] = batch["pixel_values"][rank * patches : (rank + 1) * patches]
    return out


def _model(family: str):
    """The family's converted tiny model (tests/hf_matrix_ranks.converted: float64, weights
    off their init, the same on every rank), the image token inside its vocabulary."""
    model = converted(family)
    model.config.image_token_id = IMAGE
    return model


def labels(batch: dict) -> torch.Tensor:
    """The input ids, the image tokens left out of the loss (-100), as collators do."""
    return batch["input_ids"].masked_fill(batch["mm_token_type_ids"].bool(), -100)


def _step(model, batch: dict) -> None:
    """One SGD step on the image batch."""
    model.train()
    model.zero_grad(set_to_none=True)
    model(**batch, labels=labels(batch)).loss.backward()
    torch.optim.SGD(model.parameters(), lr=LR).step()


def _logits(model, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(**batch).logits.detach()


def greedy(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """4 new tokens, greedy, the image in the prompt; and the first token's logits."""
    ids = batch["input_ids"]
    with torch.no_grad():
        out = model.eval().generate(
            **batch, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4,
            do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True,
        )  # fmt: skip
    return out.sequences[:, ids.shape[1] :], out.logits[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_image_batch_equals_transformers(family):
    """Logits, loss and every gradient (vision tower included) equal transformers' (float64)."""
    reference = tiny_model(family, torch.float64)
    reference.config.image_token_id = IMAGE
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model = moe.from_hf(copy.deepcopy(reference))
    assert moe.moe_layers(model)
    batch = image_batch(family, reference.config)
    outs = []
    for m in (reference, model):
        m.train()
        outs.append(m(**batch, labels=labels(batch)))
        outs[-1].loss.backward()
    assert relative_error(outs[1].logits, outs[0].logits) <= 1e-10, family
    assert relative_error(outs[1].loss, outs[0].loss) <= 1e-10, family
    want = {n: p.grad for n, p in reference.named_parameters()}
    vision = [n for n in want if n.startswith(("model.visual.", "model.vision_tower."))]
    assert vision and sum(want[n] is not None and bool(want[n].any()) for n in vision) > 10
    errors = gradient_errors(hf_named_grads(model), want)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-10, (family, worst, errors[worst])


def _ep_body(rank, world, families, out):
    from torch.distributed.tensor import DTensor

    from moe.parallel import init_mesh, parallelize

    logits = {}
    for family in families:
        model = _model(family)
        parallelize(model, init_mesh(dp=1, ep=2), "fsdp", sync_params=False)
        # every parameter sharded (the vision tower's by FSDP2, the experts over ep too)
        assert all(isinstance(p, DTensor) for p in model.parameters()), family
        batch = rows_of(image_batch(family, model.config), rank)
        _step(model, batch)
        logits[family] = _logits(model, batch)
        moe.save_hf_checkpoint(model, f"{out}/{family}")
    return logits


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("multimodal_ep")
    return out, run_ranks(_ep_body, 2, FAMILIES, str(out), timeout=120)


@pytest.mark.parametrize("family", FAMILIES)
def test_expert_parallel_fsdp_train_save_reload_generate(trained, family):
    """EP = 2 x FSDP2: one step on each rank's image equals one process's on both; the saved
    checkpoint reloads in transformers with the trained model's logits and generation."""
    out, ranks = trained
    model = _model(family)
    batch = image_batch(family, model.config)
    before = _logits(model, batch)
    _step(model, batch)
    want = _logits(model, batch)
    assert relative_error(want, before) > 1e-3, family  # the step changes the function
    for rank in (0, 1):
        got = ranks[rank][family]
        assert relative_error(got, want[rank : rank + 1]) <= EP_TOL, (family, rank)
    cls = type(tiny_model(family))
    reloaded = cls.from_pretrained(out / family, config=model.config).eval()
    reloaded.set_experts_implementation("eager")
    assert relative_error(_logits(reloaded, batch), want) <= EP_TOL, family
    other = dict(batch, pixel_values=torch.randn_like(batch["pixel_values"]))
    assert relative_error(_logits(model, other)[:, -1], want[:, -1]) > 1e-2, family
    tokens, first = greedy(model, batch)
    # generate read the image (its logits come back in float32)
    assert relative_error(first, want[:, -1]) <= 1e-6, family
    assert torch.equal(greedy(reloaded, batch)[0], tokens), family
