"""What FSDP1 holds per rank for answer.ai fsdp_qlora's packed 4-bit weights, on real CPU tensors (gloo, 2 ranks).

    nice .venv/bin/python benchmarks/fsdp1_qlora_packed.py [--hidden 1024] [--inter 2752] [--world 2]

fsdp_qlora (``train.py``) replaces every ``nn.Linear`` of the decoder with bitsandbytes ``Linear4bit(quant_type=
"nf4", quant_storage=bf16)`` (``compress_statistics`` at its default, True: nested absmax), casts the whole model
to bf16 and wraps it in FSDP1 (``use_orig_params=False``, the LoRA leaves and the decoder layers as units). This
builds one such layer (q/k/v/o/gate/up/down packed, two bf16 RMS norm weights), wraps it in FSDP1 and prints, for
rank 0: each packed weight's elements against the unpacked ``numel`` (4-bit values, two per byte, viewed as bf16:
numel / 4 elements), its quant state (not a parameter: FSDP1 neither flattens nor shards it), the flat parameter's
numel and this rank's shard, and that a forward and backward run through the sharded unit (bitsandbytes restores
``weight.quant_state`` from the module after FSDP1 swaps the parameter for a flat-parameter view). No project code.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _layer(hidden: int, inter: int):
    import bitsandbytes as bnb

    shapes = {"q_proj": (hidden, hidden), "k_proj": (hidden, hidden), "v_proj": (hidden, hidden),
              "o_proj": (hidden, hidden), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
              "down_proj": (hidden, inter)}
    layer = torch.nn.Module()
    for name, (out_f, in_f) in shapes.items():
        lin = bnb.nn.Linear4bit(in_f, out_f, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4",
                                quant_storage=torch.bfloat16)
        lin.weight = bnb.nn.Params4bit(torch.randn(out_f, in_f, dtype=torch.bfloat16) / in_f ** 0.5,
                                       requires_grad=False, quant_type="nf4", quant_storage=torch.bfloat16,
                                       compress_statistics=True, module=lin)
        lin.weight._quantize("cpu")  # also sets lin.quant_state, from which bitsandbytes restores it under FSDP1
        setattr(layer, name, lin)
    layer.input_layernorm = torch.nn.Parameter(torch.ones(hidden, dtype=torch.bfloat16), requires_grad=False)
    layer.post_attention_layernorm = torch.nn.Parameter(torch.ones(hidden, dtype=torch.bfloat16),
                                                        requires_grad=False)
    return layer, shapes


def _state_bytes(state) -> int:
    tensors = [state.absmax, state.code, state.offset]
    if state.state2 is not None:
        tensors += [state.state2.absmax, state.state2.code]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _run(rank: int, world: int, hidden: int, inter: int) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    layer, shapes = _layer(hidden, inter)
    lines = []
    packed_total = 0
    for name in PROJECTIONS:
        weight = getattr(layer, name).weight
        numel = shapes[name][0] * shapes[name][1]
        packed_total += weight.numel()
        lines.append(f"{name}: numel {numel}, packed {weight.numel()} {weight.dtype} (numel / "
                     f"{numel / weight.numel():g}), quant state {_state_bytes(weight.quant_state)} B")
    norms = 2 * hidden
    wrapped = FSDP(layer, use_orig_params=False, device_id=torch.device("cpu"))
    flat = wrapped._flat_param  # noqa: SLF001 - the unit's one flat parameter
    x = torch.randn(2, 16, hidden, dtype=torch.bfloat16, requires_grad=True)
    def forward(inp):
        h = wrapped.module.o_proj(wrapped.module.q_proj(inp) + wrapped.module.k_proj(inp) + wrapped.module.v_proj(inp))
        return wrapped.module.down_proj(wrapped.module.gate_proj(h) * wrapped.module.up_proj(h))

    # FSDP1's forward hooks run around the root module's forward: call it through a closure module.
    wrapped.module.forward = forward
    y = wrapped(x)
    y.float().sum().backward()
    if rank == 0:
        print("\n".join(lines))
        print(f"packed elements {packed_total} + norm elements {norms} = {packed_total + norms}; flat parameter "
              f"{flat._unpadded_unsharded_size.numel()} unpadded, shard {flat.numel()} {flat.dtype} on rank 0 "
              f"(world {world}); forward {tuple(y.shape)} {y.dtype}, input gradient {tuple(x.grad.shape)}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inter", type=int, default=2752)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    mp.spawn(_run, args=(args.world, args.hidden, args.inter), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
