"""PyTorch oracle for HSTU attention (spec sections 2-5).

This module is the test oracle, written for clarity rather than speed: it loops over the
sequences of a jagged batch on the host and builds each sequence's dense mask with
:mod:`hstu_cute.masks` (the one description of the mask semantics), so the oracle and the kernels'
tile classification cannot drift apart.

Two variants, selected by ``compute_dtype`` (spec section 5):

* ``ref_fp32`` (``compute_dtype=torch.float32``, the default): every input is upcast and the whole
  computation runs in fp32. More generally any ``compute_dtype`` other than the input dtype (for
  example ``torch.float64`` in the unit tests) upcasts to that dtype.
* ``ref_same_dtype`` (``compute_dtype=None`` or the input dtype): mimics the kernel's rounding
  points -- fp32 ``Q K^T`` accumulated on top of the rab tile, mask, ``x alpha``, SiLU in fp32,
  ``P`` rounded to the input dtype, ``P V`` accumulated in fp32, divided by ``S`` once at the end,
  rounded to the input dtype.

Gradients come from torch autograd on this function (``drab`` falls out of the indexing of the rab
slab; ``H_rab == 1`` broadcasts over the heads so its gradient is summed over them).
:func:`reference_grads` wraps that. :func:`ratio_check` is the spec section 5 pass rule.
Random inputs for the oracle and ``hstu_attn_varlen_func`` come from
:func:`hstu_cute.testing.random_jagged_batch`.
"""

from __future__ import annotations

import inspect
import math

import torch

from .masks import MaskSpec, dense_mask, func_dense_mask, normalize_window, seq_mask_from_lengths

__all__ = [
    "hstu_attn_reference",
    "reference_grads",
    "ratio_check",
    "DEFAULT_RATIO_EPS",
]

# Absolute slack of the ratio rule. See ratio_check for the reasoning.
DEFAULT_RATIO_EPS = 1e-6


def _host_list(t: torch.Tensor | None, name: str, length: int) -> list[int] | None:
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        t = torch.as_tensor(t)
    if t.dim() != 1 or t.numel() != length:
        raise ValueError(f"{name} must be 1-D with {length} entries, got shape {tuple(t.shape)}")
    return [int(x) for x in t.detach().cpu().tolist()]


