"""Reading a job spec file as untrusted input, for `spotrain submit`: in bounded time and
memory whatever it holds. Refused, each in one line naming the line (or key) and the bound:
a file over `MAX_BYTES`, YAML anchors and aliases (an alias bomb grows a few lines into
gigabytes), duplicate keys (YAML and JSON silently keep the last), nesting deeper than
`MAX_DEPTH`, more than `MAX_VALUES` values, and integers longer than `MAX_DIGITS` (Python's
int() of a long or sexagesimal YAML integer is slow, past 4,300 digits an exception).
What the values mean is workflows/spec.py's to check.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from yaml.error import Mark
from yaml.nodes import MappingNode, Node, ScalarNode

MAX_BYTES = 1 << 20
MAX_DEPTH = 32
MAX_VALUES = 20_000
MAX_DIGITS = 40


class SpecFileError(ValueError):
    """A spec file that cannot be read as plain data: one line, saying where and why."""


def at(mark: Mark | None) -> str:
    return f"line {mark.line + 1}: " if mark is not None else ""


class BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, composing nodes one at a time: the depth, the count and each
    alias are checked before the next node is read, so a refused file is never built."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.depth = 0
        self.values = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise SpecFileError(
                f"{at(event.start_mark)}YAML anchors and aliases (&name, *name) are refused in "
                "job specs: write each value out"
            )
        self.values += 1
        if self.values > MAX_VALUES:
            raise SpecFileError(f"{at(event.start_mark)}more than {MAX_VALUES:,} values")
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise SpecFileError(f"{at(event.start_mark)}nested deeper than {MAX_DEPTH} levels")
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue  # a mapping as a key is refused by the loader itself
            key = self.construct_object(key_node)
            if key in first:
                raise SpecFileError(
                    f"{at(key_node.start_mark)}duplicate key {str(key)[:40]!r} (first on line "
                    f"{first[key]}): give each key once"
                )
            first[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: ScalarNode) -> int:
        if len(node.value) > MAX_DIGITS:
            raise SpecFileError(
                f"{at(node.start_mark)}an integer of {len(node.value):,} characters (at most "
                f"{MAX_DIGITS})"
            )
        return super().construct_yaml_int(node)


BoundedLoader.add_constructor("tag:yaml.org,2002:int", BoundedLoader.construct_yaml_int)


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's keys, each given once."""
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        repeated = next(k for i, k in enumerate(keys) if k in keys[:i])
        raise SpecFileError(f"duplicate key {repeated[:40]!r}: give each key once")
    return dict(pairs)


def shape_problem(root: Any) -> str | None:
    """Nesting past `MAX_DEPTH` or more than `MAX_VALUES` values (iterative: no recursion)."""
    stack = [(root, 1)]
    seen = 0
    while stack:
        value, depth = stack.pop()
        seen += 1
        if seen > MAX_VALUES:
            return f"more than {MAX_VALUES:,} values"
        if depth > MAX_DEPTH:
            return f"nested deeper than {MAX_DEPTH} levels"
        if isinstance(value, dict | list):
            items = value.values() if isinstance(value, dict) else value
            stack.extend((item, depth + 1) for item in items)
    return None


def read_bounded(path: Path) -> str:
    """At most `MAX_BYTES` of UTF-8 text (a FIFO or /dev/zero is cut short too)."""
    with path.open("rb") as f:
        data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise SpecFileError(f"larger than {MAX_BYTES // 1024:,} KiB: a job spec is a few KiB")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecFileError(f"not UTF-8 text (byte {e.start})") from None


def load_data(path: Path) -> Any:
    """The file's plain data: JSON for `.json`, else YAML. Raises OSError when it cannot be
    read, SpecFileError (one line) when it is not a bounded, plain document."""
    text = read_bounded(path)
    if path.suffix == ".json":
        try:
            data = json.loads(text, object_pairs_hook=unique_keys)
        except RecursionError:
            raise SpecFileError(f"nested deeper than {MAX_DEPTH} levels") from None
        except SpecFileError:
            raise
        except ValueError as e:  # JSONDecodeError, or an integer past Python's digit limit
            raise SpecFileError(f"not valid JSON: {e}") from None
        if problem := shape_problem(data):
            raise SpecFileError(problem)
        return data
    loader = None
    try:  # (the loader checks every character as it is made: a NUL byte fails there)
        loader = BoundedLoader(text)
        return loader.get_single_data()
    except yaml.MarkedYAMLError as e:
        problem = " ".join(x for x in (e.context, e.problem) if x) or "unreadable"
        raise SpecFileError(f"{at(e.problem_mark)}not valid YAML: {problem}") from None
    except yaml.YAMLError as e:
        raise SpecFileError(f"not valid YAML: {' '.join(str(e).split())}") from None
    finally:
        if loader is not None:
            loader.dispose()
