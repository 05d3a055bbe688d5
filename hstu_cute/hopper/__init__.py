"""sm90 kernels (TMA loads, WGMMA, warp-specialized pipelines, FP8): not built yet.

Until they land, Hopper GPUs run the sm80 mma.sync kernels of :mod:`hstu_cute.ampere` (compiled
for sm_90a), and ``HSTU_CUTE_ARCH=sm90`` or any FP8 argument raises ``NotImplementedError``.
"""
