"""Several config files (and explicit command-line flags) into one ``RunSpec``, with the report of what was read.

Precedence: an explicit flag, then the last file that gives a setting, then a value a file's tool assumes by
default, then the estimator's own default (reported as assumed). Two files that disagree are named.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from estimator.configs.reading import SETTINGS, Reading, Setting
from estimator.options.fsdp1_args import FSDP1_FLAGS
from estimator.spec import FSDP_METHODS, Fsdp1Spec, ParallelSpec, RunSpec, TrainingSpec

SHARDED = ("fsdp", "fsdp1", "deepspeed")
_FLAG_NAMES = {"world_size": "gpus"}
_DEFAULTS = TrainingSpec()


@dataclass
class ConfigReport:
    """What the estimate read from the user's configs: settings used (and from where), values assumed, settings
    the estimator does not model, keys not understood."""

    files: list[str]
    used: list[str] = field(default_factory=list)
    assumed: list[str] = field(default_factory=list)
    not_modelled: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    no_effect: int = 0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"files": self.files, "used": self.used, "assumed": self.assumed, "not_modelled": self.not_modelled,
                "unknown": self.unknown, "no_effect_keys": self.no_effect, "notes": self.notes}

    def render(self) -> str:
        lines = [f"read from your configs ({', '.join(self.files)}):"]
        for title, items in (("used", self.used), ("assumed", self.assumed), ("not modelled", self.not_modelled),
                             ("not understood (ignored)", self.unknown), ("note", self.notes)):
            lines += [f"  {title}: {item}" for item in items]
        if self.no_effect:
            lines.append(f"  {self.no_effect} more keys have no effect on the per-rank peak (logging, saving, "
                         "schedules, data loading)")
        return "\n".join(lines)


def merge(readings: list[Reading], flags: dict[str, Any]) -> tuple[dict[str, Setting], list[str]]:
    """One value per setting, and the disagreements between files."""
    merged: dict[str, Setting] = {}
    conflicts = []
    for reading in readings:
        for name, setting in reading.settings.items():
            old = merged.get(name)
            if setting.assumed and old is not None and not (old.assumed and old.weak):
                continue  # a tool default never displaces a value another file gives
            if old is not None and not old.assumed and old.value != setting.value:
                conflicts.append(f"{name}: {old.source} says {old.value!r}, {setting.source} says "
                                 f"{setting.value!r}; using the latter")
            merged[name] = setting
    for name, value in flags.items():
        if name == "fsdp1" and value:  # the --fsdp-* flags override the configs' FSDP1 settings one by one
            old = merged.get("fsdp1")
            flags_given = " ".join(f"--{FSDP1_FLAGS[k]}" for k in value)
            merged[name] = Setting({**(old.value if old else {}), **value},
                                   f"{old.source}, {flags_given}" if old else flags_given)
        elif value is not None and name != "fsdp1":
            merged[name] = Setting(value, f"--{_FLAG_NAMES.get(name, name).replace('_', '-')}")
    return merged, conflicts


def resolve_precision(settings: dict[str, Setting], method: str) -> tuple[str, str]:
    """(TrainingSpec.precision, why). Sharded methods keep fp32 masters under a 16-bit switch (accelerate's FSDP
    upcasts to fp32 shards; DeepSpeed keeps fp32 masters); single GPU and DDP autocast over the weights' dtype."""
    if "precision" in settings:
        return settings["precision"].value, ""
    half = settings["half"].value if "half" in settings else "none"
    weights = settings["weights_dtype"].value if "weights_dtype" in settings else None
    if method in SHARDED:
        if half in ("bf16", "fp16"):
            return f"mixed_{half}", ""
        return ("bf16" if weights == "bf16" else "fp32"), ""
    if weights == "bf16" and half in ("bf16", "none"):
        return "bf16", ""
    if half in ("bf16", "fp16"):
        why = "" if weights is not None else (f"{half} autocast over fp32 weights (amp_{half}); a model loaded in "
                                              f"{half} trains as pure {half}: --precision bf16")
        return f"amp_{half}", why
    return "fp32", ""


