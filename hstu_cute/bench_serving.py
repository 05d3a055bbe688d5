"""The serving benchmark (``python -m hstu_cute bench --grid serving``): new tokens against a
paged KV cache, beside the two ways to get the same rows without one, timed in the same run.

Per workload (users x (cached + new) tokens, the last ``targets`` new tokens targets, D128 bf16 H4):

* ``paged``: ``hstu_attn_varlen_func`` with the cache (``kv_cache`` and its page tables), in
  FBGEMM's meaning: the pages hold the old and the new history, k / v give the targets;
* ``contiguous``: the same kernel family on the same data laid out contiguously (each user's cached
  keys followed by the new ones, delta_q): what the paged call costs over contiguous keys;
* ``recompute``: the causal forward over each user's whole history (every row recomputed), what
  serving costs without a cache.

Each runs eager (launches queued, L2 flushed before each sample) and replayed from a CUDA graph
(captured once: capture fails on any host sync, so the paged step has none).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .api import hstu_attn_varlen_func
from .bench import time_flushed


@dataclass(frozen=True)
class ServingWorkload:
    name: str
    users: int
    cached: int
    new: int
    targets: int
    heads: int = 4
    head_dim: int = 128
    page_size: int = 32


def serving_grid(page_size: int = 32) -> list[ServingWorkload]:
    return [
        ServingWorkload("64 users x (4096 + 256), 64 targets", 64, 4096, 256, 64, page_size=page_size),
        ServingWorkload("1 user x (4096 + 256), 64 targets", 1, 4096, 256, 64, page_size=page_size),
        ServingWorkload("512 users x (1024 + 64), 16 targets", 512, 1024, 64, 16, page_size=page_size),
    ]


def _pairs(w: ServingWorkload) -> int:
    """Allowed (query, key) pairs of one user and head: history rows see every earlier key, a
    target sees the history and itself (target_group_size 1)."""
    history_new = w.new - w.targets
    history = sum(w.cached + i + 1 for i in range(history_new))
    return history + w.targets * (w.cached + history_new + 1)


def make_serving_inputs(w: ServingWorkload, device="cuda", seed=0) -> dict:
    """The three calls' inputs on the same data: the cache (pages in a shuffled order) holding
    every token but the targets (the new history appended), the new tokens, and the contiguous
    whole histories."""
    gen = torch.Generator().manual_seed(seed)
    H, D, dtype = w.heads, w.head_dim, torch.bfloat16
    whole = w.cached + w.new

    def rnd(*shape):
        return (torch.rand(shape, generator=gen) * 2 - 1).to(dtype).to(device)

    k_full, v_full = rnd(w.users * whole, H, D), rnd(w.users * whole, H, D)
    q_new = rnd(w.users * w.new, H, D)
    q_full = rnd(w.users * whole, H, D)
    in_cache = w.cached + w.new - w.targets
    pages = -(-in_cache // w.page_size)
    order = torch.randperm(w.users * pages, generator=gen).to(device=device, dtype=torch.int32)
    kv_cache = torch.empty(w.users * pages, 2, w.page_size, H, D, dtype=dtype, device=device)
    cached_k = k_full.view(w.users, whole, H, D)[:, :in_cache]
    cached_v = v_full.view(w.users, whole, H, D)[:, :in_cache]
    padded = pages * w.page_size
    for kind, src in ((0, cached_k), (1, cached_v)):
        rows = torch.zeros(w.users, padded, H, D, dtype=dtype, device=device)
        rows[:, :in_cache] = src
        kv_cache[order.long(), kind] = rows.view(w.users * pages, w.page_size, H, D)
    new_k = k_full.view(w.users, whole, H, D)[:, w.cached:].reshape(-1, H, D)
    new_v = v_full.view(w.users, whole, H, D)[:, w.cached:].reshape(-1, H, D)

    def offsets(n):
        return torch.arange(0, (w.users + 1) * n, n, dtype=torch.int32, device=device)

    return dict(
        q_new=q_new, k_new=new_k.contiguous(), v_new=new_v.contiguous(), q_full=q_full, k_full=k_full, v_full=v_full,
        offsets_new=offsets(w.new), offsets_full=offsets(whole), kv_cache=kv_cache,
        page_offsets=offsets(pages), page_ids=order,
        last_page_lens=torch.full((w.users,), in_cache - (pages - 1) * w.page_size, dtype=torch.int32,
                                  device=device),
        num_targets=torch.full((w.users,), w.targets, dtype=torch.int32, device=device),
    )


def serving_calls(w: ServingWorkload, x: dict) -> dict:
    """The three calls of a workload, as no-argument callables. S is pinned to the new-token
    count for all three, so their outputs are comparable."""
    whole = w.cached + w.new
    common = dict(window_size=(-1, 0), num_targets=x["num_targets"], scaling_seqlen=w.new)

    def paged():
        return hstu_attn_varlen_func(x["q_new"], x["k_new"], x["v_new"], x["offsets_new"], x["offsets_full"], w.new,
                                     whole, kv_cache=x["kv_cache"], page_offsets=x["page_offsets"],
                                     page_ids=x["page_ids"], last_page_lens=x["last_page_lens"], **common)

    def contiguous():  # the same keys, contiguous: delta_q with targets
        return hstu_attn_varlen_func(x["q_new"], x["k_full"], x["v_full"], x["offsets_new"], x["offsets_full"], w.new,
                                     whole, is_delta_q=True, **common)

    def recompute():
        return hstu_attn_varlen_func(x["q_full"], x["k_full"], x["v_full"], x["offsets_full"], x["offsets_full"],
                                     whole, whole, **common)

    return dict(paged=paged, contiguous=contiguous, recompute=recompute)


def _graphed(fn):
    """``fn`` captured once into a CUDA graph (after a warm-up call); returns the replay."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def run_serving(w: ServingWorkload, reps: int = 20) -> dict:
    """Median ms of each call eager and graphed, the paged output's agreement with the
    contiguous call, and the ratios the serving acceptance is stated in."""
    x = make_serving_inputs(w)
    calls = serving_calls(w, x)
    row = dict(workload=w.name, page_size=w.page_size)
    with torch.no_grad():
        diff = (calls["paged"]().float() - calls["contiguous"]().float()).abs().max().item()
        for name, fn in calls.items():
            row[f"{name}_ms"], _ = time_flushed([fn], reps=reps)
            row[f"{name}_graph_ms"], _ = time_flushed([_graphed(fn)], reps=reps)
    flops = 4 * w.heads * w.head_dim * _pairs(w) * w.users
    row.update(max_abs_diff_vs_contiguous=diff, paged_tflops=flops / row["paged_ms"] / 1e9,
               paged_over_contiguous=row["paged_ms"] / row["contiguous_ms"],
               paged_over_contiguous_graph=row["paged_graph_ms"] / row["contiguous_graph_ms"],
               recompute_over_paged=row["recompute_ms"] / row["paged_ms"],
               recompute_over_paged_graph=row["recompute_graph_ms"] / row["paged_graph_ms"])
    return row
