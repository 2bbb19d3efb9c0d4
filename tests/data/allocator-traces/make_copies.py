"""Make the small copies of real allocator traces the tests replay (run from the repository root).

Each copy keeps only what the replay reads — per event: action, addr, size, stream (oom: device_free);
per segment: device, address, total_size, stream, segment_type, is_expandable and its blocks' address,
size, state, requested_size; allocator_settings — and drops stack frames and timestamps. The sources
are read with the restricted loader; the copies hold builtin containers and scalars only.

    PYTHONPATH=$PWD python tests/data/allocator-traces/make_copies.py /work/shared/data/allocator-traces
"""

import pathlib
import pickle
import sys

from estimator.allocator.snapshot import check_snapshot, load_snapshot

COPIES = {  # source (under the traces folder) -> copy name
    "silmont2000+assignment2-systems/b61be409_mem_snapshot.pickle": "silmont2000_b61be409_cold.pickle",
    "silmont2000+assignment2-systems/769df2d4_memory_forward_fp32_128.pickle": "silmont2000_769df2d4_warm.pickle",
    "Maphsge4+select_n/ec5be110_snapshot.pickle": "maphsge4_ec5be110_oom_retry.pickle",
    "Maphsge4+select_n/bdf4fe2e_snapshot.pickle": "maphsge4_bdf4fe2e_state_only.pickle",
    "Constructor-Sun+code_location/b5ef67ce_memory_snapshot.pickle": "constructor_sun_b5ef67ce_expandable.pickle",
    "Charan6924+assignment2-systems/075dd064_memory_snapshot.pickle": "charan6924_075dd064_training.pickle",
    "Wedsonlin+assignment2-systems/medium_512_training_memory_snapshot.pickle":
        "wedsonlin_medium_512_training_warm.pickle",
}
_EVENT_KEYS = ("action", "addr", "size", "stream", "device_free")
_SEGMENT_KEYS = ("device", "address", "total_size", "stream", "segment_type", "is_expandable")
_BLOCK_KEYS = ("address", "size", "state", "requested_size")


def _keep(item, keys):
    return {k: item[k] for k in keys if k in item}


def minimal(snapshot):
    out = {"segments": [dict(_keep(s, _SEGMENT_KEYS), blocks=[_keep(b, _BLOCK_KEYS) for b in s["blocks"]])
                        for s in snapshot["segments"]],
           "device_traces": [[_keep(e, _EVENT_KEYS) for e in trace] for trace in snapshot["device_traces"]]}
    if snapshot.get("allocator_settings"):
        out["allocator_settings"] = snapshot["allocator_settings"]
    return out


def main(source_dir):
    here = pathlib.Path(__file__).parent
    for source, name in COPIES.items():
        snapshot = check_snapshot(load_snapshot(str(pathlib.Path(source_dir) / source)))
        data = pickle.dumps(minimal(snapshot), protocol=4)
        (here / name).write_bytes(data)
        print(f"{name}: {len(data)} bytes from {source}")


if __name__ == "__main__":
    main(sys.argv[1])
