"""The long-context memory techniques, as one torch program shared by the profiler, the tracer and the harness.

* ``ce="chunked"``: torchtune's ``LinearCrossEntropyLoss`` (``torchtune/modules/loss/cross_entropy_loss.py``): the
  model stops at the last hidden states; the loss splits them and the shifted labels into ``ce_chunks`` sequence
  chunks (``tensor_split``), and per chunk selects the trained positions (a copy), applies the output projection
  and takes ``F.cross_entropy(logits.float(), reduction="sum")``; the sum is divided by the trained-token count.
  Eager (torchtune leaves its compile off for this loss): each chunk's fp32 log-softmax stays saved for backward.
* ``ce="fused_linear"``: Liger's ``LigerFusedLinearCrossEntropyFunction`` re-implemented in plain torch (Liger
  needs Triton): its CUDA path's allocations, from ``liger_kernel/ops/fused_linear_cross_entropy.py``.
* ``activation_offload``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` around the forward.
* ``ckpt_policy``: every K-th layer (torchtitan / torchtune: layers K-1, 2K-1, ...) or torchtitan's op policy.

On fake tensors (the profiler and the oracle) a trained-position mask cannot be read: every position of the
synthetic batch is trained but each row's last, whose shifted label is the ignore index (``synthetic_batch``), so
the selection is that slice. Host memory is no device memory: on fake or CPU tensors the offload emulation keeps
the packed copy out of torch's storages (shape only on fake tensors, a NumPy copy on real ones) and allocates the
device copy at unpack, as ``tensor.to(device)`` does on the GPU.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from estimator.methods.long_context import LIGER_MARK, checkpointed, liger_chunk_rows
from estimator.spec import TrainingSpec, ckpt_every

IGNORE_INDEX = -100


def causal_parts(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(decoder body returning the last hidden states, output projection) of an HF causal LM."""
    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    return causal.base_model, causal.get_output_embeddings()


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """torchtune's recipe shift: each position's target is the next token, the last position ignored."""
    ignore = torch.full((labels.shape[0], 1), IGNORE_INDEX, dtype=labels.dtype, device=labels.device)
    return torch.hstack((labels[..., 1:], ignore))


