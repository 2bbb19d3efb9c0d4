"""PyTorch's CUDA caching allocator, modelled (standard library only), and trace replay."""

from estimator.allocator.config import AllocatorConfig, config_from_snapshot_settings, parse_alloc_conf
from estimator.allocator.model import CachingAllocator, OutOfMemory, allocation_size, round_size
from estimator.allocator.requests import simulate

__all__ = ["AllocatorConfig", "CachingAllocator", "OutOfMemory", "allocation_size",
           "config_from_snapshot_settings", "parse_alloc_conf", "round_size", "simulate"]
