"""The restricted snapshot loader: builtin containers and scalars only, nothing executes."""

import pickle

import pytest

from estimator.allocator.snapshot import SnapshotError, check_snapshot, load_snapshot, load_snapshot_bytes


class _WritesAFile:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):  # unpickling this calls open(path, "w"): it creates the file
        return (open, (self.path, "w"))


def test_a_pickle_that_would_write_a_file_is_refused_before_anything_runs(tmp_path):
    target = tmp_path / "written"
    data = pickle.dumps({"segments": [], "device_traces": [[_WritesAFile(str(target))]]})
    with pytest.raises(SnapshotError, match="refusing pickle global io.open"):
        load_snapshot_bytes(data)
    assert not target.exists()
    pickle.loads(data)["device_traces"][0][0].close()  # the control: the plain unpickler does run it
    assert target.exists()


def test_builtin_containers_and_scalars_load():
    snapshot = {"segments": [{"address": 1, "total_size": 2, "stream": 0, "segment_type": "small",
                              "blocks": [{"size": 2, "state": "inactive", "requested_size": 0}]}],
                "device_traces": [[{"action": "alloc", "addr": 1, "size": 2, "stream": 0, "t": 1.5,
                                    "b": b"x", "n": None, "ok": True, "tup": (1, 2)}]]}
    assert load_snapshot_bytes(pickle.dumps(snapshot)) == snapshot


def test_not_a_pickle(tmp_path):
    path = tmp_path / "x.pickle"
    path.write_text("hello")
    with pytest.raises(SnapshotError, match="not a readable pickle"):
        load_snapshot(str(path))
    with pytest.raises(SnapshotError, match="cannot read"):
        load_snapshot(str(tmp_path / "missing.pickle"))


@pytest.mark.parametrize("snapshot, message", [
    ({"no": "segments"}, "'segments' list"),
    ({"segments": [{"address": 1}]}, "segment 0 lacks"),
    ({"segments": [], "device_traces": [[{"action": "alloc", "addr": 1}]]}, "device 0 event 0 lacks size"),
    ({"segments": [], "device_traces": "x"}, "not a list"),
])
def test_snapshot_shape_is_checked(snapshot, message):
    with pytest.raises(SnapshotError, match=message):
        check_snapshot(snapshot)
