"""Overlapped expert-parallel dispatch: the exchange of one chunk of rows runs while the experts
compute another, in forward and in backward.

Chunks are groups of whole local experts: chunk c holds local experts [c*L//n, (c+1)*L//n) of
every rank. Why by expert rather than by row range:
  * exact: every expert sees all its rows in one expert call, as in the plain dispatcher, so
    outputs and every gradient are the same numbers (no weight gradient is split into partial
    sums over chunks, no GEMM is cut smaller);
  * cheap: a chunk of one expert computes with that expert's slice of the weights (no work or
    memory for the others); a larger chunk computes with all L and zero rows elsewhere, so
    each expert takes the kernel path it takes in the plain dispatcher's call (equal groups
    run as one bmm there: a subset of experts could be equal where all are not). Either way
    the chunks' weight gradients are put together by copying slices, never accumulated;
  * free to agree on: the boundaries depend only on L and n, and the per-chunk split sizes
    come from the per-expert counts that the one count exchange already delivers;
  * the send buffer is still one gather: rows are gathered from the tokens in (chunk,
    destination, expert) order, so each chunk is one contiguous slice.
The price: n <= L (a larger n is clamped), and a chunk's size follows its experts' load.

The experts module is called once per layer call (`ExpertFn.call_once`), and the pipeline runs
inside that call as one autograd node (`_Experts`): FSDP2 gathers and reduces the weights
once, and per chunk there is no module call, hook or gradient accumulation (their host cost
was what the pipeline added on a CPU). Each chunk's expert MLP is a small autograd graph of
its own (landed rows and the weights as leaves), run backward chunk by chunk. Outputs and
every gradient equal the plain dispatcher's bit for bit.

Forward, per layer call: one count exchange (with extra columns: the requested degree,
checked equal on every rank, each rank's measured expert time per row, its row total and its
measured layer times, so overlap="auto" chooses the same degree everywhere without another
collective); then every chunk's dispatch is started (async, `_StartDispatch`), the shared
experts run while the first is in flight, and for each chunk in turn: wait for its rows,
compute its experts, start its combine. Backward: every chunk's combine gradient is started at
once, then for each chunk in that order: wait, expert backward, start its dispatch gradient,
which travels while the next chunk's expert backward (and at the end the shared experts'
backward) runs; `_StartDispatch`'s backward lands them.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace

import torch
import torch.distributed as dist

from moe.comm.alltoall import cost_model
from moe.comm.exchange_config import ExchangeConfig
from moe.comm.expert_exchange import ExpertExchange
from moe.comm.topology import get_topology
from moe.dispatch.dispatcher import DispatchContext, ExpertFn, register_dispatcher, rows_only
from moe.dispatch.expert_parallel import KEPT_ROWS, ExpertParallelDispatcher, receive_order
from moe.dispatch.overlap_clock import ExpertClock, ForwardTimes
from moe.dispatch.overlap_degree import MAX_DEGREE, choose_degree
from moe.dispatch.overlap_exchange import Landing, Worker, start_exchange
from moe.dispatch.overlap_option import validate_overlap
from moe.dispatch.permute import (
    RowMap,
    gather_tokens,
    permute_rows,
    weighted_sum_rows,
)
from moe.dispatch.wire import PLAIN_WIRE, RowFormat, RowWire
from moe.kernels.expert_weights import ExpertWeights
from moe.kernels.saved_tensors import keep_graph

# columns riding on the count exchange (the row totals always do): degree asked, expert ps
# per row, and the measured forward us of this layer plain (n = 1) and pipelined (n > 1),
# 0 = not measured yet
PROBE_EVERY = 16  # "auto" re-measures the option it is not using every this many calls


@register_dispatcher("overlap")
class OverlappedDispatcher(ExpertParallelDispatcher):
    """Expert-parallel dispatch pipelined over `degree` chunks of local experts (an int >= 1
    or "auto": from moe.comm's cost model and the measured expert time, kept only while the
    layer is measured faster pipelined than plain (CPU); 1 without a cost model, e.g. gloo
    without MOE_A2A_COST_PROFILE). `dispatch` / `combine` called directly behave as the plain
    dispatcher; MoELayer calls `run`, which overlaps."""

    overlaps = True

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_local_experts: int,
        algorithm: str = "auto",
        ranks_per_node: int | None = None,
        degree: int | str = "auto",
        exchange_config: ExchangeConfig | None = None,
        wire: RowWire = PLAIN_WIRE,
    ):
        super().__init__(group, num_local_experts, algorithm, ranks_per_node, exchange_config, wire)
        if validate_overlap(degree) is None:
            raise ValueError("degree must be an int >= 1 or 'auto', got None")
        self.degree = degree
        self.clock = ExpertClock()
        self.worker = Worker(self.exchange_config)
        self.last_degree = 1
        self.calls = 0
        self.times = ForwardTimes()  # this layer's forward, plain and pipelined

    def _count_exchange(self, x_TD: torch.Tensor, plan: RowMap) -> ExpertExchange:
        """The one count collective, with the extra columns every rank needs to agree on the
        degree (moe.comm.exchange_expert_counts)."""
        asked = 0 if self.degree == "auto" else int(self.degree)
        ps_per_row = int(self.clock.seconds_per_row * 1e12)
        plain_us, piped_us = (int(self.times.fastest(k) * 1e6) for k in (False, True))
        extra = torch.tensor(
            [asked, ps_per_row, plain_us, piped_us], dtype=torch.long, device=x_TD.device
        )
        return self._exchange_counts(x_TD, plan, extra)

    def _choose(self, counts: ExpertExchange, topo) -> int:
        """The degree from what every rank received: identical everywhere."""
        extras = counts.extras_W
        asked = {int(e[0]) for e in extras}
        if len(asked) > 1:
            seen = ", ".join(f"rank {s} has {e[0] or 'auto'}" for s, e in enumerate(extras))
            raise ValueError(f"overlap degree differs across ranks: {seen}")
        rows = counts.totals_W
        L = self.num_local
        if self.degree != "auto":
            return max(1, min(int(self.degree), L))
        expert_s = max(int(e[1]) for e in extras) * 1e-12 * sum(rows) / len(rows)
        n = choose_degree(
            cost_model(dist.get_backend(self.group), self.exchange_config),
            counts.max_rank_bytes,
            topo.num_nodes,
            topo.ranks_per_node,
            expert_s,
            min(L, MAX_DEGREE),
            hierarchical=counts.algorithm == "hierarchical",
        )
        return self._verified(n, extras)

    def _verified(self, n: int, extras) -> int:
        """The model's degree only while pipelining is measured faster than plain (the slowest
        rank's fastest recent forward time of this layer, each; ForwardTimes): first the two
        alternate until each has EXPLORE kept times on every rank, then the faster one runs,
        and every PROBE_EVERY calls the other is measured again. A pure function of shared
        values and call counts: all ranks agree."""
        if n == 1:
            return 1
        plain = max(int(e[2]) for e in extras) if all(e[2] for e in extras) else 0
        piped = max(int(e[3]) for e in extras) if all(e[3] for e in extras) else 0
        if self.times.exploring() or not plain or not piped:
            return n if self.times.next_to_explore() else 1
        faster = n if piped < plain else 1
        probe = self.calls % PROBE_EVERY == 0
        return (1 if faster == n else n) if probe else faster

    def run(self, x_TD, plan, experts, shared=None):
        experts = rows_only(experts)
        began = self.times.start(x_TD)
        self.calls += 1
        L = self.num_local
        self._check_rows(plan)  # before any collective
        topo = get_topology(self.group, self.ranks_per_node, self.exchange_config)
        counts = self._count_exchange(x_TD, plan)
        n = self._choose(counts, topo)
        self.last_degree = n
        bounds = [c * L // n for c in range(n + 1)]
        kept = sum(map(sum, counts.send_WL))
        plan_c, order = plan, chunk_order(plan, bounds, L, kept) if n > 1 else None
        if order is None:
            x_MD = gather_tokens(x_TD, plan)
        elif plan.pair_rows_TK is not None:  # token choice: gather straight into chunk order
            plan_c, order = reordered(plan, *order), None
            x_MD = gather_tokens(x_TD, plan_c)
        else:  # expert choice adds a token's rows in row order (forward and backward): keep
            # the plain order and permute only the rows that travel (same sums, bit for bit)
            x_MD = permute_rows(gather_tokens(x_TD, plan), *order)
        pipe = _Pipeline(
            [counts.splits(b0, b1) for b0, b1 in zip(bounds, bounds[1:])],
            bounds,
            counts.recv_counts_WL,
            DispatchContext(plan_c, KEPT_ROWS, algorithm=counts.algorithm, kernel=experts.kernel),
            self,
        )
        token = _StartDispatch.apply(x_MD[:kept], pipe)
        shared_TD = None if shared is None else shared()  # while the first chunk travels
        dropped = plan.num_rows - kept

        def compute(token, weights: ExpertWeights | None):
            tensors = () if weights is None else weights.tensors()
            return _Experts.apply(token, pipe, experts, dropped, weights, *tensors)

        out_MD = experts.call_once(token, compute)  # one experts module call: FSDP2 gathers once
        if order is not None:
            out_MD = permute_rows(out_MD, order[1], order[0])
        y_TD = weighted_sum_rows(out_MD, plan_c, experts.kernel)
        self.times.stop(began, n > 1)
        return y_TD, shared_TD


class _Pipeline:
    """One layer call's chunks, shared by its forward and backward: the dispatch plan of each
    chunk (its combine is the reverse), the local expert bounds, the received counts, the
    experts' context, and the exchanges in flight."""

    def __init__(self, plans, bounds, recv_WL, context, dispatcher: OverlappedDispatcher):
        self.plans, self.bounds, self.recv_WL, self.context = plans, bounds, recv_WL, context
        self.recv_L = recv_WL.sum(0)  # rows this rank computes per local expert
        self.backs = [p.reverse() for p in plans]
        self.worker, self.clock = dispatcher.worker, dispatcher.clock
        self.wire = dispatcher.wire  # each direction's row format
        self.arriving: list[Landing] = []  # forward: chunks' rows; backward: their gradients

    def start_all(self, x_MD, fmt: RowFormat) -> list[Landing]:
        """Start each chunk's exchange along its dispatch plan: x_MD is this rank's kept rows
        in chunk order (dispatch; in backward, the combine's gradient), sent in `fmt`."""
        chunks = torch.split(x_MD, [sum(p.send) for p in self.plans])
        return [self._send(x, p, fmt) for x, p in zip(chunks, self.plans)]

    def start_one(self, c: int, x_RD, fmt: RowFormat) -> Landing:
        """Start chunk c's exchange of x_RD back to the rows' ranks (combine; in backward, the
        dispatch's gradient), sent in `fmt`."""
        return self._send(x_RD, self.backs[c], fmt)

    def _send(self, x_ND, plan, fmt: RowFormat) -> Landing:
        """The rows encoded in fmt, exchanged, decoded to x's dtype on landing."""
        D, dtype = x_ND.shape[1], x_ND.dtype
        land = start_exchange(fmt.encode(x_ND), plan, self.worker)
        return lambda: fmt.decode(land(), D, dtype)

    def compute(self, c: int, recv_RD, experts: ExpertFn, weights, needs_grad):
        """Chunk c's experts on its received rows ((source, expert)-major -> expert-major and
        back, as the plain dispatcher), as an autograd graph of its own when `needs_grad`:
        (rows leaf, weight leaves [lo:hi], out_RD, lo). weights: the layer's ExpertWeights
        (None: experts without weights of their own)."""
        b0, b1 = self.bounds[c], self.bounds[c + 1]
        L = self.recv_WL.shape[1]
        device = recv_RD.device
        in_chunk_L = torch.zeros(L, dtype=torch.bool, device=device)
        in_chunk_L[b0:b1] = True
        offsets_L = torch.cumsum(torch.where(in_chunk_L, self.recv_L, 0), 0)
        offsets_L = offsets_L.to(torch.int32)
        order = None  # one expert: its rows are already expert-major
        if b1 - b0 > 1:
            order = receive_order(self.recv_WL[:, b0:b1], b0, recv_RD.shape[0])
        lo, hi = (b0, b1) if b1 - b0 == 1 else (0, L)  # the weights this chunk uses
        part = None if weights is None else weights.slice(lo, hi - lo)
        with torch.enable_grad() if any(needs_grad) else nullcontext():
            rows_RD = recv_RD.detach().requires_grad_(needs_grad[0])
            leaves = tuple(
                None if w is None else w.detach().requires_grad_(g)
                for w, g in zip(() if part is None else part.tensors(), needs_grad[1:])
            )
            x_RD = rows_RD if order is None else permute_rows(rows_RD, *order)
            start = self.clock.start(x_RD)
            # without weights (a plain function of the rows) `part` computes all experts
            part = None if part is None else part.with_tensors(leaves)
            out_RD = experts.part(x_RD, offsets_L, self.context, part, lo)
            self.clock.stop(start, x_RD.shape[0])
            if order is not None:
                out_RD = permute_rows(out_RD, order[1], order[0])
        return rows_RD, leaves, out_RD, lo


