"""FSDP2 training of a converted ConceptMoE on two processes (slow): `accelerate launch` with
examples/accelerate/fsdp2.yaml runs `hf-concept train`, gloo on CPU (tests/workers/fsdp_worker.py says
what it changes in accelerate there), NCCL on two or more GPUs.

One FSDP2 run and one DDP run (torchrun) train the same converted checkpoint on the same data: 2 optimizer
steps of 2 packed micro-batches per rank, the global ratio scope, deterministic boundaries
(`boundary_noise="none"`) so that one process can redo a step's planning on the whole global batch.
Checked: the parameters are sharded (each rank holds half of every tensor, rounded up by rows); each
step's ratio statistics are the global ones (the two ranks' micro-batches summed, equal on both ranks,
equal to one process planning the step over all four micro-batches, equal to the DDP run's); logged
losses and final weights match the DDP run; the saved weights are the trained ones and give the logits
the trained (sharded) model gave. Loading the saved folder as remote code does not work yet (an expected
failure below, docs/training.md, "FSDP").
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from hf_concept.conversion.conceptmoe import convert_to_conceptmoe
from hf_concept.modeling.modeling_conceptmoe import ConceptMoEForCausalLM
from hf_concept.modeling.ratio_step import RatioAccumulator, plan_ratio_step
from tests.test_convert_conceptmoe import TINY_LLAMA
from tests.test_train_command import _free_port, make_workspace
from tests.workers.fsdp_worker import probe_input_ids
from tests.workers.train_worker import RECORD_DIR_ENV

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "accelerate" / "fsdp2.yaml"
WORKER = REPO / "tests" / "workers" / "fsdp_worker.py"
RECORDER = "tests.workers.fsdp_worker:RecordShardedRun"
STEPS, MICRO_BATCHES = 2, 2
LOGGED = ("loss", "lm_loss", "aux_loss", "compression_ratio", "boundary_prob_mean")


def _skip_without_two_devices() -> None:
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("two FSDP processes need two GPUs here (a CPU-only machine runs them on gloo)")
    if not torch.cuda.is_available() and not dist.is_gloo_available():
        pytest.skip("torch.distributed without gloo")


def _converted_checkpoint(root: Path) -> Path:
    """A tiny random Llama converted to ConceptMoE (1 encoder, 2 concept, 1 decoder layer), sharded on
    disk, with deterministic training boundaries."""
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).save_pretrained(root / "llama")
    converted = convert_to_conceptmoe(
        root / "llama", root / "conceptmoe", encoder_layers=1, decoder_layers=1, max_shard_size="20KB"
    )
    config_file = converted / "config.json"
    config = json.loads(config_file.read_text())
    assert config["ratio_scope"] == "global"
    config["boundary_noise"] = "none"
    config_file.write_text(json.dumps(config, indent=2))
    return converted


def _run(launcher: list[str], root: Path, checkpoint: Path, workspace: Path, name: str) -> list[dict]:
    records = root / f"{name}-ranks"
    records.mkdir()
    train = [
        "train", str(checkpoint), "--data", str(workspace / "corpus.txt"),
        "--tokenizer", str(workspace / "tokenizer"), "--output-dir", str(root / name),
        "--max-steps", str(STEPS), "--logging-steps", "1", "--per-device-train-batch-size", "2",
        "--gradient-accumulation-steps", str(MICRO_BATCHES), "--block-size", "48",
        "--learning-rate", "1e-3", "--save-steps", "0", "--callback", RECORDER,
    ]  # fmt: skip
    python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=python_path, **{RECORD_DIR_ENV: str(records)})
    completed = subprocess.run(
        [*launcher, *train], capture_output=True, text=True, timeout=300, env=env, cwd=REPO
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-4000:]
    assert completed.stdout.count("final train loss") == 1, completed.stdout[-3000:]
    return [torch.load(records / f"rank{rank}.pt", weights_only=True) for rank in range(2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    _skip_without_two_devices()
    root = tmp_path_factory.mktemp("fsdp")
    workspace = make_workspace(root)
    checkpoint = _converted_checkpoint(root)
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG)]
    accelerate += ["--num_processes", "2", "--main_process_port", str(_free_port()), str(WORKER)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2"]
    torchrun += ["--master_addr", "127.0.0.1", "--master_port", str(_free_port()), "-m", "hf_concept.cli"]
    return {
        "checkpoint": checkpoint,
        "output": root / "fsdp",
        "fsdp": _run(accelerate, root, checkpoint, workspace, "fsdp"),
        "ddp": _run(torchrun, root, checkpoint, workspace, "ddp"),
    }


def _training_logs(rank: dict) -> list[dict]:
    return [entry for entry in rank["logs"] if "loss" in entry]


def test_every_parameter_is_split_between_the_two_ranks(runs):
    layers = json.loads((runs["checkpoint"] / "config.json").read_text())["num_hidden_layers"]
    for rank in runs["fsdp"]:
        sharding = rank["sharding"]
        # One unit per decoder layer (encoder, concept and decoder layers alike) and the root; accelerate
        # also gives the embeddings and the final norm with the LM head units of their own.
        units = sharding["units"]
        assert "" in units and len([name for name in units if "_layers." in name]) == layers, units
        assert all(sharding["distributed"].values()), sharding["distributed"]
    first, second = (rank["sharding"] for rank in runs["fsdp"])
    for name, full in first["full"].items():
        # FSDP2 splits dim 0 into two padded halves: each rank holds at most ceil(rows / 2) rows.
        rows = runs["fsdp"][0]["full_parameters"][name].shape[0]
        row_size = full // rows
        assert first["local"][name] + second["local"][name] == full, name
        assert max(first["local"][name], second["local"][name]) == math.ceil(rows / 2) * row_size, name
    total = sum(first["full"].values())
    assert abs(sum(first["local"].values()) - total / 2) < 0.01 * total
    # The reference run is plain data parallelism: every rank holds every tensor.
    for rank in runs["ddp"]:
        assert rank["sharding"]["units"] == [] and rank["sharding"]["local"] == rank["sharding"]["full"]


def test_each_step_uses_the_ratio_statistics_of_the_global_batch(runs):
    ranks = runs["fsdp"]
    assert [rank["world_size"] for rank in ranks] == [2, 2]
    for step in range(STEPS):
        first, second = (rank["steps"][step] for rank in ranks)
        assert first["micro_batches"] == MICRO_BATCHES
        # Planned before the step's first forward, all-reduced: the same counts on both ranks, and what
        # the step's forwards then used.
        assert torch.equal(first["planned"], second["planned"])
        assert torch.equal(first["counts"], first["planned"]) and torch.equal(
            second["counts"], first["planned"]
        )
        boundaries, _, tokens = first["planned"].tolist()
        window = slice(MICRO_BATCHES * step, MICRO_BATCHES * (step + 1))
        batches = [batch for rank in ranks for batch in rank["micro_batches"][window]]
        assert tokens == sum(batch["tokens"] for batch in batches)
        assert boundaries == sum(round(batch["tokens"] / batch["compression_ratio"]) for batch in batches)
    first_inputs = [rank["inputs"][0]["input_ids"] for rank in ranks]
    assert not torch.equal(*first_inputs), "both ranks trained on the same rows: the test would prove nothing"


def test_the_first_step_statistics_equal_one_process_planning_the_whole_batch(runs):
    """One process, unsharded weights, the four micro-batches of step 1 (both ranks') in one plan."""
    model = ConceptMoEForCausalLM.from_pretrained(runs["checkpoint"]).train()
    micro_batches = [inputs for rank in runs["fsdp"] for inputs in rank["inputs"][:MICRO_BATCHES]]
    accumulator = RatioAccumulator(len(micro_batches))
    accumulator.reset(step_token_count=sum(int(batch["input_ids"].numel()) for batch in micro_batches))
    model.ratio_accumulator = accumulator
    assert plan_ratio_step(model, micro_batches)
    single = accumulator.planned_counts
    sharded = runs["fsdp"][0]["steps"][0]["planned"]
    # Boundary and token counts exactly; the sum of p up to float32 summation order.
    assert sharded[0] == single[0] and sharded[2] == single[2], (sharded, single)
    assert_close(sharded[1], single[1], rtol=0, atol=1e-4)
    assert 0 < single[0] < single[2], "no boundary or every token a boundary: a degenerate check"


def test_losses_statistics_and_weights_match_the_ddp_run(runs):
    fsdp_logs, ddp_logs = ([_training_logs(rank) for rank in runs[name]] for name in ("fsdp", "ddp"))
    assert fsdp_logs[0] == fsdp_logs[1] and len(fsdp_logs[0]) == STEPS
    for sharded, plain in zip(fsdp_logs[0], ddp_logs[0], strict=True):
        for field in LOGGED:
            assert sharded[field] == pytest.approx(plain[field], rel=1e-4, abs=1e-5), (field, sharded, plain)
        assert sharded["loss"] == pytest.approx(sharded["lm_loss"] + 0.03 * sharded["aux_loss"], abs=1e-4)
    for step in range(STEPS):
        sharded, plain = runs["fsdp"][0]["steps"][step]["planned"], runs["ddp"][0]["steps"][step]["planned"]
        assert sharded[0] == plain[0] and sharded[2] == plain[2]
        assert_close(sharded[1], plain[1], rtol=0, atol=1e-4)
    first, second = (rank["full_parameters"] for rank in runs["fsdp"])
    start = ConceptMoEForCausalLM.from_pretrained(runs["checkpoint"]).state_dict()
    moved = 0
    for name, value in first.items():
        assert torch.equal(value, second[name]), name
        assert_close(value, runs["ddp"][0]["full_parameters"][name], rtol=0, atol=1e-5)
        moved += not torch.equal(value, start[name])
    assert moved == len(first), "some parameters never changed: the comparison would be empty for them"


def test_the_saved_weights_are_the_trained_model(runs):
    """FULL_STATE_DICT: the main process writes whole tensors, gathered from both ranks' shards."""
    trained = runs["fsdp"][0]
    reloaded = ConceptMoEForCausalLM.from_pretrained(runs["output"]).eval()
    state = reloaded.state_dict()
    for name, value in trained["full_parameters"].items():
        assert torch.equal(state[name], value), name
    with torch.no_grad():
        logits = reloaded(input_ids=probe_input_ids(reloaded.config.vocab_size)).logits
    assert_close(logits, trained["logits"], rtol=0, atol=1e-5)
    assert_close(runs["fsdp"][1]["logits"], trained["logits"], rtol=0, atol=0)


def test_the_saved_folder_loads_as_remote_code(runs):
    """FSDP2 saves through torch's wrapper class (FSDPConceptMoEForCausalLM); `restore_remote_code` puts the
    model's own modules and class back, so the folder loads without hf_concept's classes."""
    folder = runs["output"]
    auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModelForCausalLM"] == "modeling_conceptmoe.ConceptMoEForCausalLM", auto_map
    assert (folder / "modeling_conceptmoe.py").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert type(reloaded).__module__.startswith("transformers_modules"), "not loaded as remote code"
    with torch.no_grad():
        logits = reloaded(input_ids=probe_input_ids(reloaded.config.vocab_size)).logits
    assert_close(logits, runs["fsdp"][0]["logits"], rtol=0, atol=1e-5)
