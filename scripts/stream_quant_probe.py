"""How fast a per-tensor (quant mode 5) quantizer can be on this GPU when it streams its input
through shared memory with 1D bulk copies (``cp.async.bulk``) instead of per-thread vector loads:
one persistent cooperative CTA per SM, thread 0 issues the copies into a ring, 8 warps consume.
Per tensor: the scale pass maxes |x| over the CTA's chunks (one atomic per CTA), a grid barrier,
then (with the cast) the same chunks come back in reverse order (the L2 still holds part of them)
and leave as e4m3(x * (1 / scale)), 8 bytes per 16-byte input vector. q, k and v (B8 N4096 H4
D128, 32 MiB each in bf16, 96 MiB together: more than the L2) run one after the other, timed as
CUDA-graph replays beside PyTorch's amax, cast and clone of the same three tensors; the amax and
every output byte are checked against PyTorch. A probe (not a shipped kernel): it writes the
plain copy only (no V^T) and assumes contiguous tensors. docs/dev/perf-log.md, session 27: 85-89 us
with the cast, the shipped cooperative quantizer's time.

    python scripts/stream_quant_probe.py [--chunks 16384 32768] [--stages 4 6] [--compile-only]
"""
import argparse

import torch

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, Int64, Uint32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.runtime import make_fake_compact_tensor

from hstu_cute.common.fp8 import div_rn, e4m3x4
from hstu_cute.common.sm90 import advanced
from hstu_cute.hopper.quantize import BlockQuantizer

CONSUMERS = 256


