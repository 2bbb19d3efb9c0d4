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

    nice .venv/bin/python benchmarks/fsdp1_qlora_packed.py --oracle [--csv FILE]

``--oracle``: the estimator against real CPU FSDP1 ranks at several tiny Llama shapes. Each point builds a
``LlamaForCausalLM`` in bf16, replaces every ``nn.Linear`` of ``model.model`` by ``Linear4bit`` (NF4, nested
absmax, ``quant_storage=bf16``: fsdp_qlora's ``train.py``), adds peft LoRA on q/k/v/o/gate/up/down in bf16
(``autocast_adapter_dtype=False``: peft 0.8-0.10's behaviour on a bf16 model), wraps it as fsdp_qlora does
(``_or_policy``: every leaf with a trainable weight, and each ``LlamaDecoderLayer``; ``use_orig_params=False``,
FULL_SHARD), runs one forward and backward, and counts on each rank every storage the model holds: the flat
parameters' shards, each quant state tensor (deduplicated by storage; in 512-byte blocks, as the CUDA caching
allocator holds them) and buffers; and the padded unsharded size of a decoder layer's flat parameter (what its
all-gather allocates). The estimate: ``estimator.methods.fsdp1`` on the parameter table the profiler records from
the same model before wrapping (``_param_rows``), for that rank.
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


# (hidden, intermediate, layers, heads, kv heads, vocab, LoRA rank): tiny Llama shapes, every projection a
# multiple of the 64-element NF4 block.
ORACLE_POINTS = ((256, 704, 2, 4, 2, 1000, 8), (512, 1376, 2, 8, 4, 2000, 16), (1024, 2752, 2, 16, 8, 3000, 8),
                 (768, 2048, 3, 12, 4, 1500, 64))
BLOCK_BYTES = 512


