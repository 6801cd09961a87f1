"""Distillation from the source (`hf_concept.training.distillation`): each term against a plain reference
with its gradient rule, no gradient into the teacher, and a tiny converted ConceptMoE whose KL to its
source falls under `DistillationTrainer`."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch.testing import assert_close
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, TrainingArguments

from hf_concept import cli
from hf_concept.conversion.conceptmoe import convert_to_conceptmoe
from hf_concept.modeling.modeling_conceptmoe import ConceptMoEForCausalLM
from hf_concept.training.data import data_collator
from hf_concept.training.distillation import (
    DistillationTrainer,
    alignment_pairs,
    distillation_kl,
    hidden_alignment,
    label_positions,
)
from hf_concept.training.recipe_trainer import RecipeTrainer
from tests.test_convert_conceptmoe import TINY_LLAMA
from tests.test_train_command import REPO, _free_port, make_workspace
from tests.workers.train_worker import RECORD_DIR_ENV


def logits_pair(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    student = torch.randn(2, 5, 11, generator=generator, requires_grad=True)
    teacher = (3 * torch.randn(2, 5, 11, generator=generator)).requires_grad_(True)
    positions = torch.tensor([[1, 1, 1, 1, 0], [0, 1, 1, 0, 0]], dtype=torch.bool)
    return student, teacher, positions


def test_label_positions_are_the_logits_that_predict_a_label():
    labels = torch.tensor([[-100, 5, 6, -100], [7, 8, 9, 10]])
    expected = torch.tensor([[True, True, False, False], [True, True, True, False]])
    assert torch.equal(label_positions(labels), expected)


@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_kl_equals_torch_kl_div_and_its_gradient_rule(temperature):
    student, teacher, positions = logits_pair()
    value = distillation_kl(student, teacher, positions, temperature)
    log_q = F.log_softmax(student[positions] / temperature, -1)
    log_p = F.log_softmax(teacher[positions] / temperature, -1)
    reference = F.kl_div(log_q, log_p, log_target=True, reduction="sum") * temperature**2 / positions.sum()
    assert_close(value, reference)
    value.backward()
    # T · (q − p) / N at the positions, zero elsewhere; the teacher gets nothing.
    expected = torch.zeros_like(student)
    expected[positions] = temperature * (log_q.exp() - log_p.exp()).detach() / positions.sum()
    assert_close(student.grad, expected)
    assert teacher.grad is None
    # A given normalizer (the step's label count) replaces the local count.
    assert_close(
        distillation_kl(student, teacher, positions, temperature, 14), reference * positions.sum() / 14
    )


def test_kl_is_zero_when_the_student_is_the_teacher():
    _, teacher, positions = logits_pair()
    assert distillation_kl(teacher.detach(), teacher, positions).abs() < 1e-6


def test_hidden_alignment_equals_one_minus_cosine_and_leaves_the_teacher_alone():
    generator = torch.Generator().manual_seed(3)
    student = torch.randn(2, 5, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(2, 5, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    positions = torch.tensor([[1, 0, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    cosine = F.cosine_similarity(student[positions], teacher[positions], dim=-1)
    assert_close(hidden_alignment(student, teacher, positions).double(), (1 - cosine).mean())
    assert torch.autograd.gradcheck(lambda s: hidden_alignment(s, teacher, positions).double(), (student,))
    hidden_alignment(student, teacher, positions).backward()
    assert teacher.grad is None and student.grad[~positions].abs().sum() == 0


def tiny_pair(tmp_path) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A tiny Llama with peaked next-token distributions (its LM head scaled up) and its ConceptMoE
    conversion at R = 2 (compressing: the two disagree)."""
    torch.manual_seed(0)
    source = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    with torch.no_grad():
        source.lm_head.weight *= 8
    source.save_pretrained(tmp_path / "source")
    source = tmp_path / "source"
    converted = convert_to_conceptmoe(source, tmp_path / "converted", encoder_layers=1, decoder_layers=1)
    return LlamaForCausalLM.from_pretrained(source), ConceptMoEForCausalLM.from_pretrained(converted)


def teacher_text(teacher: torch.nn.Module, count: int, seed: int = 0) -> list[dict[str, list[int]]]:
    """`count` rows of 24 tokens sampled from the teacher: text the source models well, as real text is."""
    torch.manual_seed(seed)
    prompts = torch.randint(3, 128, (count, 1))
    rows = teacher.generate(
        prompts, attention_mask=torch.ones_like(prompts), do_sample=True, max_new_tokens=23
    )
    return [{"input_ids": row.tolist()} for row in rows]


