"""Which tokens open a concept (ConceptMoE, DLCM) or a segment (LSLM): read from one forward pass.

    view = segment_text(model, tokenizer, "The capital of France is Paris.")
    print(view.to_text(color=False))   # "|The| capital| of| Fr|ance|…"
    print(view.stats())                # num_tokens, num_concepts, tokens_per_concept, min, max
    view.save("segments.html")         # the concepts and the boundary-probability heatmap

The boundaries are the ones the model's own forward decides, never a re-implementation: one eval-mode
forward of the causal LM without a cache (so the concept families start from the empty state, as in a
prefill) and the decisions read from its outputs. ConceptMoE and DLCM return them from the backbone
(`ConceptModelOutput.boundaries`, captured with a forward hook on `model.base_model`); LSLM returns
them on the causal-LM output (`boundaries`). The probability of each opening comes from the same
output (`boundary_probs`): the router's p_t for ConceptMoE and DLCM, q of the byte before for LSLM
(`probability_note` says, per checkpoint, what p is and how the forward turns it into boundaries).
Hidden Decoding and the plain family have no boundaries: Hidden Decoding's streams are read with
`hf_concept.probes.probe_streams` instead, and its page says that there is nothing to draw
(`render_no_boundaries_page`).

The HTML page (`render_page`, one section per text) is self-contained: inline CSS, no script, no
external reference, every piece of text escaped. Each section shows the concepts on alternating
backgrounds and the heatmap (after DLCM's Appendix A): one cell per token, its background the opening
probability, a bar on the left of each token that opens a concept, p in the cell's tooltip (`title`) and
its `data-p` attribute.

A token's piece is its decoded text; special tokens show as their token string (`<s>`, `<BoS>`), so a
concept that holds only a marker stays visible. Text between special tokens is decoded incrementally
(prefix by prefix), which keeps a multi-byte character that spans tokens intact: its bytes before the
last one get empty pieces.
"""

from __future__ import annotations

import html
import importlib.util
import itertools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hf_concept.staging import staged
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
# The heatmap's colour scale: (p, RGB) stops, white through orange; black text stays readable on all.
HEAT_STOPS = ((0.0, (255, 255, 255)), (0.5, (253, 174, 107)), (1.0, (230, 85, 13)))


class NoSegmentationError(ValueError):
    """The model's family decides no token-level boundaries."""


@dataclass(frozen=True)
class SegmentationView:
    """One text's tokens and which of them open a concept.

    pieces: decoded text of each token; opens: True where the token opens a concept (segment);
    token_ids: the ids the model read; model_type: the checkpoint's family; probs: the probability
    that each token opens a concept, from the same forward (None: the forward returned none);
    special: True where the token is a special token (its piece is the token's string, not text);
    note: what p is for this checkpoint (`probability_note`).
    """

    pieces: list[str]
    opens: list[bool]
    token_ids: list[int]
    model_type: str = ""
    probs: list[float] | None = None
    special: list[bool] = field(default_factory=list)
    note: str = ""

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
        """A self-contained HTML page: concepts on alternating backgrounds, the boundary-probability
        heatmap, the statistics as the title."""
        return render_html(self)

    def is_special(self, index: int) -> bool:
        """Whether token `index` is a special token (False when `special` was not given)."""
        return bool(self.special) and self.special[index]

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


def write_html(view: SegmentationView | Sequence[SegmentationView], path: str | Path) -> None:
    """The HTML page of one view, or of several texts' views (`render_page`), written to `path`."""
    views = [view] if isinstance(view, SegmentationView) else list(view)
    write_page(render_page(views), path)


def write_page(page: str, path: str | Path) -> None:
    """`page` written to `path` as UTF-8, whole or not at all."""
    _write_whole(Path(path), lambda staging: staging.write_text(page, encoding="utf-8"))


