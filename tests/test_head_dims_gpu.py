"""Head dims 96 and 192 on the GPU (compiled on first use, not shipped): forward and backward
against the oracle under the ratio rule (2x for the output, 5x for gradients), both kernel paths,
over edge lengths (0, 1, 17, 1111), contexts and targets, a window, rab with drab of one and of
every head, seqused, fp16 and the deterministic backward."""

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
    # (lengths, heads, head_dim, dtype, mask kwargs, rab heads, seqused, deterministic)
    ([0, 1, 17, 1111], 2, 96, torch.bfloat16, dict(window_size=(-1, 0)), None, False, False),
    ([0, 1, 17, 1111], 2, 192, torch.bfloat16, dict(window_size=(-1, 0)), None, False, False),
    ([300, 129, 64], 2, 96, torch.bfloat16,
     dict(window_size=(-1, 0), num_contexts=[3, 0, 5], num_targets=[20, 129, 0]), 1, False, False),
    ([300, 129, 64], 3, 192, torch.float16,
     dict(window_size=(-1, 0), num_contexts=[2, 7, 0], num_targets=[0, 5, 64]), 3, False, True),
    ([513, 64], 2, 192, torch.bfloat16, dict(window_size=(40, 8)), None, True, False),
    ([257, 200], 4, 96, torch.float16, dict(), 4, True, True),
]
IDS = [f"d{c[2]}-case{i}" for i, c in enumerate(CASES)]


@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_head_dims_96_and_192_match_the_oracle(path, case):
    lengths, heads, head_dim, dtype, mask_kw, rab_heads, seqused, deterministic = CASES[case]
    seed = zlib.crc32(repr(("head-dims", case)).encode())
    gen = torch.Generator().manual_seed(seed)
    b = gaussian_jagged_batch(lengths, lengths, heads, head_dim, dtype, gen, rab_heads=rab_heads, seqused=seqused)
    b.update({n: (torch.tensor(x, dtype=torch.int32, device="cuda") if n.startswith("num_") else x)
              for n, x in mask_kw.items()})
    check_against_oracle(b, seed, has_drab=rab_heads is not None, deterministic=deterministic)
