"""delta_q with contexts and targets on contiguous keys (docs/operator.md, "delta_q"), forward and
backward on both kernel paths against the oracle (ratio rule: 2x for the output, 5x for
gradients): the last L_q rows of each sequence, whose keys hold the contexts, the history and the
targets; edge lengths (0, 1, 17, 1111 keys), rows that are all targets, seqused, rab with drab."""

from __future__ import annotations

import zlib

import pytest
import torch

from hstu_cute.testing import check_against_oracle

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _batch(lengths_q, lengths_k, heads, head_dim, dtype, gen, contexts, targets, group, rab=False, seqused=False):
    def offsets(lengths):
        return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")

    q = (torch.randn(sum(lengths_q), heads, head_dim, generator=gen) * 0.5).to(dtype).cuda()
    k = (torch.randn(sum(lengths_k), heads, head_dim, generator=gen) * 0.5).to(dtype).cuda()
    v = torch.randn(sum(lengths_k), heads, head_dim, generator=gen).to(dtype).cuda()
    b = dict(q=q, k=k, v=v, seq_offsets_q=offsets(lengths_q), seq_offsets_k=offsets(lengths_k),
             max_seqlen_q=max(lengths_q + [1]), max_seqlen_k=max(lengths_k + [1]), is_delta_q=True, alpha=0.5,
             window_size=(-1, 0), target_group_size=group,
             num_contexts=torch.tensor(contexts, dtype=torch.int32, device="cuda"),
             num_targets=torch.tensor(targets, dtype=torch.int32, device="cuda"))
    if rab:
        n = b["max_seqlen_k"]
        b["rab"] = (torch.randn(len(lengths_k), 1, n, n, generator=gen) * 0.5).to(dtype).cuda()
    if seqused:
        b["seqused_k"] = torch.tensor([max(n - 2, 0) for n in lengths_k], dtype=torch.int32, device="cuda")
        b["seqused_q"] = torch.tensor([max(min(nq, nk - 2), 0) for nq, nk in zip(lengths_q, lengths_k)],
                                      dtype=torch.int32, device="cuda")
    return b


CASES = [
    # (lengths_q, lengths_k, contexts, targets, group, head_dim, dtype, rab, seqused)
    ([0, 1, 17, 64], [0, 1, 40, 1111], [0, 0, 5, 33], [0, 1, 17, 64], 1, 128, torch.bfloat16, False, False),
    ([32, 99, 8], [300, 400, 99], [3, 0, 20], [10, 99, 8], 4, 64, torch.float16, True, False),
    ([51, 160], [256, 2000], [0, 333], [60, 100], 11, 256, torch.bfloat16, False, True),
    ([27, 129], [32, 700], [2, 50], [0, 129], 1, 32, torch.bfloat16, True, True),
]


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"case{i}" for i in range(len(CASES))])
def test_delta_q_with_contexts_and_targets(path, case):
    lengths_q, lengths_k, contexts, targets, group, head_dim, dtype, rab, seqused = CASES[case]
    seed = zlib.crc32(repr(("delta_q", case)).encode())
    gen = torch.Generator().manual_seed(seed)
    b = _batch(lengths_q, lengths_k, 2, head_dim, dtype, gen, contexts, targets, group, rab, seqused)
    check_against_oracle(b, seed, has_drab=rab)
