"""`--quick` in the reproduction scripts: the smoke settings, except what the command line gives itself."""

from __future__ import annotations

import pytest

from tests.benchmark_scripts import load_benchmark

SCRIPTS = ("reproduce_conceptmoe", "reproduce_dlcm", "reproduce_hidden_decoding", "reproduce_lslm")


@pytest.mark.parametrize("seeds", [["--seeds", "0,1"], ["--seeds=0,1"]])
@pytest.mark.parametrize("name", SCRIPTS)
def test_quick_keeps_the_seeds_the_command_line_gives(name, seeds):
    script = load_benchmark(name)
    assert tuple(script.parse_args(["--quick"]).seeds) == tuple(script.QUICK["seeds"])
    given = script.parse_args(["--quick", *seeds])
    assert tuple(given.seeds) == (0, 1)
    # Everything not given still takes the smoke value.
    for field, value in script.QUICK.items():
        if field != "seeds":
            assert getattr(given, field) == value, field
