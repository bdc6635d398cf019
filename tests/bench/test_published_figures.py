"""The README quotes the committed benchmark runs and nothing else: its summary is the one
`report.readme_summary` draws from docs/bench/results.json (what `make bench` writes), its
ablation table the one docs/bench/ablation/ablation.json gives (`dlite-ray bench-ablation`),
and it cites no ignored path."""

from __future__ import annotations

import json
import re
from pathlib import Path

from dlite_ray.bench.ablation import markdown, readme_table
from dlite_ray.bench.report import readme_summary

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_quotes_the_committed_bench_results():
    results = json.loads((ROOT / "docs" / "bench" / "results.json").read_text())
    assert not results["stamp"]["quick"], "docs/bench holds a --quick run: its figures are not for quoting"
    assert readme_summary(results) in (ROOT / "README.md").read_text(), (
        "README.md's bench summary differs from docs/bench/results.json: paste report.md's Summary section")


def test_the_readme_quotes_the_committed_ablation():
    results = json.loads((ROOT / "docs" / "bench" / "ablation" / "ablation.json").read_text())
    assert markdown(results) == (ROOT / "docs" / "bench" / "ablation" / "ablation.md").read_text()
    assert readme_table(results) in (ROOT / "README.md").read_text(), (
        "README.md's ablation table differs from docs/bench/ablation/ablation.json: paste ablation.md's first table")


def test_the_docs_cite_no_ignored_run_directory():
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("**/*.md")]:
        assert not re.search(r"(?<![\w/])runs/\w", page.read_text()), f"{page} cites a git-ignored runs/ path"
