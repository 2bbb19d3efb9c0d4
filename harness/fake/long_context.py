"""The MemTracker oracle's own long-context techniques (``harness.fake.memtracker.Variant``), written from the
frameworks' sources and sharing nothing with ``estimator.profiler.techniques``:

* ``ce="chunked"``: torchtune's ``LinearCrossEntropyLoss.forward`` / ``compute_cross_entropy`` (tensor_split of
  the hidden states and labels, the trained positions selected, the output projection, fp32 cross-entropy summed
  per chunk, divided by the trained-token count). Fake tensors cannot be indexed by a mask: the synthetic batch
  trains every position but each row's last (its shifted label is ignored), so the selection is an
  ``index_select`` of the positions kept.
* ``ce="fused_linear"``: Liger's ``fused_linear_cross_entropy_forward`` as its CUDA path allocates (a PURE-TORCH
  RE-IMPLEMENTATION, not Liger: Triton does not run here): ``grad_input``, ``grad_weight``, per-token losses and
  the target mask, one ``(chunk, V)`` logits buffer reused by every chunk, the cross-entropy gradient written over
  it in place, ``mm(out=)`` / ``addmm_`` into the gradients; the gradients saved for backward. The kernel works in
  registers; this version's per-row temporaries (a few bytes per row) are the only difference.
* ``activation_offload``: ``save_on_cpu`` as device memory sees it: the packed copy is host memory (kept as a
  NumPy array on real tensors, as shape only on fake ones), the unpacked one a new device tensor.
* ``ckpt_policy``: every-k:K (layers K-1, 2K-1, ... as torchtitan's ``_apply_ac_to_transformer_block``) or
  ``selective-ops`` (torchtitan's op SAC policy, a fresh mm count per checkpointed call).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

IGNORE = -100


def _shift(labels):
    import torch

    pad = torch.full((labels.shape[0], 1), IGNORE, dtype=labels.dtype, device=labels.device)
    return torch.hstack((labels[..., 1:], pad))


def _kept(hidden_chunk, target_chunk, last: bool):
    import torch
    from torch._subclasses.fake_tensor import is_fake

    if not is_fake(target_chunk):
        mask = target_chunk != IGNORE
        return hidden_chunk[mask], target_chunk[mask]
    width = hidden_chunk.shape[1] - (1 if last else 0)
    index = torch.arange(width, device=hidden_chunk.device)
    return (hidden_chunk.index_select(1, index).flatten(0, 1), target_chunk.index_select(1, index).flatten())


def torchtune_chunked_loss(hidden, head, labels, chunks: int):
    import torch.nn.functional as F

    targets = _shift(labels)
    total = (targets != IGNORE).sum()
    hs, ts = hidden.tensor_split(chunks, dim=1), targets.tensor_split(chunks, dim=1)
    loss = 0.0
    for i in range(len(hs)):
        h, t = _kept(hs[i], ts[i], i == len(hs) - 1)
        loss += F.cross_entropy(head(h).float(), t, reduction="sum", ignore_index=IGNORE)
    return loss / total


def _liger_rows(bt: int, v: int, h: int) -> int:
    inc = (v + h - 1) // h
    want = (bt + inc - 1) // inc
    return min(1 << (want - 1).bit_length(), bt)


def _liger_function():
    import torch

    class LigerLike(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, target, n):
            bt, h = x.shape
            v = w.shape[0]
            chunk = _liger_rows(bt, v, h)
            grad_input = torch.zeros_like(x)
            grad_weight = torch.zeros_like(w) if w.requires_grad else None  # a frozen head (LoRA): none
            loss_1d = torch.zeros(bt, dtype=torch.float32)
            target_mask = target != IGNORE
            storage = torch.empty((chunk, v), dtype=x.dtype)
            for lo in range(0, bt, chunk):
                hi = min(lo + chunk, bt)
                xc, tc, logits = x[lo:hi], target[lo:hi], storage[: hi - lo]
                torch.mm(xc, w.t(), out=logits)
                ok = tc != IGNORE
                idx = tc.clamp(min=0).unsqueeze(1)
                right = logits.gather(1, idx).float()
                logits.sub_(logits.amax(dim=1, keepdim=True)).exp_()
                z = logits.sum(dim=1, keepdim=True, dtype=torch.float32)
                loss_1d[lo:hi] = (z.log() - right).squeeze(1) * ok / n
                logits.div_(z.to(logits.dtype))
                logits.scatter_add_(1, idx, torch.full_like(idx, -1, dtype=logits.dtype))
                logits.mul_((ok.unsqueeze(1) / n).to(logits.dtype))
                torch.mm(logits, w, out=grad_input[lo:hi])
                if grad_weight is None:
                    pass
                elif grad_weight.dtype == torch.float32:  # Liger's fallback: a weight-sized mm, then +=
                    grad_weight += torch.mm(logits.t(), xc).float()
                else:
                    grad_weight.addmm_(logits.t(), xc)
                del xc, tc, logits
            del storage, target_mask
            loss = torch.sum(loss_1d)
            ctx.save_for_backward(grad_input.detach(), None if grad_weight is None else grad_weight.detach())
            return loss

        @staticmethod
        def backward(ctx, grad_output):
            gi, gw = ctx.saved_tensors
            return gi, gw, None, None

    return LigerLike


def liger_loss(hidden, head, labels):
    from torch._subclasses.fake_tensor import is_fake

    targets = _shift(labels)
    n = labels.shape[0] * (labels.shape[1] - 1) if is_fake(targets) else int((targets != IGNORE).sum())
    return _liger_function().apply(hidden.flatten(0, 1), head.weight, targets.flatten(), n)


def replace_loss(model, ce: str, chunks: int) -> None:
    """The model's forward as body + the chosen loss (torchtune's ``set_model_output``: the head inside it)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    body, head = model.base_model, model.get_output_embeddings()

    def forward(input_ids=None, attention_mask=None, labels=None, **_):
        hidden = body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        loss = torchtune_chunked_loss(hidden, head, labels, chunks) if ce == "chunked" \
            else liger_loss(hidden, head, labels)
        return CausalLMOutputWithPast(loss=loss)

    model.forward = forward


@contextlib.contextmanager
def offloaded() -> Iterator[None]:
    import torch
    from torch._subclasses.fake_tensor import is_fake

    def pack(t) -> tuple[Any, ...]:
        if is_fake(t):
            return t.shape, t.dtype, None
        flat = t.detach().contiguous()
        as_np = flat.view(torch.int16) if flat.dtype in (torch.bfloat16, torch.float16) else flat
        return t.shape, t.dtype, as_np.numpy().copy()

    def unpack(packed):
        shape, dtype, host = packed
        if host is None:
            return torch.empty(shape, dtype=dtype)
        back = torch.from_numpy(host.copy())
        return (back.view(dtype) if dtype in (torch.bfloat16, torch.float16) else back).reshape(shape)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def titan_op_context():
    import torch
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    save = {aten.mm.default, aten.max.default, aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_attention_math.default}
    meta: dict = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        key = ("recompute" if ctx.is_recompute else "forward") + "_mm_count"
        if func == aten.mm.default:
            meta[key] += 1
        if func in save and not (func == aten.mm.default and meta[key] % 2 == 0):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def enable_checkpointing(model, layers, policy: str) -> None:
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if policy == "selective-ops":
        kwargs["context_fn"] = titan_op_context
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if policy.startswith("every-k:"):
        k = int(policy.split(":")[1])
        for i, layer in enumerate(layers):
            layer.gradient_checkpointing = (i + 1) % k == 0
