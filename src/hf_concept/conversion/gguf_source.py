"""A GGUF file as the source of `hf-concept convert` and `hf-concept train`.

Which paths are GGUF sources (`find_gguf`): a `.gguf` file; a folder without `config.json` holding
exactly one `.gguf` file (several: one must be picked by name, `gguf_file` / `--gguf-file`); any folder
when `gguf_file` names a file in it. A folder with `config.json` and no `gguf_file` stays a safetensors
source, so a Hub snapshot that also ships GGUF files converts from its full-precision weights.

`source_folder` turns a GGUF source into a safetensors folder that the existing readers take as is
(`sources.iter_source_tensors` streams it shard by shard, `writer.copy_side_files` copies its tokenizer):
- transformers' GGUF loader (`from_pretrained(folder, gguf_file=NAME)`; needs the `gguf` package, the
  `gguf` extra) de-quantises the weights into the architecture's own class (a llama GGUF gives a
  `LlamaForCausalLM`) and `AutoTokenizer` rebuilds the tokenizer from the file's metadata;
- the model's tensors are written as they are (no copy; tied tensors once, under their first name), with
  its config minus `quantization_config` (the field that makes `save_pretrained` refuse such a model),
  the tokenizer, the generation config, and a README.md stating the file's `general.license`, so that the
  converted card inherits the licence;
- all of it lives in a temporary folder (under the system's temporary folder: set TMPDIR for a large
  model) that is deleted when the context ends, on error too.
Peak memory is the loader's own: the de-quantised tensors and the model, once each.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_concept.conversion.writer import check_apart

GGUF_SUFFIX = ".gguf"
INSTALL_HINT = "pip install 'hf_concept[gguf]'"


@dataclass(frozen=True)
class SourceFolder:
    """A folder of safetensors to read; `gguf` is the GGUF file it was made from (None: the folder given)."""

    folder: Path
    gguf: Path | None = None


def find_gguf(path: str | Path, gguf_file: str | None = None) -> Path | None:
    """The GGUF file `path` stands for (rules: module docstring), or None when it is no GGUF source.

    Raises ValueError naming the path for a folder with several `.gguf` files and no `gguf_file`, a
    `gguf_file` that is not in the folder, or a `gguf_file` given beside a file path it does not name.
    """
    path = Path(path)
    if path.is_file():
        if gguf_file is not None and Path(gguf_file).name != path.name:
            raise ValueError(
                f"--gguf-file={gguf_file!r} picks a file inside a source folder, but src={str(path)!r} is "
                "already a file: pass its folder as the source, or drop --gguf-file"
            )
        return path if path.suffix.lower() == GGUF_SUFFIX else None
    if not path.is_dir():
        return None
    found = sorted(
        item.name for item in path.iterdir() if item.suffix.lower() == GGUF_SUFFIX and item.is_file()
    )
    if gguf_file is not None:
        if gguf_file not in found:
            raise ValueError(
                f"--gguf-file={gguf_file!r} is not a .gguf file in src={str(path)!r} "
                f"(it holds: {', '.join(found) or 'none'})"
            )
        return path / gguf_file
    if (path / "config.json").is_file() or not found:
        return None
    if len(found) > 1:
        raise ValueError(
            f"src={str(path)!r} holds {len(found)} GGUF files ({', '.join(found)}): "
            "pick one with --gguf-file NAME"
        )
    return path / found[0]


def require_gguf(path: Path) -> None:
    """ValueError naming `path` and the install command when the `gguf` package cannot be used."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ValueError(
            f"src={str(path)!r} is a GGUF file; reading it needs the gguf package: {INSTALL_HINT}"
        ) from None
    from transformers.utils.import_utils import GGUF_MIN_VERSION, is_gguf_available

    if not is_gguf_available(GGUF_MIN_VERSION):
        raise ValueError(
            f"src={str(path)!r} is a GGUF file; reading it needs gguf>={GGUF_MIN_VERSION}, "
            f"an older one is installed: {INSTALL_HINT} --upgrade"
        )


