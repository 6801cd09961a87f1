"""Misspelt config keyword arguments: an unknown key that spells close to one of the
config's own fields gets one warning naming the key and the field, in every family; transformers' own keys,
unrelated extra keys and saved configs never warn."""

from __future__ import annotations

import json
import logging

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from tests.conformance.families import FAMILIES

SPECS = {
    spec.name: spec
    for spec in FAMILIES
    if spec.name in ("plain", "conceptmoe-first", "dlcm", "hidden-decoding", "lslm")
}
# (misspelt key, the field it resembles, a value that differs from the field's value in the tiny config)
TYPOS = {
    "plain": ("rms_norm_epsilon", "rms_norm_eps", 0.5),
    "conceptmoe-first": ("compresion_ratio", "compression_ratio", 4.0),
    "dlcm": ("smothing", "smoothing", "linear"),
    "hidden-decoding": ("num_stream", "num_streams", 3),
    "lslm": ("prior_mena", "prior_mean", 0.3),
}
# Keys transformers writes into config.json or reads from a config's keyword arguments.
TRANSFORMERS_KEYS = dict(
    architectures=["SomethingForCausalLM"],
    auto_map={"AutoConfig": "configuration_x.XConfig"},
    transformers_version="4.57.0",
    dtype="float32",
    torch_dtype="float32",
    _name_or_path="some/model",
    name_or_path="some/model",
    _attn_implementation_autoset=True,
    attn_implementation="eager",
    output_attentions=False,
    num_labels=2,
    max_length=20,
    temperature=0.7,
    do_sample=True,
    num_beams=1,
    max_new_tokens=8,
    top_k=5,
    sep_token_id=3,
    decoder_start_token_id=1,
    tokenizer_class="PreTrainedTokenizerFast",
)
WARNING_TEXT = "unknown keyword argument"


def typo_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if WARNING_TEXT in record.getMessage()]


@pytest.mark.parametrize("family", sorted(SPECS))
def test_a_misspelt_field_warns_naming_it_and_the_field(family, caplog):
    key, field, value = TYPOS[family]
    default = getattr(SPECS[family].make_config(), field)
    with caplog.at_level(logging.WARNING):
        config = SPECS[family].make_config(**{key: value})
    messages = typo_warnings(caplog)
    assert len(messages) == 1, messages
    assert f"{key}={value!r}" in messages[0] and f"did you mean {field}?" in messages[0], messages[0]
    assert type(config).__name__ in messages[0]
    # The typo changed nothing: that is why it is worth a warning.
    assert getattr(config, field) == default


def test_the_issue_example_keeps_ratio_two_and_says_so(caplog):
    from hf_concept.modeling.configuration_conceptmoe import ConceptMoEConfig

    with caplog.at_level(logging.WARNING):
        config = ConceptMoEConfig(compresion_ratio=4.0)
    assert config.compression_ratio == 2.0
    assert typo_warnings(caplog) == [
        "ConceptMoEConfig got an unknown keyword argument compresion_ratio=4.0, which no model reads (it is "
        "kept as a plain attribute); did you mean compression_ratio?"
    ]


@pytest.mark.parametrize("family", sorted(SPECS))
def test_transformers_keys_and_unrelated_extras_never_warn(family, caplog):
    with caplog.at_level(logging.WARNING):
        config = SPECS[family].make_config(**TRANSFORMERS_KEYS, my_experiment_note="run 7")
    assert typo_warnings(caplog) == []
    assert config.my_experiment_note == "run 7"


@pytest.mark.parametrize("family", sorted(SPECS))
def test_saving_and_loading_never_warns(family, tmp_path, caplog):
    spec = SPECS[family]
    model = spec.model_class()(spec.make_config())
    with caplog.at_level(logging.WARNING):
        model.save_pretrained(tmp_path)
        type(model.config).from_pretrained(tmp_path)
        AutoConfig.from_pretrained(tmp_path, trust_remote_code=True)
        AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True)
    assert typo_warnings(caplog) == []


def test_a_saved_file_with_an_unknown_close_key_loads_quietly(tmp_path, caplog):
    """A config.json written by another version or tool is data, not a hand-typed argument."""
    spec = SPECS["conceptmoe-first"]
    spec.make_config().save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "compresion_ratio": 4.0}))
    with caplog.at_level(logging.WARNING):
        config = type(spec.make_config()).from_pretrained(tmp_path)
    assert typo_warnings(caplog) == []
    assert config.compression_ratio == spec.make_config().compression_ratio


def test_a_misspelt_override_to_from_pretrained_warns(tmp_path, caplog):
    spec = SPECS["dlcm"]
    spec.make_config().save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING):
        type(spec.make_config()).from_pretrained(tmp_path, compresion_ratio=3.0)
    messages = typo_warnings(caplog)
    assert len(messages) == 1 and "did you mean compression_ratio?" in messages[0], messages


def test_the_check_lives_in_one_sibling_module():
    """Remote code: the families import the shared check from the model folder, not from hf_concept."""
    from pathlib import Path

    import hf_concept.modeling as folder

    sources = {path.name: path.read_text() for path in Path(folder.__path__[0]).glob("configuration_*.py")}
    callers = [name for name, text in sources.items() if "warn_misspelt_keys(" in text]
    assert callers == ["configuration_plain.py"]
    assert "from .config_typos import" in sources["configuration_plain.py"]
