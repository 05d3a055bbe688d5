"""Quick check of the Hopper forward on the GPU: a few mask families against the oracle (spec
ratio rule), NaN in the rows past seqused, then the headline shape on both paths + cuDNN."""
import sys
import time
import traceback

import torch

from hstu_cute import bench, launch, reference, testing

CASES = {
    "causal d128": dict(head_dim=128, window_size=(-1, 0)),
    "none d64": dict(head_dim=64, window_size=(-1, -1)),
    "local d256": dict(head_dim=256, window_size=(40, 7)),
    "local d32": dict(head_dim=32, window_size=(40, 7)),
    "ctx+tgt g3 d128": dict(head_dim=128, window_size=(-1, 0), num_contexts=9, num_targets=40, target_group_size=3),
    "delta_q d64": dict(head_dim=64, window_size=(-1, 0), is_delta_q=True, max_seqlen_k=300),
    "rab H d128 seqused": dict(head_dim=128, window_size=(-1, 0), rab_heads=2, seqused=True),
    "rab 1 d256": dict(head_dim=256, window_size=(-1, -1), rab_heads=1),
    "fp16 causal d128": dict(head_dim=128, window_size=(-1, 0), dtype=torch.float16),
}
failures = 0
for path in ("hopper", "ampere"):
    for name, kw in CASES.items():
        kw = dict(kw)
        dtype = kw.pop("dtype", torch.bfloat16)
        head_dim = kw.pop("head_dim")
        b = testing.random_jagged_batch(6, 2, head_dim, 99 if kw.get("is_delta_q") else 333, device="cuda",
                                        seed=5, dtype=dtype, **kw)
        if b["seqused_k"] is not None:  # rows past seqused are ignored, whatever they hold
            offs, used = b["seq_offsets_k"].tolist(), b["seqused_k"].tolist()
            for i in range(len(used)):
                b["v"][offs[i] + used[i]:offs[i + 1]] = float("nan")
                b["k"][offs[i] + used[i]:offs[i + 1]] = float("nan")
        try:
            call, rab = testing.call_record(**b)
            out = torch.full_like(b["q"], float("nan"))
            t = time.time()
            launch.forward(b["q"], b["k"], b["v"], rab, call, out=out, path=path)
            torch.cuda.synchronize()
            dt = time.time() - t
            ref32 = reference.hstu_attn_reference(**b)
            ref_same = reference.hstu_attn_reference(**b, compute_dtype=None)
            ok, err, ref_err = reference.ratio_check(out, ref32, ref_same, 2.0)
            nan = bool(torch.isnan(out).any())
            ok = ok and not nan
            failures += not ok
            print(f"{path:7s} {name:22s} {'ok ' if ok else 'BAD'} err {err:.2e} ref {ref_err:.2e} nan={nan} "
                  f"first call {dt:.1f}s", flush=True)
        except Exception:
            failures += 1
            print(f"{path:7s} {name:22s} EXC", flush=True)
            traceback.print_exc()
            if "illegal" in traceback.format_exc():
                sys.exit(3)
if "--bench" in sys.argv:
    w = bench.headline()
    for path in ("hopper", "ampere"):
        r = bench.run_workload(w, path=path)
        print(f"{w.name} {path}: {r['tflops']:.1f} TF  sdpa flash {r['sdpa_flash']:.0f} cudnn {r['sdpa_cudnn'] or 0:.0f}")
    for d in (64, 256):
        w = bench.replace(bench.headline(), name=f"full B8 N4096 D{d}", head_dim=d, sdpa=True)
        r = bench.run_workload(w, path="hopper")
        print(f"{w.name} hopper: {r['tflops']:.1f} TF  cudnn {r['sdpa_cudnn'] or 0:.0f}")
print("failures:", failures)
