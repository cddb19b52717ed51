#!/usr/bin/env bash
# The GPU acceptance, on a machine with one CUDA GPU: the gpu-marked tests, then the measurements,
# every figure collected into OUT_DIR/figures.json.
#
# usage: scripts/gpu-acceptance.sh OUT_DIR [STEP ...]
#   STEP: tests overhead table1 bench messages (default: all, in this order); naming some runs only
#   those, e.g. to stay within a time limit per command. figures.json collects whatever OUT_DIR holds.
#
#   tests     pytest tests/gpu -m gpu               -> OUT_DIR/junit.xml
#   overhead  engine at K=1 vs a plain loop, bf16   -> raw/overhead.json
#   table1    profile-memory --budget <free GPU memory>, then one training step of each model found on
#             the GPU                               -> raw/table1-{amoebanet,transformer}.json, raw/fits-*.json
#   bench     gpipe bench, K = 2 and 4 sharing the GPU, M = 32 (each with its own K=1) -> raw/bench-k*.json
#   messages  seconds per message through host memory -> raw/messages.json
#
# Without network: wheels/ (from scripts/gpu-wheels.sh) is installed first when present.
# Exits non-zero, naming the failed steps, when any step failed.
set -uo pipefail

usage() { echo "usage: scripts/gpu-acceptance.sh OUT_DIR [tests|overhead|table1|bench|messages ...]" >&2; exit 2; }
[ $# -ge 1 ] || usage
OUT=$1; shift
ALL=(tests overhead table1 bench messages)
STEPS=("$@")
[ ${#STEPS[@]} -gt 0 ] || STEPS=("${ALL[@]}")
for s in "${STEPS[@]}"; do
    [[ " ${ALL[*]} " == *" $s "* ]] || { echo "gpu-acceptance: unknown step '$s' (allowed: ${ALL[*]})" >&2; exit 2; }
done
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
cd "$ROOT" || exit 1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
    echo "gpu-acceptance: no CUDA GPU is visible to torch ($("$PY" -c 'import torch; print(torch.__version__)' \
        2>/dev/null || echo 'torch is not importable')): run it on a machine with one CUDA GPU" >&2
    exit 1
fi
if compgen -G "$ROOT/wheels/*.whl" >/dev/null; then
    echo "gpu-acceptance: installing the dependencies from wheels/ (offline)"
    "$PY" -m pip install --quiet --no-index --find-links "$ROOT/wheels" -r "$ROOT/wheels/requirements.txt" \
        || { echo "gpu-acceptance: installing from wheels/ failed (see above)" >&2; exit 1; }
fi
if ! "$PY" -c 'import gpipe_cli.cli, pytest' >/dev/null 2>&1; then
    echo "gpu-acceptance: gpipe-cli's dependencies or pytest are missing: run scripts/gpu-wheels.sh wheels on a" \
         "machine with network and bring wheels/ here" >&2
    exit 1
fi

mkdir -p "$OUT/raw" "$OUT/logs" || exit 1
OUT=$(cd "$OUT" && pwd)
RAW=$OUT/raw
# The budget is the memory a process can use: the card's, less what the CUDA context takes.
GPU_MEMORY=$("$PY" -c 'import torch; print(torch.cuda.mem_get_info(0)[0])')
FAILED=()

# step NAME COMMAND...: run it, log it to OUT_DIR/logs/NAME.log, remember a failure and go on.
step() {
    local name=$1; shift
    echo "== $name: $*"
    "$@" 2>&1 | tee "$OUT/logs/$name.log"
    local code=${PIPESTATUS[0]}
    if [ "$code" -ne 0 ]; then
        FAILED+=("$name")
        echo "gpu-acceptance: step $name failed with exit code $code (log: $OUT/logs/$name.log)" >&2
    fi
}
gpipe() { "$PY" -m gpipe_cli.cli "$@"; }
wants() { [[ " ${STEPS[*]} " == *" $1 "* ]]; }

if wants tests; then
    # One process on the one GPU: `-o addopts=-ra` drops the suite's xdist options, so the run needs no xdist.
    step tests "$PY" -m pytest tests/gpu -m gpu -p no:cacheprovider -o addopts=-ra -q --junitxml "$OUT/junit.xml"
    # On a GPU machine nothing may be skipped: a skip would hide a path that did not run.
    skipped=$("$PY" -c 'import sys, xml.etree.ElementTree as ET
print(sum(int(s.get("skipped", 0)) for s in ET.parse(sys.argv[1]).getroot().iter("testsuite")))' \
        "$OUT/junit.xml" 2>/dev/null || echo "unknown")
    if [ "$skipped" != 0 ]; then
        FAILED+=(tests-skipped)
        echo "gpu-acceptance: $skipped gpu test(s) were skipped or unreadable in $OUT/junit.xml" >&2
    fi
fi
if wants overhead; then
    step overhead "$PY" scripts/gpu_measure.py overhead --layers 8 --d-model 1024 --ff 4096 --heads 16 \
        --seq-len 512 --vocab-size 8192 --batch-size 32 --steps 20 --warmup 5 --rounds 2 --json "$RAW/overhead.json"
fi
if wants table1; then
    # The families' sizes and batches of the paper's Table 1, within this GPU's memory.
    step table1-amoebanet gpipe profile-memory --model amoebanet --budget "$GPU_MEMORY" --partitions 1 \
        --microbatches 8 --batch-size 128 --checkpoint except_last --schedule gpipe --optimizer rmsprop \
        --image-size 224 --num-classes 1000 --json "$RAW/table1-amoebanet.json"
    step table1-transformer gpipe profile-memory --model transformer --budget "$GPU_MEMORY" --partitions 1 \
        --microbatches 8 --batch-size 32 --checkpoint except_last --schedule gpipe --optimizer rmsprop \
        --d-model 2048 --ff 8192 --heads 32 --vocab-size 32000 --seq-len 1024 --json "$RAW/table1-transformer.json"
    for kind in amoebanet transformer; do
        if [ -f "$RAW/table1-$kind.json" ]; then
            step "fits-$kind" "$PY" scripts/gpu_measure.py fits --table "$RAW/table1-$kind.json" \
                --json "$RAW/fits-$kind.json"
        fi
    done
fi
if wants bench; then
    for k in 2 4; do
        step "bench-k$k" gpipe bench --model transformer --set arch=decoder-only --set dropout=0 --layers 8 \
            --d-model 1024 --ff 4096 --heads 16 --seq-len 256 --vocab-size 8192 --partitions "$k" \
            --microbatches 32 --batch-size 128 --checkpoint except_last --schedule gpipe --steps 10 --warmup 3 \
            --json "$RAW/bench-k$k.json"
    done
fi
if wants messages; then
    step messages "$PY" scripts/gpu_measure.py messages --sizes 65536,1048576,4194304,16777216 --count 50 \
        --json "$RAW/messages.json"
fi

"$PY" scripts/gpu_figures.py "$OUT" || FAILED+=(figures)
if [ ${#FAILED[@]} -gt 0 ]; then
    echo "gpu-acceptance: FAILED: ${FAILED[*]} (logs in $OUT/logs)" >&2
    exit 1
fi
echo "gpu-acceptance: passed (${STEPS[*]}); figures in $OUT/figures.json"
