"""`PYTORCH_CUDA_ALLOC_CONF` parsed the way PyTorch parses it.

Source read: `c10/core/AllocatorConfig.cpp` (`lexArgs`, `parseArgs`, `parseMaxSplitSize`,
`parseRoundUpPower2Divisions`, `roundup_power2_divisions`) and `c10/cuda/CUDAAllocatorConfig.cpp`
(`parseArgs`: the CUDA-only keys; unknown keys are an error). Values that change no allocation
decision (pinned-memory keys, `release_lock_on_cudamalloc`) are accepted and kept.
"""

import dataclasses

MIB = 1024 * 1024
LARGE_BUFFER_BYTES = 20 * MIB  # kLargeBuffer
UNLIMITED_BYTES = 2 ** 64 - 1  # max_split_size when unset: SIZE_MAX
ROUNDUP_INTERVALS = 16  # kRoundUpPowerOfTwoIntervals: 1 MiB .. 64 GiB, one per power of two

_BOOL_KEYS = ("expandable_segments", "release_lock_on_cudamalloc", "release_lock_on_hipmalloc",
              "pinned_use_cuda_host_register", "pinned_use_hip_host_register",
              "pinned_use_background_threads", "graph_capture_record_stream_reuse")
_INT_KEYS = ("pinned_num_register_threads", "pinned_reserve_segment_size_mb")
KNOWN_KEYS = ("backend", "max_split_size_mb", "max_non_split_rounding_mb", "garbage_collection_threshold",
              "roundup_power2_divisions") + _BOOL_KEYS + _INT_KEYS


@dataclasses.dataclass(frozen=True)
class AllocatorConfig:
    max_split_size_bytes: int = UNLIMITED_BYTES
    max_non_split_rounding_bytes: int = LARGE_BUFFER_BYTES
    roundup_power2_divisions: tuple = (0,) * ROUNDUP_INTERVALS
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False
    extra: tuple = ()  # accepted keys without effect on placement, as (key, value) pairs

    def divisions_for(self, size_bytes: int) -> int:
        index = size_bytes.bit_length() - 1 - 20  # log2(size) - log2(1 MiB)
        return self.roundup_power2_divisions[min(max(index, 0), ROUNDUP_INTERVALS - 1)]


class _Tokens:
    def __init__(self, text: str):
        self.items, word = [], []
        for char in text:
            if char in ",:[]":
                if word:
                    self.items.append("".join(word))
                    word = []
                self.items.append(char)
            elif char != " ":
                word.append(char)
        if word:
            self.items.append("".join(word))

    def expect(self, i: int, token: str) -> None:
        if i >= len(self.items) or self.items[i] != token:
            found = self.items[i] if i < len(self.items) else "end of string"
            raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: expected '{token}' at token {i}, found {found!r}")

    def value(self, i: int, key: str) -> str:
        if i >= len(self.items) or self.items[i] in ",:[]":
            raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: {key} needs a value")
        return self.items[i]


