"""The processes and mailboxes a launcher job leaves on this host (its id is in every path and command line)."""

from __future__ import annotations

import os
from pathlib import Path


def job_processes(job: str) -> list[str]:
    """`pid command line` of every live process whose command line names the job's folder.

    Read from /proc, whole: `ps` cuts command lines to the width of its terminal (80 columns under
    pytest), before the job folder of a rank's command line.
    """
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if f"musebench-{job}" in command:
            found.append(f"{entry.name} {command}")
    return found


def job_mailboxes(job: str) -> list[str]:
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"musebench-{job}-")]
