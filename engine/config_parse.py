"""Reading a config file's tables into the typed dataclasses of ``engine.config``: unknown keys
refused with the closest known one, every value checked against its field's type (an int where
a float is expected is accepted), ``key=value`` overrides parsed as TOML values; and writing a
configuration back as TOML, the form ``--print-config`` shows and a file takes."""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

FORMATS = (".toml", ".json", ".yaml", ".yml")
"""The extensions of the config files read, each by its own parser."""


class ConfigError(ValueError):
    """A configuration value that cannot run; the message names the key and the fix."""


def read_file(path: Path) -> dict[str, Any]:
    """The tables of a config file, parsed as its extension says: TOML, JSON or YAML. Any other
    extension is refused by name rather than guessed at, since a wrong guess reports a syntax
    error that hides the real mistake."""
    if path.suffix not in FORMATS:
        raise ConfigError(
            f"config file {path} has the extension {path.suffix or '(none)'!r}, which is not a config format: "
            f"name it {', '.join(FORMATS[:-1])} or {FORMATS[-1]}"
        )
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    text = path.read_text()
    kind = path.suffix[1:].upper().replace("YML", "YAML")
    try:
        raw = tomllib.loads(text) if kind == "TOML" else json.loads(text) if kind == "JSON" else _yaml(text)
    except ValueError as err:  # each parser's syntax error is one (_yaml's included)
        raise ConfigError(f"config file {path} is not valid {kind}: {err}") from err
    if not isinstance(raw, dict):
        raise ConfigError(
            f"config file {path} holds a {type(raw).__name__}, not a table of sections: write [section] keys"
        )
    return raw


def _yaml(text: str) -> Any:
    """YAML, with ``1e-3`` read as the number it reads as in TOML and JSON (YAML 1.1, PyYAML's,
    needs a dot and a signed exponent, ``1.0e-3``, and would give a string); an empty file is no
    section. A YAML syntax error comes back as a ValueError."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    exponent = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", exponent, list("-+0123456789"))
    try:
        return yaml.load(text, Loader=Loader) or {}  # Loader is a SafeLoader: no Python objects
    except yaml.YAMLError as err:
        raise ValueError(str(err)) from err


def to_toml(tables: dict[str, dict[str, Any]]) -> str:
    """Sections of keys (as ``Config.to_dict`` gives them) as a TOML file that reads back to them."""
    return "\n".join(
        f"[{name}]\n" + "".join(f"{key} = {toml_value(value)}\n" for key, value in table.items())
        for name, table in tables.items()
    )


def toml_value(value: Any) -> str:
    """One value as TOML writes it: a float keeps its exponent (``1e-08``), a string its escapes."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"{value!r}: no TOML form for {type(value).__name__}")


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _did_you_mean(name: str, options: list[str]) -> str:
    close = difflib.get_close_matches(name, options, n=1)
    return f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(sorted(options))})"


def parse_override(item: str, root: type) -> tuple[str, str, Any]:
    """``section.key=value`` or ``key=value`` (key unique across the sections of ``root``) ->
    (section, key, value).

    The value is parsed as TOML when it can be (numbers, booleans, arrays), else kept as a string;
    a string for a list-of-strings key is split at commas (``--lora.target_modules q_proj,v_proj``),
    the form a shell passes without quoting.
    """
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key=value (e.g. optim.lr=1e-3)")
    dotted, text = item.split("=", 1)
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    sections = _hints(root)
    if "." in dotted:
        section, key = dotted.split(".", 1)
        if section not in sections:
            raise ConfigError(
                f"unknown config section {section!r} in {item!r}" + _did_you_mean(section, list(sections))
            )
        return section, key, _split_list(value, _hints(sections[section]).get(key))
    owners = [s for s, cls in sections.items() if dotted in _hints(cls)]
    if len(owners) == 1:
        return owners[0], dotted, _split_list(value, _hints(sections[owners[0]])[dotted])
    if owners:
        raise ConfigError(f"key {dotted!r} is ambiguous: write one of {', '.join(f'{s}.{dotted}' for s in owners)}")
    every_key = [k for cls in sections.values() for k in _hints(cls)]
    raise ConfigError(f"unknown config key {dotted!r}" + _did_you_mean(dotted, every_key))


def _split_list(value: Any, hint: Any) -> Any:
    """``"a,b"`` -> ``["a", "b"]`` for a ``list[str]`` field (empty: ``[]``); any other value as it is."""
    if isinstance(value, str) and typing.get_origin(hint) is list and typing.get_args(hint) == (str,):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


def build_section(cls: type, raw: dict[str, Any], prefix: str) -> Any:
    """``cls`` (a config dataclass) from its table ``raw``, every key known and every value of its
    field's type; ``prefix`` names the table in messages."""
    hints = _hints(cls)
    unknown = [k for k in raw if k not in hints]
    if unknown:
        where = f"section [{prefix}]" if prefix else "the top level"
        raise ConfigError(f"unknown key {unknown[0]!r} in {where}" + _did_you_mean(unknown[0], list(hints)))
    values = {}
    for name, value in raw.items():
        key = f"{prefix}.{name}" if prefix else name
        hint = hints[name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise ConfigError(f"{key} must be a section (a table of keys), got {value!r}")
            values[name] = build_section(hint, value, key)
        else:
            values[name] = _coerce(value, hint, key)
    return cls(**values)


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Check ``value`` against a field's type; ints are accepted where floats are expected."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key} = {value!r}: must be one of {', '.join(repr(a) for a in args)}")
        return value
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key} = {value!r}: expected {' or '.join(_spelled(arg) for arg in args)}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key} = {value!r}: expected a list of {len(args)} values")
        return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=True)))
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} = {value!r}: expected {_list_forms(key, args[0])}")
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is type(None) and value is None:
        return value
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ConfigError(f"{key} = {value!r}: expected {hint.__name__}, got {type(value).__name__}")
    return value


def _spelled(hint: Any) -> str:
    """One member of a field's union type as a config file spells its values."""
    if typing.get_origin(hint) is Literal:
        return " or ".join(toml_value(a) for a in typing.get_args(hint))
    if typing.get_origin(hint) is list:
        return f"a list of {_spelled(typing.get_args(hint)[0]).removeprefix('a ')}s"
    return {float: "a number", int: "a whole number", bool: "true or false", str: "a string"}.get(
        hint, getattr(hint, "__name__", str(hint))
    )


def _list_forms(key: str, item: Any) -> str:
    """What a list field takes, with the spellings that give one in a file and on the command line."""
    if item is not str:
        return f"a list of {getattr(item, '__name__', item)}"
    return f'a list of strings: in a config file ["name1", "name2"], on the command line --{key} name1,name2'
