#!/usr/bin/env bash
# Download, on a machine with network, the wheels the GPU machine needs: gpipe-cli's runtime
# dependencies except torch (the GPU machine has its CUDA build), plus pytest, for that machine's
# Python. scripts/gpu-acceptance.sh installs them from the folder, offline, when it is present.
#
# usage: scripts/gpu-wheels.sh DIR [--python-version X.Y] [--glibc 2.N] [--packages "REQ ..."]
#   --python-version  the GPU machine's Python (default: this interpreter's)
#   --glibc           its glibc (default 2.28, what torch's own Linux wheels require)
#   --packages        download these requirements instead of the project's (e.g. to try the command)
set -euo pipefail

usage() { echo "usage: scripts/gpu-wheels.sh DIR [--python-version X.Y] [--glibc 2.N] [--packages \"REQ ...\"]" >&2; exit 2; }
[ $# -ge 1 ] || usage
case "$1" in -h|--help) sed -n '2,9p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;; -*) usage ;; esac
DIR=$1; shift
PY=${PYTHON:-python3}
PYVER=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
GLIBC=2.28
PACKAGES=""
while [ $# -gt 0 ]; do
    case "$1" in
        --python-version) PYVER=${2:?}; shift 2 ;;
        --glibc) GLIBC=${2:?}; shift 2 ;;
        --packages) PACKAGES=${2:?}; shift 2 ;;
        *) usage ;;
    esac
done
[[ "$PYVER" =~ ^3\.[0-9]+$ ]] || { echo "gpu-wheels: --python-version must look like 3.11 (got '$PYVER')" >&2; exit 2; }
[[ "$GLIBC" =~ ^2\.[0-9]+$ ]] || { echo "gpu-wheels: --glibc must look like 2.28 (got '$GLIBC')" >&2; exit 2; }
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ARCH=$(uname -m)

# Every manylinux tag a machine with this glibc accepts (this pip does not widen a tag by itself).
PLATFORMS=()
for ((minor = ${GLIBC#2.}; minor >= 17; minor--)); do PLATFORMS+=(--platform "manylinux_2_${minor}_${ARCH}"); done
PLATFORMS+=(--platform "manylinux2014_${ARCH}" --platform "manylinux2010_${ARCH}" --platform "manylinux1_${ARCH}")

mkdir -p "$DIR"
if [ -z "$PACKAGES" ]; then
    # The project's dependencies but torch, and the test runner the acceptance needs.
    "$PY" - "$ROOT/pyproject.toml" > "$DIR/requirements.txt" <<'PYEOF'
import re
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)["project"]
test = project["optional-dependencies"]["test"]
for req in project["dependencies"] + [r for r in test if re.match(r"pytest", r)]:
    if re.split(r"[<>=!~ \[;]", req, maxsplit=1)[0].lower() != "torch":
        print(req)
PYEOF
else
    printf '%s\n' $PACKAGES > "$DIR/requirements.txt"
fi
echo "gpu-wheels: wheels for Python $PYVER, glibc >= $GLIBC, $ARCH into $DIR:" $(cat "$DIR/requirements.txt")
"$PY" -m pip download --dest "$DIR" --only-binary=:all: --implementation cp --python-version "$PYVER" \
    --abi "cp${PYVER/./}" "${PLATFORMS[@]}" -r "$DIR/requirements.txt"
echo "gpu-wheels: done; copy $DIR to the GPU machine's checkout as wheels/ (scripts/gpu-acceptance.sh installs from it)"
