"""DeepSpeed's pipeline engine (``deepspeed.pipe.PipelineModule`` + ``PipelineEngine``) on a transformers decoder
(issue 18).

The decoder is a flat list of DeepSpeed ``LayerSpec``s, as DeepSpeed's pipeline examples write a Llama (each
stage builds only its own layers): the embedding, one
layer per decoder layer (each computing the rotary tables of its own input: DeepSpeed hands a layer only what the
layer before returned), the final norm with the LM head; transformers' ``ForCausalLMLoss`` is the module's
``loss_fn``, which the engine calls on the last stage. ``PipelineModule`` splits the list over the stages with its
``partition_method`` (``parameters``, DeepSpeed's default: balanced by trainable parameter count, so the embedding
and the head weigh as much as their vocabularies make them). The engine runs ``TrainSchedule`` (1F1B) over
``gradient_accumulation_steps`` micro-batches per ``train_batch``.

Used by ``benchmarks/ds_pipeline_table.py`` (the counted CPU oracle).
"""

from __future__ import annotations

import torch
from torch import nn


def _classes(config) -> tuple[type, type, type]:
    """(decoder layer, RMSNorm, rotary embedding) classes of a Llama-style transformers model (``LlamaForCausalLM``
    -> ``transformers.models.llama.modeling_llama.LlamaDecoderLayer``, ...)."""
    import importlib

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    prefix = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type].removesuffix("ForCausalLM")
    module = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    return (getattr(module, f"{prefix}DecoderLayer"), getattr(module, f"{prefix}RMSNorm"),
            getattr(module, f"{prefix}RotaryEmbedding"))


class EmbeddingPipe(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)


class DecoderLayerPipe(nn.Module):
    """One decoder layer; the rotary embedding of its own input (positions 0..s-1, full rows, no mask)."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        layer_cls, _, rotary_cls = _classes(config)
        self.layer = layer_cls(config, layer_idx)
        self.rotary_emb = rotary_cls(config=config)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        rotary = self.rotary_emb(h, position_ids=positions)
        return self.layer(h, attention_mask=None, position_ids=positions, position_embeddings=rotary)


class HeadPipe(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        _, norm_cls, _ = _classes(config)
        self.norm = norm_cls(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))


def pipe_layers(config) -> list:
    """The decoder as DeepSpeed ``LayerSpec``s (each stage builds only its own): embedding, decoder layers,
    norm + head. ``config``: the transformers config (``attn_implementation`` set on it)."""
    from deepspeed.pipe import LayerSpec

    return ([LayerSpec(EmbeddingPipe, config)]
            + [LayerSpec(DecoderLayerPipe, config, i) for i in range(config.num_hidden_layers)]
            + [LayerSpec(HeadPipe, config)])


def ds_pipe_config(micro_batch_size: int, microbatches: int, dp: int, zero_stage: int, ckpt_interval: int,
                   precision: str = "bf16") -> dict:
    """The DeepSpeed config of a pipeline run: the engine's micro-batches are its gradient accumulation steps.
    ``bf16`` / ``fp32``: no precision section, a model built in bf16 is stepped in bf16 by the client optimizer
    (DeepSpeed wraps no optimizer around it), the estimator's pure ``bf16``. ``mixed_bf16``: ``bf16.enabled``,
    DeepSpeed's bf16 mode (its ``BF16_Optimizer`` with fp32 master weights around the client optimizer).
    ``mixed_fp16``: ``fp16.enabled`` (``FP16_UnfusedOptimizer`` around torch's AdamW: per-tensor fp32 masters,
    dynamic loss scaling)."""
    config = {"train_micro_batch_size_per_gpu": micro_batch_size, "gradient_accumulation_steps": microbatches,
              "train_batch_size": micro_batch_size * microbatches * dp, "steps_per_print": 10**9,
              "zero_optimization": {"stage": zero_stage},
              "pipeline": {"activation_checkpoint_interval": ckpt_interval, "use_reentrant": False}}
    if precision == "mixed_bf16":
        config["bf16"] = {"enabled": True}
    if precision == "mixed_fp16":
        # dynamic loss scale starting at 1 (harness.methods.deepspeed's reason: a skipped update has no optimizer
        # temporaries, and 2**16 on a random model can skip the measured steps)
        config["fp16"] = {"enabled": True, "initial_scale_power": 0}
    return config


def build_engine(hf_config, pp: int, precision: str, micro_batch_size: int, microbatches: int, dp: int = 1,
                 optimizer_fn=None, ckpt_interval: int = 0, zero_stage: int = 0):
    """(engine, module): the decoder as a ``PipelineModule`` of ``pp`` stages (``partition_method="parameters"``),
    its layers built in the model's dtype (bf16 or fp32), and ``deepspeed.initialize`` with the client optimizer
    (``optimizer_fn(params)``; default torch's foreach AdamW) under ``zero_stage`` (0 or 1: DeepSpeed's pipelines
    refuse 2 and 3) over the ``dp`` data-parallel ranks of each stage. ``deepspeed.init_distributed``
    must have run. ``hf_config``: a transformers config; the loss is transformers' ``ForCausalLMLoss``."""
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from transformers.loss.loss_utils import ForCausalLMLoss

    hf_config.use_cache = False
    hf_config._attn_implementation = hf_config._attn_implementation or "sdpa"
    vocab = int(hf_config.vocab_size)

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return ForCausalLMLoss(logits, labels, vocab_size=vocab)

    # pure bf16: the layers built in bf16 and no ``bf16`` section, so the client optimizer steps the bf16 weights;
    # mixed_bf16: built in bf16 too, DeepSpeed's bf16 mode wraps BF16_Optimizer (fp32 masters) around the client
    previous = torch.get_default_dtype()
    torch.set_default_dtype({"fp32": torch.float32, "mixed_fp16": torch.float16}.get(precision, torch.bfloat16))
    try:
        module = PipelineModule(pipe_layers(hf_config), num_stages=pp, loss_fn=loss_fn,
                                partition_method="parameters")
    finally:
        torch.set_default_dtype(previous)
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = optimizer_fn(params) if optimizer_fn else torch.optim.AdamW(params, lr=1e-5, foreach=True)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer,
                                           config=ds_pipe_config(micro_batch_size, microbatches, dp, zero_stage,
                                                                         ckpt_interval, precision))
    return engine, module
