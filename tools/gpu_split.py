"""Split keys on the GPU: serving workloads with few query tiles, each call with the launcher's
parts (launch.heuristics.key_splits) and with one part, paged and on contiguous keys, in the same
run; one JSON line per workload (``--out``). HSTU_CUTE_ARCH=sm80 times the sm80 kernels (on any GPU).
tools/gpu_check.sh runs it in its ``serving`` stage.

    python tools/gpu_split.py [--reps 30] [--out split.jsonl]
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def workloads() -> list:
    from hstu_cute.bench_serving import ServingWorkload

    return [
        ServingWorkload("1 user x (4096 + 256), 64 targets", 1, 4096, 256, 64),
        ServingWorkload("1 user x (4096 + 1)", 1, 4096, 1, 0),
        ServingWorkload("1 user x (16384 + 256), 64 targets", 1, 16384, 256, 64),
        ServingWorkload("8 users x (4096 + 64), 16 targets", 8, 4096, 64, 16),
        ServingWorkload("16 users x (2048 + 128), 32 targets", 16, 2048, 128, 32),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="append the JSON lines to this file")
    parser.add_argument("--reps", type=int, default=30, help="timed calls per line")
    args = parser.parse_args()
    import torch

    from hstu_cute import arch, launch, validation
    from hstu_cute.bench import time_flushed
    from hstu_cute.bench_serving import _graphed, _pairs, make_serving_inputs, serving_calls

    default_splits = launch.fwd.key_splits
    for w in workloads():
        x = make_serving_inputs(w)
        row = dict(workload=w.name, page_size=w.page_size, gpu=torch.cuda.get_device_name())
        p, _ = validation.problem_of_op_args(x["q_new"], x["offsets_new"], w.new, w.cached + w.new, None,
                                             x["num_targets"], -1, 0, None, True, w.new)
        device = x["q_new"].device
        row["path"] = arch.kernel_path(device)
        key = launch.fwd_key(p, arch.device_arch(device), None, path=row["path"])
        row["splits"] = default_splits(p, key.tile_m, key.tile_n, w.new, w.cached + w.new, arch.num_sms(device))
        flops = 4 * w.heads * w.head_dim * _pairs(w) * w.users
        with torch.no_grad():
            outs = {}
            for label, chooser in (("split", default_splits), ("one", lambda *a: 1)):
                launch.fwd.key_splits = chooser
                # Fresh call records (empty plan caches): a prepared launch keeps the parts it was
                # built with, and the public call and serving_calls take memoized ones per signature.
                validation._VALIDATED.clear()
                validation._PROBLEMS.clear()
                calls = serving_calls(w, x)
                for name in ("paged", "contiguous"):
                    outs[(label, name)] = calls[name]().float()
                    ms, _ = time_flushed([calls[name]], reps=args.reps)
                    row[f"{name}_{label}_us"] = round(ms * 1e3, 1)
                    graph_ms, _ = time_flushed([_graphed(calls[name])], reps=args.reps)
                    row[f"{name}_{label}_graph_us"] = round(graph_ms * 1e3, 1)
                    row[f"{name}_{label}_graph_tflops"] = round(flops / graph_ms / 1e9, 1)
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    for _ in range(50):
                        calls[name]()
                    row[f"{name}_{label}_host_us"] = round((time.perf_counter() - start) / 50 * 1e6, 1)
                    torch.cuda.synchronize()
            launch.fwd.key_splits = default_splits
        ref = outs[("one", "contiguous")]
        row["max_rel_diff_split_vs_one"] = max(
            ((outs[(l, n)] - ref).abs().max() / ref.abs().max()).item() for l, n in outs)
        for g in ("", "_graph"):
            row[f"paged_speedup{g}"] = round(row[f"paged_one{g}_us"] / row[f"paged_split{g}_us"], 2)
            row[f"contiguous_speedup{g}"] = round(row[f"contiguous_one{g}_us"] / row[f"contiguous_split{g}_us"], 2)
            row[f"paged_over_contiguous_split{g}"] = round(row[f"paged_split{g}_us"] / row[f"contiguous_split{g}_us"], 3)
        line = json.dumps(row)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a", encoding="utf-8") as fh:
                fh.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
