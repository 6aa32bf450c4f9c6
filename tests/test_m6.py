"""The M6 example: the tiny config trains, resumes exactly, matches across ranks, and the
large configs' meta-device parameter counts equal their stated sizes."""

import contextlib
import io
import json
import math
import warnings

import pytest
import torch

import moe
import moe.parallel
from examples.m6 import data as m6data
from examples.m6 import train
from examples.m6.config import CONFIGS, get_config
from examples.m6.model import count_params, prefix_lm_mask
from tests.distributed import run_ranks

STEPS = 24
FAST = ["--quiet", "--no-plots", "--eval-every", "1000", "--global-batch", "32"]


def _run(tmp_path, *extra, steps=STEPS):
    return train.run(["--steps", str(steps), "--run-dir", str(tmp_path), *FAST, *extra])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("m6-full"))


def test_tiny_trains_and_loss_falls(uninterrupted):
    losses = uninterrupted["losses"]
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses)))
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < 0.7 * first, (first, last)
    assert uninterrupted["caption_total"] == len(m6data.load_digits().test)
    # the accuracy is the graded share, and a sample is graded correct iff it is the reference
    correct, total = uninterrupted["caption_correct"], uninterrupted["caption_total"]
    assert uninterrupted["caption_accuracy"] == correct / total
    samples = uninterrupted["samples"]
    graded = [s["generated"] == " ".join(s["reference"].lower().split()) for s in samples]
    assert samples and [s["correct"] for s in samples] == graded
    assert sum(s["correct"] for s in samples) <= correct


def test_resume_continues_with_the_same_losses(uninterrupted, tmp_path):
    half = _run(tmp_path, "--stop-after", str(STEPS // 2))
    assert len(half["losses"]) == STEPS // 2
    resumed = _run(tmp_path, "--resume")
    assert resumed["steps_this_run"] == STEPS - STEPS // 2
    assert resumed["losses"] == pytest.approx(uninterrupted["losses"], abs=1e-6, rel=0)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["losses"] == resumed["losses"]


def _two_ranks(rank, world_size, run_dir, data_parallel):
    """The run's losses and every warning it raised (a user sees each one per rank); first
    a bad --spare-slots for 2 ranks: exit status and stderr."""
    argv = ["--steps", "8", "--run-dir", run_dir, "--dp", "1", "--ep", "2", *FAST]
    with contextlib.redirect_stderr(io.StringIO()) as err:
        status = train.main([*argv, "--spare-slots", "16"])
    assert status == 2 and err.getvalue().count("\n") == 1, err.getvalue()
    assert err.getvalue().startswith("error: --spare-slots 16: at most 8 for 8 experts on --ep 2")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = train.run([*argv, "--data-parallel", data_parallel])["losses"]
    return losses, [f"{w.filename}:{w.lineno}: {w.message}" for w in caught]


@pytest.mark.parametrize("data_parallel", ["ddp", "fsdp"])
def test_two_ranks_match_single_process(tmp_path, data_parallel):
    # The same routing groups on one process: the global batch as two micro-batches.
    single = _run(tmp_path / "single", "--micro-batch", "16", steps=8)["losses"]
    results = run_ranks(_two_ranks, 2, str(tmp_path / "ep2"), data_parallel, timeout=120)
    assert [w for _, caught in results for w in caught] == []  # FSDP2's view, deprecations
    ranks = [losses for losses, _ in results]
    assert ranks[0] == ranks[1]
    assert ranks[0] == pytest.approx(single, abs=1e-5, rel=1e-5)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_meta_parameter_counts_equal_stated_sizes(name):
    cfg = get_config(name)
    for c in (cfg, cfg.equal_flops_dense()):
        with torch.device("meta"):
            model = c.build()
        assert all(p.device.type == "meta" for p in model.parameters())
        total, experts = count_params(model)
        assert total == c.stated_params
        assert len(moe.moe_layers(model)) == len(c.moe_block_names())
    if cfg.nominal_params:  # the assumed widths land on the size the source states
        assert cfg.stated_params >= cfg.nominal_params
        assert cfg.stated_params < 1.05 * cfg.nominal_params
    if cfg.is_moe:  # the dense baseline has the same active parameters up to the routers
        routers = len(cfg.moe_block_names()) * cfg.num_experts * cfg.d_model
        assert cfg.equal_flops_dense().stated_params == cfg.active_params - routers


def test_plan_1t_on_meta(capsys):
    out = train.run(
        ["--config", "m6-1t", "--plan", "--world-size", "480", "--device-memory-gb", "32"]
    )
    report = out["report"]
    assert f"{get_config('m6-1t').stated_params:,}" in report and "(matches)" in report
    assert "dp=1 x ep=480" in report and "2 experts per device" in report


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--ep", "2"], "torchrun --nproc-per-node 2"),
        (["--config", "m6-1t", "--plan", "--world-size", "480", "--ep", "7"], "does not divide"),
        (["--config", "m6-tiny", "--plan", "--world-size", "16", "--ep", "16"], "num_experts=8"),
        (["--config", "m6-huge"], "unknown config"),
        (["--top-k", "3"], "prototype"),
        (["--global-batch", "30", "--micro-batch", "7"], "must divide"),
        (["--threads", "100000"], "--threads must be between 0"),  # examples/device.py's rule
    ],
)
def test_bad_arguments_fail_before_work(argv, message, tmp_path):
    with pytest.raises(train.UsageError, match=message):
        train.run([*argv, "--run-dir", str(tmp_path), "--quiet"])
    assert not (tmp_path / "checkpoint").exists()