@contextlib.contextmanager
def source_folder(
    src: str | Path, gguf_file: str | None = None, destination: str | Path | None = None
) -> Iterator[SourceFolder]:
    """`src` itself when it is no GGUF source; else a temporary safetensors folder holding the GGUF's
    de-quantised weights, config and tokenizer, deleted when the context ends (on error too).

    `destination`, when given, must stay apart from `src` (the check `convert` makes for folders), since
    the converted folder may not replace or delete the file it reads. Raises ValueError for the cases of
    `find_gguf`, a missing `gguf` package, and a file transformers cannot load as GGUF.
    """
    gguf_path = find_gguf(src, gguf_file)
    if gguf_path is None:
        yield SourceFolder(Path(src))
        return
    if destination is not None:
        check_apart(Path(src), Path(destination))
    require_gguf(gguf_path)
    with tempfile.TemporaryDirectory(prefix="hf_concept-gguf-") as temporary:
        folder = Path(temporary) / gguf_path.stem
        write_gguf_as_safetensors(gguf_path, folder)
        yield SourceFolder(folder, gguf_path)


# GGUF's names of the architectures that `convert` and `train` read (`sources.SUPPORTED_SOURCE_TYPES`;
# llama.cpp writes Mixtral as "llama" and the Qwen MoE models without the underscore).
GGUF_SOURCE_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen2moe", "qwen3", "qwen3moe")


def gguf_architecture(gguf_path: Path) -> str | None:
    """`general.architecture` of a GGUF file (its header only), None when the header cannot be read (the
    loader then names the problem)."""
    import gguf

    try:
        field = gguf.GGUFReader(str(gguf_path)).fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    except Exception:
        # A truncated or foreign file: transformers' loader says what is wrong with it.
        return None


def check_gguf_architecture(gguf_path: Path) -> None:
    """ValueError naming the file, its architecture and the supported ones for any other architecture."""
    architecture = gguf_architecture(gguf_path)
    if architecture is not None and architecture not in GGUF_SOURCE_ARCHITECTURES:
        raise ValueError(
            f"src={str(gguf_path)!r} is a GGUF of architecture {architecture!r}, which is not a supported "
            f"source; supported GGUF architectures: {', '.join(GGUF_SOURCE_ARCHITECTURES)}"
        )


def write_gguf_as_safetensors(gguf_path: Path, folder: Path) -> None:
    """De-quantise `gguf_path` and write it to `folder` as a safetensors checkpoint with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_gguf_architecture(gguf_path)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as error:
        # The loader's failures range from ValueError (unsupported architecture) to struct and
        # numpy errors (a truncated file); each becomes one line naming the file.
        reason = " ".join(str(error).split()) or type(error).__name__
        raise ValueError(f"src={str(gguf_path)!r} could not be loaded as GGUF: {reason}") from error
    folder.mkdir(parents=True)
    _save_weights(model, folder)
    config = model.config
    if hasattr(config, "quantization_config"):
        # The weights written are plain floats; a GGUF quantization_config would make loaders expect GGUF.
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.save_pretrained(folder)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    license_id = gguf_license(gguf_path)
    if license_id is not None:
        (folder / "README.md").write_text(f"---\nlicense: {json.dumps(license_id)}\n---\n")


def _save_weights(model: torch.nn.Module, folder: Path) -> None:
    """The model's tensors as safetensors; a tensor shared under several names (tied embeddings) is
    written once, under the first name in state-dict order (the embedding, before the head)."""
    from huggingface_hub import save_torch_state_dict

    seen: set[tuple[int, tuple[int, ...]]] = set()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        identity = (tensor.data_ptr(), tuple(tensor.shape))
        if identity in seen:
            continue
        seen.add(identity)
        tensors[name] = tensor
    save_torch_state_dict(tensors, folder)


def gguf_license(gguf_path: Path) -> str | None:
    """The file's `general.license` metadata (e.g. "apache-2.0"), or None when it has none."""
    from gguf import GGUFReader

    field = GGUFReader(str(gguf_path)).fields.get("general.license")
    if field is None:
        return None
    # A string field's value is the part its first data index points at (the reader's layout since 0.10).
    value = bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace").strip()
    return value or None
