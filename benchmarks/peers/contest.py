"""Run one contestant in a folder of its own and make its record: the step times and losses its
ranks report, the memory and disk sampled from outside, or why it was skipped.

`benchmarks.peers.compare` runs contestants side by side at the peers' size,
`benchmarks.peers.at_scale` at giant's; both record each the same way here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.peers.launch import GroupResult, python_module, run_one, run_ranks
from benchmarks.peers.rank import RankSpec, result_path, threads_per_rank
from benchmarks.peers.trainers import ENVIRONMENT, PREPARE, REQUIRES
from benchmarks.peers.workload import Contestant, Workload

RANK_MODULE = "benchmarks.peers.rank"
INSTALL = 'DS_BUILD_OPS=0 pip install --no-build-isolation -e ".[peers]"'
REPO = Path(__file__).resolve().parents[2]
LOG_TAIL_LINES = 20


def rank_env(contestant: Contestant, workload: Workload) -> dict[str, str]:
    """This environment, plus the rank's share of the cores, the repository on the path (the benchmarks
    are not installed) and what the system itself needs."""
    path = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {
        **os.environ,
        "OMP_NUM_THREADS": str(threads_per_rank(workload.world_size)),
        "PYTHONPATH": os.pathsep.join(path),
        **ENVIRONMENT.get(contestant.system, {}),
    }


def log_tail(log: Path) -> list[str]:
    try:
        return log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
    except FileNotFoundError:
        return []


def _meaningful(line: str) -> bool:
    """Not blank, not indented (a warning's code line, a traceback's frames) and not a warning."""
    return bool(line.strip()) and not line[0].isspace() and "Warning: " not in line and "[WARNING]" not in line


def rank_error(work: Path, rank: int, code: int | None) -> str:
    """Why a rank stopped: the error it recorded, else the signal that ended it (SIGKILL, when
    memory ran out, is the kernel's OOM killer's) or its exit code, and its last line of output
    that is not a warning or the code line a warning prints under it."""
    try:
        return json.loads(result_path(work, rank).read_text())["error"]
    except (FileNotFoundError, KeyError, json.JSONDecodeError):
        lines = [line for line in log_tail(work / f"rank{rank}.log") if _meaningful(line)]
        how = (
            f"was killed by {signal.Signals(-code).name}"
            if code is not None and code < 0
            else f"exited with code {code}"
        )
        return f"rank {rank} {how}: {lines[-1] if lines else 'no output'}"


def skipped(record: dict[str, Any], reason: str, log: Path | None = None) -> dict[str, Any]:
    record.update(status="skipped", reason=reason)
    if log is not None:
        record["log_tail"] = log_tail(log)
    return record


def run_contestant(
    contestant: Contestant, workload: Workload, work: Path, timeout_s: float, prepare_timeout_s: float
) -> dict[str, Any]:
    """Run one contestant in `work` (its spec, logs, rank results and NVMe files); its record."""
    record: dict[str, Any] = {"label": contestant.label, **contestant.to_dict(), "placement": contestant.placement}
    module = REQUIRES.get(contestant.system)
    if module is not None and importlib.util.find_spec(module) is None:
        return skipped(record, f"{module} is not installed: {INSTALL}")
    nvme = work / "nvme"
    spec_path = work / "spec.json"
    RankSpec(workload, contestant, nvme, work).write(spec_path)
    env = rank_env(contestant, workload)
    if contestant.system in PREPARE:
        started = time.perf_counter()
        log = work / "prepare.log"
        command = python_module(RANK_MODULE, "--prepare", str(spec_path))
        code = run_one(command, cwd=work, env=env, timeout_s=prepare_timeout_s, log=log)
        if code != 0:
            why = f"timed out after {prepare_timeout_s:.0f} s" if code is None else f"exit code {code}"
            return skipped(record, f"preparing {contestant.system} failed ({why})", log)
        record["prepare_s"] = time.perf_counter() - started
    group = run_ranks(
        python_module(RANK_MODULE, str(spec_path)),
        workload.world_size,
        cwd=work,
        env=env,
        timeout_s=timeout_s,
        log_dir=work,
        watch=nvme if contestant.uses_nvme else None,
    )
    if not group.ok:
        return skipped(record, *group_failure(work, group, timeout_s))
    ranks = [json.loads(result_path(work, rank).read_text()) for rank in range(workload.world_size)]
    record["params"] = ranks[0]["params"]
    ran(
        record,
        workload,
        group,
        steps_s=[max(times) for times in zip(*(r["step_s"] for r in ranks), strict=True)],
        losses=[statistics.fmean(losses) for losses in zip(*(r["losses"] for r in ranks), strict=True)],
        setup_s=max(r["setup_s"] for r in ranks),
        rank_max_rss_bytes=[r["max_rss_bytes"] for r in ranks],
    )
    if contestant.uses_nvme:
        record["disk_bytes"] = group.peak_disk_bytes
    return record


def group_failure(work: Path, group: GroupResult, timeout_s: float) -> tuple[str, Path]:
    """Why a contestant's ranks did not finish, and the log that shows it."""
    failed = group.first_failure()
    if failed is None:
        return f"timed out after {timeout_s:.0f} s", work / "rank0.log"
    return rank_error(work, failed, group.returncodes[failed]), work / f"rank{failed}.log"


