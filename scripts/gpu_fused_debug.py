"""Fused-backward bring-up: one small case per path, with progress lines and a watchdog."""
import faulthandler, sys, time
import torch
from hstu_cute import api, reference
from hstu_cute.bwd_launch import run_backward

faulthandler.dump_traceback_later(int(sys.argv[1]) if len(sys.argv) > 1 else 60, exit=True)
b = reference.random_jagged_batch(2, 2, 128, 256, device="cuda", window_size=(-1, 0), lengths="full", seed=3)
p = api.validate(b["q"], b["k"], b["v"], b["seq_offsets_q"], b["seq_offsets_k"], 256, 256, None, None, 1, (-1, 0), 1.0,
                 None, False, False, None, None, None, None, -1, -1, None, None)
dout = torch.randn_like(b["q"])
for det in (True, False):
    t = time.time()
    out = run_backward(dout, b["q"], b["k"], b["v"], b["seq_offsets_q"], b["seq_offsets_k"], 256, 256, None, None, 1, 1.0,
                       None, False, None, None, p, det)
    print("launched det", det, time.time() - t, flush=True)
    torch.cuda.synchronize()
    print("done det", det, time.time() - t, flush=True)
    g = reference.reference_grads(**b, dout=dout, has_drab=False)
    for nm, x in zip(("dq", "dk", "dv"), out[:3]):
        print(nm, float((x.float() - g[nm].float()).abs().max()), float(g[nm].abs().max()), flush=True)
