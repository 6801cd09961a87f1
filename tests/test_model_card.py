"""Model cards: every family's template renders from a saved config, the metadata round-trips through
`huggingface_hub.ModelCard.load`, and the settings, figures and the exact load snippet are in the text."""

from __future__ import annotations

import pytest
from huggingface_hub import ModelCard
from transformers import LlamaConfig

from hf_concept.model_card import card_license, write_model_card
from tests.conformance.families import FAMILIES

SPECS = {spec.name: spec for spec in FAMILIES}
TRAINING = {"max_steps": 40, "learning_rate": 3e-4, "data": "bundled corpus", "lora": False}
EVALUATION = {"eval_loss": 2.345678, "bits_per_byte": 1.25}


def tiny_lslm_config():
    from hf_concept.modeling.configuration_lslm import LSLMConfig

    sizes = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4)
    sizes.update(head_dim=8, token_encoder_layers=1, segment_encoder_layers=1, decoder_layers=1)
    sizes.update(token_hidden_size=16, token_num_attention_heads=2, token_intermediate_size=32)
    sizes.update(decoder_hidden_size=16, decoder_num_attention_heads=2, decoder_intermediate_size=32)
    return LSLMConfig(router_intermediate_size=32, **sizes)


# (config factory, family, settings the card must carry, compression unit)
CASES = {
    "plain": (SPECS["plain-moe"].make_config, "hf_concept_plain", {"num_experts": 4, "num_hidden_layers": 2}),
    "conceptmoe": (
        SPECS["conceptmoe-first"].make_config,
        "conceptmoe",
        {"concept_layers": 1, "pooling": "first", "joint_decoding_layers": 2},
    ),
    "hidden_decoding": (
        SPECS["hidden-decoding"].make_config,
        "hidden_decoding",
        {"num_streams": 3, "stream_attention_layout": "ilif", "cross_stream_layers": 2, "sliding_window": 5},
    ),
    "dlcm": (
        SPECS["dlcm-rule-mup"].make_config,
        "dlcm",
        {"concept_hidden_size": 48, "rule_threshold": 0.3, "smoothing": "linear"},
    ),
    "lslm": (tiny_lslm_config, "lslm", {"token_encoder_layers": 1, "token_hidden_size": 16}),
}


def card_of(path) -> tuple[dict, str]:
    card = ModelCard.load(path)
    return card.data.to_dict(), card.text


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_family_card_round_trips_with_settings_figures_and_snippet(tmp_path, case):
    make_config, family, expected_settings = CASES[case]
    make_config().save_pretrained(tmp_path / "ckpt")
    path = write_model_card(
        tmp_path / "ckpt",
        base_model="org/source-model",
        training=TRAINING,
        evaluation=EVALUATION,
        compression=1.98765,
        license="apache-2.0",
        name_or_path="org/tiny",
    )
    assert path == tmp_path / "ckpt" / "README.md"
    data, text = card_of(path)
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-generation"
    assert data["base_model"] == "org/source-model" and data["license"] == "apache-2.0"
    assert data["tags"] == ["custom_code", family, "hf_concept"]
    assert {key: data[family][key] for key in expected_settings} == expected_settings
    for key, value in expected_settings.items():
        assert f"| {key} | {value} |" in text
    recorded = data["hf_concept"]
    assert recorded["evaluation"] == EVALUATION and recorded["training"] == TRAINING
    assert recorded["realised_compression"] == 1.98765 and recorded["load_id"] == "org/tiny"
    unit = "bytes per segment" if family == "lslm" else "tokens per concept"
    assert f"| realised compression at inference ({unit}) | 1.988 |" in text
    assert "| eval_loss | 2.346 |" in text and "| bits_per_byte | 1.25 |" in text
    assert "| learning_rate | 0.0003 |" in text and "| data | bundled corpus |" in text
    assert 'model = AutoModelForCausalLM.from_pretrained("org/tiny", trust_remote_code=True)' in text
    # No tokenizer in the folder: the snippet takes the base model's; LSLM's byte tokenizer is code.
    tokenizer_trust = ", trust_remote_code=True" if family == "lslm" else ""
    assert f'tokenizer = AutoTokenizer.from_pretrained("org/source-model"{tokenizer_trust})' in text
    assert "{{" not in text and "{%" not in text