def _trained_rows(hidden: torch.Tensor, targets: torch.Tensor, last_chunk: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden rows, targets) of the trained positions of a (b, c, H) chunk: boolean indexing (a copy of each)."""
    if not is_fake(hidden):
        mask = targets != IGNORE_INDEX
        if mask.sum() == 0:  # torchtune unmasks one token so every rank runs the projection
            mask[0] = True
        return hidden[mask], targets[mask]
    keep = slice(None, -1) if last_chunk else slice(None)  # only the sequence's last position is ignored
    return (hidden[:, keep].reshape(-1, hidden.shape[-1]).clone(), targets[:, keep].reshape(-1).clone())


def chunked_ce(hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor, chunks: int) -> torch.Tensor:
    targets = shifted_labels(labels)
    total = (targets != IGNORE_INDEX).sum()
    hidden_chunks = hidden.tensor_split(chunks, dim=1)
    target_chunks = targets.tensor_split(chunks, dim=1)
    loss = 0.0
    for i, (h, t) in enumerate(zip(hidden_chunks, target_chunks)):
        rows, kept = _trained_rows(h, t, last_chunk=i == len(hidden_chunks) - 1)
        logits = head(rows)
        loss = loss + F.cross_entropy(logits.float(), kept, reduction="sum", ignore_index=IGNORE_INDEX)
    return loss / total


_LOOP_AS_MARKER = [False]


@contextlib.contextmanager
def liger_loop_as_marker() -> Iterator[None]:
    """The profiler's trace of ``FusedLinearCE``: the chunk loop left out and ``LIGER_MARK`` left where it starts
    (its chunk is a power of two of the token count, no polynomial: ``estimator.methods.long_context`` adds it)."""
    _LOOP_AS_MARKER[0] = True
    try:
        yield
    finally:
        _LOOP_AS_MARKER[0] = False


def _mark(label: str) -> None:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from estimator.profiler.trace import StorageRecorder

    for mode in _get_current_dispatch_mode_stack():
        if isinstance(mode, StorageRecorder):
            mode.mark(label)


def _ce_in_place(logits: torch.Tensor, target: torch.Tensor, loss_out: torch.Tensor, n_trained: int) -> None:
    """Liger's cross-entropy kernel on one chunk, in torch: the loss per row into ``loss_out`` and the gradient of
    the mean loss written over ``logits`` in place (the kernel works row by row in registers: no chunk-sized
    temporary)."""
    trained = target != IGNORE_INDEX
    safe = target.clamp(min=0).unsqueeze(1)
    picked = logits.gather(1, safe).float()
    logits.sub_(logits.amax(dim=1, keepdim=True)).exp_()
    total = logits.sum(dim=1, keepdim=True, dtype=torch.float32)
    loss_out.copy_((total.log().squeeze(1) - picked.squeeze(1)) * trained / n_trained)
    logits.div_(total.to(logits.dtype))
    logits.scatter_add_(1, safe, torch.full_like(safe, -1, dtype=logits.dtype))
    logits.mul_((trained.unsqueeze(1) / n_trained).to(logits.dtype))


class FusedLinearCE(torch.autograd.Function):
    """``LigerFusedLinearCrossEntropyFunction`` (reduction "mean", no bias) on its CUDA path (``use_mm_out``: one
    reused chunk buffer for the logits; bf16/fp16 gradients accumulated in place by ``addmm``; an fp32 weight's
    gradient through the fallback's parameter-sized ``mm`` temporary)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, n_trained: int
                ) -> torch.Tensor:
        tokens, width = hidden.shape
        vocab = weight.shape[0]
        rows = liger_chunk_rows(tokens, vocab, width)
        grad_input = torch.zeros_like(hidden)
        grad_weight = torch.zeros_like(weight) if weight.requires_grad else None
        loss_1d = torch.zeros(tokens, dtype=torch.float32, device=hidden.device)
        target_mask = target != IGNORE_INDEX  # Liger counts the trained tokens from it (.item()) and keeps it
        if _LOOP_AS_MARKER[0]:
            _mark(LIGER_MARK)
            rows = 0  # nothing allocated and no chunk run: the transient is added by the estimator
        buffer = torch.empty((rows, vocab), dtype=hidden.dtype, device=hidden.device)
        for start in range(0, tokens if rows else 0, rows or 1):
            end = min(start + rows, tokens)
            chunk_in = hidden[start:end]
            logits = buffer[: end - start]
            torch.mm(chunk_in, weight.t(), out=logits)
            _ce_in_place(logits, target[start:end], loss_1d[start:end], max(n_trained, 1))
            torch.mm(logits, weight, out=grad_input[start:end])
            if grad_weight is not None:
                if grad_weight.dtype in (torch.bfloat16, torch.float16):
                    grad_weight.addmm_(logits.t(), chunk_in)
                else:
                    grad_weight += torch.mm(logits.t(), chunk_in).float()
            del logits, chunk_in
        del buffer, target_mask
        loss = torch.sum(loss_1d)
        ctx.save_for_backward(grad_input.detach(), grad_weight.detach() if grad_weight is not None else None)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        grad_input, grad_weight = ctx.saved_tensors
        return grad_input, grad_weight, None, None


def fused_linear_ce(hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor) -> torch.Tensor:
    targets = shifted_labels(labels)
    if hidden.device.type == "cuda":  # a GPU run measures Liger itself
        try:
            from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
        except ImportError:
            raise ValueError("ce: fused_linear on a GPU runs Liger's kernel: pip install liger-kernel") from None
        return LigerFusedLinearCrossEntropyFunction.apply(hidden.reshape(-1, hidden.shape[-1]), head.weight,
                                                          targets.reshape(-1))[0]
    # Liger reads the trained-token count with .item(); on fake tensors it is every position but each row's last
    n_trained = labels.shape[0] * (labels.shape[1] - 1) if is_fake(targets) else int((targets != IGNORE_INDEX).sum())
    return FusedLinearCE.apply(hidden.reshape(-1, hidden.shape[-1]), head.weight, targets.reshape(-1), n_trained)


