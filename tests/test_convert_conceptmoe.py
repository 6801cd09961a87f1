"""Converting source checkpoints into ConceptMoE checkpoints, and the atomic checkpoint writer.

Writer: shards never exceed the limit (unless one tensor does), one shard is `model.safetensors`, a
failure at any point leaves neither the destination nor a temporary folder, an existing non-empty
destination is refused (or, with overwrite, replaced only once the new folder is complete), the written
config and remote code load through the Auto classes.
Converter: clear errors, with no destination left, for an unsupported model_type, `.bin` weights
without the flag, a truncated or missing shard, a config that does not match the weights, a layer split
without a concept layer. Layout of the converted checkpoint: renamed layers, new tensors, options,
auto_map, remote code, side files, model card.
Acceptance: every source type converted with fixed chunking and R = 1 gives the source's logits
(atol = rtol = 1e-4, fp32, left-padded batch, real tokens) when loaded in a fresh `python -I` process
that cannot import hf_concept; the CLI's default conversion generates with the ConceptCache the same
greedy tokens as without a cache."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from torch.testing import assert_close
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from hf_concept.conversion import SUPPORTED_SOURCE_TYPES
from hf_concept.conversion.conceptmoe import (
    conceptmoe_config_from_source,
    conceptmoe_name,
    convert_to_conceptmoe,
    resolve_dtype,
)
from hf_concept.conversion.writer import (
    ShardWriter,
    atomic_folder,
    check_destination,
    copy_side_files,
    parse_size,
    remote_code_files,
    write_config_with_remote_code,
    write_tensors,
)
from hf_concept.modeling.configuration_plain import PlainDecoderConfig
from hf_concept.modeling.modeling_plain import PlainDecoderForCausalLM, PlainDecoderModel
from hf_concept.modeling.transformers_compat import output_cache
from tests.fresh_process import fresh_process_logits
from tests.test_layers_compat import CASES, build_source, logits_of, padded_batch, save_sharded

TINY_LLAMA = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
CONVERT_EXACT = dict(encoder_layers=1, decoder_layers=1, chunking="fixed", compression_ratio=1)


def tiny_llama_folder(folder, seed: int = 0, **overrides):
    """A tiny random Llama saved sharded (several shards) with side files; returns the folder."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, **overrides}))
    model.save_pretrained(folder, max_shard_size="20KB")
    (folder / "tokenizer.json").write_text('{"version": "1.0", "note": "stand-in tokenizer file"}')
    (folder / "chat_template.jinja").write_text("{% for message in messages %}{{ message }}{% endfor %}")
    return folder


def entries(folder) -> list[str]:
    return sorted(path.name for path in folder.iterdir())


def named_tensors(count: int, size: int = 100) -> list[tuple[str, torch.Tensor]]:
    return [(f"tensor.{index}", torch.full((size,), float(index))) for index in range(count)]


def test_parse_size():
    from huggingface_hub.serialization._base import parse_size_to_int

    assert parse_size("2GB") == 2 * 10**9
    assert parse_size("40KB") == 40_000
    assert parse_size("1GiB") == 2**30
    assert parse_size(123) == 123
    assert parse_size("1000") == parse_size("1000B") == 1000
    # Decimal units mean what they mean to save_pretrained(max_shard_size=...).
    for size in ("2GB", "500MB", "1.5GB", "20KB", "1TB", " 3 mb "):
        assert parse_size(size) == parse_size_to_int(size)
    for bad in ("", "ten MB", "-1GB", 0, "0KB", "infGB", 1.5, None):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_size(bad)


def test_shards_stay_under_the_limit_and_the_index_names_every_tensor(tmp_path):
    # 10 tensors of 400 bytes, limit 1000 bytes: two per shard.
    tensors = named_tensors(10)
    files = write_tensors(tmp_path, iter(tensors), max_shard_size=1000)
    assert len(files) == 5
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {name for name, _ in tensors}
    assert index["metadata"]["total_size"] == 10 * 400
    loaded = {}
    for path in files:
        shard = load_file(path)
        assert sum(value.numel() * value.element_size() for value in shard.values()) <= 1000
        assert all(index["weight_map"][name] == path.name for name in shard)
        loaded.update(shard)
    for name, tensor in tensors:
        assert torch.equal(loaded[name], tensor)
    assert not [name for name in entries(tmp_path) if name.startswith(".")]


