"""Start the ranks of one contestant as one process group and watch it from outside.

Each contestant gets fresh processes: no system can leave threads, caches, hooks or
a process group behind for the next one, and one that crashes, hangs or is killed
takes only itself down. The ranks join an env:// rendezvous as torchrun would set
it up, without torchrun's agent, whose own memory would count in the peak.

Memory is measured here, from outside, the same way for every system: the resident
memory of every process of the group (ranks, and any child they start) summed at
each sample, and its peak. Disk usage of a folder is sampled alongside.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

RSS_INTERVAL_S = 0.1
DISK_INTERVAL_S = 0.5  # a walk of the folder costs more than a look at a few processes
KILL_GRACE_S = 5.0


@dataclass
class GroupResult:
    """How the ranks ended, and what they held at their peak."""

    returncodes: list[int | None]
    """Per rank; None for a rank killed because of a timeout or another rank's failure."""
    peak_rss_bytes: int
    peak_disk_bytes: int
    wall_s: float
    timed_out: bool

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(code == 0 for code in self.returncodes)

    def first_failure(self) -> int | None:
        """The lowest rank that failed by its own hand (a non-zero exit), if any."""
        return next((rank for rank, code in enumerate(self.returncodes) if code not in (0, None)), None)


def free_port() -> int:
    """A port free now, for the rendezvous (another process could take it before rank 0 does;
    on one machine that is rare enough to leave to a rerun)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_rss_bytes(pids: Sequence[int]) -> int:
    """Resident bytes of these processes and all their descendants, now."""
    total = 0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            processes = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for process in processes:
            try:
                total += process.memory_info().rss
            except psutil.NoSuchProcess:  # exited (or a zombie) between the listing and the look
                continue
    return total


def allocated_bytes(folder: Path) -> int:
    """Bytes the files under `folder` occupy on disk (allocated blocks, so sparse files count
    what they use). Files may come and go during the walk: those are skipped."""
    total = 0
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return 0
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                total += allocated_bytes(Path(entry.path))
            elif entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_blocks * 512
        except FileNotFoundError:
            continue
    return total


def _kill_group(pgid: int, processes: Sequence[subprocess.Popen]) -> None:
    """SIGTERM the group, then SIGKILL whatever is left after a grace period."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + KILL_GRACE_S
        while time.monotonic() < deadline and any(p.poll() is None for p in processes):
            time.sleep(0.1)


def _start_ranks(
    processes: list[subprocess.Popen],
    argv: Sequence[str],
    world_size: int,
    cwd: Path,
    env: Mapping[str, str],
    log_dir: Path,
    hosts: int = 1,
) -> None:
    """Start the ranks into `processes`, one by one, so that the caller can end those started
    if a later one fails to start. Rank 0 leads a new process group and the others join it:
    until it is reaped, even an exited leader keeps its group alive, so joining cannot race
    rank 0's exit. With `hosts` the ranks are told, as torchrun would tell them, that they run
    on that many hosts (`GROUP_RANK`); they still share this machine's cores as one host's do."""
    port = free_port()
    per_host = world_size // hosts
    for rank in range(world_size):
        rank_env = {
            **env,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank % per_host),
            "GROUP_RANK": str(rank // per_host),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        group = 0 if rank == 0 else processes[0].pid
        with open(log_dir / f"rank{rank}.log", "wb") as log:
            processes.append(
                subprocess.Popen(
                    list(argv), cwd=cwd, env=rank_env, stdout=log, stderr=subprocess.STDOUT, process_group=group
                )
            )


def _watch(processes: list[subprocess.Popen], timeout_s: float, watch: Path | None) -> GroupResult:
    """Sample memory (and disk) until every rank has exited; end the group at the first
    failure or at the timeout, since the other ranks would wait for it in a collective forever."""
    start = time.perf_counter()
    pids = [p.pid for p in processes]
    peak_rss = peak_disk = 0
    next_disk = 0.0
    timed_out = False
    killed_at: list[int | None] | None = None  # the exit codes when the group was killed
    while None in (codes := [p.poll() for p in processes]):
        now = time.perf_counter()
        peak_rss = max(peak_rss, tree_rss_bytes(pids))
        if watch is not None and now >= next_disk:
            peak_disk = max(peak_disk, allocated_bytes(watch))
            next_disk = now + DISK_INTERVAL_S
        failed = any(code not in (None, 0) for code in codes)
        if failed or now - start > timeout_s:
            timed_out = not failed
            killed_at = codes
            _kill_group(pids[0], processes)
            break
        time.sleep(RSS_INTERVAL_S)
    wall = time.perf_counter() - start
    if watch is not None:
        peak_disk = max(peak_disk, allocated_bytes(watch))
    for p in processes:
        p.wait()
    # A rank ended by our kill did not fail by itself: it reports None, not the signal.
    codes = killed_at if killed_at is not None else [p.returncode for p in processes]
    return GroupResult(codes, peak_rss, peak_disk, wall, timed_out)


def run_ranks(
    argv: Sequence[str],
    world_size: int,
    *,
    cwd: Path,
    env: Mapping[str, str],
    timeout_s: float,
    log_dir: Path,
    watch: Path | None = None,
    hosts: int = 1,
) -> GroupResult:
    """Run `argv` as ranks 0..world_size-1 of an env:// group in a new process group, each
    rank's output in `log_dir/rank<r>.log`, sampling the disk usage of `watch` if given,
    the ranks spread over `hosts` simulated hosts.

    The ranks are not in the caller's process group, so a Ctrl-C does not reach them:
    whatever interrupts the caller ends them here.
    """
    processes: list[subprocess.Popen] = []
    try:
        _start_ranks(processes, argv, world_size, cwd, env, log_dir, hosts)
        return _watch(processes, timeout_s, watch)
    except BaseException:
        if processes:
            _kill_group(processes[0].pid, processes)
        raise


def run_one(argv: Sequence[str], *, cwd: Path, env: Mapping[str, str], timeout_s: float, log: Path) -> int | None:
    """Run a single helper process in a process group of its own to completion; its exit code,
    or None after a timeout. Like the ranks, it is ended if the caller is interrupted."""
    with open(log, "wb") as out:
        process = subprocess.Popen(
            list(argv), cwd=cwd, env=dict(env), stdout=out, stderr=subprocess.STDOUT, process_group=0
        )
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None
    finally:
        if process.poll() is None:
            _kill_group(process.pid, [process])
            process.wait()


def python_module(module: str, *args: str) -> list[str]:
    """The command that runs `python -m module args` with this interpreter."""
    return [sys.executable, "-m", module, *args]
