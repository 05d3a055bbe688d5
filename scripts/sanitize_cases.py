"""A small jagged batch through every mask family (and rab, delta_q, seqused), for compute-sanitizer.

On a compute capability 9.x GPU every case runs the forward on both kernel paths (hopper, then
ampere, forced through HSTU_CUTE_ARCH). The backward runs on both paths too, three ways per case:
the default (on hopper at D128 forced to the fused dK/dV/dQ kernel, which these short keys would
not take by default; rab without drab included), deterministic=True (the dK/dV + dQ pair; not at
D256) and, with rab, has_drab=True (on hopper at D256 all of them run the one wide kernel).
``--forward``: the forward only; ``--hopper``: the hopper path only (a quick check of a forward change)."""
import os
import sys

import torch

from hstu_cute import arch, hstu_attn_varlen_func, launch, testing

launch.heuristics.FUSED_MIN_SEQLEN_K = 0

CASES = {
    "none": dict(window_size=(-1, -1)),
    "causal": dict(window_size=(-1, 0)),
    "local": dict(window_size=(13, 5)),
    "context+target": dict(window_size=(-1, 0), num_contexts=9, num_targets=40, target_group_size=3),
    "target": dict(window_size=(-1, 0), num_targets=60, target_group_size=1),
    "delta_q causal": dict(window_size=(-1, 0), is_delta_q=True, max_seqlen_k=150),
    "delta_q local": dict(window_size=(20, 3), is_delta_q=True, max_seqlen_k=150),
    "delta_q none": dict(window_size=(-1, -1), is_delta_q=True, max_seqlen_k=150),
    "rab H_rab=1 (odd row stride)": dict(window_size=(-1, 0), rab_heads=1),
    "rab H_rab=H, seqused": dict(window_size=(-1, 0), rab_heads=2, seqused=True),
}
PATHS = ("hopper", "ampere") if torch.cuda.get_device_capability()[0] == 9 else ("ampere",)
if "--hopper" in sys.argv:
    PATHS = PATHS[:1]
FORWARD_ONLY = "--forward" in sys.argv
for path in PATHS:
    os.environ["HSTU_CUTE_ARCH"] = {"hopper": "sm90", "ampere": "sm80"}[path]
    arch._kernel_path.cache_clear()
    for name, kw in CASES.items():
        for head_dim in (32, 128, 256):
            b = testing.random_jagged_batch(5, 2, head_dim, 99 if kw.get("is_delta_q") else 131,
                                            device="cuda", seed=7, **kw)
            hstu_attn_varlen_func(**b)
            if FORWARD_ONLY:
                continue
            for t in ("q", "k", "v"):
                b[t].requires_grad_(True)
            modes = [dict()] + ([dict(deterministic=True)] if head_dim <= 128 else [])
            if b["rab"] is not None:
                modes.append(dict(has_drab=True))
            for mode in modes:
                if b["rab"] is not None:
                    b["rab"].requires_grad_(mode.get("has_drab", False))
                out = hstu_attn_varlen_func(**b, **mode)
                dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.device, out.dtype)
                out.backward(dout)
        torch.cuda.synchronize()
        print("ran", path, name, flush=True)
