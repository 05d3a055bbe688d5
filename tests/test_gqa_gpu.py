"""GQA / MQA on the GPU (docs/operator.md, "Grouped query heads"): forward and backward against
the oracle under the ratio rule (2x for the output, 5x for gradients), both kernel paths, groups of
2, 4 and all heads (MQA), masks with targets, rab, seqused and edge lengths (0, 1, 17, 1111)."""

from __future__ import annotations

import zlib

import pytest
import torch

from hstu_cute.testing import check_against_oracle, gaussian_jagged_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CASES = [
    # (lengths, H_q, H_kv, head_dim, dtype, mask kwargs, rab heads, seqused)
    ([0, 1, 17, 1111], 4, 2, 128, torch.bfloat16, dict(window_size=(-1, 0)), None, False),
    ([300, 129], 8, 2, 64, torch.float16, dict(window_size=(-1, 0), num_targets=[20, 5]), 1, True),
    ([513, 64], 4, 1, 256, torch.bfloat16, dict(window_size=(40, 8)), 4, False),
    ([200, 33], 6, 3, 32, torch.bfloat16, dict(), None, True),
]


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"case{i}" for i in range(len(CASES))])
def test_grouped_query_heads_match_the_oracle(path, case):
    lengths, h_q, h_kv, head_dim, dtype, mask_kw, rab_heads, seqused = CASES[case]
    seed = zlib.crc32(repr(("gqa", case)).encode())
    gen = torch.Generator().manual_seed(seed)
    b = gaussian_jagged_batch(lengths, lengths, h_q, head_dim, dtype, gen, rab_heads=rab_heads, seqused=seqused)
    # Keep the first H_kv key heads: query head h reads key head h // (H_q / H_kv).
    b["k"], b["v"] = b["k"][:, :h_kv].contiguous(), b["v"][:, :h_kv].contiguous()
    kw = {n: (torch.tensor(x, dtype=torch.int32, device="cuda") if n.startswith("num_") else x)
          for n, x in mask_kw.items()}
    check_against_oracle(dict(b, **kw), seed, has_drab=rab_heads is not None)
