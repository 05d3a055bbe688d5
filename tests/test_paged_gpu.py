"""Paged KV-cache forward vs the dense oracle on the GPU (spec section 6b, ratio rule of section 5).

Each batch is built by :func:`hstu_cute.testing.random_paged_batch` from dense whole sequences
(the oracle's input), its pages in shuffled order among spare pages, and every cache row that
holds no token NaN: a kernel that reads one, or multiplies an unzeroed V row past a sequence's
cached tokens, fails. Outputs are poisoned (NaN) before the launch. Both kernel paths run
(conftest ``path``)."""

from __future__ import annotations

import zlib

import pytest
import torch

from hstu_cute import hstu_attn_varlen_func, launch, reference, validation
from hstu_cute.kv_cache import PagedKVCache, key_offsets
from hstu_cute.call import Call
from hstu_cute.testing import call_record, random_paged_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PAGE_SIZES = (16, 32, 64, 128)
# (cached, new) lengths: empty caches, one token, edge lengths 17 / 1111, exactly full pages
# (128, 384), no new token, a decode step (1 new against 4K), 256 new.
LENGTHS = {
    "edges": ([0, 1, 17, 1111, 128, 384], [1, 17, 0, 1111, 64, 5]),
    "decode": ([4096, 3000], [1, 2]),
    "serve": ([1024, 700, 0, 333], [256, 64, 100, 256]),
}
MASKS = {
    "causal": dict(),
    "ctx+tgt g1": dict(num_contexts=True, num_targets=True, target_group_size=1),
    "tgt g11 rabH": dict(num_targets=True, target_group_size=11, rab_heads="H"),
    "ctx rab1": dict(num_contexts=True, rab_heads=1),
}


def _cases():
    cases = []
    for i, page_size in enumerate(PAGE_SIZES):
        for j, (lname, lengths) in enumerate(LENGTHS.items()):
            mname = list(MASKS)[(i + j) % len(MASKS)]
            cases.append(pytest.param(page_size, lengths, MASKS[mname], (torch.bfloat16, torch.float16)[(i + j) % 2],
                                      (32, 64, 128, 256)[(i + 2 * j) % 4], id=f"p{page_size}-{lname}-{mname}"))
    return cases


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def _batch(page_size, lengths, mask, dtype, head_dim, seed, heads=2):
    cached, new = lengths
    gen = torch.Generator().manual_seed(seed)
    whole = [c + n for c, n in zip(cached, new)]
    ctx = [int(torch.randint(0, w + 1, (1,), generator=gen)) for w in whole] if mask.get("num_contexts") else None
    tgt = [int(torch.randint(0, n + 1, (1,), generator=gen)) for n in new] if mask.get("num_targets") else None
    if ctx is not None and tgt is not None:
        ctx = [min(c, w - t) for c, w, t in zip(ctx, whole, tgt)]
    rab_heads = {"H": heads, 1: 1, None: None}[mask.get("rab_heads")]
    return random_paged_batch(cached, new, heads, head_dim, page_size, dtype=dtype, device="cuda", rab_heads=rab_heads,
                              num_contexts=ctx, num_targets=tgt, target_group_size=mask.get("target_group_size", 1),
                              alpha=0.5, seed=seed)


def _run(paged, path, splits=None):
    call, rab = call_record(**{n: paged[n] for n in ("q", "k", "v", "seq_offsets_q", "seq_offsets_k", "max_seqlen_q",
                                                     "max_seqlen_k", "num_contexts", "num_targets", "target_group_size",
                                                     "window_size", "alpha", "rab", "kv_cache", "page_offsets",
                                                     "page_ids", "last_page_lens")})
    out = torch.full_like(paged["q"], float("nan"))
    launch.forward(paged["q"], paged["k"], paged["v"], rab, call, out=out, path=path, splits=splits)
    torch.cuda.synchronize()
    return out


