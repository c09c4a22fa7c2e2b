#!/usr/bin/env bash
# The GPU device check: one command, no network needed, under 8 minutes on one GPU.
#
#   bash bench/device_check.sh [OUTDIR]      (or GPURING_DEVICE_CHECK_OUT=OUTDIR)
#
# Writes to OUTDIR: env.txt (nvidia-smi, versions), gpu-tests.log, and for 2 and 4 ranks
# sharing the GPU: allreduce-<n>ranks.{txt,json} from `gpuring bench` (1 KiB .. 1 GiB, with
# NCCL and torch gloo beside gpuring where present, the floor and efficiency against it).
# Runs the project from this tree (no install needed).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${GPURING_DEVICE_CHECK_OUT:-device-check-out}}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_MULTI_RANK_GPU_ENABLE=1  # NCCL >= 2.30: several ranks on one GPU
status=0

{
  date -u
  git rev-parse HEAD 2>/dev/null || echo "commit: unknown"
  nvidia-smi
  python - <<'PY'
import importlib, platform
print("python", platform.python_version())
for name in ("numpy", "cupy", "cuda.bindings", "torch", "mpi4py"):
    try:
        mod = importlib.import_module(name)
        print(name, getattr(mod, "__version__", "?"))
    except Exception as exc:
        print(name, "missing:", exc)
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

timeout 240 python -m pytest tests/gpu tests/unit/test_kernels_compile.py -q -p no:cacheprovider \
  > "$out/gpu-tests.log" 2>&1 || status=1

for n in 2 4; do
  timeout 150 python -m gpuring bench all_reduce --ranks "$n" --device cuda -b 1K -e 1G \
    --peers nccl,gloo --json "$out/allreduce-${n}ranks.json" \
    > "$out/allreduce-${n}ranks.txt" 2>&1 || status=1
done
tail -n 5 "$out"/*.txt "$out/gpu-tests.log"
exit $status
