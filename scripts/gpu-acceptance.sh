#!/usr/bin/env bash
# The GPU acceptance, on a machine with one CUDA GPU or more: the gpu-marked tests, then the
# measurements, every step bounded in time by coreutils `timeout`, in under 8 minutes in all.
#
# usage: scripts/gpu-acceptance.sh [--cpu] OUT_DIR [STEP ...]
#   STEP: tests overhead table1 bench messages multigpu (default: all, in this order); naming some runs
#   only those. A step that fails or runs past its bound is recorded as such and the others go on.
#
#   tests     pytest tests/gpu -m gpu (nothing may be skipped)
#   overhead  engine at K=1 against a hand-written loop with gradient accumulation, bf16 and fp32,
#             batches 8, 32, 128, M = 1, 4, 16, with and without rematerialization; the CUDA
#             synchronisations of one engine step (scripts/gpu_measure.py overhead)
#   table1    profile-memory --budget <free GPU memory>, then one training step of each model found on
#             the GPU (gpu_measure.py fits)
#   bench     gpipe bench, K = 2 and 4 sharing the GPU, M = 32 (each with its own K=1)
#   messages  seconds per message through host memory (gpu_measure.py messages)
#   multigpu  with 2 or more GPUs: gpipe train at K=2 under torchrun (NCCL) with each schedule, messages
#             of 16 MiB between stages; K=2 x D=2 with 4 or more GPUs; a translation model evaluated with
#             greedy decoding (BLEU). With one GPU: one line, and the step is skipped, not failed.
#
# OUT_DIR receives 5 files: acceptance.log (every step's output), junit.xml (tests), steps.jsonl (each
# step's status, exit code, seconds and bound), raw.json (each measurement's own JSON, by name) and
# figures.json (every figure, collected by scripts/gpu_figures.py). Run again with other steps into the
# same OUT_DIR, the log, steps.jsonl and raw.json keep the earlier run's too.
#
# --cpu checks this script itself where there is no GPU: every step at tiny sizes on the CPU (the gpu
# tests are skipped there, and allowed to be). GPU_ACCEPTANCE_GPUS=N pretends N GPUs for the multigpu
# step's choice (--cpu only: N >= 2 runs its ranks on the CPU). GPU_ACCEPTANCE_BOUND_SCALE=X multiplies
# every time bound (a slower machine; or a small X to see a step time out).
#
# Without network: wheels/ (from scripts/gpu-wheels.sh) is installed first when present.
# Exits non-zero, naming the failed steps, when any step failed or ran past its bound.
set -uo pipefail