def _write_whole(path: Path, write: Callable[[Path], Any]) -> None:
    """`write` into a hidden sibling file, then rename it onto `path`: a failure leaves no partial file."""
    if not path.parent.is_dir():
        raise FileNotFoundError(f"path={str(path)!r}: the folder {str(path.parent)!r} does not exist")
    with staged(path) as staging:
        write(staging)


def summary_line(view: SegmentationView) -> str:
    """One line of statistics, e.g. for a page title."""
    stats = view.stats()
    return (
        f"{stats['num_tokens']} tokens, {stats['num_concepts']} concepts, "
        f"{stats['tokens_per_concept']:.2f} tokens per concept (min {stats['min']}, max {stats['max']})"
    )


def unit_name(model_type: str) -> str:
    """What the family calls the groups its boundaries open: LSLM's segments, the others' concepts."""
    return "segment" if model_type == "lslm" else "concept"


def probability_note(config: Any) -> str:
    """What the heatmap's p is for a checkpoint with `config`, and how its forward turns p into openings."""
    if getattr(config, "model_type", "") == "lslm":
        if getattr(config, "boundary_rule", "rate") == "threshold":
            decision = f"a segment opens where p ≥ boundary_threshold={config.boundary_threshold:g}"
        else:
            decision = (
                "boundary_rule='rate' decides: a segment ends where the running sum of q over the document "
                "passes a half-integer, so an opening can sit on a pale token and a dark one stay inside"
            )
        return (
            "LSLM's router gives q_t, the probability that byte t ends its segment; a token's p is q of the "
            "byte before it (1 where the opening is forced: a document's first byte, after <BoS>, <eos> or a "
            f"marker). {decision}."
        )
    if getattr(config, "chunking", "dynamic") == "fixed":
        return (
            f"chunking='fixed' opens a concept every {int(config.compression_ratio)} tokens: there is no "
            "router, so p is 1 where a concept opens and 0 elsewhere."
        )
    router = getattr(config, "router", "cosine")
    if router == "rule":
        return (
            "p_t = ½(1 − cos(h_{t−1}, h_t)), the parameter-free rule router (1 at the first token); a "
            f"concept opens where p > rule_threshold={config.rule_threshold:g}."
        )
    formula = (
        "σ(w·h_t), the linear router" if router == "linear" else "½(1 − cos(q_t, k_{t−1})), the cosine router"
    )
    return (
        f"p_t = {formula} (1 at the first token); a concept opens where p ≥ "
        f"boundary_threshold={config.boundary_threshold:g} (eval mode: no sampling)."
    )


def heat_color(prob: float) -> str:
    """The `#rrggbb` of probability `prob` on the heatmap's scale (`HEAT_STOPS`), clamped to [0, 1]."""
    prob = min(max(prob, 0.0), 1.0)
    for (low, low_rgb), (high, high_rgb) in itertools.pairwise(HEAT_STOPS):
        if prob <= high:
            share = (prob - low) / (high - low)
            return "#" + "".join(
                f"{round(a + (b - a) * share):02x}" for a, b in zip(low_rgb, high_rgb, strict=True)
            )
    return "#" + "".join(f"{channel:02x}" for channel in HEAT_STOPS[-1][1])


PAGE_STYLE = (
    "body{font-family:sans-serif;margin:2em;max-width:60em}"
    ".text{font-family:monospace;white-space:pre-wrap;line-height:1.9;font-size:1.1em}"
    f".c0{{background:{VIEW_COLORS[0]}}}.c1{{background:{VIEW_COLORS[1]}}}"
    ".sp{color:#777;font-style:italic}"
    ".t{border-left:2px solid transparent}.t:empty{padding:0 .15em}.t.o{border-left-color:#000}"
    ".scale{display:inline-block;width:12em;height:1em;vertical-align:middle;border:1px solid #999;"
    "background:linear-gradient(to right,"
    + ",".join(f"{heat_color(stop)} {stop:.0%}" for stop, _ in HEAT_STOPS)
    + ")}"
    ".none{font-weight:bold}"
    "table{border-collapse:collapse}td,th{padding:0 1em;text-align:right}"
)


