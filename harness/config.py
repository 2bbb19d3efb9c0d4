"""Hydra side: structured-config schemas and the one conversion ``cfg -> (RunSpec, HarnessOptions)``.

The schemas are generated from the RunSpec dataclasses and from HarnessOptions (same fields, same types, not
frozen, no validation), so a typo or a bad type fails at composition time with the key named, and the schema
can never drift from what the worker reads.
Value checks stay in ``RunSpec.__post_init__`` / ``validate_options``; ``to_run`` re-raises them with the full
dotted key (``training.seq_len: must be a positive integer, got -1``).
"""

import dataclasses
import typing
from dataclasses import field
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from estimator.spec import Fsdp1Spec, ParallelSpec, RunSpec, TrainingSpec, ZeroSpec

# No `from __future__ import annotations` here: the generated schemas' annotations must be the classes
# themselves for OmegaConf to type the nodes.
from harness.options import HarnessOptions, ModelOptions, validate_options


def _field_specs(cls: type, overrides: dict[str, tuple[Any, Any]] | None = None) -> list[tuple[str, Any, Any]]:
    """``cls``'s fields as ``make_dataclass`` specs with resolved types. ``overrides``: field -> (type, default
    or field())."""
    hints = typing.get_type_hints(cls)
    overrides = overrides or {}
    specs = []
    for f in dataclasses.fields(cls):
        if f.name in overrides:
            specs.append((f.name, *overrides[f.name]))
        elif f.default_factory is not dataclasses.MISSING:
            specs.append((f.name, hints[f.name], field(default_factory=f.default_factory)))
        else:
            specs.append((f.name, hints[f.name], f.default))
    return specs


def _mirror(cls: type, name: str, overrides: dict[str, tuple[Any, Any]] | None = None) -> type:
    """A mutable, validation-free copy of a spec dataclass for OmegaConf (frozen dataclasses become read-only
    configs and would run __post_init__ on defaults)."""
    return dataclasses.make_dataclass(name, _field_specs(cls, overrides))


ZeroConf = _mirror(ZeroSpec, "ZeroConf")
Fsdp1Conf = _mirror(Fsdp1Spec, "Fsdp1Conf")
ParallelConf = _mirror(ParallelSpec, "ParallelConf", {"zero": (ZeroConf, field(default_factory=ZeroConf)),
                                                      "fsdp1": (Fsdp1Conf, field(default_factory=Fsdp1Conf))})
TrainingConf = _mirror(TrainingSpec, "TrainingConf")


# Every conf/model file sets the name (``custom`` leaves it ``???``), so the schema requires it.
ModelConf = _mirror(ModelOptions, "ModelConf", {"name": (str, MISSING)})


def _measure_conf() -> type:
    """Schema of ``conf/measure.yaml``: the RunSpec nodes (``model`` is the config group's node whose ``name``
    is RunSpec.model; ``gpu: auto`` means the key of the device the run lands on), then every HarnessOptions
    field as declared there, then ``local``: machine-specific settings from the gitignored
    conf/local/default.yaml (Slurm partition, account, ...)."""
    spec_nodes = {"model": (ModelConf, field(default_factory=ModelConf)),
                  "parallel": (ParallelConf, field(default_factory=ParallelConf)),
                  "training": (TrainingConf, field(default_factory=TrainingConf)),
                  "gpu": (str, "auto")}
    fields = [(name, *spec) for name, spec in spec_nodes.items()]
    fields += [spec for spec in _field_specs(HarnessOptions) if spec[0] not in spec_nodes]
    fields.append(("local", dict[str, Any], field(default_factory=dict)))
    return dataclasses.make_dataclass("MeasureConf", fields)


MeasureConf = _measure_conf()


_REGISTERED = False


def register_configs() -> None:
    """Store the schema (``measure_schema``) and the first-of resolver; idempotent."""
    global _REGISTERED
    if _REGISTERED:
        return
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="measure_schema", node=MeasureConf)
    # ${harness.first:a,b}: the first non-null argument (emulate.world_size, when set, is the job's world size).
    if not OmegaConf.has_resolver("harness.first"):
        OmegaConf.register_new_resolver("harness.first",
                                        lambda *args: next((a for a in args if a is not None), None))
    _REGISTERED = True


register_configs()