usage() {
    echo "usage: scripts/gpu-acceptance.sh [--cpu] OUT_DIR [tests|overhead|table1|bench|messages|multigpu ...]" >&2
    exit 2
}
CPU=0
if [ "${1:-}" = "--cpu" ]; then CPU=1; shift; fi
[ $# -ge 1 ] || usage
OUT=$1; shift
ALL=(tests overhead table1 bench messages multigpu)
STEPS=("$@")
[ ${#STEPS[@]} -gt 0 ] || STEPS=("${ALL[@]}")
for s in "${STEPS[@]}"; do
    [[ " ${ALL[*]} " == *" $s "* ]] || { echo "gpu-acceptance: unknown step '$s' (allowed: ${ALL[*]})" >&2; exit 2; }
done
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
cd "$ROOT" || exit 1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# Time bounds in seconds of each command (coreutils timeout, then SIGKILL 20 s later), each next to the
# estimate of its time on one H100 80GB (torch 2.11, CUDA 13). They add up to 475 s, under the 480 s
# (8 minutes) the acceptance may take, multigpu's included although one GPU skips it. To fit, the
# overhead model is 4 layers (not 8) of d_model 1024 at seq 512, measured in 3 rounds of 2 steps a side
# after 1 warm-up step, and the step stops starting configurations 25 s before its bound (the goals'
# rows first, fp32 at batch 128 last); multigpu trains 4 steps per run, each run within 30 s.
declare -A BOUND=(
    [wheels]=15               # est 5: pip from wheels/ (pydantic and its few wheels), only when present
    [setup]=10                # est 4: one Python start: CUDA, gpipe's imports, GPUs and free memory
    [tests]=180               # est 90: 15 gpipe runs and commands on the GPU (tests/gpu/test_cuda.py)
    [overhead]=75             # est 85: 5 s to start, the goal rows ~40 s, then the others until the budget
    [table1-amoebanet]=20     # est 8: per-layer accounting of small members, scaled (on the CPU)
    [table1-transformer]=20   # est 8
    [fits-amoebanet]=25       # est 12: two AmoebaNet-D built on the CPU, one step each at batch 128
    [fits-transformer]=35     # est 25: 0.6B and 2.6B parameters built, one fp32 step of 32 x 1024 tokens
    [bench-k2]=20             # est 12: 2 ranks and K=1 in-process, 3 + 10 steps each
    [bench-k4]=25             # est 16: 4 ranks sharing the GPU
    [messages]=25             # est 8: 2 x 2 ranks, 4 sizes x 50 messages
    [multigpu]=80             # est 75 with 2 GPUs: 5 runs of ~15 s (start, NCCL, 4 steps); 0 with one GPU
    [figures]=10              # est 3: merging the raw files and writing figures.json
)
MULTIGPU_RUN_BOUND=30
SCALE=${GPU_ACCEPTANCE_BOUND_SCALE:-1}
bound() { awk -v b="${BOUND[$1]}" -v s="$SCALE" 'BEGIN { v = int(b * s + 0.5); print (v < 1 ? 1 : v) }'; }

WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-acceptance.XXXXXX") || exit 1
trap 'rm -rf "$WORK"' EXIT
RAW=$WORK/raw  # each measurement's own JSON file, merged into OUT_DIR/raw.json at the end
mkdir -p "$RAW"
LOG=$WORK/setup.log  # until OUT_DIR is made: a machine that cannot run the acceptance leaves nothing there

if [ "$CPU" = 0 ] && compgen -G "$ROOT/wheels/*.whl" >/dev/null; then
    echo "gpu-acceptance: installing the dependencies from wheels/ (offline)" | tee -a "$LOG"
    timeout -k 5 "$(bound wheels)" "$PY" -m pip install --quiet --no-index --find-links "$ROOT/wheels" \
        -r "$ROOT/wheels/requirements.txt" 2>&1 | tee -a "$LOG"
    if [ "${PIPESTATUS[0]}" != 0 ]; then
        echo "gpu-acceptance: installing from wheels/ failed (see above)" | tee -a "$LOG" >&2
        exit 1
    fi
fi
# One Python start: exit 3 without CUDA, 4 without gpipe's dependencies or pytest; else "GPUS FREE_BYTES"
# (table1's budget is the memory a process can use: the card's, less what the CUDA context takes).
setup=$(timeout -k 5 "$(bound setup)" "$PY" - "$CPU" 2>>"$LOG" <<'PYEOF'
import sys
try:
    import torch
except ImportError:
    print("torch is not importable")
    sys.exit(3)
if sys.argv[1] == "0" and not torch.cuda.is_available():
    print(f"torch {torch.__version__}")
    sys.exit(3)
try:
    import gpipe_cli.cli  # noqa: F401
    import pytest  # noqa: F401
except ImportError as exc:
    print(exc)
    sys.exit(4)
print(*((torch.cuda.device_count(), torch.cuda.mem_get_info(0)[0]) if sys.argv[1] == "0" else (0, 0)))
PYEOF
)
case $? in
    0) ;;
    3) echo "gpu-acceptance: no CUDA GPU is visible to torch ($setup): run it on a machine with one CUDA GPU" \
           | tee -a "$LOG" >&2
       exit 1 ;;
    4) echo "gpu-acceptance: gpipe-cli's dependencies or pytest are missing ($setup): run scripts/gpu-wheels.sh" \
            "wheels on a machine with network and bring wheels/ here" | tee -a "$LOG" >&2
       exit 1 ;;
    *) echo "gpu-acceptance: checking the machine failed or took over $(bound setup) s: $(tail -n 3 "$LOG")" >&2
       exit 1 ;;
esac
read -r GPUS GPU_MEMORY <<< "$setup"
if [ "$CPU" = 1 ]; then
    DEVICE=cpu
    GPUS=${GPU_ACCEPTANCE_GPUS:-0}
else
    DEVICE=cuda
fi
mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd)
cat "$LOG" >> "$OUT/acceptance.log"
LOG=$OUT/acceptance.log
RECORDS=$OUT/steps.jsonl
figures() {
    timeout -k 5 "$(bound figures)" "$PY" scripts/gpu_figures.py "$OUT" --raw "$RAW" 2>&1 | tee -a "$LOG"
    return "${PIPESTATUS[0]}"
}
# Stopped from outside: keep what was measured.
trap 'echo "gpu-acceptance: stopped; collecting what was measured" | tee -a "$LOG" >&2; figures; exit 130' INT TERM
echo "gpu-acceptance: $(date -u +%Y-%m-%dT%H:%M:%SZ) steps: ${STEPS[*]}$([ "$CPU" = 1 ] && echo ' (--cpu: tiny sizes on the CPU)')" \
    >> "$LOG"
