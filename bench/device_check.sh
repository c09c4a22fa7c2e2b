#!/usr/bin/env bash
# The GPU device check: one command, no network, at most 7 minutes, at most 8 files.
#
#   bash bench/device_check.sh [OUTDIR]      (or GPURING_DEVICE_CHECK_OUT=OUTDIR)
#
# Leaves three files in OUTDIR (the device machine returns at most 8):
#   probe.json      the probe (python -m tools.device_check.probe), first, kept whatever happens
#                   later: CUDA IPC, stream memory operations, 2-process flag ping-pong (memops,
#                   spin kernels, MPS), a dead exporter, copy bandwidth, host cost, versions
#   details.tar.gz  everything else: steps.tsv, env.txt, kernels.log, probe.log, gpu-tests.log,
#                   every bench .txt/.json (rewritten after each step)
#   summary.txt     each step's outcome, the probe's key numbers, the benches' key rows, what
#                   to look at (and bench/device_check_notes.txt); printed last
# Exit status 1 when a step failed, timed out or found no time left; 2, with one line and no
# files, where CuPy does not import or sees no GPU (nothing else would work there).
#
# Steps, each under `timeout` (seconds); their boxes add up to more than the 420 s deadline,
# which cuts the last steps short when the earlier ones use their whole boxes:
#   env 15 | kernels 90 (gpuring kernels: the CUBIN for this GPU, built into the on-disk cache
#   outside the probe's and the tests' time boxes) | probe 85 | GPU tests 100 (pytest
#   tests/gpu; without pytest a 2-rank all_reduce smoke test) | all_reduce 1K..256M beside
#   NCCL and gloo: 2 ranks 50, 4 ranks 60 | gpuring alone 512M..1G: 2 ranks 25, 4 ranks 25 |
#   all_reduce 8..64K on 2 ranks beside NCCL as one kernel, in rounds, and as one kernel
#   replayed from a CUDA graph, and 1M..16M replayed from a graph as one kernel per piece:
#   4 x 15 | piece size and channels at 256 MiB on 4 ranks: 4 x 12 | summary and archive:
#   the last 10
#
# Settings: $PYTHON (default python3), GPURING_DEVICE_CHECK_MAXBYTES (largest size, 1G), and
# for dry runs (tests/multiproc/test_device_check.py runs one on the CUDA simulator):
# GPURING_DEVICE_CHECK_PEER_MAXBYTES (largest size beside the peers, 256M),
# GPURING_DEVICE_CHECK_TUNE_BYTES (256M), GPURING_DEVICE_CHECK_TUNE ("2M:1 8M:1 32M:1 8M:2",
# piece size:channels), GPURING_DEVICE_CHECK_BENCH_FLAGS (appended to every bench, e.g.
# "-n 2 -w 1"), GPURING_DEVICE_CHECK_TESTS (pytest or smoke), GPURING_PROBE_* (the probe's),
# GPURING_DEVICE_CHECK_TIME_SCALE (every time box and the deadline times this whole number;
# 1 on the GPU, more on a slow or loaded machine such as CI's simulator).
# Runs the project from this tree (no install), the repository root on PYTHONPATH: gpuring, and
# the check's own harness in tools/device_check/ (the probe, the summary, the smoke test), which
# is not part of the installed library. GPURING_COMMIT names the commit where this is not a git
# checkout.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py="${PYTHON:-$(command -v python3 || command -v python)}"
export py

# Every step needs CuPy and a GPU: without them, one line and exit status 2, before anything
# is written (each step would otherwise fail on its own for that same reason).
if ! why="$("$py" - 2>&1 <<'PY'
import sys


def one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


try:
    import cupy
except Exception as exc:
    sys.exit(f"needs CuPy, which does not import here ({one_line(exc)}): on a machine with a "
             "CUDA GPU, pip install -e '.[cuda13]' (or cuda12)")
try:
    count = cupy.cuda.runtime.getDeviceCount()
except Exception as exc:
    sys.exit(f"needs a CUDA GPU, and CuPy finds none ({one_line(exc)})")
if count < 1:
    sys.exit("needs a CUDA GPU, and CuPy finds none (0 devices)")
PY
)"; then
  echo "gpuring device check: stopped before the first step: ${why:-python failed}" >&2
  exit 2
fi

out="${1:-${GPURING_DEVICE_CHECK_OUT:-device-check-out}}"
mkdir -p "$out" && out="$(cd "$out" && pwd)"
rm -f "$out/summary.txt" "$out/probe.json" "$out/details.tar.gz"
stage="$(mktemp -d "${TMPDIR:-/tmp}/gpuring-check.XXXXXX")"
export NCCL_MULTI_RANK_GPU_ENABLE=1  # NCCL >= 2.30: several ranks on one GPU
export GPURING_PROBE_MPS_DIR="$stage/mps"  # MPS logs land in the archive
scale="${GPURING_DEVICE_CHECK_TIME_SCALE:-1}"
if ! [[ $scale =~ ^[1-9][0-9]*$ ]]; then
  echo "GPURING_DEVICE_CHECK_TIME_SCALE must be a whole number >= 1, not '$scale'" >&2
  exit 2
