"""Context parallelism in the harness (``parallel.cp > 1``, method fsdp): torch's ``context_parallel`` as
torchtitan runs it, with FSDP2 over every rank (dp x cp).

* Meshes: FSDP2 shards over the world's 1-D mesh (torchtitan's flattened ``dp_shard_cp``); ring attention runs
  over the ``cp`` axis of a (dp, cp) mesh (consecutive ranks form one cp group).
* Each micro-batch (full rows only: CP takes no attention mask) enters ``context_parallel(cp_mesh, buffers=
  [input_ids, shift_labels, position_ids], buffer_seq_dims=[1, 1, 1])`` for its forward *and* backward (the
  backward's SDPA ops are dispatched to the ring only inside it): the head-tail load balancer reorders the
  sequence, each rank keeps seq_len / cp tokens, SDPA becomes ring attention (all-gather rotation). Labels are
  shifted over the whole sequence first and passed as ``shift_labels`` (transformers' loss would otherwise shift
  inside each rank's chunks); positions are passed explicitly (the model would number the local tokens 0..).
* GPUs only: on CPU tensors SDPA dispatches ``aten._scaled_dot_product_flash_attention_for_cpu``, which CP has
  no handler and DTensor no sharding rule for ("does not have a sharding strategy registered"); the CPU oracle
  is ``harness.fake.context_parallel`` (fake tensors).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from harness.methods.base import TorchTrainer

IGNORE_INDEX = -100


def check_device(device: torch.device, emulated: bool) -> None:
    if emulated or device.type != "cuda":
        raise ValueError("cp: torch's ring attention runs the CUDA SDPA kernels only (flash, memory-efficient, "
                         "cuDNN); on CPU, aten._scaled_dot_product_flash_attention_for_cpu has no context-parallel "
                         "handler nor sharding rule: run on GPUs (the CPU oracle is harness.fake.context_parallel)")


def cp_mesh(device_type: str, world_size: int, cp: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (world_size // cp, cp), mesh_dim_names=("dp", "cp"))["cp"]


def cp_buffers(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors ``context_parallel`` shards: ids, labels shifted over the whole sequence, positions.
    ValueError for a padded batch (ring attention takes no mask)."""
    mask = batch.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError("cp: context parallelism takes full rows only (no attention mask); use data with "
                         "full_rows or packed rows")
    ids = batch["input_ids"]
    labels = batch.get("labels", ids)
    shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    positions = torch.arange(ids.size(1), device=ids.device).unsqueeze(0).expand_as(ids).contiguous()
    return {"input_ids": ids.contiguous(), "shift_labels": shifted.contiguous(), "position_ids": positions}


class ContextParallelTrainer(TorchTrainer):
    """``TorchTrainer`` whose forward and backward run inside ``context_parallel`` for the micro-batch."""

    def __init__(self, *args: Any, mesh: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.mesh = mesh
        self._context: contextlib.ExitStack | None = None

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        from torch.distributed.tensor.experimental import context_parallel

        buffers = cp_buffers(batch)
        tensors = list(buffers.values())
        self._context = contextlib.ExitStack()
        self._context.enter_context(context_parallel(self.mesh, buffers=tensors, buffer_seq_dims=[1] * len(tensors),
                                                     no_restore_buffers=set(tensors)))
        local = {"input_ids": buffers["input_ids"], "position_ids": buffers["position_ids"],
                 "labels": buffers["shift_labels"], "shift_labels": buffers["shift_labels"]}
        return super().forward(local)

    def backward(self, loss: torch.Tensor, scale: float = 1.0) -> None:
        try:
            super().backward(loss, scale)
        finally:
            if self._context is not None:
                self._context.close()
                self._context = None
