"""Splitting a sequential stack into pipeline stages at block boundaries.

A model is split from outside, before parallelize (as torchtitan does): the model is an
nn.Sequential whose children run in order (an embedding, blocks, a head, ...); stage s keeps
its children under their names in the whole model, so parameter names (and checkpoints) are
the single-process ones on every stage.

A child may instead be `Rooted`: it holds its modules at their paths in an original model
(e.g. `model.layers.3` of a transformers decoder, moe.pipeline.hf_stack); a stage of such
children holds those modules at the same paths, so its parameter names are the original
model's, and runs the children in order.
"""

from collections import OrderedDict

import torch
from torch import nn

from moe.layer import moe_layers
from moe.pipeline.aux import attach_aux

SPLITS = ("children", "params")


def plan_stages(model: nn.Module, num_stages: int, stages=None, by: str = "children"):
    """The child names of each stage: `stages` checked (every child once, in order), or an
    even split: by="children", by child count (the first len % num_stages stages take one
    more); by="params", contiguous stages minimising the largest stage's parameter count
    (moe.pipeline.split.balance). Children are positions (a module used twice is two); one
    parameter at two positions is refused (check_shared)."""
    if not isinstance(model, nn.Sequential):
        raise ValueError(
            f"the pipeline splits an nn.Sequential stack (children run in order), got "
            f"{type(model).__name__}"
        )
    if by not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {by!r}")
    children = dict(model._modules)  # every position: named_children() skips a repeated module
    names = list(children)
    check_shared(children)
    if stages is None:
        sizes = stage_sizes([param_count(child) for child in children.values()], num_stages, by)
        starts = [sum(sizes[:s]) for s in range(num_stages)]
        return [names[a : a + n] for a, n in zip(starts, sizes)]
    if len(stages) != num_stages:
        raise ValueError(f"stages has {len(stages)} entries for {num_stages} stages")
    flat = [n for stage in stages for n in stage]
    unknown = [n for n in flat if n not in names]
    if unknown:
        raise ValueError(f"stages names {unknown}, not children of the model (it has {names})")
    repeated = sorted({n for n in flat if flat.count(n) > 1})
    if repeated:
        raise ValueError(f"stages names {repeated} more than once")
    if flat != names:
        missing = [n for n in names if n not in flat]
        why = f"misses {missing}" if missing else "is out of order"
        raise ValueError(f"stages {why}: every child of the model once, in order ({names})")
    return [list(stage) for stage in stages]


def stage_sizes(weights: list[int], num_stages: int, by: str = "children") -> list[int]:
    """How many children each stage takes when the split is not given, from the children's
    parameter counts `weights` (the one rule: the pipeline builds it, moe.plan predicts it):
    by="children", even counts, the first len % num_stages stages one more; by="params",
    `balance` of the counts."""
    if by not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {by!r}")
    children = len(weights)
    if children < num_stages:
        raise ValueError(f"the model has {children} children, fewer than {num_stages} stages")
    if by == "params":
        return balance(list(weights), num_stages)
    base, extra = divmod(children, num_stages)
    return [base + (s < extra) for s in range(num_stages)]


def check_shared(children: dict[str, nn.Module]) -> None:
    """One parameter at two positions of the stack (tied weights, a block used twice) is
    refused, naming both: the stages hold each child's parameters apart, so the pipeline
    would train it as two copies, each with its own part of the gradient."""
    seen: dict[int, str] = {}
    for name, child in children.items():
        prefix = "" if isinstance(child, Rooted) else f"{name}."  # Rooted: the model's paths
        here: dict[int, str] = {}
        for pname, p in child.named_parameters(remove_duplicate=False):
            here.setdefault(id(p), f"{prefix}{pname} (child {name!r})")
        for key, place in here.items():
            if key in seen:
                raise ValueError(
                    f"{seen[key]} and {place} are one parameter: the pipeline's stages hold "
                    "each child's parameters apart and would train two copies; untie them, "
                    "or share them inside one child"
                )
            seen[key] = place


def param_count(module: nn.Module) -> int:
    """Elements of the module's parameters (each once), as built: the whole model's."""
    return sum(p.numel() for p in module.parameters())


