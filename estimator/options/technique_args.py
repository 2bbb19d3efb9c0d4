"""The long-context techniques' flags, shared by ``python -m estimator`` and ``python -m estimator plan``."""

from __future__ import annotations

import argparse

from estimator.methods.long_context import technique_name
from estimator.spec import CES, TrainingSpec


def add_technique_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ce", choices=CES, help="the loss: 'standard' (default: the model's head and loss, the whole "
                   "sequence's logits upcast to fp32), 'chunked' (torchtune's LinearCrossEntropyLoss: head and fp32 "
                   "cross-entropy per sequence chunk), 'fused_linear' (Liger's fused linear cross-entropy: the "
                   "logits never held for the whole sequence, the gradients made chunk by chunk in the forward)")
    p.add_argument("--ce-chunks", type=int, metavar="N", help="chunks of --ce chunked (torchtune's "
                   "num_output_chunks, default 8)")
    p.add_argument("--activation-offload", action="store_true", default=None,
                   help="saved activations moved to host memory in the forward (torch.autograd.graph.save_on_cpu)")
    p.add_argument("--ckpt-policy", metavar="POLICY", help="which layers checkpoint (implies --grad-ckpt): "
                   "every-k:K (every K-th decoder layer, as torchtitan and torchtune count) or selective-ops "
                   "(torchtitan's op policy: matmul and attention outputs saved, every second matmul and the rest "
                   "recomputed)")


def technique_fields(args, base: TrainingSpec) -> dict:
    """TrainingSpec fields from the flags, ``base``'s where a flag is not given."""
    policy = args.ckpt_policy if args.ckpt_policy is not None else base.ckpt_policy
    fields = {"ce": args.ce or base.ce, "ce_chunks": base.ce_chunks if args.ce_chunks is None else args.ce_chunks,
              "activation_offload": bool(args.activation_offload or base.activation_offload),
              "ckpt_policy": policy}
    if policy:
        fields["grad_ckpt"] = True
    return fields


def technique_label(t: TrainingSpec) -> str:
    """", chunked cross-entropy (8 chunks) + ckpt every-k:2" for a header line; "" without techniques."""
    name = technique_name(t)
    return f", {name}" if name else ""
