"""The harness takes the long-context techniques as ``training.*`` overrides (issue 18) and names them."""

import pytest

from harness.config import to_run
from tests.harness.conftest import compose


def test_techniques_compose_into_the_spec():
    spec, _ = to_run(compose("training.ce=chunked", "training.ce_chunks=16", "training.activation_offload=true",
                             "training.grad_ckpt=true", "training.ckpt_policy=every-k:2"), gpu_key="cpu")
    t = spec.training
    assert (t.ce, t.ce_chunks, t.activation_offload, t.grad_ckpt, t.ckpt_policy) == \
        ("chunked", 16, True, True, "every-k:2")


def test_a_policy_without_checkpointing_names_the_key():
    with pytest.raises(ValueError, match=r"^training\.ckpt_policy: "):
        to_run(compose("training.ckpt_policy=selective-ops"), gpu_key="cpu")
