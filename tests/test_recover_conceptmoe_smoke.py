"""Keeps benchmarks/recover_conceptmoe.py from rotting: --quick runs each training mode end to end."""

from __future__ import annotations

import json

import pytest

from tests.benchmark_scripts import load_benchmark


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["all", "new", "lora"])
def test_quick_run_reports_every_figure(mode, tmp_path):
    script = load_benchmark("recover_conceptmoe")
    out = tmp_path / "result.json"
    record = script.main(["--quick", "--train", mode, "--json", str(out), "--save", str(tmp_path / "model")])
    assert json.loads(out.read_text()) == json.loads(json.dumps(record))
    first, last = record["curve"][0], record["curve"][-1]
    assert first["step"] == 0 and last["step"] == 3 and len(record["steps"]) == 3
    for split in ("validation", "held_out"):
        # Step 0 of a converted model with a random router is near its source, never far off.
        assert abs(first[split]["vs_source"]) < 0.05
        assert last[split]["tokens_per_concept"] >= 1
        assert set(last[split]["cells"]) == set(record["source"][split]["cells"])
    assert all(len(record["answers"][key]) == len(script.PROMPTS) for key in ("source", "before", "after"))
    trains = record["trainable_parameters"]
    assert (trains == record["parameters"]) == (mode == "all")
    assert (tmp_path / "model" / "config.json").exists()
    assert not list(tmp_path.glob(".model.tmp-*"))


def test_training_windows_are_disjoint_and_balanced():
    script = load_benchmark("recover_conceptmoe")
    from datasets import Dataset

    split = Dataset.from_list(
        [
            dict(
                text=" ".join(f"{cell}{index}w{word}" for word in range(40)),
                language=cell,
                kind="prose",
                source="s",
                document=f"{cell}-{index}",
            )
            for cell in "ab"
            for index in range(3)
        ]
    )

    class Words:
        # One id per word: windows are then easy to read back.
        eos_token_id = -1

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [hash(word) for word in text.split()]}

    batches = script.TrainBatches(split, Words(), context=16, batch_size=2)
    seen = []
    while (batch := batches.next_batch()) is not None:
        seen.extend(batch.flatten().tolist())
    words = [id_ for id_ in seen if id_ != -1]
    assert len(words) == len(set(words))
    assert batches.tokens == len(seen) > 0.8 * 6 * 41


def test_aux_loss_weight_overrides_the_conversion_default(tmp_path):
    script = load_benchmark("recover_conceptmoe")
    source = script.tiny_source(tmp_path / "source")
    weights = {}
    for name, argv in (("set", ["--aux-loss-weight", "1.5"]), ("default", [])):
        args = script.parse_args(["--quick", *argv])
        model = script.converted_model(source, tmp_path / name, args)
        weights[name] = model.config.aux_loss_weight
    assert weights == {"set": 1.5, "default": 0.03}


@pytest.mark.slow
def test_quick_run_holds_the_ratio_by_the_threshold(tmp_path):
    script = load_benchmark("recover_conceptmoe")
    record = script.main(["--quick", "--train", "new", "--hold-ratio", "--ratio", "3"])
    thresholds = [step["threshold"] for step in record["steps"]]
    assert len(thresholds) == 3 and all(0.0 <= value <= 1.0 for value in thresholds)
    assert record["threshold"] == thresholds[-1]
    # The saved threshold comes from a larger sample after training, then one more evaluation.
    assert 0.0 <= record["calibrated_threshold"] <= 1.0 and record["curve"][-1]["calibrated"]


@pytest.mark.slow
def test_a_killed_run_resumes_where_its_checkpoint_stands(tmp_path):
    """A run stopped after 2 steps and started again with the same arguments (a larger --max-steps) goes
    on from its checkpoint: steps 3 and 4 equal those of a run never stopped, distillation, alignment,
    held ratio and rank decisions included, and per-cell tokens per concept are reported."""
    script = load_benchmark("recover_conceptmoe")
    common = ["--quick", "--train", "new", "--hold-ratio", "--distill", "--align-hidden", "1"]
    common += ["--checkpoint-every-minutes", "0.00001"]
    whole = script.main([*common, "--max-steps", "4", "--checkpoint", str(tmp_path / "whole")])
    script.main([*common, "--max-steps", "2", "--checkpoint", str(tmp_path / "cut")])
    resumed = script.main([*common, "--max-steps", "4", "--checkpoint", str(tmp_path / "cut")])
    assert [entry["step"] for entry in resumed["steps"]] == [1, 2, 3, 4]
    for key in ("loss", "lm_loss", "distill_loss", "align_loss", "threshold"):
        assert [entry[key] for entry in resumed["steps"]] == pytest.approx(
            [entry[key] for entry in whole["steps"]], rel=1e-5
        ), key
    cells = resumed["curve"][-1]["held_out"]["cell_tokens_per_concept"]
    assert set(cells) == set(resumed["source"]["held_out"]["cells"])
    with pytest.raises(SystemExit, match="other arguments"):
        script.main([*common, "--max-steps", "4", "--lr", "0.5", "--checkpoint", str(tmp_path / "cut")])


def test_freeze_router_keeps_the_router_out_of_training(tmp_path):
    script = load_benchmark("recover_conceptmoe")
    source = script.tiny_source(tmp_path / "source")
    for mode in ("all", "new", "lora"):
        args = script.parse_args(["--quick", "--train", mode, "--freeze-router"])
        model = script.prepare_training(script.converted_model(source, tmp_path / mode, args), mode, 4, True)
        trainable = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
        assert trainable and not any(".chunker." in f".{name}." for name in trainable), mode
    args = script.parse_args(["--quick", "--train", "all"])
    model = script.prepare_training(script.converted_model(source, tmp_path / "free", args), "all", 4)
    assert all(parameter.requires_grad for parameter in model.parameters())
