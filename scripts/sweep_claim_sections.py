"""Tile claims by section size, H100: forward (and with ``jagged``, backward) TF/s.

    python scripts/sweep_claim_sections.py          # full batches: the static snake (one pair per
                                                    # section) against claims with 16 pairs and with
                                                    # the 8 MB rule, three interleaved repeats
    python scripts/sweep_claim_sections.py family   # B8 N4096 D64-256 bf16/fp16: static vs claims
    python scripts/sweep_claim_sections.py jagged   # jagged rows of the recsys grid: claims with the
                                                    # launcher's rule against fixed 32/64/128/all pairs
"""

import sys

from hstu_cute import bench, launch, variants

orig = launch.bh_per_section


def fixed(pairs):
    return lambda p, *a, **k: min(pairs, p.batch * p.heads) if pairs else p.batch * p.heads


if sys.argv[1:] == ["jagged"]:
    for w in [w for w in bench.recsys_grid() if w.lengths != "full"]:
        w = bench.replace(w, sdpa=False)
        cells = []
        for name, rule in (("rule", orig), ("32", fixed(32)), ("64", fixed(64)), ("128", fixed(128)),
                           ("all", fixed(0))):
            launch.bh_per_section = rule
            f = bench.run_workload(w)["tflops"]
            b = bench.run_workload_bwd(w)["tflops"]
            cells.append(f"{name}: {f:.1f}/{b:.1f}")
        launch.bh_per_section = orig
        print(f"{w.name:<36} fwd/bwd " + " | ".join(cells), flush=True)
    sys.exit()

if sys.argv[1:] == ["family"]:
    # The headline family (B8 N4096, D64-256, bf16 and fp16): static snake vs claims, two repeats.
    for dtype in ("bfloat16", "float16"):
        for d in (64, 128, 256):
            w = bench.Workload(f"full B8 N4096 D{d} {dtype}", 8, 4096, head_dim=d, dtype=dtype)
            base = variants.default_hopper_fwd_tiles(d, False)
            res = {"static": [], "claims": []}
            for _ in range(2):
                for name in res:
                    res[name].append(bench.run_workload(w, dict(base, dynamic_tiles=name == "claims"))["tflops"])
            print(f"{w.name:<32} " + " | ".join(f"{n} " + " ".join(f"{t:.1f}" for t in v) for n, v in res.items()),
                  flush=True)
    sys.exit()

SHAPES = [bench.Workload("full B1024 N256", 1024, 256), bench.Workload("full B128 N512", 128, 512),
          bench.Workload("full B32 N1024", 32, 1024), bench.Workload("full B16 N2048", 16, 2048), bench.headline(),
          bench.Workload("full B8 N4096 D256", 8, 4096, head_dim=256)]
for w in SHAPES:
    w = bench.replace(w, sdpa=False)
    base = variants.default_hopper_fwd_tiles(w.head_dim, False)
    res = {"static": [], "claims16": [], "claimsL2": []}
    for _ in range(3):
        for name in res:
            launch.bh_per_section = fixed(16) if name == "claims16" else orig
            row = bench.run_workload(w, dict(base, dynamic_tiles=name != "static"))
            res[name].append(row["tflops"])
    launch.bh_per_section = orig
    print(f"{w.name:<24} " + " | ".join(f"{n} " + " ".join(f"{t:.1f}" for t in v) for n, v in res.items()), flush=True)