def _page(title: str, body: list[str]) -> str:
    return (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{PAGE_STYLE}</style></head><body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )


def _piece_html(view: SegmentationView, index: int) -> str:
    text = html.escape(view.pieces[index])
    return f'<span class="sp">{text}</span>' if view.is_special(index) else text


def _concept_spans(view: SegmentationView) -> str:
    """The concepts on alternating backgrounds, special tokens marked inside them."""
    concepts: list[list[str]] = []
    for index, opens in enumerate(view.opens):
        if opens or index == 0:
            concepts.append([])
        concepts[-1].append(_piece_html(view, index))
    unit = unit_name(view.model_type)
    return "".join(
        f'<span class="c{index % 2}" title="{unit} {index}">{"".join(pieces)}</span>'
        for index, pieces in enumerate(concepts)
    )


def _heatmap_cells(view: SegmentationView, probs: list[float]) -> str:
    """One cell per token: its background the opening probability, a bar on its left where it opens."""
    unit, cells = unit_name(view.model_type), []
    for index, (opens, prob) in enumerate(zip(view.opens, probs, strict=True)):
        classes = "t o" if opens else "t"
        if view.is_special(index):
            classes += " sp"
        title = f"token {index} (id {view.token_ids[index]}): p = {prob:.3f}" + (
            f", opens a {unit}" if opens else ""
        )
        cells.append(
            f'<span class="{classes}" data-p="{prob:.6f}" title="{title}" '
            f'style="background:{heat_color(prob)}">{html.escape(view.pieces[index])}</span>'
        )
    return "".join(cells)


def _view_section(view: SegmentationView, number: int) -> str:
    unit = unit_name(view.model_type)
    rows = "".join(
        f"<tr><td>{length}</td><td>{count}</td></tr>" for length, count in view.histogram().items()
    )
    if view.probs is None:
        heatmap = (
            '<p class="none">No boundary probabilities for this text (the forward returned none, e.g. '
            "the remote code of a checkpoint saved before LSLM had them): no heatmap is drawn, only the "
            "openings above are known.</p>"
        )
    else:
        heatmap = f'<div class="text heatmap">{_heatmap_cells(view, view.probs)}</div>'
    return (
        f'<section id="text-{number}">\n<h2>Text {number}</h2>\n'
        f'<p class="stats">{html.escape(summary_line(view))}</p>\n'
        f'<h3>{unit.capitalize()}s</h3>\n<div class="text segments">{_concept_spans(view)}</div>\n'
        f"<h3>Boundary probability</h3>\n{heatmap}\n"
        f"<h3>Tokens per {unit}</h3>\n<table><tr><th>tokens</th><th>{unit}s</th></tr>{rows}</table>\n"
        "</section>"
    )


def _legend(views: Sequence[SegmentationView]) -> str:
    unit = unit_name(views[0].model_type)
    note = next((view.note for view in views if view.note), "")
    about = f'<p class="about">{html.escape(note)}</p>\n' if note else ""
    return (
        f'{about}<p class="legend">Boundary probability p, the chance that a token opens a {unit}: '
        '0 <span class="scale"></span> 1. <span class="t o">&#160;</span> a bar on its left: the token opens '
        f'a {unit}. <span class="sp">Grey italics</span>: a special token. Hover a token for its p.</p>'
    )


def render_page(views: Sequence[SegmentationView]) -> str:
    """The HTML page of one or more texts' views (one checkpoint): per text the statistics, the concepts,
    the boundary-probability heatmap and the tokens-per-concept table; every piece of text is escaped."""
    if not views:
        raise ValueError("views=[]: give at least one SegmentationView")
    family = views[0].model_type or "model"
    summary = summary_line(views[0]) if len(views) == 1 else f"{len(views)} texts"
    body = [f"<h1>Segmentation ({html.escape(family)})</h1>", _legend(views)]
    body += [_view_section(view, number) for number, view in enumerate(views, start=1)]
    return _page(f"Segmentation ({family}): {summary}", body)


