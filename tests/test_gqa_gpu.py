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
    ([0, 17, 600], 4, 1, 96, torch.bfloat16, dict(window_size=(-1, 0), num_targets=[0, 3, 40]), 4, False),
    ([300, 129], 6, 2, 192, torch.float16, dict(window_size=(64, 0)), None, True),
]


def _case(case: int, tag: str) -> tuple[dict, int, int]:
    """(batch keyword dict with k and v cut to their first H_kv heads, seed, group) of CASES[case]."""
    lengths, h_q, h_kv, head_dim, dtype, mask_kw, rab_heads, seqused = CASES[case]
    seed = zlib.crc32(repr((tag, case)).encode())
    gen = torch.Generator().manual_seed(seed)
    b = gaussian_jagged_batch(lengths, lengths, h_q, head_dim, dtype, gen, rab_heads=rab_heads, seqused=seqused)
    # Keep the first H_kv key heads: query head h reads key head h // (H_q / H_kv).
    b["k"], b["v"] = b["k"][:, :h_kv].contiguous(), b["v"][:, :h_kv].contiguous()
    b.update({n: (torch.tensor(x, dtype=torch.int32, device="cuda") if n.startswith("num_") else x)
              for n, x in mask_kw.items()})
    return b, seed, h_q // h_kv


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"case{i}" for i in range(len(CASES))])
def test_grouped_query_heads_match_the_oracle(path, case):
    b, seed, _ = _case(case, "gqa")
    check_against_oracle(b, seed, has_drab=CASES[case][6] is not None)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"case{i}" for i in range(len(CASES))])
def test_forward_without_autograd_reads_the_key_heads_natively(path, case):
    """Without autograd the forward kernels take k and v with H_kv heads (query head h reads key
    head h // group): the ratio rule against the oracle, and the same bits as the forward over
    k and v with each head repeated (the path autograd takes)."""
    from hstu_cute import hstu_attn_varlen_func

    b, seed, group = _case(case, "gqa-native")
    native = check_against_oracle(b, seed, backward=False)["out"]
    expanded = hstu_attn_varlen_func(**dict(b, k=b["k"].repeat_interleave(group, dim=1),
                                            v=b["v"].repeat_interleave(group, dim=1)))
    assert torch.equal(native, expanded)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"case{i}" for i in range(len(CASES))])
def test_training_reads_the_key_heads_natively(path, case):
    """Under autograd the backward kernels also read key head h // group in place and the launcher
    sums each group's dK / dV: with the deterministic backward, the same bits as the call over k
    and v with each head repeated, whose copies' gradients autograd sums."""
    from hstu_cute import hstu_attn_varlen_func

    b, seed, group = _case(case, "gqa-training")
    b.update(has_drab=False, deterministic=True)
    dout = torch.randn(b["q"].shape, generator=torch.Generator().manual_seed(seed)).to(b["q"].dtype).cuda()

    def grads(expand: bool):
        leaves = {n: b[n].detach().clone().requires_grad_() for n in ("q", "k", "v")}
        k, v = leaves["k"], leaves["v"]
        if expand:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = hstu_attn_varlen_func(**dict(b, q=leaves["q"], k=k, v=v))
        return (out, *torch.autograd.grad(out, tuple(leaves.values()), dout))

    for native, expanded in zip(grads(False), grads(True)):
        assert torch.equal(native, expanded)
