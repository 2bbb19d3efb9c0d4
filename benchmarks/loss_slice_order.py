"""The causal-LM loss's logits-sized allocations and frees in one training step, under whichever torch /
transformers / peft this interpreter has: what ``TrainingSpec.full_range_slices`` models.

    python3 -m venv /tmp/v241 && /tmp/v241/bin/pip install torch==2.4.1 transformers==4.45.2 peft==0.13.2
    /tmp/v241/bin/python benchmarks/loss_slice_order.py        # fms-acceleration's rows' software
    .venv/bin/python benchmarks/loss_slice_order.py              # the project's (torch 2.13)

No project code (the old software's environment lacks its dependencies): a tiny Mistral (vocabulary 1,001, so the
logits are the only tensors of their sizes), LoRA r 4 on q, k, v, o, pure bf16, reentrant checkpointing with the
inputs made to require grad, the Trainer's step (loss from the model, output object dropped before backward).
Printed: the autograd nodes of ``x[..., :-1, :]`` and of ``x[:, :-1, :]``, then every allocation and free of a
storage of at least 95 % of the bf16 logits in the second step, in order, from a dispatch mode (an allocation is
seen when its operator returns, a free when its storage dies).

Measured 2026-11-28 (CPU):
torch 2.4.1 / transformers 4.45.2 / peft 0.13.2: ``x[..., :-1, :]`` -> SliceBackward0 (dim 2, 0:INT64_MAX),
SliceBackward0 (dim 1); ``x[:, :-1, :]`` three. Backward: nll_loss_backward b(s-1)V fp32, log_softmax_backward
b(s-1)V, free, free, slice_backward **b(s-1)V**, free of the incoming gradient, slice_backward bsV, free, then the
bf16 cast. torch 2.13 / transformers 5.24 / peft 0.21.2: one SliceBackward0 each (the full-range ``:`` elided;
5.24's loss shifts the labels, not the logits, so its loss has no slice at all).
"""

from __future__ import annotations

_HEAD = r"""
import gc, weakref
import torch, transformers, peft
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

b, s, V = 2, 32, 1001
MIN = int(0.95 * b * s * V * 2)
NAMES = {b * s * V * 2: "b s V bf16", b * s * V * 4: "b s V fp32", b * (s - 1) * V * 4: "b (s-1) V fp32"}
events, seen = [], {}


def chain(t):
    fn, out = t.grad_fn, []
    while fn is not None:
        out.append(f"{type(fn).__name__}(dim {getattr(fn, '_saved_dim', '?')}, "
                   f"{getattr(fn, '_saved_start', '?')}:{getattr(fn, '_saved_end', '?')})")
        fn = fn.next_functions[0][0] if fn.next_functions else None
    return out[:-1]


class Log(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                st = t.untyped_storage()
                key, n = st._cdata, st.nbytes()
                if key not in seen and n >= MIN:
                    events.append(("alloc", n, func.__name__))
                    seen[key] = weakref.ref(st, lambda _r, key=key, n=n: (seen.pop(key, None),
                                                                          events.append(("free", n, ""))))
        return out


x = torch.randn(2, 5, 3, requires_grad=True)
print(torch.__version__, transformers.__version__, peft.__version__)
print("x[..., :-1, :]:", chain(x[..., :-1, :]))
print("x[:, :-1, :]:", chain(x[:, :-1, :]))
torch.manual_seed(0)
cfg = transformers.MistralConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
model = transformers.MistralForCausalLM(cfg).to(torch.bfloat16)
model.enable_input_require_grads()
model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=16, lora_dropout=0.1, task_type="CAUSAL_LM",
                                                   target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
model.train()
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
ids = torch.randint(0, V, (b, s))
"""

_TAIL = r"""

step(ids)
gc.collect()
with Log():
    step(ids)
gc.collect()
for kind, n, op in events:
    print(f"{kind:5s} {NAMES.get(n, n)!s:16s} {op}")
"""


def main() -> int:
    # its sibling (this file's directory is on sys.path when run as a script)
    from training_step_source import with_training_step

    exec(compile(with_training_step(_HEAD, _TAIL), "loss_slice_order", "exec"), {"__name__": "loss_slice_order"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
