"""Tiny real CuTe DSL kernel + compile key for tests/test_cache.py, and a worker process.

As a module: ``VecAddKey`` (a frozen dataclass compile key) and ``build_vec_add(key)`` which
compiles ``c[i] = a[i] + scale * b[i]`` over a ``cute.sym_int()``-length vector for sm_80 with fake
tensors (no GPU needed).

As a script (``python _cache_worker.py --help``): imports the DSL, optionally announces itself in
a barrier directory and waits for the other workers, then asks a ModuleCache for one variant
(``build`` appends a line to a counter file), optionally runs it on the GPU, and prints one JSON
line with the stats.
"""

import os
import sys
import time
from dataclasses import dataclass

os.environ.setdefault("CUTE_DSL_ARCH", "sm_80")

ARCH = "sm_80"


@dataclass(frozen=True)
class VecAddKey:
    scale: int = 2
    dtype: str = "float32"
    arch: str = ARCH

    @property
    def kernel_name(self) -> str:
        return "test_vec_add"


def build_vec_add(key: VecAddKey, jit_engine: bool = True):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    dtype = {"float32": cutlass.Float32, "float16": cutlass.Float16}[key.dtype]
    scale = float(key.scale)  # baked into the kernel as a constant

    @cute.kernel
    def vec_add_kernel(a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, n: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * 128 + tidx
        if i < n:
            c[i] = a[i] + b[i] * dtype(scale)

    @cute.jit
    def vec_add(a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, stream):
        n = cute.size(a, mode=[0])
        vec_add_kernel(a, b, c, n).launch(grid=[(n + 127) // 128, 1, 1], block=[128, 1, 1], stream=stream)

    n = cute.sym_int()
    a = make_fake_compact_tensor(dtype, (n,), assumed_align=16)
    b = make_fake_compact_tensor(dtype, (n,), assumed_align=16)
    c = make_fake_compact_tensor(dtype, (n,), assumed_align=16)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(vec_add, a, b, c, stream, options=f"--enable-tvm-ffi --gpu-arch {key.arch}",
                        no_jit_engine=not jit_engine)


def _parse(argv):
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--fingerprint", required=True)
    p.add_argument("--scale", type=int, default=2)
    p.add_argument("--arch", default=ARCH)
    p.add_argument("--barrier-dir", help="wait until --workers processes are ready")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--counter-file", help="build() appends a line here")
    p.add_argument("--call", action="store_true", help="run the kernel on the GPU (torch)")
    return p.parse_args(argv)


def _main(argv):
    import json

    args = _parse(argv)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from hstu_cute.cache import ModuleCache

    import cutlass.cute  # noqa: F401  (pay the import before the barrier)

    cache = ModuleCache(args.cache_dir, fingerprint_override=args.fingerprint)
    key = VecAddKey(scale=args.scale, arch=args.arch)

    def build():
        if args.counter_file:
            with open(args.counter_file, "a") as f:
                f.write(f"{os.getpid()}\n")
        return build_vec_add(key)

    if args.barrier_dir:
        open(os.path.join(args.barrier_dir, f"ready.{os.getpid()}"), "w").close()
        deadline = time.monotonic() + 60
        while len(os.listdir(args.barrier_dir)) < args.workers:
            if time.monotonic() > deadline:
                print("barrier timeout", file=sys.stderr)
                return 2
            time.sleep(0.002)
    t0 = time.perf_counter()
    fn = cache.get(key, build)
    elapsed = time.perf_counter() - t0
    timing = cache.timing(key)
    result = {
        "pid": os.getpid(),
        "callable": callable(fn),
        "type": type(fn).__name__,
        "stats": cache.stats.as_dict(),
        "source": timing.source,
        "seconds": timing.seconds,
        "lock_wait_s": timing.lock_wait_s,
        "elapsed": elapsed,
    }
    if args.call:
        import torch

        n = 1000  # not a multiple of the block: exercises the bound check
        # small integers: a + scale * b is exact in float32 whatever the rounding/fma order
        torch.manual_seed(0)  # the same operands in every worker and run
        a = torch.randint(-1000, 1000, (n,), device="cuda").float()
        b = torch.randint(-1000, 1000, (n,), device="cuda").float()
        c = torch.full((n,), float("nan"), device="cuda")
        fn(a, b, c)  # positional; the stream is torch's current stream
        torch.cuda.synchronize()
        result["max_err"] = (c - (a + args.scale * b)).abs().max().item()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
