"""Rows from microsoft/DeepSpeedExamples DeepSpeed-Chat's published step-1 training log (OPT-1.3b, ZeRO-2, 16 x V100).

``training/README.md`` (8df4a0cb, 2023-04-21): "our training logs for all three steps for an OPT-1.3b actor and
OPT-350m critic trained with x16-V100-32GB GPUs". Only step 1 (supervised fine-tuning of a causal LM) is a
fine-tuning step the estimator models; steps 2-3 train a reward model and run RLHF and are not rows.

What the numbers mean, from DeepSpeed-Chat's code at the commit that added the log (3a77097a, 2023-04-21; the log
is of 2023-04-18): ``training/step1_supervised_finetuning/main.py``, ``training/utils/ds_utils.py``,
``training/utils/data/data_utils.py``, ``training/utils/model/model_utils.py`` (not copied; their values are here):

* the log's first line is the command: ``--model_name_or_path facebook/opt-1.3b --per_device_train_batch_size 8
  --max_seq_len 512 --gradient_accumulation_steps 1 --zero_stage 2 --deepspeed``; no ``--gradient_checkpointing``,
  no ``--lora_dim`` (0: full fine-tuning), no ``--offload``, no ``--disable_dropout`` (OPT's dropout 0.1 stays).
* ``get_train_ds_config``: ZeRO stage 2 with every bucket and overlap setting at DeepSpeed's defaults (the dict
  sets only stage-3 and offload keys), ``fp16: enabled`` (the log's loss-scale OVERFLOW lines), so DeepSpeed's
  fp16 engine: fp16 weights, fp32 master weights and Adam states partitioned over the 16 ranks.
* optimizer: ``deepspeed.ops.adam.FusedAdam`` (multi-tensor, in place) over two parameter groups, weight decay 0.
* data: every sample tokenized with ``padding="max_length", max_length=max_seq_len, truncation=True``: every row
  is 512 tokens, with an attention mask that marks the padding.
* the loop: ``outputs = model(**batch, use_cache=False)``, ``loss = outputs.loss``, ``model.backward(loss)``,
  ``model.step()``: the output object is bound through backward and the step (``loop=manual``).
* the figure: DeepSpeed's ``ThroughputTimer`` prints every 10 steps on rank 0
  ``MaxMemAllocated={round(max_memory_allocated() / 1024**3, 2)}GB`` (GiB, labelled GB), never reset: the peak
  since the process started (model load, the perplexity evaluation before epoch 1, training); all 736 readings of
  the 16 epochs say 22.95.
* model code: ``transformers`` from git main (requirements.txt: ``git+https://github.com/huggingface/transformers``,
  April 2023: 4.29.0.dev0), ``deepspeed>=0.9.0``, ``torch>=1.12.0``. No profile of that release's model code can
  be traced here: the profiler traces releases from 4.44, and 4.44's OPT draws LayerDrop's probability with
  ``torch.rand([]) < layerdrop`` unguarded (a data-dependent branch on fake tensors; 5.x skips it when layerdrop
  is 0), so the estimate uses the shipped release's OPT code and says so: eager attention as in 4.29 (fp32
  softmax of fp16 scores), but the loss upcasts the fp16 logits to fp32 where 4.29 takes a shifted fp16 copy
  and an fp16 cross-entropy.
Standard library only.
"""

from __future__ import annotations

import re

from common import SOURCES, manifest, ref, row

SOURCE = "deepspeed_chat"
CODE_REF = "microsoft/DeepSpeedExamples@3a77097a7b6ce67b78ea7c05129b90915cfebbb0:applications/DeepSpeed-Chat/training"
MODELS = {"facebook/opt-1.3b": "facebook/opt-1.3b"}
WORLD = 16          # training/README.md: x16-V100-32GB


def _arg(cmd: str, name: str) -> str | None:
    found = re.search(rf"--{name}(?:\s+([^\s-][^\s]*))?", cmd)
    if not found:
        return None
    return found.group(1) or ""