fi
export GPURING_DEVICE_CHECK_TIME_SCALE=$scale  # the probe scales its parts too
start=$SECONDS
deadline=$((start + (420 - 10) * scale))  # the last 10 s: summary and archive
status=0
finished=0
printf 'step\tstatus\trc\tseconds\tbudget\tlog\tnote\n' > "$stage/steps.tsv"

say() { printf '[%3ds] %s\n' $((SECONDS - start)) "$*"; }

# record NAME STATUS RC SECONDS BUDGET LOG NOTE: one line of steps.tsv
record() { printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >> "$stage/steps.tsv"; }

# archive: details.tar.gz from the stage (atomically; MPS's pipes are not files)
archive() {
  tar -czf "$out/details.tar.gz.tmp" -C "$stage" --exclude=./mps/pipe . 2>/dev/null \
    && mv -f "$out/details.tar.gz.tmp" "$out/details.tar.gz"
}

# step NAME BUDGET LOG CMD...: CMD under `timeout` (cut to the deadline), output in the stage
step() {
  local name=$1 budget=$(($2 * scale)) log=$3 left rc state t0=$SECONDS
  shift 3
  left=$((deadline - SECONDS))
  if ((left < 5)); then
    record "$name" no-time - 0 "$budget" "$log" "no time left before the deadline"
    say "$name: no time left"
    status=1
    return
  fi
  ((budget > left)) && budget=$left
  say "$name: up to ${budget}s"
  timeout -k 3 "$budget" "$@" > "$stage/$log" 2>&1
  rc=$?
  case $rc in
    0) state=ok ;;
    124 | 137) state=timeout ;;
    *) state=failed ;;
  esac
  [[ $state == ok ]] || status=1
  record "$name" "$state" "$rc" $((SECONDS - t0)) "$budget" "$log" ""
  say "$name: $state"
  archive
}

# skip NAME NOTE: a step this run does not need
skip() { record "$1" skipped - 0 0 - "$2"; }

to_bytes() {  # 8, 4K, 64M, 1G -> bytes
  local v=${1^^}
  case $v in
    *K) echo $((${v%K} << 10)) ;;
    *M) echo $((${v%M} << 20)) ;;
    *G) echo $((${v%G} << 30)) ;;
    *) echo $((v)) ;;
  esac
}

# shellcheck disable=SC2329  # run by `bash -c collect_env` in the env step
collect_env() {
  date -u
  git rev-parse HEAD 2>/dev/null || echo "commit: ${GPURING_COMMIT:-unknown}"
  if command -v nvidia-smi > /dev/null; then nvidia-smi; else echo "nvidia-smi: not found"; fi
  "$py" - <<'PY'
import importlib, importlib.metadata, platform, sys
print("python", platform.python_version(), sys.executable)
for name in ("numpy", "cupy", "cuda.bindings", "torch", "mpi4py", "pytest", "xdist"):
    try:
        mod = importlib.import_module(name)
        print(name, getattr(mod, "__version__", "?"))
    except Exception as exc:
        print(name, "missing:", exc)
for dist in ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-cuda-nvrtc", "cuda-bindings"):
    try:
        print(dist, importlib.metadata.version(dist))
    except importlib.metadata.PackageNotFoundError:
        pass
PY
}
export -f collect_env

stop_mps() {  # the probe stops its MPS daemon; this is the safety net
  local mps
  mps="$(command -v nvidia-cuda-mps-control)" || return 0
  [[ -d $stage/mps/pipe ]] || return 0
  echo quit | CUDA_MPS_PIPE_DIRECTORY="$stage/mps/pipe" CUDA_MPS_LOG_DIRECTORY="$stage/mps/log" \
    timeout 5 "$mps" > /dev/null 2>&1 || true
}

# finish: summary.txt, the final archive, then the summary printed last
finish() {
  ((finished)) && return
  finished=1
  stop_mps
  archive
  if ! timeout 8 "$py" -m tools.device_check.check_summary "$stage" "$out/probe.json" \
    bench/device_check_notes.txt "$status" $((SECONDS - start)) > "$out/summary.txt.tmp" \
    2> "$stage/summary-error.log"; then
    {
      echo "gpuring device check: summary (check_summary failed; steps.tsv and its error)"
      echo "result: exit status $status in $((SECONDS - start)) s"
      cat "$stage/steps.tsv" "$stage/summary-error.log"
    } > "$out/summary.txt.tmp"
    archive
  fi
  mv -f "$out/summary.txt.tmp" "$out/summary.txt"
  rm -rf "$stage"
  cat "$out/summary.txt"
}
trap 'status=1; record interrupted - - 0 0 - "signal"; finish; exit 1' TERM INT

