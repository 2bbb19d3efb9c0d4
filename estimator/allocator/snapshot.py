"""Load a `torch.cuda.memory._dump_snapshot` pickle without executing anything it holds.

The pickle format can name any importable callable; a snapshot only needs builtin containers and
scalars, so every global lookup is refused before it can run.
"""

import io
import pickle


class SnapshotError(ValueError):
    """A snapshot file that cannot be read, or that this tool refuses to read."""


class _BuiltinsOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        raise SnapshotError(f"refusing pickle global {module}.{name}: a snapshot holds only builtin containers "
                            "and scalars")


def load_snapshot_bytes(data: bytes):
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
