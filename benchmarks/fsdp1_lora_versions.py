"""FSDP1 LoRA's growth per sample against one GPU's, under whichever torch / transformers / peft this interpreter has.

    python3 -m venv /tmp/v241 && /tmp/v241/bin/pip install torch==2.4.1 transformers==4.45.2 peft==0.13.2
    /tmp/v241/bin/python benchmarks/fsdp1_lora_versions.py [--seq-len 256] [--vocab-size 1024] [--layers 8]

(PyPI's torch 2.4.1 is its CUDA build, about 3 GB with its libraries; it runs on the CPU.)
Measured 2026-11-27 (docs/LOG.md, session 24), torch 2.4.1 / transformers 4.45.2, peak and growth per sample:
one GPU reentrant 23,907,608 B, +7,249,920; FSDP1 x 2 reentrant 19,427,864, +8,036,352; FSDP1 x 2 non-reentrant
18,301,464, +7,118,848. Under the project's torch 2.13 / transformers 5.24 reentrant and non-reentrant FSDP1 grow
alike (+7,118,848 / +6,987,776, the same as one GPU). With --vocab-size 32000 (the loss sets the peak) one GPU and
FSDP1 x 2 grow alike under 2.4.1 too (+99,756,016).

``benchmarks/fsdp1_lora_per_sample.py`` answers the question with the harness (torch 2.13 only). This script
needs no project code, so an interpreter with the software of a published run (fms-acceleration's rows: torch
2.4.1, transformers 4.44-4.48, peft 0.12-0.13, accelerate 0.33-1.0) can run it: a tiny Mistral, LoRA r 8 on
q, k, v, o (dropout 0.1), pure bf16, reentrant checkpointing with the inputs made to require grad (TRL's
SFTTrainer, the Trainer's default ``use_reentrant``), FSDP1 as accelerate wraps it (peft's
``fsdp_auto_wrap_policy``, use_orig_params, FULL_SHARD, BACKWARD_PRE, limit_all_gathers) on torch's fake process
group, and the Trainer's step (loss from the model, output object dropped before backward, AdamW, zero_grad to
None). The peak is that of the bytes of every live CPU storage, read at every operator (a dispatch mode), over
two steps after a warm-up step. Each point runs in its own interpreter. The dispatch mode restates
``harness.fake.live_storage.LiveStorages``: that module imports the project, whose dependencies the old
software's environment lacks.
"""

from __future__ import annotations

import json
import subprocess
import sys

_HEAD = r"""
import functools, gc, json, sys, weakref
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
import transformers, peft

config, world, b, s, reentrant = json.loads(sys.argv[1])
torch.manual_seed(0)


class Live(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.storages, self.peak = {}, 0

    def add(self, t):
        if t.device.type != "cpu":
            return
        st = t.untyped_storage()
        key = st._cdata
        if key not in self.storages:
            self.storages[key] = weakref.ref(st, lambda _r, key=key: self.storages.pop(key, None))

    def live(self):
        return sum(x.nbytes() for r in list(self.storages.values()) if (x := r()) is not None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten((out, args, kwargs))[0]:
            if isinstance(item, torch.Tensor):
                self.add(item)
        self.peak = max(self.peak, self.live())
        return out


cfg = transformers.MistralConfig(**{k: v for k, v in config.items() if k not in ("model_type", "architectures")})
cfg.use_cache = True
model = transformers.MistralForCausalLM(cfg).to(torch.bfloat16)
model.enable_input_require_grads()  # TRL's SFTTrainer with peft and reentrant checkpointing
model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1,
                                                   target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                                   task_type="CAUSAL_LM"))
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": bool(reentrant)})
model.train()
if world > 1:
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy, BackwardPrefetch
    from peft.utils.other import fsdp_auto_wrap_policy
    dist.init_process_group("fake", rank=world - 1, world_size=world, store=FakeStore())
    model = FSDP(model, auto_wrap_policy=fsdp_auto_wrap_policy(model), use_orig_params=True,
                 sharding_strategy=ShardingStrategy.FULL_SHARD, backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
                 forward_prefetch=False, limit_all_gathers=True, device_id=torch.device("cpu"))
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
"""

_TAIL = r"""

ids = torch.randint(0, cfg.vocab_size, (b, s))
step(ids)
gc.collect()
mode = Live()
for obj in gc.get_objects():
    if isinstance(obj, torch.Tensor) and not obj.is_meta:
        mode.add(obj)
mode.peak = mode.live()
with mode:
    step(ids)
    step(ids)
print(mode.peak)
"""


def peak_bytes(config: dict, world: int, batch: int, seq_len: int, reentrant: bool) -> int:
    from training_step_source import with_training_step  # its sibling, as in main

    done = subprocess.run([sys.executable, "-c", with_training_step(_HEAD, _TAIL), json.dumps([config, world, batch, seq_len, reentrant])],
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"point world={world} b={batch} failed: {done.stderr.strip().splitlines()[-1]}")
    return int(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    # its sibling's arguments and config (this file's directory is on sys.path when run as a script)
    from fsdp1_lora_per_sample import point_arguments

    args, config = point_arguments(argv, __doc__.split("\n\n")[0])
    import torch
    import transformers
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    print("case | peak b1 (B) | peak b2 (B) | per sample (B)")
    for world in (1, 2):
        for reentrant in (True, False):
            b1, b2 = (peak_bytes(config, world, b, args.seq_len, reentrant) for b in (1, 2))
            name = ("one GPU" if world == 1 else "FSDP1 x2") + (", reentrant" if reentrant else ", non-reentrant")
            print(f"{name} | {b1:,} | {b2:,} | {b2 - b1:,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
