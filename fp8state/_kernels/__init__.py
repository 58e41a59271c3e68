"""GPU kernels (Triton), imported lazily and only on CUDA devices.

The pure-PyTorch functions in :mod:`fp8state.quantize` define what each kernel computes; the GPU
tests check the kernels against them bit for bit.
"""