def ran(
    record: dict[str, Any],
    workload: Workload,
    group: GroupResult,
    *,
    steps_s: list[float],
    losses: list[float],
    setup_s: float,
    rank_max_rss_bytes: list[int],
) -> None:
    """Make ``record`` that of a contestant that ran: every step's seconds and loss, the median
    step after the warm-up, and the memory its ranks held."""
    median = statistics.median(steps_s[workload.warmup :])
    record.update(
        status="ok",
        step_s=median,
        steps_s=steps_s,
        tokens_per_s=workload.tokens_per_step / median,
        setup_s=setup_s,
        losses=losses,
        peak_rss_bytes=group.peak_rss_bytes,
        rank_max_rss_bytes=rank_max_rss_bytes,
        wall_s=group.wall_s,
    )


def merge_rounds(rounds: Sequence[dict[str, Any]], workload: Workload) -> dict[str, Any]:
    """One contestant's records from several rounds as one: its step time the median of every
    round's timed steps, its memory and disk the largest any round saw. A round that failed
    stands for all of them."""
    failed = next((r for r in rounds if r["status"] != "ok"), None)
    if failed is not None or len(rounds) == 1:
        return failed or rounds[0]
    step_s = statistics.median(s for r in rounds for s in r["steps_s"][workload.warmup :])
    merged = dict(rounds[0])
    merged.update(
        step_s=step_s,
        round_step_s=[r["step_s"] for r in rounds],
        tokens_per_s=workload.tokens_per_step / step_s,
        setup_s=statistics.median(r["setup_s"] for r in rounds),
        peak_rss_bytes=max(r["peak_rss_bytes"] for r in rounds),
        wall_s=sum(r["wall_s"] for r in rounds),
    )
    if "disk_bytes" in merged:
        merged["disk_bytes"] = max(r["disk_bytes"] for r in rounds)
    return merged


Runner = Callable[[Path], dict[str, Any]]
"""Runs one contestant in the folder it is given (removed afterwards) and returns its record."""


def run_rounds(
    runners: Sequence[tuple[str, Runner]], workload: Workload, rounds: int, root: Path
) -> list[dict[str, Any]]:
    """Every contestant in turn, ``rounds`` times over, each in a fresh folder under ``root``:
    one record each, its rounds merged."""
    runs: list[list[dict[str, Any]]] = [[] for _ in runners]
    root.mkdir(parents=True, exist_ok=True)
    for round_index in range(rounds):
        for (label, runner), kept in zip(runners, runs, strict=True):
            print(f"round {round_index + 1} of {rounds}: running {label} ...", flush=True)
            with tempfile.TemporaryDirectory(prefix="bench-peers-", dir=root) as work:
                record = runner(Path(work))
            kept.append(record)
            ran = record["status"] == "ok"
            print(f"  {1000 * record['step_s']:.0f} ms/step" if ran else f"  skipped: {record['reason']}", flush=True)
    return [merge_rounds(kept, workload) for kept in runs]
