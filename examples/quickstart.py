"""All-reduce a NumPy array across ranks: gpuring run -n 4 python examples/quickstart.py"""

import numpy as np

import gpuring

with gpuring.init() as comm:
    x = np.full(8, comm.rank + 1, dtype=np.float32)
    total = comm.all_reduce(x)  # every rank gets the element-wise sum
    mean = comm.all_reduce(x, op="avg")
    expected = comm.size * (comm.size + 1) / 2
    assert np.all(total == expected), total
    print(f"rank {comm.rank} of {comm.size}: sum {total[0]:g}, avg {mean[0]:g}")
