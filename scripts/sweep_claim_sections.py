"""Tile claims on full batches, H100: forward TF/s of the static snake (one pair per section)
against claims with 16 (batch, head) pairs per section and with the L2 rule (launch.bh_per_section),
interleaved over three repeats (machines of the pool differ by up to 30% on some shapes)."""

from hstu_cute import bench, launch, variants

orig = launch.bh_per_section
SHAPES = [bench.Workload("full B1024 N256", 1024, 256), bench.Workload("full B128 N512", 128, 512),
          bench.Workload("full B32 N1024", 32, 1024), bench.Workload("full B16 N2048", 16, 2048), bench.headline(),
          bench.Workload("full B8 N4096 D256", 8, 4096, head_dim=256)]
for w in SHAPES:
    w = bench.replace(w, sdpa=False)
    base = variants.default_hopper_fwd_tiles(w.head_dim, False)
    res = {"static": [], "claims16": [], "claimsL2": []}
    for _ in range(3):
        for name in res:
            launch.bh_per_section = (lambda p, *a, **k: min(16, p.batch * p.heads)) if name == "claims16" else orig
            row = bench.run_workload(w, dict(base, dynamic_tiles=name != "static"))
            res[name].append(row["tflops"])
    launch.bh_per_section = orig
    print(f"{w.name:<24} " + " | ".join(f"{n} " + " ".join(f"{t:.1f}" for t in v) for n, v in res.items()), flush=True)
