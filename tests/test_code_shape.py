"""The shape of the library's code, checked: short files, short functions, no branching on a
tier's class, and imports that go one way.

A file over 500 lines or a function over 60 does several jobs; an ``isinstance`` on a tier
class in the engine means the tier protocols miss a method, so a new tier would have to be
added in two places. Two modules that import each other (at the top, inside a function or
only for type checking: each is a dependency) cannot be understood, tested or changed apart;
the library stands in floors (``FLOORS``), each importing only from itself and those below.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = sorted(p for package in ("engine", "offload") for p in (ROOT / package).rglob("*.py"))
SHAPED = LIBRARY + sorted((ROOT / "benchmarks").rglob("*.py"))
"""What the length checks cover: the library and the benchmarks."""
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 500
TIER_CLASSES = {"StoreOptimizerState", "MemoryOptimizerState", "StoreParamTier", "MemoryParamTier", "ShardedParams"}
TIER_CLASSES |= {"ReplicatedParams"}
ALLOWED_TIER_CHECKS: set[tuple[str, str]] = set()
TIER_NAMES = {"device", "cpu", "nvme"}
TIER_NAME_HOMES = {"engine/build.py", "engine/config.py", "engine/config_sections.py", "engine/config_parse.py"}
"""Where a tier's name may decide something: the configuration, which names the tiers and says
what each implies, and the build, which makes each tier from its name."""


def functions(path: Path) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


@pytest.mark.parametrize("path", SHAPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_function_is_longer_than_60_lines(path: Path) -> None:
    long = [
        (f.name, f.end_lineno - f.lineno + 1)
        for f in functions(path)
        if f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"{path.relative_to(ROOT)}: functions over {MAX_FUNCTION_LINES} lines: {long}"


@pytest.mark.parametrize("path", SHAPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_file_is_longer_than_500_lines(path: Path) -> None:
    name = str(path.relative_to(ROOT))
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_FILE_LINES, f"{name}: {lines} lines, over {MAX_FILE_LINES}"


def names_in(node: ast.AST) -> set[str]:
    """The names ``node`` refers to, ``Class`` and ``module.Class`` alike."""
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }


def is_tier_check(node: ast.AST) -> bool:
    """Whether ``node`` asks an object's class about a tier class: ``isinstance(x, [module.]Class)``,
    or ``type(x) is Class`` (``==``, ``in`` and their negations too)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
        return bool(names_in(node.args[1]) & TIER_CLASSES)
    if isinstance(node, ast.Compare):
        sides = [node.left, *node.comparators]
        typed = any(isinstance(s, ast.Call) and isinstance(s.func, ast.Name) and s.func.id == "type" for s in sides)
        return typed and bool(set().union(*map(names_in, sides)) & TIER_CLASSES)
    return False


def tier_checks(path: Path) -> list[tuple[str, str]]:
    """``(file, function)`` of each check of an object's class against a tier class in ``path``."""
    return [
        (str(path.relative_to(ROOT)), function.name)
        for function in functions(path)
        for node in ast.walk(function)
        if is_tier_check(node)
    ]


def test_the_engine_does_not_branch_on_a_tier_class() -> None:
    found = {check for path in LIBRARY for check in tier_checks(path)}
    assert found <= ALLOWED_TIER_CHECKS, f"isinstance on a tier class: {sorted(found - ALLOWED_TIER_CHECKS)}"


def is_tier_name_branch(node: ast.AST) -> bool:
    """Whether ``node`` compares with a tier's name (``== "nvme"``, ``in ("cpu", "device")``); a
    torch device's ``.type``, which shares the name ``cpu``, is no tier."""
    if not isinstance(node, ast.Compare):
        return False
    sides = [node.left, *node.comparators]
    named = any({c.value for c in ast.walk(s) if isinstance(c, ast.Constant)} & TIER_NAMES for s in sides)
    return named and not any(isinstance(s, ast.Attribute) and s.attr == "type" for s in sides)


def test_nothing_but_the_config_and_the_build_branches_on_a_tier_name() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}"
        for path in LIBRARY
        if str(path.relative_to(ROOT)) not in TIER_NAME_HOMES
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
        if is_tier_name_branch(node)
    ]
    assert not found, "a branch on a tier's name: ask the tier, or a rule of the config\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("code", "branches"),
    [
        ("isinstance(tier, StoreParamTier)", True),
        ("isinstance(tier, parameters.StoreParamTier)", True),
        ("isinstance(tier, (int, tiers.MemoryParamTier))", True),
        ("type(tier) is ShardedParams", True),
        ("type(tier) == optimizer.MemoryOptimizerState", True),
        ("type(tier) in (ReplicatedParams, ShardedParams)", True),
        ("isinstance(tier, Fetch)", False),
        ("tier is ShardedParams", False),
    ],
)
def test_a_check_of_a_tier_class_is_seen_in_every_form(code: str, branches: bool) -> None:
    assert is_tier_check(ast.parse(code, mode="eval").body) is branches


@pytest.mark.parametrize(
    ("code", "branches"),
    [
        ('config.offload.optimizer == "nvme"', True),
        ('tier != "device"', True),
        ('offload.param in ("cpu", "device")', True),
        ('device.type == "cpu"', False),
        ('config.offload.optimizer == "fp32"', False),
    ],
)
def test_a_branch_on_a_tier_name_is_seen_in_every_form(code: str, branches: bool) -> None:
    assert is_tier_name_branch(ast.parse(code, mode="eval").body) is branches


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in LIBRARY}