def test_prefix_lm_mask_and_causality():
    allowed = prefix_lm_mask(2, 4, torch.tensor([1, 2]), torch.tensor([True, False]))
    assert allowed.any(-1).all()  # no fully masked row
    assert allowed[0, 0, 2] and not allowed[0, 2, 3]  # patches see the prompt; text causal
    assert not allowed[1, 3, 0] and allowed[1, 2, 3]  # no image: patches hidden; prompt mutual
    torch.manual_seed(0)
    cfg = get_config("m6-tiny").replace(capacity_factor=None)
    model = cfg.build().eval()
    digits = m6data.load_digits()
    enc = m6data.encode(digits.test[:2], digits.vocab, cfg.text_len)
    b = m6data.make_batch(digits, enc, torch.arange(2))
    logits = model(b.images_BCHW, b.text_BL, b.prompt_len_B, b.has_image_B)
    later = b.text_BL.clone()
    later[:, -3] = 5  # a future text token: earlier text positions must not change
    logits2 = model(b.images_BCHW, later, b.prompt_len_B, b.has_image_B)
    torch.testing.assert_close(logits[:, :-3], logits2[:, :-3])
    assert not torch.allclose(logits[:, -3:], logits2[:, -3:])
    image = b.images_BCHW.clone()
    image[:, :, 0, 0] += 1.0  # the first patch: the prompt attends to it bidirectionally
    logits3 = model(image, b.text_BL, b.prompt_len_B, b.has_image_B)
    assert not torch.allclose(logits[:, 0], logits3[:, 0])


def test_global_batch_is_the_same_for_any_world():
    idx = m6data.global_batch_indices(7, 100, 24, seed=3)
    assert idx.tolist() == m6data.global_batch_indices(7, 100, 24, seed=3).tolist()
    assert len(set(idx.tolist())) == 24  # inside one epoch: no repeats
    shards = [m6data.shard(idx, r, 4) for r in range(4)]
    assert torch.cat(shards).tolist() == idx.tolist()
    crossing = m6data.global_batch_indices(4, 100, 24, seed=3)  # rows 96..119: two epochs
    assert crossing.shape == (24,)


def test_folder_of_images_and_captions(tmp_path):
    from PIL import Image

    lines = []
    for i in range(6):
        img = Image.new("RGB", (16, 12), color=(40 * i, 0, 255 - 40 * i))
        img.save(tmp_path / f"img{i}.png")
        color = "red" if i > 2 else "blue"
        lines.append(
            json.dumps({"image": f"img{i}.png", "caption": f"a {color} square number {i}"})
        )
    (tmp_path / "captions.jsonl").write_text("\n".join(lines) + "\n")
    data = m6data.load_folder(tmp_path, image_size=8, channels=1)
    assert data.images_NCHW.shape == (6, 1, 8, 8) and len(data.test) == 1
    assert any(ex.image == -1 for ex in data.train)  # text-to-text completions
    out = train.run(["--data", str(tmp_path), "--steps", "3", "--global-batch", "4",
                     "--run-dir", str(tmp_path / "run"), "--quiet", "--no-plots"])  # fmt: skip
    assert len(out["losses"]) == 3 and out["caption_total"] == 1


