"""Two GPUs (issue 47): a call whose tensors live on cuda:1 while the current device is cuda:0
runs on cuda:1 and on its current stream, forward and backward, both kernel paths: the ratio rule
against the oracle, the same bits as the same call on cuda:0 (deterministic backward), and the
current device left as it was. Skips without two GPUs."""

from __future__ import annotations

import pytest
import torch

from hstu_cute import hstu_attn_varlen_func
from hstu_cute.testing import check_against_oracle, random_jagged_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]


def _batch(device):
    return random_jagged_batch(4, 2, 128, 700, device=device, seed=47, lengths=[0, 17, 700, 300],
                               window_size=(-1, 0), num_contexts=[0, 3, 20, 5], num_targets=[0, 5, 33, 7],
                               rab_heads=1, alpha=0.5)


def _step(b, stream=None):
    leaves = {n: b[n].detach().clone().requires_grad_() for n in ("q", "k", "v")}
    with torch.cuda.stream(stream) if stream is not None else torch.cuda.device(b["q"].device):
        out = hstu_attn_varlen_func(**dict(b, **leaves), deterministic=True)
        out.backward(torch.ones_like(out) * 1e-2)
    torch.cuda.synchronize(b["q"].device)
    return [out.detach()] + [leaves[n].grad for n in ("q", "k", "v")]


def test_first_call_on_the_second_gpu_from_the_first(path):
    """The process's first calls for cuda:1 made while cuda:0 is current (the per-device state,
    counters and fillers, is created then), forward and backward, with no oracle in the way: the
    same bits as the same step made under ``torch.cuda.device(1)``. First in the file: later tests
    find that state made."""
    torch.cuda.set_device(0)
    b1 = _batch("cuda:1")
    got = _step(b1)
    assert torch.cuda.current_device() == 0
    with torch.cuda.device(1):
        want = _step(b1)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_tensors_on_the_second_gpu(path):
    torch.cuda.set_device(0)
    b1 = _batch("cuda:1")
    leaves = check_against_oracle(b1, 47)
    assert torch.cuda.current_device() == 0
    assert leaves["out"].device == torch.device("cuda", 1) and leaves["q"].grad.device == torch.device("cuda", 1)
    on1 = _step(b1)
    on0 = _step(_batch("cuda:0"))
    for got, want in zip(on1, on0):
        assert torch.equal(got.cpu(), want.cpu())
    assert torch.cuda.current_device() == 0


def test_the_second_gpus_side_stream(path):
    """The launches go to the tensors' device's current stream: a side stream of cuda:1 (current
    device 0) computes the same bits as its default stream."""
    torch.cuda.set_device(0)
    b1 = _batch("cuda:1")
    side = torch.cuda.Stream(device="cuda:1")
    with torch.cuda.device(1):
        side.wait_stream(torch.cuda.current_stream())
    for got, want in zip(_step(b1, side), _step(b1)):
        assert torch.equal(got, want)
    assert torch.cuda.current_device() == 0
