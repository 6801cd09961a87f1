"""`hf-concept train`: single-process runs of the real command on tiny models (a config from scratch, a
checkpoint with LoRA, DLCM with μP, LSLM with its interleaved schedule), the data readers, bad inputs, and a
two-process torchrun (gloo, CPU) run with a global ratio loss."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from hf_concept import cli
from hf_concept.modeling.modeling_conceptmoe import ConceptMoEForCausalLM
from hf_concept.training.recipes import TrainSetupError, read_documents
from tests.conformance.families import _conceptmoe_config, _dlcm_config
from tests.workers.train_worker import RECORD_DIR_ENV, RecordRun

REPO = Path(__file__).resolve().parents[1]
WORDS = [
    *("the", "a", "cat", "dog", "bird", "sat", "ran", "sang", "on", "in", "under", "over", "park", "mat"),
    *("tree", "river", "small", "big", "red", "blue", "quick", "slow", "and", "or", "but", "then", "when"),
    *("because", "concept", "token", "chunk", "model", "learns", "groups", "meaning", "words", "into"),
]
RECORDER = "tests.workers.train_worker:RecordRun"


def _paragraphs(seed: int, count: int) -> list[str]:
    generator = random.Random(seed)
    return [
        " ".join(generator.choice(WORDS) for _ in range(generator.randint(4, 60))) + " ."
        for _ in range(count)
    ]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    return make_workspace(tmp_path_factory.mktemp("train"))


def make_workspace(root: Path) -> Path:
    """A word-level tokenizer (ids 0/1/2 = pad/bos/eos, below the tiny configs' vocab of 97) and data."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<pad>", "<s>", "</s>", "<unk>"], show_progress=False)
    tokenizer.train_from_iterator([" ".join(WORDS) + " ."], trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    wrapped.save_pretrained(root / "tokenizer")
    (root / "corpus.txt").write_text("\n\n".join(_paragraphs(0, 40)))
    records = [{"text": text, "id": index} for index, text in enumerate(_paragraphs(1, 24))]
    (root / "records.jsonl").write_text("\n".join(json.dumps(record) for record in records))
    return root


def _train(capsys, *argv: str) -> tuple[int, str, str, dict]:
    """Run `hf-concept train ...` in this process; (exit status, stdout, stderr, the recorded run)."""
    runs_before = len(RecordRun.runs)
    status = cli.main(["train", *map(str, argv), "--callback", RECORDER, "--save-steps", "0"])
    captured = capsys.readouterr()
    run = RecordRun.runs[-1] if len(RecordRun.runs) > runs_before else {}
    return status, captured.out, captured.err, run


def _metric_logs(run: dict) -> list[dict]:
    return [entry for entry in run["logs"] if "loss" in entry]


def _assert_reloads_with_same_logits(folder: Path, model: torch.nn.Module, vocab: int = 97) -> None:
    reloaded = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert type(reloaded).__module__.startswith("transformers_modules"), "not loaded as remote code"
    input_ids = torch.randint(5, vocab, (2, 23), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model.eval()(input_ids=input_ids).logits
        assert_close(reloaded(input_ids=input_ids).logits, expected, atol=1e-5, rtol=1e-5)
    assert not (folder / ".final-staging").exists()
    assert not (folder / "training_args.bin").exists()


def test_config_from_scratch_logs_the_concept_metrics_and_saves_a_loadable_model(
    workspace, tmp_path, capsys, monkeypatch
):
    """(a) A ConceptMoE config file, no tokenizer anywhere (the bundled fallback), packed .txt data,
    gradient accumulation and an eval split."""
    import hf_concept.data.bpe as bpe

    config = _conceptmoe_config(ratio_scope="global")
    config_file = tmp_path / "conceptmoe.json"
    config_file.write_text(config.to_json_string())
    fallback_calls = []
    tokenizer = PreTrainedTokenizerFast.from_pretrained(workspace / "tokenizer")
    monkeypatch.setattr(bpe, "bundled_tokenizer", lambda *args: fallback_calls.append(args) or tokenizer)
    out = tmp_path / "out"
    status, stdout, stderr, run = _train(
        capsys, config_file, "--data", workspace / "corpus.txt", "--output-dir", out,
        "--max-steps", "3", "--logging-steps", "1", "--per-device-train-batch-size", "4",
        "--gradient-accumulation-steps", "2", "--block-size", "32", "--eval-split-fraction", "0.2",
        "--learning-rate", "3e-3",
    )  # fmt: skip
    assert status == 0, stderr
    assert fallback_calls == [()], "the bundled tokenizer was not the fallback"
    logs = _metric_logs(run)
    assert len(logs) == 3
    for entry in logs:
        # Both rates in the training log: the sampled one the step used, the one inference would realise.
        assert {"lm_loss", "aux_loss", "compression_ratio", "inference_compression_ratio"} <= set(entry), (
            entry
        )
        # Shares of the accumulated micro-batches add up to the step's value: lm + λ·aux is the loss.
        assert entry["loss"] == pytest.approx(entry["lm_loss"] + 0.03 * entry["aux_loss"], abs=1e-4)
        assert 1.0 <= entry["compression_ratio"] <= 32
    state = json.loads((out / "checkpoints" / "trainer_state.json").read_text())
    assert [entry["compression_ratio"] for entry in state["log_history"] if "loss" in entry] == [
        entry["compression_ratio"] for entry in logs
    ]
    eval_entry = next(entry for entry in run["logs"] if "eval_loss" in entry)
    assert "eval_compression_ratio" in eval_entry and "eval_aux_loss" not in eval_entry
    assert {"eval_inference_compression_ratio", "eval_sampled_compression_ratio"} <= set(eval_entry)
    table = stdout.splitlines()
    assert any(line.startswith("eval loss") and f"{eval_entry['eval_loss']:.4f}" in line for line in table)
    headline = f"{eval_entry['eval_compression_ratio']:.4f}"
    sampled = f"{eval_entry['eval_sampled_compression_ratio']:.4f}"
    assert any(line.startswith("compression at inference") and headline in line for line in table)
    assert any(line.startswith("compression sampled in training") and sampled in line for line in table)
    card = (out / "README.md").read_text()
    assert f"| realised compression at inference (tokens per concept) | {float(headline):.4g} |" in card
    assert f"| training_sampled_compression | {float(sampled):.4g} |" in card
    _assert_reloads_with_same_logits(out, run["model"])
    assert (out / "tokenizer.json").exists() and (out / "modeling_conceptmoe.py").exists()
    assert (out / "README.md").exists() and "trust_remote_code=True" in (out / "README.md").read_text()
    # Running again into the same folder is refused, and leaves the model as it was.
    before = (out / "model.safetensors").read_bytes()
    status, _, stderr, _ = _train(
        capsys, config_file, "--data", workspace / "corpus.txt", "--output-dir", out
    )
    assert status == 2 and "is not empty (it holds a model" in stderr and "--resume" in stderr
    assert (out / "model.safetensors").read_bytes() == before
    status, _, stderr, run = _train(
        capsys, config_file, "--data", workspace / "corpus.txt", "--output-dir", out, "--max-steps", "1",
        "--overwrite-output-dir", "--seed", "1", "--block-size", "32",
    )  # fmt: skip
    assert status == 0, stderr
    assert (out / "model.safetensors").read_bytes() != before
    _assert_reloads_with_same_logits(out, run["model"])


def test_checkpoint_with_lora_trains_adapters_and_the_router_and_saves_merged(workspace, tmp_path, capsys):
    """(b) A ConceptMoE checkpoint (tokenizer inside), --lora, JSON-lines data, padding instead of packing."""
    torch.manual_seed(0)
    checkpoint = tmp_path / "checkpoint"
    source = ConceptMoEForCausalLM(_conceptmoe_config())
    source.save_pretrained(checkpoint)
    PreTrainedTokenizerFast.from_pretrained(workspace / "tokenizer").save_pretrained(checkpoint)
    out = tmp_path / "out"
    status, _, stderr, run = _train(
        capsys, checkpoint, "--data", workspace / "records.jsonl", "--output-dir", out, "--lora",
        "--lora-r", "4", "--max-steps", "3", "--logging-steps", "1", "--no-packing",
        "--per-device-train-batch-size", "4", "--learning-rate", "1e-2",
    )  # fmt: skip
    assert status == 0, stderr
    trained = set(run["start"])
    assert any("self_attn.q_proj.lora_A" in name for name in trained)
    assert any("self_attn.concept_q_proj.lora_B" in name for name in trained), "joint decoding not adapted"
    assert any("chunker.modules_to_save" in name for name in trained), "the router is not trained"
    assert not any("base_layer" in name or "embed_tokens" in name for name in trained)
    assert {"lm_loss", "aux_loss", "compression_ratio"} <= set(_metric_logs(run)[-1])
    saved = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    names = [name for name, _ in saved.named_parameters()]
    assert not any("lora" in name or "modules_to_save" in name for name in names)
    moved = [
        name
        for name, value in saved.state_dict().items()
        if not torch.equal(value, source.state_dict()[name])
    ]
    assert any("q_proj" in name for name in moved) and any("chunker" in name for name in moved)
    assert not any("mlp" in name for name in moved), "frozen weights changed"
    _assert_reloads_with_same_logits(out, run["model"])


def test_dlcm_with_mup_uses_the_width_scaled_groups(workspace, tmp_path, capsys):
    """(c) A DLCM config folder with mup_base_width: μP param groups, data from a `datasets` folder."""
    import datasets

    config = _dlcm_config(mup_base_width=16)
    config.save_pretrained(tmp_path / "dlcm")
    datasets.Dataset.from_dict({"body": _paragraphs(2, 30)}).save_to_disk(str(tmp_path / "dataset"))
    out = tmp_path / "out"
    status, _, stderr, run = _train(
        capsys, tmp_path / "dlcm", "--data", tmp_path / "dataset", "--text-field", "body",
        "--tokenizer", workspace / "tokenizer", "--output-dir", out, "--max-steps", "2",
        "--logging-steps", "1", "--per-device-train-batch-size", "4", "--learning-rate", "2e-3",
    )  # fmt: skip
    assert status == 0, stderr
    groups = {group["name"]: group for group in run["groups"]}
    assert set(groups) == {"token", "concept", "others"}
    assert groups["token"]["initial_lr"] == pytest.approx(2e-3 / (32 / 16))
    assert groups["concept"]["initial_lr"] == pytest.approx(2e-3 / (48 / 16))
    assert groups["others"]["initial_lr"] == pytest.approx(2e-3)
    assert {"lm_loss", "aux_loss", "compression_ratio"} <= set(_metric_logs(run)[-1])
    _assert_reloads_with_same_logits(out, run["model"])


def test_lslm_config_trains_with_the_interleaved_schedule(workspace, tmp_path, capsys):
    """(d) LSLM (byte tokenizer, update_schedule=2): the router moves only on every third step."""
    from hf_concept.modeling.configuration_lslm import LSLMConfig
    from hf_concept.training.lslm import is_inference_parameter
    from tests.test_lslm_model import TINY

    LSLMConfig(**TINY, update_schedule=2).save_pretrained(tmp_path / "lslm")
    out = tmp_path / "out"
    status, _, stderr, run = _train(
        capsys, tmp_path / "lslm", "--data", workspace / "corpus.txt", "--output-dir", out,
        "--max-steps", "3", "--logging-steps", "1", "--per-device-train-batch-size", "2",
        "--block-size", "96", "--learning-rate", "1e-2",
    )  # fmt: skip
    assert status == 0, stderr
    for entry in _metric_logs(run):
        assert {"lm_loss", "kl_loss", "boundary_rate", "compression_ratio"} <= set(entry), entry
    previous = run["start"]
    for step, snapshot in enumerate(run["snapshots"]):
        moved = {name for name in snapshot if not torch.equal(snapshot[name], previous[name])}
        router = {name for name in moved if is_inference_parameter(name)}
        assert (router == moved) if step % 3 == 2 else (moved and not router), (step, sorted(moved)[:3])
        assert moved
        previous = snapshot
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "ByteTokenizer"
    _assert_reloads_with_same_logits(out, run["model"], vocab=261)


def test_data_readers(workspace, tmp_path):
    text = workspace / "corpus.txt"
    assert read_documents(text) == _paragraphs(0, 40)
    assert read_documents(text, txt_documents="file") == [text.read_text()]
    assert read_documents(workspace / "records.jsonl") == _paragraphs(1, 24)
    (tmp_path / "list.json").write_text(json.dumps([{"content": "one"}, {"content": "two"}]))
    assert read_documents([tmp_path / "list.json"], text_field="content") == ["one", "two"]
    with pytest.raises(TrainSetupError, match="'text' is missing from record 0"):
        read_documents(tmp_path / "list.json")
    (tmp_path / "table.csv").write_text("text\nhello\n")
    with pytest.raises(TrainSetupError, match=r"unsupported suffix '\.csv'"):
        read_documents(tmp_path / "table.csv")


@pytest.mark.parametrize(
    ("case", "named"),
    [("missing data file", "nowhere.txt"), ("bad text field", "'story'"), ("unknown model type", "'gpt9'")],
)
def test_bad_inputs_exit_2_with_one_line_naming_the_problem(workspace, tmp_path, capsys, case, named):
    config = tmp_path / "config.json"
    config.write_text(_conceptmoe_config().to_json_string())
    data = workspace / "records.jsonl"
    extra = []
    if case == "missing data file":
        data = tmp_path / "nowhere.txt"
    elif case == "bad text field":
        extra = ["--text-field", "story"]
    else:
        config.write_text(json.dumps({"model_type": "gpt9", "hidden_size": 8}))
    status, _, stderr, _ = _train(
        capsys, config, "--data", data, "--tokenizer", workspace / "tokenizer", "--output-dir",
        tmp_path / "out", *extra,
    )  # fmt: skip
    assert status == 2
    errors = [line for line in stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("hf-concept train: error:") and named in errors[0], (
        stderr
    )
    assert "Traceback" not in stderr
    assert not (tmp_path / "out").exists()


def test_fsdp_that_accelerate_would_not_apply_is_refused(workspace, tmp_path, capsys, monkeypatch):
    """accelerate keeps DDP on CPU processes when FSDP is asked for; the run stops instead of training
    unsharded, names the cause and leaves no output folder."""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("ACCELERATE_FSDP_VERSION", "2")
    config = tmp_path / "config.json"
    config.write_text(_conceptmoe_config().to_json_string())
    status, _, stderr, _ = _train(
        capsys, config, "--data", workspace / "corpus.txt", "--tokenizer", workspace / "tokenizer",
        "--output-dir", tmp_path / "out", "--max-steps", "1",
    )  # fmt: skip
    assert status == 2, stderr
    assert "FSDP was asked for (ACCELERATE_USE_FSDP=true) but accelerate runs this as" in stderr
    assert "unsharded" in stderr and "Traceback" not in stderr
    assert not (tmp_path / "out").exists()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _train_two_processes(workspace, tmp_path, **config) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """`hf-concept train` of a ConceptMoE under torchrun --nproc_per_node 2 (gloo, CPU): 2 steps of 2
    micro-batches of 2 blocks of 48 tokens per rank, each rank's `RecordRanks` record loaded."""
    _conceptmoe_config(**config).save_pretrained(tmp_path / "config")
    records = tmp_path / "ranks"
    records.mkdir()
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2"]
    address = ["--master_addr", "127.0.0.1", "--master_port", str(_free_port())]
    command = [
        *launcher, *address, "-m", "hf_concept.cli", "train", str(tmp_path / "config"),
        "--data", str(workspace / "corpus.txt"), "--tokenizer", str(workspace / "tokenizer"),
        "--output-dir", str(tmp_path / "out"), "--max-steps", "2", "--logging-steps", "1",
        "--per-device-train-batch-size", "2", "--gradient-accumulation-steps", "2", "--block-size", "48",
        "--save-steps", "0", "--callback", "tests.workers.train_worker:RecordRanks",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **{RECORD_DIR_ENV: str(records)})
    completed = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env, cwd=REPO)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    ranks = [torch.load(records / f"rank{rank}.pt", weights_only=True) for rank in range(2)]
    return completed, ranks


def test_two_processes_share_the_global_ratio_statistics_and_end_identical(workspace, tmp_path):
    """torchrun --nproc_per_node 2 (gloo, CPU) on a ConceptMoE with the global ratio loss."""
    completed, ranks = _train_two_processes(workspace, tmp_path, ratio_scope="global")
    assert [rank["world_size"] for rank in ranks] == [2, 2]
    assert completed.stdout.count("final train loss") == 1, "the summary must come from the main process only"

    for step in range(2):
        first, second = (rank["steps"][step] for rank in ranks)
        # The step's boundary count, sum of p and token count, summed over both ranks' micro-batches.
        assert torch.equal(first["counts"], second["counts"]) and first["micro_batches"] == 2
        # The step was planned before its first forward, and the plan counted what the forwards used.
        assert torch.equal(first["planned"], first["counts"]) and torch.equal(
            second["planned"], first["counts"]
        )
        boundaries, _, tokens = first["counts"].tolist()
        local = [rank["micro_batches"][2 * step : 2 * step + 2] for rank in ranks]
        assert tokens == sum(batch["tokens"] for rank in local for batch in rank)
        local_opens = [
            round(batch["tokens"] / batch["compression_ratio"]) for rank in local for batch in rank
        ]
        assert boundaries == sum(local_opens)
    local_tokens = [[batch["tokens"] for batch in rank["micro_batches"]] for rank in ranks]
    assert local_tokens[0] != local_tokens[1], "the ranks saw the same data: the test would prove nothing"

    logs = [[entry for entry in rank["logs"] if "loss" in entry] for rank in ranks]
    assert logs[0] == logs[1] and len(logs[0]) == 2
    for step, entry in enumerate(logs[0]):
        batches = [batch for rank in ranks for batch in rank["micro_batches"][2 * step : 2 * step + 2]]
        # Tokens per concept over the step: all its tokens over all its concepts.
        tokens = sum(batch["tokens"] for batch in batches)
        concepts = sum(batch["tokens"] / batch["compression_ratio"] for batch in batches)
        assert entry["compression_ratio"] == pytest.approx(tokens / concepts, abs=2e-6)
        assert entry["lm_loss"] == pytest.approx(sum(batch["lm_loss"] for batch in batches), abs=2e-5)
        assert entry["loss"] == pytest.approx(entry["lm_loss"] + 0.03 * entry["aux_loss"], abs=1e-4)

    parameters = [rank["parameters"] for rank in ranks]
    assert parameters[0].keys() == parameters[1].keys()
    for name, value in parameters[0].items():
        assert torch.equal(value, parameters[1][name]), name
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True)
    for name, value in saved.named_parameters():
        assert torch.equal(value, parameters[0][name]), name


@pytest.mark.parametrize("scope", ["sequence", "batch"])
def test_two_processes_with_a_local_scope_add_the_micro_batch_shares(workspace, tmp_path, scope):
    """torchrun --nproc_per_node 2 with ratio_scope="sequence" or "batch": each rank's micro-batch adds its
    share of the step's label tokens, so the logged ratio loss is the sum of the four shares and the loss
    is lm_loss + λ·aux_loss, the same on both ranks, with identical parameters at the end."""
    _, ranks = _train_two_processes(workspace, tmp_path, ratio_scope=scope)
    logs = [[entry for entry in rank["logs"] if "loss" in entry] for rank in ranks]
    assert logs[0] == logs[1] and len(logs[0]) == 2
    for step, entry in enumerate(logs[0]):
        batches = [batch for rank in ranks for batch in rank["micro_batches"][2 * step : 2 * step + 2]]
        assert entry["aux_loss"] == pytest.approx(sum(batch["aux_loss"] for batch in batches), abs=2e-6)
        assert entry["aux_loss"] > 0
        assert entry["loss"] == pytest.approx(entry["lm_loss"] + 0.03 * entry["aux_loss"], abs=1e-4)
    for name, value in ranks[0]["parameters"].items():
        assert torch.equal(value, ranks[1]["parameters"][name]), name


def test_python_api_trains_hidden_decoding_from_a_config_object(workspace, tmp_path):
    """`train(...)` with a config object, a tokenizer object and separate eval data (Hidden Decoding)."""
    from hf_concept.training.recipes import train
    from tests.conformance.families import _hidden_decoding_config

    tokenizer = PreTrainedTokenizerFast.from_pretrained(workspace / "tokenizer")
    result = train(
        _hidden_decoding_config(),
        [workspace / "records.jsonl"],
        tmp_path / "hd",
        tokenizer=tokenizer,
        eval_data=workspace / "corpus.txt",
        block_size=32,
        max_steps=2,
        per_device_train_batch_size=4,
        logging_steps=1,
        save_steps=0,
        disable_tqdm=True,
    )
    assert result.global_step == 2 and result.is_main_process
    assert result.eval_loss is not None and result.eval_loss > 0 and result.compression is None
    assert [entry["step"] for entry in result.log_history if "loss" in entry] == [1, 2]
    assert "| n/a (Hidden Decoding has no concepts)" in result.summary_table()
    assert f"{result.eval_loss:.4f}" in result.summary_table()
    _assert_reloads_with_same_logits(tmp_path / "hd", result.model)
