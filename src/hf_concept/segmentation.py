"""Which tokens open a concept (ConceptMoE, DLCM) or a segment (LSLM): read from one forward pass.

    view = segment_text(model, tokenizer, "The capital of France is Paris.")
    print(view.to_text(color=False))   # "|The| capital| of| Fr|ance|…"
    print(view.stats())                # num_tokens, num_concepts, tokens_per_concept, min, max
    view.save("segments.html")

The boundaries are the ones the model's own forward decides, never a re-implementation: one eval-mode
forward of the causal LM without a cache (so the concept families start from the empty state, as in a
prefill) and the decisions read from its outputs. ConceptMoE and DLCM return them from the backbone
(`ConceptModelOutput.boundaries`, captured with a forward hook on `model.base_model`); LSLM returns
them on the causal-LM output (`boundaries`). Hidden Decoding and the plain family have no boundaries:
Hidden Decoding's streams are read with `hf_concept.probes.probe_streams` instead.

A token's piece is its decoded text; special tokens show as their token string (`<s>`, `<BoS>`), so a
concept that holds only a marker stays visible. Text between special tokens is decoded incrementally
(prefix by prefix), which keeps a multi-byte character that spans tokens intact: its bytes before the
last one get empty pieces.
"""

from __future__ import annotations

import html
import importlib.util
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hf_concept.utils import eval_mode

HIDDEN_DECODING_MODEL_TYPE = "hidden_decoding"
# Families whose forward decides token-level boundaries (what `hf-concept segment` can show).
SEGMENTED_MODEL_TYPES = ("conceptmoe", "dlcm", "lslm")
# ANSI background colours (blue, magenta) with bright white text, alternating per concept.
ANSI_CONCEPT_COLORS = ("\x1b[97;44m", "\x1b[97;45m")
ANSI_RESET = "\x1b[0m"
# Background colours of the HTML and PNG views, alternating per concept.
VIEW_COLORS = ("#cfe3ff", "#ffd9b3")
# Widest bar of the text histogram, in characters.
HISTOGRAM_WIDTH = 40


class NoSegmentationError(ValueError):
    """The model's family decides no token-level boundaries."""


@dataclass(frozen=True)
class SegmentationView:
    """One text's tokens and which of them open a concept.

    pieces: decoded text of each token; opens: True where the token opens a concept (segment);
    token_ids: the ids the model read; model_type: the checkpoint's family.
    """

    pieces: list[str]
    opens: list[bool]
    token_ids: list[int]
    model_type: str = ""

    def concept_lengths(self) -> list[int]:
        """Tokens per concept, in order. Tokens before the first opening (if any) count as one concept."""
        lengths: list[int] = []
        for index, opens in enumerate(self.opens):
            if opens or index == 0:
                lengths.append(0)
            lengths[-1] += 1
        return lengths

    def stats(self) -> dict[str, Any]:
        """num_tokens, num_concepts, tokens_per_concept (mean), min and max tokens per concept."""
        lengths = self.concept_lengths()
        num_tokens, num_concepts = len(self.pieces), len(lengths)
        return {
            "num_tokens": num_tokens,
            "num_concepts": num_concepts,
            "tokens_per_concept": num_tokens / num_concepts if num_concepts else 0.0,
            "min": min(lengths, default=0),
            "max": max(lengths, default=0),
        }

    def histogram(self) -> dict[int, int]:
        """Concept length (tokens) -> how many concepts have it, by length."""
        return dict(sorted(Counter(self.concept_lengths()).items()))

    def concepts(self) -> list[str]:
        """The text of each concept (its tokens' pieces joined)."""
        texts: list[str] = []
        for index, (piece, opens) in enumerate(zip(self.pieces, self.opens, strict=True)):
            if opens or index == 0:
                texts.append("")
            texts[-1] += piece
        return texts

    def to_text(self, color: bool) -> str:
        """The text with concepts marked: alternating ANSI background colours, or `|` before each opening."""
        if not color:
            return "".join(
                ("|" if opens else "") + piece for piece, opens in zip(self.pieces, self.opens, strict=True)
            )
        return "".join(
            f"{ANSI_CONCEPT_COLORS[index % 2]}{text}{ANSI_RESET}"
            for index, text in enumerate(self.concepts())
        )

    def stats_text(self) -> str:
        """The statistics line and a histogram of tokens per concept, for the terminal."""
        stats = self.stats()
        lines = [
            f"tokens: {stats['num_tokens']}  concepts: {stats['num_concepts']}  tokens per concept: "
            f"mean {stats['tokens_per_concept']:.2f}, min {stats['min']}, max {stats['max']}",
            "tokens/concept  count",
        ]
        counts = self.histogram()
        largest = max(counts.values(), default=1)
        for length, count in counts.items():
            bar = "#" * max(1, round(HISTOGRAM_WIDTH * count / largest))
            lines.append(f"{length:>14}  {count:>5}  {bar}")
        return "\n".join(lines)

    def to_html(self) -> str:
        """A self-contained HTML page: concepts on alternating backgrounds, the statistics as the title."""
        return render_html(self)

    def save(self, path: str | Path) -> Path:
        """Write the view as `.html`, or as `.png` when matplotlib or Pillow is installed."""
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix in (".html", ".htm"):
            write_html(self, path)
        elif suffix == ".png":
            write_png(self, path)
        else:
            raise ValueError(
                f"path={str(path)!r}: the view is written as .html or .png, not {suffix or 'no suffix'!r}"
            )
        return path


