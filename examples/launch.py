"""torchrun, minus torchrun's traceback: the same arguments, one error line, the rank's status.

    python -m examples.launch --nproc-per-node 2 examples/m6/train.py --ep 2
    python -m examples.launch --nproc-per-node 2 examples/hf/finetune.py --ep 2

When a rank exits non-zero, torchrun itself (its launcher process, not the example) raises
ChildFailedError and Python prints a ~30-line traceback and failure table after the rank's
own one-line `error: ...`, and torchrun exits 1 whatever the rank's status was. This runs
torch.distributed.run's own launcher in-process (every torchrun option works), silences its
log lines, and on a failed rank prints one line naming the first failing rank and exits with
that rank's status (128 + N for a rank killed by signal N), as a single process would.
"""

from __future__ import annotations

import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    saved = os.environ.get("LOGLEVEL")
    os.environ["LOGLEVEL"] = "CRITICAL"  # the launcher's loggers take it when imported
    try:
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import get_args_parser, run
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
        run(args)
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
