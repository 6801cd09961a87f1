"""`hf-concept demo`: the main job runs end to end, prints its table and writes loadable checkpoints."""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_concept.cli import main
from tests.fresh_process import fresh_process_logits

ROWS = ("source", "ConceptMoE", "HD")
CLASSES = {
    "source": "LlamaForCausalLM",
    "conceptmoe": "ConceptMoEForCausalLM",
    "hidden_decoding": "HiddenDecodingForCausalLM",
}
NUMBER = r"[-+]?(?:\d[\d,]*\.?\d*|nan|inf)"


def table_rows(output: str) -> dict[str, list[float]]:
    """Row name -> [eval loss, tokens/concept, KV bytes, KV x src, prefill x, decode x] of the table."""
    rows = {}
    for line in output.splitlines():
        match = re.fullmatch(rf"({'|'.join(ROWS)})\s+((?:{NUMBER}\s*){{6}})", line.strip())
        if match:
            rows[match[1]] = [float(value.replace(",", "")) for value in match[2].split()]
    return rows


def check_table(output: str, num_streams: int = 2) -> dict[str, list[float]]:
    rows = table_rows(output)
    assert list(rows) == list(ROWS), output[-3000:]
    for name, values in rows.items():
        assert all(math.isfinite(value) and value > 0 for value in values), (name, values)
    source, conceptmoe, hidden_decoding = rows["source"], rows["ConceptMoE"], rows["HD"]
    assert source[1] == 1.0 and source[3:] == [1.0, 1.0, 1.0]
    assert hidden_decoding[1] == 1.0
    # Hidden Decoding keeps n positions per token in every layer's cache.
    assert hidden_decoding[3] == pytest.approx(num_streams, abs=0.01)
    assert conceptmoe[1] > 1.0
    for values in rows.values():
        assert values[0] < math.log(3072), "no better than a uniform guess over the vocabulary"
        assert values[3] == pytest.approx(values[2] / source[2], abs=0.01)
    return rows


@pytest.fixture(scope="module")
def quick_demo(tmp_path_factory):
    """Run `hf-concept demo --quick` once; (output folder, what it printed to stdout)."""
    folder = tmp_path_factory.mktemp("demo")
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setenv("HF_CONCEPT_CACHE", str(tmp_path_factory.mktemp("cache")))
        status = main(["demo", "--quick", "--output-dir", str(folder)])
    assert status == 0, printed.getvalue()[-3000:]
    return folder, printed.getvalue()


def test_quick_demo_prints_one_table_with_three_rows_of_finite_numbers(quick_demo):
    _, output = quick_demo
    check_table(output)
    assert output.count("eval loss") == 1
    for stage in ("generate with the caches", "segmentation", "fresh process"):
        assert stage in output
    generated = re.findall(r"^  \[(source|ConceptMoE|HD)\] (['\"])(.*)\2$", output, flags=re.MULTILINE)
    assert [name for name, _, _ in generated] == list(ROWS)
    assert all(text.startswith("Every morning at six, the") for _, _, text in generated)


def test_quick_demo_checkpoints_load_with_trust_remote_code_in_a_fresh_process(quick_demo, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, _ = quick_demo
    batch = {"input_ids": torch.tensor([[1, 40, 300, 7, 912, 15, 2048, 5, 88, 601]])}
    for name, class_name in CLASSES.items():
        checkpoint = folder / name
        assert (checkpoint / "tokenizer.json").is_file() and (checkpoint / "config.json").is_file()
        assert (checkpoint / "README.md").is_file()
        (tmp_path / name).mkdir()
        fresh = fresh_process_logits(tmp_path / name, {name: str(checkpoint)}, batch, class_name)[name]
        model = AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True).eval()
        with torch.no_grad():
            expected = model(**batch).logits
        torch.testing.assert_close(fresh, expected, atol=1e-5, rtol=1e-5)
        # The README's snippet: the checkpoint's own tokenizer, cached generation.
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        inputs = tokenizer("Every morning at six, the", return_tensors="pt")
        output = model.generate(**inputs, max_new_tokens=5, do_sample=False)
        assert output.shape == (1, inputs["input_ids"].shape[1] + 5)
        assert tokenizer.decode(output[0], skip_special_tokens=True).startswith("Every morning at six, the")
    assert sorted(path.name for path in folder.iterdir()) == sorted(CLASSES)


