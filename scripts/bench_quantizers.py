"""FP8 quantizers (hstu_cute.quantize) on the GPU: time per mode and GB/s against the HBM roofline,
for q, k and v of one batch. Usage: python scripts/bench_quantizers.py [B N H D]
(default: the headline B8 N4096 H4 D128, bf16). Bytes counted: the 16-bit input read once, the e4m3
output (and mode 1's token-contiguous copy) written once, scales included."""

import sys

import torch

from hstu_cute import bench
from hstu_cute.quantize import QuantMode, quantize

B, N, H, D = (int(a) for a in sys.argv[1:5]) if len(sys.argv) >= 5 else (8, 4096, 4, 128)
HBM_TBS = 3.35  # H100 SXM HBM3 peak
offsets = torch.arange(0, (B + 1) * N, N, dtype=torch.int32, device="cuda")
xs = [torch.randn(B * N, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
print(f"quantize q, k, v of B{B} N{N} H{H} D{D} bf16 (each {xs[0].numel() * 2 / 1e6:.0f} MB)")
for mode in QuantMode:
    outs = [quantize(x, mode, offsets, N) for x in xs]
    moved = sum(x.numel() * 2 + sum(t.numel() * t.element_size() for t in o if t is not None)
                for x, o in zip(xs, outs))
    ms, iqr = bench.time_cuda([lambda: [quantize(x, mode, offsets, N) for x in xs]], warmup=3, reps=20)
    gbs = moved / ms / 1e6
    print(f"mode {int(mode)} {mode.name:<14} {ms:7.3f} ms  {gbs:7.0f} GB/s  {gbs / (HBM_TBS * 1e3):5.1%} of HBM peak",
          flush=True)
