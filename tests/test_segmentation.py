"""`segment_text` and `hf-concept segment`: the openings shown are the ones the model's forward used.

Checked against the forward itself: forced fixed chunking (R = 2) opens every second token; with the
learned routers the view's tokens per concept equal the `compression_ratio` the causal-LM forward
reports and its openings equal the backbone's `boundaries`; a model left in training mode is read in eval
mode (no boundary noise) and handed back in training mode. The views (`|` text, ANSI colours, HTML, PNG)
render those openings (the HTML page's heatmap: tests/test_segment_html.py); Hidden Decoding prints its
stream probe table; families without boundaries and impossible outputs are refused with one line.
"""

from __future__ import annotations

import html
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

from hf_concept.cli import main
from hf_concept.modeling.tokenization_lslm import ByteTokenizer
from hf_concept.probes import probe_streams
from hf_concept.segmentation import NoSegmentationError, SegmentationView, segment_text, token_pieces
from tests.conformance.families import FAMILIES
from tests.test_generate_command import VOCAB_SIZE, bpe_tokenizer, save_checkpoint

SPECS = {spec.name: spec for spec in FAMILIES}
TEXT = "The quick brown fox jumps over the lazy dog. if a < b && c > d: print('x & y')"
CONCEPT_FAMILIES = ("conceptmoe-first", "conceptmoe-mean", "dlcm", "dlcm-rule-mup")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def tiny_model(family: str, **overrides) -> torch.nn.Module:
    spec = SPECS[family]
    torch.manual_seed(0)
    return spec.model_class()(spec.make_config(**{"vocab_size": VOCAB_SIZE, **overrides})).eval()


@pytest.fixture(scope="module")
def tokenizer():
    return bpe_tokenizer()


@pytest.mark.parametrize("family", ["conceptmoe-first", "dlcm"])
def test_fixed_chunking_opens_every_second_token(tokenizer, family):
    model = tiny_model(family, chunking="fixed", compression_ratio=2.0)
    view = segment_text(model, tokenizer, TEXT)
    assert view.opens == [index % 2 == 0 for index in range(len(view.opens))]
    assert set(view.concept_lengths()[:-1]) == {2} and view.stats()["max"] == 2