def _run_contiguous(dense, splits, path, seqused_q=None):
    """The same kernel family on contiguous keys (delta_q), ``splits`` parts of the key blocks:
    the launcher called directly, to pick the path and the splits."""
    p, plans = validation.problem_of_op_args(dense["q"], dense["seq_offsets_q"], dense["max_seqlen_q"],
                                             dense["max_seqlen_k"], dense["num_contexts"], dense["num_targets"], -1, 0,
                                             dense["rab"], True, -1)
    call = Call(p, dense["seq_offsets_q"], dense["seq_offsets_k"], dense["max_seqlen_q"], dense["max_seqlen_k"],
                dense["num_contexts"], dense["num_targets"], seqused_q, None, dense["target_group_size"],
                dense["alpha"], plans=plans)
    out = torch.full_like(dense["q"], float("nan"))
    launch.forward(dense["q"], dense["k"], dense["v"], dense["rab"], call, out=out, path=path, splits=splits)
    torch.cuda.synchronize()
    return out


def _check(out, dense, seed):
    ref32 = reference.hstu_attn_reference(**dense, compute_dtype=torch.float32)
    ref_same = reference.hstu_attn_reference(**dense, compute_dtype=None)
    ok, err, ref_err = reference.ratio_check(out, ref32, ref_same, 2.0)
    assert ok, f"kernel err {err:.3e} vs same-dtype oracle err {ref_err:.3e} (seed {seed})"


@pytest.mark.parametrize("page_size,lengths,mask,dtype,head_dim", _cases())
def test_paged_matches_dense_oracle(path, page_size, lengths, mask, dtype, head_dim):
    seed = _seed(page_size, lengths, sorted(mask.items()), str(dtype), head_dim)
    paged, dense = _batch(page_size, lengths, mask, dtype, head_dim, seed)
    _check(_run(paged, path), dense, seed)


@pytest.mark.parametrize("mname,dtype,head_dim", [("causal", torch.bfloat16, 128), ("ctx+tgt g1", torch.float16, 64),
                                                  ("tgt g11 rabH", torch.bfloat16, 256), ("ctx rab1", torch.bfloat16, 32)])
def test_split_keys_match_dense_oracle(path, mname, dtype, head_dim):
    """Split keys (each tile's key blocks in parts over CTAs, fp32 partial outputs summed), paged
    and on contiguous keys, for part counts that leave short sequences' parts empty (1, 3 and
    16 parts over a 4096-token history beside 17-, 0- and 300-token ones), against the oracle;
    the parts' sum differs from one CTA's sum only by rounding."""
    seed = _seed("split", mname, str(dtype), head_dim)
    paged, dense = _batch(64, ([4096, 17, 0, 300], [256, 1, 5, 64]), MASKS[mname], dtype, head_dim, seed)
    whole = _run(paged, path, splits=1)
    _check(whole, dense, seed)
    for splits in (3, 16):
        out = _run(paged, path, splits=splits)
        _check(out, dense, seed)
        assert (out.float() - whole.float()).abs().max() <= 1e-2 * whole.float().abs().max()
    for splits in (1, 5):
        _check(_run_contiguous(dense, splits, path), dense, seed)


@pytest.mark.parametrize("mname,dtype,head_dim", [("ctx+tgt g1", torch.bfloat16, 96), ("tgt g11 rabH", torch.float16, 192)])
def test_paged_head_dims_96_and_192(path, mname, dtype, head_dim):
    """Head dims 96 and 192 (compiled on first use): the paged forward over edge lengths, then keys
    split in 3 and 16 parts, paged and on contiguous keys, against the oracle."""
    seed = _seed("head-dims", mname, str(dtype), head_dim)
    paged, dense = _batch(32, LENGTHS["edges"], MASKS[mname], dtype, head_dim, seed)
    _check(_run(paged, path), dense, seed)
    paged, dense = _batch(64, ([4096, 17, 0, 300], [256, 1, 5, 64]), MASKS[mname], dtype, head_dim, seed)
    for splits in (3, 16):
        _check(_run(paged, path, splits=splits), dense, seed)
        _check(_run_contiguous(dense, splits, path), dense, seed)


