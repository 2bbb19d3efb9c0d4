"""Rows from ms-swift's v1 training benchmark (modelscope/ms-swift ``docs/source_en/LLM/Benchmark.md``).

The page's numbers were added on 2024-01-04 (4312aeb2, "GPU Memory (GiB)" per table row); what they mean comes
from the code of that time (97e4d198, 2024-01-02, and ``scripts/benchmark/test_memory_time/run_single.py``):

* ``Seq2SeqTrainer.train`` records ``torch.cuda.max_memory_reserved(i) / 1024**3`` for every visible device
  after training (``swift/trainers/trainers.py``): max reserved per GPU, GiB. Rows on "2*A100" are a
  device_map split of the model over two GPUs (one value per GPU, ``a+b``): summed, out of scope.
* ``swift sft`` on ``cls-fudan-news-zh`` with the page's defaults: ``max_length 2048``, ``batch_size 1``,
  gradient checkpointing and flash attention on, LoRA r=8 on the model type's DEFAULT modules (Llama-family
  ``q_proj,k_proj,v_proj``), no quantization, gradient accumulation 16; ``dtype AUTO`` -> bf16 weights with the
  HF Trainer's bf16 autocast; ``optim adamw_torch``; HF Trainer loop (``loop=trainer``).
* ``truncation_strategy`` defaults to ``delete``: samples longer than ``max_length`` are dropped, batches of one
  sample are not padded. The page gives the lengths (Qwen tokenizer): 3234.4 +- 2547.5 tokens, min 91, max 19548,
  so the longest kept sample is taken to reach ``max_length`` (``data/public/lengths/ms_swift_cls_fudan_news_zh.json``).
The A100 is the 80 GB board: single-GPU peaks reach 78.72 GiB. Standard library only.
"""

from __future__ import annotations

import re

from common import SOURCES, manifest, ref, row

SOURCE = "ms_swift_benchmark"
DEFAULTS = {"max_length": 2048, "batch_size": 1, "gradient_checkpointing": True, "use_flash_attn": True,
            "lora_rank": 8, "lora_target_modules": "DEFAULT", "lora_dropout_p": 0.05, "quantization": "bf16",
            "gradient_accumulation_steps": 16}
# Table header -> argument it varies.
VARIED = {"Max Length": "max_length", "Batch Size": "batch_size", "Use Flash Attn": "use_flash_attn",
          "Gradient Checkpointing": "gradient_checkpointing", "LoRA Rank": "lora_rank",
          "LoRA Target Modules": "lora_target_modules", "Quantization": "quantization",
          "Gradient Accumulation Steps": "gradient_accumulation_steps"}
# swift model_type -> (hub id, catalogue model or None with the reason, DEFAULT LoRA targets in transformers names)
MODELS = {"yi-6b-chat": ("01-ai/Yi-6B-Chat", "01-ai/Yi-6B-Chat", "k_proj,q_proj,v_proj"),
          "yi-34b-chat": ("01-ai/Yi-34B-Chat", None, ""), "openbuddy-zephyr-7b-chat":
          ("OpenBuddy/openbuddy-zephyr-7b-v14.1", None, ""), "qwen-1_8b-chat": ("Qwen/Qwen-1_8B-Chat", None, ""),
          "qwen-7b-chat": ("Qwen/Qwen-7B-Chat", None, ""), "qwen-14b-chat": ("Qwen/Qwen-14B-Chat", None, ""),
          "qwen-72b-chat": ("Qwen/Qwen-72B-Chat", None, ""), "chatglm3-6b": ("THUDM/chatglm3-6b", None, ""),
          "baichuan2-7b-chat": ("baichuan-inc/Baichuan2-7B-Chat", None, ""),
          "baichuan2-13b-chat": ("baichuan-inc/Baichuan2-13B-Chat", None, "")}
WHY_NOT = {"01-ai/Yi-34B-Chat": "no published config.json of Yi-34B found in the stored material",
           "OpenBuddy/openbuddy-zephyr-7b-v14.1": "no published config.json (extended vocabulary) found"}
LENGTHS = "data/public/lengths/ms_swift_cls_fudan_news_zh.json"


def html_tables(text: str) -> list[tuple[str, list[dict]]]:
    """Every <table> as (nearest heading path, rows as {header: cell}), rowspans expanded."""
    out, heading = [], []
    for block in re.split(r"(<table>.*?</table>)", text, flags=re.S):
        if not block.startswith("<table>"):
            for level, title in re.findall(r"^(#+) (.+)$", block, flags=re.M):
                heading = heading[:len(level) - 2] + [title.strip()]
            continue
        rows = [re.findall(r"<td([^>]*)>(.*?)</td>", tr, flags=re.S) for tr in re.findall(r"<tr>(.*?)</tr>",
                                                                                          block, flags=re.S)]
        header = [cell.strip() for _, cell in rows[0]]
        pending: dict[int, list] = {}
        body = []
        for cells in rows[1:]:
            values, queue = [], list(cells)
            for col in range(len(header)):
                if pending.get(col, [0])[0] > 0:
                    pending[col][0] -= 1
                    values.append(pending[col][1])
                elif queue:
                    attrs, cell = queue.pop(0)
                    span = re.search(r'rowspan="(\d+)"', attrs)
                    if span:
                        pending[col] = [int(span.group(1)) - 1, cell.strip()]
                    values.append(cell.strip())
            body.append(dict(zip(header, values)))
        out.append((" / ".join(heading), body))
    return out


