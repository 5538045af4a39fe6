"""The stray-process check of every launcher test can fail: it sees a job's whole command lines."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

from tests._processes import job_processes


def test_a_process_naming_the_job_folder_far_into_its_command_line_is_found():
    job = "t" + uuid.uuid4().hex[:11]
    padding = "/" + "p" * 200  # the job folder past any terminal's width
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", padding,
                                f"/tmp/musebench-{job}-abc/spec.json"])
    try:
        deadline = time.monotonic() + 30
        found = job_processes(job)
        while not found and time.monotonic() < deadline:  # the child's command line is set at its exec
            time.sleep(0.05)
            found = job_processes(job)
        assert len(found) == 1 and found[0].startswith(f"{sleeper.pid} ")
    finally:
        sleeper.kill()
        sleeper.wait()
    assert job_processes(job) == []
