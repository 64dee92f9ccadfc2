"""The benchmarks page, from bench/results/*.json: one table per results file, its settings and
the load it ran under, and what the benchmark measures (its script's docstring).
docs/gen_reference.py writes it with the references and checks it with them."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
SCRIPTS = (
    "goodput",
    "live_resize",
    "handover",
    "checkpoint",
    "reaction",
    "karpenter",
    "scale",
    "storm",
    "webhook_burst",
    "suite_times",
)
WRITTEN_BY = {"goodput_wedge_check": "goodput/wedge_check"}  # files named for what they check


def figure(value: Any) -> str:
    """Three significant figures for measurements, integers and text as they are."""
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if value is None:
        return ""
    return str(value).replace("|", "\\|").replace("\n", " ")


def flat(row: dict[str, Any]) -> dict[str, Any]:
    """A row's scalars, nested objects one level deep as `key.sub`; lists left out."""
    out: dict[str, Any] = {}
    for key, value in row.items():
        if isinstance(value, dict):
            for sub, inner in value.items():
                if not isinstance(inner, dict | list):
                    out[f"{key}.{sub}"] = inner
        elif not isinstance(value, list):
            out[key] = value
    return out


def script_for(path: Path) -> str:
    for prefix, script in WRITTEN_BY.items():
        if path.stem.startswith(prefix):
            return script
    return next(s for s in sorted(SCRIPTS, key=len, reverse=True) if path.stem.startswith(s))


def source(script: str) -> str:
    """A benchmark's file, from the repository's root: a module, or a package's
    `__init__.py` (bench/goodput/)."""
    module = f"bench/{script}.py"
    return module if (ROOT / module).exists() else f"bench/{script}/__init__.py"


def summary(script: str) -> tuple[str, str]:
    """The first paragraph of a benchmark's docstring, and its command line."""
    doc = ast.get_docstring(ast.parse((ROOT / source(script)).read_text())) or ""
    parts = [p.strip() for p in doc.split("\n\n")]
    command = next((p for p in parts if p.startswith(".venv/bin/python")), "")
    return " ".join(parts[0].split()), command


def section(path: Path) -> str:
    data = json.loads(path.read_text())
    script = script_for(path)
    what, command = summary(script)
    out = [f"\n## `{path.name}`\n\n{what} (`{source(script)}`)\n\n"]
    if command:
        out.append(f"```\n{command}\n```\n\n")
    settings = data.get("setup") or data.get("settings") or data.get("args") or {}
    shown = {k: v for k, v in settings.items() if not isinstance(v, dict) and k != "out"}
    if shown:
        out.append("Settings: " + ", ".join(f"`{k}` {figure(v)}" for k, v in shown.items()))
        out.append(".\n\n")
    machine = []
    if "cpus" in data or "cpus" in settings:
        machine.append(f"{data.get('cpus', settings.get('cpus'))} CPUs")
    if data.get("load_average"):
        machine.append("load average " + " / ".join(f"{x:.1f}" for x in data["load_average"]))
    out.append(
        f"Machine: {', '.join(machine)} (1, 5, 15 min, at the end).\n\n"
        if machine
        else "Machine: the shared 2-core development machine (load not recorded).\n\n"
    )
    rows = [flat(r) for r in data.get("rows") or data.get("runs") or []]
    if rows:
        columns = list(dict.fromkeys(k for r in rows for k in r))
        out.append("| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n")
        for r in rows:
            out.append("| " + " | ".join(figure(r.get(c)) for c in columns) + " |\n")
    return "".join(out)


def pictures() -> list[str]:
    """The benchmarks' pictures, which the site's hook (docs/config/hooks.py) publishes
    under reference/bench/."""
    out = []
    for picture in sorted(RESULTS.glob("*.png")):
        script = script_for(picture)
        out.append(
            f"\n## `{picture.name}`\n\nDrawn by `{source(script)}` with its results.\n\n"
            f"![{picture.stem}](bench/{picture.name})\n"
        )
    return out


def page(header: str) -> str:
    return header + "".join(
        [
            "# Benchmark results\n\n",
            "Every table below is generated from the results file named in its heading "
            "(`bench/results/*.json`, written by the benchmark scripts) by "
            "`docs/gen_benchmarks.py`: rerun a benchmark, then `python docs/gen_reference.py`. "
            "Times are seconds unless a column says otherwise. All were measured on a shared "
            "2-core development machine with other work running (the load averages are the "
            "machine's at the end of each run), so read ratios measured side by side in one "
            "run, not absolute times. What each benchmark does and how to read it: "
            "[Benchmarks](../benchmarks.md).\n",
            *(section(p) for p in sorted(RESULTS.glob("*.json"))),
            *pictures(),
        ]
    )
