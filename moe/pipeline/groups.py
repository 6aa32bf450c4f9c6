"""The pipeline's own process groups: every group a step communicates over is created by the
pipeline, with step_timeout, so a step's waits are bounded without touching any other group
of the process, and a failure can end this process's waits on them at once (close()).

Per rank: an agreement group over every rank (gloo), one group per slice of each mesh dim
("pp": the pipeline's P2P group; "dp"; "ep"), a DeviceMesh over them with the user's mesh's
layout and dim names (the stages are parallelized over its ("dp", "ep") slice), and that
slice's flattened group.

gloo cannot abort a blocked wait on PyTorch 2.13 (ProcessGroup.abort() and shutdown() leave it
blocked, moe.pipeline.torch_internals); a wait ends when its connection closes. So the
connections each gloo group opens in this process are recorded as it is created (the TCP
sockets that appear meanwhile; Linux's /proc/self/fd; the group's listening socket left out:
gloo aborts the process when it fails), and close() shuts them down: every wait on them ends
with "Connection closed", here and on the peer. Without /proc, or with gloo's lazy connections,
nothing is recorded and a wait ends at its timeout. NCCL groups are aborted instead.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from moe.parallel.mesh import mesh_group
from moe.pipeline.mesh import MESH_DIMS
from moe.pipeline.torch_internals import can_abort

_FDS = "/proc/self/fd"


class PipelineGroups:
    """The groups of one Pipeline, created collectively (every rank, the same order)."""

    def __init__(self, mesh: DeviceMesh, timeout: datetime.timedelta):
        self.timeout = timeout
        self._sockets: list[tuple[int, str]] = []  # (fd, its socket's inode)
        rank = dist.get_rank()
        self.agreement = self._new(None, backend="gloo")
        layout = mesh.mesh
        mine = []
        for dim in range(layout.dim()):
            for ranks in layout.movedim(dim, -1).reshape(-1, layout.shape[dim]).tolist():
                group = self._new(ranks)
                if rank in ranks:
                    mine.append((group, ranks))
        self.pp_group, self.pipeline_ranks = mine[0]  # the P2P group, in stage order
        self.mesh = DeviceMesh.from_group(
            [group for group, _ in mine], mesh.device_type, mesh=layout, mesh_dim_names=MESH_DIMS
        )
        with self._recording():  # the ("dp", "ep") slices' flattened groups, made by torch
            flat = mesh_group(self.mesh["dp", "ep"])
        flat.set_timeout(timeout)
        groups = [self.agreement, *(group for group, _ in mine), flat]
        self._abortable = [g for g in groups if can_abort(g)]

    def _new(self, ranks: list[int] | None, backend: str | None = None) -> dist.ProcessGroup:
        with self._recording():
            return dist.new_group(ranks, timeout=self.timeout, backend=backend, sort_ranks=False)

    @contextlib.contextmanager
    def _recording(self):
        before = _sockets()
        yield
        for fd, inode in _sockets().items():
            if fd not in before and _connected_tcp(fd):
                self._sockets.append((fd, inode))

    def close(self) -> None:
        """Ends every wait on these groups, in this process and at its peers: NCCL's abort,
        gloo's connections shut down. The groups cannot be used after."""
        for group in self._abortable:
            with contextlib.suppress(Exception):
                group.abort()
        now = _sockets()
        for fd, inode in self._sockets:
            if now.get(fd) == inode:  # still the socket recorded (not a reused fd number)
                with contextlib.suppress(OSError), socket.socket(fileno=os.dup(fd)) as s:
                    s.shutdown(socket.SHUT_RDWR)
        self._sockets = []


def _sockets() -> dict[int, str]:
    """This process's sockets: fd -> inode ("socket:[...]"); empty without /proc."""
    found = {}
    with contextlib.suppress(OSError):
        for name in os.listdir(_FDS):
            with contextlib.suppress(OSError):
                target = os.readlink(f"{_FDS}/{name}")
                if target.startswith("socket:"):
                    found[int(name)] = target
    return found


def _connected_tcp(fd: int) -> bool:
    """A TCP socket that is not listening (shutting down gloo's listener aborts the process)."""
    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            return (
                s.family in (socket.AF_INET, socket.AF_INET6)
                and s.type == socket.SOCK_STREAM
                and not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
            )
    except OSError:
        return False
