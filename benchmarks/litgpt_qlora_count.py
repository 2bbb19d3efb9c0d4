"""LitGPT's QLoRA rows (tutorials/resource-tables.md, LitGPT 8641822) counted from the same table's LoRA rows: what
Lightning's QLoRA changes in a step whose LoRA peak is published, with the catalogue configs.

    PYTHONPATH=. .venv/bin/python benchmarks/litgpt_qlora_count.py

Read at the rows' commits (no project code runs them):
- LitGPT 8641822 ``finetune/lora.py``: ``BitsandbytesPrecision("nf4-dq", torch.bfloat16)`` (no ``ignore_modules``),
  the model built under ``fabric.init_module``, ``bnb.optim.PagedAdamW`` for the adapters; one quantized step is
  the LoRA row's step with the same shapes (Llama-2 b1, the longest Alpaca sample: 1,304 tokens).
- Lightning 71aed751 (LitGPT's pin) ``fabric/plugins/precision/bitsandbytes.py``: ``init_context`` replaces the
  class ``torch.nn.Linear`` by the 4-bit one under a bf16 default dtype, so every Linear is NF4 with double
  quantization, the LM head included; norms, embedding and adapters stay bf16 (no fp32 cast, unlike peft's
  ``prepare_model_for_kbit_training``). ``_quantize_weight`` quantizes ``weight.to(torch.half)``.
- bitsandbytes 0.41.1 (18e827d6) ``MatMul4Bit.forward``: ``ctx.tensors = (A, B)`` keeps every 4-bit Linear's
  input for a backward that never reads it (dropped in 0.43.2, 9e753741, "fix QLoRA mem bug", #1270); its
  forward and backward dequantize the weight to the quantized dtype (fp16) and cast that to the input's (bf16).

So, from the LoRA row's peak: less the Linears' bf16 weights over their NF4 double-quant bytes (0.5 B packed,
1/64 B of 8-bit absmax per 64-block, 4/(64 x 256) B of fp32 second-level absmax); plus the inputs MatMul4Bit keeps
that the bf16 LoRA step does not (frozen nn.Linear keeps no input: the attention and MLP norm outputs, the
attention output reshaped for the projection, the MLP's gated product; fc_1 and fc_2 share one input); plus,
where the peak meets a 4-bit matmul, the largest dequantized weight twice (fp16, then its bf16 cast): the LM head's,
which every 128-token chunk dequantizes in forward and backward.

Measured 2026-11-28 (this script):

| model | LoRA published | - weights | + kept inputs | count | + head dequant | count | QLoRA published |
|---|---|---|---|---|---|---|---|
| Llama-2-7b-hf | 19.84 | 9.132 | 1.811 | 12.52 (-2.9 %) | 0.488 | 13.00 (+0.9 %) | 12.89 |
| Llama-2-13b-hf | 35.50 | 17.764 | 2.835 | 20.57 (-2.0 %) | 0.610 | 21.18 (+0.9 %) | 21.00 |

(GiB.) Scored as peft's recipe (head, norms and embedding fp32, an fp32 residual stream, fp32 adapters,
bitsandbytes >= 0.43.2's MatMul4Bit) the rows were +19.0 / +17.6 %; with the recipe modelled (session 33:
``qlora_quantizer lightning``, ``qlora_bnb 0.41.1``) -9.4 / -8.8 %, the rest being LitGPT's model code (its LoRA
rows -2.9 / -2.8 %, the chunked head's dequantized copies).
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3
NF4_DQ_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)
BF16 = 2
ROWS = {"meta-llama/Llama-2-7b-hf": "Llama2-7B", "meta-llama/Llama-2-13b-hf": "Llama2-13B"}


def linear_params(config: dict) -> int:
    """Parameters of every nn.Linear of a Llama config: q, k, v, o, gate, up, down per layer and the LM head."""
    hidden, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    kv = hidden * config.get("num_key_value_heads", config["num_attention_heads"]) // config["num_attention_heads"]
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter
    return layers * per_layer + config["vocab_size"] * hidden


def kept_input_bytes(config: dict, tokens: int) -> int:
    """The bf16 inputs bitsandbytes < 0.43.2 keeps that the LoRA step does not: per layer the two norm outputs,
    the attention output and the MLP's gated product (the head's input, one b x s x hidden per step, is left out)."""
    hidden, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    return (3 * hidden + inter) * BF16 * layers * tokens


def main() -> int:
    from estimator.models.arch import resolve_arch

    with open(ROOT / "data" / "public" / "measurements.csv") as handle:
        rows = {r["row_id"]: r for r in csv.DictReader(handle) if r["source"] == "litgpt"}
    print("| model | LoRA published | - weights | + kept inputs | count | + head dequant | count | QLoRA published |")
    print("|---|---|---|---|---|---|---|---|")
    for model, name in ROWS.items():
        lora = rows[f"litgpt:resource-tables:single:{name}:None:mb1:x1"]
        qlora = rows[f"litgpt:resource-tables:single:{name}:bnb.nf4-dq:mb1:x1"]
        config = resolve_arch(model).config
        tokens = int(qlora["micro_batch_size"]) * int(qlora["seq_len"])
        weights = linear_params(config) * (BF16 - NF4_DQ_BYTES_PER_PARAM)
        kept = kept_input_bytes(config, tokens)
        head_dequant = 2 * config["vocab_size"] * config["hidden_size"] * BF16  # fp16 copy, then its bf16 cast
        published = int(qlora["value_bytes"])
        count = int(lora["value_bytes"]) - weights + kept
        with_dequant = count + head_dequant
        print(f"| {model.split('/')[1]} | {int(lora['value_bytes']) / GIB:.2f} | {weights / GIB:.3f} | "
              f"{kept / GIB:.3f} | {count / GIB:.2f} ({100 * (count / published - 1):+.1f} %) | "
              f"{head_dequant / GIB:.3f} | {with_dequant / GIB:.2f} ({100 * (with_dequant / published - 1):+.1f} %) "
              f"| {published / GIB:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
