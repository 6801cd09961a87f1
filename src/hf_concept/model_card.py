"""Model cards (the checkpoint's `README.md`) for every family, written through `huggingface_hub.ModelCard`.

A card is a function of three things: the folder's `config.json` (family and architecture settings), the
facts a caller records (base model, training summary, evaluation figures, realised compression) and the
id the load snippet names. The facts are also stored in the card's metadata (under `hf_concept`), so a
card can be rewritten later (e.g. by `hf-concept push`, to name the Hub repo) without losing them.

Metadata layout (YAML front matter):

    base_model: org/source          # only when it is a Hub repo id, never a local path
    library_name: transformers
    license: apache-2.0             # when known
    pipeline_tag: text-generation
    tags: [custom_code, <family>, hf_concept]   # custom_code only for remote-code checkpoints
    <family>: {architecture settings}
    hf_concept: {family, load_id, base_model, realised_compression, evaluation, training}

Templates live in `model_cards/<family>.md` (front matter and family prose; llama-like and unknown
model types use `plain.md`); `model_cards/_sections.md` (results, training, usage) is appended to each.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from huggingface_hub import ModelCard

TEMPLATES = Path(__file__).resolve().parent / "model_cards"
FAMILY_TEMPLATES = {
    "conceptmoe": "conceptmoe.md",
    "hidden_decoding": "hidden_decoding.md",
    "dlcm": "dlcm.md",
    "lslm": "lslm.md",
}
SECTIONS_TEMPLATE = "_sections.md"
# Our own config classes: instantiating them gives derived settings (e.g. concept layers) and validation.
CONFIG_CLASSES = {
    "conceptmoe": ("configuration_conceptmoe", "ConceptMoEConfig"),
    "hidden_decoding": ("configuration_hidden_decoding", "HiddenDecodingConfig"),
    "dlcm": ("configuration_dlcm", "DLCMConfig"),
    "lslm": ("configuration_lslm", "LSLMConfig"),
    "hf_concept_plain": ("configuration_plain", "PlainDecoderConfig"),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
PROMPTS = {
    "conceptmoe": "Concepts compress what tokens repeat.",
    "hidden_decoding": "Hidden streams think between tokens.",
    "dlcm": "Concepts carry the reasoning; tokens carry the words.",
    "lslm": "Bytes group themselves into segments.",
}
DEFAULT_PROMPT = "The quick brown fox"
COMPRESSION_UNITS = {"lslm": "bytes per segment"}
CARD_KEY = "hf_concept"


def write_model_card(
    folder: str | Path,
    *,
    base_model: str | None = None,
    training: dict[str, Any] | None = None,
    evaluation: dict[str, float] | None = None,
    compression: float | None = None,
    license: str | None = None,
    settings: dict[str, Any] | None = None,
    name_or_path: str | None = None,
) -> Path:
    """Write `folder/README.md` for the checkpoint in `folder`; returns its path.

    `base_model`: the source checkpoint (Hub id or local path; only a Hub id goes into the metadata).
    `training`: summary of the run (steps, learning rate, data, ...), `evaluation`: figures by name
    (eval_loss, bits_per_byte, ...), `compression`: realised tokens (bytes for LSLM) per concept.
    Extensions to the shared contract: `license` (SPDX id), `settings` (extra architecture settings listed
    before those read from config.json, e.g. the source's model_type), `name_or_path` (what the load
    snippet passes to `from_pretrained`: a Hub repo id or a path; default: `folder` as given). A card
    this module wrote earlier in `folder` (same family) supplies what is not given: base model, licence
    and extra settings one by one, the results (training, evaluation, compression) only when none of
    them is given. Raises ValueError for a missing or unreadable config.json.
    """
    card = render_model_card(
        folder,
        base_model=base_model,
        training=training,
        evaluation=evaluation,
        compression=compression,
        license=license,
        settings=settings,
        name_or_path=name_or_path,
    )
    path = Path(folder) / "README.md"
    path.write_text(str(card), encoding="utf-8")
    return path


def render_model_card(
    folder: str | Path,
    *,
    base_model: str | None = None,
    training: dict[str, Any] | None = None,
    evaluation: dict[str, float] | None = None,
    compression: float | None = None,
    license: str | None = None,
    settings: dict[str, Any] | None = None,
    name_or_path: str | None = None,
) -> ModelCard:
    """The `huggingface_hub.ModelCard` that `write_model_card` would write (nothing is written)."""
    from huggingface_hub import ModelCard, ModelCardData

    from hf_concept.modeling.transformers_compat import MIN_TRANSFORMERS, NEWEST_TESTED_TRANSFORMERS

    folder = Path(folder)
    raw, config = read_config(folder)
    family = raw["model_type"]
    facts = dict(base_model=base_model, training=training, evaluation=evaluation, compression=compression)
    facts.update(license=license, extra_settings=settings)
    facts = _with_previous_facts(folder, family, facts)
    all_settings = {**(facts["extra_settings"] or {}), **family_settings(family, config)}
    remote_code = bool(raw.get("auto_map"))
    load_id = name_or_path or str(folder)
    record = {
        "family": family,
        "load_id": load_id,
        "base_model": facts["base_model"],
        "realised_compression": _plain(facts["compression"]),
        "evaluation": _plain(facts["evaluation"]),
        "training": _plain(facts["training"]),
        "extra_settings": _plain(facts["extra_settings"]),
    }
    tags = ["custom_code", family, "hf_concept"] if remote_code else [family, "hf_concept"]
    metadata = dict(library_name="transformers", pipeline_tag="text-generation", tags=tags)
    metadata.update(license=facts["license"], base_model=_hub_id(facts["base_model"]))
    metadata[family] = _plain(all_settings)
    metadata[CARD_KEY] = {key: value for key, value in record.items() if value is not None}
    template = _template_text(family)
    values = dict(
        family=family,
        base_model=facts["base_model"],
        settings=all_settings,
        compression=facts["compression"],
        evaluation=facts["evaluation"] or {},
        training=facts["training"] or {},
        figures=figures(family, facts["compression"], facts["evaluation"]),
        remote_code=remote_code,
        transformers_range=f"{MIN_TRANSFORMERS} to {NEWEST_TESTED_TRANSFORMERS}",
        load_snippet=load_snippet(folder, family, load_id, facts["base_model"], remote_code),
        layout=list(getattr(config, "stream_attention_layout", None) or []),
    )
    card = ModelCard.from_template(ModelCardData(**metadata), template_str=template, **values)
    # Jinja leaves runs of blank lines where optional sections are absent; Markdown needs one.
    card.text = re.sub(r"\n{3,}", "\n\n", card.text)
    return card


def figures(family: str, compression: float | None, evaluation: dict[str, float] | None) -> list:
    """(name, formatted value) rows of the card's results table."""
    rows = []
    if compression is not None:
        unit = COMPRESSION_UNITS.get(family, "tokens per concept")
        rows.append((f"realised compression at inference ({unit})", _number(compression)))
    rows.extend((name, _number(value)) for name, value in (evaluation or {}).items())
    return rows


