"""What the pipeline's fault handling assumes about PyTorch beyond its documented API, in one
place, with the version it was checked on: tests/test_pipeline_faults.py fails on any other
torch version, so each assumption is checked again before it is relied on.

- torch.distributed.pipelining wraps an exception of a stage's forward or backward in a
  RuntimeError raised from it, in its own files (stage.py, _backward.py): the original is
  its __cause__.
- gloo and NCCL report a failed transfer as a RuntimeError (or a DistError) whose text names
  the transport: a closed or reset connection, a timeout, NCCL.
- ProcessGroup.abort() ends a blocked wait on NCCL; on gloo it does nothing (a wait ends only at
  its timeout or its peer's closed connection).
- A gloo group opens its own listening socket and its TCP connections while dist.new_group runs
  (unless gloo's lazy init is on); shutting a connection down ends every wait on it, here and
  at the peer, with "Connection closed"; shutting the listener down aborts the process
  (moe.pipeline.groups).
- Two private torch APIs reached through shared helpers: a group's timeout read from
  ProcessGroup._get_backend(...).options._timeout (moe.comm.topology.group_timeout: the
  default step_timeout), and DeviceMesh._flatten (moe.parallel.mesh.mesh_group: the stages'
  dp x ep group).
"""

from __future__ import annotations

import torch.distributed as dist

CHECKED_ON = "2.13"

_PIPELINING_FILES = "torch/distributed/pipelining"
_COMM_MARKS = ("third_party/gloo", "Connection closed by peer", "Connection reset", "NCCL")
_TIMEOUT_PREFIX = "Timed out waiting"


def original_error(error: BaseException) -> BaseException:
    """The exception a stage raised, without PyTorch's pipelining wrappers ("failed to run
    forward", "Failed to run stage backward")."""
    while type(error) is RuntimeError and error.__cause__ is not None and _raised_in(error):
        error = error.__cause__
    return error


def _raised_in(error: BaseException) -> bool:
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and _PIPELINING_FILES in tb.tb_frame.f_code.co_filename.replace("\\", "/")


def is_communication_error(error: BaseException) -> bool:
    """A failed transfer (often the consequence of another rank's failure), not a cause."""
    if isinstance(error, dist.DistError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and (
        any(mark in text for mark in _COMM_MARKS) or text.startswith(_TIMEOUT_PREFIX)
    )


def can_abort(group: dist.ProcessGroup) -> bool:
    """Whether group.abort() ends this group's blocked waits (NCCL's communicator abort)."""
    return dist.get_backend(group) == "nccl"
