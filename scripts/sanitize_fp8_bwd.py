"""A small jagged batch through every mask family (and rab, delta_q, seqused) on the Hopper FP8
backward at D64, D128 and D256 (quant modes 0, 1, 2 and 4: the cast, the two-direction, the
one-pass and the cooperative quantizers; drab with modes 1 and 2 where the case has rab), gradients
by autograd, for compute-sanitizer. Lengths are random, so sequences start at tokens that are not
multiples of 16 (the token-contiguous copies' padding). Then the opt-in fused kernel at D128 on
a batch with a 2100-token sequence. Skips (exit 0) without a compute capability 9.x GPU."""
import sys

import torch

from hstu_cute import hstu_attn_varlen_func, testing

if torch.cuda.get_device_capability()[0] != 9:
    print("no sm90 GPU: the FP8 kernels do not run here; skipped")
    sys.exit(0)

CASES = {
    "none": dict(window_size=(-1, -1)),
    "causal": dict(window_size=(-1, 0)),
    "local": dict(window_size=(13, 5)),
    "context+target": dict(window_size=(-1, 0), num_contexts=9, num_targets=40, target_group_size=3),
    "delta_q causal": dict(window_size=(-1, 0), is_delta_q=True, max_seqlen_k=150),
    "rab H_rab=1": dict(window_size=(-1, 0), rab_heads=1),
    "rab H_rab=H, seqused": dict(window_size=(-1, 0), rab_heads=2, seqused=True),
}
for name, kw in CASES.items():
    for head_dim in (64, 128, 256):
        b = testing.random_jagged_batch(7, 2, head_dim, 99 if kw.get("is_delta_q") else 131, device="cuda", seed=7,
                                        **kw)
        rest = {k: v for k, v in b.items() if k not in ("q", "k", "v")}
        for mode in (0, 1, 2, 4):
            q, k, v = (b[n].detach().clone().requires_grad_() for n in "qkv")
            out = hstu_attn_varlen_func(q, k, v, **rest, quant_mode=mode)
            grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out) * 1e-2)
            torch.cuda.synchronize()
            assert all(torch.isfinite(g).all() for g in grads), (name, head_dim, mode)
        if rest.get("rab") is not None:
            # has_drab: the dQ kernel's drab stores (per head) or fp32 atomics (one rab head).
            for mode in (1, 2):
                rab = rest["rab"].detach().clone().requires_grad_()
                out = hstu_attn_varlen_func(b["q"], b["k"], b["v"], **dict(rest, rab=rab), has_drab=True,
                                            quant_mode=mode)
                drab = torch.autograd.grad(out, rab, torch.randn_like(out) * 1e-2)[0]
                torch.cuda.synchronize()
                assert torch.isfinite(drab).all(), (name, head_dim, "drab", mode)
        print(f"fp8 backward {name} D{head_dim}: ok", flush=True)

# The fused FP8 kernel (opt-in; D128, modes 0 and 2-5, no rab, keys of at least FUSED_MIN_SEQLEN_K
# tokens): lengths from 1 to 2100, so key blocks end inside K^T's padding and the next sequence.
from hstu_cute import launch  # noqa: E402
from hstu_cute.fp8_recipe import recipe  # noqa: E402

launch.heuristics.FP8_FUSED_BY_DEFAULT = True
for name, kw in CASES.items():
    if "rab" in name:
        continue
    b = testing.random_jagged_batch(3, 2, 128, 2100, device="cuda", seed=8, lengths=[2100, 1, 1500],
                                    **{k: v for k, v in kw.items() if k != "max_seqlen_k"})
    rest = {k: v for k, v in b.items() if k not in ("q", "k", "v")}
    if not launch.fp8_backward_fused(128, recipe(2), rest["max_seqlen_k"], False, False, False):
        continue
    for mode in (0, 2, 4):
        q, k, v = (b[n].detach().clone().requires_grad_() for n in "qkv")
        out = hstu_attn_varlen_func(q, k, v, **rest, quant_mode=mode)
        grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out) * 1e-2)
        torch.cuda.synchronize()
        assert all(torch.isfinite(g).all() for g in grads), (name, "fused", mode)
    print(f"fp8 backward (fused) {name} D128: ok", flush=True)
