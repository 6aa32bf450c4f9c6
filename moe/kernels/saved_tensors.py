"""How the expert ops keep tensors for backward (shared by the torch and Triton backends; a leaf:
imports nothing from moe)."""

import torch


def keep_graph() -> bool:
    """backward(retain_graph=True) is running: saved state must survive this backward (the
    expert ops release their pre-activations early otherwise)."""
    try:
        return torch._C._autograd._get_current_graph_task_keep_graph()
    except RuntimeError:  # not inside an engine-run backward (tracing)
        return False


def save_for_backward_early_free(ctx, inputs: tuple, pre: tuple) -> None:
    """Save `inputs` and the pre-activation tensors `pre` of an expert op for its backward.

    Without saved-tensor hooks, `pre` stays on ctx (detached: no cycle through the graph), so
    the backward can free it as soon as its activation step has read it (see `saved_early`).
    When hooks are installed (activation checkpointing, torch.autograd.graph.save_on_cpu), `pre`
    goes through save_for_backward like the inputs, so the hooks see it: dropped and recomputed,
    or moved to the host, instead of held on the device until backward."""
    pre = tuple(t.detach() for t in pre)
    hooked = torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    ctx.save_for_backward(*inputs, *(pre if hooked else ()))
    ctx.pre_on_ctx = None if hooked else pre
    ctx.num_saved_inputs = len(inputs)


def saved_early(ctx) -> tuple[tuple, tuple]:
    """(inputs, pre) as saved by `save_for_backward_early_free`; the ctx reference to pre is
    dropped here (unless the graph is retained), so pre dies when the caller lets it go."""
    saved = ctx.saved_tensors
    inputs, pre = saved[: ctx.num_saved_inputs], saved[ctx.num_saved_inputs :]
    if ctx.pre_on_ctx is not None:
        pre = ctx.pre_on_ctx
        if not keep_graph():
            ctx.pre_on_ctx = None
    return inputs, pre
