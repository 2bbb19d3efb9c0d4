"""Pipeline parallelism as ``torch.distributed.pipelining`` runs it, on a transformers decoder (issue 18).

A stage is a module of its own, built the way torchtitan splits its Llama: the decoder layers divided evenly
(``estimator.methods.pipeline.stage_layers``), the embedding on the first stage, the final norm and the LM head on
the last; every stage computes the rotary embedding of its own micro-batch. The loss is transformers' own
``ForCausalLMLoss`` (logits upcast to fp32, labels shifted), which the schedule calls on the last stage. Under
``dp > 1`` each stage's decoder layers and the stage module are ``fully_shard``-ed over the dp group, as torchtitan
does. ``schedule.step(..., return_outputs=False)``: torchtitan's training step keeps no merged logits.

Used by the harness's ``pp`` method and by ``benchmarks/pipeline_table.py`` (the counted CPU oracle).
"""

from __future__ import annotations

import torch
from torch import nn

from estimator.methods.pipeline import SCHEDULES, stage_layers, stages_of_rank


class HfStage(nn.Module):
    """One pipeline stage of a transformers causal LM (``model.model.layers`` style decoders)."""

    def __init__(self, model: nn.Module, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        inner = model.model
        self.embed_tokens = inner.embed_tokens if first else None
        self.layers = nn.ModuleList(inner.layers[i] for i in layers)
        self.norm = inner.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.rotary_emb = inner.rotary_emb

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        rotary = self.rotary_emb(h, position_ids=positions)
        for layer in self.layers:  # no mask: full rows, SDPA's causal kernel (as the unsplit model runs them)
            h = layer(h, attention_mask=None, position_ids=positions, position_embeddings=rotary)
        if self.lm_head is not None:
            h = self.lm_head(self.norm(h))
        return h


def schedule_class(name: str):
    from torch.distributed.pipelining import schedules

    return {"gpipe": schedules.ScheduleGPipe, "1f1b": schedules.Schedule1F1B,
            "interleaved_1f1b": schedules.ScheduleInterleaved1F1B}[name]


def build(model: nn.Module, pp: int, virtual: int, pp_rank: int, pp_group, device: torch.device,
          microbatches: int, schedule: str, dp_mesh=None, mp_policy=None):
    """(stage modules, schedule) of ``pp_rank``. The model's own modules are moved into the stages; the caller
    drops the model. ``dp_mesh``: FSDP2 over the data-parallel ranks of this stage (per decoder layer + stage)."""
    from torch.distributed.pipelining import PipelineStage
    from transformers.loss.loss_utils import ForCausalLMLoss

    if schedule not in SCHEDULES:
        raise ValueError(f"pp_schedule: {schedule!r} is not one of {', '.join(SCHEDULES)}")
    if hasattr(model, "get_base_model"):  # peft's LoRA: the stages take the adapted modules of its base model
        model = model.get_base_model()
    num_layers = len(model.model.layers)
    vocab = model.config.vocab_size
    num_stages = pp * virtual
    splits = stage_layers(num_layers, num_stages)
    modules, stages = [], []
    for index in stages_of_rank(pp_rank, pp, virtual):
        module = HfStage(model, splits[index], index == 0, index == num_stages - 1)
        if dp_mesh is not None:
            from torch.distributed.fsdp import fully_shard

            kwargs = {"mesh": dp_mesh, "reshard_after_forward": False}  # torchtitan's default under pp
            if mp_policy is not None:
                kwargs["mp_policy"] = mp_policy
            for layer in module.layers:
                fully_shard(layer, **kwargs)
            fully_shard(module, **kwargs)
        modules.append(module)
        stages.append(PipelineStage(module, index, num_stages, device, group=pp_group))

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return ForCausalLMLoss(logits, labels, vocab_size=vocab)

    cls = schedule_class(schedule)
    runner = cls(stages if schedule == "interleaved_1f1b" else stages[0], n_microbatches=microbatches,
                 loss_fn=loss_fn)
    return modules, runner


def train_step(runner, first: bool, last: bool, ids: torch.Tensor, optimizer) -> None:
    """One optimizer step: the whole batch (micro-batches x rows) into the schedule, as torchtitan steps it."""
    if first:
        runner.step(ids, target=ids if last else None, return_outputs=False)
    elif last:
        runner.step(target=ids, return_outputs=False)
    else:
        runner.step(return_outputs=False)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
