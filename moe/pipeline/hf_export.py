"""A pipelined Hugging Face model written as transformers' own files (moe.pipeline.save_hf).

    save_hf(pipe, stack, folder)   # every rank calls it; rank 0 writes

writes what `moe.to_hf(model).save_pretrained(folder)` writes for the same model in one
process: each stage's full tensors (experts gathered over "ep", FSDP2 shards over the stage's
ranks) go from the stage's first rank to rank 0, which loads them into a new model of the
stack's class and config (moe.from_hf'd like the original when it was), puts the original
blocks back (moe.to_hf) and calls save_pretrained. Rank 0 holds the whole model once.
"""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from moe.comm.consistency import raise_if_any_rank_failed
from moe.pipeline.hf_stack import HFStack
from moe.pipeline.runner import Pipeline


@torch.no_grad()
def stage_state(pipe: Pipeline) -> dict[str, torch.Tensor]:
    """This rank's stages' full state dicts (on the CPU) on each stage's first rank, {}
    elsewhere. Collective over each stage's ranks (DTensors gathered in one order)."""
    lead = all(pipe.mesh.get_local_rank(dim) == 0 for dim in ("dp", "ep"))
    state = {}
    for module in pipe.modules:
        for name, t in module.state_dict().items():
            full = t.full_tensor() if isinstance(t, DTensor) else t
            if lead:
                state[name] = full.detach().to("cpu", copy=True)
    return state


def save_hf(pipe: Pipeline, stack: HFStack, folder: str, **save_kwargs) -> None:
    """Write the pipeline's model (built from `stack`, moe.pipeline.hf_stack) into `folder`
    with transformers' save_pretrained (`save_kwargs` passed on), from rank 0. Every rank calls
    it; a bad argument or a failure on rank 0 is the same error on every rank."""
    problem = None
    try:
        if not isinstance(pipe, Pipeline):
            raise ValueError(f"save_hf: pipe must be a Pipeline, got {type(pipe).__name__}")
        if not isinstance(stack, HFStack):
            raise ValueError(
                f"save_hf: stack must be moe.pipeline.hf_stack(model), got {type(stack).__name__}"
            )
        if stack.text_only:
            raise ValueError(
                "save_hf: the stack is a multimodal model's text path (hf_stack(text_only="
                "True)): the stages do not hold its other towers; save the model as a whole"
            )
        if not isinstance(folder, str) or not folder:
            raise ValueError(f"save_hf: folder must be a path, got {folder!r}")
    except ValueError as e:
        problem = e
    raise_if_any_rank_failed(problem, error=ValueError, what="save_hf")
    state = stage_state(pipe)
    rank = dist.get_rank()
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(state, gathered, dst=0)
    problem = None
    if rank == 0:
        try:
            merged = {k: v for part in gathered for k, v in part.items()}
            _write(stack, merged, folder, save_kwargs)
        except Exception as e:  # noqa: BLE001 - every rank raises it below
            problem = e
    raise_if_any_rank_failed(problem, error=RuntimeError, what="save_hf")


def _write(stack: HFStack, state: dict, folder: str, save_kwargs: dict) -> None:
    from moe.interop.hf import from_hf, to_hf

    with torch.random.fork_rng(devices=[]):  # the new model's init draws: not the run's
        model = stack.hf_class(stack.hf_config)
    if stack.converted:
        from_hf(model, **stack.hf_options)
    model.load_state_dict(state, strict=True, assign=True)
    if stack.converted:
        to_hf(model)
    model.save_pretrained(folder, **save_kwargs)
