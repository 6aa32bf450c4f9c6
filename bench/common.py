"""Shared benchmark helpers: timing, device naming, dated reports."""

import datetime
import os
import platform
import statistics
import time

import torch


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(fns: dict, iters: int, warmup: int, device: torch.device) -> dict:
    """Median seconds per call of each fn, calls interleaved round-robin so that drift in
    machine load affects every candidate alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def write_report(name: str, text: str, device: torch.device) -> str:
    """Write bench/results/<date>-<device>-<name>.md and return its path."""
    tag = "cpu" if device.type == "cpu" else torch.cuda.get_device_name(device).split()[-1].lower()
    path = os.path.join(
        os.path.dirname(__file__), "results", f"{datetime.date.today().isoformat()}-{tag}-{name}.md"
    )
    with open(path, "w") as f:
        f.write(text)
    return path


def gather_on_four_gloo_ranks(module: str, measure) -> list[torch.Tensor] | None:
    """Under `torchrun --nproc-per-node 4 -m bench.<module>`: init gloo, run measure() on every
    rank and all-gather its tensor; rank 0 gets the list by rank, the others None. The caller
    prints, then calls torch.distributed.destroy_process_group()."""
    import torch.distributed as dist

    if os.environ.get("WORLD_SIZE") != "4":
        raise SystemExit(f"run on 4 ranks: torchrun --nproc-per-node 4 -m bench.{module}")
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo")
    mine = measure()
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return every if dist.get_rank() == 0 else None


def wait_ranks(procs: list, wall_limit: float, what: str) -> None:
    """Wait for rank processes until `wall_limit` seconds in all; kill what is left; one
    RuntimeError naming the ranks that failed (rank, exit code)."""
    deadline = time.monotonic() + wall_limit
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    if bad:
        raise RuntimeError(f"{what} ranks failed (rank, exit code): {bad}")
