"""The one printer of the text tables that the commands and the benchmarks show: aligned plain-text columns
or a Markdown table.

`format_table` returns the whole table and, given `emit`, hands each line over as soon as it is ready, so
that a caller that measures row after row can print each row as it comes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Literal

ALIGNMENTS = ("<", ">")
RULES = ("columns", "line")


def _texts(row: Sequence[object]) -> list[str]:
    return [str(cell) for cell in row]


def _alignments(align: str, count: int) -> list[str]:
    if not align or any(character not in ALIGNMENTS for character in align) or len(align) > count:
        raise ValueError(f"align={align!r} must be 1 to {count} characters out of {ALIGNMENTS}")
    return [align[min(column, len(align) - 1)] for column in range(count)]


def _widest(column: int, rows: list[list[str]]) -> int:
    return max(len(row[column]) for row in rows if column < len(row))


class _Line:
    """Plain-text lines of one table: its alignments, column widths and separators."""

    def __init__(self, aligns: list[str], widths: list[int], gaps: list[str]):
        self.aligns, self.widths, self.gaps = aligns, widths, gaps

    def cells(self, row: list[str]) -> str:
        if not 1 <= len(row) <= len(self.widths):
            raise ValueError(f"row {row!r} must have 1 to {len(self.widths)} cells, one per column")
        padded = [
            cell if align == "<" and column == len(row) - 1 else f"{cell:{align}{width}}"
            for column, (cell, align, width) in enumerate(zip(row, self.aligns, self.widths, strict=False))
        ]
        return padded[0] + "".join(gap + cell for gap, cell in zip(self.gaps, padded[1:], strict=False))

    def rule(self, style: str) -> str:
        gaps = [gap.replace(" ", "-") for gap in self.gaps] if style == "line" else self.gaps
        dashes = ["-" * width for width in self.widths]
        return dashes[0] + "".join(gap + dash for gap, dash in zip(gaps, dashes[1:], strict=True))


def _markdown_lines(
    headers: list[str],
    rows: Iterable[Sequence[object]],
    footer: Iterable[Sequence[object]],
    aligns: list[str],
) -> Iterator[str]:
    def line(cells: list[str]) -> str:
        if len(cells) > len(headers):
            raise ValueError(f"row {cells!r} has more cells than the table's {len(headers)} columns")
        return "| " + " | ".join(cells) + " |" + " |" * (len(headers) - len(cells))

    yield line(headers)
    yield line(["---:" if align == ">" else "---" for align in aligns])
    for rows_or_footer in (rows, footer):
        yield from (line(_texts(row)) for row in rows_or_footer)


def _plain_lines(
    headers: list[str],
    rows: Iterable[Sequence[object]],
    footer: Iterable[Sequence[object]],
    aligns: list[str],
    widths: Sequence[int | None] | None,
    sep: str | Sequence[str],
    rule: str | None,
) -> Iterator[str]:
    gaps = [sep] * (len(headers) - 1) if isinstance(sep, str) else list(sep)
    if len(gaps) != len(headers) - 1:
        raise ValueError(f"sep gives {len(gaps)} separators for {len(headers)} columns")
    if rule is not None and rule not in RULES:
        raise ValueError(f"rule={rule!r} must be None or one of {RULES}")
    given = [None] * len(headers) if widths is None else list(widths)
    if len(given) != len(headers):
        raise ValueError(f"widths gives {len(given)} widths for {len(headers)} columns")
    if None in given:
        # A width taken from the cells needs every row before the first line.
        rows, footer = [_texts(row) for row in rows], [_texts(row) for row in footer]
        every = [headers, *rows, *footer]
        given = [_widest(column, every) if width is None else width for column, width in enumerate(given)]
    line = _Line(aligns, given, gaps)
    yield line.cells(headers)
    if rule is not None:
        yield line.rule(rule)
    yield from (line.cells(_texts(row)) for row in rows)
    footer = [_texts(row) for row in footer]
    if footer and rule is not None:
        yield line.rule(rule)
    yield from (line.cells(row) for row in footer)


def format_table(
    headers: Sequence[object],
    rows: Iterable[Sequence[object]],
    *,
    align: str = "<",
    widths: Sequence[int | None] | None = None,
    sep: str | Sequence[str] = "  ",
    rule: Literal["columns", "line"] | None = None,
    footer: Iterable[Sequence[object]] = (),
    markdown: bool = False,
    emit: Callable[[str], object] | None = None,
) -> str:
    """`headers` over `rows` (cells as `str` gives them), one line each, without a final newline.

    Args:
        align: a column's alignment, "<" (left) or ">" (right), one character per column; the last one
            holds for the columns after it (default: all left).
        widths: each column's width, or None for the width of its widest cell, headers and footer included
            (default: None for every column). A longer cell overflows its column, as an f-string field does.
        sep: what stands between two columns, or one string per gap.
        rule: a rule of "-" under the headers and above `footer`: "columns" draws one under each column
            and keeps the separators; "line" runs through the separators too (their spaces become "-").
        footer: rows below the rule (totals, means).
        markdown: a Markdown table (`| a | b |`, then `| --- | ---: |` from `align`); `widths`, `sep` and
            `rule` do not apply and footer rows follow the rows.
        emit: called with each line as soon as the rows it needs are read (e.g. `print`, for rows that
            take long to measure): at once in Markdown or with every width given, else after all rows.

    A left-aligned cell that ends its line is not padded, so no line ends in padding. A row shorter than
    the headers stops after its last cell; in Markdown its missing cells are left empty.
    """
    headers = _texts(headers)
    aligns = _alignments(align, len(headers))
    if markdown:
        lines = _markdown_lines(headers, rows, footer, aligns)
    else:
        lines = _plain_lines(headers, rows, footer, aligns, widths, sep, rule)
    text = []
    for line in lines:
        if emit is not None:
            emit(line)
        text.append(line)
    return "\n".join(text)
