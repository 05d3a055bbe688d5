"""SM clock and power while one forward kernel runs back to back (session 23): is the FP8
forward's TF/s bounded by a clock the board lowers under its load? B8 N4096 H4 causal; lines
"bf16 D", "fp8 D" (P cast, pre-quantized per tensor); nvidia-smi samples every 100 ms over ~3 s of
launches per line, printed as median clock / power / active throttle reasons, with the line's TF/s.

    python scripts/clock_under_load.py [D ...]
"""

import statistics
import subprocess
import sys
import time

import torch

from hstu_cute import bench, launch
from hstu_cute.quantize import QuantMode, quantize_batch
from hstu_cute.testing import call_record


def fp8_call(kw, offsets):
    quantized = quantize_batch(kw, QuantMode.PER_TENSOR)
    args, descales = tuple(x.data for x in quantized), tuple(x.scale for x in quantized)
    call, rab = call_record(**dict(kw, q=args[0], k=args[1], v=args[2]),
                            **dict(zip(("descale_q", "descale_k", "descale_v"), descales)))
    q8, k8, fp8 = launch.prepare_fp8(*args, call)
    return lambda: launch.forward(q8, k8, None, rab, call, fp8=fp8)


def bf16_call(kw, offsets):
    from hstu_cute import hstu_attn_varlen_func
    return lambda: hstu_attn_varlen_func(kw["q"], kw["k"], kw["v"], *offsets, num_contexts=None, num_targets=None,
                                         window_size=kw["window_size"])


def main() -> None:
    dims = [int(a) for a in sys.argv[1:]] or [128]
    for D in dims:
        w = bench.Workload(f"full B8 N4096 D{D}", 8, 4096, head_dim=D)
        kw = {k: v for k, v in bench.make_inputs(w).items() if not k.startswith("_")}
        offsets = (kw["seq_offsets_q"], kw["seq_offsets_k"], kw["max_seqlen_q"], kw["max_seqlen_k"])
        flops = 4 * 8 * 4 * 4096 * 4096 * D / 2
        for name, make in (("bf16", bf16_call), ("fp8", fp8_call)):
            fn = make(kw, offsets)
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active",
                                    "--format=csv,noheader,nounits", "-lms", "100"], stdout=subprocess.PIPE, text=True)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t_end, calls = time.time() + 3.0, 0
            start.record()
            while time.time() < t_end:
                for _ in range(50):
                    fn()
                calls += 50
                torch.cuda.synchronize()
            end.record()
            torch.cuda.synchronize()
            smi.terminate()
            samples = [line.split(", ") for line in smi.communicate()[0].strip().splitlines()]
            ms = start.elapsed_time(end) / calls
            clocks = [float(s[0]) for s in samples[2:-1] if len(s) == 3]
            power = [float(s[1]) for s in samples[2:-1] if len(s) == 3]
            reasons = sorted({s[2] for s in samples[2:-1] if len(s) == 3})
            print(f"{name} D{D}: {flops / ms / 1e9:7.1f} TF/s, {ms:.4f} ms; "
                  f"SM clock median {statistics.median(clocks):.0f} "
                  f"MHz (min {min(clocks):.0f}), power median {statistics.median(power):.0f} W, throttle {reasons}",
                  flush=True)


if __name__ == "__main__":
    main()