class _StartDispatch(torch.autograd.Function):
    """Starts every chunk's dispatch; returns a 0-d token for `_Experts`. Backward lands the
    chunks' gradients, whose exchanges `_Experts.backward` started."""

    @staticmethod
    def forward(ctx, x_MD, pipe: _Pipeline):
        ctx.set_materialize_grads(False)
        ctx.pipe = pipe
        pipe.arriving = pipe.start_all(x_MD, pipe.wire.dispatch_format)
        return x_MD.new_zeros(())

    @staticmethod
    def backward(ctx, _token):
        arriving, ctx.pipe.arriving = ctx.pipe.arriving, []
        return torch.cat([land() for land in arriving]), None


class _Experts(torch.autograd.Function):
    """Forward: per chunk, land its rows, compute its experts, start its combine; returns the
    rows that came back (and `dropped` zero rows: the plan's tail). Backward: start every
    chunk's combine gradient, then per chunk in the same order (the first sent arrives
    first): land it, run the chunk's graph backward (its experts' slice of each weight
    gradient), start its dispatch gradient."""

    @staticmethod
    def forward(ctx, token, pipe: _Pipeline, experts: ExpertFn, dropped: int, like, *weights):
        needs_grad = (ctx.needs_input_grad[0], *ctx.needs_input_grad[5:])
        ctx.pipe, ctx.graphs, ctx.weights, ctx.dropped = pipe, [], weights, dropped
        arriving, pipe.arriving = pipe.arriving, []
        returning = []
        for c, land in enumerate(arriving):
            graph = pipe.compute(c, land(), experts, like, needs_grad)
            if any(needs_grad):
                ctx.graphs.append(graph)
            returning.append(pipe.start_one(c, graph[2].detach(), pipe.wire.combine_format))
        rows = [land() for land in returning]
        return torch.cat([*rows, rows[0].new_zeros(dropped, rows[0].shape[1])])

    @staticmethod
    def backward(ctx, grad_MD):
        pipe = ctx.pipe
        coming = pipe.start_all(
            grad_MD[: grad_MD.shape[0] - ctx.dropped], pipe.wire.combine_grad_format
        )
        grads: list = [None] * len(ctx.weights)
        arriving: list[Landing | None] = [None] * len(coming)
        for c in range(len(coming)):  # in the order the gradients were sent
            rows_RD, leaves, out_RD, lo = ctx.graphs[c]
            g_RD = coming[c]()
            if out_RD.requires_grad:
                torch.autograd.backward(out_RD, g_RD, retain_graph=keep_graph())
            b0, b1 = pipe.bounds[c], pipe.bounds[c + 1]
            for i, leaf in enumerate(leaves):  # chunk c's experts' slice of each gradient
                if leaf is None or not leaf.requires_grad:
                    continue
                g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                if grads[i] is None:  # a full-width leaf's gradient is the buffer itself
                    full = g.shape == ctx.weights[i].shape
                    grads[i] = g if full else g.new_empty(ctx.weights[i].shape)
                if grads[i] is not g:
                    grads[i][b0:b1] = g[b0 - lo : b1 - lo]
                leaf.grad = None
            dx_RD = rows_RD.grad if rows_RD.grad is not None else torch.zeros_like(rows_RD)
            rows_RD.grad = None
            arriving[c] = pipe.start_one(c, dx_RD, pipe.wire.dispatch_grad_format)
        if not keep_graph():
            ctx.graphs = []
        pipe.arriving = arriving
        return None, None, None, None, None, *grads


