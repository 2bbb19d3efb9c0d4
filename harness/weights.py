"""Optional pretrained weights. Memory depends on shapes, not values, so runs use random init unless
``model.pretrained=true``; then the hub checkpoint (or the local HF cache) is copied into the already built
model, keeping the shared builder's dtype, checkpointing and LoRA wrapping."""

from __future__ import annotations

import torch


def load_pretrained(model: torch.nn.Module, name: str) -> str:
    """Copy the checkpoint's tensors into ``model``; returns a note for the record (never raises)."""
    try:
        from huggingface_hub import snapshot_download
        from safetensors.torch import load_file

        folder = snapshot_download(name, allow_patterns=["*.safetensors", "*.json"])
        import glob

        files = sorted(glob.glob(f"{folder}/*.safetensors"))
        if not files:
            return f"pretrained: {name} has no safetensors weights; random init"
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        missing = set(base.state_dict())
        for path in files:
            state = load_file(path, device="cpu")
            result = base.load_state_dict(state, strict=False)
            missing &= set(result.missing_keys)
        return f"pretrained: loaded {name} ({len(files)} files, {len(missing)} tensors left at random init)"
    except Exception as err:  # noqa: BLE001 - unreachable hub / gated model: the run goes on with random init
        return f"pretrained: {name} unreachable ({err.__class__.__name__}); random init"
