"""The docs' commands work as written: every shell block a page marks runnable
(```` ```{.sh .runnable} ````) runs, in the page's order, against a fresh embedded stack
(`spotrain dev` on free ports), from a directory laid out as a clone: `.venv` is this
interpreter's environment and `examples/` the repository's. Each block runs under
`bash -euo pipefail` after the `export` lines `spotrain dev` printed, as the page says to do;
the only difference from a reader's terminal is the stack's ports (`TEMPORAL_ADDRESS`,
`SPOTRAIN_WEBHOOK_URL`). The example job keeps its 600 steps: the reclaim block needs the job
still running after the status block saw it start, and a shorter job (200 steps) ended first
in a CI run beside two busy loops ("its nodes: none")."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.test_dev_stack import Dev

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
RUNNABLE = re.compile(r"^```\{\.sh \.runnable\}\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def runnable_blocks() -> dict[str, list[str]]:
    """Each docs page with runnable blocks, and its blocks in order."""
    pages = {}
    for path in sorted((ROOT / "docs").rglob("*.md")):
        blocks = RUNNABLE.findall(path.read_text())
        if blocks:
            pages[str(path.relative_to(ROOT))] = blocks
    return pages


def test_the_getting_started_walk_through_is_runnable() -> None:
    blocks = runnable_blocks().get("docs/getting-started.md", [])
    assert len(blocks) >= 4
    text = "\n".join(blocks)
    for step in ("spotrain submit", "spotrain reclaim", "spotrain report", "--plot"):
        assert step in text


def clone_like(where: Path) -> Path:
    where.mkdir()
    (where / ".venv").symlink_to(Path(sys.prefix))
    shutil.copytree(ROOT / "examples", where / "examples")
    return where


@pytest.mark.timeout(600)
@pytest.mark.parametrize("page", sorted(runnable_blocks()))
def test_runnable_blocks_work_as_written(
    page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clone = clone_like(tmp_path / "clone")
    monkeypatch.chdir(clone)  # the stack's local runtime starts ranks in its own directory
    dev = Dev(tmp_path / "state")
    proc = dev.start()
    try:
        exports = "\n".join(
            line.strip() for line in dev.banner.splitlines() if line.strip().startswith("export ")
        )
        webhook = re.search(r"webhook\s+(http://\S+)", dev.banner)
        assert webhook and exports.count("export ") == 2, dev.banner
        env = {k: v for k, v in dev.env.items() if not k.startswith(("AWS_", "SPOTRAIN_"))}
        env |= {
            "SPOTRAIN_WEBHOOK_URL": webhook.group(1),
            "TEMPORAL_ADDRESS": dev.env["TEMPORAL_ADDRESS"],
        }
        for number, block in enumerate(runnable_blocks()[page], 1):
            ran = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", f"{exports}\n{block}"],
                cwd=clone,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert ran.returncode == 0, (
                f"{page}, runnable block {number} failed ({ran.returncode}):\n{block}\n"
                f"--- stdout\n{ran.stdout[-3000:]}\n--- stderr\n{ran.stderr[-3000:]}"
            )
        if page == "docs/getting-started.md":
            assert (clone / "job.png").stat().st_size > 10_000
            assert "<img" in (clone / "job.html").read_text()
            report = dev.cli("report", "ddp-example", "--json")
            assert '"reclaims": 1' in report.stdout, report.stdout[-2000:]
    finally:
        assert dev.interrupt(proc) == 0
    assert os.path.exists(tmp_path / "state" / "temporal.db")
