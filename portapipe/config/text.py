"""A config's text: YAML read strictly (a key given twice is an error), ``--set a.b=value``
overrides, and :class:`ConfigError`, which every config problem is raised as."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """Invalid configuration; ``problems`` holds one human-readable line per mistake."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


def _set_path(d: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    cur = d
    for k in keys[:-1]:
        nxt = cur.get(k)
        if nxt is None:
            nxt = cur[k] = {}
        if not isinstance(nxt, dict):
            raise ConfigError([f"{dotted}: cannot set inside {k!r}, which is not a section"])
        cur = nxt
    cur[keys[-1]] = value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b=value`` strings (value parsed as YAML) to a raw config dict."""
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError([f"--set {item!r}: expected KEY.PATH=VALUE"])
        try:
            value = _yaml(text) if text.strip() else None
        except yaml.YAMLError as exc:
            raise ConfigError([f"--set {item!r}: the value is not valid YAML ({yaml_problem(exc)})"]) from None
        _set_path(raw, key.strip(), value)
    return raw


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML would silently keep
    the last: a second ``train:`` section would drop the first's settings)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor` merges are meant to be overridden
            key = self.construct_object(key_node, deep=True)
            try:
                seen = first.get(key)
            except TypeError:
                continue  # an unhashable key: the safe loader's own error names it
            if seen is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice (first at line {seen.line + 1})", key_node.start_mark
                )
            first[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


# YAML 1.1 (PyYAML's) reads a float without a dot (`1e-2`, `3e4`) as text; YAML 1.2 and every
# user read it as a number, and no config key takes text for a number.
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a safe loader)


def yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error as one line: what is wrong and where."""
    problem = getattr(exc, "problem", None) or str(exc)
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return " ".join(f"{problem}{where}".split())


def read_yaml(path: Path) -> Any:
    if not path.is_file():
        what = "is a folder, not a YAML file" if path.is_dir() else "does not exist"
        raise ConfigError([f"<file>: {str(path)!r} {what}"])
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise ConfigError([f"<file>: cannot read {path}: {exc.strerror or exc}"]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError([f"<file>: {path} is not a UTF-8 text file (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); a config is YAML text"]) from None
    try:
        return _yaml(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError([f"<file>: {path} is not valid YAML: {yaml_problem(exc)}"]) from None