def _prefixed(prefix: str, build):
    try:
        return build()
    except ValueError as err:
        raise ValueError(_with_prefix(prefix, str(err))) from None
    except TypeError as err:  # a wrong type that slipped past the schema (e.g. a list for an int)
        raise ValueError(f"{prefix.rstrip('.') or 'config'}: {err}") from None


def _with_prefix(prefix: str, message: str) -> str:
    """``parallel.zero.`` + ``zero.x: ...`` -> ``parallel.zero.x: ...`` (spec messages may carry part of the path)."""
    parts = prefix.rstrip(".").split(".") if prefix else []
    for start in range(len(parts)):
        if message.startswith(".".join(parts[start:]) + "."):
            return ".".join(parts[:start]) + "." + message if start else message
    return prefix + message


def to_run(cfg: DictConfig | dict[str, Any], *, gpu_key: str | None = None) -> tuple[RunSpec, HarnessOptions]:
    """The composed config as (RunSpec, HarnessOptions). Raises ValueError naming the dotted key."""
    if isinstance(cfg, DictConfig):  # the hydra node needs a running app to resolve; it is not ours anyway
        cfg = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
        try:
            data = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
        except OmegaConfBaseException as err:  # a ??? left unset, a broken interpolation
            key = getattr(err, "full_key", None) or "config"
            raise ValueError(f"{key}: {str(err).splitlines()[0]}") from None
    else:
        data = {k: v for k, v in cfg.items() if k != "hydra"}
    opts = validate_options(_options(data))
    if opts.model.name in (None, "???", ""):
        raise ValueError("model.name: required (model=custom model.name=<config.json path, catalogue name or hub id>)")
    parallel = dict(data.get("parallel") or {})
    zero = _prefixed("parallel.zero.", lambda: ZeroSpec(**(parallel.pop("zero", None) or {})))
    fsdp1 = _prefixed("parallel.fsdp1.", lambda: Fsdp1Spec(**(parallel.pop("fsdp1", None) or {})))
    if opts.emulate.world_size is not None:
        if parallel.get("world_size", 1) not in (1, opts.emulate.world_size):
            raise ValueError(f"emulate.world_size: {opts.emulate.world_size} disagrees with parallel.world_size "
                             f"{parallel['world_size']} (set one of them)")
        parallel["world_size"] = opts.emulate.world_size
    parallel_spec = _prefixed("parallel.", lambda: ParallelSpec(**parallel, zero=zero, fsdp1=fsdp1))
    training_fields = dict(data.get("training") or {})
    if training_fields.get("batch", "auto") == "auto":
        training_fields["batch"] = batch_kind(opts.data)
    training = _prefixed("training.", lambda: TrainingSpec(**training_fields))
    _check_model_code(training.model_code)
    gpu = data.get("gpu") or "auto"
    if gpu == "auto":
        gpu = gpu_key or "auto"
    spec = _prefixed("", lambda: RunSpec(model=opts.model.name, parallel=parallel_spec, training=training,
                                         gpu=gpu))
    if spec.model != (opts.model.name or "").strip():
        raise ValueError("model.name: must not have surrounding spaces")
    if opts.emulated and spec.parallel.world_size < 2:
        raise ValueError("emulate.world_size: emulation needs a world size of at least 2")
    return spec, opts


def _check_model_code(model_code: str) -> None:
    """A run executes the installed transformers' model code: another release cannot be measured here."""
    from estimator.models.profiles import installed_version
    from estimator.spec import model_code_release

    installed = installed_version("transformers") or ""
    if model_code and model_code_release(model_code) != model_code_release(installed):
        raise ValueError(f"training.model_code: {model_code} is not the installed transformers {installed}; a run "
                         f"measures the installed release's model code (pip install 'transformers=="
                         f"{model_code_release(model_code)}.*' to measure that one)")


def batch_kind(data_opts) -> str:
    """``TrainingSpec.batch`` of the batches ``data`` makes: rows cut at seq_len (``full_rows``) or packed are full
    length; keeping shorter rows (``all``, ``full_batches``) pads them, and the mask path runs."""
    return "full" if data_opts.keep in ("full_rows", "packed") else "padded"


def _options(data: dict[str, Any]) -> HarnessOptions:
    from harness.options import options_from_dict

    keys = {f.name for f in dataclasses.fields(HarnessOptions)}
    return options_from_dict({k: v for k, v in data.items() if k in keys})
