"""What each host-side primitive of a call costs alone, on the main thread and on a second thread
(autograd runs CUDA backward nodes on its own device thread): the pieces of the tiny step of
``bench --host`` (B2 N128 H2 D64 bf16 causal) in tight loops, beside PyTorch's own (torch.empty,
an autograd.Function). Min over repeats of us per call. Needs a GPU.

    python scripts/host_primitives.py [--calls 2000]
"""

from __future__ import annotations

import argparse
import threading
import time

import torch

from hstu_cute import api, launch, validation
from hstu_cute.arch import kernel_path
from hstu_cute.bench import NullAttention, tiny_batch


def per_call(fn, calls: int, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    return best


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args(argv)
    (q, k, v), kw = tiny_batch(False)
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    dev = q.device
    offsets, N = kw["seq_offsets_q"], kw["max_seqlen_q"]
    vargs = (q, k, v, offsets, offsets, N, N, None, None, 1, (-1, 0), 0.125, None, False, False, None, None, None,
             None, -1, -1, None, None, None, None, None, None)
    p, plans = validation.validate_memoized(*vargs)
    call = api.Call(p, offsets, offsets, N, N, alpha=kw["alpha"], plans=plans)
    out = launch.forward(q, k, v, None, call)
    dout = torch.randn_like(q)
    launch.backward(dout, q, k, v, None, call)
    (prepared, _), = [plan for key, plan in plans.items() if key[0] == "fwd"]
    values = dict(mQ=q, mK=k, mV=v, mO=out, mRab=None, **launch.prepared._call_tensors(call))
    torch.cuda.synchronize()
    rows = {
        "torch.empty (T, H, D)": lambda: torch.empty(q.shape, dtype=q.dtype, device=dev),
        "torch.empty (3, T, H, D) + unbind": lambda: torch.empty((3,) + tuple(q.shape), dtype=q.dtype,
                                                                  device=dev).unbind(0),
        "3 x torch.empty (T, H, D)": lambda: [torch.empty(q.shape, dtype=q.dtype, device=dev) for _ in range(3)],
        "prepared forward launch (TVM-FFI call)": lambda: prepared(dict(values), dev),
        "launch.forward (validated call)": lambda: launch.forward(q, k, v, None, call),
        "launch.backward (validated call)": lambda: launch.backward(dout, q, k, v, None, call),
        "validate_memoized (hit)": lambda: validation.validate_memoized(*vargs),
        "Call(...) record": lambda: api.Call(p, offsets, offsets, N, N, None, None, None, None, 1, 0.125, False, False,
                                             (None, None, None), None, plans),
        "tile_counter": lambda: launch.tile_counter(dev),
        "kernel_path": lambda: kernel_path(dev),
        "aligned_16": lambda: launch.aligned_16(q),
        "q.device": lambda: q.device,
        "public forward (no grad)": lambda: api.hstu_attn_varlen_func(q, k, v, **kw),
        "null autograd.Function forward (grad)": lambda: NullAttention.apply(qg, kg, vg),
        "null autograd.Function step": lambda: torch.autograd.grad(NullAttention.apply(qg, kg, vg), (qg, kg, vg),
                                                                   dout),
        "public step": lambda: torch.autograd.grad(api.hstu_attn_varlen_func(qg, kg, vg, **kw), (qg, kg, vg), dout),
    }
    main_thread = {name: per_call(fn, args.calls) for name, fn in rows.items()}
    other = {}
    worker = threading.Thread(target=lambda: other.update(
        {name: per_call(fn, args.calls) for name, fn in rows.items() if "step" not in name}))
    worker.start()
    worker.join()
    print(f"{'primitive':44s} {'main thread':>12s} {'other thread':>13s}  (us per call, min of 5)")
    for name in rows:
        print(f"{name:44s} {main_thread[name]:12.2f} {other.get(name, float('nan')):13.2f}")


if __name__ == "__main__":
    main()