class Tokens:
    """The collator's tokenizer stand-in: pads with 0."""

    pad_token_id = 0


@torch.no_grad()
def kl_to(teacher: torch.nn.Module, student: torch.nn.Module, rows: list[dict[str, list[int]]]) -> float:
    """The mean KL(teacher ‖ student) per position over `rows`, both in eval mode."""
    input_ids = torch.tensor([row["input_ids"] for row in rows])
    student.eval()
    positions = torch.ones_like(input_ids, dtype=torch.bool)
    return float(distillation_kl(student(input_ids).logits, teacher(input_ids).logits, positions))


def trained(tmp_path, teacher, student, rows, **distill: float) -> torch.nn.Module:
    """`student` after 30 steps on `rows`: with the teacher's terms when `distill` is given, else the LM
    loss alone (the same batches, seed and schedule)."""
    arguments = TrainingArguments(
        output_dir=str(tmp_path / "run"),
        max_steps=30,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        logging_steps=10,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    common = dict(
        model=student, args=arguments, train_dataset=rows, data_collator=data_collator(Tokens(), False)
    )
    trainer = (
        DistillationTrainer(**common, teacher_model=teacher, **distill)
        if distill
        else RecipeTrainer(**common)
    )
    trainer.train()
    if distill:
        logged = [entry for entry in trainer.state.log_history if "distill_loss" in entry]
        assert len(logged) == 3 and ("align_loss" in logged[0]) == (distill.get("align_hidden", 0) > 0)
    return trainer.model


@pytest.mark.parametrize("align_hidden", [0.0, 0.5])
def test_distilling_brings_the_conversion_closer_to_its_source_and_never_touches_it(tmp_path, align_hidden):
    teacher, student = tiny_pair(tmp_path)
    before = {name: tensor.clone() for name, tensor in teacher.state_dict().items()}
    rows, held = teacher_text(teacher, 64), teacher_text(teacher, 16, seed=1)
    lm_only = kl_to(teacher, trained(tmp_path, teacher, copy.deepcopy(student), rows), held)
    distilled = trained(tmp_path, teacher, student, rows, distill_temperature=2.0, align_hidden=align_hidden)
    ended = kl_to(teacher, distilled, held)
    # Training moves the tiny conversion away from its source either way; the teacher's terms keep it
    # closer than the LM loss alone on the same batches (measured: 0.17 and 0.15 against 0.24).
    assert ended < 0.8 * lm_only, (lm_only, ended)
    assert all(not parameter.requires_grad and parameter.grad is None for parameter in teacher.parameters())
    for name, tensor in teacher.state_dict().items():
        assert torch.equal(tensor, before[name]), name


# The command: hf-concept train CONVERTED --distill-from SOURCE.


@pytest.fixture(scope="module")
def distill_workspace(tmp_path_factory) -> Path:
    """The train tests' word tokenizer and text, a tiny Llama source saved with that tokenizer, and its
    ConceptMoE conversion (which copies the tokenizer)."""
    root = make_workspace(tmp_path_factory.mktemp("distill"))
    tokenizer = AutoTokenizer.from_pretrained(root / "tokenizer")
    torch.manual_seed(0)
    source = LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, "vocab_size": 97}))
    with torch.no_grad():
        source.lm_head.weight *= 8  # peaked distributions, as `tiny_pair`'s: the conversion then differs
    source.save_pretrained(root / "source")
    tokenizer.save_pretrained(root / "source")
    convert_to_conceptmoe(root / "source", root / "converted", encoder_layers=1, decoder_layers=1)
    return root


def run_train(*argv: object) -> int:
    return cli.main(["train", *map(str, argv)])


def test_the_command_distills_and_saves_the_student_only(distill_workspace, tmp_path, capsys):
    root, out = distill_workspace, tmp_path / "out"
    argv = [root / "converted", "--data", root / "corpus.txt", "--output-dir", out, "--max-steps", "2"]
    teaching = ["--distill-from", root / "source", "--distill-temperature", "2", "--align-hidden", "0.5"]
    assert run_train(*argv, *teaching, "--logging-steps", "1", "--save-steps", "2", "--block-size", "32") == 0
    history = json.loads((out / "checkpoints" / "checkpoint-2" / "trainer_state.json").read_text())[
        "log_history"
    ]
    logged = [entry for entry in history if "distill_loss" in entry]
    assert len(logged) == 2 and all(entry["distill_loss"] > 0 and "align_loss" in entry for entry in logged)
    # The student alone is saved: the converted model's parameters, no teacher tensor.
    student_keys = set(ConceptMoEForCausalLM.from_pretrained(root / "converted").state_dict())
    with safe_open(out / "model.safetensors", "pt") as saved:
        assert set(saved.keys()) <= student_keys
    settings = json.loads((out / "checkpoints" / "checkpoint-2" / "run_settings.json").read_text())
    assert settings["distill_from"] == str(root / "source")
    # Resuming the distilled run without its teacher is refused, naming the flag; nothing changes.
    capsys.readouterr()
    listing = sorted(str(path) for path in out.rglob("*"))
    assert run_train(*argv[:-1], "4", "--resume", "--save-steps", "2", "--block-size", "32") == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and "resume it with --distill-from SOURCE" in errors[0], errors
    assert sorted(str(path) for path in out.rglob("*")) == listing
    # With its teacher it resumes (the checkpoint's config holds the pad id Trainer set from the tokenizer).
    assert run_train(*argv[:-1], "4", *teaching, "--resume", "--save-steps", "2", "--block-size", "32") == 0
    assert (out / "checkpoints" / "checkpoint-4").is_dir()


