#!/bin/bash
# One GPU call of a campaign (campaigns/gpu_session.md): run on the lent GPU machine from the repository root,
# with the wheel set carried as .whl (../shared/tools/gpu-wheels .whl here) and $OUT set by the device tool.
#
#   HARNESS_GIT_SHA=<sha> HARNESS_GIT_DIRTY=0 bash campaigns/run_chunk.sh [--gpu-tests] [--budget-s 470] CHUNK|all ...
#
# 1. installs .whl/*.whl into /tmp/site once per machine (a marker makes later calls skip it: idempotent, ~0 s);
# 2. prints the environment (versions, GPU) without creating a CUDA context;
# 3. --gpu-tests: pytest -m gpu tests/harness/test_gpu.py (at most GPU_TESTS_TIMEOUT_S, default 200 s);
# 4. python -m harness.campaign run CHUNK... with the deadline START + budget (default 470 s: the whole call,
#    install and tests included, stays under 8 minutes; points are not started past it, one that overruns it by
#    60 s is cut and runs again next time).
# Everything comes back in $OUT (at most 8 files): runs.tar (run dirs + this call's table rows), summary.jsonl
# (one line per point), log.txt (this script's output), pytest.txt. Merge them on the development machine with
#   python -m harness.campaign merge <files_at>
set -uo pipefail
START=$(date +%s)
BUDGET_S=470
GPU_TESTS=0
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --budget-s) BUDGET_S=$2; shift 2 ;;
    --gpu-tests) GPU_TESTS=1; shift ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
[ ${#ARGS[@]} -gt 0 ] || { echo "usage: run_chunk.sh [--gpu-tests] [--budget-s S] CHUNK|all ..." >&2; exit 2; }
OUT=${OUT:-/tmp/llmem-out}
mkdir -p "$OUT"
PY=${PY:-python3}
exec > >(tee -a "$OUT/log.txt") 2>&1

# 1. wheels (the GPU image lacks deepspeed, hydra-core, omegaconf, ...; see ../shared/tools/gpu-wheels)
SITE=/tmp/site
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  STAMP="$SITE/.installed-$(ls .whl | md5sum | cut -c1-12)"
  if [ ! -f "$STAMP" ]; then
    t0=$(date +%s)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
      || { echo "wheel install failed" >&2; exit 3; }
    touch "$STAMP"
    echo "wheels: installed $(ls .whl | wc -l) into $SITE in $(( $(date +%s) - t0 )) s"
  else
    echo "wheels: already installed ($STAMP)"
  fi
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "wheels: no .whl/ carried (carry .whl when the image lacks hydra-core, deepspeed, ...)"
fi

# 2. environment: offline, fork-safe CUDA checks, quiet tokenizers
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1 PYTORCH_NVML_BASED_CUDA_CHECK=1
export LLMEM_CACHE_DIR=${LLMEM_CACHE_DIR:-/tmp/llmem-cache}
echo "git: ${HARNESS_GIT_SHA:-unknown sha} dirty=${HARNESS_GIT_DIRTY:-unknown}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: none"
"$PY" - <<'PYEOF'
import importlib.metadata as m
names = ("torch", "transformers", "deepspeed", "hydra-core", "omegaconf", "peft", "tokenizers", "nvidia-ml-py")
def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return "MISSING"
print("versions: " + ", ".join(f"{n} {version(n)}" for n in names))
PYEOF

# 3. GPU tests (first call of a session)
if [ "$GPU_TESTS" = 1 ]; then
  t0=$(date +%s)
  timeout "${GPU_TESTS_TIMEOUT_S:-200}" "$PY" -m pytest -m gpu tests/harness/test_gpu.py -q -rA 2>&1 \
    | tee "$OUT/pytest.txt" | tail -25
  echo "gpu tests: exit ${PIPESTATUS[0]} in $(( $(date +%s) - t0 )) s (full output: pytest.txt)"
fi

# 4. the chunks, until the deadline
UNTIL=$(( START + BUDGET_S ))
echo "campaign: $(( UNTIL - $(date +%s) )) s left of the ${BUDGET_S} s budget"
"$PY" -m harness.campaign --work /tmp/llmem-campaign run "${ARGS[@]}" --until "$UNTIL" --out "$OUT"
echo "run_chunk: exit $? after $(( $(date +%s) - START )) s"
