"""Quick kernel-vs-oracle smoke on a GPU (development aid; the real suite is tests/ + scripts/gpu_check.sh)."""
import sys, time, traceback
import torch
from hstu_cute import api, reference
from hstu_cute.compile import build

def run_case(name, dtype=torch.bfloat16, D=128, **kw):
    b = reference.random_jagged_batch(device="cuda", dtype=dtype, head_dim=D, **kw)
    has_drab = False
    p = api.validate(b["q"], b["k"], b["v"], b["seq_offsets_q"], b["seq_offsets_k"], b["max_seqlen_q"], b["max_seqlen_k"],
                     b.get("num_contexts"), b.get("num_targets"), b.get("target_group_size", 1), b.get("window_size", (-1, -1)),
                     b.get("alpha", 1.0), b.get("rab"), has_drab, b.get("is_delta_q", False), None, None, None, None, -1,
                     b.get("scaling_seqlen", -1), b.get("seqused_q"), b.get("seqused_k"))
    t = time.time()
    out = api.hstu_attn_varlen_func(**b)
    torch.cuda.synchronize(); ct = time.time() - t
    key = api.fwd_key(p, api.device_arch(b["q"].device), b.get("rab"))
    ref32 = reference.hstu_attn_reference(**b)
    refd = reference.hstu_attn_reference(**b, compute_dtype=None)
    ok, ke, re_ = reference.ratio_check(out, ref32, refd, 2.0)
    print(f"{'PASS' if ok else 'FAIL'} {name:40s} kerr={ke:.3e} referr={re_:.3e} compile={ct:.2f}s key={key.describe()}", flush=True)
    return ok

cases = [
    ("none small", dict(batch_size=4, num_heads=2, max_seqlen_q=200, lengths="random")),
    ("causal full 256", dict(batch_size=4, num_heads=2, max_seqlen_q=256, lengths="full", window_size=(-1, 0))),
    ("causal rand 1111", dict(batch_size=4, num_heads=2, max_seqlen_q=1111, window_size=(-1, 0))),
    ("local 111,11", dict(batch_size=4, num_heads=2, max_seqlen_q=500, window_size=(111, 11))),
    ("ctx+tgt g=3", dict(batch_size=4, num_heads=2, max_seqlen_q=300, window_size=(-1, 0), num_contexts=40, num_targets=100, target_group_size=3)),
    ("tgt g=1 rabH", dict(batch_size=4, num_heads=2, max_seqlen_q=256, window_size=(-1, 0), num_targets=200, rab_heads=2)),
    ("rab1 99 alpha", dict(batch_size=4, num_heads=2, max_seqlen_q=99, rab_heads=1, alpha=0.1)),
    ("deltaq causal", dict(batch_size=4, num_heads=2, max_seqlen_q=51, max_seqlen_k=256, is_delta_q=True, window_size=(-1, 0))),
    ("seqused", dict(batch_size=4, num_heads=2, max_seqlen_q=300, seqused=True, window_size=(-1, 0))),
    ("fp16 d64", dict(batch_size=4, num_heads=2, max_seqlen_q=300, window_size=(-1, 0)), torch.float16, 64),
    ("d256", dict(batch_size=2, num_heads=2, max_seqlen_q=300, window_size=(-1, 0)), torch.bfloat16, 256),
    ("d32", dict(batch_size=2, num_heads=2, max_seqlen_q=300), torch.bfloat16, 32),
]
fails = 0
for c in cases:
    name, kw = c[0], c[1]
    dtype = c[2] if len(c) > 2 else torch.bfloat16
    D = c[3] if len(c) > 3 else 128
    try:
        fails += not run_case(name, dtype, D, seed=1, **kw)
    except Exception:
        fails += 1
        print("ERROR", name); traceback.print_exc()
print("fails", fails)