def test_split_keys_default_and_seqused(path):
    """The launcher splits one user's decode-like call by itself (launch.key_splits), and rows
    past seqused_q stay zero with split keys (their partials are zeros)."""
    seed = _seed("split-default")
    paged, dense = _batch(32, ([4096], [200]), MASKS["causal"], torch.bfloat16, 128, seed, heads=4)
    p = validation.validate(paged["q"], paged["k"], paged["v"], paged["seq_offsets_q"], paged["seq_offsets_k"],
                            paged["max_seqlen_q"], paged["max_seqlen_k"], None, None, 1, (-1, 0), 0.5, None, False,
                            False, None, None, None, None, -1, -1, None, None, paged["kv_cache"],
                            paged["page_offsets"], paged["page_ids"], paged["last_page_lens"])
    from hstu_cute.arch import device_arch, num_sms

    device = paged["q"].device
    key = launch.fwd_key(p, device_arch(device), None, path=path)
    assert launch.key_splits(p, key.tile_m, key.tile_n, paged["max_seqlen_q"], paged["max_seqlen_k"],
                             num_sms(device)) > 1
    _check(_run(paged, path), dense, seed)
    used = torch.tensor([150], dtype=torch.int32, device="cuda")
    out = _run_contiguous(dense, 8, path, seqused_q=used)
    ref = _run_contiguous(dense, 1, path, seqused_q=used)
    assert torch.all(out[150:] == 0) and torch.all(ref[150:] == 0)
    assert (out[:150].float() - ref[:150].float()).abs().max() <= 1e-2 * ref[:150].float().abs().max()


def test_paged_public_call_and_checks(path, monkeypatch):
    """The public call (eager) with HSTU_CUTE_CHECK=1, then a bad page id is refused there."""
    seed = _seed("public")
    paged, dense = _batch(32, LENGTHS["serve"], MASKS["ctx+tgt g1"], torch.bfloat16, 128, seed)
    monkeypatch.setenv("HSTU_CUTE_CHECK", "1")
    with torch.no_grad():
        out = hstu_attn_varlen_func(**{k: v for k, v in paged.items() if k not in ("kv_cache", "page_offsets",
                                                                                   "page_ids", "last_page_lens")},
                                    kv_cache=paged["kv_cache"], page_offsets=paged["page_offsets"],
                                    page_ids=paged["page_ids"], last_page_lens=paged["last_page_lens"])
    _check(out, dense, seed)
    bad = paged["page_ids"].clone()
    bad[0] = paged["kv_cache"].shape[0]
    with pytest.raises(ValueError, match="page_ids"):
        hstu_attn_varlen_func(**dict(paged, page_ids=bad))
    lens = paged["last_page_lens"].clone()
    lens[0] = 0
    with pytest.raises(ValueError, match="last_page_lens"):
        hstu_attn_varlen_func(**dict(paged, last_page_lens=lens))


def test_paged_bad_tables_stay_in_bounds(path):
    """Without the checks, page ids outside the cache and offsets past page_ids must not fault
    (compute-sanitizer runs this file too): the output is finite or NaN, never a crash."""
    paged, _ = _batch(16, LENGTHS["edges"], MASKS["causal"], torch.bfloat16, 64, _seed("bad"))
    ids = paged["page_ids"].clone()
    ids[::2] = 1 << 20
    ids[1::3] = -5
    offsets = paged["page_offsets"].clone()
    offsets[-1] = offsets[-1] + 1000
    _run(dict(paged, page_ids=ids, page_offsets=offsets), path)