def test_one_shard_is_model_safetensors_and_oversized_tensors_get_their_own(tmp_path):
    single, several = tmp_path / "single", tmp_path / "several"
    single.mkdir()
    several.mkdir()
    assert write_tensors(single, iter(named_tensors(3)), max_shard_size="2GB") == [
        single / "model.safetensors"
    ]
    assert entries(single) == ["model.safetensors"]
    writer = ShardWriter(several, max_shard_size=100)
    for name, tensor in named_tensors(3):
        writer.add(name, tensor)
    assert len(writer.finish()) == 3
    with pytest.raises(ValueError, match=r"tensor\.0"):
        writer.add("tensor.0", torch.zeros(1))


def test_shards_and_index_are_what_save_torch_state_dict_writes(tmp_path):
    """Streamed in the same order, the shards hold the same tensors under the same names, and the index
    has the same weight map and total size, as huggingface_hub's planner gives for the whole dict;
    an oversized tensor in the middle gets its own shard while the open one stays open."""
    from huggingface_hub import save_torch_state_dict

    sizes = [30, 20, 300, 5, 90, 10, 50, 500, 5]
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    state = {
        f"layer.{index}.weight": torch.randn(size).to(dtypes[index % 3]) for index, size in enumerate(sizes)
    }
    streamed, library = tmp_path / "streamed", tmp_path / "library"
    streamed.mkdir()
    library.mkdir()
    written = write_tensors(streamed, iter(state.items()), max_shard_size=200)
    save_torch_state_dict(state, library, max_shard_size=200)
    assert entries(streamed) == entries(library)
    assert len(written) == 6
    ours = json.loads((streamed / "model.safetensors.index.json").read_text())
    theirs = json.loads((library / "model.safetensors.index.json").read_text())
    assert ours["weight_map"] == theirs["weight_map"]
    assert ours["metadata"]["total_size"] == theirs["metadata"]["total_size"]
    for path in written:
        shard, expected = load_file(path), load_file(library / path.name)
        assert shard.keys() == expected.keys()
        assert all(torch.equal(shard[name], expected[name]) for name in shard)
    # layer.2 (600 bytes) went out on its own while layers 0, 1 and 3 shared the shard it interrupted.
    assert len({ours["weight_map"][f"layer.{index}.weight"] for index in (0, 1, 3)}) == 1


def test_split_views_are_written_as_separate_tensors(tmp_path):
    fused = torch.arange(12.0).reshape(2, 6)
    gate, up = fused.chunk(2, dim=1)
    write_tensors(tmp_path, iter([("gate", gate), ("up", up)]))
    loaded = load_file(tmp_path / "model.safetensors")
    assert torch.equal(loaded["gate"], gate) and torch.equal(loaded["up"], up)


def failing_stream(count: int):
    yield from named_tensors(count)
    raise RuntimeError("disk on fire")


def test_failure_mid_write_leaves_no_destination_and_no_temporary_folder(tmp_path):
    destination = tmp_path / "out"
    with pytest.raises(RuntimeError, match="disk on fire"), atomic_folder(destination) as folder:
        # Shards were already flushed when the failure comes.
        write_tensors(folder, failing_stream(6), max_shard_size=500)
    assert entries(tmp_path) == []
    with pytest.raises(RuntimeError), atomic_folder(tmp_path / "new" / "nested" / "out") as folder:
        write_tensors(folder, failing_stream(2))
    assert entries(tmp_path) == []
    # An interrupt (Ctrl-C) cleans up the same way.
    with pytest.raises(KeyboardInterrupt), atomic_folder(destination) as folder:
        write_tensors(folder, iter(named_tensors(2)))
        raise KeyboardInterrupt
    assert entries(tmp_path) == []