total=0
for s in "${!BOUND[@]}"; do total=$((total + $(bound "$s"))); done
echo "gpu-acceptance: $GPUS GPU(s); the time bounds add up to ${total} s" | tee -a "$LOG"
FAILED=()

now() { date +%s.%N; }
# record NAME STATUS CODE SECONDS [WHY]: one line of steps.jsonl.
record() {
    printf '{"step": "%s", "status": "%s", "exit_code": %s, "seconds": %.1f, "bound_s": %s%s}\n' \
        "$1" "$2" "$3" "$4" "$(bound "$1")" "${5:+, \"why\": \"$5\"}" >> "$RECORDS"
}
# step NAME COMMAND...: run it within its bound, append its output to the log, record how it ended, go on.
step() {
    local name=$1; shift
    local limit started code seconds status
    limit=$(bound "$name")
    echo "== $name (bound $limit s): $*" | tee -a "$LOG"
    started=$(now)
    timeout -k 20 "$limit" "$@" 2>&1 | tee -a "$LOG"
    code=${PIPESTATUS[0]}
    seconds=$(awk -v a="$started" -v b="$(now)" 'BEGIN { print b - a }')
    case $code in
        0) status=passed ;;
        124|137) status="timed out" ;;
        *) status=failed ;;
    esac
    record "$name" "$status" "$code" "$seconds"
    if [ "$status" != passed ]; then
        FAILED+=("$name")
        echo "gpu-acceptance: step $name $status (exit code $code) after ${seconds%.*} s" | tee -a "$LOG" >&2
    fi
}
skip() {  # skip NAME WHY
    echo "$1: $2: skipped" | tee -a "$LOG"
    record "$1" skipped 0 0 "$2"
}
GPIPE=("$PY" -m gpipe_cli.cli)  # an array, not a function: `timeout` runs programs
wants() { [[ " ${STEPS[*]} " == *" $1 "* ]]; }