# -- the held-out evaluation against hand-made cases (issue 49 item 21) ----------------------
class _Says(torch.nn.Module):
    """A stand-in model that says `belief[image]` after <bos>: at every position its logits
    are BIG at the next token of prompt, <bos>, belief, <eos> (teacher-forced or greedy)."""

    BIG = 12.0

    def __init__(self, vocab, beliefs: dict[int, str]):
        super().__init__()
        self.vocab, self.beliefs = vocab, beliefs

    def forward(self, images_BCHW, text_BL, prompt_len_B, has_image_B):
        B, L = text_BL.shape
        logits = torch.zeros(B, L, len(self.vocab))
        for b in range(B):
            p = int(prompt_len_B[b])
            said = self.vocab.encode(self.beliefs[int(images_BCHW[b, 0, 0, 0])])
            seq = text_BL[b, :p].tolist() + [self.vocab.bos] + said + [self.vocab.eos]
            seq += [self.vocab.pad] * (L + 1 - len(seq))
            for j in range(L):
                logits[b, j, seq[j + 1]] = self.BIG
        return logits


def _hand_made(truths: list[str]):
    from examples.m6.data import DESCRIBE, Dataset, Example, Vocab

    images = torch.arange(len(truths), dtype=torch.float32).view(-1, 1, 1, 1).expand(-1, 1, 2, 2)
    test = [Example(i, DESCRIBE, t) for i, t in enumerate(truths)]
    words = " ".join([DESCRIBE, *truths, "a photo of the digit one two three seven extra"]).split()
    return Dataset("hand-made", Vocab(words), images.contiguous(), [], test, [])


@pytest.mark.parametrize(
    "beliefs, correct",
    [
        (["a one", "a two", "a three", "a seven"], 4),  # every caption right
        (["a one", "a three", "a three", "a one"], 2),  # 2 of 4
        (["a two", "a one", "a seven", "a three"], 0),  # none
        (["a", "a two extra", "a three", "one"], 1),  # a prefix or a longer caption is wrong
    ],
)
def test_evaluation_counts_exact_captions(beliefs, correct):
    from examples.m6.evaluate import evaluate
    from examples.m6.runtime import Runtime

    truths = ["A one", "a  two", "a three", "a seven"]  # compared lower-cased, spaces collapsed
    data = _hand_made(truths)
    model = _Says(data.vocab, dict(enumerate(beliefs)))
    out = evaluate(model, data, data.test, text_len=8, rt=Runtime(), batch_size=3)
    assert (out["correct"], out["total"]) == (correct, 4)
    assert out["accuracy"] == correct / 4
    assert [s["correct"] for s in out["samples"]] == [b == " ".join(t.lower().split())
                                                      for b, t in zip(beliefs, truths)]  # fmt: skip
    assert [s["generated"] for s in out["samples"]] == beliefs
    # the teacher-forced loss: per target token, -log softmax of BIG where the model agrees
    V = len(data.vocab)
    agree = math.log1p((V - 1) * math.exp(-_Says.BIG))  # -log(e^BIG / (e^BIG + V - 1))
    disagree = math.log(math.exp(_Says.BIG) + V - 1)  # -log(e^0 / (e^BIG + V - 1))
    total = hits = 0
    for b, t in zip(beliefs, truths):
        said = data.vocab.encode(b) + [data.vocab.eos]
        want = data.vocab.encode(t) + [data.vocab.eos]
        for j, w in enumerate(want):
            total += 1
            hits += j < len(said) and said[j] == w
    expected = (hits * agree + (total - hits) * disagree) / total
    assert out["loss"] == pytest.approx(expected, rel=1e-5, abs=1e-6)  # float32 logits


def test_a_short_run_beats_chance_by_a_margin(tmp_path):
    """120 steps of the tiny config (batch 32): the held-out captions are right well above
    chance (10 digits: 10 %), where an inverted or broken evaluation would not be."""
    out = train.run(["--steps", "120", "--global-batch", "32", "--run-dir", str(tmp_path),
                     "--quiet", "--no-plots", "--eval-every", "1000"])  # fmt: skip
    assert out["caption_total"] == len(m6data.load_digits().test)
    assert out["caption_accuracy"] >= 0.25, out["caption_accuracy"]  # measured: 0.47
    assert out["caption_correct"] == round(out["caption_accuracy"] * out["caption_total"])


