"""Command-line options of DeepSpeed ZeRO-3's leaf modules (``zero_optimization.leaf_module``:
``estimator.spec.ZeroSpec``'s ``leaf_*`` fields, ``estimator.models.zero3_leaf``)."""

from __future__ import annotations

import argparse
import dataclasses

from estimator.spec import ZeroSpec

# flag's dest -> ZeroSpec field
LEAF_FLAGS = {"zero3_leaf_classes": "leaf_classes", "zero3_leaf_names": "leaf_names",
              "zero3_leaf_suffixes": "leaf_name_suffixes"}


def _names(text: str) -> tuple[str, ...]:
    """A comma-separated list; empty (``""``) or ``none`` is the empty list."""
    if text.strip().lower() in ("", "none"):
        return ()
    return tuple(name.strip() for name in text.split(",") if name.strip())


def add_zero3_leaf_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("zero3 leaf modules (DeepSpeed's zero_optimization.leaf_module)")
    group.add_argument("--zero3-leaf-classes", type=_names, metavar="LIST",
                       help="module classes DeepSpeed makes ZeRO-3 leaves, comma-separated, 'none' for none "
                            "(default DeepSpeed 0.19.8's: the Mixtral, Qwen2-MoE and Qwen3-MoE MoE blocks): a leaf "
                            "is gathered whole when entered and its gradients reduced when its backward is done")
    group.add_argument("--zero3-leaf-names", type=_names, metavar="LIST",
                       help="module names (model.named_modules(), e.g. model.layers.1.mlp) made leaves")
    group.add_argument("--zero3-leaf-suffixes", type=_names, metavar="LIST",
                       help="module name suffixes (e.g. mlp.experts) whose modules are made leaves")


def zero3_leaf_from_args(args: argparse.Namespace, method: str, zero: ZeroSpec) -> ZeroSpec:
    """``zero`` with the leaf modules given on the command line; ValueError if given for a method but zero3."""
    given = {field: getattr(args, flag) for flag, field in LEAF_FLAGS.items() if getattr(args, flag, None) is not None}
    if given and method != "zero3":
        flag = next(f for f, field in LEAF_FLAGS.items() if field in given)
        raise ValueError(f"--{flag.replace('_', '-')}: ZeRO-3 leaf modules apply to --method zero3, not {method!r}")
    return dataclasses.replace(zero, **given) if given else zero
