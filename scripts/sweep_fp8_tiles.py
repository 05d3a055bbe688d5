"""FP8 forward tile sweep, kernel alone (issue 16), beside the bf16 forward of the same run.

    python scripts/sweep_fp8_tiles.py D [TILE_Mx]TILE_N:STAGES[:Q_STAGES[:PTXAS_OPT]][:nopp][:es] [...] [--rounds 3]
        [--entry kernel|kernel2|...] [--mask causal|ctx|local|rab]

B8 N4096 H4 at head dim D, causal (``--mask``: with 8 contexts and 64 targets, a (256, 0) window,
or rab with one head); tile_m 128 (two consumer warpgroups), one Q stage and ptxas -O3 unless given, tiles claimed; the configurations are timed in
alternating rounds (run-to-run drift shows as spread within a configuration). JSON lines to
$OUT/fp8_tiles.jsonl."""

import argparse
import json
import os

from hstu_cute import bench, variants
from hstu_cute.masks import MaskKind
from hstu_cute.warmup import warmup


MASKS = {"causal": {}, "ctx": dict(contexts=8, targets=64), "local": dict(window=(256, 0)),
         "rab": dict(rab_heads=1)}
# (mask kind, contexts/targets, rab) of each --mask, for --precompile.
KEY_MASKS = {"causal": (MaskKind.CAUSAL, False, False), "ctx": (MaskKind.CAUSAL, True, False),
             "local": (MaskKind.LOCAL, False, False), "rab": (MaskKind.CAUSAL, False, True)}


def _tiles(config: str) -> dict:
    """[TILE_Mx]TILE_N:STAGES[:Q_STAGES[:PTXAS_OPT]][:nopp][:es] (tile_m 128 unless given, 64
    query rows per consumer warpgroup; defaults 1 and 3; ``nopp``: the consumer warpgroups do not
    take turns at the GEMMs; ``es``: the P-cast SiLU ahead of the mask, HopperFp8FwdKey.early_silu)."""
    fields = config.split(":")
    early_silu = fields[-1] == "es"
    fields = fields[:-1] if early_silu else fields
    pingpong = fields[-1] != "nopp"
    fields = fields if pingpong else fields[:-1]
    tile_m, tile_n = map(int, fields[0].split("x")) if "x" in fields[0] else (128, int(fields[0]))
    stages, q_stages, opt = (list(map(int, fields[1:])) + [1, 3])[:3]
    return dict(tile_m=tile_m, tile_n=tile_n, num_stages=stages, q_stages=q_stages, ptxas_opt=opt, dynamic_tiles=True,
                pingpong=pingpong, early_silu=early_silu)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("head_dim", type=int)
    parser.add_argument("configs", nargs="+")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--entry", default="kernel")
    parser.add_argument("--mask", default="causal", choices=list(MASKS))
    parser.add_argument("--precompile", type=int, default=0, help="compile the swept keys first, N processes")
    args = parser.parse_args()
    if args.precompile:
        kind, context_target, has_rab = KEY_MASKS[args.mask]
        warmup("sm_90a", workers=args.precompile, keys=[
            variants.make_hopper_fp8_fwd_key("sm_90a", "bfloat16", args.head_dim, kind, context_target, has_rab,
                                             _tiles(config), scaled_p=args.entry != "kernel",
                                             two_direction=args.entry.endswith("1"))
            for config in args.configs])
    out = os.path.join(os.environ.get("OUT", "."), "fp8_tiles.jsonl")
    w = bench.replace(bench.headline(), name=f"{args.mask} B8 N4096 D{args.head_dim}", head_dim=args.head_dim,
                      **MASKS[args.mask])
    for r in range(args.rounds):
        rows = [bench.run_workload(w)]
        for config in args.configs:
            rows.append(dict(bench.run_workload_fp8(w, args.entry, tiles=_tiles(config)), config=config))
        for row in rows:
            row["round"] = r
            print(f"round {r} {args.mask:<6} {row.get('config', 'bf16'):>8} {row.get('entry', 'bf16'):<16} "
                  f"{row['tflops']:7.1f} TF/s",
                  flush=True)
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