def test_the_printed_chance_comes_from_the_datas_captions():
    """Issue 49 item 18: the held-out caption accuracy's chance level is the data's own (1 of
    its distinct captions; the most common one's share), not a fixed "(chance 10%)"."""
    from examples.m6.report import print_summary

    test = [m6data.Example(i, "describe the image", c) for i, c in enumerate("aaab")]
    summary = {"config": {"name": "m6-tiny"}, "steps_this_run": 3, "time_s": 1.0,
               "tokens_per_s": 1.0, "world": 1, "device": "cpu", "final_loss": 1.0,
               "caption_accuracy": 0.5, "caption_correct": 2, "caption_total": 4,
               "heldout_loss": 1.0, "text_accuracy": 1.0, "samples": [], "text_samples": [],
               "checkpoint": "x"}  # fmt: skip
    from examples.m6 import report

    lines = []
    print_summary({**summary, "caption_chance": report.caption_chance(test)}, lines.append)
    line = next(x for x in lines if "caption accuracy" in x)
    assert "(chance 50.0%: 1 of 2 captions; always the most common one: 75.0%)" in line, line
    digits = report.caption_chance(m6data.load_digits().test)
    assert digits["classes"] == 10


def test_the_settings_that_change_the_math_are_printed_once_and_titled(tmp_path, capsys):
    """Issue 49 item 15: precision, FP8 parts and scale formats, dp x ep, offload, groups and
    replicas in one printed line, in summary.json, and in the plots' titles."""
    from examples.m6 import plots

    titles = []
    real_close = plots.plt.close

    def close(fig):
        titles.append(fig._suptitle.get_text() if fig._suptitle else "")
        real_close(fig)

    plots.plt.close = close
    try:
        s = train.run(["--steps", "2", "--run-dir", str(tmp_path), "--eval-every", "1000",
                       "--global-batch", "8", "--fp8", "all", "--groups", "2",
                       "--offload", "optimizer"])  # fmt: skip
    finally:
        plots.plt.close = real_close
    out = capsys.readouterr().out
    expected = (
        "fp32, FP8 dispatch e4m3 (1x128 blocks, fp32 scales) + expert GEMMs e4m3 (rowwise, "
        "pow2 scales), dp 1 x ep 1 (1 rank), offload optimizer, 2 optimizer groups, no replicas"
    )
    assert out.count("settings: ") == 1 and f"settings: {expected}" in out, out
    assert s["settings"].startswith(expected)
    assert len(titles) >= 2
    for title in titles[:2]:  # loss.png and expert_load.png
        assert "FP8 dispatch e4m3" in title.replace("\n", " "), title


def test_the_m6_benchmark_report_names_each_runs_settings():
    import argparse

    from examples.m6 import bench

    r = {"config": {"name": "m6-tiny"}, "label": "MoE", "world": 4, "dp": 2, "ep": 2,
         "device": "cpu", "params": 1, "active_params": 1, "tokens_per_s": 1.0,
         "caption_accuracy": 0.9, "heldout_loss": 0.1, "text_accuracy": 1.0, "time_s": 1.0,
         "load": (1, 1), "settings": "fp32, FP8 off, dp 2 x ep 2 (4 ranks), ddp",
         "global_batch": 32, "caption_total": 7, "caption_chance": {"classes": 4, "share": 0.5}}  # fmt: skip
    text = bench.report([r], argparse.Namespace(steps=5))
    assert "- MoE (4 rank(s)): fp32, FP8 off, dp 2 x ep 2 (4 ranks), ddp" in text
    assert "global batch 32" in text and "on the 7 held-out images (chance 25.0%" in text


def test_plan_says_what_offload_and_groups_do():
    """Issue 49 item 18: with --offload optimizer the plan's on-device "optimizer state" row is
    the fp32 master weights (said so, with the host's share), and --groups under offload
    leaves the device rows as they are (said so); without offload, groups cut the step's
    temporaries."""
    base = ["--config", "m6-1t", "--plan", "--world-size", "480", "--device-memory-gb", "32"]
    off = train.run([*base, "--offload", "optimizer", "--groups", "4"])["report"]
    assert "'optimizer state' row (8.36 GiB) is the fp32 master weights" in off, off
    assert "groups=4 with offload: the step runs on the host one group at a time" in off
    grouped = train.run([*base, "--groups", "4"])["report"]
    plain = train.run(base)["report"]

    def row(report, name):
        return float(next(x for x in report.splitlines() if x.startswith(name)).split()[-1])

    assert row(grouped, "step temporaries") == pytest.approx(
        row(plain, "step temporaries") / 4, rel=1e-3
    )
    assert row(off, "optimizer state") < row(plain, "optimizer state")
