"""`hf_concept.tables`: the one table printer of the commands and the benchmarks."""

import pytest

from hf_concept.tables import format_table


def test_columns_fit_their_widest_cell_and_no_line_ends_in_padding():
    table = format_table(["name", "value"], [["a", 1], ["longer", 22]], rule="columns")
    assert table.splitlines() == ["name    value", "------  -----", "a       1", "longer  22"]


def test_given_widths_alignments_and_a_rule_through_the_separators():
    table = format_table(["model", "loss"], [["x", "1.5"]], align="<>", widths=(6, 7), sep=" | ", rule="line")
    assert table.splitlines() == ["model  |    loss", "-------|--------", "x      |     1.5"]


def test_a_cell_longer_than_its_width_overflows_as_an_fstring_field_does():
    assert (
        format_table(["a", "b"], [["toolong", "x"]], align=">", widths=(3, 3), sep="") == "  a  b\ntoolong  x"
    )


def test_the_footer_sits_below_a_second_rule():
    lines = format_table(["k", "v"], [["a", "1"]], rule="columns", footer=[["mean", "1"]]).splitlines()
    assert lines == ["k     v", "----  -", "a     1", "----  -", "mean  1"]


def test_a_short_row_stops_after_its_last_cell():
    table = format_table(["arm", "before", "after"], [["x", "not run"]], align="<>", widths=(4, 8, 6), sep="")
    assert table.splitlines()[1] == "x    not run"


def test_one_separator_per_gap():
    table = format_table(
        ["a", "b", "note"], [["1", "2", "ok"]], align="<><", widths=(2, 2, None), sep=("", "  ")
    )
    assert table.splitlines() == ["a  b  note", "1  2  ok"]


def test_markdown_alignment_row_and_empty_cells():
    table = format_table(
        ["name", "n", "unit"], [["a", 1, "s"], ["b", "", "s"], ["failed"]], align="<><", markdown=True
    )
    assert table.splitlines() == [
        "| name | n | unit |",
        "| --- | ---: | --- |",
        "| a | 1 | s |",
        "| b |  | s |",
        "| failed | | |",
    ]


def test_emit_gets_each_line_as_soon_as_its_row_is_read_when_no_width_is_left_to_measure():
    events = []

    def rows():
        for value in ("1", "2"):
            events.append(f"read {value}")
            yield [value]

    text = format_table(["n"], rows(), widths=(3,), emit=lambda line: events.append(f"line {line}"))
    assert events == ["line n", "read 1", "line 1", "read 2", "line 2"]
    assert text == "n\n1\n2"


@pytest.mark.parametrize(
    "options",
    [dict(align="<^"), dict(widths=(1,)), dict(sep=("",) * 3), dict(rule="double")],
)
def test_bad_options_are_refused(options):
    with pytest.raises(ValueError):
        format_table(["a", "b"], [["1", "2"]], **options)


def test_a_row_longer_than_the_headers_is_refused():
    with pytest.raises(ValueError, match="cells"):
        format_table(["a"], [["1", "2"]])
