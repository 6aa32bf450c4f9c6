"""The end of an M6 run: held-out evaluation, plots and the printed summary."""

from __future__ import annotations

from pathlib import Path

from examples.m6.evaluate import evaluate
from examples.m6.runtime import Runtime


def final_evaluation(model, data, cfg, args, rt: Runtime, history) -> dict:
    """Caption accuracy on held-out images, text-to-text accuracy, sample generations."""
    caption = evaluate(model, data, data.test, cfg.text_len, rt, args.eval_batch)
    text = evaluate(model, data, data.text_pairs, cfg.text_len, rt, args.eval_batch)
    history["eval_step"].append(args.steps)
    history["eval_loss"].append(caption["loss"])
    samples = [
        {
            "image": data.test[s["example"]].image,
            "label": data.labels[data.test[s["example"]].image] if data.labels else None,
            "prompt": data.test[s["example"]].prompt,
            "generated": s["generated"],
            "reference": data.test[s["example"]].target,
            "correct": s["correct"],
        }
        for s in caption["samples"]
    ]
    text_samples = [
        {
            "prompt": data.text_pairs[s["example"]].prompt,
            "generated": s["generated"],
            "correct": s["correct"],
        }
        for s in text["samples"][:4]
    ]
    return {
        "caption_accuracy": caption["accuracy"], "caption_correct": caption["correct"],
        "caption_chance": caption_chance(data.test),
        "caption_total": caption["total"], "heldout_loss": caption["loss"],
        "text_accuracy": text["accuracy"], "samples": samples, "text_samples": text_samples,
    }  # fmt: skip


def caption_chance(examples) -> dict:
    """Chance level of the held-out caption accuracy from the data's own classes (not a fixed
    10%): the number of distinct held-out captions (a uniform guess: 1 / classes) and the
    share of the most common one (what always writing that caption scores)."""
    counts: dict[str, int] = {}
    for ex in examples:
        counts[ex.target] = counts.get(ex.target, 0) + 1
    total = sum(counts.values())
    return {"classes": len(counts), "share": max(counts.values()) / total if total else 0.0}


TRACE = "routing_trace.jsonl"


def make_plots(history, data, summary, out: Path) -> list[str]:
    from examples.m6 import plots
    from examples.m6.trace_io import trace_files

    paths = [
        plots.plot_loss(history, out / "loss.png"),
        plots.plot_expert_load(
            trace_files(out),  # with and without --pp: a run resumed at another layout
            out / "expert_load.png",
            f"expert load per MoE layer (uniform = 1/E)\n{history.get('title', '')}",
        ),
    ]
    samples = summary["samples"]
    if samples:
        images = data.images_NCHW[[s["image"] for s in samples]]
        titles = [sample_title(s) for s in samples]
        paths.append(plots.plot_samples(images, titles, out / "samples.png"))
    return [str(p) for p in paths if p is not None]


def sample_title(s: dict) -> str:
    """'ok: <generated>', or 'WRONG: <generated>' with the true caption (and label) below."""
    if s["correct"]:
        return f"ok: {s['generated']!r}"
    label = f" [{s['label']}]" if s.get("label") else ""
    return f"WRONG: {s['generated']!r}\ntrue{label}: {s['reference']!r}"


def print_summary(s: dict, say) -> None:
    c = s.get("caption_chance")
    chance = (
        f" (chance {100 / c['classes']:.1f}%: 1 of {c['classes']} captions; always the most "
        f"common one: {100 * c['share']:.1f}%)"
        if c and c["classes"]
        else ""
    )
    say(
        f"\n{s['config']['name']}: {s['steps_this_run']} steps in {s['time_s']:.1f} s, "
        f"{s['tokens_per_s']:,.0f} tokens/s on {s['world']} rank(s) ({s['device']}); "
        f"final train loss {s['final_loss']:.4f}"
    )
    say(
        f"held-out caption accuracy {100 * s['caption_accuracy']:.1f}% "
        f"({s['caption_correct']}/{s['caption_total']}){chance}; held-out loss "
        f"{s['heldout_loss']:.4f}; text-to-text accuracy {100 * s['text_accuracy']:.1f}%"
    )
    say("sample captions (held-out images):")
    for x in s["samples"]:
        label = f"[{x['label']}] " if x["label"] else ""
        say(f"  {label}{x['prompt']} -> {x['generated']!r} {'ok' if x['correct'] else 'WRONG'}")
    for x in s["text_samples"]:
        say(f"  {x['prompt']} -> {x['generated']!r} {'ok' if x['correct'] else 'WRONG'}")
    for path in s.get("plots", []):
        say(f"plot: {path}")
    if s.get("checkpoint"):
        say(f"checkpoint: {s['checkpoint']} (continue with --resume --steps N)")
