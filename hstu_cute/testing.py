"""Random jagged batches for tests, benchmarks and the demo.

:func:`random_jagged_batch` draws the keyword dict accepted by both the oracle
(:func:`hstu_cute.reference.hstu_attn_reference`) and ``hstu_attn_varlen_func``. Every draw comes
from a CPU :class:`torch.Generator`, so a seed gives the same batch on every device. Tests pass
``seed`` explicitly; without one the generator is seeded from torch's global RNG.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["random_jagged_batch", "random_paged_batch"]


def _draw_lengths(spec, B: int, max_len: int, min_len: int, gen: torch.Generator, name: str) -> list[int]:
    if isinstance(spec, str):
        if spec == "full":
            return [max_len] * B
        if spec == "random":
            lo = min(max(min_len, 0), max_len)
            return torch.randint(lo, max_len + 1, (B,), generator=gen).tolist()
        raise ValueError(f"{name} must be 'full', 'random' or a sequence of ints, got {spec!r}")
    out = [int(x) for x in spec]
    if len(out) != B:
        raise ValueError(f"{name} must have batch_size={B} entries, got {len(out)}")
    if any(x < 0 or x > max_len for x in out):
        raise ValueError(f"{name} entries must lie in [0, {max_len}], got {out}")
    return out


def _offsets(lengths: list[int], device) -> torch.Tensor:
    offs = [0]
    for n in lengths:
        offs.append(offs[-1] + n)
    return torch.tensor(offs, dtype=torch.int32, device=device)


def _uniform(shape, gen, dtype, device, requires_grad) -> torch.Tensor:
    x = (torch.rand(shape, generator=gen, dtype=torch.float32) * 2 - 1).to(dtype=dtype, device=device)
    return x.requires_grad_(requires_grad)


def gaussian_jagged_batch(lengths_q: Sequence[int], lengths_k: Sequence[int], heads: int, head_dim: int,
                          dtype: torch.dtype, gen: torch.Generator, *, rab_heads: int | None = None,
                          seqused: bool = False, alpha: float = 0.5, device="cuda") -> dict:
    """Keyword arguments of one call on explicit lengths, drawn from ``gen`` in a fixed order (q,
    k, v, then rab): q, k ~ N(0, 0.25), v ~ N(0, 1); ``is_delta_q`` where the lengths differ;
    ``rab_heads``: a (B, rab_heads, L_k, L_k) bias; ``seqused``: 3 rows fewer per sequence (queries
    capped by keys under delta_q). The GPU test files' common batch."""
    lengths_q, lengths_k = list(lengths_q), list(lengths_k)
    q = (torch.randn(sum(lengths_q), heads, head_dim, generator=gen) * 0.5).to(dtype).to(device)
    k = (torch.randn(sum(lengths_k), heads, head_dim, generator=gen) * 0.5).to(dtype).to(device)
    v = torch.randn(sum(lengths_k), heads, head_dim, generator=gen).to(dtype).to(device)
    b = dict(q=q, k=k, v=v, seq_offsets_q=_offsets(lengths_q, device), seq_offsets_k=_offsets(lengths_k, device),
             max_seqlen_q=max(lengths_q + [1]), max_seqlen_k=max(lengths_k + [1]), is_delta_q=lengths_q != lengths_k,
             alpha=alpha)
    if rab_heads:
        n = b["max_seqlen_k"]
        b["rab"] = (torch.randn(len(lengths_k), rab_heads, n, n, generator=gen) * 0.5).to(dtype).to(device)
    if seqused:
        b["seqused_q"] = torch.tensor([max(n - 3, 0) for n in lengths_q], dtype=torch.int32, device=device)
        b["seqused_k"] = torch.tensor([max(n - 3, 0) for n in lengths_k], dtype=torch.int32, device=device)
        if b["is_delta_q"]:
            b["seqused_q"] = torch.minimum(b["seqused_q"], b["seqused_k"])
    return b