def hstu_attn_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets_q: torch.Tensor,
    seq_offsets_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    num_contexts: torch.Tensor | None = None,
    num_targets: torch.Tensor | None = None,
    target_group_size: int = 1,
    window_size: tuple[int, int] = (-1, -1),
    alpha: float = 1.0,
    rab: torch.Tensor | None = None,
    is_delta_q: bool = False,
    *,
    scaling_seqlen: int = -1,
    seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = torch.float32,
    has_drab: bool = False,
    p_round=None,
    func: torch.Tensor | None = None,
    block_mask=None,
) -> torch.Tensor:
    """HSTU attention forward, spec section 2, differentiable w.r.t. q, k, v and rab.

    ``block_mask``: a :class:`hstu_cute.BlockMask`; an element is attended only if the HSTU mask
    allows it and its (query block, key block) is kept for its sequence and head
    (:meth:`hstu_cute.BlockMask.element_mask`, key coordinates on both sides).

    ``func``: an arbitrary mask ``(1, n_func, T_q + 256)`` int32 of per-row key intervals
    (FBGEMM's layout; :func:`hstu_cute.masks.func_dense_mask`), replacing the window, context and
    target masks (which must then be off).

    Returns ``out`` of shape ``(T_q, H, D)``: in ``compute_dtype`` for the upcast variant, in the
    input dtype for the same-dtype variant (``compute_dtype`` None or equal to ``q.dtype``).
    Padding rows (between a sequence's valid length and the next offset), rows of empty sequences
    and rows past ``seq_offsets_q[-1]`` are exactly zero.

    ``has_drab`` is accepted (and ignored) only so that the same keyword dict can be passed to
    this oracle and to ``hstu_attn_varlen_func``: the oracle always carries rab's gradient.
    ``p_round`` (upcast variant only): ``p_round(P, b)`` replaces sequence b's (H, Lq, Lk) P
    before P.V: the FP8 emulation's re-quantization of P (:func:`hstu_attn_fp8_emulation`).
    """
    del has_drab
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor (T, H, D), got {getattr(t, 'shape', t)}")
    if k.shape[1] != q.shape[1] and k.shape[1] and q.shape[1] % k.shape[1] == 0 and v.shape[1] == k.shape[1]:
        # GQA / MQA: query head h reads key head h // (H_q // H_kv) (docs/operator.md).
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    T_q, H, D = q.shape
    if k.shape[1:] != (H, D) or v.shape[1] != H or k.shape[0] != v.shape[0]:
        raise ValueError(
            f"k/v must be (T_k, H={H}, D={D}) with equal T_k, got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    D_v = v.shape[2]
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v dtypes must match, got {q.dtype}, {k.dtype}, {v.dtype}")
    in_dtype = q.dtype
    device = q.device

    same_dtype = compute_dtype is None or compute_dtype == in_dtype
    if same_dtype:
        # The kernel accumulates in fp32 (or wider if the inputs already are).
        acc_dtype = torch.promote_types(in_dtype, torch.float32)
        out_dtype = in_dtype
    else:
        acc_dtype = compute_dtype
        out_dtype = compute_dtype

    offs_q = _host_list(seq_offsets_q, "seq_offsets_q", len(seq_offsets_q))
    B = len(offs_q) - 1
    if B < 1:
        raise ValueError(f"seq_offsets_q must have length B+1 >= 2, got {len(offs_q)}")
    offs_k = _host_list(seq_offsets_k, "seq_offsets_k", B + 1)
    used_q = _host_list(seqused_q, "seqused_q", B)
    used_k = _host_list(seqused_k, "seqused_k", B)
    ctx = _host_list(num_contexts, "num_contexts", B)
    tgt = _host_list(num_targets, "num_targets", B)
    if offs_q[-1] > T_q or offs_k[-1] > k.shape[0]:
        raise ValueError(
            f"offsets exceed the tensors: seq_offsets_q[-1]={offs_q[-1]} (T_q={T_q}), "
            f"seq_offsets_k[-1]={offs_k[-1]} (T_k={k.shape[0]})"
        )
    if int(target_group_size) < 1:
        raise ValueError(f"target_group_size must be >= 1, got {target_group_size}")

    if func is not None and (tuple(window_size) != (-1, -1) or num_contexts is not None or num_targets is not None):
        raise ValueError("func replaces the other masks: pass window_size=(-1, -1), num_contexts=None, "
                         "num_targets=None with it")
    if block_mask is not None and (block_mask.batch != B or block_mask.heads not in (1, H)):
        raise ValueError(f"block_mask: expected (B={B}, H_mask in {{1, {H}}}) lists, got batch {block_mask.batch}, "
                         f"heads {block_mask.heads}")
    kind, wl, wr = normalize_window(window_size, max_seqlen_k)
    spec = MaskSpec(
        kind,
        has_context=num_contexts is not None,
        has_target=num_targets is not None,
        is_delta_q=bool(is_delta_q),
    )
    if scaling_seqlen != -1 and scaling_seqlen <= 0:
        raise ValueError(f"scaling_seqlen must be -1 or positive, got {scaling_seqlen}")
    S = scaling_seqlen if scaling_seqlen != -1 else max_seqlen_q
    if S <= 0:
        # Only reachable for an all-empty batch with max_seqlen_q == 0; nothing is divided then.
        S = 1

    if rab is not None:
        if rab.dim() != 4 or rab.shape[0] != B or rab.shape[1] not in (1, H):
            raise ValueError(
                f"rab must be (B={B}, H_rab in {{1, {H}}}, max_seqlen_k, max_seqlen_k), got {tuple(rab.shape)}"
            )
        if rab.shape[2] < max_seqlen_k or rab.shape[3] < max_seqlen_k:
            raise ValueError(
                f"rab's last two dims must be >= max_seqlen_k={max_seqlen_k}, got {tuple(rab.shape)}"
            )
        rab_acc = rab.to(acc_dtype)  # exact for 16-bit rab; one autograd node for all slices

    pieces: list[torch.Tensor] = []
    cursor = 0
    for b in range(B):
        sq, eq = offs_q[b], offs_q[b + 1]
        sk, ek = offs_k[b], offs_k[b + 1]
        if eq < sq or ek < sk:
            raise ValueError(f"offsets must be non-decreasing (sequence {b})")
        Lq = used_q[b] if used_q is not None else eq - sq
        Lk = used_k[b] if used_k is not None else ek - sk
        if not (0 <= Lq <= eq - sq) or not (0 <= Lk <= ek - sk):
            raise ValueError(
                f"sequence {b}: valid lengths (Lq={Lq}, Lk={Lk}) must lie within the storage "
                f"({eq - sq}, {ek - sk})"
            )
        if Lq > max_seqlen_q or Lk > max_seqlen_k:
            raise ValueError(
                f"sequence {b}: lengths (Lq={Lq}, Lk={Lk}) exceed max_seqlen ({max_seqlen_q}, {max_seqlen_k})"
            )
        if is_delta_q and Lq > Lk:
            raise ValueError(f"sequence {b}: is_delta_q needs Lq <= Lk, got Lq={Lq}, Lk={Lk}")
        c = ctx[b] if ctx is not None else 0
        t = tgt[b] if tgt is not None else 0
        if c < 0 or t < 0 or c + t > Lk:
            raise ValueError(f"sequence {b}: need 0 <= c, t and c + t <= Lk, got c={c}, t={t}, Lk={Lk}")

        if sq > cursor:
            pieces.append(q.new_zeros((sq - cursor, H, D_v), dtype=out_dtype))
        cursor = eq
        if Lq > 0:
            seq = seq_mask_from_lengths(spec, Lq, Lk, wl, wr, c, t, int(target_group_size))
            # (Lq, Lk) bool; expand because dense_mask gives (1, Lk) for MaskKind.NONE.
            if func is None:
                mask = dense_mask(spec, seq, device=device).expand(Lq, Lk)
            else:
                mask = func_dense_mask(func, sq, Lq, Lk, device=device)
            row0 = seq.row_offset  # key-coordinate row of query 0
            if block_mask is not None:
                rows = torch.arange(row0, row0 + Lq, device=device)
                keys = torch.arange(Lk, device=device)
                kept = torch.stack([block_mask.element_mask(b, h, rows, keys) for h in range(block_mask.heads)])
                mask = mask & kept  # (H_mask, Lq, Lk): broadcasts over the heads when H_mask is 1

            qb = q[sq : sq + Lq].to(acc_dtype).transpose(0, 1)  # (H, Lq, D)
            kb = k[sk : sk + Lk].to(acc_dtype).transpose(0, 1)  # (H, Lk, D)
            vb = v[sk : sk + Lk].transpose(0, 1)  # (H, Lk, Dv)
            scores = torch.matmul(qb, kb.transpose(1, 2))  # (H, Lq, Lk), fp32 (or wider)
            if rab is not None:
                scores = scores + rab_acc[b, :, row0 : row0 + Lq, :Lk]  # H_rab=1 broadcasts
            z = scores * alpha
            p = torch.where(mask, torch.nn.functional.silu(z), torch.zeros((), dtype=acc_dtype, device=device))
            if same_dtype:
                # P rounded to the input dtype, P.V accumulated in fp32, / S, rounded.
                p = p.to(in_dtype).to(acc_dtype)
                o = torch.matmul(p, vb.to(acc_dtype)) / S
                o = o.to(in_dtype)
            else:
                if p_round is not None:
                    p = p_round(p, b)
                o = torch.matmul(p, vb.to(acc_dtype)) / S
            pieces.append(o.transpose(0, 1))
        if eq - sq - Lq > 0:
            pieces.append(q.new_zeros((eq - sq - Lq, H, D_v), dtype=out_dtype))
    if T_q > cursor:
        pieces.append(q.new_zeros((T_q - cursor, H, D_v), dtype=out_dtype))
    if not pieces:
        return q.new_zeros((0, H, D_v), dtype=out_dtype)
    return torch.cat(pieces, dim=0)


def reference_grads(*args, dout: torch.Tensor, **kwargs) -> dict[str, torch.Tensor | None]:
    """Autograd gradients of :func:`hstu_attn_reference` for upstream gradient ``dout``.

    Takes the oracle's arguments (positional or keyword, same names and defaults: the signature
    below is the oracle's with ``dout`` added) plus the keyword-only ``dout``.
    Runs on fresh leaf copies (the caller's tensors are untouched). For the upcast variant the
    leaves are in ``compute_dtype`` (so the fp32 oracle's gradients are not rounded back to 16
    bits); for the same-dtype variant they are in the input dtype, and the gradients come back in
    it. Returns ``dict(out, dq, dk, dv, drab)``; ``drab`` is None when ``rab`` is None.
    """
    call = _ORACLE_SIGNATURE.bind(*args, **kwargs)
    call.apply_defaults()
    arguments = call.arguments
    q, compute_dtype = arguments["q"], arguments["compute_dtype"]
    same_dtype = compute_dtype is None or compute_dtype == q.dtype
    leaf_dtype = q.dtype if same_dtype else compute_dtype

    # The differentiable inputs, replaced by leaves in the oracle's arguments.
    leaves = {
        name: arguments[name].detach().to(leaf_dtype).clone().requires_grad_(True)
        for name in ("q", "k", "v", "rab")
        if arguments[name] is not None
    }
    arguments.update(leaves)
    out = hstu_attn_reference(*call.args, **call.kwargs)
    inputs = list(leaves.values())
    if out.requires_grad:
        grads = torch.autograd.grad(out, inputs, dout.to(out.dtype), allow_unused=True)
    else:  # nothing attends (e.g. an empty batch)
        grads = [None] * len(inputs)
    grads = {name: torch.zeros_like(x) if g is None else g for (name, x), g in zip(leaves.items(), grads)}
    return {"out": out.detach(), "dq": grads["q"], "dk": grads["k"], "dv": grads["v"], "drab": grads.get("rab")}


_ORACLE_SIGNATURE = inspect.signature(hstu_attn_reference)


def _with_dout(signature: inspect.Signature) -> inspect.Signature:
    """The oracle's signature with ``reference_grads``'s keyword-only ``dout`` before its other
    keyword-only parameters (what ``help`` and IDEs show for :func:`reference_grads`)."""
    params = list(signature.parameters.values())
    at = next(i for i, p in enumerate(params) if p.kind is inspect.Parameter.KEYWORD_ONLY)
    dout = inspect.Parameter("dout", inspect.Parameter.KEYWORD_ONLY, annotation="torch.Tensor")
    return signature.replace(parameters=params[:at] + [dout] + params[at:],
                             return_annotation="dict[str, torch.Tensor | None]")


reference_grads.__signature__ = _with_dout(_ORACLE_SIGNATURE)


def ratio_check(
    kernel_out: torch.Tensor,
    ref_fp32: torch.Tensor,
    ref_same: torch.Tensor,
    factor: float,
    eps: float = DEFAULT_RATIO_EPS,
) -> tuple[bool, float, float]:
    """Spec section 5 pass rule: ``max|kernel - ref_fp32| <= factor * max|ref_same - ref_fp32| + eps``.

    Returns ``(ok, kernel_err, ref_err)``. Fails on any NaN (in any of the three tensors) and on
    a non-finite error. Use ``factor=2`` for outputs and ``factor=5`` for dq, dk, dv, drab.

    Why ``eps = 1e-6`` by default: the rule is relative to the same-dtype oracle's own error, which
    is exactly zero only where the true result is exactly representable -- in practice all-zero
    outputs (every key masked, empty sequences, padding rows) or tiny cases. There a correct
    kernel may still differ by fp32 accumulation-order noise (~1e-7 relative to O(1) values) in
    fp32 intermediates, so a zero slack would be flaky. 1e-6 stays well below one bf16/fp16 ulp of
    the output magnitudes these tests produce (O(1e-2)..O(1): ulps ~1e-4..1e-2 for bf16), so it
    cannot hide an error of a whole rounding step.
    """
    if kernel_out.shape != ref_fp32.shape or ref_same.shape != ref_fp32.shape:
        raise ValueError(
            f"shape mismatch: kernel {tuple(kernel_out.shape)}, ref_fp32 {tuple(ref_fp32.shape)}, "
            f"ref_same {tuple(ref_same.shape)}"
        )
    kf = kernel_out.detach().to(torch.float64)
    rf = ref_fp32.detach().to(torch.float64)
    rs = ref_same.detach().to(torch.float64)
    if kf.numel() == 0:
        return True, 0.0, 0.0
    kernel_err = (kf - rf).abs().max().item()
    ref_err = (rs - rf).abs().max().item()
    any_nan = bool(torch.isnan(kf).any() or torch.isnan(rf).any() or torch.isnan(rs).any())
    ok = (
        not any_nan
        and math.isfinite(kernel_err)
        and math.isfinite(ref_err)
        and kernel_err <= factor * ref_err + eps
    )
    return ok, kernel_err, ref_err


def cast_p_e4m3(p: torch.Tensor) -> torch.Tensor:
    """P through a saturating e4m3 cast and back: the pre-quantized entry and quant_mode 0."""
    from .fp8_format import E4M3_MAX

    return p.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(p.dtype)


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """The least power of two >= x (positive normal fp32), from the bits, as the kernel does."""
    bits = x.to(torch.float32).view(torch.int32)
    return ((bits + 0x7FFFFF) & -0x800000).view(torch.float32)


def scaled_p_e4m3(p: torch.Tensor, dv: torch.Tensor, tile_n: int) -> torch.Tensor:
    """P (H, Lq, Lk) through the scaled-P rule of :mod:`hstu_cute.fp8_format` (quant modes
    >= 1) and back, dequantized: per row a running power-of-two scale over key blocks of
    ``tile_n`` visited last to first; ``dv`` (H, Lk): each key's V descale."""
    from .fp8_format import E4M3_MAX, P_AMAX_FLOOR

    heads, rows, keys = p.shape
    scale = torch.zeros(heads, rows, dtype=torch.float32, device=p.device)
    out = torch.empty_like(p)
    inv_max = torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32)
    for start in reversed(range(0, keys, tile_n)):
        block = p[:, :, start:start + tile_n].to(torch.float32)
        dv_block = dv[:, start].to(torch.float32)[:, None]  # one V descale per key block
        amax = block.amax(dim=2).clamp(min=P_AMAX_FLOOR)
        scale = torch.maximum(scale, _pow2_ceil(amax * dv_block * inv_max.to(p.device)))
        mult = (dv_block / scale)[:, :, None]
        rounded = (block * mult).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
        out[:, :, start:start + tile_n] = (rounded / mult).to(p.dtype)
    return out