def chunk_order(
    plan: RowMap, bounds: list[int], L: int, kept: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(perm_M, inverse_M): the plan's kept rows reordered (chunk, destination rank, local
    expert), row m of the new order being row perm_M[m] of `plan`; within an expert the order
    is kept, dropped rows stay at the tail."""
    E = plan.counts_E.numel()
    device = plan.counts_E.device
    chunk_L = torch.zeros(L, dtype=torch.long, device=device)
    for c, (b0, b1) in enumerate(zip(bounds, bounds[1:])):
        chunk_L[b0:b1] = c
    expert_M = torch.repeat_interleave(
        torch.arange(E, device=device), plan.counts_E, output_size=kept
    )
    key_M = chunk_L[expert_M % L] * E + expert_M
    perm_M = torch.cat(
        [torch.argsort(key_M, stable=True), torch.arange(kept, plan.num_rows, device=device)]
    )
    inverse_M = torch.empty_like(perm_M)
    inverse_M[perm_M] = torch.arange(plan.num_rows, device=device)
    return perm_M, inverse_M


def reordered(plan: RowMap, perm_M: torch.Tensor, inverse_M: torch.Tensor) -> RowMap:
    """A token-choice plan whose rows come in the order perm_M (chunk_order)."""
    return replace(
        plan, token_ids_M=plan.token_ids_M[perm_M], pair_rows_TK=inverse_M[plan.pair_rows_TK]
    )