def random_func(lengths_q: Sequence[int], lengths_k: Sequence[int], n_func: int, gen: torch.Generator,
                device="cuda") -> torch.Tensor:
    """An arbitrary ``func`` mask ``(1, n_func, T_q + 256)`` int32 (docs/operator.md, "Arbitrary
    masks"): each row's bounds uniform in ``[-2, L_k + 2]`` of its sequence (out-of-range bounds
    included: the kernels and the oracle clamp them), the padding rows garbage (never read as
    bounds)."""
    from .masks import FUNC_ROW_PADDING

    total = sum(lengths_q)
    func = torch.randint(-(1 << 30), 1 << 30, (1, n_func, total + FUNC_ROW_PADDING), generator=gen, dtype=torch.int32)
    row = 0
    for lq, lk in zip(lengths_q, lengths_k):
        func[0, :, row:row + lq] = torch.randint(-2, lk + 3, (n_func, lq), generator=gen, dtype=torch.int32)
        row += lq
    return func.to(device)


def random_jagged_batch(
    batch_size: int,
    num_heads: int,
    head_dim: int,
    max_seqlen_q: int,
    max_seqlen_k: int | None = None,
    *,
    lengths: str | Sequence[int] = "random",
    lengths_q: str | Sequence[int] | None = None,
    min_seqlen: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    is_delta_q: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    alpha: float = 1.0,
    rab_heads: int | None = None,
    num_contexts: int | Sequence[int] | None = None,
    num_targets: int | Sequence[int] | None = None,
    target_group_size: int = 1,
    seqused: bool = False,
    scaling_seqlen: int = -1,
    requires_grad: bool = False,
    seed: int | None = None,
    generator: torch.Generator | None = None,
) -> dict[str, Any]:
    """Draw a random jagged batch; returns the keyword dict for both
    :func:`hstu_cute.reference.hstu_attn_reference` and ``hstu_attn_varlen_func`` (pass
    ``has_drab=True`` yourself when you want drab).

    * ``lengths``: the key-sequence storage lengths, ``"full"`` (all ``max_seqlen_k``),
      ``"random"`` (uniform in ``[min_seqlen, max_seqlen_k]``) or an explicit list.
    * Without ``is_delta_q``: ``max_seqlen_q`` must equal ``max_seqlen_k`` and the query lengths
      equal the key lengths. With ``is_delta_q``: query lengths come from ``lengths_q`` (same
      options; default ``"random"``, ``"full"`` meaning ``min(Lk, max_seqlen_q)``) and are clipped
      to ``Lq <= min(Lk, max_seqlen_q)`` when drawn.
    * ``seqused``: draw valid prefixes ``seqused_k`` in ``[0, storage_k]`` (and ``seqused_q``: equal
      to ``seqused_k`` clipped to the query storage without delta_q; in ``[0, min(storage_q,
      seqused_k)]`` with delta_q); the rest of the storage is padding.
    * ``num_contexts`` / ``num_targets``: None (absent), an int (upper bound: drawn per sequence
      with ``c + t <= L``, L the valid key length; contexts first) or an explicit list.
    * ``rab_heads``: None (no rab), 1 or ``num_heads``; rab is ``(B, rab_heads, max_seqlen_k,
      max_seqlen_k)`` uniform(-1, 1), like q, k, v.
    Random draws come from a CPU generator (``seed`` or ``generator``), so a seed gives the same
    batch on every device.
    """
    if max_seqlen_k is None:
        max_seqlen_k = max_seqlen_q
    if max_seqlen_q > max_seqlen_k:
        raise ValueError(f"max_seqlen_q={max_seqlen_q} must be <= max_seqlen_k={max_seqlen_k}")
    if not is_delta_q and max_seqlen_q != max_seqlen_k:
        raise ValueError(
            f"max_seqlen_q={max_seqlen_q} < max_seqlen_k={max_seqlen_k} requires is_delta_q=True"
        )
    gen = generator
    if gen is None:
        gen = torch.Generator()
        # Without a seed, draw one from torch's global RNG (so torch.manual_seed makes it repeatable).
        gen.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,))))
    B = batch_size

    store_k = _draw_lengths(lengths, B, max_seqlen_k, min_seqlen, gen, "lengths")
    if is_delta_q:
        if lengths_q is None or isinstance(lengths_q, str):
            mode = lengths_q or "random"
            if mode == "full":
                store_q = [min(n, max_seqlen_q) for n in store_k]
            elif mode == "random":
                store_q = [
                    int(torch.randint(0, min(n, max_seqlen_q) + 1, (1,), generator=gen)) for n in store_k
                ]
            else:
                raise ValueError(f"lengths_q must be 'full', 'random' or a sequence of ints, got {mode!r}")
        else:
            store_q = _draw_lengths(lengths_q, B, max_seqlen_q, 0, gen, "lengths_q")
            if any(a > b for a, b in zip(store_q, store_k)):
                raise ValueError(f"is_delta_q needs Lq <= Lk: lengths_q={store_q}, lengths={store_k}")
    else:
        if lengths_q is not None:
            raise ValueError("lengths_q is only meaningful with is_delta_q=True")
        store_q = list(store_k)

    if seqused:
        used_k = [int(torch.randint(0, n + 1, (1,), generator=gen)) for n in store_k]
        if is_delta_q:
            used_q = [int(torch.randint(0, min(sq, uk) + 1, (1,), generator=gen)) for sq, uk in zip(store_q, used_k)]
        else:
            used_q = [min(uk, sq) for uk, sq in zip(used_k, store_q)]
    else:
        used_k, used_q = store_k, store_q

    def draw_ct(arg, name, room):
        if arg is None:
            return None
        if isinstance(arg, int):
            return [int(torch.randint(0, max(0, min(arg, r)) + 1, (1,), generator=gen)) for r in room]
        vals = [int(x) for x in arg]
        if len(vals) != B:
            raise ValueError(f"{name} must have batch_size={B} entries, got {len(vals)}")
        return vals

    ctx = draw_ct(num_contexts, "num_contexts", used_k)
    room_t = [L - (ctx[b] if ctx is not None else 0) for b, L in enumerate(used_k)]
    tgt = draw_ct(num_targets, "num_targets", room_t)
    for b in range(B):
        c = ctx[b] if ctx is not None else 0
        t = tgt[b] if tgt is not None else 0
        if c < 0 or t < 0 or c + t > used_k[b]:
            raise ValueError(f"sequence {b}: need c + t <= L, got c={c}, t={t}, L={used_k[b]}")

    T_q, T_k = sum(store_q), sum(store_k)
    H, D = num_heads, head_dim
    q = _uniform((T_q, H, D), gen, dtype, device, requires_grad)
    k = _uniform((T_k, H, D), gen, dtype, device, requires_grad)
    v = _uniform((T_k, H, D), gen, dtype, device, requires_grad)
    rab = None
    if rab_heads is not None:
        if rab_heads not in (1, H):
            raise ValueError(f"rab_heads must be 1 or num_heads={H}, got {rab_heads}")
        rab = _uniform((B, rab_heads, max_seqlen_k, max_seqlen_k), gen, dtype, device, requires_grad)

    def i32(vals):
        return None if vals is None else torch.tensor(vals, dtype=torch.int32, device=device)

    return {
        "q": q,
        "k": k,
        "v": v,
        "seq_offsets_q": _offsets(store_q, device),
        "seq_offsets_k": _offsets(store_k, device),
        "max_seqlen_q": int(max_seqlen_q),
        "max_seqlen_k": int(max_seqlen_k),
        "num_contexts": i32(ctx),
        "num_targets": i32(tgt),
        "target_group_size": int(target_group_size),
        "window_size": tuple(window_size),
        "alpha": alpha,
        "rab": rab,
        "is_delta_q": bool(is_delta_q),
        "scaling_seqlen": int(scaling_seqlen),
        "seqused_q": i32(used_q) if seqused else None,
        "seqused_k": i32(used_k) if seqused else None,
    }


