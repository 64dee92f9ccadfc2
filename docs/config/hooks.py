"""MkDocs hook: the benchmarks' pictures (bench/results/*.png) join the site under
reference/bench/, where the generated results page shows them, without a copy in docs/."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def on_files(files: Files, config: Any) -> Files:
    for picture in sorted(RESULTS.glob("*.png")):
        files.append(
            File.generated(config, f"reference/bench/{picture.name}", abs_src_path=str(picture))
        )
    return files
