"""Architecture facts read from a Hugging Face ``config.json`` (never from the model's name).

Pure standard library. Resolving a model name: catalogue name (case-insensitive, with or without the
org prefix) -> path to a config.json -> hub id (only when ``allow_hub``; no remote code unless asked).
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

# Alternative key names used by different families for the same fact (first present wins).
_KEYS = {
    "hidden_size": ("hidden_size", "n_embd", "n_embed", "d_model"),
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "num_heads": ("num_attention_heads", "n_head", "num_heads"),
    "max_positions": ("max_position_embeddings", "n_positions", "n_ctx", "seq_length"),
}
# Families whose decoder stacks we know how to build and parallelise. Others may still work through
# the profiler (transformers builds them), but a non-decoder config is refused.
_ENCODER_DECODER_TYPES = {"t5", "bart", "mbart", "marian", "pegasus", "whisper", "bert", "roberta", "deberta",
                          "distilbert", "electra", "albert", "mt5", "longt5", "led", "blenderbot"}


@dataclass(frozen=True)
class ModelArch:
    name: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_size: int
    vocab_size: int
    max_positions: int | None
    tie_word_embeddings: bool
    config: dict[str, Any]

    @property
    def config_sha(self) -> str:
        """Hash of the architecture-defining config (layer count excluded: profiles are per layer)."""
        return config_fingerprint(self.config)


def config_fingerprint(config: dict[str, Any]) -> str:
    drop = {"_name_or_path", "num_hidden_layers", "n_layer", "num_layers", "transformers_version",
            "torch_dtype", "dtype", "architectures", "attention_types", "layer_types", "max_window_layers",
            "use_cache"}
    canonical = json.dumps({k: v for k, v in config.items() if k not in drop}, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _first(config: dict[str, Any], fact: str) -> Any:
    for key in _KEYS[fact]:
        if config.get(key) is not None:
            return config[key]
    return None


def arch_from_config(config: dict[str, Any], name: str = "") -> ModelArch:
    """Normalise a config dict; raises ValueError naming the missing or bad field."""
    if not isinstance(config, dict):
        raise ValueError("model: config.json must hold a JSON object")
    model_type = config.get("model_type")
    if not model_type:
        raise ValueError("model: config.json has no 'model_type'; is it a Hugging Face model config?")
    archs = config.get("architectures") or []
    if model_type in _ENCODER_DECODER_TYPES or config.get("is_encoder_decoder"):
        raise ValueError(f"model: {model_type!r} is not a decoder-only causal LM")
    if archs and not any(a.endswith("ForCausalLM") or a.endswith("LMHeadModel") for a in archs):
        raise ValueError(f"model: architectures {archs} has no causal-LM head (…ForCausalLM)")
    hidden = _first(config, "hidden_size")
    layers = _first(config, "num_layers")
    heads = _first(config, "num_heads")
    vocab = config.get("vocab_size")
    for field_name, value in (("hidden_size", hidden), ("num_hidden_layers", layers),
                              ("num_attention_heads", heads), ("vocab_size", vocab)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"model: config.json field {field_name!r} missing or not a positive integer ({value!r})")
    kv_heads = config.get("num_key_value_heads") or (1 if config.get("multi_query") else heads)
    head_dim = config.get("head_dim") or hidden // heads
    ffn = (config.get("intermediate_size") or config.get("ffn_dim") or config.get("n_inner")
           or config.get("ffn_size") or 4 * hidden)
    max_pos = _first(config, "max_positions")
    tie = config.get("tie_word_embeddings", True)
    return ModelArch(name=name or config.get("_name_or_path", model_type), model_type=model_type,
                     hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                     head_dim=head_dim, ffn_size=ffn, vocab_size=vocab,
                     max_positions=max_pos if isinstance(max_pos, int) else None,
                     tie_word_embeddings=bool(tie), config=dict(config))


@functools.lru_cache(maxsize=1)
def _catalogue_index() -> dict[str, str]:
    """lower-case names (full id and bare name) -> file name."""
    index: dict[str, str] = {}
    for entry in (resources.files("estimator") / "catalogue" / "models").iterdir():
        if entry.name.endswith(".json"):
            full = entry.name[:-5].replace("--", "/")
            index[full.lower()] = entry.name
            index.setdefault(full.split("/")[-1].lower(), entry.name)
    return index


def catalogue_models() -> list[str]:
    return sorted({name[:-5].replace("--", "/") for name in _catalogue_index().values()})


@functools.lru_cache(maxsize=256)
def _load_catalogue(file_name: str) -> dict[str, Any]:
    return json.loads((resources.files("estimator") / "catalogue" / "models" / file_name).read_text())


def load_config(model: str, *, allow_hub: bool = False, trust_remote_code: bool = False) -> dict[str, Any]:
    """Config dict for a catalogue name, a config.json path (or a directory holding one), or a hub id."""
    key = model.strip().lower()
    index = _catalogue_index()
    if key in index:
        return dict(_load_catalogue(index[key]))
    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" or path.exists():
        if not path.is_file():
            raise ValueError(f"model: no such config file {str(path)!r}")
        try:
            config = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"model: {str(path)!r} is not valid JSON ({err.__class__.__name__})") from None
        if not isinstance(config, dict):
            raise ValueError(f"model: {str(path)!r} must hold a JSON object")
        return config
    if allow_hub and "/" in model:
        return _hub_config(model, trust_remote_code)
    close = difflib.get_close_matches(key, list(index), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else "; see --list-models"
    raise ValueError(f"model: unknown model {model!r} (not in the catalogue, not a config.json path){hint}")


def _hub_config(model: str, trust_remote_code: bool) -> dict[str, Any]:
    try:
        from transformers import AutoConfig  # only on the hub path
        config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except Exception as err:  # noqa: BLE001 - any hub failure is a user-facing one-liner
        raise ValueError(f"model: could not fetch the config of {model!r} from the hub "
                         f"({err.__class__.__name__}: {str(err).splitlines()[0][:120]})") from None
    return config.to_dict()


def resolve_arch(model: str, *, allow_hub: bool = False, trust_remote_code: bool = False) -> ModelArch:
    config = load_config(model, allow_hub=allow_hub, trust_remote_code=trust_remote_code)
    return arch_from_config(config, name=config.get("_name_or_path") or model)


@functools.lru_cache(maxsize=256)
def cached_arch(model: str) -> ModelArch:
    """``resolve_arch`` once per model name per process (estimates and plans ask for it many times)."""
    return resolve_arch(model)


@functools.lru_cache(maxsize=256)
def spec_arch(model: str, vocab_size: int = 0) -> ModelArch:
    """The architecture a run trains: ``model``'s, with its embedding resized to ``vocab_size`` rows when the
    training script calls ``model.resize_token_embeddings(vocab_size)`` (``TrainingSpec.vocab_size``; 0: as
    configured). transformers writes the new size into ``config.vocab_size`` and resizes the tied or untied head
    with it, so the resized model is the model of that config (its profile is the configured model's re-sized:
    ``estimator.profiler.vocab``)."""
    arch = cached_arch(model)
    if not vocab_size or vocab_size == arch.vocab_size:
        return arch
    return arch_from_config({**arch.config, "vocab_size": vocab_size}, name=arch.name)
