"""``parallel.pp > 1`` with ``parallel.pp_engine=deepspeed`` (method ``single``): DeepSpeed's pipeline engine on real
process groups (``harness.ds_pipeline``: the decoder as a ``PipelineModule`` of LayerSpecs split by parameter count,
ZeRO stage 0, torch's foreach AdamW as the client optimizer, the model in bf16 or fp32 with no DeepSpeed fp16/bf16
mode; ``mixed_bf16``: DeepSpeed's bf16 mode, BF16_Optimizer with fp32 masters around the client optimizer).

``engine.train_batch`` runs the whole step: the forward and backward of its ``pp_microbatches`` micro-batches
(DeepSpeed's gradient accumulation steps), the gradient reduction and the optimizer step. So ``forward`` runs it on
``pp_microbatches`` copies of the micro-batch the worker hands it (full-length rows: every micro-batch the same
shape), ``backward`` and ``step`` have nothing left to do, and the rank's peak is recorded in its "forward" phase,
as under torch's pipelining (``harness.methods.pipeline``).
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch

from harness.methods.base import WrapContext


class DsPipelineTrainer:
    def __init__(self, engine, microbatches: int, config) -> None:
        self.engine, self.microbatches = engine, microbatches
        self.model = SimpleNamespace(config=config)  # the worker reads the attention implementation off it

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        ids = batch["input_ids"]
        data = iter([(ids, ids)] * self.microbatches)  # the first stage reads inputs, the last labels
        loss = self.engine.train_batch(data)
        return loss.detach() if isinstance(loss, torch.Tensor) else torch.zeros(())

    def backward(self, loss: torch.Tensor, scale: float = 1.0) -> None:
        pass  # train_batch ran every backward

    def step(self) -> None:
        pass  # and the optimizer step

    def micro_batch(self, is_last: bool):
        return contextlib.nullcontext()

    def close(self) -> None:
        self.engine = None


RUN_PRECISIONS = ("bf16", "fp32", "mixed_bf16")


def wrap(ctx: WrapContext) -> DsPipelineTrainer:
    import deepspeed
    from transformers import AutoConfig

    from harness import ds_pipeline as dsp
    from harness.methods.deepspeed import patch_deepspeed

    spec, par = ctx.spec, ctx.spec.parallel
    if ctx.fake_pg:
        raise ValueError("pp_engine: DeepSpeed's pipeline stages send activations point to point; they need real "
                         "process groups (gloo on CPU, NCCL on GPUs), not the emulated ranks")
    if spec.training.precision not in RUN_PRECISIONS:
        raise ValueError(f"pp_engine: the DeepSpeed pipeline is run in {', '.join(RUN_PRECISIONS)} (mixed_bf16: "
                         f"DeepSpeed's bf16 mode), not {spec.training.precision}")
    patch_deepspeed(fake_pg=False)
    deepspeed.init_distributed(dist_backend=ctx.dist.backend, auto_mpi_discovery=False)
    fields = {k: v for k, v in ctx.config.items() if k not in ("architectures", "model_type")}
    hf = AutoConfig.for_model(ctx.config["model_type"], **fields)
    hf._attn_implementation = spec.training.attn if spec.training.attn != "flash" else "flash_attention_2"
    torch.manual_seed(ctx.options.seed)
    with torch.device(ctx.device):
        engine, module = dsp.build_engine(hf, par.pp, spec.training.precision, spec.training.micro_batch_size,
                                          par.microbatches)
    ctx.notes.append(f"pp: DeepSpeed's pipeline engine, rank {ctx.dist.rank} runs layers "
                     f"{module.parts[ctx.dist.rank]}..{module.parts[ctx.dist.rank + 1] - 1} of the PipelineModule "
                     f"(parts {list(map(int, module.parts))}), {par.microbatches} micro-batches per train_batch, all "
                     "inside the forward phase")
    return DsPipelineTrainer(engine, par.microbatches, hf)
