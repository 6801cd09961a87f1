"""Each family's checkpoint carries exactly the remote code its `FamilySpec.remote_code_files` declares
(tests/conformance/families.py): what `save_pretrained`, the checkpoint writer and the converters put in
the folder, and what `push` checks for. An import that brings another file into a family's closure (or
drops one) fails here until the declaration says so. LSLM and Hidden Decoding carry none of another
family's machinery."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_concept.conversion import convert_to_conceptmoe, convert_to_hidden_decoding, expand_hidden_decoding
from hf_concept.conversion.writer import write_config_with_remote_code
from hf_concept.hub import required_code_files
from tests.conformance.families import FAMILIES
from tests.test_convert_conceptmoe import CONVERT_EXACT, tiny_llama_folder

SPECS = {spec.name: spec for spec in FAMILIES}
# The concept families' machinery (ConceptMoE's and DLCM's chunking, concept cache and concept stack).
CONCEPT_MACHINERY = ("concept_chunking.py", "concept_cache.py", "concept_stack.py")


def python_files(folder: Path) -> set[str]:
    return {path.name for path in folder.glob("*.py")}


def save_tokenizer(model_type: str, folder: Path) -> None:
    """Save the family's own tokenizer beside the model, for a family that has one (LSLM's bytes)."""
    if model_type == "lslm":
        from hf_concept.modeling.tokenization_lslm import ByteTokenizer

        ByteTokenizer().save_pretrained(folder)


def test_each_family_declares_its_files_once_and_only_files_that_exist():
    modeling = Path(__file__).resolve().parents[1] / "src" / "hf_concept" / "modeling"
    by_family: dict[type, tuple[str, ...]] = {}
    for spec in FAMILIES:
        files = spec.remote_code_files
        assert len(set(files)) == len(files), f"{spec.name} declares a file twice: {sorted(files)}"
        assert all((modeling / name).is_file() for name in files), spec.name
        declared = by_family.setdefault(spec.model_class(), files)
        assert set(declared) == set(files), f"{spec.name} declares other files than its family's"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_save_pretrained_writes_the_declared_files(name, tmp_path):
    spec = SPECS[name]
    torch.manual_seed(0)
    model = spec.model_class()(spec.make_config())
    model.save_pretrained(tmp_path)
    save_tokenizer(model.config.model_type, tmp_path)
    assert python_files(tmp_path) == set(spec.remote_code_files)
    # The closure `push` checks a folder against: nothing written is unused, nothing used is missing.
    assert required_code_files(tmp_path) == sorted(spec.remote_code_files)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_checkpoint_writer_copies_the_declared_files(name, tmp_path):
    """What a streaming conversion writes for a family (`write_config_with_remote_code`)."""
    spec = SPECS[name]
    write_config_with_remote_code(tmp_path, spec.make_config(), {"AutoModelForCausalLM": spec.model_class()})
    assert python_files(tmp_path) == set(spec.remote_code_files)


def test_a_conceptmoe_conversion_ships_the_declared_files(tmp_path):
    source = tiny_llama_folder(tmp_path / "src")
    convert_to_conceptmoe(source, tmp_path / "dst", max_shard_size="20KB", **CONVERT_EXACT)
    assert python_files(tmp_path / "dst") == set(SPECS["conceptmoe-first"].remote_code_files)


def test_hidden_decoding_conversion_and_expansion_ship_the_declared_files(tmp_path):
    source = tiny_llama_folder(tmp_path / "src")
    convert_to_hidden_decoding(source, tmp_path / "two", num_streams=2, max_shard_size="20KB")
    expand_hidden_decoding(tmp_path / "two", tmp_path / "four", num_streams=4, max_shard_size="20KB")
    declared = set(SPECS["hidden-decoding"].remote_code_files)
    assert python_files(tmp_path / "two") == declared
    assert python_files(tmp_path / "four") == declared


@pytest.mark.parametrize("name", ["lslm", "hidden-decoding"])
def test_lslm_and_hidden_decoding_ship_no_other_familys_machinery(name, tmp_path):
    spec = SPECS[name]
    spec.model_class()(spec.make_config()).save_pretrained(tmp_path)
    save_tokenizer(spec.make_config().model_type, tmp_path)
    shipped = python_files(tmp_path)
    assert not shipped & {*CONCEPT_MACHINERY, "concept_views.py", "concept_config.py"}, sorted(shipped)
    # The plain decoder's model classes; the causal-LM half every family shares is causal_lm.py.
    assert "modeling_plain.py" not in shipped
