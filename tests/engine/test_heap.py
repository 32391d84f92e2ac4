"""The console command's heap settings (``engine.runtime.heap``), each in a fresh process:
they are the process's, and torch reads its huge-page switch once, at its first allocation."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")

PROBE = """
import json, os, sys
from engine.runtime.heap import tune_heap
before = os.environ.get("THP_MEM_ALLOC_ENABLE")
glibc = tune_heap()
import torch
x = torch.ones(64 << 18)  # 64 MiB, written
huge = sum(int(line.split()[1]) for line in open("/proc/self/smaps") if line.startswith("AnonHugePages:"))
print(json.dumps({"before": before, "after": os.environ.get("THP_MEM_ALLOC_ENABLE"), "glibc": glibc, "huge_kib": huge}))
"""


def probe(env: dict[str, str]) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True, timeout=120
    ).stdout
    return json.loads(out.splitlines()[-1])


def env_with(extra: dict[str, str]) -> dict[str, str]:
    """This environment without torch's huge-page switch, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    return env | extra


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="the kernel has no transparent huge pages")
def test_large_tensors_come_in_huge_pages():
    result = probe(env_with({}))
    assert result["before"] is None and result["after"] == "1"
    assert result["glibc"] is True
    assert result["huge_kib"] >= 32 << 10, result  # most of the 64 MiB tensor in 2 MiB pages


def test_an_explicit_setting_is_kept():
    result = probe(env_with({"THP_MEM_ALLOC_ENABLE": "0"}))
    assert result["after"] == "0"
    assert result["huge_kib"] < 32 << 10, result