def _int(text: str, key: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: {key} expects an integer, got {text!r}") from None


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _megabytes_at_least_20(text: str, key: str) -> int:
    value_mb = _int(text, key)
    if value_mb < LARGE_BUFFER_BYTES // MIB:
        raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: {key} too small, must be >= {LARGE_BUFFER_BYTES // MIB}")
    return min(value_mb, UNLIMITED_BYTES // MIB) * MIB


def _parse_roundup(tokens: _Tokens, i: int) -> tuple:
    """Returns (index of the last token consumed, divisions per interval)."""
    key = "roundup_power2_divisions"
    divisions = [0] * ROUNDUP_INTERVALS
    first = tokens.items[i] if i < len(tokens.items) else ""
    if first != "[":
        first = tokens.value(i, key)
        value = _int(first, key)
        if not _is_power_of_two(value):
            raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: {key} must be a power of 2, got {value}")
        return i, tuple([value] * ROUNDUP_INTERVALS)
    last_index, first_entry = 0, True
    while True:
        i += 1
        if i >= len(tokens.items):
            raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: {key} list is not closed with ']'")
        if tokens.items[i] == "]":
            return i, tuple(divisions)
        interval = tokens.value(i, key)
        tokens.expect(i + 1, ":")
        i += 2
        value = _int(tokens.value(i, key), key)
        if value != 0 and not _is_power_of_two(value):
            raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: {key} divisions must be a power of 2 or 0, got {value}")
        if interval == ">":
            divisions[last_index:] = [value] * (ROUNDUP_INTERVALS - last_index)
        else:
            interval_mb = _int(interval, key)
            if not _is_power_of_two(interval_mb):
                raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: {key} intervals must be powers of 2 (MiB), "
                                 f"got {interval_mb}")
            index = min(interval_mb.bit_length() - 1, ROUNDUP_INTERVALS - 1)
            if first_entry:
                divisions[:index] = [value] * index
                first_entry = False
            divisions[index] = value
            last_index = index
        if i + 1 < len(tokens.items) and tokens.items[i + 1] != "]":
            tokens.expect(i + 1, ",")
            i += 1


def parse_alloc_conf(text) -> AllocatorConfig:
    """Parse a `PYTORCH_CUDA_ALLOC_CONF` string; None or "" give PyTorch's defaults."""
    fields, extra = {}, []
    tokens = _Tokens(text or "")
    i = 0
    while i < len(tokens.items):
        key = tokens.items[i]
        if key not in KNOWN_KEYS:
            raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: unknown allocator option {key!r} "
                             f"(known: {', '.join(KNOWN_KEYS)})")
        tokens.expect(i + 1, ":")
        i += 2
        if key == "roundup_power2_divisions":
            i, fields["roundup_power2_divisions"] = _parse_roundup(tokens, i)
        else:
            value = tokens.value(i, key)
            _apply_scalar(key, value, fields, extra)
        if i + 1 < len(tokens.items):
            tokens.expect(i + 1, ",")
            i += 1
        i += 1
    return AllocatorConfig(extra=tuple(extra), **fields)


def _apply_scalar(key: str, value: str, fields: dict, extra: list) -> None:
    if key == "backend":
        if value == "cudaMallocAsync":
            raise ValueError("PYTORCH_CUDA_ALLOC_CONF: backend:cudaMallocAsync is not modelled "
                             "(only the native caching allocator is)")
        if value != "native":
            raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: unknown allocator backend {value!r}, "
                             "options are native and cudaMallocAsync")
    elif key == "max_split_size_mb":
        fields["max_split_size_bytes"] = _megabytes_at_least_20(value, key)
    elif key == "max_non_split_rounding_mb":
        fields["max_non_split_rounding_bytes"] = _megabytes_at_least_20(value, key)
    elif key == "garbage_collection_threshold":
        try:
            threshold = float(value)
        except ValueError:
            raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: {key} expects a number, got {value!r}") from None
        if not 0.0 < threshold < 1.0:
            raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: {key} must be in (0.0, 1.0), got {value}")
        fields["garbage_collection_threshold"] = threshold
    elif key in _BOOL_KEYS:
        if value not in ("True", "False"):
            raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: {key} expects True or False, got {value!r}")
        if key == "expandable_segments":
            fields["expandable_segments"] = value == "True"
        else:
            extra.append((key, value))
    else:
        extra.append((key, _int(value, key)))


def config_from_snapshot_settings(settings) -> AllocatorConfig:
    """The `allocator_settings` a snapshot carries (torch >= 2.4) as a config; None gives defaults."""
    if not settings:
        return AllocatorConfig()
    max_split = settings.get("max_split_size", -1)
    divisions = settings.get("roundup_power2_divisions") or {}
    ordered = [int(divisions[k]) for k in sorted(divisions, key=int)] if divisions else [0] * ROUNDUP_INTERVALS
    return AllocatorConfig(
        max_split_size_bytes=UNLIMITED_BYTES if max_split in (-1, None) or max_split >= UNLIMITED_BYTES
        else int(max_split),
        roundup_power2_divisions=tuple(ordered),
        garbage_collection_threshold=float(settings.get("garbage_collection_threshold") or 0.0),
        expandable_segments=bool(settings.get("expandable_segments")))
