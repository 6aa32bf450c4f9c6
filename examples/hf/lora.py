"""Fine-tune a Hugging Face MoE model's experts with LoRA, save a PEFT adapter, and show
transformers + PEFT generating the same tokens from it.

    python examples/hf/lora.py                          # tiny Qwen3-MoE built here
    python examples/hf/lora.py --family mixtral         # tiny Mixtral
    python examples/hf/lora.py --model path/to/hf_dir   # any local Mixtral / Qwen-MoE / OLMoE
    torchrun --nproc-per-node 2 examples/hf/lora.py --ep 2

Steps: build (and save as <out>/base) or load the model -> moe.from_hf -> moe.lora.add_lora (the base frozen, per-
expert adapters on w1 / w3 / w2) -> optionally moe.parallel.parallelize over (dp, ep) -> train
the adapters on the synthetic counting task of finetune.py -> moe.interop.to_peft writes the
PEFT adapter -> peft.PeftModel.from_pretrained(the original transformers model, adapter)
generates greedily, and its tokens are compared with ours.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `moe` importable from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import moe  # noqa: E402
from examples.device import (  # noqa: E402
    add_device_args,
    resolve_device,
    threads_problem,
)
from examples.hf.finetune import _layout_problem, _path_problem, batch, start  # noqa: E402
from examples.settings import settings_line  # noqa: E402
from moe.lora import LoRAConfig, adapter_parameters, add_lora  # noqa: E402

FAMILIES = ("qwen3_moe", "mixtral")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="a local Hugging Face checkpoint directory (default: tiny)")
    p.add_argument("--family", choices=FAMILIES, default="qwen3_moe", help="the tiny model built")
    p.add_argument("--out", default="runs/hf-lora", help="where the PEFT adapter goes")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=16, help="sequences per step, all ranks")
    p.add_argument("--seq-len", type=int, default=24)
    p.add_argument("--lr", type=float, default=2e-2)
    p.add_argument("--rank", type=int, default=8, help="LoRA rank of every expert projection")
    p.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha (scale alpha / rank)")
    p.add_argument("--new-tokens", type=int, default=12, help="tokens generated greedily")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (under torchrun)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=25, help="read the loss every n steps")
    p.add_argument("--quiet", action="store_true")
    add_device_args(p)
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch < 1 or args.seq_len < 2 or args.new_tokens < 1:
        p.error("--steps, --batch, --new-tokens must be >= 1 and --seq-len >= 2")
    for name in ("lr", "alpha"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            p.error(f"--{name} must be a finite number > 0, got {value}")
    if args.rank < 1 or args.log_every < 1:
        p.error(f"--rank and --log-every must be >= 1, got {args.rank}, {args.log_every}")
    problem = (
        threads_problem(args.threads)
        or _layout_problem(args, int(os.environ.get("WORLD_SIZE", "1")))
        or _path_problem(args)
    )
    if problem:
        p.error(problem)
    try:
        args.device = resolve_device(args.device)
    except ValueError as e:
        p.error(str(e))
    return args


def tiny(family: str):
    """A tiny Qwen3-MoE or Mixtral (random weights, CPU-sized)."""
    import transformers as T

    common = dict(
        vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=2,
    )  # fmt: skip
    if family == "mixtral":
        config = T.MixtralConfig(**common, intermediate_size=32, num_local_experts=8)
        return T.MixtralForCausalLM(config)
    config = T.Qwen3MoeConfig(
        **common, intermediate_size=128, moe_intermediate_size=32, num_experts=8, head_dim=16,
        norm_topk_prob=True,
    )  # fmt: skip
    return T.Qwen3MoeForCausalLM(config)


def load_base(args, rank: int, world: int):
    """The transformers model the adapter is for, loaded from a folder whose absolute path the
    adapter records (base_model_name_or_path), so it loads in any process: --model, or the
    tiny model built here and saved first as <out>/base (rank 0 writes, the others wait)."""
    from transformers import AutoModelForCausalLM

    if args.model:
        return AutoModelForCausalLM.from_pretrained(os.path.abspath(args.model))
    folder = os.path.abspath(os.path.join(args.out, "base"))
    if rank == 0:
        tiny(args.family).save_pretrained(folder)
    if world > 1:
        dist.barrier()
    return AutoModelForCausalLM.from_pretrained(folder)


@torch.no_grad()
def greedy(model, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """n greedy tokens after `prompt` (full recompute per token: the same work on every rank,
    which expert parallelism needs)."""
    ids = prompt
    for _ in range(n):
        ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    return ids[:, prompt.shape[1] :]


def main(argv=None) -> dict:
    args = parse_args(argv)
    world, rank, say = start(args)
    device = args.device
    base = load_base(args, rank, world).float().eval()
    model = moe.from_hf(copy.deepcopy(base))  # `base` stays transformers' own, for PEFT
    add_lora(model, LoRAConfig(rank=args.rank, alpha=args.alpha))
    model.to(device)
    if world > 1:
        moe.parallel.parallelize(model, moe.parallel.init_mesh(dp=world // args.ep, ep=args.ep))
    params = [p for _, p in adapter_parameters(model)]
    frozen = sum(p.numel() for p in base.parameters())
    settings = settings_line(
        precision="fp32", device=device, dp=world // args.ep, ep=args.ep,
        data_parallel="ddp" if world > 1 else None,
        extra=(f"expert LoRA rank {args.rank} alpha {args.alpha:g}",),
    )  # fmt: skip
    say(f"settings: {settings}")
    trainable = sum(p.numel() for p in params)  # a DTensor's numel is the global one
    say(f"trainable {trainable} of {frozen} parameters ({100 * trainable / frozen:.1f}%)")
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    vocab = model.config.get_text_config().vocab_size
    losses, pending = [], []
    model.train()
    for step in range(args.steps):
        ids = batch(step, args.batch, args.seq_len, vocab, args.seed).chunk(world)[rank]
        loss = model(ids.to(device), labels=ids.to(device)).loss + moe.aux_loss(model)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        pending.append(loss.detach().float())
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            losses += torch.stack(pending).cpu().tolist()
            pending = []
            say(f"step {step + 1}/{args.steps} loss {sum(losses[-10:]) / len(losses[-10:]):.3f}")
    moe.interop.to_peft(model, args.out, base)  # every rank: the adapters are gathered
    model.eval()
    prompt = batch(10**6, 2, 6, vocab, args.seed)
    ours = greedy(model, prompt.to(device), args.new_tokens).cpu()
    result = {"first_loss": losses[0], "final_loss": sum(losses[-10:]) / len(losses[-10:]),
              "settings": settings, "ours": ours.tolist()}  # fmt: skip
    if rank == 0:
        from peft import PeftModel

        peft_model = PeftModel.from_pretrained(base, args.out).eval()
        theirs = peft_model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0,
        )[:, prompt.shape[1] :]  # fmt: skip
        result["theirs"] = theirs.tolist()
        result["same_tokens"] = bool(torch.equal(ours, theirs))
        say(
            f"loss {result['first_loss']:.3f} -> {result['final_loss']:.3f}; PEFT adapter "
            f"{args.out}, for the base {base.config._name_or_path}"
        )
        for i in range(prompt.shape[0]):
            say(f"prompt {prompt[i].tolist()}")
            say(f"  moe (greedy)       {ours[i].tolist()}")
            say(f"  transformers+PEFT  {theirs[i].tolist()}")
        say(f"same tokens from transformers + PEFT: {'yes' if result['same_tokens'] else 'NO'}")
    if world > 1:
        dist.barrier()
    return result


if __name__ == "__main__":
    main()