if wants tests; then
    # `-o addopts=-ra` drops the suite's xdist options, so the run needs no xdist; with xdist (its wheel comes
    # with the others), up to 6 workers share the GPU: the tests are mostly process starts, small on the GPU.
    workers=()
    if "$PY" -c 'import xdist' >/dev/null 2>&1; then
        workers=(-n "$(( $(nproc) / 2 < 6 ? ($(nproc) / 2 > 1 ? $(nproc) / 2 : 1) : 6 ))" --dist load)
    fi
    step tests "$PY" -m pytest tests/gpu -m gpu -p no:cacheprovider -o addopts=-ra -q --durations 12 "${workers[@]}" \
        --junitxml "$OUT/junit.xml"
    # On a GPU machine nothing may be skipped: a skip would hide a path that did not run.
    skipped=$("$PY" -c 'import sys, xml.etree.ElementTree as ET
print(sum(int(s.get("skipped", 0)) for s in ET.parse(sys.argv[1]).getroot().iter("testsuite")))' \
        "$OUT/junit.xml" 2>/dev/null || echo "unknown")
    if [ "$CPU" = 0 ] && [ "$skipped" != 0 ]; then
        FAILED+=(tests-skipped)
        echo "gpu-acceptance: $skipped gpu test(s) were skipped or unreadable in $OUT/junit.xml" | tee -a "$LOG" >&2
    fi
fi
if wants overhead; then
    if [ "$CPU" = 1 ]; then
        sizes=(--layers 2 --d-model 32 --ff 64 --heads 2 --seq-len 16 --vocab-size 128 --batches 4 --microbatches 1,4
               --precisions bf16 --steps 1 --warmup 1 --rounds 1 --sync-batch 4)
    else
        # ~67M parameters: ~0.2 TFLOP a sample (6 x parameters x 512 tokens), ~1500 samples/s in bf16 and
        # ~250 in fp32 (TF32 off, torch's default); 26 rows of 2 x 7 steps each.
        sizes=(--layers 4 --d-model 1024 --ff 4096 --heads 16 --seq-len 512 --vocab-size 8192 --batches 8,32,128
               --microbatches 1,4,16 --precisions bf16,fp32 --checkpoint never,except_last --steps 2 --warmup 1
               --rounds 3 --sync-batch 32 --sync-microbatches 4)
    fi
    step overhead "$PY" scripts/gpu_measure.py overhead --device "$DEVICE" "${sizes[@]}" \
        --budget-s "$(( $(bound overhead) > 40 ? $(bound overhead) - 15 : $(bound overhead) / 2 ))" \
        --json "$RAW/overhead.json"
fi
if wants table1; then
    # The families' sizes and batches of the paper's Table 1, within this GPU's memory.
    if [ "$CPU" = 1 ]; then
        amoeba=(--budget 200MiB --microbatches 2 --batch-size 8 --image-size 32 --num-classes 10)
        trans=(--budget 100MiB --microbatches 2 --batch-size 4 --d-model 64 --ff 256 --heads 4 --vocab-size 512
               --seq-len 32)
    else
        amoeba=(--budget "$GPU_MEMORY" --microbatches 8 --batch-size 128 --image-size 224 --num-classes 1000)
        trans=(--budget "$GPU_MEMORY" --microbatches 8 --batch-size 32 --d-model 2048 --ff 8192 --heads 32
               --vocab-size 32000 --seq-len 1024)
    fi
    common=(--partitions 1 --checkpoint except_last --schedule gpipe --optimizer rmsprop --device "$DEVICE")
    step table1-amoebanet "${GPIPE[@]}" profile-memory --model amoebanet "${amoeba[@]}" "${common[@]}" \
        --json "$RAW/table1-amoebanet.json"
    step table1-transformer "${GPIPE[@]}" profile-memory --model transformer "${trans[@]}" "${common[@]}" \
        --json "$RAW/table1-transformer.json"
    for kind in amoebanet transformer; do
        if [ -f "$RAW/table1-$kind.json" ]; then
            step "fits-$kind" "$PY" scripts/gpu_measure.py fits --device "$DEVICE" --table "$RAW/table1-$kind.json" \
                --json "$RAW/fits-$kind.json"
        else
            skip "fits-$kind" "no table1-$kind figures to train"
        fi
    done
fi
if wants bench; then
    if [ "$CPU" = 1 ]; then
        ks=(2)
        sizes=(--layers 2 --d-model 32 --ff 64 --heads 2 --seq-len 16 --vocab-size 128 --microbatches 4 --batch-size 8
               --steps 2 --warmup 1)
    else
        ks=(2 4)
        sizes=(--layers 8 --d-model 1024 --ff 4096 --heads 16 --seq-len 256 --vocab-size 8192 --microbatches 32
               --batch-size 128 --steps 10 --warmup 3)
    fi
    for k in "${ks[@]}"; do
        step "bench-k$k" "${GPIPE[@]}" bench --model transformer --set arch=decoder-only --set dropout=0 "${sizes[@]}" \
            --partitions "$k" --checkpoint except_last --schedule gpipe --json "$RAW/bench-k$k.json"
    done
fi
if wants messages; then
    if [ "$CPU" = 1 ]; then sizes=(--sizes 65536,1048576 --count 5); else
        sizes=(--sizes 65536,1048576,4194304,16777216 --count 50); fi
    step messages "$PY" scripts/gpu_measure.py messages --device "$DEVICE" "${sizes[@]}" --json "$RAW/messages.json"
fi
if wants multigpu; then
    if [ "$GPUS" -lt 2 ]; then
        skip multigpu "needs two GPUs, this machine has $GPUS"
    else
        if [ "$CPU" = 1 ]; then
            sizes=(--layers 2 --d-model 32 --ff 64 --heads 2 --seq-len 16 --micro-batch 2 --microbatches 2 --steps 2
                   --synthetic-size 64 --translation-size 256)
        else
            # Boundary activation per micro-batch: 8 x 512 x 1024 x 4 B = 16 MiB (fp32), over 8 MiB.
            sizes=(--layers 4 --d-model 1024 --ff 4096 --heads 16 --seq-len 512 --micro-batch 8 --microbatches 4
                   --steps 4 --synthetic-size 256 --translation-size 1024)
        fi
        run_bound=$(awk -v b="$MULTIGPU_RUN_BOUND" -v s="$SCALE" 'BEGIN { print b * s }')
        step multigpu "$PY" scripts/gpu_measure.py multigpu --device "$DEVICE" --gpus "$GPUS" "${sizes[@]}" \
            --run-timeout "$run_bound" --budget-s "$(( $(bound multigpu) > 20 ? $(bound multigpu) - 10 : 1 ))" \
            --work-dir "$WORK/multigpu" --json "$RAW/multigpu.json"
    fi
fi

figures || FAILED+=(figures)
if [ ${#FAILED[@]} -gt 0 ]; then
    echo "gpu-acceptance: FAILED: ${FAILED[*]} (log: $LOG)" | tee -a "$LOG" >&2
    exit 1
fi
echo "gpu-acceptance: passed (${STEPS[*]}); figures in $OUT/figures.json" | tee -a "$LOG"
