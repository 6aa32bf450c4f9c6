"""The layout chosen for the user (issue 48): search (pp, dp, ep), ddp / fsdp, schedules and
micro-batches, recompute, offload, grouped apply, exchange, overlap, FP8 and replicas for a
model on a cluster, with predicted per-device memory and step time by term.

  from moe.plan import load_model, preset, search
  result = search(load_model("qwen3-30b-a3b"), preset("h100", nodes=2), 4 * 2**20, 4096)
  print(result.best().layout.code())

Command line: `python -m moe.plan --model <config.json | preset> --nodes N --gpus-per-node G
--gpu-mem 80 --tokens 4M` (see moe/plan/cli.py). Public names: search, SearchSpace, Layout,
Prediction, predict, Cluster, preset, PRESETS, ModelSpec, load_model, from_hf_config.
"""

from moe.plan.cluster import PRESETS, Cluster, preset
from moe.plan.layout import Layout
from moe.plan.models import HF_CONFIGS, load_model
from moe.plan.predict import Prediction, predict
from moe.plan.search import SearchResult, SearchSpace, search
from moe.plan.spec import ModelSpec, from_hf_config, from_planner_model

__all__ = [
    "HF_CONFIGS",
    "PRESETS",
    "Cluster",
    "Layout",
    "ModelSpec",
    "Prediction",
    "SearchResult",
    "SearchSpace",
    "from_hf_config",
    "from_planner_model",
    "load_model",
    "predict",
    "preset",
    "search",
]
