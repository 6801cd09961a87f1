"""Keeps benchmarks/gpu_suite.py runnable without a GPU: `--cpu-smoke` runs every section's code on
minuscule sizes on CPU (the varlen path on `varlen_reference`), writes the JSON and Markdown, and a run
out of budget stops cleanly with what it has."""

from __future__ import annotations

import json

from tests.benchmark_scripts import load_benchmark


def test_cpu_smoke_runs_every_section_and_writes_both_tables(tmp_path, capsys):
    suite = load_benchmark("gpu_suite")
    result = suite.main(["--cpu-smoke", "--out", str(tmp_path)])
    assert result["meta"]["status"] == "complete"
    sections = result["sections"]
    assert set(sections) == {"exactness", "kernel", "training", "inference", "dlcm-forms"}
    families = {row["family"] for row in sections["exactness"]}
    assert families == {"plain", "conceptmoe", "dlcm", "hidden_decoding", "attention alone"}
    for row in sections["exactness"]:
        assert row["varlen fp32 (reference kernel)"] <= 1e-4, row
    for section in ("kernel", "training", "inference", "dlcm-forms"):
        assert not any(key.endswith("error") for row in sections[section] for key in row), section
    assert {row["attn"] for row in sections["inference"] if "attn" in row} == {"sdpa", "hf_concept_varlen"}
    saved = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert saved["sections"] == json.loads(json.dumps(sections))
    markdown = (tmp_path / "gpu_suite.md").read_text()
    assert "## dlcm-forms" in markdown and "| family |" in markdown
    assert "## training" in capsys.readouterr().out


def test_a_run_out_of_budget_stops_cleanly_with_partial_results(tmp_path):
    suite = load_benchmark("gpu_suite")
    # The kernel section's estimates fit 3.99 s on these sizes, the training section's (>= 4 s) do not.
    argv = ["--cpu-smoke", "--out", str(tmp_path), "--budget-s", "3.99", "--sections", "kernel,training"]
    result = suite.main(argv)
    assert result["meta"]["status"].startswith("stopped in training")
    saved = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert saved["meta"]["status"] == result["meta"]["status"]
    assert len(saved["sections"]["kernel"]) == 4
    assert "training" not in saved["sections"]