def balance(weights: list[int], num_stages: int) -> list[int]:
    """Sizes of `num_stages` contiguous non-empty groups of `weights` whose largest sum is the
    least possible; of those plans, earlier groups take as many items as they can."""
    n = len(weights)
    if num_stages < 1 or n < num_stages:
        raise ValueError(f"cannot split {n} items into {num_stages} non-empty stages")
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    # best[i]: least largest sum splitting the first i items into the stages so far
    best = [prefix[i] for i in range(n + 1)]
    for s in range(2, num_stages + 1):
        best = [
            min((max(best[j], prefix[i] - prefix[j]) for j in range(s - 1, i)), default=None)
            if i >= s
            else None
            for i in range(n + 1)
        ]
    bound, sizes, start = best[n], [], 0
    for s in range(num_stages):
        left = num_stages - s - 1  # stages after this one, one item each at least
        end = start + 1
        while end < n - left and prefix[end + 1] - prefix[start] <= bound:
            end += 1
        sizes.append(end - start)
        start = end
    return sizes


class Rooted(nn.Module):
    """A stack child holding its modules at their paths in an original model (`paths`: path
    -> module, the same objects), so its parameter names are that model's; its forward runs
    them. Several children may hold one module at one path (e.g. a rotary embedding)."""

    def __init__(self, paths: dict[str, nn.Module]):
        super().__init__()
        graft(self, paths)
        # plain containers: the modules are registered by graft only
        self.paths, self.parts = dict(paths), tuple(paths.values())


def graft(root: nn.Module, paths: dict[str, nn.Module]) -> None:
    """Register each module under `root` at its dotted path (empty holders in between); one
    path holding two different modules is an error."""
    for path, module in paths.items():
        node, parts = root, path.split(".")
        for part in parts[:-1]:
            if part not in node._modules:
                node.add_module(part, nn.Module())
            node = node._modules[part]
        have = node._modules.get(parts[-1])
        if have is None:
            node.add_module(parts[-1], module)
        elif have is not module:
            raise ValueError(f"two different modules at {path} in one pipeline stage")


class _StageAux:
    """What every stage does with its MoE layers' aux loss."""

    aux_scale: float
    aux_values: list

    def aux_loss(self) -> torch.Tensor | None:
        """Sum of the stage's MoE layers' aux_loss from the last forward (None: no MoE layer)."""
        losses = [layer.aux_loss for _, layer in moe_layers(self)]
        return torch.stack(losses).sum() if losses else None

    def _with_aux(self, y):
        aux = self.aux_loss()
        if aux is None:
            return y
        if self.training:
            self.aux_values.append(aux.detach())
        return attach_aux(y, aux, self.aux_scale)


class PipelineStageModule(_StageAux, nn.Sequential):
    """One stage: its children in order, under their names in the whole model. Its output
    carries the stage's MoE aux loss into the backward (moe.pipeline.aux); each training
    forward's aux loss is kept (detached) in `aux_values` for logging."""

    def __init__(self, children: "OrderedDict[str, nn.Module]", aux_scale: float):
        nn.Sequential.__init__(self, children)
        self.aux_scale = aux_scale
        self.aux_values: list[torch.Tensor] = []

    def units(self) -> list[nn.Module]:
        """The modules parallelized one by one (moe.pipeline.stage_parallel): the children."""
        return list(self.children())

    def forward(self, x):
        return self._with_aux(nn.Sequential.forward(self, x))


class RootedStageModule(_StageAux, nn.Module):
    """One stage of a stack with Rooted children: their modules at their original paths (a
    plain child at its name), run child by child; aux loss as PipelineStageModule."""

    def __init__(self, children: "OrderedDict[str, nn.Module]", aux_scale: float):
        super().__init__()
        self.aux_scale = aux_scale
        self.aux_values: list[torch.Tensor] = []
        self.steps = list(children.values())  # a plain list: not registered twice
        self.step_names = list(children)
        self.paths: dict[str, nn.Module] = {}
        for name, child in children.items():
            paths = child.paths if isinstance(child, Rooted) else {name: child}
            graft(self, paths)
            self.paths.update(paths)

    def units(self) -> list[nn.Module]:
        """The modules at the children's paths (each once), in order: each is called in the
        forward, so each can be an FSDP2 unit."""
        return list({id(m): m for m in self.paths.values()}.values())

    def forward(self, x):
        for step in self.steps:
            x = step(x)
        return self._with_aux(x)


def build_stage(model: nn.Sequential, names: list[str], aux_scale: float) -> nn.Module:
    """The stage holding `names` (children of `model`, moved, not copied)."""
    children = dict(model._modules)  # every position (named_children() skips repeats)
    picked = OrderedDict((n, children[n]) for n in names)
    if any(isinstance(child, Rooted) for child in children.values()):
        return RootedStageModule(picked, aux_scale)
    return PipelineStageModule(picked, aux_scale)
