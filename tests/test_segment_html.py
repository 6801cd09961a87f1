"""The `segment --html` page and the training-curve pictures.

The page is read back with the stdlib `html.parser`: for every text and every family with boundaries, the
concepts and the heatmap cells (special tokens left out) give back the exact input text — characters that
need escaping and ja/zh text from the bundled corpus included — the heatmap has one cell per token, whose
probability is the one the model's forward returns (`boundary_probs`) and whose opening mark is its
`boundaries`; the page references nothing outside itself. Hidden Decoding's page says it has no
boundaries and draws no heatmap. The curve writers (`hf-concept train`'s, reproduce_lslm's) write a PNG
with matplotlib and skip with one line without it.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

from hf_concept.cli import main
from hf_concept.data import load_text
from hf_concept.modeling.tokenization_lslm import ByteTokenizer
from hf_concept.segmentation import heat_color, render_page, segment_text
from hf_concept.training.curves import write_training_curves
from tests.test_generate_command import bpe_tokenizer, save_checkpoint
from tests.test_segmentation import SPECS, tiny_model

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TEXTS = (
    "if a < b && c > d: print(\"x\" & 'y') </div>",
    load_text("ja", "heldout").splitlines()[0][:16],
    load_text("zh", "heldout").splitlines()[0][:16],
)
VOID_TAGS = {"meta", "br", "hr", "img", "link", "input", "wbr"}
PAGE_TAGS = {
    "html",
    "head",
    "meta",
    "title",
    "style",
    "body",
    "h1",
    "h2",
    "h3",
    "p",
    "section",
    "div",
    "span",
}
PAGE_TAGS |= {"table", "tr", "th", "td", "pre"}


class SegmentPage(HTMLParser):
    """Per section (text): the concepts' and the heatmap cells' text, special tokens apart; the cells'
    classes, `data-p`, `title` and style; every attribute that could load something from elsewhere."""

    def __init__(self) -> None:
        super().__init__()
        self.sections: list[dict] = []
        self.references: list[tuple[str, str]] = []
        self.tags: set[str] = set()
        self.none_notes: list[str] = []
        self._stack: list[tuple[str, set[str]]] = []

    def _inside(self, name: str) -> bool:
        return any(name in classes for _, classes in self._stack)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.add(tag)
        self.references += [(key, value) for key, value in attrs.items() if key in ("src", "href", "srcset")]
        classes = set((attrs.get("class") or "").split())
        if tag == "section":
            self.sections.append({"concepts": [], "cells": [], "text": ""})
        elif tag == "span" and "t" in classes and self._inside("heatmap"):
            cell = dict(classes=classes, p=float(attrs["data-p"]), title=attrs["title"], style=attrs["style"])
            self.sections[-1]["cells"].append({**cell, "text": ""})
        elif tag == "span" and classes & {"c0", "c1"} and self._inside("segments"):
            self.sections[-1]["concepts"].append("")
        if tag not in VOID_TAGS:
            self._stack.append((tag, classes))

    def handle_endtag(self, tag):
        while self._stack and self._stack.pop()[0] != tag:
            pass

    def handle_data(self, data):
        if self._inside("none"):
            self.none_notes.append(data)
        if not self.sections or self._inside("sp"):
            return
        if self._inside("segments"):
            self.sections[-1]["concepts"][-1] += data
        elif self._inside("heatmap"):
            self.sections[-1]["cells"][-1]["text"] += data
        elif self._inside("text"):
            self.sections[-1]["text"] += data


def parse(page: str) -> SegmentPage:
    parser = SegmentPage()
    parser.feed(page)
    parser.close()
    return parser


def lslm_model() -> torch.nn.Module:
    spec = SPECS["lslm"]
    torch.manual_seed(0)
    return spec.model_class()(spec.make_config(boundary_rule="threshold")).eval()


def forward_probs(model: torch.nn.Module, input_ids: torch.Tensor) -> tuple[list[float], list[bool]]:
    """The opening probabilities and openings the forward returns: LSLM's on the causal-LM output, the
    concept families' on the backbone's."""
    with torch.no_grad():
        if model.config.model_type == "lslm":
            outputs = model(input_ids=input_ids, use_cache=False)
        else:
            outputs = model.model(input_ids=input_ids, use_cache=False)
    return outputs.boundary_probs[0].tolist(), outputs.boundaries[0].tolist()


def decides(config, prob: float) -> bool:
    """The inference decision the family takes from p (eval mode, no sampling)."""
    if getattr(config, "router", None) == "rule":
        return prob > config.rule_threshold
    return prob >= config.boundary_threshold


@pytest.mark.parametrize("family", ["conceptmoe-first", "dlcm", "dlcm-rule-mup", "lslm"])
def test_every_text_round_trips_and_each_token_has_its_forward_probability(family):
    if family == "lslm":
        model, tokenizer = lslm_model(), ByteTokenizer()
    else:
        overrides = {"rule_threshold": 0.5} if family == "dlcm-rule-mup" else {}
        model, tokenizer = tiny_model(family, **overrides), bpe_tokenizer()
    views = [segment_text(model, tokenizer, text) for text in TEXTS]
    page = parse(render_page(views))
    assert len(page.sections) == len(TEXTS)
    for text, view, section in zip(TEXTS, views, page.sections, strict=True):
        input_ids = tokenizer(text, return_tensors="pt").input_ids
        probs, opens = forward_probs(model, input_ids)
        cells = section["cells"]
        assert "".join(section["concepts"]) == text
        assert "".join(cell["text"] for cell in cells) == text
        assert len(cells) == input_ids.shape[1] == len(view.pieces)
        assert [cell["p"] for cell in cells] == pytest.approx(probs, abs=1e-6)
        assert all(0.0 <= cell["p"] <= 1.0 for cell in cells)
        assert ["o" in cell["classes"] for cell in cells] == opens == view.opens
        # The router's p is what the forward thresholded (LSLM here: boundary_rule="threshold").
        assert opens == [decides(model.config, prob) for prob in probs]
        assert cells[0]["p"] == 1.0 and "o" in cells[0]["classes"]
        for cell in cells:
            assert f"p = {cell['p']:.3f}" in cell["title"]
            assert cell["style"] == f"background:{heat_color(cell['p'])}"
    if family == "lslm":
        # <BoS> and <eos> are marked special, so they do not count as text.
        assert sum("sp" in cell["classes"] for cell in page.sections[0]["cells"]) == 2


def test_page_refers_to_nothing_outside_itself():
    views = [segment_text(tiny_model("dlcm"), bpe_tokenizer(), text) for text in TEXTS]
    text = render_page(views)
    page = parse(text)
    assert page.references == []
    assert not page.tags & {"script", "link", "img", "iframe", "object", "embed"}
    assert "://" not in text and "url(" not in text and "@import" not in text
    # Escaped: the text's "<", "&" and "</div>" never become markup (the texts round-trip, above).
    assert page.tags <= PAGE_TAGS and "&lt;" in text and "&amp;" in text


def test_heat_colors_run_from_white_to_the_top_of_the_scale():
    assert heat_color(0.0) == "#ffffff" and heat_color(1.0) == "#e6550d"
    assert heat_color(-1.0) == heat_color(0.0) and heat_color(2.0) == heat_color(1.0)
    assert heat_color(0.5) == "#fdae6b"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("segment-html")
    return {name: save_checkpoint(root / name, name) for name in ("conceptmoe-first", "hidden-decoding")}


def test_cli_writes_one_page_for_several_texts(capsys, checkpoints, tmp_path):
    path = tmp_path / "page.html"
    code = main(["segment", str(checkpoints["conceptmoe-first"]), *TEXTS, "--html", str(path), "--no-color"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.endswith(f"wrote {path}\n") and out.count("tokens per concept: mean") == len(TEXTS)
    page = parse(path.read_text(encoding="utf-8"))
    assert ["".join(section["concepts"]) for section in page.sections] == list(TEXTS)
    assert all(section["cells"] for section in page.sections)


def test_hidden_decoding_page_says_it_has_no_boundaries(capsys, checkpoints, tmp_path):
    path = tmp_path / "hd.html"
    code = main(["segment", str(checkpoints["hidden-decoding"]), *TEXTS[:2], "--html", str(path)])
    out = capsys.readouterr().out
    assert code == 0 and out.endswith(f"wrote {path}\n") and "E2 (final)" in out
    text = path.read_text(encoding="utf-8")
    page = parse(text)
    assert "Hidden Decoding has no boundaries" in "".join(page.none_notes)
    assert "no heatmap" in "".join(page.none_notes)
    assert [section["text"] for section in page.sections] == list(TEXTS[:2])
    assert all(section["cells"] == [] for section in page.sections) and "data-p" not in text
    assert page.references == [] and "script" not in page.tags


LOG_HISTORY = [
    {"loss": 5.0, "compression_ratio": 3.1, "inference_compression_ratio": 2.9, "step": 1},
    {"loss": 4.2, "compression_ratio": 2.5, "inference_compression_ratio": 2.4, "step": 2},
    {"eval_loss": 4.4, "eval_compression_ratio": 2.4, "step": 2},
    {"train_loss": 4.6, "step": 2},
]


def hide_matplotlib(monkeypatch) -> None:
    """Make `import matplotlib` (and its submodules) fail as if it were not installed."""
    for name in [name for name in sys.modules if name == "matplotlib" or name.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.pyplot"):
        monkeypatch.setitem(sys.modules, name, None)


def test_training_curves_skip_cleanly_without_matplotlib(tmp_path, monkeypatch, caplog):
    hide_matplotlib(monkeypatch)
    path = tmp_path / "curves.png"
    with caplog.at_level(logging.INFO, logger="hf_concept.train"):
        assert write_training_curves(LOG_HISTORY, path) is None
    assert "matplotlib is not installed (pip install 'hf_concept[plots]')" in caplog.text
    assert str(path) in caplog.text and not path.exists()


def test_training_curves_are_a_png_with_matplotlib(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from hf_concept.commands.train import _draw_curves

    # Hidden Decoding logs no compression: the loss panel alone.
    loss_only = [{"loss": 3.0, "step": 1}, {"loss": 2.5, "step": 2}]
    assert write_training_curves(loss_only, tmp_path / "hd.png").read_bytes()[:8] == PNG_SIGNATURE
    # `hf-concept train` draws beside trainer_state.json and says where.
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    _draw_curves(LOG_HISTORY, tmp_path / "run")
    picture = tmp_path / "run" / "checkpoints" / "training_curves.png"
    assert picture.read_bytes()[:8] == PNG_SIGNATURE
    assert capsys.readouterr().out == f"training curves: {picture}\n"
    assert write_training_curves([{"train_loss": 1.0, "step": 0}], tmp_path / "none.png") is None


def load_reproduce_lslm():
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "reproduce_lslm.py"
    sys.path.insert(0, str(script.parent))
    spec = importlib.util.spec_from_file_location("reproduce_lslm", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RUNS = [
    {"model": "gpt2", "seed": 0, "curves": {"loss": [5.0, 4.0, 3.5]}},
    {"model": "lslm", "seed": 0, "curves": {"loss": [5.5, 4.2, 3.4], "boundary_rate": [0.5, 0.6, 0.7]}},
    {"model": "lslm", "seed": 1, "curves": {"loss": [5.4, 4.1, 3.3], "boundary_rate": [0.4, 0.6, 0.7]}},
]


def test_reproduce_lslm_draws_its_curves_or_skips_without_matplotlib(tmp_path, monkeypatch, capsys):
    reproduce = load_reproduce_lslm()
    if importlib.util.find_spec("matplotlib") is not None:
        assert reproduce.draw(RUNS, str(tmp_path / "lslm.png"))
        assert (tmp_path / "lslm.png").read_bytes()[:8] == PNG_SIGNATURE
    hide_matplotlib(monkeypatch)
    capsys.readouterr()
    assert not reproduce.draw(RUNS, str(tmp_path / "skipped.png"))
    assert "matplotlib is not installed" in capsys.readouterr().out
    assert not (tmp_path / "skipped.png").exists()
