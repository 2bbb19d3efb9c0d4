"""Command-line options of the ``fsdp1`` method (FSDP1's settings, ``estimator.spec.Fsdp1Spec``)."""

from __future__ import annotations

import argparse

from estimator.spec import FSDP1_BACKWARD_PREFETCH, FSDP1_LORA_WRAPS, FSDP1_SHARDING, Fsdp1Spec

FLAG_FIELDS = {"fsdp_sharding": "sharding_strategy", "fsdp_backward_prefetch": "backward_prefetch",
          "fsdp_use_orig_params": "use_orig_params", "fsdp_offload": "cpu_offload",
          "fsdp_forward_prefetch": "forward_prefetch", "fsdp_limit_all_gathers": "limit_all_gathers",
          "gpus_per_node": "gpus_per_node", "fsdp_lora_wrap": "lora_wrap"}
# Fsdp1Spec field -> its flag as typed.
FSDP1_FLAGS = {field: flag.replace("_", "-") for flag, field in FLAG_FIELDS.items()}


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _upper(choices: tuple[str, ...]):
    def parse(text: str) -> str:
        value = text.strip().upper()
        if value not in choices:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(choices)}")
        return value
    return parse


def add_fsdp1_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("fsdp1 (FSDP1, FullyShardedDataParallel) settings")
    group.add_argument("--fsdp-sharding", type=_upper(FSDP1_SHARDING), metavar="STRATEGY",
                       help=f"sharding strategy: {', '.join(FSDP1_SHARDING)} (default FULL_SHARD)")
    group.add_argument("--fsdp-backward-prefetch", type=_upper(FSDP1_BACKWARD_PREFETCH), metavar="MODE",
                       help=f"{', '.join(FSDP1_BACKWARD_PREFETCH)} (default BACKWARD_PRE)")
    group.add_argument("--fsdp-use-orig-params", type=_bool, metavar="BOOL",
                       help="use_orig_params (default true, as accelerate and the Trainer set it)")
    group.add_argument("--fsdp-offload", action="store_true", default=None,
                       help="CPUOffload(offload_params=True): shards, gradients and the step on the host")
    group.add_argument("--fsdp-forward-prefetch", action="store_true", default=None, help="forward_prefetch=True")
    group.add_argument("--fsdp-limit-all-gathers", type=_bool, metavar="BOOL",
                       help="limit_all_gathers (default true; changes reserved, not allocated memory)")
    group.add_argument("--gpus-per-node", type=int, metavar="N", help="HYBRID_SHARD's shard group (default 8)")
    group.add_argument("--fsdp-lora-wrap", choices=FSDP1_LORA_WRAPS,
                       help="LoRA adapters' units: adapter (peft's fsdp_auto_wrap_policy, default) or layer (inside "
                            "the decoder layer's flat parameter, as Lightning's auto_wrap_policy={Block} puts them)")


def fsdp1_from_args(args: argparse.Namespace, method: str, base: Fsdp1Spec | None = None) -> Fsdp1Spec:
    """The FSDP1 settings given on the command line over ``base``; ValueError if given for another method."""
    given = {field: getattr(args, flag) for flag, field in FLAG_FIELDS.items() if getattr(args, flag, None) is not None}
    if given and method != "fsdp1":
        flag = next(f for f, field in FLAG_FIELDS.items() if field in given)
        raise ValueError(f"--{flag.replace('_', '-')}: FSDP1 settings apply to --method fsdp1, not {method!r}")
    base = base or Fsdp1Spec()
    return Fsdp1Spec(**{**base.__dict__, **given})