def write_html(view: SegmentationView, path: str | Path) -> None:
    """The HTML view (`to_html`) written to `path`, whatever its suffix."""
    page = view.to_html()
    _write_whole(Path(path), lambda staged: staged.write_text(page, encoding="utf-8"))


def _write_whole(path: Path, write: Callable[[Path], Any]) -> None:
    """`write` into a hidden sibling file, then rename it onto `path`: a failure leaves no partial file."""
    if not path.parent.is_dir():
        raise FileNotFoundError(f"path={str(path)!r}: the folder {str(path.parent)!r} does not exist")
    staged = path.with_name(f".{path.name}.partial")
    try:
        write(staged)
        os.replace(staged, path)
    finally:
        staged.unlink(missing_ok=True)


def summary_line(view: SegmentationView) -> str:
    """One line of statistics, e.g. for a page title."""
    stats = view.stats()
    return (
        f"{stats['num_tokens']} tokens, {stats['num_concepts']} concepts, "
        f"{stats['tokens_per_concept']:.2f} tokens per concept (min {stats['min']}, max {stats['max']})"
    )


def render_html(view: SegmentationView) -> str:
    """The HTML page of `view`; every piece of text is escaped."""
    summary = html.escape(summary_line(view))
    family = html.escape(view.model_type or "model")
    spans = []
    for index, text in enumerate(view.concepts()):
        spans.append(f'<span class="c{index % 2}" title="concept {index}">{html.escape(text)}</span>')
    rows = "".join(
        f"<tr><td>{length}</td><td>{count}</td></tr>" for length, count in view.histogram().items()
    )
    return (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8">'
        f"<title>Segmentation ({family}): {summary}</title><style>"
        "body{font-family:sans-serif;margin:2em;max-width:60em}"
        ".text{font-family:monospace;white-space:pre-wrap;line-height:1.8;font-size:1.1em}"
        f".c0{{background:{VIEW_COLORS[0]}}}.c1{{background:{VIEW_COLORS[1]}}}"
        "table{border-collapse:collapse}td,th{padding:0 1em;text-align:right}"
        "</style></head><body>\n"
        f'<h1>Segmentation ({family})</h1>\n<p class="stats">{summary}</p>\n'
        f'<div class="text">{"".join(spans)}</div>\n'
        "<h2>Tokens per concept</h2>\n<table><tr><th>tokens</th><th>concepts</th></tr>"
        f"{rows}</table>\n</body></html>\n"
    )


