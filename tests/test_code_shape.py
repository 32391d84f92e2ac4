"""The shape of the library's code, checked: short files, short functions, and no branching on
a tier's class.

A file over 500 lines or a function over 60 does several jobs; an ``isinstance`` on a tier
class in the engine means the tier protocols miss a method, so a new tier would have to be
added in two places.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = sorted(p for package in ("engine", "offload") for p in (ROOT / package).rglob("*.py"))
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 500
TIER_CLASSES = {"StoreOptimizerState", "MemoryOptimizerState", "StoreParamTier", "MemoryParamTier", "ShardedParams"}
TIER_CLASSES |= {"ReplicatedParams"}
ALLOWED_TIER_CHECKS: set[tuple[str, str]] = set()


def functions(path: Path) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_function_is_longer_than_60_lines(path: Path) -> None:
    long = [
        (f.name, f.end_lineno - f.lineno + 1)
        for f in functions(path)
        if f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"{path.relative_to(ROOT)}: functions over {MAX_FUNCTION_LINES} lines: {long}"


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_file_is_longer_than_500_lines(path: Path) -> None:
    name = str(path.relative_to(ROOT))
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_FILE_LINES, f"{name}: {lines} lines, over {MAX_FILE_LINES}"


def tier_checks(path: Path) -> list[tuple[str, str]]:
    """``(file, function)`` of each ``isinstance(x, <tier class>)`` in ``path``."""
    found = []
    for function in functions(path):
        for node in ast.walk(function):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
                classes = node.args[1]
                names = {n.id for n in ast.walk(classes) if isinstance(n, ast.Name)}
                if names & TIER_CLASSES:
                    found.append((str(path.relative_to(ROOT)), function.name))
    return found


def test_the_engine_does_not_branch_on_a_tier_class() -> None:
    found = {check for path in LIBRARY for check in tier_checks(path)}
    assert found <= ALLOWED_TIER_CHECKS, f"isinstance on a tier class: {sorted(found - ALLOWED_TIER_CHECKS)}"
