"""Keeps benchmarks/reproduce_conceptmoe.py from rotting: the compute matching picks the top-k the
calculator says, and `--quick` (one seed, a few steps, two workers) runs every configuration and the CT
conversion, printing each table with finite figures and a JSON record of every run."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "reproduce_conceptmoe.py"
TITLES = ("[compute]", "[§4.5]", "[§4.3]", "[directions]", "total wall time")


def load_script():
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("reproduce_conceptmoe", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_matched_top_k_is_the_one_nearest_the_source_flops():
    from hf_concept.compute import conceptmoe_compute
    from hf_concept.modeling.configuration_conceptmoe import ConceptMoEConfig

    script = load_script()
    args = script.parse_args([])
    fields = dict(script.backbone(args, 3072, 0), encoder_layers=2, decoder_layers=2, compression_ratio=2.0)
    top_k, ratio = script.matched_top_k(fields, args.context)
    ratios = {}
    for candidate in range(script.TOP_K, script.NUM_EXPERTS + 1):
        report, source = conceptmoe_compute(
            ConceptMoEConfig(**fields, concept_num_experts_per_tok=candidate), 256
        )
        ratios[candidate] = report.matmul_flops / source.matmul_flops
    assert ratio == ratios[top_k] and abs(ratio - 1) == min(abs(value - 1) for value in ratios.values())
    # Half the concept-layer work saved at R = 2 is given back by about twice the source's top-k.
    assert top_k > script.TOP_K
    # An ablation keeps the dynamic model's top-k; fixed chunking is matched on its own.
    dynamic = script.conceptmoe_config(args, {}, 3072, 0)
    assert (
        script.conceptmoe_config(args, dict(joint_decoding_layers=0), 3072, 0).concept_top_k
        == dynamic.concept_top_k
    )


@pytest.mark.slow
def test_quick_run_prints_every_table_with_finite_figures(tmp_path):
    figures_path = tmp_path / "figures.json"
    command = [sys.executable, str(SCRIPT), "--quick", "--workers", "2", "--json", str(figures_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    for title in TITLES:
        assert title in result.stdout, title
    figures = json.loads(figures_path.read_text())
    scratch = [run for run in figures["runs"] if run["part"] == "scratch"]
    assert [run["config"] for run in scratch] == list(load_script().SCRATCH)
    for run in scratch:
        assert len(run["history"]) == figures["args"]["steps"]
        assert all(math.isfinite(value) and value > 0 for value in run["heldout"].values()), run["heldout"]
    (ct,) = [run for run in figures["runs"] if run["part"] == "ct"]
    names = [model["name"] for model in ct["models"]]
    assert names == ["source continued", "converted R=1.5", "converted R=2"]
    for model in ct["models"]:
        assert len(model["history"]) == figures["args"]["continue_steps"]
        assert math.isfinite(model["heldout"]["loss"]) and math.isfinite(model["converted"]["loss"])
    assert len(figures["directions"]) == 8
