"""Throughput of the MUFU ops the SiLU could be built from, on this GPU (session 22: is
``tanh.approx`` as fast as ``ex2.approx``, and do the packed forms help?). Each thread runs eight
independent chains of one op; results per op in Gop/s (values, so a packed f16x2 op counts two)
and in values per clock per SM at the GPU's current SM clock.

    python scripts/mufu_rates.py            # JSON lines to $OUT/mufu.jsonl as well
"""

import json
import os

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cute.runtime import from_dlpack

OPS = {  # name: (PTX with $0 result and $1 input, register type, values per op)
    "tanh.approx.f32": ("tanh.approx.f32 $0, $1;", "f", 1),
    "ex2.approx.ftz.f32": ("ex2.approx.ftz.f32 $0, $1;", "f", 1),
    "rcp.approx.ftz.f32": ("rcp.approx.ftz.f32 $0, $1;", "f", 1),
    "tanh.approx.f16x2": ("tanh.approx.f16x2 $0, $1;", "r", 2),
    "ex2.approx.f16x2": ("ex2.approx.f16x2 $0, $1;", "r", 2),
    "fma.rn.f32 (reference)": ("fma.rn.f32 $0, $1, $1, $1;", "f", 1),
}
CHAINS, ITERS, THREADS = 8, 2048, 256


def make_kernel(code: str, reg: str):
    ty = Float32 if reg == "f" else Uint32

    def op(x):
        return ty(llvm.inline_asm(ty.mlir_type, [ty(x).ir_value()], code, f"={reg},{reg}", has_side_effects=False,
                                  is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))

    @cute.kernel
    def kernel(m: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        i = bid * THREADS + tid
        acc = [ty(m[i]) for _ in range(CHAINS)]
        for _ in cutlass.range(ITERS, unroll=4):
            for c in cutlass.range_constexpr(CHAINS):
                acc[c] = op(acc[c])
        total = acc[0]
        for c in cutlass.range_constexpr(1, CHAINS):
            total = total ^ acc[c] if reg == "r" else total + acc[c]
        m[i] = total

    @cute.jit
    def launch(m: cute.Tensor, blocks: cutlass.Constexpr):
        kernel(m).launch(grid=[blocks, 1, 1], block=[THREADS, 1, 1])

    return launch


def main() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    blocks = sms * 8
    out = os.path.join(os.environ.get("OUT", "."), "mufu.jsonl")
    for name, (code, reg, per_op) in OPS.items():
        dtype = torch.float32 if reg == "f" else torch.int32
        x = torch.full((blocks * THREADS,), 0.25, device="cuda").to(dtype) if reg == "f" else \
            torch.full((blocks * THREADS,), 0x34003400, dtype=torch.int32, device="cuda")
        t = from_dlpack(x)
        fn = cute.compile(make_kernel(code, reg), t, blocks)
        for _ in range(3):
            fn(t)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        reps = 10
        for _ in range(reps):
            fn(t)
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / reps
        values = blocks * THREADS * ITERS * CHAINS * per_op
        try:
            clock = torch.cuda.clock_rate() * 1e6
        except Exception:  # needs pynvml
            clock = float("nan")
        row = dict(op=name, us=round(seconds * 1e6, 1), gvalues_per_s=round(values / seconds / 1e9, 1),
                   values_per_clk_per_sm=round(values / seconds / clock / sms, 2), sm_clock_mhz=clock / 1e6,
                   gpu=torch.cuda.get_device_name())
        print(json.dumps(row), flush=True)
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