def test_the_quick_demos_source_serves_the_readme_quickstart(quick_demo, tmp_path, monkeypatch, capsys):
    """The README's offline route: `demo-quick/source` as `llama-checkpoint`, a bundled text as corpus."""
    import shlex
    import shutil

    from hf_concept.data import corpus
    from tests.test_quickstart import FAST, quickstart_blocks

    folder, _ = quick_demo
    shutil.copytree(folder / "source", tmp_path / "llama-checkpoint")
    bundled = Path(corpus.__file__).parent / "corpus" / "essays_en.txt"
    shutil.copyfile(bundled, tmp_path / "corpus.txt")
    monkeypatch.chdir(tmp_path)
    lines = [
        line for language, code in quickstart_blocks("ConceptMoE") if language == "sh"
        for line in code.splitlines() if line.startswith("hf-concept ")
    ]  # fmt: skip
    assert len(lines) == 5
    for line in lines:
        argv = shlex.split(line)[1:]
        status = main(argv + FAST.get(argv[0], []))
        assert status == 0, f"{line}\n{capsys.readouterr().err[-2000:]}"


def test_the_segmentation_has_a_simple_view_when_hf_concept_segmentation_is_missing(
    quick_demo, capsys, monkeypatch
):
    from transformers import AutoTokenizer

    from hf_concept.commands import demo
    from hf_concept.modeling.modeling_conceptmoe import ConceptMoEForCausalLM

    folder, _ = quick_demo
    model = ConceptMoEForCausalLM.from_pretrained(folder / "conceptmoe").eval()
    tokenizer = AutoTokenizer.from_pretrained(folder / "conceptmoe")
    monkeypatch.setitem(sys.modules, "hf_concept.segmentation", None)
    demo.show_segmentation(model, tokenizer)
    printed = capsys.readouterr().out
    marked = re.search(r"simple view; '\|' opens a concept\): (.*)", printed)[1]
    assert marked.replace("|", "") == demo.SEGMENT_SENTENCE
    assert marked.startswith("|")
    tokens, concepts = map(int, re.search(r"(\d+) tokens, (\d+) concepts", printed).groups())
    assert marked.count("|") == concepts < tokens


def test_without_output_dir_the_checkpoints_go_to_a_temporary_folder_that_is_removed(monkeypatch):
    from hf_concept.commands import demo

    seen = []

    def fake_run(output_dir, sizes, seed, keep):
        (output_dir / "source").mkdir()
        seen.append((output_dir, sizes, seed, keep))
        return 0

    monkeypatch.setattr(demo, "_run_in", fake_run)
    assert main(["demo", "--quick", "--seed", "3"]) == 0
    [(folder, sizes, seed, keep)] = seen
    assert (sizes, seed, keep) == (demo.QUICK, 3, False)
    assert folder.name.startswith("hf-concept-demo-") and not folder.exists()


@pytest.mark.parametrize("omp_setting", [None, "2"])
def test_a_busy_machine_runs_single_threaded_unless_omp_num_threads_is_set(omp_setting, monkeypatch, capsys):
    from hf_concept.commands import demo

    monkeypatch.setattr(os, "getloadavg", lambda: (3.0, 3.0, 3.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    if omp_setting is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp_setting)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        demo._threads_for_load()
        assert torch.get_num_threads() == (1 if omp_setting is None else 2)
    finally:
        torch.set_num_threads(threads)
    note = capsys.readouterr().out
    assert "the machine is busy (load average 3.0 on 2 cores)" in note
    assert ("running on 1 thread" in note) == (omp_setting is None)


def test_an_output_dir_that_is_a_file_is_refused(tmp_path, capsys):
    target = tmp_path / "taken"
    target.write_text("not a folder")
    assert main(["demo", "--quick", "--output-dir", str(target)]) == 2
    assert "hf-concept demo: error: --output-dir" in capsys.readouterr().err
    assert target.read_text() == "not a folder"


@pytest.mark.slow
def test_full_demo_runs_end_to_end(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "hf_concept", "demo", "--output-dir", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=1200,
        env={**os.environ, "HF_CONCEPT_CACHE": str(tmp_path / "cache")},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = check_table(result.stdout)
    # With the default step counts the source model gets well below a uniform guess (ln 3072 = 8.0).
    assert rows["source"][0] < 6.5
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == sorted(CLASSES)
