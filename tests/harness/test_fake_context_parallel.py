"""The context-parallel oracle (``harness.fake.context_parallel``): torch's ring attention on fake tensors under
FSDP2, in a spawned interpreter. It shows the finding the estimator models: a rank whose last ring step is a half
step keeps one more attention output per layer (the copy the model's ``transpose(1, 2).contiguous()`` makes of the
(b, h, s, d)-contiguous merge), the last rank of the group does not; under LoRA with peft's fp32 adapters the frozen
o_proj saves its fp32 cast instead, and the copy is gone with the projection."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

_RUN = """
import json
from harness.fake.context_parallel import peak_bytes
from harness.fake.memtracker import load_model_config
config = load_model_config("tiny-llama")
print(json.dumps([peak_bytes(config, "mixed_bf16", 2, 2, rank, 1, 512) for rank in (0, 1)]))
"""

_RUN_LORA = """
import json
from harness.fake.context_parallel import peak_bytes
from harness.fake.memtracker import load_model_config
config = load_model_config("tiny-llama")
lora = {"lora_rank": 8, "lora_targets": "q_proj,k_proj,v_proj,o_proj"}
print(json.dumps([peak_bytes(config, "bf16", 2, 2, rank, 1, 512, **lora) for rank in (0, 1)]))
"""


@pytest.mark.slow
def test_half_step_ranks_keep_one_more_attention_output_per_layer():
    result = subprocess.run([sys.executable, "-c", _RUN], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    first, last = json.loads(result.stdout.strip().splitlines()[-1])
    config = json.loads((REPO / "harness" / "assets" / "models" / "tiny-llama.json").read_text())
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    # the logits set the peak here, with every layer's saved tensors alive: 256 local tokens x hidden x 2 B each
    assert first - last == layers * 256 * hidden * 2


@pytest.mark.slow
def test_under_lora_with_fp32_adapters_no_rank_keeps_the_copy():
    result = subprocess.run([sys.executable, "-c", _RUN_LORA], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    first, last = json.loads(result.stdout.strip().splitlines()[-1])
    assert first == last
