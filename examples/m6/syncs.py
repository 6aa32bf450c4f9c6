"""Host syncs of the training loop, counted by CUDA itself (--count-syncs).

torch.cuda.set_sync_debug_mode("warn") makes every operation that blocks the host on the device
(.item(), .cpu(), nonzero, a synchronizing copy) raise a warning; the warnings are counted, not
shown. CPU runs have nothing to count (count is None)."""

import warnings

import torch

SYNC_WARNING = "synchronizing"  # in the text of the warning CUDA's sync debug mode raises


class SyncCounter:
    """Context manager: `count` is the number of host syncs inside it (None when not counting)."""

    def __init__(self, enabled: bool, device: torch.device):
        self.active = enabled and device.type == "cuda"
        self.count: int | None = None
        self._catch = warnings.catch_warnings(record=True)
        self._records: list = []

    def __enter__(self):
        if self.active:
            self._records = self._catch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if self.active:
            torch.cuda.set_sync_debug_mode("default")
            self._catch.__exit__(*exc)
            self.count = sum(SYNC_WARNING in str(w.message) for w in self._records)