def _row(entry: dict, heading: str, cells: dict) -> dict | None:
    memory = cells.get("GPU Memory (GiB)", "")
    if not re.fullmatch(r"[0-9.]+(\+[0-9.]+)*", memory):
        return None  # OOM: not a measurement
    label = cells[next(k for k in cells if k.startswith("Model Type"))]
    model_type = label.split(" ")[0]
    full = "[FULL]" in " ".join(cells) or heading.endswith("Full")
    args = dict(DEFAULTS)
    for header, name in VARIED.items():
        if header in cells:
            args[name] = cells[header]
    hub, model, default_targets = MODELS[model_type]
    two_gpus = "2*A100" in label or "2*A100" in cells.get("Training Speed (samples/s)", "") or "+" in memory
    quant = str(args["quantization"])
    out = [] if model else [WHY_NOT.get(hub, f"{hub} needs remote code (trust_remote_code): not an architecture "
                                             "transformers supports natively")]
    if two_gpus:
        out.append("model split over 2 GPUs with device_map (naive pipeline), one value per GPU")
    if quant != "bf16":
        out.append(f"quantization {quant}")
    targets = str(args["lora_target_modules"])
    if not full and targets != "DEFAULT" and model:
        out.append(f"LoRA targets {targets}")
    flag = {"True": True, "False": False, True: True, False: False, "&#x2714;": True, "&#x2718;": False}
    value = sum(float(v) for v in memory.split("+"))
    return row(
        row_id=f"{SOURCE}:{heading.split(' / ')[-1]}:{label}:" + ",".join(f"{VARIED_KEY}={cells[h]}"
                                                                      for h, VARIED_KEY in VARIED.items()
                                                                      if h in cells).replace(" ", ""),
        source=SOURCE, source_ref=ref(entry), source_table=heading,
        source_key=" | ".join(cells.values()), model=model or hub, gpu="a100-80gb",
        method="single", world_size=1, micro_batch_size=int(args["batch_size"]), seq_len=int(args["max_length"]),
        precision="bf16", optimizer="adamw", grad_ckpt=flag[args["gradient_checkpointing"]],
        attn="flash" if flag[args["use_flash_attn"]] else "eager",
        lora_rank=0 if full else int(args["lora_rank"]), lora_targets=default_targets if not full and model
        else "auto", lora_dropout=0.0 if full else float(args["lora_dropout_p"]), qlora=False, grad_accum_steps=int(args["gradient_accumulation_steps"]), loop="trainer",
        outputs_fp32=True,  # the Trainer's bf16 runs through accelerate's forward wrapper (no effect: trainer loop)
        model_hub_id=hub, framework="ms-swift v1 (HF Seq2SeqTrainer, swift LoRA tuner)",
        adapter="full" if full else "lora", padding="longest", max_length=int(args["max_length"]),
        seq_len_basis="max_length_cap", lengths=LENGTHS, rescore_lengths=True, torch_version="2.1.1",
        other_versions="CUDA 11.8; flash_attn 2.3.4; transformers >=4.33,<4.37 and peft 0.7.x (requirements at "
                       "97e4d198)", bitsandbytes_version="0.41.3.post2",
        quantity="max_reserved", scope="sum" if two_gpus else "per_gpu", value=value, unit="GiB",
        complete=True, in_scope=not out,
        assumptions="; ".join(
            ["value = torch.cuda.max_memory_reserved() after trainer.train(), GiB",
             "seq_len = max_length: truncation_strategy 'delete' drops longer samples; the dataset's lengths "
             "(3234 +- 2548, max 19548 Qwen tokens) put kept samples up to the cap",
             "bf16 weights + HF Trainer bf16 autocast; LoRA adapters as swift/peft create them (fp32)",
             "attention: use_flash_attn -> flash_attention_2",
             "use_cache false: swift/llm/sft.py sets model.config.use_cache = False with gradient checkpointing"]
            + ([f"not expressible: {'; '.join(out)}"] if out else [])))


def extract() -> list[dict]:
    rows = []
    for local, entry in sorted(manifest(SOURCE).items()):
        for heading, table in html_tables((SOURCES / SOURCE / local).read_text()):
            if not table or not any(k.startswith("Model Type") for k in table[0]):
                continue  # Tuners/Sequence Parallel tables: other layouts, other tools
            rows += [r for r in (_row(entry, heading, cells) for cells in table) if r]
    return rows
