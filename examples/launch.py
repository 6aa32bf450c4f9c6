"""torchrun, minus torchrun's traceback: the same arguments, one error line, the rank's status.

    python -m examples.launch --nproc-per-node 2 examples/m6/train.py --ep 2
    python -m examples.launch --nproc-per-node 2 examples/hf/finetune.py --ep 2

When a rank exits non-zero, torchrun itself (its launcher process, not the example) raises
ChildFailedError and Python prints a ~30-line traceback and failure table after the rank's
own one-line `error: ...`, and torchrun exits 1 whatever the rank's status was. This runs
torch.distributed.run's own launcher in-process (every torchrun option works), silences its
log lines, and on a failed rank prints one line naming the first failing rank and exits with
that rank's status (128 + N for a rank killed by signal N), as a single process would. A bad
--nproc-per-node is one error line (exit status 2) before any rank starts; SIGTERM or SIGINT
to the launcher stops every rank and exits 128 + N with one line, no traceback.
"""

from __future__ import annotations

import logging
import os
import sys

MAX_RANKS_PER_NODE = 1024  # more processes than any node runs ranks: a typo, not a launch


def main(argv: list[str] | None = None) -> int:
    saved = os.environ.get("LOGLEVEL")
    os.environ["LOGLEVEL"] = "CRITICAL"  # the launcher's loggers take it when imported
    try:
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import determine_local_world_size, get_args_parser, run
    finally:  # the ranks keep the user's own setting
        if saved is None:
            os.environ.pop("LOGLEVEL", None)
        else:
            os.environ["LOGLEVEL"] = saved
    for name in list(logging.root.manager.loggerDict):  # torchrun's own log lines
        if name.startswith(("torch.distributed.elastic", "torch.distributed.run",
                            "torch.distributed.launcher")):  # fmt: skip
            logging.getLogger(name).setLevel(logging.CRITICAL)
    args = get_args_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        ranks = determine_local_world_size(args.nproc_per_node)
    except ValueError as e:  # not a number, nor auto / cpu / gpu; or no GPU for "gpu"
        ranks, why = None, f" ({e})"
    if ranks is None or not 1 <= ranks <= MAX_RANKS_PER_NODE:
        why = why if ranks is None else ""
        print(f"error: --nproc-per-node must be a number of ranks in [1, {MAX_RANKS_PER_NODE}] "
              f"or auto, cpu, gpu; got {args.nproc_per_node!r}{why}", file=sys.stderr)  # fmt: skip
        return 2
    try:
        run(args)
    except SignalException as e:  # the launcher was told to stop: torchrun stopped the ranks
        print(f"error: {args.training_script}: stopped by {e.sigval.name}; every rank was "
              "stopped", file=sys.stderr)  # fmt: skip
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        status = 128 - code if code < 0 else code
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        print(f"error: {e.name}: rank {rank} {how} (its error is above)", file=sys.stderr)
        return status or 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