def other_source(root: Path, folder: Path, vocab_size: int = 97, words: tuple[str, ...] = ()) -> Path:
    """A source like the workspace's, with another vocabulary size or a tokenizer with other words."""
    torch.manual_seed(1)
    LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, "vocab_size": vocab_size})).save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(root / "tokenizer")
    if words:
        tokenizer.add_tokens(list(words))
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    ("case", "named"),
    [
        ("vocabulary", "its vocabulary has 101 ids and the model's 97"),
        ("tokenizer", "its tokenizer differs from the model's"),
        ("no source", "--distill-temperature and --align-hidden go with --distill-from SOURCE"),
        ("temperature", "--distill-temperature 0.0 must be a positive finite number"),
        ("infinite temperature", "--distill-temperature inf must be a positive finite number"),
    ],
)
def test_a_source_that_cannot_teach_is_refused_in_one_line(distill_workspace, tmp_path, capsys, case, named):
    root, out = distill_workspace, tmp_path / "out"
    argv = [root / "converted", "--data", root / "corpus.txt", "--output-dir", out, "--max-steps", "1"]
    extra = {
        "vocabulary": lambda: ["--distill-from", other_source(root, tmp_path / "src", vocab_size=101)],
        "tokenizer": lambda: ["--distill-from", other_source(root, tmp_path / "src", words=("zebra",))],
        "no source": lambda: ["--align-hidden", "0.5"],
        "temperature": lambda: ["--distill-from", root / "source", "--distill-temperature", "0"],
        "infinite temperature": lambda: ["--distill-from", root / "source", "--distill-temperature", "inf"],
    }[case]()
    capsys.readouterr()
    assert run_train(*argv, *extra) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and named in errors[0], errors
    assert not out.exists()


def test_distillation_with_lora_the_held_ratio_and_accumulation_lowers_the_kl(distill_workspace, tmp_path):
    root = distill_workspace
    argv = [root / "converted", "--data", root / "corpus.txt", "--max-steps", "12", "--block-size", "32"]
    options = [
        "--lora",
        "--hold-ratio",
        "--gradient-accumulation-steps",
        "2",
        "--per-device-train-batch-size",
        "2",
    ]
    options += ["--learning-rate", "3e-3", "--logging-steps", "1", "--save-steps", "12"]
    teaching = ["--distill-from", root / "source"]
    assert run_train(*argv, *options, *teaching, "--output-dir", tmp_path / "distilled") == 0
    assert run_train(*argv, *options, "--output-dir", tmp_path / "lm") == 0
    state = json.loads(
        (tmp_path / "distilled" / "checkpoints" / "checkpoint-12" / "trainer_state.json").read_text()
    )
    logged = [entry for entry in state["log_history"] if "distill_loss" in entry]
    assert len(logged) == 12 and all(entry["distill_loss"] > 0 for entry in logged)
    # On paragraphs neither run trained on, the merged distilled student is closer to its source than the
    # same recipe without the teacher (same batches and seed; measured 0.27 against 0.61).
    tokenizer = AutoTokenizer.from_pretrained(root / "converted")
    texts = [json.loads(line)["text"] for line in (root / "records.jsonl").read_text().splitlines()]
    held = [{"input_ids": ids[:24]} for ids in tokenizer(texts)["input_ids"] if len(ids) >= 24]
    source = LlamaForCausalLM.from_pretrained(root / "source").eval()
    lm_only, distilled = (
        kl_to(source, ConceptMoEForCausalLM.from_pretrained(tmp_path / name), held)
        for name in ("lm", "distilled")
    )
    assert distilled < 0.8 * lm_only, (lm_only, distilled)


