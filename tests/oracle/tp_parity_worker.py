"""Real (non-fake) TP check, run under torchrun with 2 gloo ranks: for each family, the losses of 3 AdamW steps
with ``harness.tp.apply_tp`` must match a single-process run of the same model and batch.

    python -m torch.distributed.run --nproc_per_node 2 tests/oracle/tp_parity_worker.py OUT.json llama opt ...

A family name may carry ``:lora`` (LoRA rank 4 on every linear, lora_B randomised). Rank 0 writes
``{name: {"tp": [losses], "single": [losses], "local_numel": int, "full_numel": int}}``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from estimator.profiler.build import build_model, synthetic_batch  # noqa: E402
from estimator.spec import ParallelSpec, RunSpec, TrainingSpec  # noqa: E402
from harness.fake.wrap import build_method_optimizer  # noqa: E402
from harness.tp import apply_tp  # noqa: E402
from tests.oracle.tiny import tiny_config  # noqa: E402

STEPS = 3
LR = 1e-3


def run(model, spec, batch, training) -> list[float]:
    opt = build_method_optimizer(model, spec, lr=LR)
    losses = []
    for _ in range(STEPS):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def local_numel(model) -> int:
    return sum((getattr(p, "_local_tensor", None) if hasattr(p, "_local_tensor") else p).numel()
               for p in model.parameters())


def main() -> None:
    out_path, families = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    base_training = TrainingSpec(micro_batch_size=2, seq_len=32, precision="fp32", attn="eager")
    result = {}
    for name in families:
        family, _, variant = name.partition(":")
        training = base_training
        if variant == "lora":  # every linear LoRA-wrapped: colwise and rowwise targets
            training = dataclasses.replace(base_training, lora_rank=4, lora_targets="all-linear")
        config = tiny_config(family, num_layers=2)
        torch.manual_seed(0)
        model = build_model(config, training, "cpu")
        if variant == "lora":  # peft zero-inits lora_B; give it values so that the A/B split is exercised
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if "lora_B" in n:
                        p.normal_(0, 0.02)
        reference = copy.deepcopy(model)
        torch.manual_seed(1)
        batch = synthetic_batch(2, 32, config["vocab_size"], "cpu")
        full = sum(p.numel() for p in model.parameters())
        apply_tp(model, mesh, config)
        tp_spec = RunSpec(model="x", parallel=ParallelSpec(method="tp", world_size=world, tp=world),
                          training=training)
        tp_losses = run(model, tp_spec, batch, training)
        single = run(reference, RunSpec(model="x", training=training), batch, training)
        result[name] = {"tp": tp_losses, "single": single, "local_numel": local_numel(model), "full_numel": full}
    if dist.get_rank() == 0:
        with open(out_path, "w") as fh:
            json.dump(result, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
