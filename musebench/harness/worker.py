"""One rank of a process-launched run: `python -m musebench.harness.worker SPEC RESULTS`.

Started by torchrun (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT set): reads the job
spec the launcher wrote (`launch.spec_to_json`) and runs this rank's part through the one driver
(`driver.run_rank`); rank 0 appends one JSON line per case to RESULTS. Progress lines ("rank R
started/done case N") go to stdout for the launcher's diagnostics.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path


def main(argv: Sequence[str]) -> int:
    from musebench.harness.driver import run_rank
    from musebench.harness.launch import spec_from_json

    spec, results = argv
    job = spec_from_json(json.loads(Path(spec).read_text()))
    run_rank(job.cases, job.options, Path(results), measurement=job.measurement, bench=job.bench)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
