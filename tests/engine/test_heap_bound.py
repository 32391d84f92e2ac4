"""The bound on what the heap keeps of freed memory (``engine.runtime.heap_bound``): freed
buffers stay resident for reuse until the resident set has grown by ``keep``, then go back.
What the heap does is the process's, so each such check runs in a fresh process."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.engine import Engine
from engine.runtime import heap_bound
from engine.runtime.heap_bound import KEEP_LIMIT, KEEP_MIN, KEEP_UNITS, HeapBound, keep_bytes
from engine.tools.estimate import estimate, plan_of, run_shape
from tests.training import config, tiny_gpt

MIB = 1 << 20

FREED = """
import ctypes, json, sys, time
from engine.runtime import heap_bound
from engine.runtime.heap import tune_heap
heap_bound.REFRESH_S = 0.5
assert tune_heap()
bound = heap_bound._process_bound
if sys.argv[1] == "by hand":
    bound.close()  # this process calls check itself
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
size = 8 << 20  # under the mmap threshold: from the heap
blocks = [libc.malloc(size) for _ in range(64)]
for block in blocks:
    ctypes.memset(block, 1, size)
live = heap_bound.resident_bytes()
for block in blocks[:-1]:  # holes below the last block, which the heap cannot give back by itself
    libc.free(block)
freed = heap_bound.resident_bytes()
if sys.argv[1] == "by hand":
    trimmed = bound.check()
else:
    deadline = time.monotonic() + 5
    while heap_bound.resident_bytes() > live - (256 << 20) and time.monotonic() < deadline:
        time.sleep(0.01)
    trimmed = bound.trims > 0
print(json.dumps({"live": live, "freed": freed, "after": heap_bound.resident_bytes(), "trimmed": trimmed,
                  "again": bound.check(), "keep": bound.keep}))
"""


def freed_run(mode: str) -> dict:
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run(
        [sys.executable, "-c", FREED, mode], env=env, capture_output=True, text=True, check=True, timeout=120
    ).stdout
    return json.loads(out.splitlines()[-1])


@pytest.mark.parametrize("mode", ["by hand", "on its thread"])
def test_freed_heap_memory_stays_until_the_bound_hands_it_back(mode) -> None:
    run = freed_run(mode)
    assert run["keep"] == KEEP_MIN  # no model yet
    # Only with no thread running can nothing trim between the frees and the reading after them.
    assert mode != "by hand" or run["freed"] > run["live"] - 64 * MIB, "the heap keeps what it was given back"
    assert run["trimmed"] and run["after"] < run["live"] - 400 * MIB, run  # 504 MiB freed
    assert mode != "by hand" or not run["again"], "no trim again right after one"


def test_the_keep_follows_the_largest_unit_within_its_limits() -> None:
    assert keep_bytes(0) == KEEP_MIN
    assert keep_bytes(100 * MIB) == KEEP_UNITS * 100 * MIB
    assert keep_bytes(1 << 40) == KEEP_LIMIT


def test_an_engine_widens_the_process_bound_to_its_model_and_the_estimate_counts_it(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(heap_bound, "KEEP_MIN", 0)  # the tiny model's keep is its own, not the floor
    bound = HeapBound(0)  # not started: this test reads its keep
    monkeypatch.setattr(heap_bound, "_process_bound", bound)
    cfg = config(zero={"stage": 3}, offload={"optimizer": "cpu", "nvme_path": str(tmp_path)})
    Engine(tiny_gpt(), cfg).close()
    run = run_shape(cfg, 1, model=tiny_gpt())
    largest = run.layout.largest_unit_numel * 4  # fp32
    assert bound.keep == KEEP_UNITS * largest
    heap_bound.keep_for(0)
    assert bound.keep == KEEP_UNITS * largest, "a smaller model never narrows the bound"
    terms = estimate(run, plan_of(cfg), baseline_bytes=0, device_is_host=True).terms
    assert terms["heap retention"] == KEEP_UNITS * largest


def test_a_forked_child_has_a_bound_of_its_own() -> None:
    script = """
import os
from engine.runtime import heap_bound
from engine.runtime.heap import tune_heap
assert tune_heap()
parent = heap_bound._process_bound
pid = os.fork()
if pid == 0:
    child = heap_bound._process_bound
    os._exit(0 if child is not parent and child._thread.is_alive() else 1)
_, status = os.waitpid(pid, 0)
raise SystemExit(os.waitstatus_to_exitcode(status))
"""
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    assert subprocess.run([sys.executable, "-c", script], env=env, timeout=60).returncode == 0
