"""All-reduce CuPy arrays across ranks, one GPU per rank where there are several:

    gpuring run -n 2 python examples/cupy_quickstart.py

Each rank uses GPU `local_rank % count` (ranks may share a GPU). A collective on CuPy arrays is
queued on the current stream and returns at once, as CuPy's own operations do: work queued
after it on that stream sees its result, and the host waits only where it reads a result.
"""

import cupy
import numpy as np

import gpuring

with gpuring.init() as comm:
    cupy.cuda.Device(comm.local_rank % cupy.cuda.runtime.getDeviceCount()).use()
    n = comm.size

    x = cupy.full(1 << 16, comm.rank + 1, dtype=cupy.float32)
    total = comm.all_reduce(x)  # a new array: the element-wise sum on every rank
    comm.all_reduce(x, op="avg", out=x)  # in place

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:  # queued on this stream instead of the default one
        shards = comm.reduce_scatter(cupy.ones(4 * n, dtype=cupy.float64))  # 4 elements each
        gathered = comm.all_gather(cupy.arange(3, dtype=cupy.int32) + comm.rank)
    stream.synchronize()  # (cupy.asnumpy below would wait too)

    assert float(total[0]) == n * (n + 1) / 2 and float(x[-1]) == (n + 1) / 2
    assert np.array_equal(cupy.asnumpy(shards), np.full(4, n, np.float64))
    assert cupy.asnumpy(gathered).shape == (n, 3)
    comm.synchronize()  # a failure that came after the calls returned would be raised here
    print(f"rank {comm.rank} of {n}: sum {float(total[0]):g}, avg {float(x[0]):g}, "
          f"GPU {cupy.cuda.Device().id}")