def test_existing_destination_is_refused_or_replaced_only_when_complete(tmp_path):
    destination = tmp_path / "out"
    destination.mkdir()
    (destination / "keep.txt").write_text("old")
    with pytest.raises(ValueError, match=r"out.*overwrite=True"):
        check_destination(destination, overwrite=False)
    with pytest.raises(ValueError, match="overwrite=True"), atomic_folder(destination):
        pytest.fail("the body must not run")
    with pytest.raises(RuntimeError), atomic_folder(destination, overwrite=True) as folder:
        write_tensors(folder, failing_stream(3))
    assert entries(destination) == ["keep.txt"]
    assert entries(tmp_path) == ["out"]
    with atomic_folder(destination, overwrite=True) as folder:
        write_tensors(folder, iter(named_tensors(2)))
    assert entries(destination) == ["model.safetensors"]
    assert entries(tmp_path) == ["out"]
    (tmp_path / "empty").mkdir()
    with atomic_folder(tmp_path / "empty") as folder:
        write_tensors(folder, iter(named_tensors(1)))
    assert entries(tmp_path / "empty") == ["model.safetensors"]


def test_conversion_into_a_non_empty_destination_is_refused(tmp_path):
    source = tiny_llama_folder(tmp_path / "src")
    destination = tmp_path / "dst"
    destination.mkdir()
    (destination / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"dst.*not empty"):
        convert_to_conceptmoe(source, destination, **CONVERT_EXACT)
    assert entries(destination) == ["notes.txt"]
    assert (destination / "notes.txt").read_text() == "mine"
    assert entries(tmp_path) == ["dst", "src"]
    convert_to_conceptmoe(source, destination, overwrite=True, **CONVERT_EXACT)
    assert "notes.txt" not in entries(destination) and (destination / "config.json").is_file()
    assert entries(tmp_path) == ["dst", "src"]


def test_unsupported_model_type_is_named(tmp_path):
    GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=32, n_layer=1, n_head=4)).save_pretrained(
        tmp_path / "g"
    )
    with pytest.raises(ValueError, match=r"model_type='gpt2'.*llama.*qwen3_moe"):
        convert_to_conceptmoe(tmp_path / "g", tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


def test_layer_split_without_a_concept_layer_is_refused():
    source_config = LlamaConfig(**TINY_LLAMA)
    options = dict(CONVERT_EXACT, joint_decoding_layers=None, concept_loop=None, experts_per_token=None)
    options.update(router="cosine", router_init="random", pooling="first", encoder_layers=2, decoder_layers=2)
    with pytest.raises(ValueError, match=r"encoder_layers=2.*decoder_layers=2.*num_hidden_layers=4"):
        conceptmoe_config_from_source(source_config, **options)
    options.update(encoder_layers=1, decoder_layers=1, experts_per_token=1)
    with pytest.raises(ValueError, match=r"experts_per_token=1.*'llama'"):
        conceptmoe_config_from_source(source_config, **options)
    options.update(experts_per_token=None, router="linear", router_init="identity")
    with pytest.raises(ValueError, match="router_init='identity'"):
        conceptmoe_config_from_source(source_config, **options)


def test_output_dtype_defaults_to_the_source_dtype():
    assert resolve_dtype(None, LlamaConfig(**TINY_LLAMA, dtype="bfloat16")) == torch.bfloat16
    assert resolve_dtype(None, LlamaConfig(**TINY_LLAMA)) == torch.float32
    assert resolve_dtype("float16", LlamaConfig(**TINY_LLAMA, dtype="bfloat16")) == torch.float16
    with pytest.raises(ValueError, match="dtype='int8'"):
        resolve_dtype("int8", LlamaConfig(**TINY_LLAMA))


def test_layer_names_follow_the_split():
    names = [conceptmoe_name(f"model.layers.{index}.mlp.up_proj.weight", 2, 3) for index in range(7)]
    assert names == [
        "model.encoder_layers.0.mlp.up_proj.weight",
        "model.encoder_layers.1.mlp.up_proj.weight",
        "model.concept_layers.0.mlp.up_proj.weight",
        "model.concept_layers.1.mlp.up_proj.weight",
        "model.concept_layers.2.mlp.up_proj.weight",
        "model.decoder_layers.0.mlp.up_proj.weight",
        "model.decoder_layers.1.mlp.up_proj.weight",
    ]
    assert conceptmoe_name("model.embed_tokens.weight", 2, 3) == "model.embed_tokens.weight"
    assert conceptmoe_name("lm_head.weight", 2, 3) == "lm_head.weight"


def test_truncated_shard_is_named_and_nothing_is_written(tmp_path):
    source = tiny_llama_folder(tmp_path / "src")
    shard = sorted(source.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size - 100])
    with pytest.raises(ValueError, match=rf"{shard.name}.*truncated"):
        convert_to_conceptmoe(source, tmp_path / "dst", **CONVERT_EXACT)
    assert entries(tmp_path) == ["src"]