def _bulk_g2s(smem_addr: Int32, gmem_ptr: Int64, nbytes: Int32, mbar_addr: Int32):
    llvm.inline_asm(None, [Int32(smem_addr).ir_value(), Int64(gmem_ptr).ir_value(), Int32(nbytes).ir_value(),
                           Int32(mbar_addr).ir_value()],
                    "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
                    "r,l,r,r", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


def _st_v2(gmem_ptr: Int64, a: Uint32, b: Uint32):
    llvm.inline_asm(None, [Int64(gmem_ptr).ir_value(), Uint32(a).ir_value(), Uint32(b).ir_value()],
                    "st.global.v2.b32 [$0], {$1, $2};", "l,r,r", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT)


class StreamQuant:
    """Warp 0 (thread 0): bulk copies into the ring (PipelineTmaAsync, one stage per chunk); warps
    1-8: the scale pass, then (``cast``) the cast pass. Named barrier 1: the 8 consumer warps."""

    def __init__(self, chunk_bytes: int, stages: int, cast: bool):
        self.chunk = chunk_bytes
        self.stages = stages
        self.cast = cast
        self.vectors = chunk_bytes // 16 // CONSUMERS  # 16-byte vectors per consumer thread and chunk

    @cute.jit
    def __call__(self, mX: cute.Tensor, mOut: cute.Tensor, mAmax: cute.Tensor, mBar: cute.Tensor, num_sms: Int32,
                 stream):
        self.kernel(mX, mOut, mAmax, mBar).launch(grid=[num_sms, 1, 1], block=[32 + CONSUMERS, 1, 1],
                                                  stream=stream, cooperative=True)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mOut: cute.Tensor, mAmax: cute.Tensor, mBar: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()

        @cute.struct
        class Storage:
            mbar: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            warp_max: cute.struct.MemRange[Float32, 8]
            ring: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, self.stages * self.chunk], 1024]

        storage = cutlass.memory.SmemAllocator().allocate(Storage)
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, CONSUMERS // 32)
        pipe = pipeline.PipelineTmaAsync.create(barrier_storage=storage.mbar.data_ptr(), num_stages=self.stages,
                                                producer_group=producer, consumer_group=consumers,
                                                tx_count=self.chunk, defer_sync=True)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        ring = storage.ring.get_tensor(cute.make_layout(self.stages * self.chunk))
        warp_max = storage.warp_max.get_tensor(cute.make_layout(8))
        total = cute.size(mX.shape) * 2
        chunks = total // self.chunk
        count = (chunks - cta + ctas - 1) // ctas
        phases = 2 if const_expr(self.cast) else 1
        x_base = mX.iterator.toint()
        ring_base = ring.iterator.toint()
        if tidx == 0:
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
            for phase in cutlass.range_constexpr(phases):
                if const_expr(phase == 1):
                    self.grid_barrier(mBar, ctas, tidx, False)
                for j in cutlass.range(count, unroll=1):
                    idx = j if const_expr(phase == 0) else count - 1 - j
                    chunk = cta + idx * ctas
                    pipe.producer_acquire(state)
                    _bulk_g2s(Int32(ring_base) + state.index * self.chunk, x_base + Int64(chunk) * self.chunk,
                              Int32(self.chunk), Int32(pipe.producer_get_barrier(state).toint()))
                    state = advanced(state)
        elif tidx >= 32:
            t = tidx - 32
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            amax = Float32(0.0)
            for j in cutlass.range(count, unroll=1):
                pipe.consumer_wait(state)
                for v in cutlass.range_constexpr(self.vectors):
                    vals = self.stage_vector(ring_base, state.index, t, v)
                    for e in cutlass.range_constexpr(8):
                        x = Float32(vals[e])
                        amax = cute.arch.fmax(amax, cute.arch.fmax(x, -x))
                pipe.consumer_release(state)
                state = advanced(state)
            for off in (16, 8, 4, 2, 1):
                amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, off))
            if t % 32 == 0:
                warp_max[t // 32] = amax
            cute.arch.barrier(barrier_id=1, number_of_threads=CONSUMERS)
            if t == 0:
                m = warp_max[0]
                for w in cutlass.range_constexpr(1, 8):
                    m = cute.arch.fmax(m, warp_max[w])
                cute.arch.atomic_max_float32(mAmax.iterator, m)
            if const_expr(self.cast):
                self.grid_barrier(mBar, ctas, t, True)
                inverse = div_rn(Float32(1.0), BlockQuantizer.scale_of(mAmax[0]))
                out_base = mOut.iterator.toint()
                for j in cutlass.range(count, unroll=1):
                    chunk = cta + (count - 1 - j) * ctas
                    pipe.consumer_wait(state)
                    for v in cutlass.range_constexpr(self.vectors):
                        vals = self.stage_vector(ring_base, state.index, t, v)
                        w0 = e4m3x4(*(Float32(vals[e]) * inverse for e in range(4)))
                        w1 = e4m3x4(*(Float32(vals[e]) * inverse for e in range(4, 8)))
                        _st_v2(out_base + Int64(chunk) * (self.chunk // 2) + (t + v * CONSUMERS) * 8, w0, w1)
                    pipe.consumer_release(state)
                    state = advanced(state)

    def stage_vector(self, ring_base: Int32, stage: Int32, t: Int32, v: int) -> cute.Tensor:
        """Consumer thread ``t``'s ``v``-th 16-byte vector of a ring stage, 8 bf16 in registers
        (plain Python, traced inline)."""
        vec = cute.make_tensor(cute.make_ptr(cutlass.BFloat16, ring_base + stage * self.chunk + (t + v * CONSUMERS) * 16,
                                             cute.AddressSpace.smem, assumed_align=16), cute.make_layout(8))
        vals = cute.make_rmem_tensor(cute.make_layout(8), cutlass.BFloat16)
        cute.autovec_copy(vec, vals)
        return vals

    @staticmethod
    @cute.jit
    def grid_barrier(mBar, target: Int32, t: Int32, consumer: cutlass.Constexpr):
        """Every CTA's atomic max before it, visible after it. The consumers' thread 0 counts its
        CTA in (release) and waits for all, then the consumer warps meet; the producer thread waits
        too, so that no chunk of the cast pass is requested before the scale is final. (The shipped
        quantizer's barrier, ``QuantizeSlotsSm90.grid_barrier``, syncs the whole CTA: here the
        producer warp's other lanes never reach it.)"""
        if t == 0:
            if const_expr(consumer):
                cute.arch.fence_acq_rel_gpu()
                cute.arch.atomic_add(mBar.iterator, Int32(1), sem="release", scope="gpu")
            arrived = Int32(0)
            while arrived < target:
                arrived = cute.arch.load(mBar.iterator, Int32, sem="acquire", scope="gpu")
            cute.arch.fence_acq_rel_gpu()
        if const_expr(consumer):
            cute.arch.barrier(barrier_id=1, number_of_threads=CONSUMERS)


def build(chunk: int, stages: int, cast: bool, n: int):
    mx = make_fake_compact_tensor(cutlass.BFloat16, (n,), assumed_align=16)
    mo = make_fake_compact_tensor(cutlass.Uint8, (n,), assumed_align=16)
    ma = make_fake_compact_tensor(Float32, (1,), assumed_align=4)
    mb = make_fake_compact_tensor(Int32, (1,), assumed_align=4)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(StreamQuant(chunk, stages, cast), mx, mo, ma, mb, Int32(132), stream,
                        options="--enable-tvm-ffi --gpu-arch sm_90a")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, nargs="+", default=[16384, 32768])
    ap.add_argument("--stages", type=int, nargs="+", default=[4, 6])
    ap.add_argument("--compile-only", action="store_true")
    a = ap.parse_args()
    n = 8 * 4096 * 4 * 128
    if a.compile_only:
        for cast in (False, True):
            build(a.chunks[0], a.stages[0], cast, n)
        print("compiled")
        return
    from hstu_cute import bench
    from hstu_cute.quantize import QuantMode, quantize
    xs = [torch.randn(8 * 4096, 4, 128, device="cuda", dtype=torch.bfloat16) * (i + 1) for i in range(3)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"3 tensors {tuple(xs[0].shape)} {xs[0].numel() * 2 / 2**20:.1f} MiB each, {sms} SMs", flush=True)
    t = lambda fns: bench.time_graphed(fns, reps=40)[0] * 1000
    print(f"torch over the three: amax {t([lambda: [x.abs().amax() for x in xs]]):.1f} us;  cast x.to(e4m3) "
          f"{t([lambda: [x.to(torch.float8_e4m3fn) for x in xs]]):.1f} us;  clone {t([lambda: [x.clone() for x in xs]]):.1f} us",
          flush=True)
    for cast in (False, True):
        for chunk in a.chunks:
            for stages in a.stages:
                if chunk * stages > 200 * 1024:
                    continue
                outs = [torch.empty(x.shape, dtype=torch.float8_e4m3fn, device="cuda") for x in xs]
                words = torch.zeros(6, dtype=torch.float32, device="cuda")
                fn = build(chunk, stages, cast, n)
                args = [(x.view(-1), o.view(torch.uint8).view(-1), words[2 * i:2 * i + 1],
                         words[2 * i + 1:2 * i + 2].view(torch.int32)) for i, (x, o) in enumerate(zip(xs, outs))]

                def run():
                    words.zero_()
                    for arg in args:
                        fn(*arg, sms)

                run()
                torch.cuda.synchronize()
                ok = True
                offsets = torch.tensor([0, xs[0].shape[0]], dtype=torch.int32, device="cuda")
                for i, (x, o) in enumerate(zip(xs, outs)):
                    ok = ok and torch.equal(words[2 * i], x.float().abs().amax())
                    if cast:
                        ref = quantize(x, QuantMode.PER_TENSOR, offsets, x.shape[0]).data
                        ok = ok and torch.equal(o.view(torch.uint8), ref.view(torch.uint8))
                us = t([run])
                hbm = 3 * (xs[0].numel() * 2 + (xs[0].numel() if cast else 0))
                print(f"{'amax+cast' if cast else 'amax':9s} chunk {chunk // 1024:2d} KiB x {stages:2d} stages, q k v: "
                      f"{us:6.1f} us ({hbm / (us * 1e3):.0f} GB/s of the bytes once), exact {ok}", flush=True)


if __name__ == "__main__":
    main()
