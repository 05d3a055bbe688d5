import time, torch
from hstu_cute import launch, quantize
from hstu_cute.testing import random_jagged_batch
b = random_jagged_batch(6, 3, 128, 300, device="cuda", seed=1, lengths=[300, 0, 1, 17, 129, 256])
x, offsets = b["k"], b["seq_offsets_k"]
want = quantize.quantize(x, 2, offsets, 300)
table = quantize.descale_table(want.scale, 2, 6, 3)
data, got = launch.quantize_blocks(x, offsets, 300, 2, False)
bad = (got != table).nonzero()
print("mismatches", bad.shape[0], bad[:5].tolist(), got[tuple(bad[:5].T)].tolist() if bad.numel() else "", table[tuple(bad[:5].T)].tolist() if bad.numel() else "")
from hstu_cute import bench
for d in (128, 256):
    w = bench.replace(bench.headline(), name=f"D{d}", head_dim=d)
    kw = bench.make_inputs(w, seed=0)
    for mode in (2, 5):
        for tr, x in ((False, kw["q"]), (True, kw["v"])):
            f = lambda: launch.quantize_blocks(x, kw["seq_offsets_q"], kw["max_seqlen_q"], mode, tr)
            f(); torch.cuda.synchronize()
            t0 = time.perf_counter(); 
            for _ in range(20): f()
            host = (time.perf_counter() - t0) / 20
            torch.cuda.synchronize(); t1 = time.perf_counter()
            for _ in range(20): f()
            torch.cuda.synchronize(); wall = (time.perf_counter() - t1) / 20
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                f(); torch.cuda.synchronize()
            kern = [(e.name[:40], round(e.device_time, 1)) for e in prof.events() if e.device_time > 0]
            print(f"D{d} mode{mode} transposed={tr}: host {host*1e6:.0f} us/call, wall {wall*1e6:.0f} us/call, kernels {kern}", flush=True)
