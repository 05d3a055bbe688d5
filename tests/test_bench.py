"""CPU checks of the benchmark definitions: the recsys grid's shapes and its jagged length draws."""

from __future__ import annotations

import dataclasses

import torch

from hstu_cute import bench


def test_recsys_grid_shapes():
    grid = {w.name: w for w in bench.recsys_grid()}
    assert len(grid) == 6
    shapes = {(w.batch, w.max_len, w.lengths, w.contexts, w.targets) for w in grid.values()}
    assert shapes == {(1024, 256, "full", None, None), (128, 512, "full", None, None), (32, 1024, "full", None, None),
                      (128, 2048, "uniform1", None, 32), (4096, 256, "uniform1", None, 8),
                      (512, 1024, "zipf", 8, 16)}
    assert all(w.head_dim == 128 and w.heads == 4 and w.window == (-1, 0) and w.sdpa for w in grid.values())


def test_uniform1_lengths_span_one_to_n():
    w = bench.Workload("u", 4096, 256, lengths="uniform1")
    lens = bench._lengths(w, torch.Generator().manual_seed(0))
    assert len(lens) == 4096 and min(lens) == 1 and max(lens) == 256


def test_jagged_inputs_with_targets():
    w = dataclasses.replace(bench.recsys_grid()[3], batch=6, max_len=40, heads=1, head_dim=32)
    kw = bench.make_inputs(w, device="cpu")
    lens = kw["_lens_k"]
    assert kw["q"].shape[0] == sum(lens) and kw["seq_offsets_q"][-1].item() == sum(lens)
    assert kw["num_targets"].tolist() == [min(32, n) for n in lens]
