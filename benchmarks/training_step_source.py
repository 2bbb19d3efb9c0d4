"""The one training step the version-probe benchmarks run in a fresh interpreter (``loss_slice_order.py``,
``fsdp1_lora_versions.py``): Python source, since it runs under whichever torch / transformers the probe's venv has,
after the probe has defined ``model`` and ``opt``. The output object is dropped before backward, as the HF Trainer
does, so only the loss keeps the logits' graph alive."""

TRAINING_STEP_SOURCE = r"""
def step(ids):
    out = model(input_ids=ids, labels=ids)
    loss = out["loss"]
    del out
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
"""


def with_training_step(head: str, tail: str) -> str:
    """``head`` (builds ``model`` and ``opt``), the step, then ``tail`` (runs it)."""
    return head + TRAINING_STEP_SOURCE + tail
