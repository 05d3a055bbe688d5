"""The slot quantizer against the per-tensor quantizers, A/B (issues 16 and 18): run twice on the
same lease, with HSTU_CUTE_FP8_QUANT_SLOTS=0 and =1 (launch.FP8_QUANT_SLOTS; one module cache
serves both). B8 N4096 H4 D128 causal (the acceptance shape): the bf16 forward and training step,
the FP8 forward per mode (kernel alone, quantizers alone, end to end), the FP8 backward's
quantizers and end to end, the FP8 training step, and the host time of a tiny FP8 step and
forward call. JSON lines to $OUT/ab-<label>.jsonl.

    python scripts/ab_quantizers.py LABEL --warmup-only     # the D128 variants below, in parallel
    HSTU_CUTE_FP8_QUANT_SLOTS=0 python scripts/ab_quantizers.py per-tensor [--modes 2,5]
    HSTU_CUTE_FP8_QUANT_SLOTS=1 python scripts/ab_quantizers.py slots [--modes 2,5]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from hstu_cute import bench as B
from hstu_cute import hstu_attn_varlen_func


def keys_needed():
    """What these rows and the slot quantizer's GPU tests run: every FP8 input-preparation
    variant (quantizers, V^T, cast) and the causal FP8 kernels without context or rab at every
    head dim and dtype, plus the D128 bf16 causal Hopper kernels of the bf16 lines."""
    from hstu_cute import variants
    from hstu_cute.masks import MaskKind

    keep = []
    for k in variants.shipped_keys("sm_90a"):
        name = k.kernel_name
        if not name.startswith("hopper") or "paged" in name or getattr(k, "split_keys", False):
            continue
        if name.startswith(("hopper_fwd_quant", "hopper_fwd_vt", "hopper_fwd_cast")):
            keep.append(k)
            continue
        if k.mask_kind != int(MaskKind.CAUSAL) or k.has_context or k.has_rab or getattr(k, "has_drab", False):
            continue
        if "fp8" in name or (k.head_dim == 128 and k.dtype == "bfloat16"):
            keep.append(k)
    return keep


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("label")
    ap.add_argument("--warmup-only", action="store_true")
    ap.add_argument("--modes", default="2,5")
    args = ap.parse_args()
    if args.warmup_only:
        from hstu_cute import warmup

        keys = keys_needed()
        res = warmup(arch="sm_90a", keys=keys, workers=os.cpu_count(), raise_errors=False)
        bad = [r for r in res if not r.get("path") and r.get("error")]
        print(f"{args.label}: warmed {len(keys)} variants, {len(bad)} failed", flush=True)
        for r in bad[:5]:
            print(r)
        return
    out = os.path.join(os.environ.get("OUT", "."), f"ab-{args.label}.jsonl")
    w = B.replace(B.headline(), name="full B8 N4096 D128", head_dim=128)
    modes = [int(m) for m in args.modes.split(",")]
    rows = [B.run_workload(w)]
    for m in modes:
        rows += [B.run_workload_fp8(w, f"kernel{m}"), B.run_workload_fp8(w, f"quant{m}"),
                 B.run_workload_fp8(w, f"mode{m}")]
    for m in modes:
        rows += [B.run_workload_bwd_fp8(w, m, "quant"), B.run_workload_bwd_fp8(w, m, "kernel"),
                 B.run_workload_bwd_fp8(w, m, "end2end")]
    rows.append(B.run_training_step(w))
    for m in modes:
        rows.append(B.run_training_step(w, quant_mode=m))
    tiny = B.make_inputs(B.Workload("tiny B2 N128 D128", 2, 128, head_dim=128))
    kw = {k: v for k, v in tiny.items() if not k.startswith("_")}
    train = {**kw, **{n: kw[n].detach().clone().requires_grad_(True) for n in "qkv"}}
    dout = torch.rand_like(kw["q"])
    for m in [-1] + modes:
        step = B.host_us_per_call(lambda: torch.autograd.grad(hstu_attn_varlen_func(**train, quant_mode=m),
                                                              (train["q"], train["k"], train["v"]), dout), 300)
        with torch.no_grad():
            fwd = B.host_us_per_call(lambda: hstu_attn_varlen_func(**kw, quant_mode=m), 300)
        rows.append(dict(workload="tiny B2 N128 D128 host", entry=f"mode {m}", step_us=step, fwd_us=fwd))
    with open(out, "a") as f:
        for row in rows:
            row["label"] = args.label
            f.write(json.dumps(row, default=str) + "\n")
    for row in rows:
        extra = f" {row['gbps']:.0f} GB/s" if "gbps" in row else ""
        if "step_us" in row:
            print(f"{args.label:5} host {row['entry']:>8}: step {row['step_us']:7.1f} us  fwd {row['fwd_us']:6.1f} us")
        else:
            print(f"{args.label:5} {row['workload']:<24} {row.get('entry', row.get('tiles', 'bf16'))!s:<44} "
                  f"{row['ms']:.4f} ms {row['tflops']:7.1f} TF/s{extra}", flush=True)


if __name__ == "__main__":
    main()
