"""The processes and mailboxes a launcher job leaves on this host (its id is in every path and command line),
and the ports and spawned ranks the multi-process tests start."""

from __future__ import annotations

import os
from collections.abc import Callable
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


def free_port_pair() -> int:
    """A port whose successor is free too (the rendezvous and the launchers' store)."""
    import socket

    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            if port >= 65534:
                continue
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free port pair")


def spawned_ranks(target: Callable, count: int, args_of: Callable, timeout_s: float = 90.0) -> list:
    """Run `count` spawned processes `target(*args_of(rank, port, answers))` on one free port pair
    and return the `count` items they put on the `answers` queue, in arrival order (queue.Empty
    after `timeout_s` without one: a rank that hangs fails the test); every process is joined,
    and killed if it is still alive 10 s after the answers."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    answers = context.Queue()
    port = free_port_pair()
    ranks = [context.Process(target=target, args=args_of(rank, port, answers)) for rank in range(count)]
    for process in ranks:
        process.start()
    try:
        return [answers.get(timeout=timeout_s) for _ in ranks]
    finally:
        for process in ranks:
            process.join(10)
            if process.is_alive():
                process.kill()
