"""The MoE aux losses of a pipeline stage reach the backward through the stage's output.

PyTorch's schedules call loss_fn on the last stage's output only, so the balance / z losses of
the MoE layers on every other stage would never be differentiated. Megatron-Core's answer,
done here: an identity in forward whose backward also hands the stage's aux loss a gradient
(`scale`), so the same backward pass that carries the output's gradient differentiates the
aux loss too: d(scale * aux)/d(weights, inputs) is added where it belongs, and the stage
input's gradient (sent to the previous stage) includes it. No extra communication.

Meaning per micro-batch: each micro-batch's aux loss (the sum over the stage's MoE layers of
their aux_loss from that forward) enters with weight `scale` = 1/microbatches (PipelineConfig
.aux_scale), so a step's aux loss is the mean over its micro-batches, on each rank; data
parallelism then averages over ranks as it does the task loss. At pp = 1 the same quantity is
sum over micro-batches of moe.aux_loss(model) / microbatches, accumulated per micro-batch.
"""

import torch


class AuxLossToBackward(torch.autograd.Function):
    """y, aux, scale -> y; backward: (grad_y, scale * ones_like(aux), None)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_shape, ctx.aux_dtype, ctx.aux_device = aux.shape, aux.dtype, aux.device
        # an alias, not a view: PyTorch's split backward (zero-bubble schedules) detaches the
        # stage outputs in place, which a view refuses; it shares y's version counter, so an
        # in-place change of y that autograd needs is still caught
        return y.detach()

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        ones = torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=ctx.aux_device)
        return grad_y, ones, None


def attach_aux(y, aux: torch.Tensor, scale: float):
    """`y` (a tensor, or a tuple whose first grad-requiring tensor carries it) with `aux`'s
    gradient attached; `y` unchanged where there is nothing to differentiate."""
    if not (torch.is_grad_enabled() and aux.requires_grad):
        return y
    if isinstance(y, torch.Tensor):
        return AuxLossToBackward.apply(y, aux, scale) if y.requires_grad else y
    if isinstance(y, tuple):
        for i, t in enumerate(y):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                return (*y[:i], AuxLossToBackward.apply(t, aux, scale), *y[i + 1 :])
    raise ValueError(
        "a pipeline stage with a differentiable aux loss must output a tensor that requires "
        "grad (or a tuple holding one), to carry the aux loss's gradient"
    )
