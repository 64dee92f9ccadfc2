"""The documentation site: generated references match the code, every CLI option and spec field
is described, and the site builds with warnings as errors (broken links fail)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "docs" / "config" / "mkdocs.yml"


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs/gen_reference.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_references_match_the_code() -> None:
    assert generator().stale() == [], "run: python docs/gen_reference.py"


def test_every_cli_command_and_option_has_help() -> None:
    gen = generator()
    found = gen.commands()
    assert {"spotrain submit", "spotrain pool create", "spotrain dev", "spotrain webhook"} <= {
        name for name, _ in found
    }
    missing = [
        f"{name} {'/'.join(a.option_strings) or a.dest}"
        for name, p in found
        for a in gen.options(p)
        if not (a.help or "").strip()
    ]
    assert missing == []
    assert [name for name, p in found if not (p.description or "").strip()] == []


def test_every_spec_field_is_described() -> None:
    rows = [line for line in generator().spec_page().splitlines() if line.startswith("| `")]
    assert len(rows) > 40
    assert [row.split(" | ")[0] for row in rows if row.rstrip().endswith("|  |")] == []


def test_site_builds_strict(tmp_path: Path) -> None:
    if importlib.util.find_spec("mkdocs") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("mkdocs is missing: pip install -e '.[docs]'")
        pytest.skip("mkdocs is missing: pip install -e '.[docs]'")
    site = tmp_path / "site"
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(CONFIG), "-d", str(site)],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {"NO_MKDOCS_2_WARNING": "1"},  # Material's banner, not a warning
    )
    assert built.returncode == 0, built.stderr[-4000:]
    assert (site / "reference" / "job-spec" / "index.html").exists()
    for picture in (ROOT / "bench" / "results").glob("*.png"):  # published by the hook
        assert (site / "reference" / "bench" / picture.name).read_bytes() == picture.read_bytes()


DEMO = (
    'python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 && .venv/bin/pip install -e ".'
    '[local,train,s3]" && .venv/bin/spotrain demo'
)


CI = ROOT / ".ci" / "run"


def test_the_readme_is_a_front_page_with_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) < 14_000  # a front page; the rest lives in docs/
    for command in (DEMO, "bash .ci/run"):
        assert f"```\n{command}\n```" in readme
    assert f"```\n{DEMO}\n```" in (ROOT / "docs" / "getting-started.md").read_text()
    (ci_tests,) = re.findall(r"python -m pytest -q -n \d+ --dist loadfile", CI.read_text())
    assert ci_tests in " ".join(readme.split())  # the README says how CI runs the tests
    extras = (ROOT / "pyproject.toml").read_text()
    assert all(f"\n{extra} = [" in extras for extra in ("local", "train", "s3", "report"))


def test_job_specs_in_the_docs_validate() -> None:
    from spotrain.workflows.spec import parse_spec

    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    specs = [
        (page, block)
        for page in pages
        for block in re.findall(r"^```yaml\n(.*?)^```$", page.read_text(), re.M | re.S)
        if "total_steps:" in block
    ]
    assert len(specs) >= 2
    for page, block in specs:
        try:
            parse_spec(yaml.safe_load(block))
        except ValueError as e:
            pytest.fail(f"{page.relative_to(ROOT)}: {e}")
