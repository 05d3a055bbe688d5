"""FBGEMM's arbitrary ``func`` masks on the GPU: forward and backward against the oracle (ratio
rule: 2x for the output, 5x for gradients), both kernel paths, bf16 and fp16, head dims 32-256,
n_func 1 and 3, edge lengths (0, 1, 17, 1111), seqused, delta_q; a func spelling causal against
the causal call. Outputs are poisoned; the padding rows of func hold garbage (never used)."""

from __future__ import annotations

import zlib

import pytest
import torch

from hstu_cute import hstu_attn_varlen_func, masks
from hstu_cute.testing import check_against_oracle, gaussian_jagged_batch, random_func

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def _batch(lengths, lengths_k, heads, head_dim, dtype, gen, seqused=False):
    return gaussian_jagged_batch(lengths, lengths_k, heads, head_dim, dtype, gen, seqused=seqused)


def _check(b, func, seed, backward=True):
    check_against_oracle(b, seed, backward, func=func)


CASES = [
    # (lengths_q, lengths_k, n_func, dtype, head_dim, seqused)
    ([0, 1, 17, 1111], [0, 1, 17, 1111], 3, torch.bfloat16, 128, False),
    ([5, 300, 64], [5, 300, 64], 1, torch.float16, 64, False),
    ([256, 17, 129], [256, 17, 129], 3, torch.bfloat16, 256, True),
    ([33, 200], [33, 200], 3, torch.float16, 32, False),
    ([8, 51], [99, 256], 3, torch.bfloat16, 128, False),  # delta_q: shorter queries, end-aligned
    ([0, 17, 300], [0, 17, 300], 3, torch.bfloat16, 96, False),  # head dims compiled on first use
    ([129, 64], [129, 64], 1, torch.float16, 192, True),
]


@pytest.mark.parametrize("lengths,lengths_k,n_func,dtype,head_dim,seqused", CASES,
                         ids=[f"case{i}" for i in range(len(CASES))])
def test_func_matches_oracle(path, lengths, lengths_k, n_func, dtype, head_dim, seqused):
    seed = _seed(lengths, lengths_k, n_func, str(dtype), head_dim, seqused)
    gen = torch.Generator().manual_seed(seed)
    b = _batch(lengths, lengths_k, 2, head_dim, dtype, gen, seqused)
    _check(b, random_func(lengths, lengths_k, n_func, gen), seed)


def test_func_spelling_causal_equals_causal(path):
    """The same mask in two encodings: a func of [0, i + 1) per row and window (-1, 0)."""
    gen = torch.Generator().manual_seed(7)
    lengths = [1, 17, 1111, 256]
    b = _batch(lengths, lengths, 4, 128, torch.bfloat16, gen)
    rows = torch.cat([torch.arange(n) + 1 for n in lengths] + [torch.zeros(masks.FUNC_ROW_PADDING, dtype=torch.int64)])
    func = torch.stack([rows, rows, rows])[None].to(torch.int32).cuda()
    with torch.no_grad():
        causal = hstu_attn_varlen_func(**b, window_size=(-1, 0))
        encoded = hstu_attn_varlen_func(**b, func=func)
    assert (causal.float() - encoded.float()).abs().max() <= 1e-2 * causal.float().abs().max()


@pytest.mark.parametrize("n_func", [1, 3])
def test_func_table_kernel_matches_definition(n_func):
    """The one-launch table (hstu_cute.ampere.func_table) equals masks.func_key_ranges, its
    definition, entry for entry: bounds out of range, empty intervals, empty and 1-row sequences,
    entries past a sequence's rows, more key blocks than query blocks; the memory the table gets
    was poisoned."""
    from hstu_cute.launch.prepared import func_table

    gen = torch.Generator().manual_seed(n_func)
    lengths = [0, 1, 70, 200, 64, 1111]
    offsets = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    func = torch.randint(-50, 1200, (1, n_func, sum(lengths) + masks.FUNC_ROW_PADDING), generator=gen,
                         dtype=torch.int32)
    func[0, :, 5:9] = torch.tensor([1 << 30, -(1 << 30), 3])[:n_func, None]  # huge bounds are clamped alike
    expected = masks.func_key_ranges(func, offsets, max(lengths), 1300)
    func, offsets_gpu = func.cuda(), offsets.cuda()
    poison = torch.full(expected.shape, 0x5EADBEEF, dtype=torch.int32, device="cuda")
    del poison  # the caching allocator hands this block to the table's torch.empty
    got = func_table(func, offsets_gpu, max(lengths), 1300)
    assert got.shape == expected.shape and got.dtype == torch.int32
    assert torch.equal(got.cpu(), expected)
