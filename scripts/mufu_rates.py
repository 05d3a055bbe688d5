"""Throughput of the MUFU ops the SiLU could be built from, on this GPU (session 22: is
``tanh.approx`` as fast as ``ex2.approx``, and do the packed forms help?). Each thread runs eight
independent chains of one op; results per op in Gop/s (values, so a packed f16x2 op counts two)
and in values per clock per SM at the GPU's current SM clock.

    python scripts/mufu_rates.py            # JSON lines to $OUT/mufu.jsonl as well
    python scripts/mufu_rates.py --warps 1 2 4 --chains 8 16 --ops tanh silu

``--warps W``: one CTA of 128 W threads per SM, so W warps per scheduler (the FP8 forward's SiLU
phase has one warp per scheduler issuing it while the other consumer warpgroup runs its GEMMs:
what matters there is one warp's rate, not a full SM's). Without it, 8 CTAs of 256 threads per SM
(16 warps per scheduler), the session-22 setup.
"""

import argparse
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
    # The P-cast kernel's SiLU per value (scale, tanh, x * t + x), its fp32 ops only.
    "silu.f32 (mul, tanh, fma)": ("{ .reg .f32 t; mul.f32 t, $1, 0f3F000000; tanh.approx.f32 t, t; "
                                  "fma.rn.f32 $0, t, $1, $1; }", "f", 1),
    # The packers' conversions (two values per op; the packed bits go back in as the next input).
    "cvt.e4m3x2.f32": ("{ .reg .b16 h; cvt.rn.satfinite.e4m3x2.f32 h, $1, $1; mov.b32 $0, {h, h}; }", "f", 2),
    "cvt.f16x2.f32": ("{ .reg .b32 h; cvt.rn.f16x2.f32 h, $1, $1; mov.b32 $0, h; }", "f", 2),
    # Two SiLU values and their e4m3 pack, as in the P-cast packer.
    "silu2+cvt.e4m3x2": ("{ .reg .f32 a, b, t, u; .reg .b16 h; mul.f32 a, $1, 0f3F000000; mul.f32 b, $1, 0f3E800000; "
                         "tanh.approx.f32 t, a; tanh.approx.f32 u, b; fma.rn.f32 t, t, $1, $1; fma.rn.f32 u, u, $1, $1; "
                         "cvt.rn.satfinite.e4m3x2.f32 h, t, u; mov.b32 $0, {h, h}; }", "f", 2),
}
ITERS = 2048


def make_kernel(code: str, reg: str, chains: int, threads: int):
    ty = Float32 if reg == "f" else Uint32

    def op(x):
        return ty(llvm.inline_asm(ty.mlir_type, [ty(x).ir_value()], code, f"={reg},{reg}", has_side_effects=False,
                                  is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))

    @cute.kernel
    def kernel(m: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        i = bid * threads + tid
        acc = [ty(m[i]) for _ in range(chains)]
        for _ in cutlass.range(ITERS, unroll=4):
            for c in cutlass.range_constexpr(chains):
                acc[c] = op(acc[c])
        total = acc[0]
        for c in cutlass.range_constexpr(1, chains):
            total = total ^ acc[c] if reg == "r" else total + acc[c]
        m[i] = total

    @cute.jit
    def launch(m: cute.Tensor, blocks: cutlass.Constexpr):
        kernel(m).launch(grid=[blocks, 1, 1], block=[threads, 1, 1])

    return launch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--warps", type=int, nargs="*", default=[0], help="warps per scheduler (0: 8 CTAs x 256 threads)")
    ap.add_argument("--chains", type=int, nargs="*", default=[8], help="independent chains per thread")
    ap.add_argument("--ops", nargs="*", default=None, help="substrings of the op names to run")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = os.path.join(os.environ.get("OUT", "."), "mufu.jsonl")
    runs = [(name, w, c) for name in OPS if args.ops is None or any(o in name for o in args.ops)
            for w in args.warps for c in args.chains]
    for name, warps, chains in runs:
        code, reg, per_op = OPS[name]
        threads, blocks = (256, sms * 8) if warps == 0 else (128 * warps, sms)
        dtype = torch.float32 if reg == "f" else torch.int32
        x = torch.full((blocks * threads,), 0.25, device="cuda").to(dtype) if reg == "f" else \
            torch.full((blocks * threads,), 0x34003400, dtype=torch.int32, device="cuda")
        t = from_dlpack(x)
        fn = cute.compile(make_kernel(code, reg, chains, threads), t, blocks)
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
        values = blocks * threads * ITERS * chains * per_op
        try:
            clock = torch.cuda.clock_rate() * 1e6
        except Exception:  # needs pynvml
            clock = float("nan")
        row = dict(op=name, warps_per_scheduler=warps or 16, chains=chains, us=round(seconds * 1e6, 1), gvalues_per_s=round(values / seconds / 1e9, 1),
                   values_per_clk_per_sm=round(values / seconds / clock / sms, 2), sm_clock_mhz=clock / 1e6,
                   gpu=torch.cuda.get_device_name())
        print(json.dumps(row), flush=True)
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
