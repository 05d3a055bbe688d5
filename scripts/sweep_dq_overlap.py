"""Backward (dK/dV + dQ pair) with the dQ kernel's n-block loop overlapped (dQ GEMM of block i in
flight while block i+1's G is formed) against the plain loop, H100, kernels alone, same run, two
interleaved repeats. Usage: python scripts/sweep_dq_overlap.py."""

from hstu_cute import bench, variants

SHAPES = [w for w in bench.recsys_grid()] + [bench.Workload("full B16 N2048", 16, 2048),
                                             bench.Workload("full B8 N4096 D64", 8, 4096, head_dim=64)]
for w in SHAPES:
    w = bench.replace(w, sdpa=False)
    dkdv = variants.hopper_bwd_tiles("dkdv", w.head_dim, False)
    dq = variants.hopper_bwd_tiles("dq", w.head_dim, False)
    configs = {"plain s2": dict(dq, overlap=False, num_stages=2), "overlap s2": dict(dq, overlap=True, num_stages=2),
               "overlap s3": dict(dq, overlap=True, num_stages=3)}
    res = {name: [] for name in configs}
    for _ in range(2):
        for name, tiles in configs.items():
            res[name].append(bench.run_workload_bwd(w, tiles_dq=tiles, tiles_dkdv=dkdv)["tflops"])
    print(f"{w.name:<36} " + " | ".join(f"{n} " + " ".join(f"{t:.1f}" for t in v) for n, v in res.items()),
          flush=True)