def spec_from_settings(settings: dict[str, Setting], report: ConfigReport) -> RunSpec:
    def value(name: str, default: Any, why: str = "") -> Any:
        if name in settings:
            return settings[name].value
        if why:
            report.assumed.append(f"{name} = {default!r} ({why})")
        return default

    if "model" not in settings:
        raise ValueError("model: none of the configs names the model; pass --model (a catalogue name or a "
                         "config.json path)")
    world = value("world_size", 1, "no config gives the number of processes; pass --gpus")
    method = value("method", "ddp" if world > 1 else "single")
    if method in ("single", "ddp"):
        method = "ddp" if world > 1 else "single"
    precision, why = resolve_precision(settings, method)
    if why:
        report.assumed.append(f"precision = {precision!r} ({why})")
    training = TrainingSpec(
        micro_batch_size=value("micro_batch_size", 1, "no micro-batch size given"),
        seq_len=value("seq_len", _DEFAULTS.seq_len, "no sequence length given; pass --seq-len"),
        precision=precision, optimizer=value("optimizer", "adamw"),
        grad_ckpt=bool(value("grad_ckpt", False) or value("ckpt_policy", "")),
        attn=value("attn", "sdpa"), lora_rank=value("lora_rank", 0),
        lora_targets=value("lora_targets", "auto"),
        lora_dropout=value("lora_dropout", 0.0) if value("lora_rank", 0) else 0.0, qlora=bool(value("qlora", False)),
        grad_accum_steps=value("grad_accum_steps", 1), loop=value("loop", "trainer"),
        # it changes nothing without accumulation or sharded gradients: left at its default there (same spec id)
        grad_sync=value("grad_sync", "every") if value("grad_accum_steps", 1) > 1 and method in FSDP_METHODS
        else "every",
        outputs_fp32=_outputs_fp32(settings, method, value), use_cache=bool(value("use_cache", False)),
        ce=value("ce", "standard"), ce_chunks=value("ce_chunks", 8),
        activation_offload=bool(value("activation_offload", False)), ckpt_policy=value("ckpt_policy", ""),
        ckpt_reentrant=bool(value("ckpt_reentrant", False)) and bool(value("grad_ckpt", False))
        and not value("ckpt_policy", ""), vocab_size=value("vocab_size", 0))
    gpu = str(value("gpu", "h100-80gb", "no config names the GPU type; pass --gpu")).lower()
    tp = value("tp", 1) if "tp" in settings else (world if method == "tp" else 1)
    model = str(settings["model"].value)
    fsdp1 = _fsdp1(settings, method)
    if method == "fsdp1" and training.lora_rank and (precision.startswith("mixed_") or fsdp1.forward_prefetch
                                                     or fsdp1.backward_prefetch != "BACKWARD_PRE"):
        report.not_modelled.append("fsdp1 with LoRA under mixed precision or other than the default prefetching: "
                                   "estimated as fsdp (FSDP2, fully_shard per decoder layer)")
        method = "fsdp"
    if method == "deepspeed":
        base = RunSpec(model=model, parallel=ParallelSpec(method="ddp" if world > 1 else "single", world_size=world),
                       training=training, gpu=gpu)
        from estimator.configs.deepspeed_json import spec_from_deepspeed
        from estimator.models.arch import resolve_arch

        return spec_from_deepspeed(settings["deepspeed"].value, base, resolve_arch(model).hidden_size)
    return RunSpec(model=model, parallel=ParallelSpec(method=method, world_size=world, tp=tp, fsdp1=fsdp1),
                   training=training, gpu=gpu)


def _outputs_fp32(settings: dict[str, Setting], method: str, value) -> bool:
    """A 16-bit mixed-precision switch (``half``) is accelerate's (accelerate configs, and the HF Trainer, TRL,
    axolotl and LLaMA-Factory, which run on accelerate): it wraps the forward to return fp32 copies of 16-bit
    outputs, except under DeepSpeed."""
    half = settings["half"].value if "half" in settings else "none"
    if half not in ("bf16", "fp16") or method == "deepspeed":
        return bool(value("outputs_fp32", False))
    return bool(value("outputs_fp32", True, f"accelerate's {half} mixed precision wraps the forward in "
                                             "convert_outputs_to_fp32: a manual loop holds fp32 logits"))


def _fsdp1(settings: dict[str, Setting], method: str) -> Fsdp1Spec:
    """The FSDP1 settings the configs and --fsdp-* flags give, over torch's defaults."""
    setting = settings.get("fsdp1")
    if setting is None:
        return Fsdp1Spec()
    if method != "fsdp1":
        if setting.source.startswith("--") or ", --" in setting.source:
            flag = next(part for part in setting.source.replace(",", " ").split() if part.startswith("--"))
            raise ValueError(f"{flag}: FSDP1 settings apply to --method fsdp1, not {method!r}")
        return Fsdp1Spec()
    return Fsdp1Spec(**{**Fsdp1Spec().__dict__, **setting.value})


def build_report(readings: list[Reading], settings: dict[str, Setting], conflicts: list[str]) -> ConfigReport:
    report = ConfigReport(files=[r.path for r in readings])
    for name in SETTINGS + ("tp",):
        setting = settings.get(name)
        if setting is None:
            continue
        shown = "(DeepSpeed config)" if name == "deepspeed" and isinstance(setting.value, dict) else setting.value
        if setting.assumed:
            report.assumed.append(f"{name} = {shown!r} ({setting.why}; {setting.source})")
        else:
            report.used.append(f"{name} = {shown!r} ({setting.source})")
    for reading in readings:
        report.not_modelled += [f"{reading.path}: {item}" for item in reading.unmodelled]
        report.unknown += [f"{reading.path}: {key}" for key in reading.unknown]
        report.no_effect += len(reading.no_effect)
        report.notes += [f"{reading.path}: {note}" for note in reading.notes]
    report.notes += conflicts
    packing = settings.get("packing")
    report.notes.append("packing: every row is filled to seq_len, as the estimate assumes" if packing and packing.value
                        else "no packing: batches are padded to their longest row; the estimate is for rows of the "
                             "full seq_len (the upper end)")
    return report