def import_targets(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    """The dotted names an import statement in ``package`` reaches: ``from pkg import x`` reaches
    ``pkg.x`` when that is a module, else ``pkg``; relative forms resolved against ``package``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    parts = package.split(".")
    base = parts[: len(parts) - node.level + 1] if node.level else []
    source = ".".join([*base, *([node.module] if node.module else [])])
    return [f"{source}.{alias.name}" if f"{source}.{alias.name}" in MODULES else source for alias in node.names]


def imported_modules(name: str, path: Path) -> set[str]:
    """The library modules ``name`` imports anywhere: at module level, inside functions and under
    ``if TYPE_CHECKING:`` alike (each is a dependency, whenever it is taken)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        for target in import_targets(node, package):
            while target and target not in MODULES:  # ``import a.b.c``: the longest prefix that is a module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


IMPORTS = {name: imported_modules(name, path) for name, path in MODULES.items()}


def tangles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of ``graph`` with more than one node (Tarjan's algorithm),
    each sorted: every node of one reaches every other, so each lies on a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            part = []
            while not part or part[-1] != node:
                part.append(stack.pop())
            if len(part) > 1:
                found.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def shortest_cycle(graph: dict[str, set[str]], part: list[str]) -> list[str]:
    """The shortest cycle from ``part``'s first node back to it, inside ``part``."""
    start, inside = part[0], set(part)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node] & inside):
                if target == start:
                    return [*paths[node], start]
                if target not in paths:
                    paths[target] = [*paths[node], target]
                    following.append(target)
        frontier = following
    raise AssertionError(f"{part} is not strongly connected")


def describe_cycles(graph: dict[str, set[str]]) -> str:
    return "\n".join(
        f"{' -> '.join(shortest_cycle(graph, part))}  (a tangle of {len(part)}: {', '.join(part)})"
        for part in tangles(graph)
    )


def test_no_module_imports_itself_round_a_circle() -> None:
    cycles = describe_cycles(IMPORTS)
    assert not cycles, f"import cycles:\n{cycles}"


ENTRY_POINTS = {"engine.run.cli"}
"""The command line dispatches to ``engine.run`` and ``engine.tools`` alike, so it stands above
both, as a part of its own, though it lives in ``engine/run``."""


def part(module: str) -> str:
    """The part of the engine ``module`` belongs to: its subpackage (``engine.zero``), or the
    module itself for the engine's top-level modules and its entry points, each a part of its own."""
    return module if module in ENTRY_POINTS else ".".join(module.split(".")[:2])


def test_no_engine_package_imports_itself_round_a_circle() -> None:
    graph: dict[str, set[str]] = {}
    for module, targets in IMPORTS.items():
        if module.startswith("engine."):
            graph.setdefault(part(module), set()).update(
                part(t) for t in targets if t.startswith("engine.") and part(t) != part(module)
            )
    cycles = describe_cycles(graph)
    assert not cycles, f"cycles between the engine's packages:\n{cycles}"


FLOORS = [
    ("offload",),
    ("engine.config_parse", "engine.config_sections", "engine.config", "engine.config_docs"),
    ("engine.runtime",),
    ("engine.state",),
    ("engine.tiers",),
    ("engine.zero",),
    ("engine.build", "engine.engine"),
    ("engine.run",),
    ("engine.tools",),
    ("engine", "engine.__main__", *ENTRY_POINTS),
]
"""The floors of the library, lowest first: a module imports from its own floor and those below,
never from one above. ``offload`` moves bytes and knows no engine; every part reads the
configuration; ``runtime`` is the machine; ``state`` what a rank's training state is made of and
how it is laid out, which the ``tiers`` hold between uses and the ZeRO step (``zero``) updates,
driving the tiers; ``build`` and ``engine`` put an ``Engine`` together; ``run`` trains with one;
``tools`` work on what runs leave, with the models and data ``run`` defines."""


def floor(module: str) -> int:
    """The floor of ``module``: that of the longest name in ``FLOORS`` it is or lies under (the
    package ``engine`` itself only by its own name: its modules each have a floor)."""
    found = [
        (len(name), level)
        for level, names in enumerate(FLOORS)
        for name in names
        if module == name or (module.startswith(f"{name}.") and name != "engine")
    ]
    assert found, f"{module} is on no floor: add it to FLOORS"
    return max(found)[1]


def test_no_module_imports_from_a_floor_above_its_own() -> None:
    upward = sorted(
        f"{module} (floor {floor(module)}) imports {target} (floor {floor(target)})"
        for module, targets in IMPORTS.items()
        for target in targets
        if floor(target) > floor(module)
    )
    assert not upward, "imports from a floor above:\n" + "\n".join(upward)


def test_the_cycle_finder_names_each_tangle_by_its_shortest_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c", "a2"}, "c": {"a"}, "a2": {"b"}, "d": {"a"}, "e": set()}
    assert tangles(graph) == [["a", "a2", "b", "c"]]
    assert shortest_cycle(graph, ["a", "a2", "b", "c"]) == ["a", "b", "c", "a"]
    assert "a -> b -> c -> a  (a tangle of 4: a, a2, b, c)" in describe_cycles(graph)


def test_every_form_of_import_is_a_dependency(tmp_path: Path) -> None:
    source = tmp_path / "probe.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import step\n"
        "from ..config import Config\n"
        "import engine.tiers.optimizer\n"
        "if TYPE_CHECKING:\n"
        "    from engine.runtime.device import Device\n"
        "def later():\n"
        "    from engine.state import partition\n"
    )
    found = imported_modules("engine.zero.probe", source)
    assert found == {
        "engine.zero.step",
        "engine.config",
        "engine.tiers.optimizer",
        "engine.runtime.device",
        "engine.state.partition",
    }
