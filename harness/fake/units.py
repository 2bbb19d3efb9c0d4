"""FSDP2 units beyond one per decoder layer: what transformers' FSDP plan adds and the harness applies alike.

transformers 5.24 (``PreTrainedModel._resolve_parallel_plans``) gives every module that a 16-bit model keeps in
fp32 (``_keep_in_fp32_modules_strict``: DeepSeek-V2/V3's router, ``mlp.gate``) an FSDP2 group of its own, sharded
before the layer that contains it: FSDP2 asserts one original dtype per group ("FSDP expects uniform original
parameter dtype"). Without it a bf16 DeepSeek layer cannot be ``fully_shard``ed at all.
"""

from __future__ import annotations

from typing import Any

HALF_DTYPES = ("torch.bfloat16", "torch.float16")


def fp32_kept_modules(model: Any) -> list[Any]:
    """The modules holding (directly) a trainable fp32 parameter in a model whose other trainable parameters are
    16-bit, deepest first. FSDP2's one-dtype rule counts trainable parameters only, so a LoRA model's fp32
    adapters on a frozen 16-bit base need none; nor does an fp32 model or one built in fp32 for mixed
    precision."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not any(str(p.dtype) in HALF_DTYPES for p in trainable):
        return []
    found = [(name, module) for name, module in model.named_modules()
             if any(p.requires_grad and str(p.dtype) == "torch.float32" for p in module.parameters(recurse=False))]
    return [module for _name, module in sorted(found, key=lambda item: item[0].count("."), reverse=True)]
