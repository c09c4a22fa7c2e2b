"""What the CUDA driver reads from a CUBIN to size a kernel's occupancy, for the simulator
and the tests: each kernel's register count, and the blocks of a given size that fit on one
SM of compute capability 8.0 or 9.0.

`registers(cubin)` reads the EIATTR_REGCOUNT records of the CUBIN's `.nv.info` section (what
`cuobjdump --dump-resource-usage` prints; the counts agree with `nvcc --resource-usage`).
`blocks_per_sm(registers, threads)` applies CUDA's occupancy rules for sm_80 and sm_90 (the
calculation of cuda_occupancy.h): 65536 registers in 4 partitions, allocated per warp in
units of 256, at most 64 warps and 32 blocks per SM. The kernels of reduce.cu use no shared
memory, so registers and warps are the only limits.
"""

from __future__ import annotations

import struct

__all__ = ["registers", "blocks_per_sm"]

_EIATTR_REGCOUNT = 0x2F
_EIFMT_SVAL = 4  # a record with a 16-bit size and that many bytes of value
_REGISTERS_PER_SM = 65536
_PARTITIONS = 4
_REGISTER_UNIT = 256  # registers are allocated to a warp in multiples of this
_MAX_WARPS_PER_SM = 64
_MAX_BLOCKS_PER_SM = 32
_WARP = 32


def _sections(cubin: bytes) -> tuple[list[tuple[int, ...]], list[str]]:
    """The ELF64 section headers and their names."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not a 64-bit ELF CUBIN")
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize)
               for i in range(shnum)]
    names_at = headers[shstrndx][4]
    return headers, [_string(cubin, names_at + h[0]) for h in headers]


def _string(data: bytes, offset: int) -> str:
    return data[offset:data.index(b"\0", offset)].decode()


def _symbols(cubin: bytes, headers: list[tuple[int, ...]], names: list[str]) -> list[str]:
    """The names of the symbol table's entries, by index."""
    symtab = headers[names.index(".symtab")]
    strings_at = headers[symtab[6]][4]  # sh_link: the symbol names' string table
    count = symtab[5] // 24
    return [_string(cubin, strings_at + struct.unpack_from("<I", cubin, symtab[4] + 24 * i)[0])
            for i in range(count)]


def registers(cubin: bytes) -> dict[str, int]:
    """Registers a thread of each kernel in the CUBIN uses, by kernel name."""
    headers, names = _sections(cubin)
    symbols = _symbols(cubin, headers, names)
    info = headers[names.index(".nv.info")]
    data = cubin[info[4]:info[4] + info[5]]
    found: dict[str, int] = {}
    at = 0
    while at + 4 <= len(data):
        fmt, attr = data[at], data[at + 1]
        size = struct.unpack_from("<H", data, at + 2)[0] if fmt == _EIFMT_SVAL else 0
        if attr == _EIATTR_REGCOUNT:
            symbol, count = struct.unpack_from("<II", data, at + 4)
            found[symbols[symbol]] = count
        at += 4 + size
    return found


def blocks_per_sm(registers: int | None, threads: int) -> int:
    """Blocks of `threads` threads that fit on one SM (sm_80, sm_90) when each thread uses
    `registers` registers (None: unknown, only the warp and block limits count)."""
    warps = -(-threads // _WARP)
    fit = min(_MAX_BLOCKS_PER_SM, _MAX_WARPS_PER_SM // warps)
    if registers:
        per_warp = -(-registers * _WARP // _REGISTER_UNIT) * _REGISTER_UNIT
        warps_per_partition = _REGISTERS_PER_SM // _PARTITIONS // per_warp
        fit = min(fit, warps_per_partition * _PARTITIONS // warps)
    return fit