def test_hidden_decoding_card_lists_the_layer_layout(tmp_path):
    SPECS["hidden-decoding"].make_config().save_pretrained(tmp_path)
    _, text = card_of(write_model_card(tmp_path))
    rows = [f"| {index} | {kind} |" for index, kind in enumerate(["intra", "local", "intra", "full"])]
    assert all(row in text for row in rows)
    assert "`sliding_window` (5) counts expanded positions, in which every token occupies\n3 slots" in text
    config = SPECS["hidden-decoding"].make_config()
    config.local_window, config.sliding_window = 2, 6
    config.save_pretrained(tmp_path / "tokens")
    _, text = card_of(write_model_card(tmp_path / "tokens"))
    assert "A `local` layer sees the last 2 tokens: `sliding_window` =\n6 positions" in text


def test_minimal_card_has_no_results_and_loads_from_the_folder(tmp_path):
    SPECS["conceptmoe-first"].make_config().save_pretrained(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "tokenizer.json").write_text("{}")
    data, text = card_of(write_model_card(tmp_path / "ckpt"))
    assert "base_model" not in data and "license" not in data
    assert "## Results" not in text and "## Training" not in text
    folder = str(tmp_path / "ckpt")
    assert f'AutoModelForCausalLM.from_pretrained("{folder}", trust_remote_code=True)' in text
    assert f'AutoTokenizer.from_pretrained("{folder}")' in text


def test_native_llama_card_needs_no_remote_code(tmp_path):
    sizes = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2)
    LlamaConfig(num_attention_heads=2, num_key_value_heads=2, **sizes).save_pretrained(tmp_path)
    data, text = card_of(write_model_card(tmp_path, name_or_path="org/llama"))
    assert data["tags"] == ["llama", "hf_concept"] and data["llama"]["hidden_size"] == 16
    assert 'AutoModelForCausalLM.from_pretrained("org/llama")\n' in text
    assert "trust_remote_code" not in text and text.startswith("\n# llama model")


def test_a_local_base_model_stays_out_of_the_metadata(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    SPECS["plain"].make_config().save_pretrained(tmp_path / "ckpt")
    data, text = card_of(write_model_card(tmp_path / "ckpt", base_model=str(source)))
    # The Hub rejects a base_model that is not a repo id; the body still names the source.
    assert "base_model" not in data and data["hf_concept"]["base_model"] == str(source)
    assert f"from `{source}`" in text


def test_rewriting_a_card_keeps_the_recorded_facts(tmp_path):
    SPECS["dlcm"].make_config().save_pretrained(tmp_path)
    write_model_card(tmp_path, base_model="org/base", evaluation={"eval_loss": 3.5}, license="mit")
    # A re-render (only the load id changes) keeps everything recorded.
    write_model_card(tmp_path, name_or_path="org/dlcm-tiny", settings={"note": "kept"})
    data, text = card_of(tmp_path / "README.md")
    assert data["base_model"] == "org/base" and data["license"] == "mit" and card_license(tmp_path) == "mit"
    assert data["hf_concept"]["evaluation"] == {"eval_loss": 3.5} and data["dlcm"]["note"] == "kept"
    assert '.from_pretrained("org/dlcm-tiny", trust_remote_code=True)' in text
    # New results replace the old ones as a group; provenance stays.
    write_model_card(tmp_path, compression=2.5)
    data, text = card_of(tmp_path / "README.md")
    assert data["hf_concept"]["realised_compression"] == 2.5 and "evaluation" not in data["hf_concept"]
    assert "eval_loss" not in text and data["base_model"] == "org/base" and data["dlcm"]["note"] == "kept"


def test_missing_or_broken_config_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"no config\.json in .*a model card needs"):
        write_model_card(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json' is not valid JSON"):
        write_model_card(tmp_path)
    assert not (tmp_path / "README.md").exists()


def test_conversion_card_names_the_source_type_and_inherits_its_licence(tmp_path):
    from hf_concept.conversion.conceptmoe import convert_to_conceptmoe
    from tests.test_convert_conceptmoe import CONVERT_EXACT, tiny_llama_folder

    source = tiny_llama_folder(tmp_path / "src")
    (source / "README.md").write_text("---\nlicense: llama3.2\n---\n# the source\n")
    destination = convert_to_conceptmoe(source, tmp_path / "dst", **CONVERT_EXACT)
    data, text = card_of(destination / "README.md")
    assert data["license"] == "llama3.2" and data["conceptmoe"]["source_model_type"] == "llama"
    assert "produced by `hf-concept convert conceptmoe` from a `llama`" in text
    # The snippet names the final folder, not the temporary one the conversion wrote into.
    assert f'from_pretrained("{destination}", trust_remote_code=True)' in text
