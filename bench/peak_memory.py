"""Peak memory of one forward+backward on the CPU, measured in a fresh process.

torch's CPU allocator keeps no statistics, so the probe reads the kernel's peak resident set
size: the child process sets MALLOC_MMAP_THRESHOLD_ so every tensor-sized block is its own
mmap (returned to the system when freed), builds the module and inputs, resets the peak
(`echo 5 > /proc/self/clear_refs`), runs forward+backward once after a warm-up, and reports
VmHWM - VmRSS before the step: the bytes the step added at its peak (activations, gradients,
workspace), the same quantity for every candidate.
"""

import json
import os
import subprocess
import sys


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure_here(step, reset) -> int:
    """In the child: bytes added at the peak of `step()` (called once before, as warm-up);
    `reset()` frees what a step leaves behind (gradients), so they count in the peak."""
    import gc

    step()
    reset()
    gc.collect()
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    step()
    return _status("VmHWM") - before


def measure(module: str, *args: str) -> int | None:
    """Run `python -m module --memory-probe args...` (e.g. "bench.moe_layer", from the
    repository root) in a fresh process; its last stdout line is the JSON {"peak_bytes": n}.
    None if the probe failed (the reason is printed)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    proc = subprocess.run(
        [sys.executable, "-m", module, "--memory-probe", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode != 0:
        print(f"memory probe {args} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak_bytes"]
