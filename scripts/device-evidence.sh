#!/usr/bin/env bash
# One device call that brings back the GPU evidence: `pytest -m gpu`, the parity runs and the
# benches, as JSON under $OUT (records) plus the logs. Run on the device machine after staging
# CuTe DSL (../shared/device/stage, then call 1 `bash .dsl/p1/stash.sh`), as call 2:
#   source .dsl/p2/env.sh && MUSEBENCH_GIT_COMMIT=$(git rev-parse HEAD) bash scripts/device-evidence.sh [quick]
# (pass the commit from this machine: the device copy has no .git). `quick` skips the long runs.
set -uo pipefail
out=${OUT:-records/device-$(date -u +%Y%m%d-%H%M)}
mkdir -p "$out"
day=$(date -u +%Y-%m-%d)
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[-1].lower())" 2>/dev/null || echo gpu)
status=0
# The device returns at most 8 files: 7 JSON records and one log holding every command's output.
log="$out/evidence.log"
run() {  # run NAME COMMAND...: append to the log, remember a failure, keep going
  local name=$1; shift
  echo "== $name: $*" | tee -a "$log"
  "$@" >> "$log" 2>&1 || { echo "   $name failed (see evidence.log)"; status=1; }
  tail -n 2 "$log"
}
run env musebench env --json "$out/$day-$gpu-env.json"
run pytest-gpu python3 -m pytest -m gpu -q -n 8 -p no:cacheprovider
run tail-tp8 musebench tail --tp 8 --inputs random,adversarial --json "$out/$day-$gpu-tail-tp8.json"
run bench-tail musebench bench tail --tp 2,4,8 --weights bf16,fp32 --json "$out/$day-$gpu-bench-tail.json"
run routing musebench routing --tp 8 --tile 8,64 --json "$out/$day-$gpu-routing-tp8.json"
run bench-routing musebench bench routing --json "$out/$day-$gpu-bench-routing.json"
if [ "${1:-}" != quick ]; then
  run parity-ep musebench parity scenarios/gpu-ep.toml --json "$out/$day-$gpu-parity-ep.json"
  run tail-torchrun musebench tail --tp 4 --launcher torchrun --json "$out/$day-$gpu-tail-tp4-torchrun.json"
fi
exit $status
