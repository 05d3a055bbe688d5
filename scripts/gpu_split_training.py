"""Split keys in a training step (H100): autograd forward + backward of the public call, and the
forward alone, for small causal batches, with the launcher's parts (launch.heuristics.key_splits) and
with splits off (``launch.heuristics.MIN_SPLITS = 10**9``), interleaved in the same run.

bf16, D128, causal, alpha = 1/sqrt(128), full-length sequences, 3 input sets rotated. Per row:
the forward's parts as the launcher chose them (recorded from ``launch.fwd.key_splits`` during the
calls), median ms of the training step and of the forward alone (CUDA events, L2 flushed before
each sample, launches queued with no host sync inside the loop, ``--reps`` samples per setting in
two interleaved halves), the forward's device time from CUDA-graph replays (L2 flushed), and the
largest difference of output / gradients between the two settings relative to their scale.

    python scripts/gpu_split_training.py [--reps 50]

Prints a markdown table; writes ``$OUT/gpu_split_training.json`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

import torch

from hstu_cute import arch, hstu_attn_varlen_func, launch, validation
from hstu_cute.bench import Workload, _flush_l2, make_inputs
from hstu_cute.bench_serving import _graphed

# The asked-for batches (H4), then two shapes of as many query tiles (32) where longer keys are
# split at H4's tile count too (4 parts): what the split path does to a training step there.
WORKLOADS = [
    Workload("B1 N1024 H4", 1, 1024),
    Workload("B1 N2048 H4", 1, 2048),
    Workload("B2 N1024 H4", 2, 1024),
    Workload("B1 N4096 H4", 1, 4096),
    Workload("B1 N2048 H2", 1, 2048, heads=2),
    Workload("B1 N4096 H1", 1, 4096, heads=1),
]
ALPHA = 1.0 / math.sqrt(128)
SETTINGS = ("split", "nosplit")


def samples_ms(fn, reps: int, warmup: int = 3) -> list[float]:
    """``reps`` single-call times (ms), L2 flushed before each (outside the events), no host sync
    inside the loop (as hstu_cute.bench.time_flushed, returning the samples)."""
    flush = _flush_l2()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]


class Splits:
    """Sets MIN_SPLITS for a setting and records the parts key_splits returns."""

    def __init__(self):
        self.default_min, self.choose = launch.heuristics.MIN_SPLITS, launch.fwd.key_splits
        self.seen: set[int] = set()
        launch.fwd.key_splits = self._record

    def _record(self, *args):
        parts = self.choose(*args)
        self.seen.add(parts)
        return parts

    def use(self, setting: str):
        launch.heuristics.MIN_SPLITS = self.default_min if setting == "split" else 10**9
        # Fresh call records (empty plan caches) for the public call: a prepared forward keeps
        # the parts it was built with.
        validation._VALIDATED.clear()

    def restore(self):
        launch.heuristics.MIN_SPLITS, launch.fwd.key_splits = self.default_min, self.choose


def inputs(w: Workload, seed: int) -> dict:
    kw = {k: v for k, v in make_inputs(w, seed=seed).items() if not k.startswith("_")}
    kw["alpha"] = ALPHA
    for name in ("q", "k", "v"):
        kw[name].requires_grad_(True)
    kw["_dout"] = torch.rand_like(kw["q"]) * 2 - 1
    return kw


def step(kw):
    out = hstu_attn_varlen_func(**{k: v for k, v in kw.items() if not k.startswith("_")})
    return (out, *torch.autograd.grad(out, (kw["q"], kw["k"], kw["v"]), kw["_dout"]))


def forward(kw):
    with torch.no_grad():
        return hstu_attn_varlen_func(**{k: v for k, v in kw.items() if not k.startswith("_")})


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def run(w: Workload, splits: Splits, reps: int) -> dict:
    sets = [inputs(w, s) for s in range(3)]
    row = dict(workload=w.name, batch=w.batch, max_len=w.max_len, heads=w.heads, head_dim=w.head_dim,
               dtype=w.dtype, alpha=ALPHA, reps=reps)
    results = {}
    for setting in SETTINGS:
        splits.use(setting)
        splits.seen.clear()
        results[setting] = [t.detach().clone() for t in step(sets[0])]
        forward(sets[0])
        torch.cuda.synchronize()
        row[f"parts_{setting}"] = sorted(splits.seen)
    row["max_rel_diff"] = {name: rel_diff(a, b) for name, a, b in
                           zip(("out", "dq", "dk", "dv"), results["split"], results["nosplit"])}
    times = {f"{kind}_{s}": [] for kind in ("step", "fwd", "fwd_graph") for s in SETTINGS}
    counters = {s: 0 for s in SETTINGS}

    def rotating(fn, setting):
        def call():
            i = counters[setting] = counters[setting] + 1
            return fn(sets[i % len(sets)])
        return call

    half = max(1, reps // 2)
    for _ in range(2):  # two interleaved halves: split, no split, split, no split
        for setting in SETTINGS:
            splits.use(setting)
            times[f"step_{setting}"] += samples_ms(rotating(step, setting), half)
            times[f"fwd_{setting}"] += samples_ms(rotating(forward, setting), half)
    for setting in SETTINGS:  # the forward's device time: one graph per setting (input set 0)
        splits.use(setting)
        try:
            times[f"fwd_graph_{setting}"] = samples_ms(_graphed(lambda: forward(sets[0])), reps)
        except Exception as exc:  # noqa: BLE001  (reported in the row, the eager lines still count)
            row[f"fwd_graph_{setting}_error"] = f"{type(exc).__name__}: {exc}"
            times[f"fwd_graph_{setting}"] = [float("nan")]
    splits.use("split")
    for name, ts in times.items():
        row[f"{name}_ms"] = statistics.median(ts)
        row[f"{name}_iqr_ms"] = (sorted(ts)[(3 * len(ts)) // 4] - sorted(ts)[len(ts) // 4])
    for kind in ("step", "fwd", "fwd_graph"):
        row[f"{kind}_speedup"] = row[f"{kind}_nosplit_ms"] / row[f"{kind}_split_ms"]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=50, help="samples per setting and measure (default 50)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.cuda.get_device_name()
    print(f"{dev}, {arch.num_sms(torch.device('cuda'))} SMs, torch {torch.__version__}, "
          f"MIN_SPLITS {launch.heuristics.MIN_SPLITS}, MAX_SPLITS {launch.heuristics.MAX_SPLITS}", flush=True)
    splits = Splits()
    rows = []
    try:
        for w in WORKLOADS:
            row = run(w, splits, args.reps)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        splits.restore()
    print()
    print("| workload (bf16 D128 causal) | parts | step ms split / no split | step speedup | "
          "fwd ms split / no split | fwd speedup | fwd graph us split / no split | max rel diff out / dq / dk / dv |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        parts = ",".join(map(str, r["parts_split"])) + " / " + ",".join(map(str, r["parts_nosplit"]))
        d = r["max_rel_diff"]
        print(f"| {r['workload']} | {parts} | {r['step_split_ms']:.3f} / {r['step_nosplit_ms']:.3f} | "
              f"{r['step_speedup']:.2f}x | {r['fwd_split_ms']:.3f} / {r['fwd_nosplit_ms']:.3f} | "
              f"{r['fwd_speedup']:.2f}x | {r['fwd_graph_split_ms'] * 1e3:.1f} / {r['fwd_graph_nosplit_ms'] * 1e3:.1f} | "
              f"{d['out']:.1e} / {d['dq']:.1e} / {d['dk']:.1e} / {d['dv']:.1e} |")
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "gpu_split_training.json"), "w", encoding="utf-8") as fh:
            json.dump(dict(device=dev, torch=torch.__version__, rows=rows), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
