"""``common.fp8.cast_tile_e4m3``, the piece a forward that casts its own 16-bit Q and K tiles needs
(docs/design/fp8-forward.md, "Mode 5 after session 25"): a 16-bit tile in the swizzled WGMMA smem
layout cast into an e4m3 tile in its own swizzled layout. A probe kernel loads a (rows, D) tile
into the 16-bit layout, casts, and writes the e4m3 tile back by logical coordinates; on the GPU the
bytes must equal ``hstu_cute.quantize``'s cast; on the CPU every probe variant compiles for sm_90a."""


import pytest
import torch

CASES = [("bfloat16", 128, 128), ("float16", 128, 64), ("bfloat16", 64, 256), ("bfloat16", 128, 256)]


def _probe(dtype_name: str, rows: int, cols: int):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32

    from hstu_cute.common.fp8 import cast_tile_e4m3
    from hstu_cute.common.sm90 import sm90_smem_layout
    from hstu_cute.kernel_args import dsl_dtype

    dtype = dsl_dtype(dtype_name)

    class CastTileProbe:
        """One CTA of 128 threads: global (rows, cols) -> 16-bit swizzled smem -> e4m3 swizzled
        smem -> global, by logical coordinates."""

        @cute.jit
        def __call__(self, mX, mY, inverse: Float32, stream):
            self.kernel(mX, mY, inverse).launch(grid=[1, 1, 1], block=[128, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, mX, mY, inverse: Float32):
            tidx, _, _ = cute.arch.thread_idx()
            src_layout = sm90_smem_layout(dtype, rows, cols)
            dst_layout = sm90_smem_layout(cutlass.Float8E4M3FN, rows, cols)

            @cute.struct
            class Storage:
                sSrc: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(src_layout)], 1024]
                sDst: cute.struct.Align[cute.struct.MemRange[cutlass.Float8E4M3FN, cute.cosize(dst_layout)], 1024]

            storage = cutlass.memory.SmemAllocator().allocate(Storage)
            sSrc = storage.sSrc.get_tensor(src_layout)
            sDst = storage.sDst.get_tensor(dst_layout)
            for i in cutlass.range(tidx, rows * cols, 128):
                sSrc[i // cols, i % cols] = mX[i // cols, i % cols]
            cute.arch.sync_threads()
            cast_tile_e4m3(sSrc, sDst, inverse, tidx, 128)
            cute.arch.sync_threads()
            for i in cutlass.range(tidx, rows * cols, 128):
                mY[i // cols, i % cols] = sDst[i // cols, i % cols]

    return CastTileProbe(), dtype


def _compile(dtype_name: str, rows: int, cols: int):
    import cutlass
    import cutlass.cute as cute

    probe, dtype = _probe(dtype_name, rows, cols)
    x = cute.runtime.make_fake_compact_tensor(dtype, (rows, cols), stride_order=(1, 0), assumed_align=16)
    y = cute.runtime.make_fake_compact_tensor(cutlass.Float8E4M3FN, (rows, cols), stride_order=(1, 0),
                                                  assumed_align=16)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(probe, x, y, cutlass.Float32(1.0), stream, options="--enable-tvm-ffi --gpu-arch sm_90a")


@pytest.mark.parametrize("dtype_name, rows, cols", CASES)
def test_cast_tile_compiles_for_sm90(dtype_name, rows, cols, monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    assert _compile(dtype_name, rows, cols) is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs a compute capability 9.x GPU")
@pytest.mark.parametrize("dtype_name, rows, cols", CASES)
def test_cast_tile_matches_the_quantizer(dtype_name, rows, cols, monkeypatch):
    from hstu_cute.quantize import _cast  # the PyTorch cast the device quantizers match bit for bit

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    compiled = _compile(dtype_name, rows, cols)
    torch_dtype = getattr(torch, dtype_name)
    g = torch.Generator(device="cuda").manual_seed(rows * 7 + cols)
    x = (torch.randn(rows, cols, device="cuda", generator=g) * 40).to(torch_dtype)
    x[0, :4] = torch.tensor([1e4, -1e4, 0.0, -0.0], dtype=torch_dtype)  # saturation and signed zero
    scale = torch.tensor(0.37, device="cuda")
    inverse = (1.0 / scale).item()
    y = torch.full((rows, cols), 0x7F, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)  # poisoned
    compiled(x, y, inverse)
    torch.cuda.synchronize()
    want = _cast(x.float(), scale)
    assert torch.equal(y.view(torch.uint8), want.view(torch.uint8))
