"""The configuration reference, read from the docstrings of ``engine.config``'s dataclasses.

``reference`` is the one source: ``markdown`` renders it as ``docs/configuration.md`` and
``help_text`` as the key list of ``python -m engine train --help``, so the two cannot drift
from the code or from each other (``tests/test_docs.py`` regenerates the file and compares).
Regenerate the file with ``python -m engine.config_docs > docs/configuration.md``.

A field's docstring is the string literal right after it, which Python keeps nowhere at run
time: it is read from the module's source. Its first paragraph is the one-line summary.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import re
import sys
import textwrap
import typing
from dataclasses import dataclass

from engine.config import Config
from engine.config_parse import toml_value

SHORTHANDS = {"seed": ("train.seed", "data.seed")}
"""Command-line flags that set several keys at once: ``--seed N`` seeds the weights and the batch order."""


@dataclass(frozen=True)
class Key:
    """One config key: its name, its default as TOML writes it, and its documentation."""

    name: str
    default: str
    summary: str
    detail: str


@dataclass(frozen=True)
class Section:
    """One section of the config file (``[zero]``), its documentation and its keys."""

    name: str
    summary: str
    detail: str
    keys: tuple[Key, ...]


def reference() -> list[Section]:
    """Every section of ``Config`` and every key in it, in the order of the source, each with its
    default and documentation; a key without a docstring has an empty summary (the docs test
    refuses that)."""
    sections, classes = [], typing.get_type_hints(Config)
    for section in dataclasses.fields(Config):
        cls = classes[section.name]
        docs = _field_docs(cls)
        defaults = cls()
        keys = tuple(
            Key(key.name, toml_value(getattr(defaults, key.name)), *_split(docs.get(key.name, "")))
            for key in dataclasses.fields(cls)
        )
        sections.append(Section(section.name, *_split(inspect.getdoc(cls) or ""), keys))
    return sections


def _field_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}`` of a dataclass: each string literal right after an annotated field."""
    source = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = source.body[0].body  # type: ignore[attr-defined]  # the class statement's
    docs = {}
    for statement, after in itertools.pairwise(body):
        documented = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name) and documented:
            docs[statement.target.id] = inspect.cleandoc(after.value.value)  # type: ignore[attr-defined]
    return docs


def _split(doc: str) -> tuple[str, str]:
    """A docstring's first paragraph and the rest, each joined into one line."""
    summary, _, detail = doc.partition("\n\n")
    return " ".join(summary.split()), " ".join(detail.split())


def flag(section: str, key: str) -> str:
    """The command-line spelling of a key: kebab-case, like every flag (``--optim.grad-clip``)."""
    return f"--{section}.{key}".replace("_", "-")


INTRO = """\
# Configuration reference

<!-- Generated from the docstrings in engine/config_sections.py by
     `python -m engine.config_docs > docs/configuration.md`: edit those, then regenerate. -->

A run is configured by a file and by flags; every key is optional. The file is TOML, JSON
or YAML, told by its extension (`.toml`, `.json`, `.yaml` or `.yml`; any other is refused),
with one table per section:

```toml
[zero]
stage = 3
[offload]
optimizer = "nvme"
param = "nvme"
nvme_path = "/mnt/nvme/run1"
[optim]
lr = 1e-4
```

On the command line, `--section.key value` (or `--section.key=value`) overrides the file,
and `--key value` does too where no other section has that key: `--steps 3`, `--lr 1e-3`.
Flags are spelled in kebab-case, `--optim.grad-clip 0.5`, `--seq-len 512`; the snake_case
of the file (`--seq_len`) is also accepted, with a deprecation warning. Values are read as
TOML (`3`, `1e-3`, `true`, `["q_proj", "v_proj"]`), else taken as a string; a list of strings
may be given comma-separated (`--lora.target-modules q_proj,v_proj`).
{shorthands} `--print-config` prints the configuration a command would run
with, as a TOML file, and exits. A bad key or value stops the run before any work, naming
the key and the fix. In Python: `Config.load(path, ["optim.lr=1e-3"])` or `Config.from_dict(tables)`.
"""


def _shorthands() -> str:
    return " ".join(
        f"`--{name} N` sets {' and '.join(f'`{key}`' for key in keys)}." for name, keys in SHORTHANDS.items()
    )


def _cell(text: str) -> str:
    """Text for one cell of a Markdown table: single backticks, no column breaks."""
    return text.replace("``", "`").replace("|", "\\|")


def markdown(sections: list[Section]) -> str:
    """``docs/configuration.md``: the introduction, then a table of keys for each section."""
    parts = [INTRO.format(shorthands=_shorthands())]
    for section in sections:
        parts.append(f"\n## `[{section.name}]`\n\n{_cell(' '.join((section.summary, section.detail)).strip())}\n")
        parts.append("\n| key | default | meaning |\n|---|---|---|\n")
        for key in section.keys:
            meaning = " ".join((key.summary, key.detail)).strip()
            parts.append(f"| `{key.name}` | `{_cell(key.default)}` | {_cell(meaning)} |\n")
    return "".join(parts)


def help_text(sections: list[Section], width: int = 100) -> str:
    """The config keys of ``train --help``, by section: each flag with its default, and its summary."""

    def plain(text: str) -> str:  # a terminal shows no markup
        return re.sub(r"``(.*?)``", r"\1", text)

    lines = [
        "config keys: --section.key VALUE, or --key VALUE where no other section has the key;",
        "in a config file: [section] then key = value (docs/configuration.md has each key's details)",
        *(f"  --{name} N: sets {' and '.join(keys)}" for name, keys in SHORTHANDS.items()),
    ]
    for section in sections:
        lines.append(f"\n[{section.name}] {plain(section.summary)}")
        for key in section.keys:
            lines.append(f"  {flag(section.name, key.name)} (default {key.default})")
            lines.extend(textwrap.wrap(plain(key.summary), width, initial_indent=" " * 6, subsequent_indent=" " * 6))
    return "\n".join(lines)


if __name__ == "__main__":  # python -m engine.config_docs > docs/configuration.md
    sys.stdout.write(markdown(reference()))
