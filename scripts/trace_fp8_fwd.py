"""Clock trace of one tile of the D128 P-cast FP8 forward (experiment, session 23). The trace build
is a patch, not part of the shipped kernel: ``git apply scripts/trace_fwd.patch`` first (and a
separate HSTU_CUTE_CACHE_DIR: the variable is read at trace time). With HSTU_CUTE_EXP_TRACE=M
the kernel records %clock at fixed points of each key block of tile
(batch 0, head 0, m-block M), per consumer warpgroup (thread 0 of each) and for the producer
thread, and writes them into head 0 of that tile's output rows. B8 N4096 H4 D128 causal.

    HSTU_CUTE_EXP_TRACE=31 python scripts/trace_fp8_fwd.py [--es]

Per tile of the traced CTA: start, first block done, loop done, end, and the first block's steps
(before the Q wait, Q ready, K ready, its QK^T + the previous tile's P.V done, that tile stored).

Consumer events per block: 0 before the K wait, 1 K ready, 2 turn acquired, 3 QK^T issued,
4 V ready, 5 P.V issued + turn passed, 6 QK^T done, 7 P words ready (SiLU), 8 P.V done.
Producer: 0 before K acquire, 1 K slot free (load issued), 2 before V acquire, 3 V slot free."""

import argparse
import json
import os

import torch

from hstu_cute import bench, launch
from hstu_cute.quantize import QuantMode, quantize_batch
from hstu_cute.testing import call_record

ap = argparse.ArgumentParser()
ap.add_argument("--es", action="store_true")
args = ap.parse_args()
M = int(os.environ["HSTU_CUTE_EXP_TRACE"])
w = bench.Workload("full B8 N4096 D128", 8, 4096, head_dim=128)
kw = {k: v for k, v in bench.make_inputs(w).items() if not k.startswith("_")}
quantized = quantize_batch(kw, QuantMode.PER_TENSOR)
qargs, descales = tuple(x.data for x in quantized), tuple(x.scale for x in quantized)
call, rab = call_record(**dict(kw, q=qargs[0], k=qargs[1], v=qargs[2]),
                        **dict(zip(("descale_q", "descale_k", "descale_v"), descales)))
q8, k8, fp8 = launch.prepare_fp8(*qargs, call)
tiles = None
if args.es:
    from hstu_cute import variants
    tiles = dict(variants.default_hopper_fp8_fwd_tiles(128, False), early_silu=True)
run = lambda: launch.forward(q8, k8, None, rab, call, fp8=fp8, tiles=tiles)
for _ in range(3):
    out = run()
torch.cuda.synchronize()
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for _ in range(10):
    out = run()
end.record()
torch.cuda.synchronize()
ms = start.elapsed_time(end) / 10
flops = 4 * 8 * 4 * 4096 * 4096 * 128 / 2
print(f"traced kernel: {ms:.4f} ms, {flops / ms / 1e9:.1f} TF/s")
words = out.view(torch.int32)[M * 128:M * 128 + 64, 0, :].reshape(-1).cpu().tolist()
rows = [words[r * 16:(r + 1) * 16] for r in range(192)]
t0 = min(v for r in rows for v in r[:9] if v != 0)
rel = lambda v: ((v - t0) & 0xFFFFFFFF) if v != 0 else None
# Per tile of the traced CTA, 16 words: clocks 0, 3, 4, 5, 8-12 and m-block, blocks, head, batch at 1, 2, 6, 7.
result = {"ms": ms, "consumer": {}, "producer": {},
          "tiles": [words[(192 + t) * 16:(192 + t) * 16 + 16] for t in range(63)]}
for wg in (0, 1):
    for n in range(64):
        r = rows[wg * 64 + n]
        if any(r[:9]):
            result["consumer"].setdefault(wg, {})[n] = [rel(v) for v in r[:9]]
for n in range(64):
    r = rows[128 + n]
    if any(r[:4]):
        result["producer"][n] = [rel(v) for v in r[:4]]
print(json.dumps(result))
out_dir = os.environ.get("OUT", ".")
with open(os.path.join(out_dir, f"trace-m{M}{'-es' if args.es else ''}.json"), "w") as f:
    json.dump(result, f)
# A table: blocks in the order the loop visits them (n descending), per warpgroup, cycles from t0.
for wg in (0, 1):
    print(f"warpgroup {wg}: n  Kwait  Kready  turn  QKiss  Vready  PViss  QKdone  Pwords  PVdone")
    for n in sorted(result["consumer"].get(wg, {}), reverse=True):
        print(f"  {n:3d} " + " ".join(f"{v if v is not None else -1:7d}" for v in result["consumer"][wg][n]))
print("producer: n  Kacq  Kfree  Vacq  Vfree")
for n in sorted(result["producer"], reverse=True):
    print(f"  {n:3d} " + " ".join(f"{v if v is not None else -1:7d}" for v in result["producer"][n]))
# The traced CTA's tiles: start, first block done, loop done, end (cycles from its first tile).
tiles_rec = [t for t in result["tiles"] if t[0] != 0 and 0 <= t[2] <= 64 and 0 <= t[1] < 64]
if tiles_rec:
    base = tiles_rec[0][0]
    print("tile  m_block head batch blocks  start  first  loop_end  end   cycles/block   "
          "first block: before Q wait, Q ready, K ready, QK+P.V issued and P ready, stored, done")
    for i, t in enumerate(tiles_rec):
        st, fb, le, en = ((t[j] - base) & 0xFFFFFFFF for j in (0, 3, 4, 5))
        first = " ".join(f"{(t[j] - t[0]) & 0xFFFFFFFF:6d}" for j in (12, 8, 9, 10, 11, 3))
        per_block = (en - st) / max(t[2], 1)
        print(f"  {i:2d} {t[1]:6d} {t[6]:4d} {t[7]:5d} {t[2]:6d} {st:7d} {fb:7d} {le:8d} {en:7d}   {per_block:7.0f}"
              f"   first block (from tile start): descales {first}")
