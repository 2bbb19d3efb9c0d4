"""What one config file said, in the estimator's terms: the settings it gave (with the key each came from), the
values that had to be assumed, the settings it names that the estimator does not model, and every key it did
not understand. Nothing is dropped silently: a key is either used, assumed around, marked not modelled,
known to have no effect on the per-rank peak, or reported as not understood.

Settings (the vocabulary every reader writes; ``build`` turns them into one ``RunSpec``):

``model``, ``world_size``, ``method`` (``single``/``ddp``/``fsdp``/``fsdp1``/``deepspeed``), ``deepspeed`` (a
DeepSpeed config dict or path), ``fsdp1`` (a dict of ``Fsdp1Spec`` fields the config gives), ``micro_batch_size``, ``seq_len``, ``half`` (``bf16``/``fp16``/``none``: the
mixed-precision switch), ``weights_dtype`` (``fp32``/``bf16``/``fp16``: what the model is loaded in),
``precision`` (an exact ``TrainingSpec.precision``), ``optimizer``, ``grad_ckpt``, ``attn``, ``lora_rank``,
``lora_targets``, ``lora_dropout``, ``qlora``, ``grad_accum_steps``, ``grad_sync``, ``loop``, ``outputs_fp32`` (accelerate's mixed precision wraps
the forward: fp32 outputs), ``packing``, ``gpu``, ``ce``, ``ce_chunks``, ``activation_offload``, ``ckpt_policy`` (the long-context
techniques: ``TrainingSpec``'s fields).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SETTINGS = ("model", "world_size", "method", "deepspeed", "fsdp1", "micro_batch_size", "seq_len", "half", "weights_dtype",
            "precision", "optimizer", "grad_ckpt", "attn", "lora_rank", "lora_targets", "lora_dropout",
            "qlora", "grad_accum_steps", "grad_sync", "loop", "outputs_fp32", "use_cache", "packing", "gpu", "ce",
            "ce_chunks", "activation_offload", "ckpt_policy", "ckpt_reentrant", "vocab_size")
_TRUE = {"true", "yes", "on", "1", "y", "t"}
_FALSE = {"false", "no", "off", "0", "n", "f", "none", "null", ""}


@dataclass
class Setting:
    value: Any
    source: str          # "file.yaml: key" or "--flag"
    assumed: bool = False
    why: str = ""         # for an assumed value: why this value
    weak: bool = False    # an assumption any other file's assumption displaces


@dataclass
class Reading:
    """One file's contribution. ``tool`` names the format it was read as."""

    path: str
    tool: str
    settings: dict[str, Setting] = field(default_factory=dict)
    unknown: list[str] = field(default_factory=list)          # keys not understood
    unmodelled: list[str] = field(default_factory=list)       # "key: what the estimate does instead"
    no_effect: list[str] = field(default_factory=list)        # keys known to leave the peak unchanged
    notes: list[str] = field(default_factory=list)

    def set(self, name: str, value: Any, key: str) -> None:
        assert name in SETTINGS, name
        self.settings[name] = Setting(value, f"{self.path}: {key}")

    def assume(self, name: str, value: Any, why: str, *, weak: bool = False) -> None:
        """A value the file does not give; used only when no other file or flag gives it. A later assumption
        (a tool's own default, read after the shared Trainer fields) replaces an earlier one."""
        assert name in SETTINGS, name
        if name not in self.settings or self.settings[name].assumed:
            self.settings[name] = Setting(value, f"{self.path} ({self.tool})", assumed=True, why=why, weak=weak)

    def not_modelled(self, key: str, what: str) -> None:
        self.unmodelled.append(f"{key}: {what}")

    def fail(self, key: str, message: str) -> None:
        raise ValueError(f"config: {self.path}: {key}: {message}")

    # -- typed reads of one key (a bad value is a one-line error naming the file and key)
    def flag(self, key: str, value: Any) -> bool:
        if isinstance(value, bool):
            return value
        if value is None:
            return False
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        self.fail(key, f"must be true or false, got {value!r}")
        raise AssertionError

    def count(self, key: str, value: Any, minimum: int = 1) -> int:
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value.strip())
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            self.fail(key, f"must be an integer >= {minimum}, got {value!r}")
        return value

    def probability(self, key: str, value: Any) -> float:
        """A dropout probability in [0, 1)."""
        if isinstance(value, str):
            try:
                value = float(value.strip())
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            self.fail(key, f"must be a probability in [0, 1), got {value!r}")
        return float(value)

    def lora_dropout(self, key: str, data: dict[str, Any]) -> None:
        """``lora_dropout`` when the file gives it (the LoRA readers share the key's name)."""
        name = key.rsplit(".", 1)[-1]
        if data.get(name) is not None:
            self.set("lora_dropout", self.probability(key, data[name]), key)


def words(text: str) -> frozenset[str]:
    """A set of key names written as whitespace-separated words."""
    return frozenset(text.split())


def unknown_keys(reading: Reading, data: dict[str, Any], handled: set[str], no_effect: frozenset[str],
                 prefix: str = "") -> None:
    """Every key of ``data`` is handled, has no effect on the peak, or is reported as not understood. A handled
    key that set nothing (empty, or at its tool's default) counts as having no effect."""
    mentioned = " ".join([s.source for s in reading.settings.values()] + reading.unmodelled + reading.no_effect)
    for key in data:
        if key in handled:
            if f"{prefix}{key}" not in mentioned:
                reading.no_effect.append(f"{prefix}{key} (empty or at its default)")
            continue
        if key in no_effect:
            reading.no_effect.append(prefix + key)
        else:
            reading.unknown.append(prefix + key)
