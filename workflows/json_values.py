"""Whether a value can reach the ranks as plain JSON (the spec's `scale_config`): bounded in
size and depth, finite, of JSON's types only."""

from __future__ import annotations

import math
from typing import Any

MAX_SCALE_CONFIG_VALUES = 10_000
MAX_SCALE_CONFIG_DEPTH = 8


def json_problem(root: Any) -> str | None:
    """What keeps a value from reaching ranks as plain JSON: a type JSON lacks (a YAML date or
    set), a number that is not finite or beyond 64 bits, nesting or size past the bounds.
    Iterative, so that a value nested 10,000 deep costs no recursion."""
    stack: list[tuple[Any, str, int]] = [(root, "", 0)]
    seen = 0
    while stack:
        value, where, depth = stack.pop()
        seen += 1
        if seen > MAX_SCALE_CONFIG_VALUES:
            return f"more than {MAX_SCALE_CONFIG_VALUES:,} values"
        if depth > MAX_SCALE_CONFIG_DEPTH + 1:  # + 1: the world-size level
            return f"{where}: nested deeper than {MAX_SCALE_CONFIG_DEPTH} levels"
        if isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str | int) or isinstance(key, bool):
                    return f"{where or '(top)'}: key {str(key)[:40]!r} is not a string"
                stack.append((item, f"{where}.{str(key)[:40]}".lstrip("."), depth + 1))
        elif isinstance(value, list):
            stack.extend((item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value))
        elif isinstance(value, float) and not math.isfinite(value):
            return f"{where}: must be a finite number, got {value}"
        elif isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 63:
            return f"{where}: integer beyond 64 bits"
        elif not isinstance(value, str | int | float | bool | type(None)):
            return f"{where}: a {type(value).__name__} is not a JSON value"
    return None
