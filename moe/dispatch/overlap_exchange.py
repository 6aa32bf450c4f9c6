"""Exchanges that run in the background while the experts compute: `start_exchange` starts one
and returns the function that lands it (moe.dispatch.overlapped calls them in forward and
backward).

Flat: one `all_to_all_single(async_op=True)`. On NCCL that already runs on the communicator's
own stream, ordered after the producer by an event, and `work.wait()` makes the current stream
wait on its completion event: no host sync. On gloo it runs on gloo's worker threads.
Hierarchical: the two-stage exchange of moe.comm (`AllToAllSplits.run`) runs on one worker
thread per dispatcher; a single FIFO thread keeps the order of collectives the same on every
rank. On CUDA that thread runs on a dedicated stream with events
(ExchangeConfig.overlap_cuda_stream; off by default and not run on a GPU yet); without it a CUDA hierarchical exchange runs at
launch, in order, and simply does not overlap. Reviewed without a GPU: the side stream waits
for x's producer (event recorded at submit), x is recorded on the side stream and y on the
consumer's, the consumer waits by event, and the host waits only for the worker thread to
have enqueued (AllToAllSplits.reverse needs no host-to-device copy since it carries device send
counts). Open risk to check on a GPU: the worker's NCCL collectives on the 2D subgroups can be
in flight while the main thread launches FSDP collectives on other communicators, in an order
that may differ across ranks; NCCL can deadlock on that.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from moe.comm.alltoall import AllToAllSplits, alone
from moe.comm.exchange_config import ExchangeConfig, overlap_cuda_stream

Landing = Callable[[], torch.Tensor]


class Worker:
    """One background thread (created on first use) that runs hierarchical exchanges in the
    order they were submitted; `exchange_config` says whether a CUDA one runs on a side stream."""

    def __init__(self, exchange_config: ExchangeConfig | None = None) -> None:
        self.exchange_config = exchange_config
        self._pool: ThreadPoolExecutor | None = None
        self._stream = None

    def submit(self, plan: AllToAllSplits, x_ND: torch.Tensor) -> Landing:
        if x_ND.is_cuda and not overlap_cuda_stream(self.exchange_config):
            y_ND = plan.run(x_ND)  # guarded: no side stream, no overlap
            return lambda: y_ND
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="moe-overlap")
        if not x_ND.is_cuda:
            future = self._pool.submit(_run_no_grad, plan, x_ND)
            return future.result
        return self._submit_cuda(plan, x_ND)

    def _submit_cuda(self, plan: AllToAllSplits, x_ND: torch.Tensor) -> Landing:
        """The exchange on a side stream: it waits for x's producer by an event, and the
        consumer's stream waits for its end by an event; the host only waits for the worker
        thread to have enqueued the work (no device sync)."""
        device = x_ND.device
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        stream, ready = self._stream, torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))

        def job():
            with torch.no_grad(), torch.cuda.device(device), torch.cuda.stream(stream):
                stream.wait_event(ready)
                x_ND.record_stream(stream)  # x's memory stays ours until the exchange ends
                y_ND = plan.run(x_ND)
                done = torch.cuda.Event()
                done.record(stream)
            return y_ND, done

        future = self._pool.submit(job)

        def land() -> torch.Tensor:
            y_ND, done = future.result()
            current = torch.cuda.current_stream(device)
            current.wait_event(done)
            y_ND.record_stream(current)
            return y_ND

        return land


def _run_no_grad(plan: AllToAllSplits, x_ND: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():  # grad mode is per thread: the caller's autograd Function owns it
        return plan.run(x_ND)


def start_exchange(x_ND: torch.Tensor, plan: AllToAllSplits, worker: Worker) -> Landing:
    """Start exchanging x_ND's rows by `plan`; the returned function waits and gives y."""
    x_ND = x_ND.contiguous()
    if alone(plan.group):
        y_ND = x_ND.clone()
        return lambda: y_ND
    if plan.algorithm != "flat":
        return worker.submit(plan, x_ND)
    y_ND = x_ND.new_empty((sum(plan.recv), x_ND.shape[1]))
    work = dist.all_to_all_single(
        y_ND, x_ND, list(plan.recv), list(plan.send), group=plan.group, async_op=True
    )

    def land() -> torch.Tensor:
        work.wait()
        return y_ND

    return land
