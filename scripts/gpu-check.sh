#!/usr/bin/env bash
# The GPU check (issue 45): what offloop measures on a GPU, in one command of at most six
# minutes, for a machine with an NVIDIA GPU and no network that already has torch,
# Lightning, msgpack, prometheus-client and torchmetrics.
#
#   bash scripts/gpu-check.sh prepare    here, with PyPI reachable: the wheels it installs
#                                        there, in .gpu-wheels/: offloop's own (what ships)
#                                        and what that machine may lack (pyzmq, ormsgpack,
#                                        rich, cloudpickle, pytest, tensorboard ...), built
#                                        for CPython $GPU_PYTHON (3.12)
#   bash scripts/gpu-check.sh [--device cuda|cpu]
#                                        there: the wheels unpacked into .gpu-site/ (only
#                                        those whose module is missing, offloop's always),
#                                        then the CUDA tests, host_cost.py,
#                                        checkpoint_stall.py and end_to_end.py on a
#                                        launch-bound and a compute-bound model; one JSON
#                                        summary in $OUT/gpu-check.json (OUT: gpu-check/)
#
# PYTHON picks the interpreter (python3). With --device cpu it runs the same on the CPU
# (the CUDA tests skip), to try it before a GPU is at hand.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
OUT=${OUT:-gpu-check}
WHEELS=.gpu-wheels
SITE=.gpu-site

if [ "${1:-}" = prepare ]; then
    set -e
    GPU_PYTHON=${GPU_PYTHON:-3.12}
    abi=cp${GPU_PYTHON/./}
    rm -rf "$WHEELS" && mkdir -p "$WHEELS"
    "$PY" -m pip wheel --quiet --no-deps --no-build-isolation -w "$WHEELS" .
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$GPU_PYTHON" \
        --implementation cp --abi "$abi" --abi none --abi abi3 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any -d "$WHEELS" \
        pyzmq ormsgpack rich markdown-it-py mdurl pygments cloudpickle \
        pytest pytest-timeout iniconfig pluggy packaging \
        tensorboard tensorboard-data-server protobuf absl-py markdown werkzeug markupsafe grpcio six
    du -sh "$WHEELS"
    exit 0
fi

DEVICE=cuda
while [ $# -gt 0 ]; do
    case "$1" in
        --device) DEVICE=$2; shift 2 ;;
        *) echo "gpu-check.sh: unknown argument $1 (prepare, or --device cuda|cpu)" >&2; exit 2 ;;
    esac
done
mkdir -p "$OUT"
began=$(date +%s)

# --- offloop as it ships, and what this machine lacks, from the wheels (no network)
if [ ! -d "$WHEELS" ]; then
    echo "gpu-check.sh: no $WHEELS/: run 'bash scripts/gpu-check.sh prepare' where PyPI is reachable" >&2
    exit 2
fi
rm -rf "$SITE" && mkdir -p "$SITE"
unpack() { for wheel in "$@"; do "$PY" -m zipfile -e "$wheel" "$SITE" || return 1; done; }
unpack "$WHEELS"/offloop-*.whl || { echo "gpu-check.sh: cannot unpack offloop's wheel" >&2; exit 2; }
declare -A NEEDS=(  # a module this machine may lack -> the wheels that bring it
    [zmq]="pyzmq" [ormsgpack]="ormsgpack" [rich]="rich markdown_it_py mdurl pygments"
    [cloudpickle]="cloudpickle" [pytest]="pytest iniconfig pluggy packaging"
    [pytest_timeout]="pytest_timeout"
    [tensorboard]="tensorboard tensorboard_data_server protobuf absl_py markdown werkzeug markupsafe grpcio six"
)
for module in "${!NEEDS[@]}"; do
    if ! "$PY" -c "import $module" 2>/dev/null; then
        for name in ${NEEDS[$module]}; do
            unpack "$WHEELS"/"$name"-*.whl || echo "gpu-check.sh: no wheel for $name" >&2
        done
    fi
done
export PYTHONPATH="$PWD/$SITE${PYTHONPATH:+:$PYTHONPATH}"
# -P: the checkout's own offloop/ (the current directory) must not stand in for the wheel
"$PY" -P -c "import offloop, zmq, ormsgpack, sys; sys.exit(not offloop.__file__.startswith('$PWD/$SITE'))" \
    || { echo "gpu-check.sh: offloop does not import from $SITE" >&2; exit 2; }

# --- each step: a time limit, its output kept, its last JSON line taken into the summary
SCALE=1; [ "$DEVICE" = cpu ] && SCALE=5  # the CPU trial is slower, and not held to six minutes
step() {  # name, seconds (on a GPU), command...
    local name=$1 limit=$(( $2 * SCALE )); shift 2
    local start=$(date +%s)
    echo "== $name (at most ${limit}s)" >&2
    timeout "$limit" "$@" >"$OUT/$name.log" 2>"$OUT/$name.err"
    local rc=$?
    echo "$name $rc $(( $(date +%s) - start ))" >>"$OUT/steps"
    tail -n 3 "$OUT/$name.log" >&2
}
rm -f "$OUT/steps"
small=(); [ "$DEVICE" = cpu ] && small=(--small)
step cuda_tests 110 "$PY" -P -m pytest -q -p no:cacheprovider tests/trainer/test_trainer_cuda.py
step host_cost 120 "$PY" benchmarks/host_cost.py --what time --device "$DEVICE" --rounds 20
step checkpoint_stall 45 "$PY" benchmarks/checkpoint_stall.py --device "$DEVICE" --checkpoints 5 --every 6
step end_to_end_mlp 40 "$PY" benchmarks/end_to_end.py --device "$DEVICE" --model mlp --rounds 2
step end_to_end_transformer 45 "$PY" benchmarks/end_to_end.py --device "$DEVICE" --model transformer \
    --rounds 2 "${small[@]}"

"$PY" - "$OUT" "$DEVICE" "$began" <<'EOF'
import json, subprocess, sys, time
from pathlib import Path

out, device, began = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
card = "cpu"
if device == "cuda":
    try:
        card = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip()
    except OSError:
        card = "unknown (no nvidia-smi)"
summary = {"device": device, "card": card, "seconds": int(time.time()) - began, "steps": {}}
for line in (out / "steps").read_text().splitlines():
    name, rc, seconds = line.split()
    log = (out / f"{name}.log").read_text(errors="replace").splitlines()
    result = None
    for text in reversed(log):
        if text.startswith("{"):
            try:
                result = json.loads(text)
                break
            except ValueError:
                pass
    if name == "cuda_tests":
        result = next((t for t in reversed(log) if "passed" in t or "failed" in t or "skipped" in t), None)
    summary["steps"][name] = {"rc": int(rc), "seconds": int(seconds), "result": result}
(out / "gpu-check.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary))
EOF
