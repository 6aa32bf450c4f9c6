"""Expert-parallel exchange inside an MoELayer: send each kept row to the rank holding its
expert, run the local experts, send the outputs back."""

import torch
import torch.distributed as dist

from moe.comm.alltoall import AllToAllPlan, exchange, plan_all_to_all
from moe.comm.topology import get_topology
from moe.dispatch.permute import DispatchPlan, gather_tokens


class _Permute(torch.autograd.Function):
    """y = x[order]; backward is the inverse permutation (a gather, no scatter-add)."""

    @staticmethod
    def forward(ctx, x_ND, order_N, inverse_N):
        ctx.save_for_backward(inverse_N)
        return x_ND.index_select(0, order_N)

    @staticmethod
    def backward(ctx, dy_ND):
        (inverse_N,) = ctx.saved_tensors
        return dy_ND.index_select(0, inverse_N), None, None


def _permute(x_ND, order_N, inverse_N):
    return _Permute.apply(x_ND, order_N, inverse_N)


class ExpertExchange:
    """Installed as `MoELayer.exchange` by parallelize(). Every rank of the EP group calls it
    once per forward (also with zero tokens), so the collectives always match."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_local_experts: int,
        algorithm: str = "auto",
        ranks_per_node: int | None = None,
    ):
        self.group, self.num_local = group, num_local_experts
        self.ep_size = dist.get_world_size(group)
        self.algorithm, self.ranks_per_node = algorithm, ranks_per_node
        self._multi_node: bool | None = None
        self.last_algorithm = "flat"  # resolved algorithm of the latest call (layer.stats)

    def _flat(self) -> bool:
        """Flat unless asked otherwise and the EP group spans nodes (topology detected once)."""
        if self.algorithm == "flat":
            return True
        if self._multi_node is None:
            self._multi_node = get_topology(self.group, self.ranks_per_node).is_multi_node
        return not self._multi_node

    def __call__(self, x_TD: torch.Tensor, plan: DispatchPlan, experts) -> torch.Tensor:
        P, E_l = self.ep_size, self.num_local
        counts_PE = plan.counts_E.view(P, E_l)
        # One small collective: how many rows each source sends to each of my local experts.
        recv_counts_PE = torch.empty_like(counts_PE)
        dist.all_to_all_single(recv_counts_PE, counts_PE.contiguous(), group=self.group)
        x_MD = gather_tokens(x_TD, plan)
        send_P, recv_P = counts_PE.sum(1), recv_counts_PE.sum(1)
        send, recv = torch.stack([send_P, recv_P]).tolist()  # the host read a2a sizes need
        x_kept_D = x_MD[: sum(send)]
        if self._flat():  # the per-expert counts above already give both row totals
            a2a = AllToAllPlan("flat", self.group, tuple(send), tuple(recv), recv_P)
        else:  # hierarchical needs the W x W matrix: plan_all_to_all gathers it
            a2a = plan_all_to_all(x_kept_D, send, self.group, self.algorithm, self.ranks_per_node)
        self.last_algorithm = a2a.algorithm
        recv_RD = exchange(x_kept_D, a2a)
        # Received rows are (source, local expert)-major; the experts want expert-major.
        expert_R = torch.repeat_interleave(
            torch.arange(E_l, device=x_TD.device).repeat(P),
            recv_counts_PE.reshape(-1),
            output_size=recv_RD.shape[0],
        )
        order_R = torch.argsort(expert_R, stable=True)
        inverse_R = torch.empty_like(order_R)
        inverse_R[order_R] = torch.arange(order_R.shape[0], device=order_R.device)
        offsets_E = torch.cumsum(recv_counts_PE.sum(0), 0).to(torch.int32)
        out_RD = _permute(
            experts(_permute(recv_RD, order_R, inverse_R), offsets_E), inverse_R, order_R
        )
        out_kept_D = exchange(out_RD.contiguous(), a2a.reverse())
        tail = out_kept_D.new_zeros(x_MD.shape[0] - x_kept_D.shape[0], out_kept_D.shape[1])
        return torch.cat([out_kept_D, tail])
