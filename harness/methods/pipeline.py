"""``parallel.pp > 1`` (methods ``single``, ``fsdp``, ``tp`` and ``dp_tp``): torch.distributed.pipelining on real process groups
(``harness.pipeline``: the stage split, torch's PipelineStage and schedule, FSDP2 over the dp ranks of a stage, with
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` over fp32 weights under ``mixed_bf16``; ``grad_ckpt``:
transformers' per-layer checkpointing of every decoder layer, which the stages keep, as torchtitan checkpoints each
stage's blocks; method ``tp``: every decoder layer split over the tp ranks (``apply_tp``) before the stage split;
``dp_tp``: both, on torchtitan's mesh (pp, dp, tp)).

The worker's step is forward / backward / optimizer per micro-batch; a pipeline step runs forward and backward
of all its micro-batches inside ``schedule.step``. So ``forward`` runs the whole schedule on the micro-batch the
worker hands it, repeated ``pp_microbatches`` times along the batch (the pipeline's micro-batches, each of
``micro_batch_size`` rows: full-length rows make every one the same shape), ``backward`` has nothing left to do,
and ``step`` is the optimizer's. The rank's peak is therefore recorded in its "forward" phase. Gradient
accumulation outside the pipeline is refused by the spec.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from estimator.profiler.build import build_model, build_optimizer
from harness import pipeline as hp
from harness.fake.wrap import build_training, fsdp_mp_policy
from harness.methods.base import WrapContext


class PipelineTrainer:
    def __init__(self, modules, runner, optimizer, first: bool, last: bool, microbatches: int, config) -> None:
        self.modules, self.runner, self.optimizer = modules, runner, optimizer
        # the worker reads the model's attention implementation off ``trainer.model.config``
        self.model = SimpleNamespace(config=config)
        self.first, self.last, self.microbatches = first, last, microbatches

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        ids = batch["input_ids"].repeat(self.microbatches, 1)
        losses: list[torch.Tensor] = []
        if self.first:
            self.runner.step(ids, target=ids if self.last else None, losses=losses, return_outputs=False)
        elif self.last:
            self.runner.step(target=ids, losses=losses, return_outputs=False)
        else:
            self.runner.step(return_outputs=False)
        return torch.stack([x.detach() for x in losses]).mean() if losses else torch.zeros(())

    def backward(self, loss: torch.Tensor, scale: float = 1.0) -> None:
        pass  # schedule.step ran every backward

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def micro_batch(self, is_last: bool):
        import contextlib

        return contextlib.nullcontext()

    def close(self) -> None:
        self.modules = self.runner = self.optimizer = None


def wrap(ctx: WrapContext) -> PipelineTrainer:
    spec, par = ctx.spec, ctx.spec.parallel
    if ctx.fake_pg:
        raise ValueError("pp: pipeline stages send activations point to point; they need real process groups "
                         "(gloo on CPU, NCCL on GPUs), not the emulated ranks")
    dp, tp_mesh = par.dp, None
    if par.tp > 1:  # TP inside each stage: method tp (mesh (pp, tp)) or dp_tp (torchtitan's (pp, dp, tp): FSDP2 over
        # dp of the TP-split stages, the dp and tp sub-meshes of one root as FSDP2 needs for 2-D parameters)
        from torch.distributed.device_mesh import init_device_mesh

        shape, names = ((par.pp, dp, par.tp), ("pp", "dp", "tp")) if dp > 1 else ((par.pp, par.tp), ("pp", "tp"))
        mesh = init_device_mesh(ctx.device.type, shape, mesh_dim_names=names)
        pp_group, tp_mesh, pp_rank = mesh.get_group("pp"), mesh["tp"], mesh.get_local_rank("pp")
        dp_mesh = mesh["dp"] if dp > 1 else None
    elif dp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(ctx.device.type, (par.pp, dp), mesh_dim_names=("pp", "dp"))
        pp_group, dp_mesh, pp_rank = mesh.get_group("pp"), mesh["dp"], mesh.get_local_rank("pp")
    else:
        pp_group, dp_mesh, pp_rank = None, None, ctx.dist.rank
    torch.manual_seed(ctx.options.seed)
    # mixed_*: fp32 weights (FSDP2's shards are the masters), 16-bit compute through the FSDP2 policy; checkpointing
    # (grad_ckpt): transformers' per-layer checkpointing, kept by the decoder layers the stages take over
    training = build_training(spec)
    model = build_model(ctx.config, training, ctx.device)
    model.train()
    if tp_mesh is not None:  # every decoder layer split over the tp ranks before the stage split
        from estimator.profiler.tp import apply_tp

        apply_tp(model, tp_mesh, ctx.config)
    modules, runner = hp.build(model, par.pp, par.virtual_stages, pp_rank, pp_group, ctx.device, par.microbatches,
                               par.pp_schedule, dp_mesh=dp_mesh,
                               mp_policy=fsdp_mp_policy(spec.training) if dp_mesh is not None else None)
    config = model.config
    del model
    params = [p for m in modules for p in m.parameters()]
    if tp_mesh is not None and dp_mesh is None:  # one optimizer per parameter kind (DTensor, plain), as the tp
        # method builds it (under FSDP2 every parameter is a DTensor: one optimizer, as dp_tp builds it)
        from estimator.profiler.tp import build_tp_optimizer

        optimizer = build_tp_optimizer([p for p in params if p.requires_grad], training)
    else:
        optimizer = build_optimizer(params, training)
    mine = hp.stages_of_rank(pp_rank, par.pp, par.virtual_stages)
    num_stages = par.pp * par.virtual_stages
    ctx.notes.append(f"pp: rank {ctx.dist.rank} runs stages {mine} of {num_stages} ({par.pp_schedule}, "
                     f"{par.microbatches} micro-batches per step, all inside the forward phase)")
    return PipelineTrainer(modules, runner, optimizer, 0 in mine, num_stages - 1 in mine, par.microbatches, config)
