"""Where the slot quantizer's time goes (issue 16's mode-5 ratio): the device time of each kernel
and memset of ``launch.quantize_for`` per mode and purpose, from torch.profiler (CUPTI), at B8
N4096 H4 D128 (the acceptance shape), with the bytes each launch moves and its GB/s. Prints a
table; JSON lines to $OUT/quant-profile.jsonl.

    python scripts/profile_quantizers.py [--modes 2,5] [--dim 128]
"""

from __future__ import annotations

import argparse
import collections
import json
import os

import torch
from torch.profiler import ProfilerActivity, profile

from hstu_cute import bench as B
from hstu_cute import launch, variants


def moved_bytes(mode: int, purpose: str, x: torch.Tensor) -> list[int]:
    """Per launch of the plan: 16-bit bytes read plus e4m3 bytes written."""
    per = []
    for slots in variants.quant_launches(mode, purpose):
        n = 0
        for _, role, plain, transposed in slots:
            n += x.numel() * x.element_size() + x.numel() * (int(plain) + int(transposed))
        per.append(n)
    return per


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="2,5")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    w = B.Workload(f"full B8 N4096 D{args.dim}", 8, 4096, head_dim=args.dim)
    kw = B.make_inputs(w)
    q, k, v = kw["q"], kw["k"], kw["v"]
    offsets = (kw["seq_offsets_q"], kw["seq_offsets_k"], kw["seq_offsets_k"])
    max_lens = (kw["max_seqlen_q"], kw["max_seqlen_k"], kw["max_seqlen_k"])
    flush = torch.empty(64 * 2**20, dtype=torch.int32, device="cuda")
    rows = []
    for mode in [int(m) for m in args.modes.split(",")]:
        for purpose in ("forward", "training", "gradient"):
            xs = (q,) if purpose == "gradient" else (q, k, v)
            offs, lens = (offsets[:1], max_lens[:1]) if purpose == "gradient" else (offsets, max_lens)
            for _ in range(3):
                launch.quantize_for(mode, purpose, xs, offs, lens)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.reps):
                    flush.bitwise_not_()  # a kernel of its own name, dropped below
                    launch.quantize_for(mode, purpose, xs, offs, lens)
                torch.cuda.synchronize()
            times = collections.OrderedDict()
            for ev in prof.events():
                if ev.device_type == torch.autograd.DeviceType.CUDA and "bitwise_not" not in ev.name.lower() \
                        and "BitwiseNot" not in ev.name:
                    times.setdefault(ev.name, []).append(ev.time_range.elapsed_us())
            per = moved_bytes(mode, purpose, q)
            total = 0.0
            for name, ts in times.items():
                ts = sorted(ts)
                us = ts[len(ts) // 2] * len(ts) / args.reps
                total += us
                rows.append(dict(mode=mode, purpose=purpose, kernel=name[:90], us=us, count=len(ts)))
            rows.append(dict(mode=mode, purpose=purpose, kernel="TOTAL", us=total, bytes=sum(per),
                             gbps=sum(per) / total / 1e3, per_launch_bytes=per))
    out = os.path.join(os.environ.get("OUT", "."), "quant-profile.jsonl")
    with open(out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    for r in rows:
        extra = f"  {r['bytes'] / 1e6:.0f} MB {r['gbps']:.0f} GB/s" if "gbps" in r else f"  x{r['count']}"
        print(f"mode {r['mode']} {r['purpose']:<9} {r['kernel'][:70]:<70} {r['us']:8.1f} us{extra}")


if __name__ == "__main__":
    main()