def _number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def read_config(folder: Path) -> tuple[dict[str, Any], Any]:
    """(config.json as a dict, a config object): our own config class for our families (so derived
    settings are available and invalid values are caught), the dict itself wrapped otherwise."""
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(f"no config.json in {str(folder)!r}: a model card needs the checkpoint's config")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{str(path)!r} is not valid JSON: {error}") from error
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
        raise ValueError(f"{str(path)!r} has no model_type")
    if raw["model_type"] not in CONFIG_CLASSES:
        return raw, _DictConfig(raw)
    import importlib

    module_name, class_name = CONFIG_CLASSES[raw["model_type"]]
    module = importlib.import_module(f"hf_concept.modeling.{module_name}")
    return raw, getattr(module, class_name).from_dict(dict(raw))


class _DictConfig:
    """Attribute access over a config.json dict (missing keys read as None), for model types we do not own."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def _dtype(config) -> str | None:
    # A config.json older than transformers 5 names it torch_dtype; a loaded config's `torch_dtype` is a
    # deprecated alias of `dtype` (read from the instance only, so the alias is never called).
    dtype = getattr(config, "dtype", None) or vars(config).get("torch_dtype")
    return None if dtype is None else str(dtype).removeprefix("torch.")


def family_settings(family: str, config) -> dict[str, Any]:
    """The architecture settings the card lists for `family`, read from its config."""
    get = lambda name: getattr(config, name, None)  # noqa: E731
    experts = get("num_experts") or 0
    moe = {"num_experts": experts, "num_experts_per_tok": get("num_experts_per_tok") if experts else None}
    if family == "conceptmoe":
        values = {"encoder_layers": get("encoder_layers"), "concept_layers": get("num_concept_layers")}
        values.update(decoder_layers=get("decoder_layers"), hidden_size=get("hidden_size"))
        names = ("chunking", "compression_ratio", "router", "router_init", "pooling", "dechunk_residual")
        names += ("dechunk_ema",)
        values.update({name: get(name) for name in names}, concept_hidden_size=get("concept_width"))
        values.update(joint_decoding_layers=get("num_joint_layers"), concept_loop=get("concept_loop"))
        if experts:
            values["concept_num_experts_per_tok"] = get("concept_top_k")
    elif family == "hidden_decoding":
        layout = list(get("stream_attention_layout") or [])
        values = {"num_streams": get("num_streams"), "stream_attention_layout": "".join(k[0] for k in layout)}
        values["cross_stream_layers"] = sum(kind != "intra" for kind in layout)
        names = ("local_window", "sliding_window", "intra_window", "intra_stream_positions")
        names += ("cross_stream_mask", "cross_stream_positions", "stream_kv")
        names += ("num_hidden_layers", "hidden_size")
        values.update({name: get(name) for name in names})
    elif family == "dlcm":
        names = ("encoder_layers", "concept_layers", "decoder_layers", "hidden_size", "concept_hidden_size")
        names += ("compression_ratio", "chunking", "router", "cross_num_attention_heads", "cross_head_dim")
        names += ("mup_base_width", "ratio_scope", "smoothing")
        values = {name: get(name) for name in names}
        if get("router") == "rule":
            values["rule_threshold"] = get("rule_threshold")
    elif family == "lslm":
        names = ("token_encoder_layers", "segment_encoder_layers", "decoder_layers", "token_hidden_size")
        names += ("hidden_size", "decoder_hidden_size", "pooling", "prior_mean", "kl_weight")
        names += ("update_schedule", "boundary_threshold", "boundary_rule", "prior_loss", "vocab_size")
        values = {name: get(name) for name in names}
    else:
        names = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        names += (
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "max_position_embeddings",
            "sliding_window",
        )
        names += ("tie_word_embeddings",)
        values = {name: get(name) for name in names}
    if family != "lslm":
        values.update(moe)
    values["dtype"] = _dtype(config)
    return values


def load_snippet(folder: Path, family: str, load_id: str, base_model: str | None, remote_code: bool) -> str:
    """The Python lines that load the checkpoint and generate; remote code needs trust_remote_code=True.

    The tokenizer comes from the checkpoint when it ships one, else from the base model. A tokenizer
    with its own code (LSLM's byte tokenizer) needs trust_remote_code=True as well."""
    has_tokenizer = any((folder / name).is_file() for name in TOKENIZER_FILES)
    tokenizer_id = load_id if has_tokenizer or not base_model else base_model
    tokenizer_code = family == "lslm" or _tokenizer_has_code(folder)
    trust = ", trust_remote_code=True"
    # JSON string literals are valid Python string literals, escapes (Windows paths) included.
    prompt = json.dumps(PROMPTS.get(family, DEFAULT_PROMPT))
    model_id, tokenizer_id = json.dumps(load_id), json.dumps(tokenizer_id)
    return "\n".join(
        [
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            f"model = AutoModelForCausalLM.from_pretrained({model_id}{trust if remote_code else ''})",
            f"tokenizer = AutoTokenizer.from_pretrained({tokenizer_id}{trust if tokenizer_code else ''})",
            f'inputs = tokenizer({prompt}, return_tensors="pt")',
            "output = model.generate(**inputs, max_new_tokens=20)",
            "print(tokenizer.decode(output[0], skip_special_tokens=True))",
        ]
    )


def _tokenizer_has_code(folder: Path) -> bool:
    try:
        tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(tokenizer_config, dict) and bool(tokenizer_config.get("auto_map"))


def _template_text(family: str) -> str:
    name = FAMILY_TEMPLATES.get(family, "plain.md")
    return (TEMPLATES / name).read_text(encoding="utf-8") + "\n" + (TEMPLATES / SECTIONS_TEMPLATE).read_text()


def _hub_id(base_model: str | None) -> str | None:
    """`base_model` when it reads as a Hub repo id; None for local paths (the Hub rejects those)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not base_model or Path(base_model).exists() or base_model.startswith((".", "/", "~")):
        return None
    try:
        validate_repo_id(base_model)
    except HFValidationError:
        return None
    return base_model


def previous_card_record(folder: str | Path) -> dict[str, Any] | None:
    """The `hf_concept` metadata of a card this module wrote in `folder` (None when there is none),
    with the card's license added under "license"."""
    from huggingface_hub import ModelCard

    path = Path(folder) / "README.md"
    if not path.is_file():
        return None
    try:
        data = ModelCard.load(path).data.to_dict()
    except Exception:
        # Any card we cannot parse is simply not ours to inherit from.
        return None
    record = data.get(CARD_KEY)
    if not isinstance(record, dict):
        return None
    return {**record, "license": data.get("license")}


def _with_previous_facts(folder: Path, family: str, facts: dict[str, Any]) -> dict[str, Any]:
    """Fill what the caller did not give from an earlier card of the same family in `folder`.

    Provenance (base model, licence, extra settings) is kept item by item. Results (training,
    evaluation, compression) describe one state of the weights, so they are kept only as a group, when
    the caller gives none of them (a pure re-render, e.g. to name the Hub repo)."""
    record = previous_card_record(folder)
    if record is None or record.get("family") != family:
        return facts
    inherited = dict(
        base_model=record.get("base_model"),
        license=record.get("license"),
        extra_settings=record.get("extra_settings"),
    )
    if all(facts[key] is None for key in ("training", "evaluation", "compression")):
        inherited.update(training=record.get("training"), evaluation=record.get("evaluation"))
        inherited.update(compression=record.get("realised_compression"))
    return {key: inherited.get(key) if value is None else value for key, value in facts.items()}


def _plain(value: Any) -> Any:
    """`value` with only YAML-safe types (str, int, float, bool, None, lists, str-keyed dicts)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple | set):
        return [_plain(item) for item in value]
    if hasattr(value, "item") and callable(value.item):
        # numpy and torch scalars
        return _plain(value.item())
    return str(value)


def card_license(folder: str | Path) -> str | None:
    """The `license` in the metadata of `folder/README.md` (e.g. a downloaded source checkpoint's card)."""
    from huggingface_hub import ModelCard

    path = Path(folder) / "README.md"
    if not path.is_file():
        return None
    try:
        license_id = ModelCard.load(path).data.to_dict().get("license")
    except Exception:
        return None
    return license_id if isinstance(license_id, str) else None
