"""kernels/reduce.cu compiles with NVRTC from pip for the GPUs we ship to. No GPU needed."""

from __future__ import annotations

import pytest

pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings (NVRTC) is not installed")

from gpuring._ops import COMPLEX_DTYPES, SUPPORTED_DTYPES, ReduceOp
from gpuring.devices import _kernels


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_kernel_compiles(arch: str) -> None:
    _kernels.compile_all_with_nvrtc(arch)


def test_every_op_dtype_pair_has_a_kernel() -> None:
    source = _kernels.kernel_source()
    for dtype in SUPPORTED_DTYPES:
        for op in ReduceOp:
            if dtype in COMPLEX_DTYPES and op in (ReduceOp.MIN, ReduceOp.MAX):
                with pytest.raises(TypeError):
                    _kernels.reduce_kernel_name(dtype, op)
                continue
            name = _kernels.reduce_kernel_name(dtype, op)
            assert name in _kernels.REDUCE_KERNEL_NAMES
            assert f"GPURING_REDUCE_{'COMPLEX' if dtype in COMPLEX_DTYPES else 'REAL'}" \
                f"({dtype}," in source
    assert _kernels.reduce_kernel_name("float32", "avg") == "gpuring_reduce_float32_sum"
    reduce_kernels = sum(2 if d in COMPLEX_DTYPES else 4 for d in SUPPORTED_DTYPES)
    assert len(set(_kernels.ALL_KERNEL_NAMES)) == len(_kernels.ALL_KERNEL_NAMES) == (
        reduce_kernels + 3)


def test_compile_error_carries_the_nvrtc_log() -> None:
    bad = '#include <cuda_fp16.h>\nextern "C" __global__ void k() { undeclared_thing(); }\n'
    with pytest.raises(_kernels.KernelCompileError, match="undeclared_thing"):
        _kernels.nvrtc_compile("sm_90", source=bad)


def test_source_is_found_next_to_the_package() -> None:
    path = _kernels.kernel_source_path()
    assert path.name == "reduce.cu"
    assert path.parent.name == "kernels"