def install_loss(model: torch.nn.Module, training: TrainingSpec) -> None:
    """The causal LM's forward replaced by body + the spec's loss (``training.ce``), as torchtune's recipes run
    ``set_model_output``: the head is applied inside the loss. An instance attribute, so DDP / FSDP2 wrappers and
    module hooks still go through ``model(**batch)``. The output object holds the loss alone."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    body, head = causal_parts(model)

    def forward(input_ids=None, attention_mask=None, labels=None, **kwargs):
        hidden = body(input_ids=input_ids, attention_mask=attention_mask, **kwargs)[0]
        if training.ce == "chunked":
            loss = chunked_ce(hidden, head, labels, training.ce_chunks)
        else:
            loss = fused_linear_ce(hidden, head, labels)
        return CausalLMOutputWithPast(loss=loss)

    model.forward = forward


# ----------------------------------------------------------------------------------------------- activation offload

def _host_copy(tensor: torch.Tensor):
    if is_fake(tensor) or tensor.device.type == "meta":
        return None
    data = tensor.detach()
    if data.dtype in (torch.bfloat16, torch.float16):
        return data.view(torch.int16).numpy().copy()
    if data.dtype == torch.bool:
        return data.numpy().copy()
    return data.numpy().copy()


def _pack(tensor: torch.Tensor):
    return (tensor.shape, tensor.stride(), tensor.dtype, tensor.device, tensor.storage_offset() == 0 and
            tensor.is_contiguous(), _host_copy(tensor))


def _unpack(packed) -> torch.Tensor:
    shape, stride, dtype, device, _, host = packed
    if host is None:  # fake: only the device copy's size matters
        return torch.empty(shape, dtype=dtype, device=device)
    out = torch.from_numpy(host.copy())
    if dtype in (torch.bfloat16, torch.float16):
        out = out.view(dtype)
    return out.reshape(shape)


@contextlib.contextmanager
def offload_saved_tensors(device: torch.device | str) -> Iterator[None]:
    """``save_on_cpu(pin_memory=True)`` on a GPU; elsewhere its device-memory shape (see the module doc): every
    tensor saved for backward leaves the device at once and comes back as a new (contiguous) tensor when its
    node's backward unpacks it."""
    if torch.device(device).type == "cuda":
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            yield
        return
    with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
        yield


# ------------------------------------------------------------------------------------------ checkpointing policies

# torchtitan's op policy (torchtitan/distributed/activation_checkpoint.py, ``_op_sac_save_list``): these outputs
# are saved, every second mm recomputed, everything else recomputed.
def _save_ops() -> set:
    aten = torch.ops.aten
    ops = {aten.mm.default, aten.max.default, aten._scaled_dot_product_efficient_attention.default,
           aten._scaled_dot_product_flash_attention.default,
           aten._scaled_dot_product_flash_attention_for_cpu.default}
    for name in ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_attention_math"):
        if hasattr(aten, name):
            ops.add(getattr(aten, name).default)
    return ops


def _op_policy(meta: dict):
    from torch.utils.checkpoint import CheckpointPolicy

    save = _save_ops()

    def policy(ctx, func, *args, **kwargs):
        key = f"{'recompute' if ctx.is_recompute else 'forward'}_mm_count"
        if func == torch.ops.aten.mm.default:
            meta[key] += 1
        keep = func in save and not (func == torch.ops.aten.mm.default and meta[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


def op_sac_context():
    """A fresh pair of selective-checkpoint contexts per checkpointed call: the mm count starts at 0 in every
    layer, forward and recompute alike (torchtitan keeps one count per wrapped block across steps, so with an odd
    number of mm per layer its saved set alternates from step to step; per call it is the same every step)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_op_policy(defaultdict(int)))


def checkpoint_kwargs(training: TrainingSpec, reentrant: bool = False) -> dict:
    """``reentrant``: the spec's ``ckpt_reentrant`` for a real run (a traced profile stays non-reentrant)."""
    kwargs: dict = {"use_reentrant": reentrant}
    if training.ckpt_policy == "selective-ops":
        kwargs["context_fn"] = op_sac_context
    return kwargs


def apply_layer_policy(layers: torch.nn.ModuleList, training: TrainingSpec) -> None:
    """every-k: only the policy's layers keep checkpointing on (HF checks each layer's flag at every call)."""
    if ckpt_every(training.ckpt_policy) is None:
        return
    for layer, on in zip(layers, checkpointed(len(layers), ckpt_every(training.ckpt_policy))):
        layer.gradient_checkpointing = on