def extract() -> list[dict]:
    rows = []
    entries = manifest(SOURCE)
    readme = next(e for e in entries.values() if e["path"].endswith("training/README.md"))
    readme_text = (SOURCES / SOURCE / readme["file"]).read_text()
    if "x16-V100-32GB" not in readme_text:
        raise ValueError("training/README.md no longer names the logs' GPUs")
    for local, entry in sorted(entries.items()):
        if not entry["path"].endswith(".log"):
            continue
        text = (SOURCES / SOURCE / local).read_text()
        cmd = text.splitlines()[0]
        peaks = {float(v) for v in re.findall(r"MaxMemAllocated=([0-9.]+)GB", text)}
        hub = _arg(cmd, "model_name_or_path")
        batch, seq = int(_arg(cmd, "per_device_train_batch_size")), int(_arg(cmd, "max_seq_len"))
        accum, stage = int(_arg(cmd, "gradient_accumulation_steps")), int(_arg(cmd, "zero_stage"))
        ckpt = _arg(cmd, "gradient_checkpointing") is not None
        lora = int(_arg(cmd, "lora_dim") or 0)
        out = []
        if lora:
            out.append("DeepSpeed-Chat's own LoRA layers")
        if _arg(cmd, "offload") is not None:
            out.append("ZeRO offload")
        model = MODELS.get(hub)
        if model is None:
            out.append(f"{hub} is not in the catalogue")
        notes = [f"code semantics: {CODE_REF} (main.py, utils/ds_utils.py, utils/data/data_utils.py, "
                 "utils/model/model_utils.py)", f"command (the log's first line): {cmd.removeprefix('cmd = ')}",
                 "16 ranks: training/README.md's x16-V100-32GB (the log does not print the world size; global batch "
                 f"128 = {batch} x 16 x {accum} as the file name says)",
                 "DeepSpeed fp16 engine (ds_config fp16 enabled): fp16 weights, fp32 master weights and Adam states "
                 "partitioned; ZeRO buckets and overlap at DeepSpeed's defaults",
                 "optimizer: DeepSpeed FusedAdam (adamw_fused: in place, no foreach temporaries)",
                 "every row padded to max_seq_len (padding='max_length') with its attention mask (batch=padded)",
                 "OPT dropout 0.1 kept (no --disable_dropout); eager attention (transformers of April 2023)",
                 "transformers 4.29.0.dev0 (git main) has no traceable profile here (4.44's OPT LayerDrop draw is "
                 "data-dependent): the shipped release's OPT code is estimated (its loss upcasts the fp16 logits); "
                 "DeepSpeed >= 0.9.0 unpinned (the estimator follows DeepSpeed 0.19's ZeRO allocations)",
                 "every MaxMemAllocated reading of the run is the same (max_memory_allocated/1024**3, "
                 "labelled GB: GiB)"]
        if len(peaks) != 1:
            raise ValueError(f"{local}: the log's MaxMemAllocated readings differ: {sorted(peaks)}")
        peak = peaks.pop()
        rows.append(row(
            row_id=f"{SOURCE}:step1:{hub.rsplit('/', 1)[1]}:zero{stage}:x{WORLD}:b{batch}:s{seq}", source=SOURCE,
            source_ref=ref(entry), source_table="DeepSpeed ThroughputTimer lines (rank 0)",
            source_key=f"MaxMemAllocated={peak}GB", model=model or hub, gpu="v100-32gb",
            method=f"zero{stage}", world_size=WORLD, micro_batch_size=batch, seq_len=seq, precision="mixed_fp16",
            optimizer="adamw_fused", grad_ckpt=ckpt, attn="eager", lora_rank=lora, grad_accum_steps=accum,
            loop="manual", batch="padded", use_cache=False, model_hub_id=hub,
            framework="DeepSpeed-Chat step 1 (3a77097a; custom loop, DeepSpeed engine, transformers model)",
            adapter="lora" if lora else "full", padding="max_length", max_length=seq, seq_len_basis="longest_sample",
            lengths=f"every sample padded to {seq} tokens", rescore_lengths=False,
            transformers_version="4.29.0.dev0", deepspeed_version="",
            other_versions="transformers from git main (April 2023); deepspeed>=0.9.0; torch>=1.12.0",
            quantity="max_allocated", scope="per_gpu", value=peak,
            unit="GiB", complete=True, in_scope=not out,
            assumptions="; ".join(notes + ([f"not expressible: {'; '.join(out)}"] if out else []))))
    return rows
