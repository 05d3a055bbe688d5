"""hstu_cute.integrations.fbgemm on meta tensors (no GPU): FBGEMM's current parameter list, the
packed entry, and calls in the other order refused by name (never reinterpreted)."""

from __future__ import annotations

import inspect

import pytest
import torch

import hstu_cute
from hstu_cute.integrations import fbgemm
from hstu_cute.testing import random_paged_batch

FBGEMM_VARLEN = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "max_seqlen_q",
                 "max_seqlen_k", "scaling_seqlen", "num_contexts", "num_targets", "target_group_size", "window_size",
                 "alpha", "rab", "has_drab", "kv_cache", "page_offsets", "page_ids", "last_page_lens", "func",
                 "quant_mode")
FBGEMM_PACKED = ("qkv", "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "max_seqlen_q", "max_seqlen_k",
                 "scaling_seqlen", "num_contexts", "num_targets", "target_group_size", "window_size", "alpha", "rab",
                 "has_drab", "func")


def _jagged(lens, H=2, D=64, device="meta"):
    offsets = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=device)
    total = int(sum(lens))
    return [torch.empty(total, H, D, dtype=torch.bfloat16, device=device) for _ in range(3)], offsets


def test_signatures_are_fbgemms():
    assert tuple(inspect.signature(fbgemm.hstu_attn_varlen_func).parameters) == FBGEMM_VARLEN
    assert tuple(inspect.signature(fbgemm.hstu_attn_qkvpacked_func).parameters) == FBGEMM_PACKED
    # FBGEMM's first twelve parameters have no defaults.
    params = list(inspect.signature(fbgemm.hstu_attn_varlen_func).parameters.values())
    assert all(p.default is inspect.Parameter.empty for p in params[:12])
    assert all(p.default is not inspect.Parameter.empty for p in params[12:])


def test_positional_call_and_delta_q():
    (q, k, v), off = _jagged([5, 17, 0, 9])
    out = fbgemm.hstu_attn_varlen_func(q, k, v, off, off, None, None, 17, 17, -1, None, None, 1, (-1, 0))
    assert out.shape == q.shape and out.device.type == "meta"
    (q2, _, _), off_q = _jagged([1, 2, 0, 3])
    out = fbgemm.hstu_attn_varlen_func(q2, k, v, off_q, off, None, None, 3, 17, -1, None, None)
    assert out.shape == q2.shape  # shorter queries: aligned to the end, no is_delta_q flag


def test_packed_entry_reads_three_views():
    (q, _, _), off = _jagged([5, 17])
    qkv = torch.empty(q.shape[0], 3, 2, 64, dtype=torch.bfloat16, device="meta")
    out = fbgemm.hstu_attn_qkvpacked_func(qkv, off, off, None, None, 17, 17, num_targets=None)
    assert out.shape == q.shape
    with pytest.raises(ValueError, match=r"qkv: expected a 4-D tensor \(L, 3, H, D\)"):
        fbgemm.hstu_attn_qkvpacked_func(qkv[:, :2], off, off, None, None, 17, 17)


def test_mixed_orders_fail_by_name():
    (q, k, v), off = _jagged([5, 17])
    # Our order into FBGEMM's entry: max_seqlen_q lands on seqused_q.
    with pytest.raises(TypeError, match="seqused_q: expected a \\(B,\\) int32 tensor or None.*FBGEMM's current order"):
        fbgemm.hstu_attn_varlen_func(q, k, v, off, off, 17, 17, None, None, 1, None, None)
    # FBGEMM's current order into the top-level entry: seqused_q lands on max_seqlen_q.
    used = torch.tensor([5, 17], dtype=torch.int32, device="meta")
    with pytest.raises(TypeError, match="max_seqlen_q: expected a Python int.*integrations.fbgemm"):
        hstu_cute.hstu_attn_varlen_func(q, k, v, off, off, used, used, 17, 17, -1)
    with pytest.raises(TypeError, match="max_seqlen_q: expected a Python int"):
        hstu_cute.hstu_attn_varlen_func(q, k, v, off, off, None, None, 17, 17)


