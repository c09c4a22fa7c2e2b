"""A CUDA simulator and a host build of the kernels, for tests without a GPU (see cupy.py)."""
