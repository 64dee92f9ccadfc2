"""A short explanation of `left == right` failing on long sequences, for conftest's
pytest_assertrepr_compare: pytest's own is one differing index without -v and a diff of the
whole pretty-printed lists with it (thousands of lines for a list of samples). This names the
lengths, then each run of items missing, extra or changed, with its indexes, up to a few runs,
whatever the verbosity."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

LONG = 12  # sequences up to this length keep pytest's own explanation
# pytest cuts an explanation at 8 lines or 640 characters without -vv: this one fits.
MAX_RUNS = 4  # runs of differences shown
MAX_ITEMS = 4  # items shown per run
MAX_REPR = 24  # characters per item
MATCHED_UP_TO = 20_000  # beyond that, items are compared index by index (difflib is quadratic)


def _short(item: Any) -> str:
    text = repr(item)
    return text if len(text) <= MAX_REPR else text[: MAX_REPR - 3] + "..."


def _items(seq: Sequence[Any], lo: int, hi: int) -> str:
    shown = ", ".join(_short(x) for x in seq[lo : min(hi, lo + MAX_ITEMS)])
    more = hi - lo - MAX_ITEMS
    return f"[{shown}{f', ... {more} more' if more > 0 else ''}]"


def _span(lo: int, hi: int) -> str:
    return f"[{lo}]" if hi - lo == 1 else f"[{lo}:{hi}]"


def _runs(left: Sequence[Any], right: Sequence[Any]) -> list[tuple[str, int, int, int, int]]:
    """(tag, i1, i2, j1, j2) for each run that differs, as difflib's opcodes."""
    if max(len(left), len(right)) <= MATCHED_UP_TO:
        matcher = difflib.SequenceMatcher(
            None, [repr(x) for x in left], [repr(x) for x in right], autojunk=False
        )
        return [op for op in matcher.get_opcodes() if op[0] != "equal"]
    runs: list[tuple[str, int, int, int, int]] = []
    common = min(len(left), len(right))
    for i in range(common):
        if repr(left[i]) != repr(right[i]):
            runs.append(("replace", i, i + 1, i, i + 1))
    if len(left) > common:
        runs.append(("delete", common, len(left), common, common))
    elif len(right) > common:
        runs.append(("insert", common, common, common, len(right)))
    return runs


def long_sequence_diff(left: Sequence[Any], right: Sequence[Any]) -> list[str]:
    """The explanation's lines (the first is its summary)."""
    kind = type(left).__name__
    lines = [f"{kind} of {len(left)} items == {type(right).__name__} of {len(right)} items"]
    runs = _runs(left, right)
    counts = {"delete": 0, "insert": 0, "replace": 0}
    for tag, i1, i2, j1, j2 in runs:
        counts[tag] += max(i2 - i1, j2 - j1)
    lines.append(
        f"{len(runs)} runs differ: {counts['delete']} only on the left, "
        f"{counts['insert']} only on the right, {counts['replace']} changed"
    )
    for tag, i1, i2, j1, j2 in runs[:MAX_RUNS]:
        if tag == "delete":
            lines.append(f"  left{_span(i1, i2)} not on the right: {_items(left, i1, i2)}")
        elif tag == "insert":
            lines.append(f"  right{_span(j1, j2)} not on the left: {_items(right, j1, j2)}")
        else:
            lines.append(
                f"  left{_span(i1, i2)} {_items(left, i1, i2)} "
                f"!= right{_span(j1, j2)} {_items(right, j1, j2)}"
            )
    if len(runs) > MAX_RUNS:
        lines.append(f"  ... {len(runs) - MAX_RUNS} more runs")
    return lines


def explain(op: str, left: Any, right: Any) -> list[str] | None:
    """For `==` between two lists or tuples, at least one of them long; else None (pytest's)."""
    sequences = (list, tuple)
    if op != "==" or not (isinstance(left, sequences) and isinstance(right, sequences)):
        return None
    if max(len(left), len(right)) <= LONG:
        return None
    return long_sequence_diff(left, right)
