"""Expert parallelism as transformers 5.24 applies it, on real process groups (gloo on CPU, NCCL on GPUs): the
model's own ``ep_plan`` (``MoEParamShard`` on the expert tensors, ``AllToAllEP`` dispatch) and its FSDP2 layout for
experts (each experts module ``fully_shard``ed on the ``efsdp`` mesh), through
``PreTrainedModel.prepare_distribute_model`` / ``maybe_distribute_model``. The dense part is FSDP2 per decoder
layer, then the root, as the harness's ``fsdp`` method and ``estimator.methods.state.fsdp`` shard it (transformers'
own dense plan also gives the embeddings and the final norm + head units of their own: not modelled yet).

``distribute(model, world, ep)`` must run on every rank after ``init_process_group`` and before the weights are
materialised (the model built on the meta device).
"""

from __future__ import annotations

from typing import Any

# the harness's dense FSDP2 layout: every decoder layer a unit, the rest in the root unit
DENSE_FSDP_PLAN = {"model.layers.*": "free_full_weight"}


def distributed_config(world: int, ep: int, precision: str = "bf16") -> Any:
    """``mixed_bf16``: fp32 shards, bf16 compute, fp32 reduction (transformers' ``fsdp_mixed_precision``, the
    policy the harness's fsdp method applies); its FSDP2 has no fp16 policy."""
    from transformers.distributed import DistributedConfig

    if precision == "mixed_fp16":
        raise ValueError("ep: transformers' FSDP2 mixed precision is bf16 only; use mixed_bf16, bf16 or fp32")
    return DistributedConfig(fsdp_size=world, ep_size=ep if ep > 1 else None,
                             fsdp_mixed_precision=precision == "mixed_bf16")


def distribute(model: Any, world: int, ep: int, precision: str = "bf16") -> Any:
    """``model`` (meta device) sharded as ``DistributedConfig(fsdp_size=world, ep_size=ep)`` shards it, with the
    dense FSDP2 units of ``DENSE_FSDP_PLAN``."""
    config = distributed_config(world, ep, precision)
    cls = type(model)
    config, _, mesh = cls.prepare_distribute_model(config)
    model._fsdp_plan = dict(DENSE_FSDP_PLAN)
    return cls.maybe_distribute_model(model, config, mesh)


def balanced(tokens: int, k: int, experts: int):
    """Token t to experts t*k .. t*k+k-1 (mod E): every expert, hence every EP rank, gets the same rows."""
    import torch

    return (torch.arange(tokens)[:, None] * k + torch.arange(k)[None, :]) % experts


def skewed(tokens: int, k: int, experts: int):
    """Every token to experts 0 .. k-1: one EP rank receives every routed row of its group."""
    import torch

    return torch.arange(k)[None, :].expand(tokens, k).contiguous()


ROUTINGS = {"balanced": balanced, "skewed": skewed}


def force_routing(model: Any, pick) -> int:
    """Every top-k router returns ``pick(tokens, top_k, experts)`` as its experts; the number of routers."""
    def hook(_module, _inputs, output):
        logits, weights, _ = output
        return logits, weights, pick(logits.shape[0], weights.shape[-1], logits.shape[-1]).to(logits.device)

    routers = [m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")]
    for router in routers:
        router.register_forward_hook(hook)
    return len(routers)


def skew_imbalance(experts: int, top_k: int) -> float:
    """The busiest expert's load under ``skewed`` relative to balanced: every token's row, against top_k / E."""
    return experts / top_k