@pytest.mark.parametrize("family", CONCEPT_FAMILIES)
def test_openings_are_the_forwards_boundaries(tokenizer, family):
    # The rule router's threshold is set where random token states give concepts of several tokens.
    model = tiny_model(family, **({"rule_threshold": 0.5} if family == "dlcm-rule-mup" else {}))
    view = segment_text(model, tokenizer, TEXT)
    input_ids = tokenizer(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        ratio = model(input_ids=input_ids, use_cache=False).compression_ratio.item()
        boundaries = model.model(input_ids=input_ids, use_cache=False).boundaries[0]
    stats = view.stats()
    assert view.opens == boundaries.tolist()
    assert stats["num_tokens"] == input_ids.shape[1]
    assert stats["tokens_per_concept"] == pytest.approx(ratio, rel=1e-6)
    assert stats["num_concepts"] == sum(view.opens)
    # A learned router on random weights: neither every token nor one concept for the whole text.
    assert 1 < stats["num_concepts"] < stats["num_tokens"]


def test_model_in_training_mode_is_read_in_eval_mode_and_restored(tokenizer):
    model = tiny_model("conceptmoe-first", boundary_noise="bernoulli")
    expected = segment_text(model, tokenizer, TEXT).opens
    model.train()
    for _ in range(3):
        assert segment_text(model, tokenizer, TEXT).opens == expected
    assert model.training


def test_lslm_openings_come_from_the_output_boundaries():
    from hf_concept.modeling.configuration_lslm import LSLMConfig
    from hf_concept.modeling.modeling_lslm import LSLMForCausalLM
    from tests.test_lslm_model import TINY

    torch.manual_seed(0)
    model = LSLMForCausalLM(LSLMConfig(**TINY)).eval()
    tokenizer = ByteTokenizer()
    text = "héllo wörld, 你好"
    view = segment_text(model, tokenizer, text)
    input_ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        outputs = model(input_ids=input_ids)
    assert view.opens == outputs.boundaries[0].tolist()
    assert view.stats()["tokens_per_concept"] == pytest.approx(outputs.compression_ratio.item(), rel=1e-6)
    assert 1 < view.stats()["num_concepts"] < view.stats()["num_tokens"]
    assert "".join(view.pieces) == f"<BoS>{text}<eos>"


def test_pieces_rebuild_the_text_and_keep_split_characters_whole(tokenizer):
    text = "Un café, déjà vu: 你好 ✓"
    ids = tokenizer(text).input_ids
    pieces = token_pieces(tokenizer, ids)
    assert len(pieces) == len(ids) and "".join(pieces) == text
    # Byte tokens: a character's bytes before its last one show nothing, the last shows the character.
    byte_ids = ByteTokenizer()("é你").input_ids
    assert token_pieces(ByteTokenizer(), byte_ids) == ["<BoS>", "", "é", "", "", "你", "<eos>"]
    # A real U+FFFD at the end of the text is not held back for ever.
    ids = tokenizer("ok \ufffd").input_ids
    assert "".join(token_pieces(tokenizer, ids)) == "ok \ufffd"


@pytest.mark.parametrize(
    ("family", "message"),
    [("plain", "has no segmentation"), ("hidden-decoding", "probe_streams")],
)
def test_families_without_boundaries_are_refused(tokenizer, family, message):
    with pytest.raises(NoSegmentationError, match=message):
        segment_text(tiny_model(family), tokenizer, TEXT)


VIEW = SegmentationView(
    pieces=["<s>", "a", " <b>", " &", "c", "\n", "d"],
    opens=[True, True, False, False, True, True, False],
    token_ids=list(range(7)),
    model_type="conceptmoe",
)


def test_text_view_stats_and_histogram():
    assert VIEW.to_text(color=False) == "|<s>|a <b> &|c|\nd"
    assert VIEW.concepts() == ["<s>", "a <b> &", "c", "\nd"]
    assert VIEW.stats() == {
        "num_tokens": 7,
        "num_concepts": 4,
        "tokens_per_concept": 1.75,
        "min": 1,
        "max": 3,
    }
    assert VIEW.histogram() == {1: 2, 2: 1, 3: 1}
    colored = VIEW.to_text(color=True)
    assert ANSI.sub("", colored) == "".join(VIEW.pieces)
    # Neighbouring concepts get different colours.
    assert colored.count("\x1b[97;44m") == 2 and colored.count("\x1b[97;45m") == 2
    lines = VIEW.stats_text().splitlines()
    assert lines[0] == "tokens: 7  concepts: 4  tokens per concept: mean 1.75, min 1, max 3"
    assert re.match(r"\s+1\s+2\s+#{40}$", lines[2]) and re.match(r"\s+3\s+1\s+#{20}$", lines[4])


class _Page(HTMLParser):
    """The title, the stats paragraph and the concept spans (not the heatmap cells) of a segmentation page."""

    def __init__(self) -> None:
        super().__init__()
        self.title, self.stats, self.spans, self._in = "", "", [], None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "title" or attrs.get("class") == "stats":
            self._in = tag
        elif tag == "span" and attrs.get("class") in ("c0", "c1"):
            self._in = "span"
            self.spans.append([attrs["class"], ""])

    def handle_endtag(self, tag):
        self._in = None

    def handle_data(self, data):
        if self._in == "title":
            self.title += data
        elif self._in == "p":
            self.stats += data
        elif self._in == "span":
            self.spans[-1][1] += data


def test_html_view_escapes_the_text_and_shows_the_stats(tmp_path):
    page_text = VIEW.to_html()
    assert "<b>" not in page_text and "&lt;b&gt;" in page_text and "&amp;" in page_text
    path = VIEW.save(tmp_path / "view.html")
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    summary = "7 tokens, 4 concepts, 1.75 tokens per concept (min 1, max 3)"
    assert summary in page.title and page.stats == summary
    assert page.spans == [["c0", "<s>"], ["c1", "a <b> &"], ["c0", "c"], ["c1", "\nd"]]
    assert [entry.name for entry in tmp_path.iterdir()] == ["view.html"]


def test_png_needs_an_imaging_library(tmp_path, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("PIL", "matplotlib") else real_find_spec(name, *a),
    )
    with pytest.raises(ImportError, match=r"Pillow.*matplotlib"):
        VIEW.save(tmp_path / "view.png")
    with pytest.raises(ValueError, match=r"'\.txt'"):
        VIEW.save(tmp_path / "view.txt")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("segment")
    return {
        name: save_checkpoint(root / name, name) for name in ("conceptmoe-first", "hidden-decoding", "plain")
    }


def segment_cli(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["segment", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_marks_openings_and_writes_the_html_view(capsys, checkpoints, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    checkpoint = checkpoints["conceptmoe-first"]
    code, out, err = segment_cli(capsys, checkpoint, TEXT, "--html", tmp_path / "view.html")
    assert code == 0, err
    model = AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True)
    view = segment_text(model, tokenizer, TEXT)
    assert out == f"{view.to_text(color=False)}\n{view.stats_text()}\nwrote {tmp_path / 'view.html'}\n"
    assert out.startswith("|The") and out.splitlines()[0].replace("|", "") == TEXT
    page = _Page()
    page.feed((tmp_path / "view.html").read_text(encoding="utf-8"))
    assert page.stats == (
        f"{view.stats()['num_tokens']} tokens, {view.stats()['num_concepts']} concepts, "
        f"{view.stats()['tokens_per_concept']:.2f} tokens per concept (min {view.stats()['min']}, "
        f"max {view.stats()['max']})"
    )
    assert "".join(text for _, text in page.spans) == TEXT
    assert html.escape("a < b && c") in (tmp_path / "view.html").read_text(encoding="utf-8")


def test_cli_colours_in_a_terminal_unless_no_color(capsys, checkpoints, monkeypatch):
    import sys

    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    code, colored, _ = segment_cli(capsys, checkpoints["conceptmoe-first"], TEXT)
    assert code == 0
    first_line = colored.splitlines()[0]
    assert "\x1b[97;44m" in first_line and "|" not in ANSI.sub("", first_line).replace("|", "", 0)
    assert ANSI.sub("", first_line) == TEXT
    code, plain, _ = segment_cli(capsys, checkpoints["conceptmoe-first"], TEXT, "--no-color")
    assert "\x1b[" not in plain and plain.splitlines()[0].replace("|", "") == TEXT


def test_png_view_when_pillow_is_installed(capsys, checkpoints, tmp_path):
    image_module = pytest.importorskip("PIL.Image", reason="Pillow is an optional dependency")
    path = VIEW.save(tmp_path / "view.png")
    code, out, err = segment_cli(capsys, checkpoints["conceptmoe-first"], TEXT, "--png", tmp_path / "cli.png")
    assert code == 0, err
    assert out.endswith(f"wrote {tmp_path / 'cli.png'}\n")
    for picture in (path, tmp_path / "cli.png"):
        assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        with image_module.open(picture) as image:
            assert image.width > 100 and image.height > 40


def test_cli_prints_the_stream_probe_table_for_hidden_decoding(capsys, checkpoints, tokenizer):
    from transformers import AutoModelForCausalLM

    checkpoint = checkpoints["hidden-decoding"]
    code, out, err = segment_cli(capsys, checkpoint, "The quick brown fox")
    assert code == 0, err
    model = AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True)
    assert out == probe_streams(model, text="The quick brown fox", tokenizer=tokenizer).to_table() + "\n"
    assert "E2 (final)" in out


@pytest.mark.parametrize(
    ("family", "flags", "message"),
    [
        ("plain", [], "model_type='hf_concept_plain', which has no segmentation"),
        ("hidden-decoding", ["--png", "x.png"], "no segmentation to draw; segment prints its stream probe"),
        ("conceptmoe-first", ["two", "--png", "x.png"], "draws one text and 2 were given; --html shows"),
        ("conceptmoe-first", ["--png", "x.png"], "optional dependency Pillow"),
        ("conceptmoe-first", ["--html", "no/such/folder/x.html"], "does not exist"),
        (None, [], "is not a folder"),
    ],
)
def test_cli_errors_exit_2_with_one_line(capsys, checkpoints, tmp_path, monkeypatch, family, flags, message):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("hf_concept.segmentation.png_backend", lambda: None)
    checkpoint = checkpoints[family] if family else tmp_path / "missing"
    code, out, err = segment_cli(capsys, checkpoint, TEXT, *flags)
    assert code == 2 and out == ""
    assert err.startswith("hf-concept segment: error: ") and len(err.strip().splitlines()) == 1
    assert message in err, err
    assert not list(tmp_path.glob("x.*"))
