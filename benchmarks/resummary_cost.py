"""CPU seconds a loader that re-summarises every profile spends (the load path before ``summary_rule``):
``vocab.with_hook_moments`` over the profiles one cold opt-125m paper plan loads, timed on their versions from
before ``python -m estimator.profiler.ship --resummarise`` (a directory of them).

    git archive 9206ba3 estimator/profiles | tar -x -C /tmp/old
    LLMEM_CACHE_DIR=$(mktemp -d) PYTHONPATH=$PWD python benchmarks/resummary_cost.py /tmp/old/estimator/profiles
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main(old_dir: Path) -> int:
    from estimator.models import profiles as store
    from estimator.planning.plan import plan
    from estimator.profiler.vocab import with_hook_moments

    loaded: set[str] = set()
    read = store._read.__wrapped__

    def recording(path: str) -> dict:
        loaded.add(Path(path).name)
        return read(path)

    store._read = recording  # find_profile looks it up in the module: every profile the plan loads
    plan("facebook/opt-125m", gpus=4, gpu="v100-16gb", seq_len=512)
    old = [json.loads((old_dir / name).read_text()) for name in sorted(loaded)]
    started = time.process_time()
    for profile in old:
        with_hook_moments(profile)
    print(f"{len(old)} profiles loaded; re-summarising them: {time.process_time() - started:.2f} s CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
