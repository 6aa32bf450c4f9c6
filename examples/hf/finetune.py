"""Fine-tune a Hugging Face MoE model with moe's layers, then save it back for transformers.

    python examples/hf/finetune.py                         # tiny Qwen3-MoE built here
    python examples/hf/finetune.py --model path/to/hf_dir  # any local Mixtral / Qwen-MoE / ...
    torchrun --nproc-per-node 2 examples/hf/finetune.py --ep 2

Steps: build (or load) the model -> moe.from_hf (sparse-MoE blocks become moe layers) ->
optionally moe.parallel.parallelize over (dp, ep) -> train on a synthetic next-token task
(each sequence counts up by a random stride, mod the vocabulary) -> moe.save_hf_checkpoint
-> transformers' from_pretrained reloads it, and its logits are compared with ours.
--device auto (the default) trains on CUDA when available, in bf16 autocast (--precision fp32
turns it off); the loss is read back once per --log-every steps, not every step.
"""

from __future__ import annotations

import argparse
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
    activate,
    add_device_args,
    autocast,
    backend,
    resolve_device,
    set_threads,
    threads_problem,
)
from examples.settings import settings_line  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="a local Hugging Face checkpoint directory (default: tiny)")
    p.add_argument("--out", default="runs/hf-finetune", help="where the hub-format result goes")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=16, help="sequences per step, all ranks")
    p.add_argument("--seq-len", type=int, default=24)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (under torchrun)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10, help="read the loss every n steps")
    p.add_argument("--quiet", action="store_true")
    add_device_args(p)
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch < 1 or args.seq_len < 2:
        p.error("--steps, --batch must be >= 1 and --seq-len >= 2")
    if not (math.isfinite(args.lr) and args.lr > 0):  # inf trained, then died at step 2
        p.error(f"--lr must be a finite number > 0, got {args.lr}")
    if args.log_every < 1:
        p.error(f"--log-every must be >= 1, got {args.log_every}")
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


def _layout_problem(args, world: int) -> str | None:
    """--ep and --batch against the number of ranks (torchrun's WORLD_SIZE)."""
    if args.ep < 1:
        return f"--ep must be >= 1, got {args.ep}"
    if world % args.ep:
        return f"--ep {args.ep} must divide the {world} rank(s) (torchrun --nproc-per-node)"
    if args.batch % world:
        return f"--batch {args.batch} must divide by the {world} rank(s)"
    return None


def _path_problem(args) -> str | None:
    """--model an existing directory; --out a directory to (over)write, not a file, and under
    no file (checked before training, not after it)."""
    if args.model is not None and not Path(args.model).is_dir():
        return f"--model {args.model!r}: not a directory"
    return out_problem(args.out)


def out_problem(out: str) -> str | None:
    """--out a directory to (over)write, not a file, and under no file."""
    for path in (Path(out), *Path(out).parents):
        if path.exists() or path.is_symlink():
            if not path.is_dir():
                return f"--out {out!r}: {str(path)!r} exists and is not a directory"
            if not os.access(path, os.W_OK | os.X_OK):
                return f"--out {out!r}: {str(path)!r} is not writable"
            return None
    return None


def tiny_qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=64,
    )  # fmt: skip
    return Qwen3MoeForCausalLM(config)


def batch(step: int, size: int, seq_len: int, vocab: int, seed: int) -> torch.Tensor:
    """Sequences start + stride * i (mod vocab): the next token follows from the context."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    start = torch.randint(0, vocab, (size, 1), generator=g)
    stride = torch.randint(1, 4, (size, 1), generator=g)
    return (start + stride * torch.arange(seq_len)) % vocab


def start(args) -> tuple:
    """The run's world size, rank and printer (rank 0 unless --quiet): the device activated,
    the CPU threads set, the process group started under torchrun, the seed set."""
    world, device = int(os.environ.get("WORLD_SIZE", "1")), args.device
    activate(device)
    set_threads(args.threads, device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend(device))
    rank = dist.get_rank() if world > 1 else 0
    say = print if rank == 0 and not args.quiet else (lambda *a, **k: None)
    torch.manual_seed(args.seed)
    return world, rank, say


def main(argv=None) -> dict:
    from transformers import AutoModelForCausalLM

    args = parse_args(argv)
    world, rank, say = start(args)
    device = args.device
    model = (
        AutoModelForCausalLM.from_pretrained(args.model) if args.model else tiny_qwen3_moe()
    ).float()
    moe.from_hf(model)
    model.to(device)
    if world > 1:
        mesh = moe.parallel.init_mesh(dp=world // args.ep, ep=args.ep)
        moe.parallel.parallelize(model, mesh)
    settings = settings_line(
        precision=args.precision, device=device, dp=world // args.ep, ep=args.ep,
        data_parallel="ddp" if world > 1 else None,
    )  # fmt: skip
    say(f"settings: {settings}")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    vocab = model.config.get_text_config().vocab_size
    losses, pending = [], []  # pending: losses of the steps since the last read, on device
    model.train()
    for step in range(args.steps):
        ids = batch(step, args.batch, args.seq_len, vocab, args.seed).chunk(world)[rank]
        ids = ids.to(device, non_blocking=True)
        with autocast(args.precision, device):
            loss = model(ids, labels=ids).loss + moe.aux_loss(model)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        pending.append(loss.detach().float())
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            losses += torch.stack(pending).cpu().tolist()  # one read per log interval
            pending = []
            say(f"step {step + 1}/{args.steps} loss {sum(losses[-10:]) / len(losses[-10:]):.3f}")
    moe.save_hf_checkpoint(model, args.out)
    probe = batch(10**6, 4, args.seq_len, vocab, args.seed)
    model.eval()
    with torch.no_grad():  # fp32, no autocast: compared with transformers' fp32 CPU reload
        ours = model(probe.to(device)).logits.cpu()
    result = {"first_loss": losses[0], "final_loss": sum(losses[-10:]) / len(losses[-10:]),
              "settings": settings}  # fmt: skip
    if rank == 0:
        reloaded = AutoModelForCausalLM.from_pretrained(args.out).float().eval()
        with torch.no_grad():
            theirs = reloaded(probe).logits
        # moe's layers against transformers' blocks: the same function, float32 rounding apart
        # (moe sums the k chosen experts' outputs in its own order, transformers per expert)
        result["max_logit_diff"] = float((ours - theirs).abs().max())
        line = (
            f"loss {result['first_loss']:.3f} -> {result['final_loss']:.3f}; saved {args.out}; "
            f"transformers reloads it: max |logit difference| "
        )
        if world == 1:  # our trained weights in transformers' own blocks: the same code
            moe.to_hf(model)
            with torch.no_grad():
                same_code = model.cpu()(probe).logits
            result["max_logit_diff_same_code"] = float((same_code - theirs).abs().max())
            line += (
                f"{result['max_logit_diff_same_code']:.2e} against our weights in transformers' "
                f"blocks (moe.to_hf: the file holds them exactly), "
                f"{result['max_logit_diff']:.2e} against moe's layers (float32 rounding)"
            )
        else:
            line += f"{result['max_logit_diff']:.2e} against moe's layers (float32 rounding)"
        say(line)
    if world > 1:
        dist.barrier()
    return result


if __name__ == "__main__":
    main()
