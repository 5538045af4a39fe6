#!/usr/bin/env bash
# The GPU evidence, in parts that each fit one device call (10 minutes): records as JSON under
# $OUT plus one log per part. Run on the device machine after staging CuTe DSL
# (../shared/device/stage, then call 1 `bash .dsl/p1/stash.sh`), as calls 2, 3, ...:
#   source .dsl/p2/env.sh && MUSEBENCH_GIT_COMMIT=<hash> bash scripts/device-evidence.sh PART
# (pass the commit from this machine: the device copy has no .git). PART:
#   facts       machine facts alone (GPUs, topology, P2P, musebench env)
#   tests       machine facts (GPUs, topology, P2P, musebench env) and `pytest -m gpu` outside
#               tests/kernels (harness, launcher, stock, CLI)
#   kernels     `pytest -m gpu tests/kernels` (the EP and TP tail and routing kernels); paths given
#               after the part replace tests/kernels
#   records     the one-GPU records: tail --tp 8 (and its EP tail as one kernel), tail --tp 4
#               --launcher torchrun, routing --tp 8
#   bench       bench tail (virtual ranks), bench routing and (ncu) the kernel durations of
#               scripts/profile-tail.py
#   parity      musebench parity scenarios/parity.toml
#   routing     the routing kernel's GPU tests, routing --tp 8, bench routing and (ncu) the kernel
#               durations of scripts/profile-routing.py
#   front       qkv_front's GPU tests, bench front with the cold-weight column, and (ncu, caches not
#               flushed between launches) each launch's duration and DRAM / L2 bytes
#               (scripts/profile-qkv-front.py, warm and cold weights; cold again without the MMAs,
#               --loads-only); FRONT_TREE=DIR (optional):
#               another musebench tree (e.g. `git archive front-profile musebench`, carried) benched
#               the same way, alternating with the checkout, for an A/B on one lease; then every
#               CTA's phases from the traced build (scripts/trace-qkv-front.py)
#   attn2       attn2's GPU tests (and the wgmma probe's), its split kernel's switches and tensor-core
#               paths side by side (scripts/sweep-attn2.py: exit 1 if one changes a bit; ATTN2_ISSUES
#               overrides the list), one or two splits a CTA at tp 4 / 8 / 16, the ring's depth at tp 16,
#               and bench attn (about 400 s)
#   attn2-order  the split order (attn2_layout.spread_splits) on one lease: scripts/sweep-attn2.py in
#               the deployment's order and the other one, alternating, two rounds each, without a window
#               (256 splits; the other order --grid-order) and with the 2048 window (64 splits; the other
#               order --spread-splits), then traced launches of the window's plan in both orders at tp 8
#               (about 400 s)
#   attn2-profile  where attn2's time goes: every CTA's phases from the traced build
#               (scripts/trace-attn2.py), and (ncu) the split and combine kernels' durations, the 128k
#               split kernel's pipe utilizations, its page stream alone (--loads-only, tp 8 and 16), both with
#               the pages in logical order (--sequential-pages), and its
#               stalls per setting (ATTN2_ISSUES as above)
#   floor       the read floor: the best plain read (Triton, swept; torch.sum) of qkv_front's weight
#               and attn2's K + V byte counts, cold and warm, as CUDA-graph medians (scripts/read-floor.py)
#   multi-gpu   one process per GPU (needs 2+ GPUs): tail (both EP forms) and bench tail
#               --launcher torchrun at tp = TP (default: every GPU; TP=2 or 4 on eight GPUs uses
#               the first TP)
#   ab          AB_TREE=DIR (AB_TP, AB_COMMIT, AB_ROUNDS): bench tail with an older musebench tree and
#               with the checkout, alternating AB_ROUNDS times (default 2), then `musebench report
#               --compare` of the last pair
#   multi-gpu-shared  two processes per GPU (their GPU tests, tail and bench tail at tp = 2 x GPUs)
#               and the fault runs at tp = GPUs (a killed and a silent rank)
# Every command runs under `timeout` so the call always returns; a failure is logged, the part
# goes on, and the exit status says whether anything failed. NVLink multicast stays off.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
part=${1:?usage: device-evidence.sh facts|tests|kernels|records|bench|parity|routing|front|attn2|attn2-order|attn2-profile|floor|multi-gpu|multi-gpu-shared|ab}
out=${OUT:-records/device-$(date -u +%Y%m%d-%H%M)}
mkdir -p "$out"
day=$(date -u +%Y-%m-%d)
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[-1].lower())" 2>/dev/null || echo gpu)
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
status=0
log="$out/$part.log"  # the device returns at most 8 files: 7 JSON records and this log
run() {  # run NAME SECONDS COMMAND...: append to the log, remember a failure, keep going
  local name=$1 limit=$2; shift 2
  local started=$SECONDS
  echo "== $name: $*" | tee -a "$log"
  timeout -s "${RUN_SIGNAL:-TERM}" -k 20 "$limit" "$@" >> "$log" 2>&1
  local code=$?
  [ $code -eq 0 ] || { echo "   $name failed with code $code (see $part.log)" | tee -a "$log"; status=1; }
  echo "   $name took $((SECONDS - started)) s" | tee -a "$log"
  tail -n 3 "$log"
}
expect_fault() {  # expect_fault NAME SECONDS PATTERN COMMAND...: must exit 1 and report PATTERN
  local name=$1 limit=$2 pattern=$3; shift 3
  local started=$SECONDS mark
  mark=$(wc -l < "$log" 2>/dev/null || echo 0)
  echo "== $name (must fail, reporting '$pattern'): $*" | tee -a "$log"
  timeout -k 10 "$limit" "$@" >> "$log" 2>&1
  local code=$?
  # the pattern may be in the table's diagnostic line or only in a rank's error in the JSON record
  if [ $code -eq 1 ] && { tail -n +"$((mark + 1))" "$log" | grep -q -- "$pattern" ||
                          grep -q -- "$pattern" "$out"/*"$name".json 2>/dev/null; }; then
    echo "   $name reported as expected (exit 1) in $((SECONDS - started)) s" | tee -a "$log"
  else
    echo "   $name: exit $code, expected 1 with '$pattern'" | tee -a "$log"; status=1
  fi
}
strays() {  # processes of a finished launch must be gone
  local left
  left=$(pgrep -fc 'musebench.harness.worker|torch.distributed.run' || true)
  echo "   stray musebench processes: ${left:-0}" | tee -a "$log"
  [ "${left:-0}" -eq 0 ] || status=1
}
gpu_tests() {  # gpu_tests NAME SECONDS PATHS...: pytest -m gpu with JUnit; one stuck test fails alone
  local name=$1 limit=$2; shift 2
  local per_test=()  # pytest-timeout, where installed: a stuck test fails and the summary is still written
  python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout "${TEST_TIMEOUT:-240}")
  # SIGINT at the limit: pytest stops its workers and still writes the summary and the JUnit file
  RUN_SIGNAL=INT run "$name" "$limit" python3 -m pytest -m gpu -q -rfE -n "${WORKERS:-16}" -p no:cacheprovider \
    "${per_test[@]}" --durations 15 --junitxml "$out/$name.xml" "$@"
}
facts() {  # the machine: GPUs, topology, peer access, musebench env (a multi-GPU lease's first call)
  run gpus 30 nvidia-smi
  run topology 30 nvidia-smi topo -m
  run p2p 60 python3 -c "import torch; n = torch.cuda.device_count(); print('gpus', n); [print(i, [torch.cuda.can_device_access_peer(i, j) if i != j else '-' for j in range(n)]) for i in range(n)]"
  local prefix=$gpu
  [ "$gpus" -gt 1 ] && prefix=${gpus}x$gpu
  run env 120 musebench env --json "$out/$day-$prefix-env.json"
}
case $part in
  facts)
    facts
    ;;
  tests)
    facts
    gpu_tests pytest-gpu "${PYTEST_LIMIT:-480}" --ignore tests/kernels
    ;;
  kernels)  # optional paths after the part narrow it (default: all of tests/kernels)
    shift
    gpu_tests pytest-gpu-kernels "${PYTEST_LIMIT:-540}" "${@:-tests/kernels}"
    ;;
  records)
    run tail-tp8 130 musebench tail --tp 8 --inputs random,adversarial --json "$out/$day-$gpu-tail-tp8.json"
    run tail-tp4-torchrun 120 musebench tail --tp 4 --launcher torchrun --json "$out/$day-$gpu-tail-tp4-torchrun.json"
    run tail-tp8-single 120 musebench tail --tp 8 --mode ep --ep-launch single --inputs random,adversarial \
      --json "$out/$day-$gpu-tail-tp8-single-launch.json"
    run routing 60 musebench routing --tp 8 --tile 8,64 --inputs random,adversarial --seeds 2 \
      --json "$out/$day-$gpu-routing-tp8.json"
    ;;
  bench)
    run bench-tail 300 musebench bench tail --tp 2,4,8 --tokens 1,2,4,8 --json "$out/$day-$gpu-bench-tail-virtual.json"
    run bench-routing 60 musebench bench routing --json "$out/$day-$gpu-bench-routing.json"
    # kernel durations (Nsight Compute, where it reads the counters): the EP publisher vs the finalize
    if command -v ncu > /dev/null; then
      run ncu-tail 180 ncu --clock-control none --metrics gpu__time_duration.sum python3 scripts/profile-tail.py
    fi
    ;;
  parity)
    run parity 400 musebench parity scenarios/parity.toml --json "$out/$day-$gpu-parity.json"
    ;;
  routing)
    gpu_tests pytest-routing 300 tests/kernels/test_routing_gpu.py tests/stock/test_triton_routing.py \
      tests/stock/test_triton_metadata.py tests/harness/test_routing.py
    run routing 60 musebench routing --tp 8 --tile 8,64 --inputs random,adversarial --seeds 2 \
      --json "$out/$day-$gpu-routing-tp8.json"
    run bench-routing 60 musebench bench routing --json "$out/$day-$gpu-bench-routing.json"
    # kernel durations (Nsight Compute, where it reads the counters): inside the GPU vs the whole call
    if command -v ncu > /dev/null; then
      run ncu-routing 180 ncu --clock-control none --metrics gpu__time_duration.sum python3 scripts/profile-routing.py
    else
      echo "== ncu-routing: no ncu on this machine" | tee -a "$log"
    fi
    ;;
  front)
    gpu_tests pytest-front 300 tests/kernels/test_qkv_front_gpu.py tests/cases/test_qkv_front.py
    rounds=1
    [ -n "${FRONT_TREE:-}" ] && rounds=2
    for round in $(seq 1 "$rounds"); do
      run "bench-front-$round" 200 musebench bench front --cold-weights --json "$out/$day-$gpu-bench-front-$round.json"
      if [ -n "${FRONT_TREE:-}" ]; then
        run "bench-front-tree-$round" 200 env -C "$FRONT_TREE" MUSEBENCH_GIT_COMMIT="${FRONT_COMMIT:-tree}" \
          musebench bench front --cold-weights --json "$out/$day-$gpu-bench-front-tree-$round.json"
      fi
    done
    if command -v ncu > /dev/null; then
      run ncu-front 200 ncu --cache-control none --clock-control none --kernel-name regex:QkvFront \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum,lts__t_sector_hit_rate.pct \
        python3 scripts/profile-qkv-front.py
      # the same launches without the MMAs (the stream, the reduction and the epilogue): what the arithmetic costs
      run ncu-front-loads-only 200 ncu --cache-control none --clock-control none --kernel-name regex:QkvFront \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
        python3 scripts/profile-qkv-front.py --loads-only --l2 cold
    else
      echo "== ncu-front: no ncu on this machine" | tee -a "$log"
    fi
    # every CTA's phases in a graph of cold-weight launches (the traced build's clocks)
    run trace-front 150 python3 scripts/trace-qkv-front.py --json "$out/$day-$gpu-trace-front.json"
    ;;
  attn2)
    gpu_tests pytest-attn2 300 tests/kernels/test_attn2_gpu.py tests/kernels/test_gmma_probe_gpu.py tests/cases/test_attn2.py
    issues=${ATTN2_ISSUES:-all@sync,all,auto}
    run sweep-attn2 200 python3 scripts/sweep-attn2.py --splits 256 --tp 8,16 --lengths 8192,32768,131072 \
      --issue "$issues" --json "$out/$day-$gpu-sweep-attn2.json"
    # one or two sibling splits a CTA (Attn2Build.splits_per_cta; auto: the deployment's, two at tp 4):
    # the same bits either way, head 0's bits across tp
    run sweep-attn2-splits 200 python3 scripts/sweep-attn2.py --splits 256 --tp 4,8,16 --lengths 2048,32768,131072 \
      --splits-per-cta 1,auto --json "$out/$day-$gpu-sweep-attn2-splits.json"
    # the ring's depth at one KV head (tp 16: two split CTAs an SM), 8 / 16 / 24 stages and the deployment's: same bits
    run sweep-attn2-ring 150 python3 scripts/sweep-attn2.py --splits 256 --tp 16 --lengths 8192,32768,131072 \
      --ring-stages 8,16,24,auto --json "$out/$day-$gpu-sweep-attn2-ring.json"
    run bench-attn 200 musebench bench attn --json "$out/$day-$gpu-bench-attn.json"
    ;;
  attn2-order)  # the deployment's split order against the other, same lease, without and with the window
    order_runs="$out/order-runs"  # the sweeps' JSON, merged below into one record (the device returns 8 files)
    mkdir -p "$order_runs"
    for round in 1 2; do
      run "sweep-order-deployed-$round" 60 python3 scripts/sweep-attn2.py --splits 256 --issue auto --tp 8,16 \
        --lengths 8,128,512,2048,32768,131072 --json "$order_runs/deployed-$round.json"
      run "sweep-order-grid-$round" 60 python3 scripts/sweep-attn2.py --splits 256 --issue auto --tp 8,16 \
        --lengths 8,128,512,2048,32768,131072 --grid-order --json "$order_runs/grid-$round.json"
      run "sweep-window-deployed-$round" 50 python3 scripts/sweep-attn2.py --splits 64 --issue auto --tp 8,16 \
        --window 2048 --lengths 8,512,2048,8192,131072 --json "$order_runs/window-deployed-$round.json"
      run "sweep-window-spread-$round" 50 python3 scripts/sweep-attn2.py --splits 64 --issue auto --tp 8,16 \
        --window 2048 --lengths 8,512,2048,8192,131072 --spread-splits --json "$order_runs/window-spread-$round.json"
    done
    run merge-order-runs 30 python3 -c "import json, pathlib, sys; d = pathlib.Path(sys.argv[1]); \
json.dump({p.stem: json.loads(p.read_text()) for p in sorted(d.glob('*.json'))}, open(sys.argv[2], 'w'))" \
      "$order_runs" "$out/$day-$gpu-sweep-attn2-order.json"
    rm -rf "$order_runs"
    for order in --grid-order --spread-splits; do
      run "trace-window$order" 60 python3 scripts/trace-attn2.py --tp 8 --lengths 512,8192 --window 2048 $order
    done
    ;;
  attn2-profile)  # a call of its own: with attn2's tests and sweeps it would pass one call's 600 s
    issues=${ATTN2_ISSUES:-all@sync,all,auto}
    # every split and combine CTA's phases in a graph of back-to-back launches (the traced build's clocks)
    run trace-attn2 120 python3 scripts/trace-attn2.py --json "$out/$day-$gpu-trace-attn2.json"
    if command -v ncu > /dev/null; then
      # the split and the combine kernel's durations, one launch at a time (tp 8)
      run ncu-attn2-kernels 120 ncu --clock-control none -k regex:Attn2 --metrics gpu__time_duration.sum \
        python3 scripts/profile-attn2.py --lengths 8192,131072
      # which of the SM's pipes the 128k split kernel keeps busy (tensor, MUFU, FMA, ALU, LSU) and how full
      # shared memory and DRAM run: what bounds its pages an SM a microsecond
      run ncu-attn2-pipes 120 ncu --clock-control none -k regex:Attn2Kernel --launch-skip 1 --launch-count 1 \
        --metrics "regex:sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active,regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum" \
        python3 scripts/profile-attn2.py --lengths 131072
      # the split kernel's page stream alone (no MMA, no softmax): the ceiling the memory side sets at 128k
      # and with the request's pages in logical order (--sequential-pages): what scattering 4 KB pages costs
      for tp in 8 16; do
        for what in --loads-only "--loads-only --sequential-pages" --sequential-pages; do
          run "ncu-attn2-tp$tp${what//[ -]/_}" 90 ncu --clock-control none -k regex:Attn2Kernel --launch-skip 1 \
            --launch-count 1 --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum \
            python3 scripts/profile-attn2.py --tp "$tp" --lengths 131072 $what
        done
      done
      for issue in ${issues//,/ }; do
        run "ncu-attn2-$issue" 120 ncu --clock-control none -k regex:Attn2Kernel --launch-skip 1 --launch-count 1 \
          --metrics "regex:smsp__warp_issue_stalled_.*_per_warp_active.pct,gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.per_cycle_active,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__inst_executed.sum" \
          python3 scripts/profile-attn2.py --lengths 131072 --issue "$issue"
      done
    else
      echo "== ncu-attn2: no ncu on this machine" | tee -a "$log"
    fi
    ;;
  floor)
    run read-floor 200 python3 scripts/read-floor.py --json "$out/$day-$gpu-read-floor.json"
    ;;
  multi-gpu)  # TP=N (default: every GPU) runs on the first N GPUs, one process each
    tp=${TP:-$gpus}
    [ "$tp" -ge 2 ] && [ "$tp" -le "$gpus" ] || { echo "multi-gpu needs 2 <= TP <= GPUs ($gpus), got $tp"; exit 2; }
    [ "$tp" -eq "$gpus" ] || export CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((tp - 1)))
    run tail-own-gpu 150 musebench tail --tp "$tp" --launcher torchrun --inputs random,adversarial \
      --json "$out/$day-${tp}x$gpu-tail-tp$tp-torchrun.json"
    strays
    run bench-own-gpu 200 musebench bench tail --tp "$tp" --launcher torchrun --weights bf16,fp32 \
      --json "$out/$day-${tp}x$gpu-bench-tail-tp$tp-torchrun.json"
    strays
    run tail-own-gpu-single 120 musebench tail --tp "$tp" --launcher torchrun --mode ep --ep-launch single \
      --inputs random,adversarial --json "$out/$day-${tp}x$gpu-tail-tp$tp-torchrun-single-launch.json"
    strays
    ;;
  multi-gpu-shared)
    [ "$gpus" -ge 2 ] || { echo "multi-gpu-shared needs 2+ GPUs, found $gpus"; exit 2; }
    gpu_tests pytest-two-per-gpu 150 tests/harness/test_launch_gpu.py -k "two_processes_per_gpu or opened_on_this_device"
    # the driver time-slices two processes on a GPU (no MPS): on four H200s a tp 8 case takes 5-10 s
    # (48 cases ran past 120 s), so fewer cases and a longer limit; the bench only shows it runs
    run tail-two-per-gpu "${SHARED_TAIL_LIMIT:-360}" musebench tail --tp $((2 * gpus)) --launcher torchrun \
      --inputs random,adversarial --tokens 1,8 --json "$out/$day-${gpus}x$gpu-tail-tp$((2 * gpus))-torchrun.json"
    strays
    run bench-two-per-gpu 200 musebench bench tail --tp $((2 * gpus)) --launcher torchrun --tokens 1 --calls 5 \
      --replays 5 --json "$out/$day-${gpus}x$gpu-bench-tail-tp$((2 * gpus))-torchrun.json"
    strays
    # fault runs: each must fail within its --timeout with a named rank, and leave nothing behind
    expect_fault fault-killed 90 "rank 1 exited with code 17" musebench tail --tp "$gpus" --launcher torchrun --mode ep --tokens 2 --weights bf16 \
      --norm before --timeout 2 --inject "exit:1" --json "$out/$day-${gpus}x$gpu-fault-killed.json"
    strays
    expect_fault fault-silent 90 "timed out" musebench tail --tp "$gpus" --launcher torchrun --mode both --tokens 2 --weights bf16 \
      --norm before --timeout 2 --inject "silent:1" --json "$out/$day-${gpus}x$gpu-fault-silent.json"
    strays
    ;;
  ab)  # AB_TREE=DIR: a musebench package tree to compare with (for example `git archive REF musebench`
       # unpacked under an ignored _scratch* folder, carried), benched alternately with the checkout
    tree=$(cd "${AB_TREE:?ab needs AB_TREE, a directory holding a musebench package}" && pwd)
    tp=${AB_TP:-2}
    args=(bench tail --tp "$tp" --tokens 1,2,4,8 --weights bf16)
    [ "$gpus" -ge "$tp" ] && args+=(--launcher torchrun)
    run ab-tree 30 env -C "$tree" python3 -c "import musebench; print('base tree:', musebench.__file__)"
    rounds=${AB_ROUNDS:-2}
    for round in $(seq 1 "$rounds"); do  # alternating, so a drift of the machine shows as a difference between rounds
      # run from inside the tree: python -m puts the working directory first on sys.path (torchrun's
      # workers inherit it), ahead of the checkout that env.sh put on PYTHONPATH
      run "ab-base-$round" 200 env -C "$tree" MUSEBENCH_GIT_COMMIT="${AB_COMMIT:-base}" \
        musebench "${args[@]}" --json "$out/ab-base-$round.json"
      run "ab-head-$round" 200 musebench "${args[@]}" --json "$out/ab-head-$round.json"
    done
    run ab-report 60 musebench report "$out/ab-head-$rounds.json" --compare "$out/ab-base-$rounds.json" --side-by-side  # fails where the checkout is > 5 % slower
    ;;
  *) echo "unknown part $part"; exit 2 ;;
esac
exit $status
