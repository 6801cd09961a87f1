"""Config bounds: every numeric field of the five families either refuses a value at construction time,
with a ValueError naming the field and the value, or accepts it and then builds a tiny model whose
forward pass is finite. The walk covers 0, -1, inf, nan and a huge value for each field, discovered from
the default config (fields whose default is a number) and the annotations (optional `int | None` /
`float | None` fields). Also: `convert --ratio`, LSLM's token ids and its Beta prior, and legal values that
earlier checks refused (a norm eps >= 1, LSLM without an eos id, ...), which must build, run and
generate.
"""

from __future__ import annotations

import inspect
import math
import re
from typing import Any

import pytest
import torch

from hf_concept.cli import main
from tests.conformance.families import FAMILIES, FamilySpec

SPECS = {
    spec.name: spec
    for spec in FAMILIES
    if spec.name in ("plain", "conceptmoe-first", "dlcm", "hidden-decoding", "lslm")
}
HUGE = {"int": 10**12, "float": 1e30}
EXEMPT = {
    # transformers' own PretrainedConfig field (chunked feed-forward); no family of ours reads it.
    "chunk_size_feed_forward",
}
BACKBONE_ACCEPTED = {
    # eps only has to keep RMSNorm's division finite (eps >= 1 is legal).
    ("rms_norm_eps", 1e30),
    ("initializer_range", 0),
    ("attention_dropout", 0),
    ("rope_theta", 1e30),
    ("num_experts", 0),
    ("shared_expert_intermediate_size", 0),
    ("pad_token_id", 0),
}
CONCEPT_ACCEPTED = {
    ("boundary_tau", 1e30),
    ("boundary_sigma", 0),
    ("boundary_sigma", 1e30),
    ("aux_loss_weight", 0),
    ("aux_loss_weight", 1e30),
    ("boundary_fixed_bonus", 0),  # no bonus: the router alone
}
# Values that are valid for their field (sentinels such as 0 = dense or no dropout, and weights or scales
# with no upper bound); everything else in the walk must be refused.
ACCEPTED: dict[str, set[tuple[str, Any]]] = {
    "plain": BACKBONE_ACCEPTED | {("bos_token_id", 0), ("eos_token_id", 0)},
    "conceptmoe-first": BACKBONE_ACCEPTED
    | CONCEPT_ACCEPTED
    | {
        ("bos_token_id", 0),
        ("eos_token_id", 0),
        ("encoder_layers", 0),
        ("decoder_layers", 0),
        ("joint_decoding_layers", 0),
    },
    "dlcm": BACKBONE_ACCEPTED
    | CONCEPT_ACCEPTED
    | {
        ("bos_token_id", 0),
        ("eos_token_id", 0),
        ("mup_token_learning_rate", 1e30),
        ("mup_concept_learning_rate", 1e30),
        ("mup_other_learning_rate", 1e30),
    },
    "hidden-decoding": BACKBONE_ACCEPTED | {("bos_token_id", 0), ("eos_token_id", 0)},
    # LSLM's five special ids must differ: 0 is the pad id, so bos, eos and the markers cannot take it.
    "lslm": BACKBONE_ACCEPTED
    | {
        ("kl_weight", 0),
        ("kl_weight", 1e30),
        ("boundary_seed", 0),
        ("update_schedule", 0),
        ("segmental_flips", 0),
    },
}


def numeric_fields(config_class: type) -> dict[str, str]:
    """Field -> "int" or "float": fields whose default is a number (not a bool), and fields of our classes
    annotated `int | None` / `float | None` whose default is None."""
    defaults = config_class().to_dict()
    fields = {
        name: "float" if isinstance(value, float) else "int"
        for name, value in defaults.items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }
    for klass in config_class.__mro__:
        if not klass.__module__.startswith("hf_concept."):
            continue
        for name, annotation in inspect.get_annotations(klass).items():
            if name not in fields and annotation in ("int | None", "float | None"):
                fields[name] = annotation.split()[0]
    return {name: kind for name, kind in sorted(fields.items()) if name not in EXEMPT}