# 1. environment, 2. the kernels, 3. the probe (writes probe.json straight into OUTDIR)
step env 15 env.txt bash -c collect_env
step kernels 90 kernels.log "$py" -m gpuring kernels
step probe 85 probe.log "$py" -m tools.device_check.probe "$out/probe.json"
stop_mps  # in case the probe was killed before it could

# 4. the GPU tests, or the smoke test where pytest is missing
tests="${GPURING_DEVICE_CHECK_TESTS:-pytest}"
if [[ $tests == pytest ]] && ! "$py" -c "import pytest" 2> /dev/null; then tests=smoke; fi
if [[ $tests == pytest ]]; then
  parallel=()
  "$py" -c "import xdist" 2> /dev/null && parallel=(-n 4)
  step gpu-tests 100 gpu-tests.log "$py" -m pytest tests/gpu -q -p no:cacheprovider \
    ${parallel[@]+"${parallel[@]}"}
else
  step gpu-smoke 100 gpu-tests.log "$py" -m gpuring run -n 2 -- \
    "$py" -m tools.device_check.smoke
fi

# 5. all_reduce: beside NCCL and gloo up to 256 MiB, gpuring alone above
maxb=$(to_bytes "${GPURING_DEVICE_CHECK_MAXBYTES:-1G}")
peerb=$(to_bytes "${GPURING_DEVICE_CHECK_PEER_MAXBYTES:-256M}")
((peerb > maxb)) && peerb=$maxb
read -r -a extra <<< "${GPURING_DEVICE_CHECK_BENCH_FLAGS:-}"
bench() {  # bench NAME BUDGET ARGS...
  local name=$1 budget=$2
  shift 2
  step "$name" "$budget" "$name.txt" "$py" -m gpuring bench all_reduce --device cuda "$@" \
    --json "$stage/$name.json" ${extra[@]+"${extra[@]}"}
}
bench allreduce-2ranks 50 --ranks 2 -b 1K -e "$peerb" --peers nccl,gloo
bench allreduce-4ranks 60 --ranks 4 -b 1K -e "$peerb" --peers nccl,gloo
for n in 2 4; do
  if ((maxb > peerb)); then
    bench "allreduce-${n}ranks-large" 25 --ranks "$n" -b $((2 * peerb)) -e "$maxb" --peers ""
  else
    skip "allreduce-${n}ranks-large" "largest size $maxb is within the peers' range"
  fi
done

# 5b. small all_reduces, 2 ranks beside NCCL, in the forms the default does not take here
# (where the ranks share the GPU it takes stream memory operations): the one kernel, whose
# waits spin (GPURING_CUDA_FUSED's rule assumes a spinning kernel holds a shared GPU for its
# turn: this measures it), and rounds (the path before)
small() {  # small NAME BUDGET FORM [ARGS...]: 2 ranks, 8 B .. 64 KiB
  local name=$1 budget=$2 form=$3
  shift 3
  step "$name" "$budget" "$name.txt" env GPURING_CUDA_FUSED="$form" "$py" -m gpuring bench \
    all_reduce --device cuda --ranks 2 -b 8 -e 64K --json "$stage/$name.json" "$@" \
    ${extra[@]+"${extra[@]}"}
}
small small-2ranks-kernel 15 kernel --peers nccl
small small-2ranks-rounds 15 off --peers nccl
small small-2ranks-graph 15 kernel -G 20  # launches of a graph of -n calls (nccl-tests' -G)
# sizes that run in rounds outside a graph, one kernel per 1 MiB piece in it (few calls: where
# the ranks share the GPU without MPS, each piece may cost each rank a turn on it)
graphb=$((16 << 20)) pieceb=$((1 << 20))
((graphb > maxb)) && graphb=$maxb
((pieceb > graphb)) && pieceb=$graphb
small graph-2ranks-pieces 15 kernel -b "$pieceb" -e "$graphb" -f 4 -n 5 -G 5

# 6. the piece size and channel count CudaDevice should default to (4 ranks)
tuneb="${GPURING_DEVICE_CHECK_TUNE_BYTES:-256M}"
for tuning in ${GPURING_DEVICE_CHECK_TUNE:-2M:1 8M:1 32M:1 8M:2}; do
  chunk=${tuning%%:*} channels=${tuning##*:}
  bench "tune-chunk$chunk-ch$channels" 12 --ranks 4 -b "$tuneb" -e "$tuneb" \
    --chunk-bytes "$chunk" --channels "$channels" -c 0 -n 20 -w 5 --peers ""
done

finish
exit $status