@pytest.mark.parametrize("func, exc, match", [
    (torch.empty(1, 5, 22 + 256, dtype=torch.int32), NotImplementedError, r"func.shape\[1\] \(n_func\): the kernels take 1 or 3"),
    (torch.empty(1, 2, 22 + 256, dtype=torch.int32), ValueError, r"func: expected shape \(1, n_func, >= 278\)"),
    (torch.empty(1, 3, 22 + 255, dtype=torch.int32), ValueError, r"func: expected shape \(1, n_func, >= 278\)"),
    (torch.empty(2, 3, 22 + 256, dtype=torch.int32), ValueError, "func: expected shape"),
    (torch.empty(1, 3, 22 + 256, dtype=torch.int64), TypeError, "func.dtype: expected torch.int32"),
    ("func", TypeError, "func: expected a torch.Tensor or None"),
])
def test_bad_func_is_refused_by_name(func, exc, match):
    (q, k, v), off = _jagged([5, 17])
    if isinstance(func, torch.Tensor):
        func = func.to("meta")
    with pytest.raises(exc, match=match):
        fbgemm.hstu_attn_varlen_func(q, k, v, off, off, None, None, 17, 17, -1, None, None, func=func)


@pytest.mark.parametrize("n_func", [1, 3])
def test_func_call_has_the_output_shape(n_func):
    (q, k, v), off = _jagged([5, 17])
    func = torch.empty(1, n_func, 22 + 256, dtype=torch.int32, device="meta")
    out = fbgemm.hstu_attn_varlen_func(q, k, v, off, off, None, None, 17, 17, -1, None, None, func=func)
    assert out.shape == q.shape


@pytest.mark.parametrize("quant_mode", [0, 1, 2, 5])
def test_func_with_fp8_has_the_output_shape(quant_mode):
    """FBGEMM's HSTU8Test draws func masks with FP8: both entries take them (the FP8 kernels read
    the same per-row intervals), forward and, for quant modes, training."""
    (q, k, v), off = _jagged([5, 17])
    func = torch.empty(1, 3, 22 + 256, dtype=torch.int32, device="meta")
    out = fbgemm.hstu_attn_varlen_func(q, k, v, off, off, None, None, 17, 17, -1, None, None, func=func,
                                       quant_mode=quant_mode)
    assert out.shape == q.shape and out.dtype == q.dtype
    q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
    out = hstu_cute.hstu_attn_varlen_func(q8, k8, v8, off, off, 17, 17, func=func)
    assert out.shape == q.shape and out.dtype == torch.bfloat16


def test_func_with_another_mask_is_an_error():
    (q, k, v), off = _jagged([5, 17])
    func = torch.empty(1, 3, 22 + 256, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match=r"func: expected no other mask.*window_size=\(-1, 0\)"):
        fbgemm.hstu_attn_varlen_func(q, k, v, off, off, None, None, 17, 17, -1, None, None, 1, (-1, 0), func=func)
    targets = torch.ones(2, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="func: expected no other mask"):
        hstu_cute.hstu_attn_varlen_func(q, k, v, off, off, 17, 17, num_targets=targets, window_size=(-1, 0),
                                        func=func)


def test_paged_call_has_fbgemms_meaning():
    """The same paged batch through both entries: cu_seqlens_k counts cached + target keys."""
    paged, _ = random_paged_batch([0, 17, 40, 64], [3, 5, 16, 1], 2, 32, 16, num_targets=[1, 0, 2, 1], seed=3)
    meta = {n: (t.to("meta") if isinstance(t, torch.Tensor) else t) for n, t in paged.items()}
    out = fbgemm.hstu_attn_varlen_func(
        meta["q"], meta["k"], meta["v"], meta["seq_offsets_q"], meta["seq_offsets_k"], None, None,
        meta["max_seqlen_q"], meta["max_seqlen_k"], -1, None, meta["num_targets"], window_size=(-1, 0),
        alpha=meta["alpha"], kv_cache=meta["kv_cache"], page_offsets=meta["page_offsets"], page_ids=meta["page_ids"],
        last_page_lens=meta["last_page_lens"])
    assert out.shape == meta["q"].shape