def test_a_lossy_hidden_decoding_conversion_is_taught_by_its_source(tmp_path):
    """Local layers with a window shorter than the text depart from a full-attention source (a notice says
    so at conversion): the teacher's terms apply to Hidden Decoding as they do to ConceptMoE."""
    from hf_concept.conversion.hidden_decoding import convert_to_hidden_decoding
    from hf_concept.modeling.modeling_hidden_decoding import HiddenDecodingForCausalLM

    torch.manual_seed(0)
    source = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    with torch.no_grad():
        source.lm_head.weight *= 8
    source.save_pretrained(tmp_path / "source")
    folder = convert_to_hidden_decoding(
        tmp_path / "source", tmp_path / "hd", num_streams=2, stream_attention_layout="llfi", local_window=2
    )
    teacher, student = source.eval(), HiddenDecodingForCausalLM.from_pretrained(folder)
    rows = teacher_text(teacher, 16)
    with torch.no_grad():
        input_ids = torch.tensor([row["input_ids"] for row in rows])
        assert distillation_kl(student(input_ids).logits, teacher(input_ids).logits, input_ids > 0) > 1e-3
    model = trained(tmp_path, teacher, student, rows, align_hidden=0.5)
    assert all(parameter.grad is None for parameter in teacher.parameters()) and model is not None


def test_two_processes_distil_with_the_step_shares_and_end_identical(distill_workspace, tmp_path):
    """torchrun --nproc_per_node 2 (gloo, CPU), 2 micro-batches per step: the KL term is a share of the
    step's label count like the LM loss, so the logged loss is their sum plus the ratio term, and both
    ranks log and end the same."""
    root, records = distill_workspace, tmp_path / "ranks"
    records.mkdir()
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2"]
    address = ["--master_addr", "127.0.0.1", "--master_port", str(_free_port())]
    command = [
        *launcher, *address, "-m", "hf_concept.cli", "train", str(root / "converted"),
        "--data", str(root / "corpus.txt"), "--output-dir", str(tmp_path / "out"), "--max-steps", "2",
        "--logging-steps", "1", "--per-device-train-batch-size", "2", "--gradient-accumulation-steps", "2",
        "--block-size", "32", "--save-steps", "0", "--distill-from", str(root / "source"),
        "--callback", "tests.workers.train_worker:RecordRanks",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **{RECORD_DIR_ENV: str(records)})
    completed = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    ranks = [torch.load(records / f"rank{rank}.pt", weights_only=True) for rank in range(2)]
    logs = [[entry for entry in rank["logs"] if "loss" in entry] for rank in ranks]
    assert logs[0] == logs[1] and len(logs[0]) == 2
    weight = json.loads((root / "converted" / "config.json").read_text())["aux_loss_weight"]
    for entry in logs[0]:
        total = entry["lm_loss"] + weight * entry["aux_loss"] + entry["distill_loss"]
        assert entry["distill_loss"] > 0 and entry["loss"] == pytest.approx(total, abs=1e-4), entry
    for name, value in ranks[0]["parameters"].items():
        assert torch.equal(value, ranks[1]["parameters"][name]), name


def test_hidden_alignment_pairs_the_decoder_layers_with_the_source_layers_they_copy(tmp_path):
    """An exact conversion (fixed chunks of one token, the concept stage a pass-through of the source's
    middle layers) gives each paired state exactly the source's: every pair aligns to 0 at step 0, and a
    pair shifted by one layer does not, so the map is what makes the term small."""
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).save_pretrained(tmp_path / "source")
    convert_to_conceptmoe(
        tmp_path / "source", tmp_path / "exact", encoder_layers=1, decoder_layers=2, chunking="fixed",
        compression_ratio=1,
    )  # fmt: skip
    teacher = LlamaForCausalLM.from_pretrained(tmp_path / "source").eval()
    student = ConceptMoEForCausalLM.from_pretrained(tmp_path / "exact").eval()
    ids = torch.randint(3, TINY_LLAMA["vocab_size"], (2, 12))
    with torch.no_grad():
        ours = student(input_ids=ids, output_hidden_states=True).hidden_states
        theirs = teacher(input_ids=ids, output_hidden_states=True).hidden_states
    pairs = alignment_pairs(student.config, len(theirs) - 1)
    assert pairs == [(3, 3), (4, 4)]  # embeddings, 1 encoder layer, 1 concept pass; source layers 2 and 3
    everywhere = torch.ones(2, 12, dtype=torch.bool)
    for mine, source in pairs:
        assert float(hidden_alignment(ours[mine], theirs[source], everywhere)) < 1e-5
    assert float(hidden_alignment(ours[3], theirs[2], everywhere)) > 1e-3
