"""A multimodal family converted through the experts contract with an image + text batch:
pixels through the vision tower, image tokens into the MoE language model (Qwen3-VL-MoE, tiny):
logits, loss and every gradient, the vision tower's included, equal transformers' (float64)."""

import copy

import pytest
import torch

pytest.importorskip("transformers")  # the `hf` extra; .ci/run installs it

import moe  # noqa: E402
from tests.hf_matrix import hf_named_grads  # noqa: E402
from tests.hf_tiny import gradient_errors, relative_error, tiny_model  # noqa: E402

IMAGE = 120  # the image token id inside the tiny vocabulary


def image_batch(config, g: torch.Generator) -> dict:
    v = config.vision_config
    h = w = 4  # patches per side; merged 2 x 2 into 4 image tokens
    tokens = h * w // v.spatial_merge_size**2
    width = v.in_channels * v.temporal_patch_size * v.patch_size**2
    ids = torch.cat(
        [
            torch.randint(0, 97, (1, 3), generator=g),
            torch.full((1, tokens), IMAGE),
            torch.randint(0, 97, (1, 4), generator=g),
        ],
        1,
    )
    return dict(
        input_ids=ids,
        labels=ids,
        pixel_values=torch.randn(h * w, width, generator=g, dtype=torch.float64),
        image_grid_thw=torch.tensor([[1, h, w]]),
        mm_token_type_ids=(ids == IMAGE).int(),
    )


def test_image_and_text_through_a_converted_multimodal_model():
    reference = tiny_model("qwen3_vl_moe", torch.float64)
    reference.config.image_token_id = IMAGE
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model = moe.from_hf(copy.deepcopy(reference))
    assert moe.moe_layers(model)
    batch = image_batch(reference.config, torch.Generator().manual_seed(5))
    outs = []
    for m in (reference, model):
        m.train()
        outs.append(m(**batch))
        outs[-1].loss.backward()
    assert relative_error(outs[1].logits, outs[0].logits) <= 1e-10
    assert relative_error(outs[1].loss, outs[0].loss) <= 1e-10
    want = {n: p.grad for n, p in reference.named_parameters()}
    vision = [n for n in want if ".visual." in n]
    assert vision and all(want[n] is not None and want[n].any() for n in vision[:3])
    errors = gradient_errors(hf_named_grads(model), want)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-10, (worst, errors[worst])