def test_missing_shard_is_named_and_nothing_is_written(tmp_path):
    source = tiny_llama_folder(tmp_path / "src")
    shard = sorted(source.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ValueError, match=rf"{shard.name}.*missing"):
        convert_to_conceptmoe(source, tmp_path / "dst", **CONVERT_EXACT)
    assert entries(tmp_path) == ["src"]


def test_cli_user_error_is_one_line_and_exit_status_2(tmp_path):
    GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=32, n_layer=1, n_head=4)).save_pretrained(
        tmp_path / "g"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "hf_concept",
            "convert",
            "conceptmoe",
            str(tmp_path / "g"),
            str(tmp_path / "d"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "gpt2" in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "d").exists()


def test_written_config_and_remote_code_load_through_the_auto_classes(tmp_path):
    """The writer is family-agnostic: a plain-family checkpoint it writes loads with trust_remote_code."""
    from transformers import AutoModel, AutoModelForCausalLM

    torch.manual_seed(0)
    config = PlainDecoderConfig(**{**TINY_LLAMA, "tie_word_embeddings": True})
    model = PlainDecoderForCausalLM(config).eval()
    state = {name: value for name, value in model.state_dict().items() if name != "lm_head.weight"}
    source = tiny_llama_folder(tmp_path / "src")
    destination = tmp_path / "dst"
    with atomic_folder(destination) as folder:
        write_tensors(folder, iter(state.items()), max_shard_size="30KB")
        write_config_with_remote_code(
            folder, config, {"AutoModel": PlainDecoderModel, "AutoModelForCausalLM": PlainDecoderForCausalLM}
        )
        assert copy_side_files(source, folder) == [
            "tokenizer.json",
            "chat_template.jinja",
            "generation_config.json",
        ]
    code = {path.name for path in remote_code_files(PlainDecoderConfig, PlainDecoderForCausalLM)}
    assert {"configuration_plain.py", "modeling_plain.py", "layers.py"} <= code
    assert code <= {path.name for path in destination.glob("*.py")}
    assert json.loads((destination / "config.json").read_text())["auto_map"] == {
        "AutoConfig": "configuration_plain.PlainDecoderConfig",
        "AutoModel": "modeling_plain.PlainDecoderModel",
        "AutoModelForCausalLM": "modeling_plain.PlainDecoderForCausalLM",
    }
    for name in ("tokenizer.json", "chat_template.jinja", "generation_config.json"):
        assert (destination / name).read_bytes() == (source / name).read_bytes()
    reloaded = AutoModelForCausalLM.from_pretrained(destination, trust_remote_code=True).eval()
    input_ids = torch.randint(0, TINY_LLAMA["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_close(reloaded(input_ids).logits, model(input_ids).logits, atol=0, rtol=0)
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    base = AutoModel.from_pretrained(destination, trust_remote_code=True)
    assert type(base).__name__ == "PlainDecoderModel"


def test_written_remote_code_is_what_save_pretrained_writes(tmp_path):
    """The same .py files, byte for byte, and the same auto_map as save_pretrained of the registered
    classes; config.json has every field, not only those that differ from the defaults."""
    torch.manual_seed(0)
    config = PlainDecoderConfig(**TINY_LLAMA)
    PlainDecoderForCausalLM(config).save_pretrained(tmp_path / "saved")
    (tmp_path / "written").mkdir()
    write_config_with_remote_code(
        tmp_path / "written",
        PlainDecoderConfig(**TINY_LLAMA),
        {"AutoModel": PlainDecoderModel, "AutoModelForCausalLM": PlainDecoderForCausalLM},
    )
    code = {
        folder: {path.name: path.read_bytes() for path in (tmp_path / folder).glob("*.py")}
        for folder in ("saved", "written")
    }
    assert code["written"] == code["saved"] and len(code["saved"]) >= 3
    saved, written = (
        json.loads((tmp_path / folder / "config.json").read_text()) for folder in ("saved", "written")
    )
    assert written["auto_map"] == saved["auto_map"]
    assert set(saved) - {"transformers_version"} <= set(written)


def test_an_unregistered_config_class_is_refused(tmp_path):
    config = PlainDecoderConfig(**TINY_LLAMA)
    config._auto_class = None
    with pytest.raises(ValueError, match="register_for_auto_class"):
        write_config_with_remote_code(tmp_path, config, {"AutoModelForCausalLM": PlainDecoderForCausalLM})
    assert entries(tmp_path) == []


def convert_tiny(tmp_path, name: str = "dst", source=None, **options):
    source = source or tiny_llama_folder(tmp_path / "src")
    destination = tmp_path / name
    convert_to_conceptmoe(source, destination, **{"max_shard_size": "20KB", **options})
    return source, destination


def read_checkpoint(folder) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in folder.glob("*.safetensors"):
        tensors.update(load_file(path))
    return tensors


def test_converted_checkpoint_layout(tmp_path):
    source, destination = convert_tiny(tmp_path, **CONVERT_EXACT)
    assert entries(tmp_path) == ["dst", "src"]
    before, after = read_checkpoint(source), read_checkpoint(destination)
    stages = {0: "encoder_layers.0", 1: "concept_layers.0", 2: "concept_layers.1", 3: "decoder_layers.0"}
    for index, stage in stages.items():
        for key in [key for key in before if key.startswith(f"model.layers.{index}.")]:
            assert torch.equal(after[key.replace(f"layers.{index}", stage)], before[key]), key
    for key in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert torch.equal(after[key], before[key])
    # J = min(4, decoder_layers) = 1: the only decoder layer reads concepts through zero projectors.
    for kind in "qkv":
        assert not after[f"model.decoder_layers.0.self_attn.concept_{kind}_proj.weight"].any()
    query = after["model.chunker.boundary_query.weight"]
    assert query.shape == (32, 32) and not torch.equal(query, after["model.chunker.boundary_key.weight"])
    assert abs(query.std().item() - 0.02) < 0.005
    index = json.loads((destination / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(after) and len(set(index["weight_map"].values())) > 1
    config = json.loads((destination / "config.json").read_text())
    assert config["model_type"] == "conceptmoe" and config["dechunk_residual"] == "delta"
    assert (config["encoder_layers"], config["decoder_layers"], config["num_hidden_layers"]) == (1, 1, 4)
    assert set(config["auto_map"]) == {"AutoConfig", "AutoModel", "AutoModelForCausalLM"}
    for module in {value.split(".")[0] for value in config["auto_map"].values()}:
        assert (destination / f"{module}.py").is_file()
    for name in ("tokenizer.json", "chat_template.jinja", "generation_config.json"):
        assert (destination / name).read_bytes() == (source / name).read_bytes()


def test_model_card_metadata_and_usage(tmp_path):
    from huggingface_hub import ModelCard

    _, destination = convert_tiny(tmp_path, base_model="someone/tiny-llama", **CONVERT_EXACT)
    card = ModelCard.load(destination / "README.md")
    data = card.data.to_dict()
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-generation"
    assert data["base_model"] == "someone/tiny-llama"
    assert data["tags"] == ["custom_code", "conceptmoe", "hf_concept"]
    assert data["conceptmoe"]["concept_layers"] == 2 and data["conceptmoe"]["chunking"] == "fixed"
    assert "trust_remote_code=True" in card.text and "someone/tiny-llama" in card.text


def test_options_reach_the_checkpoint(tmp_path):
    source = tiny_llama_folder(tmp_path / "src", num_hidden_layers=6)
    _, first = convert_tiny(tmp_path, "first", source, seed=3)
    _, again = convert_tiny(tmp_path, "again", source, seed=3)
    _, other = convert_tiny(tmp_path, "other", source, seed=4)
    first_q = read_checkpoint(first)["model.chunker.boundary_query.weight"]
    assert torch.equal(first_q, read_checkpoint(again)["model.chunker.boundary_query.weight"])
    assert not torch.equal(first_q, read_checkpoint(other)["model.chunker.boundary_query.weight"])
    _, varied = convert_tiny(
        tmp_path,
        "varied",
        source,
        router_init="identity",
        dtype="bfloat16",
        concept_loop=(0, 1, 2),
        joint_decoding_layers=0,
        pooling="mean",
        compression_ratio=3.0,
    )
    tensors = read_checkpoint(varied)
    assert {tensor.dtype for tensor in tensors.values()} == {torch.bfloat16}
    assert torch.equal(tensors["model.chunker.boundary_key.weight"], torch.eye(32, dtype=torch.bfloat16))
    assert not [name for name in tensors if "concept_q_proj" in name]
    config = json.loads((varied / "config.json").read_text())
    assert config["concept_loop"] == [0, 1, 2] and config["pooling"] == "mean"
    assert config["compression_ratio"] == 3.0 and config["dtype"] == "bfloat16"
    _, linear = convert_tiny(tmp_path, "linear", source, router="linear")
    assert read_checkpoint(linear)["model.chunker.score.weight"].shape == (1, 32)


def test_pickle_source_needs_the_flag(tmp_path):
    source = tiny_llama_folder(tmp_path / "src")
    tensors = read_checkpoint(source)
    for path in [*source.glob("*.safetensors"), source / "model.safetensors.index.json"]:
        path.unlink()
    torch.save(tensors, source / "pytorch_model.bin")
    with pytest.raises(ValueError, match="allow_pickle=True"):
        convert_to_conceptmoe(source, tmp_path / "dst", **CONVERT_EXACT)
    assert entries(tmp_path) == ["src"]
    convert_to_conceptmoe(source, tmp_path / "dst", allow_pickle=True, **CONVERT_EXACT)
    assert torch.equal(read_checkpoint(tmp_path / "dst")["model.norm.weight"], tensors["model.norm.weight"])


def test_config_that_does_not_match_the_weights_is_refused(tmp_path):
    source = tiny_llama_folder(tmp_path / "src")
    config_path = source / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "intermediate_size": 40}))
    with pytest.raises(
        ValueError, match=r"shape mismatch for 'model\.\w+_layers\.\d\.mlp\.\w+_proj\.weight'"
    ):
        convert_to_conceptmoe(source, tmp_path / "dst", **CONVERT_EXACT)
    assert entries(tmp_path) == ["src"]
    config_path.write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match=r"unused source tensors: \['model\.decoder_layers\.1\."):
        convert_to_conceptmoe(source, tmp_path / "dst", **CONVERT_EXACT)
    assert entries(tmp_path) == ["src"]


def test_every_source_type_converts_exactly(tmp_path):
    """fixed chunking, R = 1: every token is a concept, so the converted logits are the source's."""
    input_ids, attention_mask, position_ids = padded_batch()
    batch = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    real = attention_mask.bool()
    expected, jobs = {}, {}
    for case in CASES:
        four_layers = dataclasses.replace(case, overrides={**case.overrides, "num_hidden_layers": 4})
        source = build_source(four_layers)
        save_sharded(source, tmp_path / case.name, **case.save_kwargs)
        expected[case.name] = logits_of(source, **batch)
        convert_to_conceptmoe(tmp_path / case.name, tmp_path / f"{case.name}-conceptmoe", **CONVERT_EXACT)
        jobs[case.name] = str(tmp_path / f"{case.name}-conceptmoe")
    source_types = {
        json.loads((tmp_path / case.name / "config.json").read_text())["model_type"] for case in CASES
    }
    assert source_types == set(SUPPORTED_SOURCE_TYPES)
    # A tied head is not stored: loading ties it to the embedding again.
    tied = read_checkpoint(tmp_path / "llama-tied-linear-rope-conceptmoe")
    assert "lm_head.weight" not in tied and "model.embed_tokens.weight" in tied
    actual = fresh_process_logits(tmp_path, jobs, batch, "ConceptMoEForCausalLM")
    for name in jobs:
        assert_close(actual[name][real], expected[name][real], atol=1e-4, rtol=1e-4, msg=name)


def test_cli_converts_and_the_default_conversion_generates_with_the_cache(tmp_path):
    from transformers import AutoModelForCausalLM

    source = tiny_llama_folder(tmp_path / "src", num_hidden_layers=6)
    destination = tmp_path / "dst"
    command = ["convert", "conceptmoe", str(source), str(destination), "--max-shard-size", "20KB"]
    result = subprocess.run(
        [sys.executable, "-m", "hf_concept", *command],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    config = json.loads((destination / "config.json").read_text())
    assert (config["chunking"], config["compression_ratio"], config["encoder_layers"]) == ("dynamic", 2.0, 2)
    model = AutoModelForCausalLM.from_pretrained(destination, trust_remote_code=True).eval()
    prompt = torch.randint(1, TINY_LLAMA["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(5))
    settings = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    cached = model.generate(prompt, use_cache=True, return_dict_in_generate=True, **settings)
    assert type(output_cache(cached)).__name__ == "ConceptCache"
    assert cached.sequences.shape == (2, 7 + 12)
    assert torch.equal(cached.sequences, model.generate(prompt, use_cache=False, **settings))


def test_cli_flags_map_onto_the_converter(tmp_path, capsys):
    from hf_concept.cli import main

    source = tiny_llama_folder(tmp_path / "src", num_hidden_layers=5)
    flags = (
        "--encoder-layers 1 --decoder-layers 2 --chunking fixed --ratio 1 --loop 0:2:1 --router-init identity"
    )
    flags += " --pooling sum --dtype bfloat16 --joint-decoding-layers 1 --base-model org/tiny"
    assert main(["convert", "conceptmoe", str(source), str(tmp_path / "dst"), *flags.split()]) == 0
    config = json.loads((tmp_path / "dst" / "config.json").read_text())
    expected = dict(encoder_layers=1, decoder_layers=2, chunking="fixed", compression_ratio=1.0)
    expected.update(concept_loop=[0, 2, 1], router_init="identity", pooling="sum", dtype="bfloat16")
    expected.update(joint_decoding_layers=1)
    assert {key: config[key] for key in expected} == expected
    assert "org/tiny" in (tmp_path / "dst" / "README.md").read_text()
    assert main(["convert", "conceptmoe", str(source), str(tmp_path / "dst")]) == 2
    error = capsys.readouterr().err
    assert "overwrite" in error and "Traceback" not in error
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", "conceptmoe", str(source), str(tmp_path / "other"), "--loop", "1:2"])
    assert exit_info.value.code == 2 and "START:END:TIMES" in capsys.readouterr().err


def test_experts_per_token_changes_the_concept_layers_top_k_only(tmp_path):
    case = next(case for case in CASES if case.name == "mixtral")
    four_layers = dataclasses.replace(case, overrides={**case.overrides, "num_hidden_layers": 4})
    source = build_source(four_layers)
    save_sharded(source, tmp_path / "src")
    convert_to_conceptmoe(tmp_path / "src", tmp_path / "dst", experts_per_token=1, **CONVERT_EXACT)
    config = json.loads((tmp_path / "dst" / "config.json").read_text())
    source_top_k = source.config.num_experts_per_tok
    assert (config["num_experts"], config["num_experts_per_tok"]) == (4, source_top_k)
    assert config["concept_num_experts_per_tok"] == 1 != source_top_k
    experts = {name for name in read_checkpoint(tmp_path / "dst") if ".mlp.experts." in name}
    assert len(experts) == 4 * 4 * 3
    # §3.5 Strategy 1: the concept layers route to the new top-k; encoder and decoder keep the source's.
    from hf_concept.modeling.modeling_conceptmoe import ConceptMoEForCausalLM

    model = ConceptMoEForCausalLM.from_pretrained(tmp_path / "dst")
    top_ks = {
        stage: {layer.mlp.top_k for layer in getattr(model.model, f"{stage}_layers")}
        for stage in ("encoder", "concept", "decoder")
    }
    assert top_ks == {"encoder": {source_top_k}, "concept": {1}, "decoder": {source_top_k}}
    with pytest.raises(ValueError, match="concept_num_experts_per_tok=5"):
        convert_to_conceptmoe(tmp_path / "src", tmp_path / "other", experts_per_token=5, **CONVERT_EXACT)
    assert not (tmp_path / "other").exists()


@pytest.mark.slow
def test_converted_model_trains_and_its_compression_moves_toward_the_target(tmp_path):
    """Default conversion options except R = 4: the fresh random router opens about every other token
    (p near 1/2), so R = 2 would already be met; R = 4 shows the ratio loss pulling it."""
    from transformers import AutoModelForCausalLM, TrainingArguments

    from hf_concept.training.trainer import ConceptTrainer

    target = 4.0
    source = tiny_llama_folder(tmp_path / "src", num_hidden_layers=6)
    convert_to_conceptmoe(source, tmp_path / "dst", compression_ratio=target)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "dst", trust_remote_code=True)
    input_ids = torch.randint(
        1, TINY_LLAMA["vocab_size"], (4, 32), generator=torch.Generator().manual_seed(0)
    )

    def realised() -> tuple[float, float]:
        model.eval()
        with torch.no_grad():
            outputs = model(input_ids=input_ids)
        model.train()
        return outputs.compression_ratio.item(), outputs.boundary_prob_mean.item()

    ratio_before, prob_before = realised()
    rows = [{"input_ids": row, "labels": row} for row in input_ids.tolist()]
    arguments = TrainingArguments(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=4,
        max_steps=30,
        learning_rate=1e-2,
        logging_steps=5,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = ConceptTrainer(model=model, args=arguments, train_dataset=rows)
    trainer.train()
    ratio_after, prob_after = realised()
    assert abs(ratio_after - target) < abs(ratio_before - target), (ratio_before, ratio_after)
    assert prob_after < prob_before
    logged = [row for row in trainer.state.log_history if "loss" in row]
    assert len(logged) == 6
    assert all({"lm_loss", "aux_loss", "compression_ratio"} <= set(row) for row in logged)
    assert logged[-1]["loss"] < logged[0]["loss"]


@pytest.mark.parametrize(("rank_window", "ratio"), [(64, 2.0), (16, 1.5), (0, 2.0)])
def test_dynamic_conversion_decides_on_local_ranks(rank_window, ratio):
    """Dynamic chunking converts with rank decisions by default: the window, the threshold 1 − 1/R that
    opens one token in R, and no decision noise; a window of 0 keeps one threshold on the probabilities."""
    options = dict(joint_decoding_layers=None, concept_loop=None, experts_per_token=None, router="cosine")
    options.update(router_init="random", pooling="first", encoder_layers=1, decoder_layers=1)
    options.update(chunking="dynamic", compression_ratio=ratio, rank_window=rank_window)
    config = conceptmoe_config_from_source(LlamaConfig(**TINY_LLAMA), **options)
    if rank_window:
        assert config.boundary_rank_window == rank_window and config.boundary_noise == "none"
        assert config.boundary_threshold == pytest.approx(1 - 1 / ratio)
    else:
        assert config.boundary_rank_window is None and config.boundary_threshold == 0.5


def test_a_fixed_bonus_converts_with_ranks_and_is_refused_without_them(tmp_path, capsys):
    """`--fixed-bonus` writes `boundary_fixed_bonus` beside the rank window; with `--rank-window 0`
    (nothing to rank) the conversion is one error line naming the field, and nothing is written."""
    from hf_concept.cli import main

    source = tiny_llama_folder(tmp_path / "src", num_hidden_layers=5)
    flags = ["--encoder-layers", "1", "--decoder-layers", "1", "--fixed-bonus", "0.05"]
    assert main(["convert", "conceptmoe", str(source), str(tmp_path / "dst"), *flags]) == 0
    config = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert (config["boundary_fixed_bonus"], config["boundary_rank_window"]) == (0.05, 64)
    code = main(["convert", "conceptmoe", str(source), str(tmp_path / "out"), *flags, "--rank-window", "0"])
    assert code == 2
    assert "boundary_fixed_bonus=0.05" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
