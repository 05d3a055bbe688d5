"""Host time of the eager path on a machine without a GPU: CPU tensors, with the kernel launches,
streams and device queries stubbed, so only our Python and PyTorch's autograd are timed (the CPU
stand-in rows of docs/dev/perf-log.md, session 9). The H100 host reads 2-5x these numbers; compare
rows of one run only.

    python scripts/host_standin.py            # us per call: validate, launchers, public call, step
    python scripts/host_standin.py profile    # cProfile of the forward + backward step
"""

import contextlib
import functools
import sys
import time

import torch

import hstu_cute.api as api
import hstu_cute.launch as launch
import hstu_cute.validation as validation
from hstu_cute.bench import NullAttention as AllocOnly  # the floor: an autograd node that only allocates
from hstu_cute.testing import call_record

api._eager = lambda t: type(t) is torch.Tensor and not torch.compiler.is_compiling()
_counter = torch.zeros(2, dtype=torch.int32)
STUBS = dict(kernel_path=lambda device: "hopper", device_arch=lambda device: "sm_90a", num_sms=lambda device: 132,
             _compiled=lambda key: (lambda *args: None), _beside=lambda device: contextlib.nullcontext(),
             _on_device=lambda device: contextlib.nullcontext(), tile_counter=lambda device: _counter)
LAUNCH_MODULES = (launch.buffers, launch.prepared, launch.fwd, launch.bwd, launch.fp8)


def stub(name, value):
    """``name`` replaced in every launch module that holds it (each imports its own reference)."""
    for module in LAUNCH_MODULES:
        if hasattr(module, name):
            setattr(module, name, value)


for _name, _value in STUBS.items():
    stub(_name, _value)
torch.cuda.is_current_stream_capturing = lambda: False
torch._C._cuda_isCurrentStreamCapturing = lambda: False
torch._C._cuda_getDevice = lambda: 0
# Validation insists on CUDA tensors: it runs once per signature, on meta stand-ins.
_validate = validation.validate
validation.validate = functools.wraps(_validate)(
    lambda *a: _validate(*[x.to("meta") if isinstance(x, torch.Tensor) else x for x in a]))

B, N, H, D = 2, 114, 2, 64
q, k, v = (torch.randn(B * N, H, D, dtype=torch.bfloat16) for _ in range(3))
offsets = torch.tensor([0, N, B * N], dtype=torch.int32)
kw = dict(seq_offsets_q=offsets, seq_offsets_k=offsets, max_seqlen_q=N, max_seqlen_k=N, window_size=(-1, 0))
qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
dout = torch.ones_like(q)
args = (q, k, v, offsets, offsets, N, N, None, None, 1, (-1, 0), 1.0, None, False, False, None, None, None, None, -1,
        -1, None, None)
call, _ = call_record(q=q, k=k, v=v, **kw)


def step():
    torch.autograd.grad(api.hstu_attn_varlen_func(qg, kg, vg, **kw), (qg, kg, vg), dout)


def fp8_step(mode: int):
    """An FP8 training step (quant_mode ``mode``)."""

    def run():
        torch.autograd.grad(api.hstu_attn_varlen_func(qg, kg, vg, **kw, quant_mode=mode), (qg, kg, vg), dout)

    return run


ROWS = {
    "validate (memo hit)": lambda: validation.validate_memoized(*args),
    "launch.forward": lambda: launch.forward(q, k, v, None, call),
    "launch.backward": lambda: launch.backward(dout, q, k, v, None, call),
    "public forward": lambda: api.hstu_attn_varlen_func(q, k, v, **kw),
    "public forward, FP8 quant_mode 0": lambda: api.hstu_attn_varlen_func(q, k, v, **kw, quant_mode=0),
    "public forward, FP8 pre-quantized e4m3": lambda: api.hstu_attn_varlen_func(q8, k8, v8, **kw),
    "forward + backward step": step,
    **{f"FP8 step, quant_mode {m}": fp8_step(m) for m in (2, 5, 1, 0)},
    "floor: allocating autograd.Function step": lambda: torch.autograd.grad(AllocOnly.apply(qg, kg, vg), (qg, kg, vg),
                                                                            dout),
}


def us_per_call(fn, calls: int = 3000) -> float:
    for _ in range(200):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


if __name__ == "__main__":
    if sys.argv[1:] == ["profile"]:
        import cProfile
        import pstats

        for _ in range(200):
            step()
        profiler = cProfile.Profile()
        profiler.runcall(lambda: [step() for _ in range(2000)])
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    else:
        launches = []
        stub("_launch", lambda key, compiled, values: launches.append(values))
        stub("_launch_prepared", lambda prepared, values: launches.append(values))
        for name, fn in ROWS.items():
            launches.clear()
            fn()
            count = len(launches)
            print(f"{name:<56} {us_per_call(fn):7.1f} us  {count:2d} launches", flush=True)