def render_html(view: SegmentationView) -> str:
    """The HTML page of `view` (`render_page` of one text)."""
    return render_page([view])


def render_no_boundaries_page(
    model_type: str, texts: Sequence[str], reason: str, details: Sequence[str] | None = None
) -> str:
    """The page of a family without boundaries: `reason` in plain words instead of a heatmap, each text
    as given, and under it the matching `details` entry (e.g. a stream probe table) when given."""
    body = [
        f"<h1>Segmentation ({html.escape(model_type)})</h1>",
        f'<p class="none">{html.escape(reason)}</p>',
    ]
    for number, text in enumerate(texts, start=1):
        body.append(f'<section id="text-{number}">\n<h2>Text {number}</h2>')
        body.append(f'<div class="text">{html.escape(text)}</div>')
        if details is not None:
            body.append(f"<pre>{html.escape(details[number - 1])}</pre>")
        body.append("</section>")
    return _page(f"Segmentation ({model_type}): no boundaries", body)


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


def forward_boundaries(
    model: torch.nn.Module, input_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
    """(L,) bool openings and (L,) float opening probabilities (None when the forward returns none) of
    the one row in `input_ids` (1, L), from one eval-mode forward without a cache, and the causal-LM
    output. Raises NoSegmentationError for families without boundaries."""
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
    source = outputs if getattr(outputs, "boundaries", None) is not None else None
    if source is None and captured:
        source = captured[-1]
    opens = getattr(source, "boundaries", None)
    if opens is None:
        raise NoSegmentationError(
            f"model_type={model_type!r} ({type(model).__name__}) has no segmentation: its forward returns "
            f"no chunk boundaries (the families with boundaries: {', '.join(SEGMENTED_MODEL_TYPES)})"
        )
    probs = getattr(source, "boundary_probs", None)
    return opens[0].bool().cpu(), None if probs is None else probs[0].float().cpu(), outputs


def segment_text(model: torch.nn.Module, tokenizer: Any, text: str) -> SegmentationView:
    """The tokens of `text` and which of them the model's forward opens a concept (segment) at.

    `text` is encoded as the tokenizer does by default (its special tokens included), as one row.
    """
    if not isinstance(text, str) or not text:
        raise ValueError(f"text={text!r}: give a non-empty string")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        # Fast tokenizers raise a TypeError that names neither the text nor the character.
        raise ValueError(
            f"text[{error.start}] is U+{ord(text[error.start]):04X}, a lone surrogate with no UTF-8 "
            "encoding (a byte of another encoding, read with errors='surrogateescape'); pass UTF-8 text"
        ) from None
    input_ids = tokenizer(text, return_tensors="pt").input_ids
    if input_ids.shape[1] == 0:
        raise ValueError(f"text={text!r} gives no tokens")
    vocab_size = getattr(model.config, "vocab_size", None)
    if vocab_size is not None and int(input_ids.max()) >= vocab_size:
        # The embedding would raise an IndexError that names no cause.
        raise ValueError(
            f"the tokenizer gives id {int(input_ids.max())}, but the model's vocab_size is {vocab_size}: "
            "the tokenizer does not belong to this model"
        )
    device = next(model.parameters()).device
    opens, probs, _ = forward_boundaries(model, input_ids.to(device))
    token_ids = input_ids[0].tolist()
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    return SegmentationView(
        pieces=token_pieces(tokenizer, token_ids),
        opens=opens.tolist(),
        token_ids=token_ids,
        model_type=getattr(model.config, "model_type", ""),
        probs=None if probs is None else probs.tolist(),
        special=[token_id in special for token_id in token_ids],
        note=probability_note(model.config),
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
        _write_whole(path, lambda staging: _write_png_pillow(view, lines, staging))
    else:
        _write_whole(path, lambda staging: _write_png_matplotlib(view, lines, width, staging))


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
