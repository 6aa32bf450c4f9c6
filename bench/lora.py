"""Expert LoRA training step against full fine-tuning and against transformers + PEFT, side by
side in one run (one process, CPU, fp32, round-robin interleaved medians):

    python -m bench.lora [--steps 6 --tokens 512 --rank 8 --write]

Candidates, each on its own copy of the same small Qwen3-MoE (2 layers, 32 experts of d=512,
F=256, top-2, vocab 1024: 28 M parameters) and the same batch, one step = forward + backward +
AdamW step:
    moe full          moe.from_hf, every parameter trained
    moe expert LoRA   moe.from_hf + moe.lora.add_lora(rank r, alpha 2r), adapters only
    PEFT LoRA (...)   transformers' model + peft LoraConfig(target_parameters=experts'
                      gate_up_proj at rank 2r, down_proj at rank r: what moe.interop.to_peft
                      writes for moe's adapters; PEFT trains B's off-diagonal blocks too, so
                      it holds 2rE*F more parameters per layer), transformers' experts code
                      "grouped_mm" (its default) and "eager" (a loop over the experts)
    HF full           transformers' model, every parameter trained ("grouped_mm")
Memory columns are what training holds besides the frozen weights: trainable parameters,
their gradients and AdamW's two moments (bytes, counted from the tensors after a step).
--write saves bench/results/<date>-cpu-lora.{md,json}.
"""

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch

import moe
from bench.common import device_name, write_report

SIZES = dict(
    vocab_size=1024, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
    num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
    num_experts=32, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512,
)  # fmt: skip
SEQ = 128  # tokens per sequence


def build():
    import transformers as T

    torch.manual_seed(0)
    return T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(**SIZES)).float()


def candidates(base, r: int) -> dict:
    """name -> (model, trainable parameters)."""
    import peft

    from moe.lora import LoRAConfig, adapter_parameters, add_lora

    out = {}
    full = moe.from_hf(copy.deepcopy(base))
    out["moe full"] = (full, list(full.parameters()))
    lora = moe.from_hf(copy.deepcopy(base))
    add_lora(lora, LoRAConfig(rank=r, alpha=2 * r))
    out[f"moe expert LoRA r={r}"] = (lora, [p for _, p in adapter_parameters(lora)])
    for impl in ("grouped_mm", "eager"):
        m = copy.deepcopy(base)
        m.set_experts_implementation(impl)
        config = peft.LoraConfig(
            r=r, lora_alpha=2 * r, target_modules=[],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
            rank_pattern={"gate_up_proj": 2 * r}, alpha_pattern={"gate_up_proj": 4 * r},
        )  # fmt: skip
        pm = peft.get_peft_model(m, config)
        with torch.no_grad():  # B non-zero, as after some training
            for n, p in pm.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.02)
        out[f"PEFT LoRA ({impl})"] = (pm, [p for p in pm.parameters() if p.requires_grad])
    hf = copy.deepcopy(base)
    out["HF full"] = (hf, list(hf.parameters()))
    return out


def memory(params, opt) -> dict:
    """Bytes of the trainable parameters, their gradients and the optimizer's state."""
    size = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
    return {
        "trainable_params": sum(p.numel() for p in params),
        "trainable_bytes": size(params),
        "grad_bytes": size([p.grad for p in params if p.grad is not None]),
        "optimizer_bytes": size(state),
    }


def timed(steps: dict, iters: int) -> dict:
    """name -> (median wall seconds, median CPU seconds of this process) per step, the
    candidates interleaved round-robin (one warm-up step each first) so that drift in machine
    load touches all alike; CPU time counts every thread's work and is the steadier of the
    two on a shared machine."""
    for fn in steps.values():
        fn()
    samples = {name: ([], []) for name in steps}
    for _ in range(iters):
        for name, fn in steps.items():
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            samples[name][0].append(time.perf_counter() - wall)
            samples[name][1].append(time.process_time() - cpu)
    return {n: (statistics.median(w), statistics.median(c)) for n, (w, c) in samples.items()}


def run(args) -> dict:
    base = build()
    total = sum(p.numel() for p in base.parameters())
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SIZES["vocab_size"], (args.tokens // SEQ, SEQ), generator=g)
    steps, rows = {}, {}
    for name, (model, params) in candidates(base, args.rank).items():
        model.train()
        opt = torch.optim.AdamW(params, lr=1e-4)

        def step(model=model, opt=opt):
            loss = model(ids, labels=ids).loss
            opt.zero_grad(set_to_none=False)
            loss.backward()
            opt.step()

        step()
        rows[name] = memory(params, opt)
        steps[name] = step
    for name, (wall, cpu) in timed(steps, args.steps).items():
        rows[name]["step_ms"], rows[name]["cpu_ms"] = 1e3 * wall, 1e3 * cpu
    return {"model_params": total, "tokens": ids.numel(), "rank": args.rank, "rows": rows}


def table(result: dict) -> str:
    head = (
        "| candidate | step ms (wall) | step ms (CPU) | trainable params | "
        "trainable + grads + AdamW MiB | vs moe full (CPU time, memory) |\n"
        "|---|---:|---:|---:|---:|---:|\n"
    )
    rows = result["rows"]
    ref = rows["moe full"]
    mib = lambda r: (r["trainable_bytes"] + r["grad_bytes"] + r["optimizer_bytes"]) / 2**20  # noqa: E731
    lines = [
        f"| {n} | {r['step_ms']:.1f} | {r['cpu_ms']:.1f} | {r['trainable_params']:,} | "
        f"{mib(r):.2f} | {r['cpu_ms'] / ref['cpu_ms']:.2f}x, {mib(r) / mib(ref):.3f}x |"
        for n, r in rows.items()
    ]
    return head + "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=6, help="timed steps per candidate")
    p.add_argument("--tokens", type=int, default=512, help="tokens per step (sequences of 128)")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--write", action="store_true", help="save bench/results/<date>-cpu-lora.*")
    args = p.parse_args(argv)
    if args.steps < 1 or args.rank < 1 or args.tokens < SEQ or args.tokens % SEQ:
        p.error(f"--steps, --rank must be >= 1; --tokens a positive multiple of {SEQ}")
    result = run(args)
    result["machine"] = device_name(torch.device("cpu"))
    result["load_average"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    words = argv if argv is not None else sys.argv[1:]
    result["command"] = " ".join(["python -m bench.lora", *words])
    text = (
        f"# Expert LoRA training step: moe vs transformers + PEFT\n\n"
        f"`{result['command']}`: fp32, {result['tokens']} tokens per step, Qwen3-MoE (2 layers "
        f"x {SIZES['num_experts']} experts, {result['model_params']:,} parameters), LoRA rank "
        f"{args.rank}, AdamW; {result['machine']}, 1-minute load average "
        f"{result['load_average']}. Medians of {args.steps} interleaved steps.\n\n" + table(result)
    )
    print(text)
    if args.write:
        path = write_report("lora", text, torch.device("cpu"))
        with open(os.path.splitext(path)[0] + ".json", "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {path} and .json")
    return result


if __name__ == "__main__":
    main()
