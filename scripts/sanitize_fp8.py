"""A small jagged batch through every mask family (and rab, delta_q, seqused) on the Hopper FP8
forward, every entry (pre-quantized e4m3 with descales; quant_mode 0; quant_mode 1, 2 and 4: the
per-token and per-dim descales, the quantizer's one-pass and cooperative forms), for
compute-sanitizer.
Lengths are random, so sequences start at tokens that are not multiples of 16. Skips (exit 0)
without a compute capability 9.x GPU."""
import sys

import torch

from hstu_cute import hstu_attn_varlen_func, testing
from hstu_cute.quantize import QuantMode, quantize_batch

if torch.cuda.get_device_capability()[0] != 9:
    print("no sm90 GPU: the FP8 kernels do not run here; skipped")
    sys.exit(0)

CASES = {
    "none": dict(window_size=(-1, -1)),
    "causal": dict(window_size=(-1, 0)),
    "local": dict(window_size=(13, 5)),
    "context+target": dict(window_size=(-1, 0), num_contexts=9, num_targets=40, target_group_size=3),
    "delta_q causal": dict(window_size=(-1, 0), is_delta_q=True, max_seqlen_k=150),
    "delta_q local": dict(window_size=(20, 3), is_delta_q=True, max_seqlen_k=150),
    "rab H_rab=1": dict(window_size=(-1, 0), rab_heads=1),
    "rab H_rab=H, seqused": dict(window_size=(-1, 0), rab_heads=2, seqused=True),
}
for name, kw in CASES.items():
    for head_dim in (64, 128, 256):
        b = testing.random_jagged_batch(7, 2, head_dim, 99 if kw.get("is_delta_q") else 131, device="cuda", seed=7,
                                        **kw)
        rest = {k: v for k, v in b.items() if k not in ("q", "k", "v")}
        with torch.no_grad():
            out0 = hstu_attn_varlen_func(b["q"], b["k"], b["v"], **rest, quant_mode=0)
            scaled = [hstu_attn_varlen_func(b["q"], b["k"], b["v"], **rest, quant_mode=m) for m in (1, 2, 4)]
            quantized = dict(zip("qkv", quantize_batch(b, QuantMode.PER_TENSOR)))
            out8 = hstu_attn_varlen_func(*(quantized[n].data for n in "qkv"), **rest,
                                         descale_q=quantized["q"].scale, descale_k=quantized["k"].scale,
                                         descale_v=quantized["v"].scale)
        torch.cuda.synchronize()
        assert all(torch.isfinite(o).all() for o in (out0, out8, *scaled)), (name, head_dim)
        print(f"fp8 {name} D{head_dim}: ok", flush=True)
