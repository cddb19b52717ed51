#!/usr/bin/env bash
# The GPU acceptance, on a machine with one CUDA GPU or more: the gpu-marked tests, then the
# measurements, every step bounded in time by coreutils `timeout`, in under 8 minutes in all.
#
# usage: scripts/gpu-acceptance.sh [--cpu] OUT_DIR [STEP ...]
#   STEP: tests overhead table1 bench messages multigpu (default: all but bench, in this order; --cpu: all);
#   naming some runs only those. A step that fails or runs past its bound is recorded as such and the others go on.
#
#   tests     pytest tests/gpu -m gpu (nothing may be skipped)
#   overhead  engine at K=1 against a hand-written loop with gradient accumulation, bf16 and fp32,
#             batches 8, 32, 128, M = 1, 4, 16, with and without rematerialization; the CUDA
#             synchronisations of one engine step (scripts/gpu_measure.py overhead)
#   table1    profile-memory --budget at the paper's memory per device (AmoebaNet-D 8 GiB, Transformer-L
#             16 GiB), its prediction corrected by a few probe steps on the GPU, then one training step of each
#             model found, predicted against measured peak (gpu_measure.py fits); the Transformer also as
#             V-Half (virtual stages 2) and with offload at K=2, and the goals: the largest remat model peaks
#             within 5% below the budget, offload fits 1.3x its parameters (reported, never failing the step)
#   bench     gpipe bench, K = 2 sharing the GPU, M = 8, with its own K=1 (only when named: the tests bench
#             K = 2 on the GPU too, and its speed means little with two ranks on one GPU)
#   messages  seconds per message through host memory (gpu_measure.py messages)
#   multigpu  with 2 or more GPUs: gpipe train at K=2 under torchrun (NCCL) with each schedule, messages
#             of 16 MiB between stages; K=2 x D=2 with 4 or more GPUs; a translation model evaluated with
#             greedy decoding (BLEU). With one GPU: one line, and the step is skipped, not failed. With
#             the tests it runs beside them (they keep to GPU 0; it takes GPUs 1-4 where there are 3 or 5+).
#
# OUT_DIR receives 5 files: acceptance.log (every step's output), junit.xml (tests), steps.jsonl (each
# step's status, exit code, seconds and bound), raw.json (each measurement's own JSON, by name) and
# figures.json (every figure, collected by scripts/gpu_figures.py). Run again with other steps into the
# same OUT_DIR, the log, steps.jsonl and raw.json keep the earlier run's too.
#
# --cpu checks this script itself where there is no GPU: every step at tiny sizes on the CPU (the gpu
# tests are skipped there, and allowed to be). GPU_ACCEPTANCE_GPUS=N pretends N GPUs for the multigpu
# step's choice (--cpu only: N >= 2 runs its ranks on the CPU). GPU_ACCEPTANCE_BOUND_SCALE=X multiplies
# every step's time bound (a slower machine, whose Python start and pip it lengthens too; or a small X to see a
# step time out). Under --cpu the whole run also ends within 480 s (what a test may wait for it): each step's
# bound is cut to what is left of them.
#
# Without network: where a dependency is missing, wheels/ (from scripts/gpu-wheels.sh) is installed first.
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
DEFAULT=(tests overhead table1 messages multigpu)
STEPS=("$@")
if [ ${#STEPS[@]} -eq 0 ]; then
    if [ "$CPU" = 1 ]; then STEPS=("${ALL[@]}"); else STEPS=("${DEFAULT[@]}"); fi
fi
for s in "${STEPS[@]}"; do
    [[ " ${ALL[*]} " == *" $s "* ]] || { echo "gpu-acceptance: unknown step '$s' (allowed: ${ALL[*]})" >&2; exit 2; }
done
case $OUT in /*) ;; *) OUT=$PWD/$OUT ;; esac  # named from where it was typed: the script runs in the repository
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
cd "$ROOT" || exit 1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# gpipe_cli sets this on import; set here too so that Python that loads torch first (the tests) runs alike.
[[ -n "${PYTORCH_ALLOC_CONF:-}${PYTORCH_CUDA_ALLOC_CONF:-}" ]] || export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True

# Time bounds in seconds of each command (coreutils timeout, then SIGKILL 20 s later), each next to its
# time on one H100 80GB (torch 2.11, CUDA 13): measured there where it says so, else estimated. The
# bounds of the default steps, one after the other, add up to 477 s, under the 480 s (8 minutes) the
# acceptance may take (with a dependency missing, installing it from wheels/ and checking again add 50 s);
# multigpu runs beside the tests, within their bound, so it adds nothing. To fit:
#  - tests: on up to 8 xdist workers, the reference runs trained once for all of them (when every worker
#    trained its own, 9 of the 11 were done at 180 s: 25 to 50 s a gpipe run with 8 starting at once);
#  - overhead: the model is 4 layers (not 8) of d_model 1024 at seq 512; each row runs 1 warm-up step
#    and 3 rounds of at least 2 steps a side (more, up to 50, where steps are short: 0.25 s a round); it
#    starts a row only if it should end within 55 s (1.5x the longest row of its precision and batch so far):
#    the goals' rows first (~35 s), then bf16's others, fp32 at batch 128 last;
#  - table1: the paper's memory per device, not the GPU's 80 GiB, whose largest models (3.7B and 2.75B
#    parameters) take minutes to build and train one step;
#  - bench: named only; 4 layers, batch 32, M = 8, 1 warm-up and 3 measured steps, K = 2 (K = 4, four
#    ranks on one GPU, ran past 90 s);
#  - multigpu: 4 steps a run; 5 runs (6 with 4 GPUs) of ~21 s each (measured with 2 ranks sharing one).
declare -A BOUND=(
    [wheels]=40               # est 20: pip from wheels/ into a folder of its own, only when a dependency is missing
    [setup]=10                # est 4: one Python start: CUDA, gpipe's imports, GPUs and free memory (6 s: too few
                              # on a busy CPU)
    [tests]=185               # measured 146 and 159.7 (H100, 2026-11-27) for 13 tests; 16 now (3 fused-optimizer
                              # and offload ones, each one gpipe run): not measured since
    [overhead]=70             # measured 63.0, 64.3 (H200, 2026-12-04): 55 s of rows, ~8 s start and sync counts
    [table1-amoebanet]=38     # measured 17.6 to 30.6 (H100, 2026-11-27), its 6 device probe steps included
    [table1-transformer]=55   # measured 27.7 to 39.1; 43 with the probes grown past the optimizer's update
                              # (H100, 2026-11-27), its 6 device probe steps included
    [fits-amoebanet]=20       # measured 13.6 to 17.2, 14.8 (H100, 2026-11-27): two members at 224 px, batch 128
    [fits-transformer]=65     # measured 40.0, 42.2 and 57.2 (H100, 2026-11-27: a 3-layer naive model of 35 GB
                              # among them): one fp32 step of 32 x 1024 tokens of each member, V-Half, offload
    [bench-k2]=100            # measured 74: K=1 in-process, then 2 ranks start and run 4 steps (named only)
    [messages]=24             # measured 21.1, 17.9: 20 messages a size, 2 x 2 ranks start
    [figures]=10              # est 4: merging the raw files, reading the machine (CUDA, nvidia-smi), writing figures.json
    [multigpu]=150            # est 110 (2 GPUs), 130 (4); beside the tests, within their 185 s; 30 s a run
)
MULTIGPU_RUN_BOUND=30
SCALE=${GPU_ACCEPTANCE_BOUND_SCALE:-1}
STARTED=$(date +%s)
CPU_TOTAL=480  # --cpu: seconds the whole run may take, setup and figures included
bound() {  # bound NAME: the steps' bounds scaled by GPU_ACCEPTANCE_BOUND_SCALE, at least 1 s
    local scale=$SCALE
    # One Python start and pip are not a step's work: a small scale leaves them as they are, a slower machine's
    # lengthens them; under --cpu (a machine busy with a test suite's workers took over a minute to start Python
    # and import torch) they are twelve times longer; figures, which reads no GPU there, six.
    case $1 in wheels|setup|figures)
        scale=$([ "$CPU" = 1 ] && { [ "$1" = figures ] && echo 6 || echo 12; } \
                || awk -v s="$SCALE" 'BEGIN { print (s > 1 ? s : 1) }') ;; esac
    awk -v b="${BOUND[$1]}" -v s="$scale" 'BEGIN { v = int(b * s + 0.5); print (v < 1 ? 1 : v) }'
}
limit() {  # limit NAME: its bound; under --cpu at most what is left of CPU_TOTAL after it, its SIGKILL and figures
    local b
    b=$(bound "$1")
    if [ "$CPU" = 1 ]; then
        local left=$(( CPU_TOTAL - ($(date +%s) - STARTED) - 20 - $(bound figures) - 5 ))
        b=$(( b < left ? b : (left > 1 ? left : 1) ))
    fi
    echo "$b"
}

WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-acceptance.XXXXXX") || exit 1
trap 'rm -rf "$WORK"' EXIT
RAW=$WORK/raw  # each measurement's own JSON file, merged into OUT_DIR/raw.json at the end
mkdir -p "$RAW"
LOG=$WORK/setup.log  # until OUT_DIR is made: a machine that cannot run the acceptance leaves nothing there

# One Python start: exit 3 without CUDA, 4 naming the dependencies missing (gpipe-cli's, pytest; pytest-xdist on a
# GPU, whose 16 tests would not end within their bound one after the other); else "GPUS FREE_BYTES" (table1's
# budget is the memory a process can use: the card's, less what the CUDA context takes).
check_machine() {
    timeout -k 5 "$(bound setup)" "$PY" - "$CPU" 2>>"$LOG" <<'PYEOF'
import importlib.util
import sys

try:
    import torch
except ImportError:
    print("torch is not importable")
    sys.exit(3)
if sys.argv[1] == "0" and not torch.cuda.is_available():
    print(f"torch {torch.__version__}")
    sys.exit(3)
NEEDED = ["typer", "yaml", "ruamel.yaml", "rich", "pydantic", "datasets", "huggingface_hub", "pyarrow", "numpy", "PIL",
          "sentencepiece", "sacrebleu", "safetensors", "xxhash", "pytest"] + (["xdist"] if sys.argv[1] == "0" else [])


def found(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # its parent package is missing (ruamel)
        return False


missing = [name for name in NEEDED if not found(name)]
if missing:
    print(", ".join(missing))
    sys.exit(4)
import gpipe_cli.cli  # noqa: E402,F401  (what the steps run)

print(*((torch.cuda.device_count(), torch.cuda.mem_get_info(0)[0]) if sys.argv[1] == "0" else (0, 0)))
PYEOF
}
setup=$(check_machine)
code=$?
if [ "$code" = 4 ] && [ "$CPU" = 0 ] && compgen -G "$ROOT/wheels/*.whl" >/dev/null; then
    # Into a folder of its own on PYTHONPATH: a system Python may refuse pip's changes (PEP 668), and nothing
    # half-installed is left in it should the bound stop pip.
    echo "gpu-acceptance: $setup missing: installing the dependencies from wheels/ (offline)" | tee -a "$LOG"
    timeout -k 5 "$(bound wheels)" "$PY" -m pip install --quiet --no-index --find-links "$ROOT/wheels" \
        --target "$WORK/site" -r "$ROOT/wheels/requirements.txt" 2>&1 | tee -a "$LOG"
    if [ "${PIPESTATUS[0]}" != 0 ]; then
        echo "gpu-acceptance: installing from wheels/ failed or took over $(bound wheels) s (see above)" \
            | tee -a "$LOG" >&2
        exit 1
    fi
    export PYTHONPATH="$PYTHONPATH:$WORK/site"
    setup=$(check_machine)
    code=$?
fi
case $code in
    0) ;;
    3) echo "gpu-acceptance: no CUDA GPU is visible to torch ($setup): run it on a machine with one CUDA GPU" \
           | tee -a "$LOG" >&2
       exit 1 ;;
    4) echo "gpu-acceptance: missing here: $setup; run scripts/gpu-wheels.sh wheels on a machine with network" \
            "and bring wheels/ here" | tee -a "$LOG" >&2
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
for s in "${!BOUND[@]}"; do  # wheels: only when a dependency is missing, said above then
    case $s in multigpu|bench-k2|wheels) ;; *) total=$((total + $(bound "$s"))) ;; esac
done
if [ "$CPU" = 1 ]; then  # the bounds are scaled for a GPU's steps; --cpu caps the run itself
    echo "gpu-acceptance: --cpu; the run is bounded at ${CPU_TOTAL} s in all" | tee -a "$LOG"
else
    echo "gpu-acceptance: $GPUS GPU(s); the default steps' time bounds add up to ${total} s (multigpu beside the tests)" | tee -a "$LOG"
fi
FAILED=()

now() { date +%s.%N; }
# record NAME STATUS CODE SECONDS BOUND [WHY]: one line of steps.jsonl.
record() {
    printf '{"step": "%s", "status": "%s", "exit_code": %s, "seconds": %.1f, "bound_s": %s%s}\n' \
        "$1" "$2" "$3" "$4" "$5" "${6:+, \"why\": \"$6\"}" >> "$RECORDS"
}
# step NAME COMMAND...: run it within its bound, append its output to the log (STEP_LOG: another file),
# record how it ended; returns non-zero unless it passed. STOP_SIGNAL: what `timeout` sends first.
step() {
    local name=$1; shift
    local limit started code seconds status log=${STEP_LOG:-$LOG}
    limit=$(limit "$name")
    echo "== $name (bound $limit s): $*" | tee -a "$log"
    started=$(now)
    timeout -s "${STOP_SIGNAL:-TERM}" -k 20 "$limit" "$@" 2>&1 | tee -a "$log"
    code=${PIPESTATUS[0]}
    seconds=$(awk -v a="$started" -v b="$(now)" 'BEGIN { print b - a }')
    case $code in
        0) status=passed ;;
        124|137) status="timed out" ;;
        *) status=failed ;;
    esac
    record "$name" "$status" "$code" "$seconds" "$limit"
    # Into OUT_DIR at once: a machine taken back (SIGKILL) keeps every step that ended. No torch: quick.
    timeout -k 2 10 "$PY" scripts/gpu_figures.py "$OUT" --raw "$RAW" --merge-only >/dev/null 2>&1
    if [ "$status" != passed ]; then
        FAILED+=("$name")
        echo "gpu-acceptance: step $name $status (exit code $code) after ${seconds%.*} s" | tee -a "$log" >&2
        return 1
    fi
}
skip() {  # skip NAME WHY
    echo "$1: $2: skipped" | tee -a "$LOG"
    record "$1" skipped 0 0 "$(bound "$1")" "$2"
}
GPIPE=("$PY" -m gpipe_cli.cli)  # an array, not a function: `timeout` runs programs
wants() { [[ " ${STEPS[*]} " == *" $1 "* ]]; }

# multigpu: started first, beside the tests when they run too (see its bound).
MULTIGPU_PID=
if wants multigpu; then
    if [ "$GPUS" -lt 2 ]; then
        skip multigpu "needs two GPUs, this machine has $GPUS"
    else
        if [ "$CPU" = 1 ]; then
            sizes=(--layers 2 --d-model 32 --ff 64 --heads 2 --seq-len 16 --micro-batch 2 --microbatches 2 --steps 2
                   --synthetic-size 64 --translation-size 256)
            visible=
        else
            # Boundary activation per micro-batch: 8 x 512 x 1024 x 4 B = 16 MiB (fp32), over 8 MiB.
            sizes=(--layers 4 --d-model 1024 --ff 4096 --heads 16 --seq-len 512 --micro-batch 8 --microbatches 4
                   --steps 4 --synthetic-size 256 --translation-size 1024)
            # Beside the tests (on the first GPU) it keeps off that one where it can still have 2 GPUs, or 4 for
            # D=2; named as the machine lists them (its own CUDA_VISIBLE_DEVICES may hold indices or UUIDs).
            visible=
            if wants tests && { [ "$GPUS" -ge 5 ] || [ "$GPUS" = 3 ]; }; then
                IFS=, read -ra listed <<< "${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((GPUS - 1)))}"
                if [ "$GPUS" -ge 5 ]; then take=4; else take=2; fi
                visible=$(IFS=,; echo "${listed[*]:1:$take}")
            fi
        fi
        gpus=$GPUS
        [ -z "$visible" ] || gpus=$(awk -F, '{ print NF }' <<< "$visible")
        run_bound=$(awk -v b="$MULTIGPU_RUN_BOUND" -v s="$SCALE" 'BEGIN { print b * s }')
        command=("$PY" scripts/gpu_measure.py multigpu --device "$DEVICE" --gpus "$gpus" "${sizes[@]}"
                 --run-timeout "$run_bound" --budget-s "$(( $(limit multigpu) > 20 ? $(limit multigpu) - 15 : 1 ))"
                 --work-dir "$WORK/multigpu" --json "$RAW/multigpu.json")
        if wants tests; then
            (
                [ -z "$visible" ] || export CUDA_VISIBLE_DEVICES=$visible
                STEP_LOG=$WORK/multigpu.log step multigpu "${command[@]}" >/dev/null 2>&1
            ) &
            MULTIGPU_PID=$!
            echo "== multigpu: started beside the tests (its output follows theirs)" | tee -a "$LOG"
        else
            step multigpu "${command[@]}"
        fi
    fi
fi
if wants tests; then
    # `-o addopts=-ra` drops the suite's xdist options, so the run needs no xdist; with xdist (its wheel comes
    # with the others), up to 8 workers (6 beside multigpu) share GPU 0: the tests are mostly process starts.
    # SIGINT at the bound: pytest stops as on Ctrl-C and still writes what ran to junit.xml.
    workers=()
    most=8
    [ -z "$MULTIGPU_PID" ] || most=6
    # --cpu: no workers, whose start (torch imported again) costs more than the skipped tests.
    if [ "$CPU" = 0 ] && "$PY" -c 'import xdist' >/dev/null 2>&1; then
        cores=$(nproc)
        workers=(-n "$(( cores / 2 < most ? (cores / 2 > 1 ? cores / 2 : 1) : most ))" --dist load)
    fi
    first=${CUDA_VISIBLE_DEVICES:-0}  # one GPU for the tests: the first the machine lists
    CUDA_VISIBLE_DEVICES=${first%%,*} STOP_SIGNAL=INT step tests "$PY" -m pytest tests/gpu -m gpu \
        -p no:cacheprovider -o addopts=-ra -q --durations 12 "${workers[@]}" --junitxml "$OUT/junit.xml"
    # On a GPU machine nothing may be skipped: a skip would hide a path that did not run.
    skipped=$("$PY" -c 'import sys, xml.etree.ElementTree as ET
print(sum(int(s.get("skipped", 0)) for s in ET.parse(sys.argv[1]).getroot().iter("testsuite")))' \
        "$OUT/junit.xml" 2>/dev/null || echo "unknown")
    if [ "$CPU" = 0 ] && [ "$skipped" != 0 ]; then
        FAILED+=(tests-skipped)
        record tests-skipped failed 1 0 0 "$skipped gpu test(s) skipped or unreadable in junit.xml"
        echo "gpu-acceptance: $skipped gpu test(s) were skipped or unreadable in $OUT/junit.xml" | tee -a "$LOG" >&2
    fi
fi
if [ -n "$MULTIGPU_PID" ]; then
    wait "$MULTIGPU_PID" || FAILED+=(multigpu)
    cat "$WORK/multigpu.log" >> "$LOG"
    tail -n 1 "$WORK/multigpu.log"
fi
if wants overhead; then
    if [ "$CPU" = 1 ]; then
        sizes=(--layers 2 --d-model 32 --ff 64 --heads 2 --seq-len 16 --vocab-size 128 --batches 4 --microbatches 1,4
               --precisions bf16 --steps 1 --warmup 1 --rounds 1 --round-s 0 --sync-batch 4)
    else
        # ~67M parameters (50M in the layers): ~0.2 TFLOP a sample (6 x parameters x 512 tokens); measured
        # at batch 128 ~1,550 samples/s in bf16 (~310 TFLOP/s) and ~230 in fp32 (~46 TFLOP/s: full fp32
        # matmuls, torch's default, TF32 off); 26 rows, 12 with goals.
        sizes=(--layers 4 --d-model 1024 --ff 4096 --heads 16 --seq-len 512 --vocab-size 8192 --batches 8,32,128
               --microbatches 1,4,16 --precisions bf16,fp32 --checkpoint never,except_last --steps 2 --warmup 1
               --rounds 3 --round-s 0.25 --sync-batch 32 --sync-microbatches 4)
    fi
    step overhead "$PY" scripts/gpu_measure.py overhead --device "$DEVICE" "${sizes[@]}" \
        --budget-s "$(( $(limit overhead) > 40 ? $(limit overhead) - 15 : $(limit overhead) / 2 ))" \
        --json "$RAW/overhead.json"
fi
if wants table1; then
    # The families' sizes and batches of the paper's Table 1, at its memory per device.
    if [ "$CPU" = 1 ]; then
        # 20 MiB: models of under a million parameters (200 MiB: 12M, twice the search and training time)
        amoeba=(--budget 20MiB --microbatches 2 --batch-size 8 --image-size 32 --num-classes 10)
        trans=(--budget 20MiB --microbatches 2 --batch-size 4 --d-model 64 --ff 256 --heads 4 --vocab-size 512
               --seq-len 32)
    else
        amoeba=(--budget 8GiB --microbatches 8 --batch-size 128 --image-size 224 --num-classes 1000)
        trans=(--budget 16GiB --microbatches 8 --batch-size 32 --d-model 2048 --ff 8192 --heads 32
               --vocab-size 32000 --seq-len 1024)
    fi
    common=(--partitions 1 --checkpoint except_last --schedule gpipe --optimizer rmsprop)
    # --device cpu probes the CPU as a GPU is probed (its correction is none): the Transformer shows that; on the
    # CPU the AmoebaNet probe's six steps would cost more than the rest of its step, so auto skips it there.
    amoeba_device=$DEVICE
    [ "$CPU" = 0 ] || amoeba_device=auto
    step table1-amoebanet "${GPIPE[@]}" profile-memory --model amoebanet "${amoeba[@]}" "${common[@]}" \
        --device "$amoeba_device" --json "$RAW/table1-amoebanet.json"
    step table1-transformer "${GPIPE[@]}" profile-memory --model transformer "${trans[@]}" "${common[@]}" \
        --device "$DEVICE" --json "$RAW/table1-transformer.json"
    for kind in amoebanet transformer; do
        if [ -f "$RAW/table1-$kind.json" ]; then
            extra=()  # the Transformer's V-Half and offload rows, and the goals
            [ "$kind" = amoebanet ] || extra=(--extra)
            step "fits-$kind" "$PY" scripts/gpu_measure.py fits --device "$DEVICE" --table "$RAW/table1-$kind.json" \
                "${extra[@]}" --json "$RAW/fits-$kind.json"
        else
            skip "fits-$kind" "no table1-$kind figures to train"
        fi
    done
fi
if wants bench; then
    if [ "$CPU" = 1 ]; then
        sizes=(--layers 2 --d-model 32 --ff 64 --heads 2 --seq-len 16 --vocab-size 128 --microbatches 4 --batch-size 8
               --steps 2 --warmup 1)
    else
        sizes=(--layers 4 --d-model 1024 --ff 4096 --heads 16 --seq-len 256 --vocab-size 8192 --microbatches 8
               --batch-size 32 --steps 3 --warmup 1)
    fi
    step bench-k2 "${GPIPE[@]}" bench --model transformer --set model.arch=decoder-only --set model.dropout=0 "${sizes[@]}" \
        --partitions 2 --checkpoint except_last --schedule gpipe --json "$RAW/bench-k2.json"
fi
if wants messages; then
    if [ "$CPU" = 1 ]; then sizes=(--sizes 65536,1048576 --count 5); else
        sizes=(--sizes 65536,1048576,4194304,16777216 --count 20); fi
    step messages "$PY" scripts/gpu_measure.py messages --device "$DEVICE" "${sizes[@]}" --json "$RAW/messages.json"
fi

figures || FAILED+=(figures)
if [ ${#FAILED[@]} -gt 0 ]; then
    echo "gpu-acceptance: FAILED: ${FAILED[*]} (log: $LOG)" | tee -a "$LOG" >&2
    exit 1
fi
echo "gpu-acceptance: passed (${STEPS[*]}); figures in $OUT/figures.json" | tee -a "$LOG"
