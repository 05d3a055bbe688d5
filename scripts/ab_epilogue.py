"""The forward's staged epilogue (smem + TMA store, HopperFwdKey.staged_epilogue) against register
stores, kernel alone, bf16 and the FP8 P-cast kernel, on the headline and the recsys shapes (D128
causal unless named), configurations alternating over rounds. JSON lines to $OUT/ab_epilogue.jsonl.

    python scripts/ab_epilogue.py [--rounds 3] [--precompile 16] [--fp8-only | --bf16-only] [--arms staged]
"""

import argparse
import json
import os

from hstu_cute import bench, variants
from hstu_cute.masks import MaskKind
from hstu_cute.warmup import warmup


def workloads():
    w = bench.headline()
    return [bench.replace(w, sdpa=False), bench.Workload("full B8 N4096 D256", 8, 4096, head_dim=256)] + [
        bench.replace(r, sdpa=False) for r in bench.recsys_grid()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--precompile", type=int, default=16)
    ap.add_argument("--fp8-only", action="store_true")
    ap.add_argument("--bf16-only", action="store_true")
    ap.add_argument("--arms", nargs="+", default=["staged", "registers"], choices=["staged", "registers"])
    args = ap.parse_args()
    arms = [(a, a == "staged") for a in args.arms]
    keys = []
    for w in workloads():
        kind = MaskKind.CAUSAL
        ct = bool(w.contexts or w.targets)
        for _, staged in arms:
            if not args.fp8_only:
                keys.append(variants.make_hopper_fwd_key("sm_90a", "bfloat16", w.head_dim, kind, ct, False, dict(
                    variants.default_hopper_fwd_tiles(w.head_dim, False), staged_epilogue=staged)))
            if not args.bf16_only:
                keys.append(variants.make_hopper_fp8_fwd_key("sm_90a", "bfloat16", w.head_dim, kind, ct, False, dict(
                    variants.default_hopper_fp8_fwd_tiles(w.head_dim, False), staged_epilogue=staged)))
    if args.precompile:
        warmup("sm_90a", workers=args.precompile, keys=list(dict.fromkeys(keys)))
    out = os.path.join(os.environ.get("OUT", "."), "ab_epilogue.jsonl")
    for r in range(args.rounds):
        for w in workloads():
            for arm, staged in arms:
                rows = []
                if not args.fp8_only:
                    rows.append(bench.run_workload(w, dict(variants.default_hopper_fwd_tiles(w.head_dim, False),
                                                           staged_epilogue=staged)))
                    rows[-1]["entry"] = "bf16"
                if not args.bf16_only:
                    rows.append(bench.run_workload_fp8(w, "kernel", dict(
                        variants.default_hopper_fp8_fwd_tiles(w.head_dim, False), staged_epilogue=staged)))
                for row in rows:
                    row.update(round=r, arm=arm)
                    print(f"round {r} {w.name:36s} {row['entry']:12s} {arm:9s} {row['tflops']:7.1f} TF/s "
                          f"{row['ms']:.4f} ms", flush=True)
                    with open(out, "a") as f:
                        f.write(json.dumps(row, default=str) + "\n")


if __name__ == "__main__":
    main()