def fp8_p_tile_n(head_dim: int, has_rab: bool = False, two_direction: bool = False) -> int:
    """Keys per block of the FP8 forward's scaled P (its key tile)."""
    from .variants import default_hopper_fp8_fwd_tiles

    return default_hopper_fp8_fwd_tiles(head_dim, has_rab, scaled_p=True, two_direction=two_direction)["tile_n"]


def hstu_attn_fp8_emulation(q, k, v, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k, *args,
                            quant_mode: int, round_p: bool = True, **kwargs) -> torch.Tensor:
    """The FP8 oracle (docs/operator.md, FP8 section): q, k, v quantized with ``quant_mode``'s
    groups (:mod:`hstu_cute.quantize`) and dequantized, then the fp32 oracle, with P re-quantized
    when ``round_p``: mode 0 a plain cast, modes >= 1 the scaled-P rule (:func:`scaled_p_e4m3`,
    with the kernel's key tile). Mode 1 reads V from its token-contiguous copy, as the kernel's
    P.V does. Its error against the fp32 oracle on the unquantized inputs is the yardstick of the
    FP8 kernels' (spec: within 2x)."""
    from .fp8_recipe import recipe
    from .quantize import dequantize, quantize, token_scales

    quantized = {}
    r = recipe(quant_mode)

    def emulate(name, x, offsets, max_seqlen, token_contiguous=False):
        qx = quantized[name] = quantize(x, quant_mode, offsets, max_seqlen)
        return dequantize(qx, quant_mode, offsets, max_seqlen, token_contiguous=token_contiguous)

    qe = emulate("q", q, seq_offsets_q, max_seqlen_q)
    ke = emulate("k", k, seq_offsets_k, max_seqlen_k)
    ve = emulate("v", v, seq_offsets_k, max_seqlen_k, token_contiguous=r.two_direction)
    p_round = None
    if round_p and not r.scaled_p:
        p_round = lambda p, b: cast_p_e4m3(p)  # noqa: E731
    elif round_p:
        # Mode 1's V scale varies along D: it stays in the dequantized V, P is scaled alone.
        dv = (torch.ones(v.shape[:2], dtype=torch.float32, device=v.device) if r.two_direction
              else token_scales(quantized["v"], quant_mode, seq_offsets_k, max_seqlen_k))
        starts = seq_offsets_k.tolist()
        tile_n = fp8_p_tile_n(q.shape[2], kwargs.get("rab") is not None, r.two_direction)
        p_round = lambda p, b: scaled_p_e4m3(  # noqa: E731
            p, dv[starts[b]:starts[b] + p.shape[2]].transpose(0, 1), tile_n)
    return hstu_attn_reference(qe, ke, ve, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k, *args,
                               compute_dtype=torch.float32, p_round=p_round, **kwargs)