def walk_cases() -> list[tuple[str, str, Any]]:
    cases = []
    for family, spec in SPECS.items():
        for field, kind in numeric_fields(type(spec.make_config())).items():
            cases += [(family, field, value) for value in (0, -1, math.inf, math.nan, HUGE[kind])]
    return cases


CASES = walk_cases()


@torch.no_grad()
def assert_runs_finite(spec: FamilySpec, config: Any) -> None:
    """A training-mode forward with labels (noise, loss terms) and an eval forward (thresholds) on a
    (2, 9) batch of non-special ids: logits and loss are finite."""
    torch.manual_seed(0)
    model = spec.model_class()(config).train()
    input_ids = torch.randint(5, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    outputs = model(input_ids=input_ids, labels=input_ids)
    assert torch.isfinite(outputs.logits).all() and torch.isfinite(outputs.loss)
    assert torch.isfinite(model.eval()(input_ids=input_ids).logits).all()


def test_the_walk_covers_every_family_and_the_optional_fields():
    walked = {(family, field) for family, field, _ in CASES}
    for family, field in [
        ("plain", "sliding_window"),
        ("conceptmoe-first", "compression_ratio"),
        ("conceptmoe-first", "concept_hidden_size"),
        ("dlcm", "mup_base_width"),
        ("hidden-decoding", "num_streams"),
        ("lslm", "segment_end_token_id"),
        ("lslm", "prior_alpha"),
    ]:
        assert (family, field) in walked, (family, field)
    for family, accepted in ACCEPTED.items():
        assert {field for field, _ in accepted} <= {field for name, field, _ in CASES if name == family}


@pytest.mark.parametrize(
    ("family", "field", "value"), CASES, ids=[f"{family}-{field}-{value!r}" for family, field, value in CASES]
)
def test_numeric_field_is_refused_or_runs(family, field, value):
    spec = SPECS[family]
    if (field, value) in ACCEPTED[family]:
        config = spec.make_config(**{field: value})
        assert getattr(config, field) == value
        assert_runs_finite(spec, config)
        return
    with pytest.raises(ValueError) as error:
        spec.make_config(**{field: value})
    message = str(error.value)
    assert f"{field}={value!r}" in message, message


@pytest.mark.parametrize("family", ["conceptmoe-first", "dlcm"])
def test_compression_ratio_is_at_most_max_position_embeddings(family):
    spec = SPECS[family]
    limit = spec.make_config().max_position_embeddings
    assert_runs_finite(spec, spec.make_config(compression_ratio=float(limit)))
    for ratio in (limit + 0.5, 1e9):
        with pytest.raises(
            ValueError, match=rf"compression_ratio={ratio!r}.*max_position_embeddings={limit}"
        ):
            spec.make_config(compression_ratio=ratio)


@pytest.mark.parametrize(
    "field",
    ["pad_token_id", "bos_token_id", "eos_token_id", "segment_start_token_id", "segment_end_token_id"],
)
def test_lslm_token_ids_outside_the_vocabulary_are_refused(field):
    spec = SPECS["lslm"]
    vocab_size = spec.make_config().vocab_size
    for value in (vocab_size, -1):
        with pytest.raises(ValueError, match=rf"^{field}={value}.*vocab_size={vocab_size}"):
            spec.make_config(**{field: value})


def test_lslm_special_token_ids_must_differ():
    with pytest.raises(ValueError, match=r"segment_end_token_id=3.*segment_start_token_id=3"):
        SPECS["lslm"].make_config(segment_end_token_id=3)


def test_lslm_beta_prior_names_its_own_fields():
    make = SPECS["lslm"].make_config
    with pytest.raises(ValueError, match=r"^prior_alpha=-1\.0 must be"):
        make(prior_alpha=-1.0, prior_beta=3.0)
    with pytest.raises(ValueError, match=r"^prior_beta=nan must be"):
        make(prior_alpha=1.0, prior_beta=math.nan)
    with pytest.raises(ValueError, match=r"prior_alpha=2\.0.*prior_beta=None"):
        make(prior_alpha=2.0)
    with pytest.raises(ValueError, match=r"prior_mean=0\.5.*prior_alpha=1\.0.*prior_beta=3\.0"):
        make(prior_mean=0.5, prior_alpha=1.0, prior_beta=3.0)
    assert make(prior_alpha=1.0, prior_beta=3.0).prior_mean == 0.25


@pytest.mark.parametrize("ratio", ["inf", "nan", "-inf", "1e400", "0.5", "-1", "two"])
def test_convert_ratio_not_finite_or_below_one_is_a_usage_error(ratio, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        # "--ratio=VALUE": argparse reads a separate "-inf" as an option, not as the flag's value.
        main(["convert", "conceptmoe", str(tmp_path / "src"), str(tmp_path / "dst"), f"--ratio={ratio}"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert (
        error.strip()
        .splitlines()[-1]
        .endswith(f"--ratio={ratio!r} must be a finite number >= 1 (tokens per concept)")
    )
    assert "Traceback" not in error


def test_convert_ratio_above_the_sources_positions_is_one_error_line(capsys, tmp_path):
    from tests.test_convert_conceptmoe import tiny_llama_folder

    source = tiny_llama_folder(tmp_path / "src", num_hidden_layers=5, max_position_embeddings=64)
    capsys.readouterr()
    assert main(["convert", "conceptmoe", str(source), str(tmp_path / "dst"), "--ratio", "1e9"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "Traceback" not in error, error
    assert "compression_ratio=1000000000.0 must be" in error and "max_position_embeddings=64" in error
    assert not (tmp_path / "dst").exists()


# Legal values that earlier checks refused: unusual, but nothing in the math or the cache breaks. Each
# builds, runs a finite forward and generates.
RELAXED = [
    ("plain", dict(rms_norm_eps=1.0)),
    ("conceptmoe-first", dict(rms_norm_eps=2.5)),
    ("dlcm", dict(rms_norm_eps=1.0)),
    ("hidden-decoding", dict(rms_norm_eps=10.0)),
    ("lslm", dict(rms_norm_eps=1.0)),
    ("lslm", dict(eos_token_id=None)),
    ("plain", dict(initializer_range=2.0)),
    # Narrower than hidden_size=32 and not a multiple of its 4 heads: projections in and out, head_dim kept.
    ("conceptmoe-first", dict(concept_hidden_size=20)),
    ("dlcm", dict(chunking="fixed", compression_ratio=1.0)),
    ("lslm", dict(boundary_rule="threshold", boundary_threshold=1.0)),
]


@pytest.mark.parametrize(
    ("family", "overrides"), RELAXED, ids=[f"{family}-{overrides}" for family, overrides in RELAXED]
)
def test_legal_values_build_run_and_generate(family, overrides):
    spec = SPECS[family]
    config = spec.make_config(**overrides)
    assert {name: getattr(config, name) for name in overrides} == overrides
    assert_runs_finite(spec, config)
    model = spec.model_class()(config).eval()
    prompt = torch.randint(5, config.vocab_size, (2, 4), generator=torch.Generator().manual_seed(2))
    out = model.generate(
        prompt,
        max_new_tokens=4,
        min_new_tokens=4,
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=True,
    )
    assert len(out.scores) == 4 and out.sequences.shape[0] == 2
    # min_new_tokens sets the eos score to -inf; nothing may be nan.
    assert not any(torch.isnan(scores).any() for scores in out.scores)


def test_lslm_without_eos_stops_at_max_new_tokens():
    spec = SPECS["lslm"]
    model = spec.model_class()(spec.make_config(eos_token_id=None)).eval()
    assert model.generation_config.eos_token_id is None
    prompt = torch.randint(5, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(3))
    out = model.generate(
        prompt, max_new_tokens=7, do_sample=False, return_dict_in_generate=True, output_scores=True
    )
    assert len(out.scores) == 7


@pytest.mark.parametrize(
    ("field", "value"),
    [("eos_token_id", -1), ("eos_token_id", []), ("pad_token_id", None), ("bos_token_id", None)],
)
def test_lslm_special_ids_other_than_a_missing_eos_are_still_refused(field, value):
    with pytest.raises(ValueError, match="^" + re.escape(f"{field}={value!r} must be")):
        SPECS["lslm"].make_config(**{field: value})