def token_pieces(tokenizer: Any, token_ids: list[int]) -> list[str]:
    """The decoded text of each token (see the module docstring for special tokens and split characters)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    pieces: list[str] = []
    run: list[int] = []
    shown = decoded = ""
    for token_id in [*token_ids, None]:
        if token_id is None or token_id in special:
            # A run ends: text still held back (a trailing U+FFFD that was real text) joins its last token.
            if run and decoded != shown:
                pieces[-1] += decoded[len(shown) :] if decoded.startswith(shown) else ""
            if token_id is not None:
                pieces.append(tokenizer.convert_ids_to_tokens(token_id))
            run, shown, decoded = [], "", ""
            continue
        run.append(token_id)
        decoded = tokenizer.decode(run, clean_up_tokenization_spaces=False)
        if decoded.endswith("\ufffd"):
            # An incomplete character: its text appears with the token that completes it.
            pieces.append("")
        elif decoded.startswith(shown):
            pieces.append(decoded[len(shown) :])
            shown = decoded
        else:
            # A decoder that rewrites earlier text (rare): fall back to the token's own decoding.
            pieces.append(tokenizer.decode([token_id], clean_up_tokenization_spaces=False))
            shown = decoded
    return pieces


def forward_boundaries(model: torch.nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """(L,) bool openings of the one row in `input_ids` (1, L), from one eval-mode forward without a
    cache, and the causal-LM output. Raises NoSegmentationError for families without boundaries."""
    model_type = getattr(model.config, "model_type", "")
    if model_type == HIDDEN_DECODING_MODEL_TYPE:
        raise NoSegmentationError(
            "model_type='hidden_decoding' has no segmentation (every token is expanded into streams, "
            "none are merged); read its streams with hf_concept.probes.probe_streams, which "
            "`hf-concept segment` prints for Hidden Decoding checkpoints"
        )
    captured: list[Any] = []
    backbone = getattr(model, "base_model", None)
    hook = None
    if isinstance(backbone, torch.nn.Module) and backbone is not model:
        hook = backbone.register_forward_hook(lambda module, args, output: captured.append(output))
    try:
        with eval_mode(model), torch.no_grad():
            outputs = model(input_ids=input_ids, use_cache=False)
    finally:
        if hook is not None:
            hook.remove()
    # LSLM puts its openings on the causal-LM output; the concept families on the backbone's.
    opens = getattr(outputs, "boundaries", None)
    if opens is None and captured:
        opens = getattr(captured[-1], "boundaries", None)
    if opens is None:
        raise NoSegmentationError(
            f"model_type={model_type!r} ({type(model).__name__}) has no segmentation: its forward returns "
            f"no chunk boundaries (the families with boundaries: {', '.join(SEGMENTED_MODEL_TYPES)})"
        )
    return opens[0].bool().cpu(), outputs


def segment_text(model: torch.nn.Module, tokenizer: Any, text: str) -> SegmentationView:
    """The tokens of `text` and which of them the model's forward opens a concept (segment) at.

    `text` is encoded as the tokenizer does by default (its special tokens included), as one row.
    """
    if not isinstance(text, str) or not text:
        raise ValueError(f"text={text!r}: give a non-empty string")
    input_ids = tokenizer(text, return_tensors="pt").input_ids
    if input_ids.shape[1] == 0:
        raise ValueError(f"text={text!r} gives no tokens")
    device = next(model.parameters()).device
    opens, _ = forward_boundaries(model, input_ids.to(device))
    token_ids = input_ids[0].tolist()
    return SegmentationView(
        pieces=token_pieces(tokenizer, token_ids),
        opens=opens.tolist(),
        token_ids=token_ids,
        model_type=getattr(model.config, "model_type", ""),
    )


def wrap_concepts(view: SegmentationView, width: int) -> list[list[tuple[str, int]]]:
    """The text as lines of at most `width` characters (breaking at newlines too); each line a list of
    (fragment, concept index) runs, for the PNG view."""
    lines: list[list[tuple[str, int]]] = [[]]
    column = 0
    for index, text in enumerate(view.concepts()):
        for character in text:
            if character == "\n" or column >= width:
                lines.append([])
                column = 0
                if character == "\n":
                    continue
            line = lines[-1]
            if line and line[-1][1] == index:
                line[-1] = (line[-1][0] + character, index)
            else:
                line.append((character, index))
            column += 1
    return lines


def png_backend() -> str | None:
    """ "pillow" or "matplotlib" (the first installed), or None: the PNG view needs one of them."""
    for backend, module in (("pillow", "PIL"), ("matplotlib", "matplotlib")):
        if importlib.util.find_spec(module) is not None:
            return backend
    return None


def write_png(view: SegmentationView, path: str | Path, width: int = 80) -> None:
    """The PNG view, drawn with Pillow if installed, else matplotlib; neither -> ImportError naming both."""
    path = Path(path)
    backend = png_backend()
    if backend is None:
        raise ImportError(
            f"writing {str(path)!r} needs an imaging library: install Pillow (pip install pillow) or "
            "matplotlib; neither is installed (the HTML view needs nothing)"
        )
    lines = wrap_concepts(view, width)
    if backend == "pillow":
        _write_whole(path, lambda staged: _write_png_pillow(view, lines, staged))
    else:
        _write_whole(path, lambda staged: _write_png_matplotlib(view, lines, width, staged))


def _write_png_pillow(view: SegmentationView, lines: list[list[tuple[str, int]]], path: Path) -> None:
    from PIL import Image, ImageDraw, ImageFont

    try:
        # A system font with wide coverage (accents, Greek, Cyrillic) where there is one.
        font = ImageFont.truetype("DejaVuSans.ttf", 16)
    except OSError:
        try:
            font = ImageFont.load_default(size=16)
        except TypeError:
            # Pillow < 10.1 has only the fixed bitmap font.
            font = ImageFont.load_default()
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    line_height = int(measure.textbbox((0, 0), "Ag|", font=font)[3]) + 8
    title = summary_line(view)
    text_width = max(
        [measure.textlength(title, font=font)]
        + [sum(measure.textlength(fragment, font=font) for fragment, _ in line) for line in lines]
    )
    image = Image.new("RGB", (int(text_width) + 20, line_height * (len(lines) + 2) + 10), "white")
    draw = ImageDraw.Draw(image)
    draw.text((10, 10), title, fill="black", font=font)
    for row, line in enumerate(lines):
        x, y = 10.0, 10 + line_height * (row + 2)
        for fragment, index in line:
            advance = measure.textlength(fragment, font=font)
            draw.rectangle([x, y - 2, x + advance, y + line_height - 6], fill=VIEW_COLORS[index % 2])
            draw.text((x, y), fragment, fill="black", font=font)
            x += advance
    image.save(path, format="PNG")


def _write_png_matplotlib(
    view: SegmentationView, lines: list[list[tuple[str, int]]], width: int, path: Path
) -> None:
    # The Figure API (no pyplot): no global backend switch, no figure left open.
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    # DejaVu Sans Mono (shipped with matplotlib) at 12 pt: 0.602 em per character; 1.6 em per line.
    char_width, line_height = 0.602 * 12 / 72, 1.6 * 12 / 72  # inches
    fig_width, fig_height = char_width * (width + 4), line_height * (len(lines) + 3)
    figure = Figure(figsize=(fig_width, fig_height))
    figure.text(0.02, 1 - line_height / fig_height, summary_line(view), fontsize=12, va="top")
    for row, line in enumerate(lines):
        column = 0
        bottom = 1 - line_height * (row + 3) / fig_height
        for fragment, index in line:
            left = (2 + column) * char_width / fig_width
            span = len(fragment) * char_width / fig_width
            box = Rectangle((left, bottom), span, line_height / fig_height, transform=figure.transFigure)
            box.set(facecolor=VIEW_COLORS[index % 2], edgecolor="none")
            figure.add_artist(box)
            figure.text(
                left,
                bottom + 0.3 * line_height / fig_height,
                fragment,
                family="DejaVu Sans Mono",
                fontsize=12,
            )
            column += len(fragment)
    figure.savefig(path, format="png", dpi=100)
