"""kernels/reduce.cu compiles with NVRTC from pip for the GPUs we ship to. No GPU needed."""

from __future__ import annotations

import io
import threading
from pathlib import Path

import pytest

from ..cudasim import kernels_host_build

pytest.importorskip("cuda.bindings.nvrtc", reason=kernels_host_build.NVRTC_MISSING)

from gpuring._ops import COMPLEX_DTYPES, SUPPORTED_DTYPES, ReduceOp
from gpuring.devices import _file_cache, _kernels, cuda

from ..cudasim import cubin

ARCHS = ["sm_80", "sm_90"]


@pytest.fixture(scope="module")
def cubins() -> dict[str, bytes]:
    """reduce.cu built by NVRTC for every architecture we ship to, once (a build takes a
    while; the on-disk cache CudaDevice loads from, so the simulator's GPU tests reuse the
    build): the tests below check every kernel is in it."""
    return {arch: _kernels.cubin_for(arch) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_every_kernel_compiles(cubins: dict[str, bytes], arch: str) -> None:
    assert set(cubin.registers(cubins[arch])) == set(_kernels.ALL_KERNEL_NAMES)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_data_kernel_fits_the_fallback_occupancy(cubins: dict[str, bytes],
                                                       arch: str) -> None:
    """Where the driver cannot tell a kernel's occupancy, CudaDevice caps its grid at
    _FALLBACK_BLOCKS_PER_SM blocks per SM: that is at most one wave only while every data
    kernel (registers decide) fits that many blocks of _THREADS on one SM."""
    data_kernels = (*_kernels.REDUCE_KERNEL_NAMES, *_kernels.REDUCE_N_KERNEL_NAMES,
                    _kernels.COPY_KERNEL)
    registers = cubin.registers(cubins[arch])
    for name in data_kernels:
        fit = cubin.blocks_per_sm(registers[name], cuda.THREADS)
        assert fit >= cuda._FALLBACK_BLOCKS_PER_SM, (name, registers[name], fit)


def test_the_kernels_command_builds_into_the_cache_collectives_load(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`gpuring kernels --arch ARCH` (for job prologues) leaves each CUBIN where CudaDevice
    looks first (here an empty cache, and NVRTC's compile stood in for); a cache it cannot
    write, and a name that is no GPU architecture, are errors."""
    from gpuring import _cli

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    built: list[str] = []

    def compile_for(arch: str, source: str | None = None) -> bytes:
        built.append(arch)
        return f"CUBIN for {arch}".encode()

    monkeypatch.setattr(_kernels, "nvrtc_compile", compile_for)
    assert _cli.main(["kernels", "--arch", "sm_80", "--arch", "sm_90"]) == 0
    out = capsys.readouterr().out
    for arch in ARCHS:
        path = _kernels.cubin_path(arch)
        assert path.is_relative_to(tmp_path) and f"{arch}: {path} (ready in " in out, out
        assert path.read_bytes() == f"CUBIN for {arch}".encode()
    assert built == ARCHS
    assert _cli.main(["kernels", "--arch", "sm_90"]) == 0 and built == ARCHS  # (cached)
    capsys.readouterr()
    monkeypatch.setenv("XDG_CACHE_HOME", "/proc/self/no-such-directory")
    assert _cli.main(["kernels", "--arch", "sm_90"]) == 1
    assert "could not write" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        _cli.main(["kernels", "--arch", "compute_90"])
    assert exited.value.code == 2
    assert "is not a GPU architecture" in capsys.readouterr().err


class _Watched(io.StringIO):
    """A stream that tells when a line holding `wanted` was written to it."""

    def __init__(self, wanted: str):
        super().__init__()
        self.wanted, self.seen = wanted, threading.Event()

    def write(self, text: str) -> int:
        if self.wanted in text:
            self.seen.set()
        return super().write(text)


def test_the_kernels_command_says_what_it_builds_while_it_builds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A build takes minutes in one NVRTC call: `gpuring kernels` says which architecture it
    starts on before the call, then that it still runs every few seconds (here a build that
    lasts until the first such line), then where the CUBIN is; a cached one needs neither."""
    from gpuring import _cli

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(_cli, "KERNELS_PROGRESS_S", 0.01)
    err = _Watched("still running")
    monkeypatch.setattr("sys.stderr", err)

    def slow_compile(arch: str, source: str | None = None) -> bytes:
        assert err.seen.wait(60), "no progress line while the build ran"
        return f"CUBIN for {arch}".encode()

    monkeypatch.setattr(_kernels, "nvrtc_compile", slow_compile)
    assert _cli.main(["kernels", "--arch", "sm_80", "--arch", "sm_90"]) == 0
    lines = err.getvalue().splitlines()
    assert lines[0] == (f"gpuring kernels: sm_80 (1 of 2): compiling {_kernels.SOURCE_NAME} "
                        f"({len(_kernels.ALL_KERNEL_NAMES)} kernels) with NVRTC: tens of seconds "
                        "to minutes of CPU (or waiting for another process's build of it)")
    assert lines[1].startswith("gpuring kernels: sm_80's build: still running after ")
    assert any(line.startswith("gpuring kernels: sm_90 (2 of 2): compiling") for line in lines)
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out] == ARCHS
    err.seek(0)
    err.truncate()
    monkeypatch.setattr(_cli, "KERNELS_PROGRESS_S", 3600.0)
    assert _cli.main(["kernels", "--arch", "sm_90"]) == 0  # cached: nothing to wait for
    assert err.getvalue() == ""
    assert capsys.readouterr().out.startswith("sm_90: ")


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
            assert _kernels.reduce_n_kernel_name(dtype, op) in _kernels.REDUCE_N_KERNEL_NAMES
            assert _kernels.fused_kernel_name(dtype, op) in \
                _kernels.DIRECT_KERNEL_NAMES
            assert f"GPURING_FUSED_{'COMPLEX' if dtype in COMPLEX_DTYPES else 'REAL'}" \
                f"({dtype}," in source
            assert f"GPURING_REDUCE_{'COMPLEX' if dtype in COMPLEX_DTYPES else 'REAL'}" \
                f"({dtype}," in source
    assert _kernels.reduce_kernel_name("float32", "avg") == "gpuring_reduce_float32_sum"
    assert _kernels.reduce_n_kernel_name("float16", "avg") == "gpuring_reduce_n_float16_sum"
    reduce_kernels = sum(2 if d in COMPLEX_DTYPES else 4 for d in SUPPORTED_DTYPES)
    assert len(set(_kernels.ALL_KERNEL_NAMES)) == len(_kernels.ALL_KERNEL_NAMES) == (
        3 * reduce_kernels + 5)  # copy, wait, write one flag, write several, stage
    assert f"#define GPURING_MAX_SOURCES {_kernels.MAX_SOURCES}\n" in source
    assert f"#define GPURING_FUSED_MAX_BLOCKS {_kernels.FUSED_MAX_BLOCKS}\n" in source
    assert "#define GPURING_FUSED_MAX_RANKS GPURING_MAX_SOURCES\n" in source
    assert _kernels.FUSED_MAX_RANKS == _kernels.MAX_SOURCES
    assert f"#define GPURING_FUSED_DATA {_kernels.FUSED_DATA}\n" in source
    for kind, value in _kernels.DIRECT_KINDS.items():
        assert f"#define GPURING_{kind.upper()} {value}\n" in source
    assert f"#define GPURING_MAX_FLAGS {_kernels.MAX_FLAGS}\n" in source


def test_fold_launches_take_every_source_once_in_order() -> None:
    """The first launch folds up to 8 sources; each later one starts from dst (the fold so
    far) and adds up to 7 more; only the last applies the divisor."""
    dst = 1000
    for count in range(2, 30):
        srcs = list(range(count))
        launches = _kernels.fold_launches(dst, srcs)
        assert [last for _, last in launches] == [False] * (len(launches) - 1) + [True]
        assert all(2 <= len(s) <= _kernels.MAX_SOURCES for s, _ in launches[1:])
        assert all(s[0] == dst for s, _ in launches[1:])
        assert launches[0][0] == tuple(srcs[:_kernels.MAX_SOURCES])
        assert [a for s, _ in launches for a in s if a != dst] == srcs
    with pytest.raises(ValueError):
        _kernels.fold_launches(dst, [1])


def test_compile_error_carries_the_nvrtc_log() -> None:
    bad = '#include <cuda_fp16.h>\nextern "C" __global__ void k() { undeclared_thing(); }\n'
    with pytest.raises(_kernels.KernelCompileError, match="undeclared_thing"):
        _kernels.nvrtc_compile("sm_90", source=bad)


def test_source_is_found_next_to_the_package() -> None:
    path = _kernels.kernel_source_path()
    assert path.name == "reduce.cu"
    assert path.parent.name == "kernels"


def test_occupancy_rules_of_sm80_and_sm90() -> None:
    """The simulator's occupancy (tests/cudasim/cubin.py), against values worked out by hand
    from CUDA's rules: registers are given to a warp in units of 256 from 4 partitions of
    16384, at most 64 warps and 32 blocks an SM."""
    by_registers = {None: 8, 32: 8, 33: 6, 40: 6, 41: 5, 48: 5, 49: 4, 64: 4, 65: 3, 72: 3,
                    128: 2, 255: 1}
    for registers, blocks in by_registers.items():
        assert cubin.blocks_per_sm(registers, 256) == blocks, registers
    assert cubin.blocks_per_sm(8, 32) == 32  # the block limit
    assert cubin.blocks_per_sm(None, 1024) == 2  # the warp limit


def test_one_process_compiles_while_the_others_wait(tmp_path) -> None:
    """The ranks of a node that find no CUBIN compile it once: a second holder of the
    compile lock waits until the first lets go (bounded: it compiles anyway after its
    seconds)."""
    import threading

    lock = tmp_path / "reduce.lock"
    entered = threading.Event()

    def second() -> None:
        with _file_cache.build_lock(lock, seconds=60.0):
            entered.set()

    with _file_cache.build_lock(lock):
        waiter = threading.Thread(target=second)
        waiter.start()
        assert not entered.wait(0.3)  # held: the second waits
    assert entered.wait(30.0)  # released: it goes on
    waiter.join()
    with _file_cache.build_lock(lock), _file_cache.build_lock(lock, seconds=0.0):
        pass  # past its bound a waiter goes on without the lock