def random_paged_batch(
    cached_lens: Sequence[int],
    new_lens: Sequence[int],
    num_heads: int,
    head_dim: int,
    page_size: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    alpha: float = 1.0,
    rab_heads: int | None = None,
    num_contexts: Sequence[int] | None = None,
    num_targets: Sequence[int] | None = None,
    target_group_size: int = 1,
    spare_pages: int = 3,
    seed: int = 0,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A serving batch in FBGEMM's meaning (docs/operator.md, "Paged KV cache"): sequence b had
    ``cached_lens[b]`` tokens and gets ``new_lens[b]`` new ones, the last ``num_targets[b]`` of them
    targets (0 without), the others new history, already appended to the cache. Returns ``(paged,
    dense)`` keyword dicts: ``paged`` for ``hstu_attn_varlen_func`` (q/k/v the new tokens, the cache
    and its page tables, ``seq_offsets_k`` counting cached + target keys); ``dense`` for the oracle
    on the same whole sequences (k/v every token, ``is_delta_q``). The cache is built from the dense
    keys, not the other way round, so the oracle does not depend on any page-gathering code.

    Pages are assigned in a shuffled order among ``spare_pages`` extra ones; every cache row that
    holds no token (spare pages, rows past a last page's length) is NaN, and so are the k/v rows of
    the new history (FBGEMM reads those keys from the cache only): a kernel that reads one shows it.
    ``num_contexts`` count whole-sequence tokens."""
    gen = torch.Generator().manual_seed(seed)
    B, H, D = len(cached_lens), num_heads, head_dim
    new = [int(n) for n in new_lens]
    targets = [int(t) for t in num_targets] if num_targets is not None else [0] * B
    for name, vals, limit in (("num_contexts", num_contexts, [int(c) + n for c, n in zip(cached_lens, new)]),
                              ("num_targets", num_targets, new)):
        if vals is not None and any(not 0 <= x <= lim for x, lim in zip(vals, limit)):
            raise ValueError(f"{name} must lie in [0, {list(limit)}], got {list(vals)}")
    # What the cache holds: the old history and the new one (every new token but the targets).
    cached = [int(c) + n - t for c, n, t in zip(cached_lens, new, targets)]
    whole = [c + t for c, t in zip(cached, targets)]
    max_q, max_k = max(new + [1]), max(whole + [1])
    k_full = _uniform((sum(whole), H, D), gen, dtype, "cpu", False)
    v_full = _uniform((sum(whole), H, D), gen, dtype, "cpu", False)
    q = _uniform((sum(new), H, D), gen, dtype, device, False)
    pages = [-(-c // page_size) for c in cached]
    order = torch.randperm(sum(pages) + spare_pages, generator=gen).tolist()
    kv_cache = torch.full((sum(pages) + spare_pages, 2, page_size, H, D), float("nan"), dtype=dtype)
    page_ids, last_page_lens, k_new, v_new, start = [], [], [], [], 0
    for b in range(B):
        for j in range(pages[b]):
            page = order[len(page_ids)]
            rows = slice(start + j * page_size, start + min((j + 1) * page_size, cached[b]))
            count = rows.stop - rows.start
            kv_cache[page, 0, :count] = k_full[rows]
            kv_cache[page, 1, :count] = v_full[rows]
            page_ids.append(page)
        last_page_lens.append(cached[b] - (pages[b] - 1) * page_size if pages[b] else 1)
        history = torch.full((new[b] - targets[b], H, D), float("nan"), dtype=dtype)
        k_new += [history, k_full[start + cached[b]: start + whole[b]]]
        v_new += [history, v_full[start + cached[b]: start + whole[b]]]
        start += whole[b]

    def i32(vals):
        return None if vals is None else torch.tensor(list(vals), dtype=torch.int32, device=device)

    rab = None
    if rab_heads is not None:
        rab = _uniform((B, rab_heads, max_k, max_k), gen, dtype, device, False)
    common = dict(q=q, seq_offsets_q=_offsets(new, device), seq_offsets_k=_offsets(whole, device), max_seqlen_q=max_q,
                  max_seqlen_k=max_k, num_contexts=i32(num_contexts), num_targets=i32(num_targets),
                  target_group_size=target_group_size, window_size=(-1, 0), alpha=alpha, rab=rab)
    empty = torch.empty((0, H, D), dtype=dtype)
    paged = dict(common, k=torch.cat([empty] + k_new).to(device), v=torch.cat([empty] + v_new).to(device),
                 kv_cache=kv_cache.to(device), page_offsets=_offsets(pages, device),
                 page_ids=i32(page_ids + [0] * (len(page_ids) == 0)), last_page_lens=i32(last_page_lens))
    dense = dict(common, k=k_full.to(device), v=v_full.to(device), is_delta_q=True)
    return paged, dense


def call_record(**kwargs):
    """``(call, rab)``: the validated record :func:`hstu_cute.hstu_attn_varlen_func` builds from
    the same keyword arguments (:class:`hstu_cute.call.Call`), for driving the launchers
    directly (benchmarks, kernel tests). Extra keys of a batch dict (``_lens_q`` ...) are ignored."""
    import inspect

    from .api import hstu_attn_varlen_func
    from .call import Call, PagedTables
    from .validation import validate

    public = inspect.signature(hstu_attn_varlen_func)
    bound = public.bind(**{n: x for n, x in kwargs.items() if n in public.parameters})
    bound.apply_defaults()
    a = bound.arguments
    p = validate(*(a[n] for n in inspect.signature(validate).parameters))
    paged = PagedTables(a["kv_cache"], a["page_offsets"], a["page_ids"], a["last_page_lens"]) if p.page_size else None
    call = Call(p, a["seq_offsets_q"], a["seq_offsets_k"], a["max_seqlen_q"], a["max_seqlen_k"], a["num_contexts"],
                a["num_targets"], a["seqused_q"], a["seqused_k"], a["target_group_size"], a["alpha"], a["has_drab"],
                a["deterministic"], (a["descale_q"], a["descale_k"], a["descale_v"]), paged, {}, a["func"],
                a["block_mask"])
    return call, a["rab"]


def check_against_oracle(batch: dict, seed: int, backward: bool = True, **extra) -> dict:
    """Run :func:`hstu_cute.hstu_attn_varlen_func` on ``batch`` (a keyword dict) plus ``extra`` and
    assert the ratio rule against the fp32 oracle: the output within 2x the same-dtype oracle's
    error, and with ``backward`` (a seeded random dO) dq, dk, dv (and drab with ``has_drab``)
    within 5x, none NaN. Returns the leaves (with their gradients) and the output."""
    from .api import hstu_attn_varlen_func
    from .reference import hstu_attn_reference, ratio_check, reference_grads

    names = ("q", "k", "v") + (("rab",) if backward and extra.get("has_drab") else ())
    leaves = {n: batch[n].detach().clone().requires_grad_(backward) for n in names}
    out = hstu_attn_varlen_func(**dict(batch, **leaves), **extra)
    ref_kw = dict(batch, **{n: x for n, x in extra.items() if n != "deterministic"})  # the oracle is exact
    if not backward:
        ref32, ref_same = hstu_attn_reference(**ref_kw), hstu_attn_reference(**ref_kw, compute_dtype=None)
        ok, err, ref_err = ratio_check(out, ref32, ref_same, 2.0)
        assert ok, f"[seed={seed}] out: kernel err {err:.3e} > 2 x {ref_err:.3e}"
        return dict(leaves, out=out)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype).to(out.device)
    out.backward(dout)
    ref32 = reference_grads(**ref_kw, dout=dout)
    ref_same = reference_grads(**ref_kw, dout=dout, compute_dtype=None)
    ok, err, ref_err = ratio_check(out, ref32["out"], ref_same["out"], 2.0)
    assert ok, f"[seed={seed}] out: kernel err {err:.3e} > 2 x {ref_err:.3e}"
    for n in names:
        grad = leaves[n].grad
        assert grad is not None and not torch.isnan(grad).any(), (n, seed)
        ok, err, ref_err = ratio_check(grad, ref32["d" + n], ref_same["d" + n], 5.0)
        assert ok, f"[seed={seed}] d{n}: kernel err {err:.3e} > 5 x same-dtype err {ref_err:.3e}"
    return dict(leaves, out=out)