def test_serving_step_under_cuda_graph(path):
    """Three requests of two users through PagedKVCache in FBGEMM's order: grow the history, append
    the request's new history (its tokens but the targets), then serve the request's tokens from
    the cache in a captured CUDA graph (no host sync), each checked against the dense oracle on the
    whole sequence. The new-history rows of k / v are NaN in the graph's inputs: keys come from
    the pages, so a kernel that reads them fails."""
    torch.manual_seed(0)
    H, D, dtype, page_size = 2, 128, torch.bfloat16, 32
    cache = PagedKVCache(1, 64, page_size, H, D, dtype=dtype, device="cuda", max_sequences=4)
    users = torch.tensor([0, 3], device="cuda")
    history_k = [torch.empty(0, H, D, dtype=dtype, device="cuda") for _ in range(2)]
    history_v = [torch.empty(0, H, D, dtype=dtype, device="cuda") for _ in range(2)]
    new, tgt = 48, 16
    offsets = torch.tensor([0, new, 2 * new], dtype=torch.int32, device="cuda")
    targets = torch.full((2,), tgt, dtype=torch.int32, device="cuda")
    static = {name: torch.empty(2 * new, H, D, dtype=dtype, device="cuda") for name in ("q", "k", "v")}
    max_k = 1024  # user 1 ends with 530 + 3 * 32 history tokens and 16 targets
    graph, out = None, None
    for request, grown in enumerate((100, 37, 128)):
        # Grow each user's history (outside the graph), then take `new` fresh tokens, `tgt` targets.
        lens = torch.tensor([0, grown, 2 * grown], dtype=torch.int32, device="cuda")
        hk = torch.rand(2 * grown, H, D, device="cuda").to(dtype) * 2 - 1
        hv = torch.rand(2 * grown, H, D, device="cuda").to(dtype) * 2 - 1
        cache.append(users, lens, hk, hv)
        fresh = {name: torch.rand_like(t, dtype=torch.float32).to(dtype) * 2 - 1 for name, t in static.items()}
        cache.append(users, offsets, fresh["k"], fresh["v"], num_targets=targets)
        for u in range(2):
            rows = slice(u * new, u * new + new - tgt)
            history_k[u] = torch.cat([history_k[u], hk[u * grown:(u + 1) * grown], fresh["k"][rows]])
            history_v[u] = torch.cat([history_v[u], hv[u * grown:(u + 1) * grown], fresh["v"][rows]])
            for name in ("k", "v"):
                fresh[name][rows] = float("nan")
        for name, t in static.items():
            t.copy_(fresh[name])

        def step():
            page_offsets, page_ids, last_page_lens, cached = cache.lookup(users)
            return hstu_attn_varlen_func(static["q"], static["k"], static["v"], offsets, key_offsets(cached, targets),
                                         new, max_k, num_targets=targets, window_size=(-1, 0),
                                         kv_cache=cache.layer(0), page_offsets=page_offsets, page_ids=page_ids,
                                         last_page_lens=last_page_lens, scaling_seqlen=new)

        with torch.no_grad():
            if graph is None:
                step()  # compile and warm up outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = step()
            graph.replay()
        torch.cuda.synchronize()
        tg = [slice(u * new + new - tgt, (u + 1) * new) for u in range(2)]
        k_full = torch.cat([torch.cat([history_k[u], static["k"][tg[u]]]) for u in range(2)])
        v_full = torch.cat([torch.cat([history_v[u], static["v"][tg[u]]]) for u in range(2)])
        whole = [history_k[u].shape[0] + tgt for u in range(2)]
        dense = dict(q=static["q"], k=k_full, v=v_full, seq_offsets_q=offsets,
                     seq_offsets_k=torch.tensor([0, whole[0], whole[0] + whole[1]], dtype=torch.int32, device="cuda"),
                     max_seqlen_q=new, max_seqlen_k=max_k, num_targets=targets, window_size=(-1, 0),
                     is_delta_q=True, scaling_seqlen=new)
        _check(out, dense, request)