def _blocks(nbytes: int) -> int:
    return -(-nbytes // BLOCK_BYTES) * BLOCK_BYTES


def _qlora_llama(hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int, r: int):
    """fsdp_qlora's model on CPU: NF4 Linear4bit (bf16 storage) in the decoder, the rest bf16, bf16 LoRA."""
    import bitsandbytes as bnb
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                         max_position_embeddings=256, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    for module in list(model.model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear):
                lin = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=False,
                                        compute_dtype=torch.bfloat16, quant_type="nf4", quant_storage=torch.bfloat16)
                lin.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4",
                                               quant_storage=torch.bfloat16, compress_statistics=True, module=lin)
                lin.weight._quantize("cpu")
                setattr(module, name, lin)
    lora = LoraConfig(r=r, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return get_peft_model(model, lora, autocast_adapter_dtype=False)


def _estimate(model, world: int, rank: int) -> tuple[float, float, float, float]:
    """(weights resident on ``rank``, a decoder layer's unsharded bytes, quant states, the root unit's unsharded
    bytes) from the estimator."""
    import re

    from estimator.methods.fsdp1 import fsdp1, fsdp1_sizes
    from estimator.models.params import _info
    from estimator.profiler.profile import _param_rows
    from estimator.spec import Fsdp1Spec, ParallelSpec, RunSpec, TrainingSpec

    table = []
    for name, _param, row in _param_rows(model):
        match = re.search(r"\.layers\.(\d+)\.", name)
        table.append(_info(row, name, int(match.group(1)) if match else None))
    # qlora is read from the table's 4-bit rows; the spec's LoRA in the model's dtype is fsdp_qlora's adapters
    spec = RunSpec(model="x", parallel=ParallelSpec(method="fsdp1", world_size=world,
                                                    fsdp1=Fsdp1Spec(use_orig_params=False)),
                   training=TrainingSpec(precision="bf16", lora_rank=8, lora_dtype="model"))
    sizes = fsdp1_sizes(spec, table, rank)
    return (fsdp1(spec, table, rank).resident["weights"], sizes.layer.unsharded_bytes, sizes.quant_state_bytes,
            sizes.root.unsharded_bytes)


def _oracle_rank(rank: int, world: int, point: tuple, port: int, out: str) -> None:
    import functools
    import json

    import bitsandbytes as bnb
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import _or_policy, lambda_auto_wrap_policy, transformer_auto_wrap_policy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = _qlora_llama(*point)
    estimate = _estimate(model, world, rank)

    def trainable_leaf(module):  # fsdp_qlora's (and peft's) lambda policy
        return (not list(module.named_children()) and getattr(module, "weight", None) is not None
                and module.weight.requires_grad)
    policy = functools.partial(_or_policy, policies=[
        functools.partial(lambda_auto_wrap_policy, lambda_fn=trainable_leaf),
        functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})])
    wrapped = FSDP(model, auto_wrap_policy=policy, use_orig_params=False, device_id=torch.device("cpu"),
                   limit_all_gathers=True)
    ids = torch.randint(0, point[5], (1, 32))
    wrapped(input_ids=ids, labels=ids).loss.backward()
    handles = [m._handle for m in FSDP.fsdp_modules(wrapped) if m._handle is not None]  # noqa: SLF001
    shards = sum(h.flat_param.numel() * h.flat_param.element_size() for h in handles)
    def unsharded(h) -> int:
        return h.flat_param._padded_unsharded_size.numel() * h.flat_param.element_size()  # noqa: SLF001
    layer_unsharded = max(unsharded(m._handle) for m in FSDP.fsdp_modules(wrapped)  # noqa: SLF001
                          if isinstance(m.module, LlamaDecoderLayer))
    root_unsharded = unsharded(wrapped._handle)  # noqa: SLF001 - embeddings, final norm, head
    states, seen = 0, set()
    for module in wrapped.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            state = module.quant_state
            tensors = [state.absmax, state.code, state.offset, state.state2.absmax, state.state2.code]
            for t in tensors:
                if t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    states += _blocks(t.untyped_storage().nbytes())
    buffers = sum(b.numel() * b.element_size() for b in wrapped.buffers())
    row = {"hidden": point[0], "inter": point[1], "layers": point[2], "vocab": point[5], "lora_r": point[6],
           "world": world, "rank": rank, "measured_weights_bytes": shards + states,
           "estimated_weights_bytes": estimate[0], "measured_layer_unsharded_bytes": layer_unsharded,
           "estimated_layer_unsharded_bytes": estimate[1], "measured_root_unsharded_bytes": root_unsharded,
           "estimated_root_unsharded_bytes": estimate[3], "measured_quant_state_bytes": states,
           "estimated_quant_state_bytes": estimate[2], "buffers_bytes": buffers}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(row, f)
    dist.destroy_process_group()


def oracle(world: int, csv_path: str | None) -> None:
    import csv
    import json
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for k, point in enumerate(ORACLE_POINTS):
            out = os.path.join(tmp, f"point{k}")
            mp.spawn(_oracle_rank, args=(world, point, 29530 + k, out), nprocs=world, join=True)
            for rank in range(world):
                with open(f"{out}.{rank}") as f:
                    rows.append(json.load(f))
    for row in rows:
        for what in ("weights", "layer_unsharded", "root_unsharded", "quant_state"):
            m, e = row[f"measured_{what}_bytes"], row[f"estimated_{what}_bytes"]
            row[f"{what}_error_pct"] = round(100 * (e - m) / m, 3)
    fields = list(rows[0])
    lines = [",".join(fields)] + [",".join(str(row[f]) for f in fields) for row in rows]
    print("\n".join(lines))
    if csv_path:
        with open(csv_path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inter", type=int, default=2752)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--oracle", action="store_true", help="the estimate against real CPU FSDP1 ranks")
    parser.add_argument("--csv", help="--oracle: write the error table here")
    args = parser.parse_args()
    if args.oracle:
        oracle(args.world, args.csv)
        return
    mp.spawn(_run, args=(args.world, args.hidden, args.inter), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
