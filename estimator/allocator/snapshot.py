"""Load a `torch.cuda.memory._dump_snapshot` pickle without executing anything it holds.

The pickle format can name any importable callable; a snapshot only needs builtin containers and
scalars, so every global lookup is refused before it can run.
"""

import gzip
import io
import pickle
import zlib


class SnapshotError(ValueError):
    """A snapshot file that cannot be read, or that this tool refuses to read."""


class _BuiltinsOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        raise SnapshotError(f"refusing pickle global {module}.{name}: a snapshot holds only builtin containers "
                            "and scalars")


def load_snapshot_bytes(data: bytes):
    if data[:2] == b"\x1f\x8b":  # gzipped, as the harness writes them (rank<r>.snapshot.pickle.gz)
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as err:
            raise SnapshotError(f"not a readable gzip file ({type(err).__name__}: {err})") from None
    try:
        return _BuiltinsOnlyUnpickler(io.BytesIO(data)).load()
    except SnapshotError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError,
            AttributeError, MemoryError, UnicodeDecodeError) as err:
        raise SnapshotError(f"not a readable pickle ({type(err).__name__}: {err})") from None


def load_snapshot(path: str):
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError as err:
        raise SnapshotError(f"cannot read {path}: {err.strerror}") from None
    return load_snapshot_bytes(data)


_SEGMENT_KEYS = ("address", "total_size", "stream", "segment_type", "blocks")
_BLOCK_KEYS = ("size", "state", "requested_size")
_EVENT_KEYS = {"alloc": ("addr", "size", "stream"), "free_requested": ("addr", "size", "stream"),
               "free_completed": ("addr", "size", "stream"), "segment_alloc": ("addr", "size", "stream"),
               "segment_free": ("addr", "size", "stream"), "segment_map": ("addr", "size", "stream"),
               "segment_unmap": ("addr", "size", "stream"), "oom": ("size", "stream")}


def check_snapshot(snapshot) -> dict:
    """The snapshot as {'segments': [...], 'device_traces': [[...], ...], ...}, or SnapshotError naming
    the first thing that is not shaped like `torch.cuda.memory._snapshot()` output."""
    if isinstance(snapshot, list):  # the oldest dumps hold the segment list alone
        snapshot = {"segments": snapshot, "device_traces": []}
    if not isinstance(snapshot, dict) or not isinstance(snapshot.get("segments"), list):
        raise SnapshotError("not a memory snapshot: expected a dict with a 'segments' list")
    for k, seg in enumerate(snapshot["segments"]):
        _require(seg, _SEGMENT_KEYS, f"segment {k}")
        for j, block in enumerate(seg["blocks"]):
            _require(block, _BLOCK_KEYS, f"segment {k} block {j}")
    traces = snapshot.get("device_traces") or []
    if not isinstance(traces, list):
        raise SnapshotError("not a memory snapshot: 'device_traces' is not a list")
    for device, trace in enumerate(traces):
        if not isinstance(trace, list):
            raise SnapshotError(f"not a memory snapshot: device_traces[{device}] is not a list")
        for index, event in enumerate(trace):
            _require(event, ("action",), f"device {device} event {index}")
            _require(event, _EVENT_KEYS.get(event["action"], ()), f"device {device} event {index}")
    return snapshot


def _require(item, keys, where):
    if not isinstance(item, dict):
        raise SnapshotError(f"not a memory snapshot: {where} is not a dict")
    missing = [k for k in keys if k not in item]
    if missing:
        raise SnapshotError(f"not a memory snapshot: {where} lacks {', '.join(missing)}")
