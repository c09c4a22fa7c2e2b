#!/usr/bin/env bash
# The GPU device check: one command, no network needed, under 8 minutes on one GPU.
#
#   bash bench/device_check.sh [OUTDIR]      (or GPURING_DEVICE_CHECK_OUT=OUTDIR)
#
# Writes to OUTDIR: env.txt (nvidia-smi, versions), gpu-tests.log, and for 2 and 4 ranks
# sharing the GPU: allreduce-<n>ranks.{txt,json} from `gpuring bench` (1 KiB .. 1 GiB, with
# NCCL and torch gloo beside gpuring where present, the floor and efficiency against it), and
# tune-chunk*.{txt,json}: 256 MiB on 4 ranks at several piece sizes and channel counts.
# Runs the project from this tree (no install needed). $PYTHON picks the interpreter (default
# python3); GPURING_DEVICE_CHECK_MAXBYTES the largest size (default 1G).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${GPURING_DEVICE_CHECK_OUT:-device-check-out}}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_MULTI_RANK_GPU_ENABLE=1  # NCCL >= 2.30: several ranks on one GPU
py="${PYTHON:-$(command -v python3 || command -v python)}"
status=0

{
  date -u
  git rev-parse HEAD 2>/dev/null || echo "commit: unknown"
  nvidia-smi
  "$py" - <<'PY'
import importlib, importlib.metadata, platform, sys
print("python", platform.python_version(), sys.executable)
for name in ("numpy", "cupy", "cuda.bindings", "torch", "mpi4py"):
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
try:
    import cupy
    from cupy.cuda import nccl
    print("nccl", nccl.get_version())
    print("cuda runtime", cupy.cuda.runtime.runtimeGetVersion(),
          "driver", cupy.cuda.runtime.driverGetVersion())
except Exception as exc:
    print("nccl/cuda versions unavailable:", exc)
PY
} > "$out/env.txt" 2>&1

timeout 180 "$py" -m pytest tests/gpu tests/unit/test_kernels_compile.py -q -p no:cacheprovider \
  > "$out/gpu-tests.log" 2>&1 || status=1

for n in 2 4; do
  timeout 110 "$py" -m gpuring bench all_reduce --ranks "$n" --device cuda -b 1K \
    -e "${GPURING_DEVICE_CHECK_MAXBYTES:-1G}" \
    --peers nccl,gloo --json "$out/allreduce-${n}ranks.json" \
    > "$out/allreduce-${n}ranks.txt" 2>&1 || status=1
done
# the piece size and channel count CudaDevice should default to: 256 MiB on 4 ranks
for tuning in "2M 1" "8M 1" "32M 1" "8M 2"; do
  set -- $tuning
  timeout 40 "$py" -m gpuring bench all_reduce --ranks 4 --device cuda -b 256M -e 256M \
    --chunk-bytes "$1" --channels "$2" -c 0 -n 20 -w 5 --peers "" --json "$out/tune-chunk$1-ch$2.json" \
    > "$out/tune-chunk$1-ch$2.txt" 2>&1 || status=1
done
tail -n 5 "$out"/*.txt "$out/gpu-tests.log"
exit $status
