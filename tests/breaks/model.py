"""A break: a behaviour that a unit test guards, the edit that breaks it (text that must occur
exactly once in its file), and the fast tests that must fail with it (tests/breaks/)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Break:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    more: tuple[tuple[str, str], ...] = ()  # further edits in the same file

    @property
    def edits(self) -> tuple[tuple[str, str], ...]:
        return ((self.old, self.new), *self.more)

    def matches(self, repo: Path) -> bool:
        text = (repo / self.path).read_text()
        return all(text.count(old) == 1 for old, _ in self.edits)


def _in(file: str) -> Callable[..., tuple[str, ...]]:
    """Node ids of tests in `file` (a path under tests/)."""

    def named(*tests: str) -> tuple[str, ...]:
        return tuple(f"tests/{file}::{t}" for t in tests)

    return named