def running_scale_e4m3(x: torch.Tensor, block: int, ascending: bool, visited: torch.Tensor, floor: float
                       ) -> torch.Tensor:
    """``x`` (H, rows, cols) through e4m3 with a running power-of-two scale per row, dequantized:
    the columns in blocks of ``block`` from column 0, visited in ascending (or descending) order
    where ``visited[j]`` (the kernel skips a tile that its mask leaves empty); at each visited
    block ``s = max(s, pow2_ceil(max(max |x|, floor) / 448))`` and the block is ``e4m3(x / s) s``
    (saturating). What a kernel that re-quantizes an operand per accumulator row (P^T and G^T of
    the FP8 backward) computes, up to the accumulation order."""
    from .fp8_format import E4M3_MAX

    heads, rows, cols = x.shape
    scale = torch.zeros(heads, rows, dtype=torch.float32, device=x.device)
    out = torch.zeros_like(x, dtype=torch.float32)
    starts = list(range(0, cols, block))
    for j in (starts if ascending else reversed(starts)):
        if not bool(visited[j // block]):
            continue
        tile = x[:, :, j:j + block].to(torch.float32)
        amax = tile.abs().amax(dim=2).clamp(min=floor)
        scale = torch.maximum(scale, _pow2_ceil(amax * (1.0 / E4M3_MAX)))
        s = scale[:, :, None]
        out[:, :, j:j + block] = (tile / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32) * s
    return out


def tile_scale_e4m3(x: torch.Tensor, rows: int, cols: int, floor: float) -> torch.Tensor:
    """``x`` (H, R, C) through e4m3 with one power-of-two scale per (head, ``rows`` x ``cols``
    tile from (0, 0)), dequantized: ``s = pow2_ceil(max(max |x|, floor) / 448)``, ``e4m3(x / s) s``.
    What the fused FP8 backward does to G before dQ = G K (a warpgroup's tile per m-block)."""
    from .fp8_format import E4M3_MAX

    heads, R, C = x.shape
    padded = torch.zeros(heads, -(-R // rows) * rows, -(-C // cols) * cols, dtype=torch.float32, device=x.device)
    padded[:, :R, :C] = x
    tiles = padded.view(heads, padded.shape[1] // rows, rows, padded.shape[2] // cols, cols)
    amax = tiles.abs().amax(dim=(2, 4), keepdim=True).clamp(min=floor)
    s = _pow2_ceil(amax * (1.0 / E4M3_MAX))
    out = (tiles / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32) * s
    return out.view(padded.shape)[:, :R, :C]


def _blocks_visited(mask: torch.Tensor, row_block: int, col_block: int) -> torch.Tensor:
    """(row blocks, col blocks) bool: which tiles of a (rows, cols) mask hold an allowed entry."""
    rows, cols = mask.shape
    padded = torch.zeros(-(-rows // row_block) * row_block, -(-cols // col_block) * col_block, dtype=torch.bool,
                         device=mask.device)
    padded[:rows, :cols] = mask
    return padded.view(padded.shape[0] // row_block, row_block, -1, col_block).any(dim=3).any(dim=1)


def hstu_attn_fp8_grad_emulation(q, k, v, dout, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k,
                                 num_contexts=None, num_targets=None, target_group_size=1, window_size=(-1, -1),
                                 alpha=1.0, rab=None, is_delta_q=False, *, quant_mode: int, scaling_seqlen=-1,
                                 quantize_inputs: bool = True, round_products: bool = True, tile_m: int = 64,
                                 tile_n: int = 128, fused_dq: bool = False, seqused_q=None, seqused_k=None,
                                 func=None) -> dict:
    """The FP8 backward's oracle (docs/design/fp8-backward.md): ``dict(dq, dk, dv, drab)`` in fp32.

    With ``quantize_inputs``, q, k, v and dO (dO with q's groups) are quantized with
    ``quant_mode``'s groups and dequantized; mode 1's token-reduction products (dV = P^T dO,
    dK = G^T Q, dQ = G K) read the token-contiguous copies, as the kernels' K-major operands do.
    With ``round_products`` the register operands are re-quantized per accumulator row with a
    running power-of-two scale (:func:`running_scale_e4m3`): P^T and G^T per key over the query
    blocks of ``tile_m`` in ascending order (the dK/dV kernel's walk), G per query over the key
    blocks of ``tile_n`` in descending order (the dQ kernel's walk), or with ``fused_dq`` (the
    fused kernel) per tile of ``tile_m`` queries and ``tile_n / 2`` keys (a warpgroup's) with one
    power-of-two scale (:func:`tile_scale_e4m3`); the rounding is of the
    unscaled values (silu(z), alpha silu'(z) dP), 1/S applied after the products. Without
    either flag this is the fp32 backward of spec section 2 written out (the tests compare it
    with autograd of :func:`hstu_attn_reference`). ``seqused_q`` / ``seqused_k``: each sequence
    attends over its valid prefixes only (the padding rows' gradients are zeros), while the
    quantization groups still span the whole storage, padding included, as the device quantizers'
    do (they see the offsets, not seqused). ``func``: FBGEMM's arbitrary mask in place of the
    window, context and target masks (:func:`hstu_attn_reference`)."""
    from .fp8_format import P_AMAX_FLOOR
    from .fp8_recipe import recipe
    from .quantize import dequantize, quantize

    def inputs(x, offsets, max_seqlen):
        if not quantize_inputs:
            wide = x.to(torch.promote_types(x.dtype, torch.float32))
            return wide, wide
        qx = quantize(x, quant_mode, offsets, max_seqlen)
        per_token = dequantize(qx, quant_mode, offsets, max_seqlen)
        if recipe(quant_mode).two_direction:
            return per_token, dequantize(qx, quant_mode, offsets, max_seqlen, token_contiguous=True)
        return per_token, per_token

    (qe, qt), (ke, kt), (ve, _), (de, dt) = (inputs(q, seq_offsets_q, max_seqlen_q), inputs(k, seq_offsets_k, max_seqlen_k),
                                             inputs(v, seq_offsets_k, max_seqlen_k),
                                             inputs(dout, seq_offsets_q, max_seqlen_q))
    dq, dk, dv = torch.zeros_like(qe), torch.zeros_like(ke), torch.zeros_like(ve)
    drab = None if rab is None else torch.zeros(rab.shape, dtype=qe.dtype, device=rab.device)
    offs_q, offs_k = seq_offsets_q.tolist(), seq_offsets_k.tolist()
    ctx = None if num_contexts is None else num_contexts.tolist()
    tgt = None if num_targets is None else num_targets.tolist()
    kind, wl, wr = normalize_window(window_size, max_seqlen_k)
    spec = MaskSpec(kind, has_context=ctx is not None, has_target=tgt is not None, is_delta_q=bool(is_delta_q))
    S = scaling_seqlen if scaling_seqlen != -1 else max(max_seqlen_q, 1)
    # Rows whose tiles hold nothing but masked or zero entries keep a scale above zero.
    g_floor = 2.0 ** -120
    used_q = _host_list(seqused_q, "seqused_q", len(offs_q) - 1)
    used_k = _host_list(seqused_k, "seqused_k", len(offs_q) - 1)
    for b in range(len(offs_q) - 1):
        sq, Lq, sk, Lk = offs_q[b], offs_q[b + 1] - offs_q[b], offs_k[b], offs_k[b + 1] - offs_k[b]
        if used_q is not None:
            Lq = min(Lq, used_q[b])
        if used_k is not None:
            Lk = min(Lk, used_k[b])
        if Lq == 0 or Lk == 0:
            continue
        seq = seq_mask_from_lengths(spec, Lq, Lk, wl, wr, ctx[b] if ctx else 0, tgt[b] if tgt else 0,
                                    int(target_group_size))
        if func is None:
            mask = dense_mask(spec, seq, device=q.device).expand(Lq, Lk)
        else:
            mask = func_dense_mask(func, sq, Lq, Lk, device=q.device)
        row0 = seq.row_offset

        def heads(x, start, length):
            return x[start:start + length].transpose(0, 1)  # (H, L, D)

        z = torch.matmul(heads(qe, sq, Lq), heads(ke, sk, Lk).transpose(1, 2))
        if rab is not None:
            z = z + rab[b, :, row0:row0 + Lq, :Lk].to(z.dtype)
        z = z * alpha
        sig = torch.sigmoid(z)
        zero = torch.zeros((), dtype=z.dtype, device=q.device)
        p = torch.where(mask, z * sig, zero)
        dp = torch.matmul(heads(de, sq, Lq), heads(ve, sk, Lk).transpose(1, 2))
        g = torch.where(mask, alpha * sig * (1 + z * (1 - sig)) * dp, zero)
        p_t, g_t, g_q = p.transpose(1, 2), g.transpose(1, 2), g
        if round_products:
            visited = _blocks_visited(mask, tile_m, tile_n)  # (query blocks, key blocks)
            p_t, g_t, g_q = p_t.clone(), g_t.clone(), g.clone()
            # The dK/dV kernel: one CTA per key block walks its query blocks.
            for kb in range(visited.shape[1]):
                keys = slice(kb * tile_n, (kb + 1) * tile_n)
                p_t[:, keys] = running_scale_e4m3(p_t[:, keys], tile_m, True, visited[:, kb], P_AMAX_FLOOR)
                g_t[:, keys] = running_scale_e4m3(g_t[:, keys], tile_m, True, visited[:, kb], g_floor)
            if fused_dq:
                g_q = tile_scale_e4m3(g, tile_m, tile_n // 2, g_floor)
            else:
                # The dQ kernel: one CTA per query block walks its key blocks, last first.
                for qb in range(visited.shape[0]):
                    rows = slice(qb * tile_m, (qb + 1) * tile_m)
                    g_q[:, rows] = running_scale_e4m3(g[:, rows], tile_n, False, visited[qb], g_floor)
        dv[sk:sk + Lk] += torch.matmul(p_t, heads(dt, sq, Lq)).transpose(0, 1) / S
        dk[sk:sk + Lk] += torch.matmul(g_t, heads(qt, sq, Lq)).transpose(0, 1) / S
        dq[sq:sq + Lq] += torch.matmul(g_q, heads(kt, sk, Lk)).transpose(0, 1) / S
        if drab is not None:
            gr = g / S
            if rab.shape[1] == 1:
                gr = gr.sum(dim=0, keepdim=True)
            drab[b, :, row0:row0 + Lq, :Lk] += gr
    return dict(dq=dq, dk=dk, dv=dv, drab=drab)
