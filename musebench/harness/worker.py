"""One rank of a process-launched run: `python -m musebench.harness.worker SPEC RESULTS`.

Started by torchrun (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT set):
reads the launch's spec (`launch.spec_to_json`, or `{"runs": [...]}` for several runs of one
launch) and runs this rank's part of each run, in order, through the one driver
(`driver.run_rank`), over one process group; rank 0 (and the lowest rank of every other node)
appends one JSON line per row to RESULTS. Progress lines ("rank R started/done case N") go to
stdout for the launcher's diagnostics.

The rank ends with its torchrun (PR_SET_PDEATHSIG: `nodes.die_with_parent`). An exception that
escapes the driver (its cases' errors never do) is printed; a collective's failure (a peer on
another node went away: `collective_failed`) ends the rank with `nodes.COLLECTIVE_FAILED_EXIT`,
which the launchers take for a consequence whose cause is elsewhere, any other error with
RANK_FAILED_EXIT (1: this rank is the cause); a refusal (every rank alike) exits 2.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path


RANK_FAILED_EXIT = 1  # this rank's own error: the cause, named by its launcher at once


def collective_failed(error: BaseException) -> bool:
    """Whether `error` is a collective's failure (torch.distributed's DistError, or gloo's
    RuntimeError raised out of a collective of torch.distributed's c10d module: a peer went away
    or timed out), as opposed to this rank's own error (a bad value, an allocation, a CUDA error
    outside a collective), which its launcher must name as the cause instead of waiting for one
    elsewhere."""
    import torch.distributed as dist

    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    if not isinstance(error, RuntimeError):
        return False
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and frames[-1].filename.replace("\\", "/").endswith("torch/distributed/distributed_c10d.py")


def main(argv: Sequence[str]) -> int:
    import datetime

    import torch.distributed as dist

    from musebench.harness.driver import process_group_timeout_s, run_rank
    from musebench.harness.launch import specs_from_json
    from musebench.harness.nodes import COLLECTIVE_FAILED_EXIT, die_with_parent

    die_with_parent()
    spec, results = argv
    runs = specs_from_json(json.loads(Path(spec).read_text()))
    try:
        if len(runs) > 1:  # one process group for every run (run_rank uses it, and makes its groups)
            world = int(os.environ["WORLD_SIZE"])
            timeout = max(process_group_timeout_s(run.options, run.bench if run.measurement == "bench" else None,
                                                  groups=world // run.cases[0].tp) for run in runs)
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
        for run in runs:
            run_rank(run.cases, run.options, Path(results), measurement=run.measurement, bench=run.bench)
    except SystemExit:
        raise
    except Exception as error:
        traceback.print_exc()
        if collective_failed(error):
            print(f"musebench: a collective of the job failed (exit {COLLECTIVE_FAILED_EXIT}): a peer went away?",
                  file=sys.stderr, flush=True)
            return COLLECTIVE_FAILED_EXIT
        print(f"musebench: this rank failed (exit {RANK_FAILED_EXIT}): {type(error).__name__}: {error}",
              file=sys.stderr, flush=True)
        return RANK_FAILED_EXIT
    finally:
        if len(runs) > 1 and dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
