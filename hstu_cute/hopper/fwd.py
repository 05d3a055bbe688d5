"""HSTU attention forward for sm90a: TMA loads, WGMMA, a producer warp and two consumer warpgroups."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from .. import masks
from ..common.mask_apply import KERNEL_OPS, apply_mask_rows_cols, mask_dropped_blocks
from ..common.barriers import NamedBarrier
from ..common.fp8 import (
    rescale_rows_if_needed,
    dim_descales,
    scale_columns,
    scale_rows,
    fp8_words,
    silu_to_fp8_words,
    silu_to_scaled_fp8_words,
    words_to_operand_a,
    zero_smem_cols_past,
)
from ..fp8_format import BLOCK_TOKENS, vt_column_start
from ..common.key_blocks import PAGE_CHUNK, KeyBlocks, PagedArgs, cache_row, page_span
from ..common.seqinfo import SEQ_WORDS, BlockSparseArgs, BlockTiles, ScoreScalars, SequenceArgs
from ..common.silu import silu_scaled_inplace
from ..common.tile_scheduler import SectionWalk, TileScheduler
from .base import HstuSm90Base, StagedEpilogue, store_rows_staged
from ..common.sm90 import (
    acc_coords,
    advanced,
    copy_acc_rows,
    rows_zero_copy,
    shared_storage,
    sm90_smem_layout,
    sm90_tma_atom_rab,
    sm90_tma_atom_tokens,
    smem_tensors,
    transposed_view,
    trivial_mma,
    wgmma,
    wgmma_acc_as_operand_a,
    wgmma_acc_rows_cols,
    wgmma_replace_operand_a,
    zero_smem_rows_past,
)

class HstuForwardSm90(StagedEpilogue, HstuSm90Base):
    """Forward kernel: out = sum_j mask(silu(alpha * (q.k + rab))) v / S over one jagged batch.

    Tiles: (m-block, head, batch), last m-block first within sections of ``bh_per_section``
    (batch, head) pairs (common.tile_scheduler.SectionWalk); with ``persistent`` one CTA per SM
    walks them in a snake order, or (``dynamic_tiles``) claims the next one from a global counter
    whenever it is free (common.tile_scheduler.TileClaims), else one CTA per tile. Tiles past a
    sequence's end are skipped.

    Warp roles (``128 * (1 + tile_m / 64)`` threads):
      * warpgroup 0, warp 0: producer. Issues TMA loads of Q (once per tile), then K(+rab) and V per
        n-block into ``num_stages``-deep smem rings; 24 registers after ``setmaxnreg``.
        Warps 1-3 of warpgroup 0 only lower their registers.
      * warpgroups 1..: consumers, 64 query rows each, 240 registers. S = Q K^T (SS WGMMA),
        S += rab, SiLU, mask (partial tiles only), P = bf16(S) stays in registers and feeds
        O += P V as the register A operand (RS WGMMA).

    Pipelines (mbarrier, TMA transaction counts): with ``dynamic_tiles`` a ring of claimed tile
    indices (producer warp -> consumers, ``TILE_RING_STAGES``); Q (``q_stages``: with 2 the next tile's Q loads
    while this one's is read), K, V and rab (``num_stages`` each).
    K and V have separate rings so that, with ``intra_wg_overlap``, QK^T of block i+1 is issued
    before P.V of block i and SiLU of block i+1 runs while the tensor cores do P.V of block i.
    Barriers: named barriers 2/3 (``pingpong``) make the two consumer warpgroups alternate GEMM
    issue, so one warpgroup's SiLU overlaps the other's GEMMs; 4/5 after zeroing the V rows past
    seqlen_k (TMA reads the next sequence there: P is 0 for them, but 0 * NaN would be NaN).
    Epilogue (``staged_epilogue`` where the smem fits, head dims 64k): O times 1/S in the output
    type, a warpgroup's 64 rows through a swizzled smem tile and one TMA store that runs behind the
    next tile (:class:`~hstu_cute.hopper.base.StagedEpilogue`; named barrier 4 + warpgroup); a tile
    crossing seqlen_q is copied out of the same smem tile by its warpgroup, rows inside the
    sequence only; the other configurations store from registers two columns at a time.
    FP8: each block probes (``mbarrier.test_wait``) the full barriers of the next K and V stages
    while its GEMMs run, and the next block skips a wait whose probe found the phase done.
    Tiles are chained: a tile's last P.V goes out with the next tile's first QK^T and its epilogue
    follows (consume_tiles), so short tiles do not drain the tensor cores between them. With tile
    claims the producer publishes each tile's sequence words beside its index (tile_problem).
    """

    def __init__(self, dtype, head_dim: int, mask: masks.MaskSpec, has_rab: bool, tile_m: int, tile_n: int,
                 num_stages: int, fast_silu: bool, intra_wg_overlap: bool = True, pingpong: bool = True,
                 persistent: bool = True, q_stages: int = 1, dynamic_tiles: bool = False, out_dtype=None,
                 scaled_p: bool = False, two_direction: bool = False, paged: bool = False, split_keys: bool = False,
                 early_silu: bool = False, staged_epilogue: bool = True, block_sparse: bool = False):
        # The CTA launches with 168 x 384 registers; setmaxnreg moves them between roles, so the
        # consumers' 240 must come out of that pool (common.sm90.sm90_register_split).
        super().__init__(dtype, head_dim, mask, has_rab, tile_m, tile_n, num_stages, fast_silu, tile_m // 64,
                         persistent, dynamic_tiles)
        # FP8 (e4m3) q, k and V^T; the output and rab stay 16-bit (HstuForwardFp8Sm90).
        self.fp8 = dtype.width == 8
        self.out_dtype = self.rab_dtype = out_dtype or dtype
        # Split keys: a tile's key blocks come in ``num_splits`` parts (a runtime argument), one
        # CTA tile each (common.key_blocks.KeyBlocks.part): few query tiles over long keys (one
        # user's serving call) keep the SMs busy. Each part stores its fp32 partial output; the
        # warpgroup that finishes a tile's rows last adds the parts up in part order and stores
        # the output (store_split_tile).
        self.split_keys = split_keys
        assert not (split_keys and self.fp8)
        # FP8 quant modes >= 1: P re-quantized per row with a running power-of-two scale
        # (hstu_cute.fp8_format), descales per (sequence, block, head). A query tile is one
        # quantizer block and a key tile lies inside one.
        self.scaled_p = scaled_p
        assert not scaled_p or (self.fp8 and tile_m == BLOCK_TOKENS and BLOCK_TOKENS % tile_n == 0)
        # Quant mode 1: q and k descales per (token, head), so the scores take an outer product
        # of them; V^T's per (block, head, dim), so the output's columns are rescaled when the key
        # block changes (it can not go into P, whose scale is per row).
        self.two_direction = two_direction
        assert not two_direction or scaled_p
        # FP8 P cast: the SiLU in place in the fp32 scores ahead of the mask's branch, then only the
        # e4m3 packing, as the 16-bit kernels do. With the SiLU inside the packing (after the
        # mask), ptxas hoists the P.V wait (`wait_group 0`) above all but the first few MUFU ops,
        # and each warpgroup idles until its own P.V retires; the branch keeps the wait after all
        # 64 of them (SASS, docs/design/fp8-forward.md section 9). Timed in session 23 (H100,
        # causal): D256 +3-4 %, D128 even, D64 -9 %; the default at D256 only (variants).
        self.early_silu = early_silu
        assert not early_silu or (self.fp8 and not scaled_p)
        # Keys of a paged KV cache ahead of each sequence's new keys (common.key_blocks): cache
        # blocks arrive as PAGE_CHUNK-row TMA loads, one per chunk of a page.
        self.paged = paged
        assert not (paged and self.fp8)
        # The consumers take each claimed tile's sequence from the producer (tile_problem's
        # ``words``) instead of loading its offsets: H100, same lease (session 23), FP8 P cast on
        # the short jagged recsys batch 88.3-88.4 TF/s against 85.5-85.6, bf16 there 113.0-113.6
        # against 111.4-112.1, the D128 headline +1 %. Paged tiles still load their page span.
        self.publishes_seq = self.dynamic_tiles and not paged
        # fp16 stores the next P through an operand fence: with a plain store ptxas serializes every
        # WGMMA of the fp16 variants (C7513). H200 fp16 B8 N4096 causal: D128 484 vs 378 TF, D256
        # 620 vs 366, D64 290 vs 268. bf16 keeps the plain store (the fence cost it D64 461 -> 427).
        self.operand_fence = dtype == cutlass.Float16
        self.intra_wg_overlap = intra_wg_overlap
        self.pingpong = pingpong and self.num_mma_wg == 2
        self.q_stages = q_stages
        # Split keys store fp32 partials (store_split_tile); the smem tile is written in 64-column
        # blocks.
        self.staged = staged_epilogue and not split_keys and head_dim % 64 == 0
        # A block mask (hstu_cute.block_mask): each tile walks its list of key tiles
        # (common.key_blocks.KeyBlocks.of_list) and masks by block where its blocks are mixed.
        self.block_sparse = block_sparse
        assert not (block_sparse and (paged or split_keys or self.fp8)), "block-sparse: plain 16-bit tiles only"
        # With claims the producer publishes each tile's list range too: the consumers' own list
        # lookup (the count, then the list's ends: dependent loads at every tile start) cost the
        # 10%-density causal forward 4% (H200 B8 H32 N16384: kernel 3.841 -> 3.676 ms;
        # docs/dev/perf-log.md, session 31).
        if block_sparse:
            self.tile_words = SEQ_WORDS + 2
        assert tile_m % 64 == 0 and tile_n % 16 == 0 and head_dim % 16 == 0

    # ------------------------------------------------------------------------------------------
    # Host side: layouts, TMA atoms, launch (arguments: hstu_cute.kernel_args.SPECS["hopper_fwd"])
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(self, mQ, mK, mV, mO, mOffsetsQ, mOffsetsK, mSeqUsedQ, mSeqUsedK, mNumContexts, mNumTargets, mFunc, mFuncBlocks, mRab,
                 alpha, inv_scale, window_left, window_right, group_size, is_delta_q, num_m_blocks, num_sms,
                 bh_per_section, mTileCounter, mCache, mPageOffsets, mPageIds, mLastPageLens, log2_page_size, mRabNew,
                 mPartials, mArrivals, num_splits, mBlockCount, mBlockIndex, mBlockState, mBlockKept, q_block,
                 k_block, stream):
        paged = None
        if const_expr(self.paged):
            paged = PagedArgs(mCache, mPageOffsets, mPageIds, mLastPageLens, log2_page_size, mRabNew)
        blocks = None
        if const_expr(self.block_sparse):
            blocks = BlockSparseArgs(mBlockCount, mBlockIndex, mBlockState, mBlockKept, q_block, k_block)
        self.compile_forward(mQ, mK, mV, mO, SequenceArgs(mOffsetsQ, mOffsetsK, mSeqUsedQ, mSeqUsedK, mNumContexts,
                                                          mNumTargets, mFunc, mFuncBlocks, blocks), mRab,
                             ScoreScalars(alpha, inv_scale, window_left, window_right, group_size, is_delta_q),
                             num_m_blocks, num_sms, bh_per_section, mTileCounter, None, stream, paged,
                             (mPartials, mArrivals, num_splits) if const_expr(self.split_keys) else None)

    def compile_forward(self, mQ, mK, mV, mO, seqs, mRab, scalars, num_m_blocks, num_sms, bh_per_section,
                        mTileCounter, descales, stream, paged=None, split=None):
        """The body of ``__call__`` (traced inside it): layouts, TMA atoms, smem plan and the
        launch. ``mV`` is V (T, H, D), or for FP8 its token-contiguous copy V^T (H, D, W);
        ``descales``: None, or the FP8 kernel's (q, k, v) descale tensors; ``paged``: None, or
        the cache's :class:`PagedArgs`; ``split``: split keys, (fp32 partial outputs part after
        part (parts x T_q, H, D), arrival counts (B x H x m-blocks x 2, zero at launch and left
        zero), parts); ``num_m_blocks`` counts m-blocks times parts."""
        D = self.head_dim
        sQ_layout = sm90_smem_layout(self.dtype, self.tile_m, D, self.q_stages)
        sK_layout = sm90_smem_layout(self.dtype, self.tile_n, D, self.num_stages)
        sRab_layout = self.rab_ring_layout()
        tma_load = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_q, tma_q = sm90_tma_atom_tokens(tma_load, mQ, cute.slice_(sQ_layout, (None, None, 0)), self.tile_m)
        tma_atom_k, tma_k = sm90_tma_atom_tokens(tma_load, mK, cute.slice_(sK_layout, (None, None, 0)), self.tile_n)
        if const_expr(self.fp8):
            # V^T stages (D, tile_n), keys contiguous: the K-major B operand an 8-bit WGMMA needs.
            sV_layout = sm90_smem_layout(self.dtype, D, self.tile_n, self.num_stages)
            mVt = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[1, 2, 0]))  # (D, W, H)
            tma_atom_v, tma_v = cpasync.make_tiled_tma_atom(tma_load, mVt, cute.slice_(sV_layout, (None, None, 0)),
                                                            (D, self.tile_n))
        else:
            sV_layout = sK_layout
            tma_atom_v, tma_v = sm90_tma_atom_tokens(tma_load, mV, cute.slice_(sK_layout, (None, None, 0)),
                                                     self.tile_n)
        tma_atom_rab, tma_rab = None, None
        if const_expr(self.has_rab):
            tma_atom_rab, tma_rab = sm90_tma_atom_rab(mRab, sRab_layout, self.tile_m, self.tile_n)
        page_loads = None
        if const_expr(self.paged):
            # Boxes of min(page_size, tile_n) cache rows, one TMA atom per box height (a runtime
            # choice); rab of the new segment from its own (aligned) tensor.
            rab_new = None
            if const_expr(self.has_rab):
                rab_new = sm90_tma_atom_rab(paged.mRabNew, sRab_layout, self.tile_m, self.tile_n)
            page_loads = (rab_new, tuple(sm90_tma_atom_tokens(tma_load, paged.mCache, sm90_smem_layout(self.dtype, rows, D),
                                                              rows) for rows in self.page_boxes()))

        elem_bytes = self.dtype.width // 8
        self.q_bytes = self.tile_m * D * elem_bytes
        self.kv_bytes = self.tile_n * D * elem_bytes
        self.rab_bytes = self.tile_m * self.tile_n * (self.rab_dtype.width // 8)
        kv = (self.dtype, cute.cosize(sK_layout))
        ring_barriers, ring_words = self.tile_ring_storage()
        if const_expr(self.split_keys):
            ring_words = dict(ring_words, sArrived=2)  # a warpgroup's arrival count, for its threads
        barriers = dict(mbar_q=2 * self.q_stages, mbar_k=2 * self.num_stages, mbar_v=2 * self.num_stages,
                        mbar_rab=2 * self.num_stages, **ring_barriers)
        buffers = dict(sQ=(self.dtype, cute.cosize(sQ_layout)), sK=kv, sV=(self.dtype, cute.cosize(sV_layout)),
                       sRab=(self.rab_dtype, self.smem_elems(sRab_layout)))
        storage_of = lambda extra: shared_storage(barriers, dict(buffers, **extra), words=ring_words)  # noqa: E731
        sEpi_layout = epi_atoms = None
        if const_expr(self.staged):
            self.shared_storage, sEpi_layout, epi_atoms = self.staged_epilogue(storage_of, (mO,), D, self.out_dtype)
        else:
            self.shared_storage = storage_of({})

        num_tiles = num_m_blocks * mQ.shape[1] * (seqs.mOffsetsQ.shape[0] - 1)
        # Persistent: one CTA per SM (smem allows no second one) walking the tiles; the producer
        # runs ahead into the next tile while the consumers finish the current one.
        grid = [cutlass.min(num_tiles, num_sms) if const_expr(self.persistent) else num_tiles, 1, 1]
        self.launch(
            tma_atom_q, tma_q, tma_atom_k, tma_k, tma_atom_v, tma_v, tma_atom_rab, tma_rab, mQ, mO, mK, seqs, mRab,
            scalars, num_m_blocks, bh_per_section, mTileCounter, descales, page_loads,
            paged._replace(mCache=None, mRabNew=None) if const_expr(self.paged) else None, split, epi_atoms,
            statics=dict(
                sQ_layout=sQ_layout, sK_layout=sK_layout, sV_layout=sV_layout, sRab_layout=sRab_layout,
                sEpi_layout=sEpi_layout,
                tiled_mma_qk=trivial_mma(self.dtype, self.tile_n, False, self.num_mma_wg),
                # P (registers) x V: 16-bit V is (n, D) with D contiguous, an MN-major B operand;
                # FP8 V^T is (D, n) with n contiguous, K-major.
                tiled_mma_pv=trivial_mma(self.dtype, D, not self.fp8, self.num_mma_wg, a_in_registers=True),
                # V rows (FP8: V^T columns) past seqlen_k, per consumer warpgroup
                zero_copy_v=rows_zero_copy(self.dtype, self.tile_n if self.fp8 else D),
            ),
            grid=grid, stream=stream,
        )

    # ------------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, tma_atom_q, tma_q, tma_atom_k, tma_k, tma_atom_v, tma_v, tma_atom_rab, tma_rab, mQ, mO, mK,
               seqs, mRab, scalars, num_m_blocks: Int32, bh_per_section: Int32, mTileCounter, descales, page_loads,
               paged, split, epi_atoms, statics):
        self.bind(statics)
        page_atoms = ()
        if const_expr(self.paged):
            page_atoms = tuple(atom for atom, _ in page_loads[1]) + (
                page_loads[0][0] if const_expr(self.has_rab) else None,)
        tidx, warp_idx = self.prologue(tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_rab, *page_atoms)
        self.paged_args = paged
        # GQA / MQA: k and v hold H_q / group heads; query head h reads key head h // group.
        self.kv_group = mQ.shape[1] // mK.shape[1]
        if const_expr(self.split_keys):
            self.mPartials, self.mArrivals, self.num_splits = split
            # Part p of a tile stores rows q_start + p * T_q of the partial outputs.
            self.part_rows = mQ.shape[0]
            self.heads, self.m_blocks = mQ.shape[1], num_m_blocks // self.num_splits
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        if const_expr(self.split_keys):
            self.sArrived = storage.sArrived.get_tensor(cute.make_layout(2))
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads // 32)

        def tma_pipeline(mbar, stages, tx_count):
            return pipeline.PipelineTmaAsync.create(barrier_storage=mbar.data_ptr(), num_stages=stages,
                                                    producer_group=producer, consumer_group=consumers,
                                                    tx_count=tx_count, defer_sync=True)

        pipe_q = tma_pipeline(storage.mbar_q, self.q_stages, self.q_bytes)
        pipe_k = tma_pipeline(storage.mbar_k, self.num_stages, self.kv_bytes)
        pipe_v = tma_pipeline(storage.mbar_v, self.num_stages, self.kv_bytes)
        pipe_rab = None
        if const_expr(self.has_rab):
            pipe_rab = tma_pipeline(storage.mbar_rab, self.num_stages, self.rab_bytes)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        s = smem_tensors(storage, dict(sQ=self.sQ_layout, sK=self.sK_layout, sV=self.sV_layout,
                                       sRab=self.sRab_layout, sEpi=self.sEpi_layout))
        # (smem tiles, TMA store atoms) of the staged epilogue, or None (store_output).
        self.epilogue = (s["sEpi"], epi_atoms) if const_expr(self.sEpi_layout is not None) else None
        walk = SectionWalk(num_m_blocks, mQ.shape[1], seqs.mOffsetsQ.shape[0] - 1, bh_per_section, reverse=True)
        seqinfo = self.sequence_info(seqs, scalars, mQ, mK)
        claims = self.tile_claims(storage, walk, mTileCounter)
        alpha, out_scale = scalars.alpha, scalars.inv_scale
        if const_expr(self.fp8):
            # scores = (q8 . k8) dq dk: without rab the product folds into alpha, with rab it
            # scales the scores before the bias (add_rab_silu_mask); out = (P8 . v8) dv / S.
            mDescaleQ, mDescaleK, mDescaleV = descales
            if const_expr(self.scaled_p):
                # (B, blocks, H) tables, read per tile and per key block (tile_descales).
                self.descales = descales
            else:
                self.qk_descale = mDescaleQ[0] * mDescaleK[0]
                if const_expr(not self.has_rab):
                    alpha = alpha * self.qk_descale
                out_scale = out_scale * mDescaleV[0]

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.produce((tma_atom_q, tma_q, tma_atom_k, tma_k, tma_atom_v, tma_v, tma_atom_rab, tma_rab, s["sQ"],
                              s["sK"], s["sV"], s["sRab"], pipe_q, pipe_k, pipe_v, pipe_rab, mRab, page_loads), walk,
                             seqinfo, claims)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            self.consume(tidx - 128, mO, s["sQ"], s["sK"], s["sV"], s["sRab"], pipe_q, pipe_k, pipe_v, pipe_rab,
                         alpha, out_scale, walk, seqinfo, claims)

    @cute.jit
    def tile_problem(self, tiles, seqinfo, tile: Int32, words=None):
        """(live, (m_block, head, batch, q_start, k_start, seq, key blocks)) of a linear tile;
        ``live``: the m-block starts inside its sequence (else the tile is skipped). ``seq``: the
        whole sequence's mask (paged: the cached keys included); from the producer's ``words``
        (:meth:`SequenceInfo.from_words`) where given."""
        m_block, head, batch = tiles.coords(tile)
        part = None
        if const_expr(self.split_keys):
            # The walk's blocks are (m-block, part) pairs, parts fastest.
            part = m_block % self.num_splits
            m_block = m_block // self.num_splits
        span = None
        if const_expr(self.paged):
            span = page_span(self.paged_args, batch)
        if const_expr(words is not None):
            q_start, k_start, seq = seqinfo.from_words(words[:SEQ_WORDS], batch)
        else:
            q_start, k_start, seq = seqinfo.at(batch, span.cached_len if const_expr(self.paged) else None)
        if const_expr(self.block_sparse):
            seq.sparse = BlockTiles.of(seqinfo.seqs.blocks, batch, head)
            if const_expr(words is not None):
                blocks = KeyBlocks.of_list_range(seq, m_block, words[SEQ_WORDS], words[SEQ_WORDS + 1])
            else:
                blocks = KeyBlocks.of_list(self.mask, seq, m_block, self.tile_m, self.tile_n)
        else:
            blocks = KeyBlocks.of_tile(self.mask, seq, m_block, self.tile_m, self.tile_n, span)
        if const_expr(self.split_keys):
            blocks = blocks.part(part, self.num_splits)
        live = m_block * self.tile_m < seq.seqlen_q
        return live, (m_block, head, batch, q_start, k_start, seq, blocks)

    # ------------------------------------------------------------------------------------------
    # Producer warp
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def produce(self, loads, walk, seqinfo, claims):
        states = (pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages),
                  pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages),
                  pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages))
        # A tile whose mask leaves it no key loads nothing (its consumers write zeros).
        self.for_each_tile(walk, seqinfo, self.produce_tile, loads, states, claims=claims, producer=True,
                           visit_if=lambda coords: coords[6].count > 0)

    @cute.jit
    def produce_tile(self, tma_atom_q, tma_q, tma_atom_k, tma_k, tma_atom_v, tma_v, tma_atom_rab, tma_rab, sQ, sK,
                     sV, sRab, pipe_q, pipe_k, pipe_v, pipe_rab, mRab, page_loads, m_block: Int32, head: Int32,
                     batch: Int32, q_start: Int32, k_start: Int32, seq, blocks, q_state, k_state, v_state):
        """TMA loads of one tile: Q, then K (and rab) of each n-block ahead of V of the one before.
        Returns the advanced pipeline states."""
        D = self.head_dim
        no_mcast = cute.make_layout(1)
        # No method call on a name inside the loops below (it would be carried through them).
        n_count, block_at = blocks.count, blocks.at
        gQ = cute.local_tile(cute.domain_offset((q_start, 0), tma_q[None, None, head]), (self.tile_m, D),
                             (m_block, 0))
        tQsQ, tQgQ = cpasync.tma_partition(tma_atom_q, 0, no_mcast, cute.group_modes(sQ, 0, 2),
                                           cute.group_modes(gQ, 0, 2))
        kv_head = head // self.kv_group
        gK = cute.local_tile(cute.domain_offset((k_start, 0), tma_k[None, None, kv_head]), (self.tile_n, D),
                             (None, 0))
        tKsK, tKgK = cpasync.tma_partition(tma_atom_k, 0, no_mcast, cute.group_modes(sK, 0, 2),
                                           cute.group_modes(gK, 0, 2))
        if const_expr(self.fp8):
            # Each sequence starts 16-byte aligned in V^T (hopper.vt: a TMA box must start 16-byte
            # aligned along the contiguous dimension).
            gV = cute.local_tile(cute.domain_offset((0, vt_column_start(k_start, batch)), tma_v[None, None, kv_head]),
                                 (D, self.tile_n), (0, None))
        else:
            gV = cute.local_tile(cute.domain_offset((k_start, 0), tma_v[None, None, kv_head]), (self.tile_n, D),
                                 (None, 0))
        tVsV, tVgV = cpasync.tma_partition(tma_atom_v, 0, no_mcast, cute.group_modes(sV, 0, 2),
                                           cute.group_modes(gV, 0, 2))
        tRsR = tRgR = None
        if const_expr(self.has_rab):
            rab_head = cutlass.select_(mRab.shape[1] > 1, head, Int32(0))
            # rab rows are key coordinates: query i reads row row_offset + i.
            gRab = cute.local_tile(
                cute.domain_offset((seq.row_offset, 0), tma_rab[None, None, rab_head, batch]),
                (self.tile_m, self.tile_n), (m_block, None),
            )
            tRsR, tRgR = cpasync.tma_partition(
                tma_atom_rab, 0, no_mcast, cute.group_modes(sRab, 0, 2), cute.group_modes(gRab, 0, 2)
            )
        pages = None
        if const_expr(self.paged):
            pages = self.page_partitions(page_loads, sK, sV, tma_atom_rab, tma_rab, sRab, mRab, m_block, head, batch,
                                         seq, blocks)

        pipe_q.producer_acquire(q_state)
        cute.copy(tma_atom_q, tQgQ, tQsQ[None, q_state.index], tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
        q_state = advanced(q_state)
        # K (and rab) of block i+1 go out before V of block i: the consumers issue QK^T of
        # block i+1 before P.V of block i.
        for it in cutlass.range(n_count, unroll=1):
            _, n_block = block_at(n_count - 1 - it)
            rows_k = self.lane_cache_row(blocks, n_count - 1 - it, n_block, 0) if const_expr(self.paged) else None
            pipe_k.producer_acquire(k_state)
            if const_expr(self.paged):
                self.load_paged(pages, 0, blocks, n_count - 1 - it, n_block, rows_k, tma_atom_k, tKgK, tKsK, pipe_k,
                                k_state)
            else:
                cute.copy(tma_atom_k, tKgK[None, n_block], tKsK[None, k_state.index],
                          tma_bar_ptr=pipe_k.producer_get_barrier(k_state))
            if const_expr(self.has_rab):
                pipe_rab.producer_acquire(k_state)
                if const_expr(self.paged):
                    self.load_paged_rab(pages, blocks, n_count - 1 - it, n_block, tma_atom_rab, tRgR, tRsR, pipe_rab,
                                        k_state)
                else:
                    cute.copy(tma_atom_rab, tRgR[None, n_block], tRsR[None, k_state.index],
                              tma_bar_ptr=pipe_rab.producer_get_barrier(k_state))
            k_state = advanced(k_state)
            if it > 0:
                _, n_prev = block_at(n_count - it)
                rows_v = self.lane_cache_row(blocks, n_count - it, n_prev, 1) if const_expr(self.paged) else None
                pipe_v.producer_acquire(v_state)
                if const_expr(self.paged):
                    self.load_paged(pages, 1, blocks, n_count - it, n_prev, rows_v, tma_atom_v, tVgV, tVsV, pipe_v,
                                    v_state)
                else:
                    cute.copy(tma_atom_v, tVgV[None, n_prev], tVsV[None, v_state.index],
                              tma_bar_ptr=pipe_v.producer_get_barrier(v_state))
                v_state = advanced(v_state)
        _, n_last = block_at(Int32(0))
        rows_v = self.lane_cache_row(blocks, Int32(0), n_last, 1) if const_expr(self.paged) else None
        pipe_v.producer_acquire(v_state)
        if const_expr(self.paged):
            self.load_paged(pages, 1, blocks, Int32(0), n_last, rows_v, tma_atom_v, tVgV, tVsV, pipe_v, v_state)
        else:
            cute.copy(tma_atom_v, tVgV[None, n_last], tVsV[None, v_state.index],
                      tma_bar_ptr=pipe_v.producer_get_barrier(v_state))
        v_state = advanced(v_state)
        return q_state, k_state, v_state

    @cute.jit
    def page_partitions(self, page_loads, sK, sV, tma_atom_rab, tma_rab, sRab, mRab, m_block: Int32, head: Int32,
                        batch: Int32, seq, blocks):
        """Paged: (per box height of :meth:`page_boxes`: (atom, cache boxes, K and V stage boxes),
        rab tiles of the new segment). A stage's box ``c`` of ``rows`` rows holds keys
        ``[c, c + 1) * rows`` of its block."""
        D = self.head_dim
        no_mcast = cute.make_layout(1)
        rab_new, atoms = page_loads
        boxes = []
        for rows, (atom, tma_cache) in zip(self.page_boxes(), atoms):
            gBox = cute.local_tile(tma_cache[None, None, head], (rows, D), (None, 0))
            tBsK, tBgB = cpasync.tma_partition(atom, 0, no_mcast, cute.group_modes(cute.flat_divide(sK, (rows, D)), 0, 2),
                                               cute.group_modes(gBox, 0, 2))
            tBsV, _ = cpasync.tma_partition(atom, 0, no_mcast, cute.group_modes(cute.flat_divide(sV, (rows, D)), 0, 2),
                                            cute.group_modes(gBox, 0, 2))
            boxes.append((atom, tBgB, (tBsK, tBsV)))
        rab_loads_new = None
        if const_expr(self.has_rab):
            # The new segment's rab: its own tensor, rows by query index (the gather applied the
            # row offset: history queries sit before the target keys, at negative segment rows).
            tma_atom_rab_new, tma_rab_new = rab_new
            rab_head = cutlass.select_(mRab.shape[1] > 1, head, Int32(0))
            gRab_new = cute.local_tile(tma_rab_new[None, None, rab_head, batch], (self.tile_m, self.tile_n),
                                       (m_block, None))
            _, tRgR_new = cpasync.tma_partition(tma_atom_rab_new, 0, no_mcast, cute.group_modes(sRab, 0, 2),
                                                cute.group_modes(gRab_new, 0, 2))
            rab_loads_new = (tma_atom_rab_new, tRgR_new)
        return boxes, rab_loads_new

    def page_boxes(self):
        """The box heights of the cache loads: PAGE_CHUNK, doubling up to tile_n. A block's cache
        rows arrive in boxes of min(page_size, tile_n) rows (H100, 64 users x (4096 + 256) D128:
        16-row boxes for every page size cost 10-14% over contiguous keys, whole blocks 1-2%)."""
        return [PAGE_CHUNK << i for i in range((self.tile_n // PAGE_CHUNK).bit_length())]

    def log2_cache_box(self):
        """log2 of the cache boxes' height, min(page_size, tile_n) (:meth:`page_boxes`)."""
        return cutlass.min(self.paged_args.log2_page_size, Int32(self.tile_n.bit_length() - 1))

    @cute.jit
    def lane_cache_row(self, blocks, i: Int32, n_block: Int32, kind: cutlass.Constexpr[int]):
        """Producer lane l's cache box of block ``i`` (K: ``kind`` 0, V: 1): box min(l, boxes - 1),
        in units of the box height; 0 for a block of new keys. The lanes read the page table at
        once and :meth:`load_paged` shuffles the rows out, ahead of the stage wait (H100, 64 users
        x (4096 + 256) at page size 16: 0.277 ms against 0.296 with one page-table read per box
        in turn; contiguous keys 0.249)."""
        row = Int32(0)
        if blocks.in_cache(i):
            log2_box = self.log2_cache_box()
            box = cutlass.min(cute.arch.lane_idx(), (Int32(self.tile_n) >> log2_box) - 1)
            row = cache_row(self.paged_args, blocks.span, n_block * self.tile_n + (box << log2_box), kind,
                            rows=1) >> log2_box
        return row

    @cute.jit
    def load_paged(self, pages, kind: cutlass.Constexpr[int], blocks, i: Int32, n_block: Int32, lane_row: Int32,
                   tma_atom, tXgX, tXsX, pipe, state):
        """K (``kind`` 0) or V (1) of block ``i``: from the cache in boxes of min(page_size,
        tile_n) rows (:meth:`page_boxes`; the stage's transaction count is met either way), box c
        at lane c's ``lane_row`` (:meth:`lane_cache_row`), else the new keys' tile."""
        boxes = pages[0]
        log2_box = self.log2_cache_box()
        if blocks.in_cache(i):
            for b, (atom, tBgB, box_dst) in enumerate(boxes):
                box = PAGE_CHUNK << b
                if log2_box == box.bit_length() - 1:
                    for c in cutlass.range_constexpr(self.tile_n // box):
                        row = cute.arch.shuffle_sync(lane_row, c) if const_expr(self.tile_n // box > 1) else lane_row
                        cute.copy(atom, tBgB[None, row], box_dst[kind][None, c, 0, state.index],
                                  tma_bar_ptr=pipe.producer_get_barrier(state))
        else:
            cute.copy(tma_atom, tXgX[None, n_block], tXsX[None, state.index], tma_bar_ptr=pipe.producer_get_barrier(state))

    @cute.jit
    def load_paged_rab(self, pages, blocks, i: Int32, n_block: Int32, tma_atom_rab, tRgR, tRsR, pipe_rab, state):
        """rab of block ``i``: the cache segment's tiles from rab, the new segment's from the rab
        among the new tokens (mRabNew)."""
        tma_atom_rab_new, tRgR_new = pages[1]
        in_cache = blocks.in_cache(i)
        if in_cache:
            cute.copy(tma_atom_rab, tRgR[None, n_block], tRsR[None, state.index],
                      tma_bar_ptr=pipe_rab.producer_get_barrier(state))
        else:
            cute.copy(tma_atom_rab_new, tRgR_new[None, n_block], tRsR[None, state.index],
                      tma_bar_ptr=pipe_rab.producer_get_barrier(state))

    # ------------------------------------------------------------------------------------------
    # Consumer warpgroups
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def consume(self, tidx: Int32, mO, sQ, sK, sV, sRab, pipe_q, pipe_k, pipe_v, pipe_rab, alpha: Float32,
                inv_scale: Float32, walk, seqinfo, claims):
        D = self.head_dim
        tiled_mma_qk, tiled_mma_pv = self.tiled_mma_qk, self.tiled_mma_pv
        wg = cute.arch.make_warp_uniform(tidx // 128)
        wg_thread0 = wg * 128
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        thr_mma_pv = tiled_mma_pv.get_slice(tidx)
        wg_mma_qk = tiled_mma_qk.get_slice(wg_thread0)
        wg_mma_pv = tiled_mma_pv.get_slice(wg_thread0)
        tSrQ = wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(sQ))
        tSrK = wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(sK))
        if const_expr(self.fp8):
            sVt = sV  # V^T (D, n): already the (N, K) B operand of P.V, K-major
        else:
            # V is (n, D) with D contiguous: as the B operand of P.V (N = D, K = n) it is MN-major.
            sVt = transposed_view(sV, (D, self.tile_n, self.num_stages))
        tOrVt = wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(sVt))
        acc_shape_S = wg_mma_qk.partition_shape_C((self.tile_m, self.tile_n))
        acc_shape_O = wg_mma_pv.partition_shape_C((self.tile_m, D))
        tOrP = wg_mma_pv.make_fragment_A(wg_mma_pv.partition_shape_A((self.tile_m, self.tile_n)))

        tScS, tScS_rc = acc_coords(thr_mma_qk, (self.tile_m, self.tile_n))
        tOcO, tOcO_rc = acc_coords(thr_mma_pv, (self.tile_m, D))
        tSsRab = None
        if const_expr(self.has_rab):
            tSsRab = thr_mma_qk.partition_C(sRab)

        if const_expr(self.pingpong):
            if wg == 0:
                # Warpgroup 0 issues first: pre-arrive on its own turn barrier.
                cute.arch.barrier_arrive(barrier_id=NamedBarrier.SCHED_WG0, number_of_threads=256)

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        tiles = claims if const_expr(self.dynamic_tiles) else TileScheduler(walk)
        self.consume_tiles(tiles, seqinfo, tidx, wg, mO, sV, pipe_q, pipe_k, pipe_v, pipe_rab, alpha, inv_scale,
                           q_state, k_state, v_state, tSrQ, tSrK, tOrVt, tOrP, tScS_rc, tSsRab, thr_mma_pv, tOcO_rc,
                           acc_shape_S, acc_shape_O)

    @cute.jit
    def consume_tiles(self, tiles, seqinfo, tidx: Int32, wg: Int32, mO, sV, pipe_q, pipe_k, pipe_v, pipe_rab,
                      alpha: Float32, inv_scale: Float32, q_state, k_state, v_state, tSrQ, tSrK, tOrVt, tOrP, tScS_rc,
                      tSsRab, thr_mma_pv, tOcO_rc, acc_shape_S, acc_shape_O):
        """The consumers' loop over the CTA's tiles, chained: a tile's last P.V goes out with the
        next tile's first QK^T, and the finished tile's epilogue follows it (H100, against a loop
        that finished each tile alone, session 10: B1024 N256 187 vs 180 TF, B128 N512 298 vs 289,
        short jagged 101 vs 95, long rows unchanged). ``pending``: a tile's last P is in registers,
        its P.V not issued yet; ``prev_*``: where that block's V rows end and the tile's output
        coordinates. One tile per CTA: the loop runs once and the pending P.V closes it."""
        tiled_mma_qk, zero_copy_v, spec = self.tiled_mma_qk, self.zero_copy_v, self.mask
        pending = cutlass.Boolean(False)
        prev_v_rows, prev_head, prev_q_start, prev_m_block, prev_seqlen_q = Int32(0), Int32(0), Int32(0), Int32(0), Int32(0)
        # The pending tile's sequence and last key block (two_direction: its V descales).
        prev_batch, prev_n_last = Int32(0), Int32(0)
        acc_O = cute.make_rmem_tensor(acc_shape_O, Float32)
        acc_O.fill(0.0)
        p_scale = pending_p_scale = None
        if const_expr(self.scaled_p):
            # The running P scale of the thread's two rows, and the pending tile's for its epilogue.
            p_scale = cute.make_rmem_tensor(cute.make_layout(2), Float32)
            pending_p_scale = cute.make_rmem_tensor(cute.make_layout(2), Float32)
            p_scale.fill(0.0)
        # What every overlapped block step reads (overlapped_block).
        step = (tidx, wg, sV, pipe_k, pipe_v, pipe_rab, alpha, tSrQ, tSrK, tOrVt, tOrP, tScS_rc, tSsRab, acc_shape_S,
                acc_O, p_scale, tOcO_rc)
        # No method call on a loop-carried name.
        num_tiles, next_tile, next_words = tiles.num_tiles, tiles.consumer_next, None
        words = None
        if const_expr(self.publishes_seq):
            next_words = tiles.consumer_next_words
            tile, words, tile_token = tiles.consumer_first_words()
        else:
            tile, tile_token = tiles.consumer_first()
        while tile < num_tiles:
            live, (m_block, head, batch, q_start, k_start, seq, blocks) = self.tile_problem(tiles, seqinfo, tile,
                                                                                             words)
            n_count, block_at = blocks.count, blocks.at
            if live:
                row_first = seq.row_offset + m_block * self.tile_m
                scales = self.tile_descales(batch, head, m_block, q_start, k_start, seq, tScS_rc)
                if n_count > 0:
                    pipe_q.consumer_wait(q_state)
                    # ---- first n-block: its QK^T goes out with the previous tile's last P.V ----
                    seg, n_block = block_at(n_count - 1)
                    pipe_k.consumer_wait(k_state)
                    if pending:
                        if const_expr(self.scaled_p):
                            pending_p_scale.store(p_scale.load())
                        v_state = self.overlapped_block(step, q_state, k_state, v_state, lambda: prev_v_rows, seg,
                                                        m_block, n_block, self.rows_of(seg, m_block, row_first),
                                                        scales, advance_v=True)
                        self.store_tile(acc_O, mO, thr_mma_pv, tOcO_rc, inv_scale, prev_head, prev_q_start,
                                        prev_m_block, prev_seqlen_q, pending_p_scale, (prev_batch, prev_n_last))
                        acc_O.fill(0.0)
                    else:
                        acc_S = cute.make_rmem_tensor(acc_shape_S, Float32)
                        wgmma(tiled_mma_qk, acc_S, tSrQ[None, None, None, q_state.index],
                              tSrK[None, None, None, k_state.index], True, 0)
                        pipe_k.consumer_release(k_state)
                        self.scores_to_p(acc_S, tOrP, tSsRab, tScS_rc, pipe_rab, k_state, alpha, spec, seg, m_block,
                                         n_block, self.rows_of(seg, m_block, row_first), scales, p_scale)
                    k_state = advanced(k_state)
                    # ---- the tile's other n-blocks: the per-tile loop's body ----
                    k_peek, v_peek = cutlass.Boolean(False), cutlass.Boolean(False)  # done: skip the wait
                    for it in cutlass.range(1, n_count, unroll=1):
                        seg, n_block = block_at(n_count - 1 - it)
                        seg_prev, n_prev = block_at(n_count - it)
                        # FP8: the next K and V barriers are probed while this block's GEMMs run
                        # and their waits skipped when done (a wait on a completed phase still
                        # cost ~100 cycles in the clock trace): D128 963-967 TF/s against 926
                        # (H100, session 24); bf16 measured 0.8 % slower, so not there.
                        pipe_k.consumer_wait(k_state, k_peek if const_expr(self.fp8) else None)
                        done = self.overlapped_block(step, q_state, k_state, v_state,
                                                     lambda: seg_prev.seqlen_k - n_prev * self.tile_n, seg, m_block,
                                                     n_block, self.rows_of(seg, m_block, row_first), scales,
                                                     n_prev=n_prev, peeks=v_peek if const_expr(self.fp8) else None)
                        if const_expr(self.fp8):
                            k_peek, v_peek = done[1]
                        k_state = advanced(k_state)
                        v_state = advanced(v_state)
                    # Every QK^T of this tile is complete: the producer may load the next Q.
                    pipe_q.consumer_release(q_state)
                    q_state = advanced(q_state)
                    # The last P.V waits for the next tile's first QK^T.
                    seg_last, n_last = block_at(Int32(0))
                    pending = cutlass.Boolean(True)
                    prev_v_rows = seg_last.seqlen_k - n_last * self.tile_n
                    prev_head, prev_q_start, prev_m_block, prev_seqlen_q = head, q_start, m_block, seq.seqlen_q
                    prev_batch, prev_n_last = batch, self.pending_tag(n_last, blocks)
                else:
                    # No key for this tile: finish the pending one, then store this tile's zeros.
                    if pending:
                        v_state = self.last_pv(pipe_v, v_state, sV, zero_copy_v, tidx, wg, prev_v_rows, acc_O, tOrP,
                                               tOrVt)
                        self.store_tile(acc_O, mO, thr_mma_pv, tOcO_rc, inv_scale, prev_head, prev_q_start,
                                        prev_m_block, prev_seqlen_q, p_scale, (prev_batch, prev_n_last))
                        acc_O.fill(0.0)
                        pending = cutlass.Boolean(False)
                    self.store_tile(acc_O, mO, thr_mma_pv, tOcO_rc, inv_scale, head, q_start, m_block, seq.seqlen_q,
                                    None, self.split_tile(batch, blocks))
            if const_expr(self.publishes_seq):
                tile, words, tile_token = next_words(tile_token)
            else:
                tile, tile_token = next_tile(tile, tile_token)
        if pending:
            v_state = self.last_pv(pipe_v, v_state, sV, zero_copy_v, tidx, wg, prev_v_rows, acc_O, tOrP, tOrVt)
            self.store_tile(acc_O, mO, thr_mma_pv, tOcO_rc, inv_scale, prev_head, prev_q_start, prev_m_block,
                            prev_seqlen_q, p_scale, (prev_batch, prev_n_last))
        if const_expr(self.epilogue is not None):
            # The last TMA stores must have read smem before the CTA's smem goes away.
            if tidx % 128 < 32:
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    def extra_tile_words(self, coords):
        """Block-sparse: the tile's list range after its sequence's words."""
        if const_expr(self.block_sparse):
            return coords[6].list_words()
        return ()

    def pending_tag(self, n_last, blocks):
        """What the pending tile's epilogue needs besides its coordinates: its last key block
        (two_direction: the V descales of the output's columns), or with split keys its part."""
        return blocks.part_index if const_expr(self.split_keys) else n_last

    def split_tile(self, batch, blocks):
        """The ``last_block`` argument of :meth:`store_tile` for a tile without keys: with split
        keys (batch, part) (its zeros still count as a part), else None."""
        return (batch, blocks.part_index) if const_expr(self.split_keys) else None

    def rows_of(self, seg, m_block, row_first):
        """The first row of an m-block in the coordinates of a key block's segment: a paged
        tile's new segment is shifted by the cached length (common.key_blocks)."""
        if const_expr(self.paged):
            return seg.row_offset + m_block * self.tile_m
        return row_first

    @cute.jit
    def overlapped_block(self, step, q_state, k_state, v_state, v_rows, seq, m_block: Int32, n_block: Int32,
                         row_first: Int32, scales, advance_v: cutlass.Constexpr[bool] = False, n_prev=None,
                         peeks=None):
        """One block after the first (K waited for): QK^T of this block and P.V of the previous one
        (``v_rows()``: its V rows inside the sequence) in flight together, under the ping-pong
        barrier; then this block's P replaces the previous one. Releases K and V; the caller
        advances the states, except V with ``advance_v`` (returned; it is advanced before the P
        swap there, which keeps the tile-boundary step's PTX as it was measured): then this block
        is a new tile's first, and its scaled P (``scales``) starts afresh. ``n_prev``: the previous
        block (two_direction: the output's columns move to this block's V descales). ``peeks``
        (FP8): whether this block's V has landed, probed by the previous block; then returns
        ``(v_state, (k_done, v_done))``, the next K's and this V's barriers probed while the GEMMs
        run, for the next block to skip its waits on."""
        (tidx, wg, sV, pipe_k, pipe_v, pipe_rab, alpha, tSrQ, tSrK, tOrVt, tOrP, tScS_rc, tSsRab, acc_shape_S, acc_O,
         p_scale, tOcO_rc) = step
        self.sched_wait(wg)
        acc_S = cute.make_rmem_tensor(acc_shape_S, Float32)
        wgmma(self.tiled_mma_qk, acc_S, tSrQ[None, None, None, q_state.index], tSrK[None, None, None, k_state.index],
              True, -1)
        dk = v_ratios = mixed = None
        if const_expr(self.block_sparse):
            # Whether the block mixes kept and dropped blocks, loaded while the GEMMs run: loaded at
            # its use, after the QK^T wait, the load's latency sits between the GEMM and the SiLU.
            mixed = seq.sparse.tile_mixed(m_block, n_block)
        if const_expr(self.two_direction):
            # Loads of this block's descales while the GEMMs run (latency off the critical path).
            dk = self.key_descales(scales, n_block, tScS_rc)
            # D256: 64 ratios held through the SiLU spill (340 bytes); they are loaded late there.
            if const_expr(not advance_v and self.head_dim <= 128):
                v_ratios = self.v_column_ratios(tOcO_rc, scales, n_prev, n_block)
        self.wait_v_rows(pipe_v, v_state, sV, self.zero_copy_v, tidx, wg, v_rows, peeks)
        wgmma(self.tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, v_state.index], False, -1)
        self.sched_signal(wg)
        next_peeks = None
        if const_expr(peeks is not None):
            k_next, v_next = advanced(k_state), advanced(v_state)
            next_peeks = (pipe_k.sync_object_full.test_wait(k_next.index, k_next.phase),
                          pipe_v.sync_object_full.test_wait(v_next.index, v_next.phase))
        warpgroup.wait_group(1)
        pipe_k.consumer_release(k_state)
        if const_expr(self.fp8):
            # The next P's words while P.V runs; into the operand registers once it is done.
            words, rescale = self.fp8_p_words(acc_S, tSsRab, tScS_rc, pipe_rab, k_state, alpha, seq, m_block,
                                              n_block, row_first, scales, p_scale, advance_v, dk)
            warpgroup.wait_group(0)
            pipe_v.consumer_release(v_state)
            if const_expr(advance_v):
                v_state = advanced(v_state)
            if const_expr(self.scaled_p and not advance_v):
                rescale_rows_if_needed(acc_O, rescale)
                if const_expr(self.two_direction):
                    self.rescale_v_columns(acc_O, v_ratios, tOcO_rc, scales, n_prev, n_block)
            words_to_operand_a(words, tOrP)
            if const_expr(peeks is not None):
                return v_state, next_peeks
            return v_state
        rP = self.scores_to_p_deferred(acc_S, tSsRab, tScS_rc, pipe_rab, k_state, alpha, self.mask, seq, m_block,
                                       n_block, row_first, mixed)
        warpgroup.wait_group(0)
        pipe_v.consumer_release(v_state)
        if const_expr(advance_v):
            v_state = advanced(v_state)
        if const_expr(self.operand_fence):
            wgmma_replace_operand_a(tOrP, rP)
        else:
            tOrP.store(rP.load())
        return v_state

    @cute.jit
    def last_pv(self, pipe_v, v_state, sV, zero_copy_v, tidx: Int32, wg: Int32, v_rows: Int32, acc_O, tOrP, tOrVt):
        """The P.V of the pending block alone (nothing to overlap it with); returns the V state."""
        self.wait_v_rows(pipe_v, v_state, sV, zero_copy_v, tidx, wg, lambda: v_rows)
        wgmma(self.tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, v_state.index], False, 0)
        pipe_v.consumer_release(v_state)
        return advanced(v_state)

    def store_tile(self, acc_O, mO, thr_mma_pv, tOcO_rc, inv_scale, head, q_start, m_block, seqlen_q, p_scale=None,
                   last_block=None):
        """Epilogue (plain Python: the choice is static): :meth:`store_output`, or with split keys
        :meth:`store_split_tile`, ``last_block`` then being (batch, part)."""
        if const_expr(self.split_keys):
            self.store_split_tile(acc_O, mO, thr_mma_pv, tOcO_rc, inv_scale, head, q_start, m_block, seqlen_q,
                                  last_block[0], last_block[1])
        else:
            self.store_output(acc_O, mO, thr_mma_pv, tOcO_rc, inv_scale, head, q_start, m_block, seqlen_q, p_scale,
                              last_block)

    @cute.jit
    def store_output(self, acc_O, mO, thr_mma_pv, tOcO_rc, inv_scale: Float32, head: Int32, q_start: Int32,
                     m_block: Int32, seqlen_q: Int32, p_scale=None, last_block=None):
        """O * (1/S) -> the output dtype, rows past seqlen_q skipped: through the staged epilogue
        where there is one (a warpgroup's tile cut at the sequence's end copied out by its threads,
        one store path: both paths in one loop cost the FP8 D128 loop 36 SASS instructions), else
        from registers (:meth:`store_output_rows`); scaled P: each row times its final P scale first (``acc_O`` is
        overwritten; None for a tile without keys: its zeros); two_direction: each column times
        the V descale of the tile's last key block (``last_block``: (batch, n_block))."""
        if const_expr(p_scale is not None):
            scale_rows(acc_O, p_scale)
            if const_expr(self.two_direction):
                batch, n_last = last_block
                mDescaleV = self.descales[2]
                block = self.v_descale_block(n_last)
                # Each column's load beside its multiplies (as measured; loading all first is
                # a different schedule).
                rc = cute.make_tensor(acc_O.iterator, wgmma_acc_rows_cols(acc_O.layout))
                for j in cutlass.range_constexpr(cute.size(rc.shape[1])):
                    dv = mDescaleV[batch, block, head, 0, tOcO_rc[0, j][1]]
                    for i in cutlass.range_constexpr(cute.size(rc.shape[0])):
                        rc[i, j] = rc[i, j] * dv
        rows = seqlen_q - m_block * self.tile_m
        if const_expr(self.epilogue is not None):
            tid_in_wg = (cute.arch.thread_idx()[0] - 128) % 128
            wg = cute.arch.make_warp_uniform((cute.arch.thread_idx()[0] - 128) // 128)
            acc_O.store(acc_O.load() * inv_scale)
            store_rows_staged((acc_O,), *self.epilogue, self.out_dtype, tid_in_wg, wg,
                              q_start + m_block * self.tile_m + wg * 64, head, rows=rows - wg * 64, outputs=(mO,))
        else:
            self.store_output_rows(acc_O, mO, thr_mma_pv, tOcO_rc, inv_scale, head, q_start, m_block, rows)

    @cute.jit
    def store_output_rows(self, acc_O, mO, thr_mma_pv, tOcO_rc, inv_scale: Float32, head: Int32, q_start: Int32,
                          m_block: Int32, rows: Int32):
        """O * (1/S) from registers, two columns per store, the tile's rows past ``rows`` skipped."""
        rO = cute.make_rmem_tensor(acc_O.layout, self.out_dtype)
        rO.store((acc_O.load() * inv_scale).to(self.out_dtype))
        gO = cute.local_tile(cute.domain_offset((q_start, 0), mO[None, head, None]), (self.tile_m, self.head_dim),
                             (m_block, 0))
        copy_acc_rows(rO, thr_mma_pv.partition_C(gO), tOcO_rc, rows)

    @cute.jit
    def store_split_tile(self, acc_O, mO, thr_mma_pv, tOcO_rc, inv_scale: Float32, head: Int32, q_start: Int32,
                         m_block: Int32, seqlen_q: Int32, batch: Int32, part: Int32):
        """Split keys: store this part's fp32 output (times 1/S) to its slab of the partials, then
        count the warpgroup's arrival for its 64 rows of the tile (release: every thread's stores
        are fenced first); the warpgroup that arrives last adds the parts up in part order (the
        sum is the same whichever part ends last) and stores the output, then zeroes the count
        for the next launch."""
        tid_in_wg = (cute.arch.thread_idx()[0] - 128) % 128
        wg = cute.arch.make_warp_uniform((cute.arch.thread_idx()[0] - 128) // 128)
        # No attribute of self inside the runtime branches and loop below.
        sArrived, mArrivals, num_splits = self.sArrived, self.mArrivals, self.num_splits
        partials = self.mPartials[None, head, None]
        part_rows, tile_shape, out_dtype = self.part_rows, (self.tile_m, self.head_dim), self.out_dtype
        rows = seqlen_q - m_block * self.tile_m
        mine = cute.make_rmem_tensor(acc_O.layout, Float32)
        mine.store(acc_O.load() * inv_scale)
        tPgP = thr_mma_pv.partition_C(cute.local_tile(cute.domain_offset((q_start + part * part_rows, 0), partials),
                                                      tile_shape, (m_block, 0)))
        copy_acc_rows(mine, tPgP, tOcO_rc, rows)
        cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier(barrier_id=NamedBarrier.SPLIT_WG0 + wg, number_of_threads=128)
        slot = ((batch * self.heads + head) * self.m_blocks + m_block) * 2 + wg
        if tid_in_wg == 0:
            sArrived[wg] = cute.arch.atomic_add(mArrivals.iterator + slot, Int32(1), sem="acq_rel", scope="gpu")
        cute.arch.barrier(barrier_id=NamedBarrier.SPLIT_WG0 + wg, number_of_threads=128)
        if sArrived[wg] == num_splits - 1:
            cute.arch.fence_acq_rel_gpu()
            # Every part from memory, its own too (the same values, and no registers held for
            # them): two parts' loads in flight at a time where registers allow.
            total = cute.make_rmem_tensor(acc_O.layout, Float32)
            total.fill(0.0)
            for p in cutlass.range(num_splits, unroll=2 if const_expr(self.head_dim <= 128) else 1):
                theirs = cute.make_rmem_tensor(acc_O.layout, Float32)
                tPgP = thr_mma_pv.partition_C(cute.local_tile(
                    cute.domain_offset((q_start + p * part_rows, 0), partials), tile_shape, (m_block, 0)))
                copy_acc_rows(tPgP, theirs, tOcO_rc, rows)
                total.store(total.load() + theirs.load())
            rO = cute.make_rmem_tensor(acc_O.layout, out_dtype)
            rO.store(total.load().to(out_dtype))
            gO = cute.local_tile(cute.domain_offset((q_start, 0), mO[None, head, None]), tile_shape, (m_block, 0))
            copy_acc_rows(rO, thr_mma_pv.partition_C(gO), tOcO_rc, rows)
            if tid_in_wg == 0:
                mArrivals[slot] = Int32(0)

    @cute.jit
    def wait_v_rows(self, pipe_v, v_state, sV, zero_copy_v, tidx: Int32, wg: Int32, v_rows, peek=None):
        """Wait for a V block; if it crosses seqlen_k (``v_rows()``: its rows inside the sequence,
        read after the wait), zero its rows past the end so that P = 0 there multiplies finite
        values (TMA reads the next sequence's rows there, and 0 * NaN would be NaN)."""
        pipe_v.consumer_wait(v_state, peek)
        row_limit = v_rows()
        if row_limit < self.tile_n:
            if const_expr(self.fp8):
                zero_smem_cols_past(zero_copy_v, sV[None, None, v_state.index], (self.head_dim, self.tile_n),
                                    tidx % 128, wg, row_limit)
            else:
                zero_smem_rows_past(zero_copy_v, (sV[None, None, v_state.index],), (self.tile_n, self.head_dim),
                                    tidx % 128, wg, row_limit)

    @cute.jit
    def sched_wait(self, wg: Int32):
        if const_expr(self.pingpong):
            cute.arch.barrier(barrier_id=NamedBarrier.SCHED_WG0 + wg, number_of_threads=256)

    @cute.jit
    def sched_signal(self, wg: Int32):
        if const_expr(self.pingpong):
            cute.arch.barrier_arrive(barrier_id=NamedBarrier.SCHED_WG0 + 1 - wg, number_of_threads=256)

    @cute.jit
    def add_rab_silu_mask(self, acc_S, tSsRab, tScS_rc, pipe_rab, k_state, alpha: Float32, spec: cutlass.Constexpr,
                          seq, m_block: Int32, n_block: Int32, row_first: Int32, qk_descale=None, mixed=None):
        if const_expr(self.has_rab):
            pipe_rab.consumer_wait(k_state)
            rRab = cute.make_rmem_tensor(acc_S.layout, self.rab_dtype)
            cute.autovec_copy(tSsRab[None, None, None, k_state.index], rRab)
            pipe_rab.consumer_release(k_state)
            if const_expr(self.fp8):
                acc_S.store(acc_S.load() * qk_descale + rRab.load().to(Float32))
            else:
                acc_S.store(acc_S.load() + rRab.load().to(Float32))
        if const_expr(not self.fp8 or self.early_silu):
            silu_scaled_inplace(acc_S, alpha, self.fast_silu)
        # Otherwise FP8 runs the SiLU in the packing (common.fp8.silu_to_fp8_words,
        # silu_to_scaled_fp8_words), after the mask: masked scores become 0, and silu(0) = 0.
        acc_rc = cute.make_tensor(acc_S.iterator, wgmma_acc_rows_cols(acc_S.layout))
        if not masks.tile_is_full(spec, seq, m_block, n_block, self.tile_m, self.tile_n, KERNEL_OPS):
            apply_mask_rows_cols(acc_rc, tScS_rc, spec, seq, row_first, n_block * self.tile_n)
        mask_dropped_blocks((acc_rc,), tScS_rc, seq, m_block, n_block, row_first, n_block * self.tile_n, mixed=mixed,
                            rows_cols=self.tile_n)

    @cute.jit
    def scores_to_p(self, acc_S, tOrP, tSsRab, tScS_rc, pipe_rab, k_state, alpha, spec: cutlass.Constexpr, seq,
                    m_block, n_block, row_first, scales, p_scale):
        """A tile's first P (nothing in flight), into the operand registers."""
        if const_expr(self.fp8):
            words, _ = self.fp8_p_words(acc_S, tSsRab, tScS_rc, pipe_rab, k_state, alpha, seq, m_block, n_block,
                                        row_first, scales, p_scale, True)
            words_to_operand_a(words, tOrP)
        else:
            self.add_rab_silu_mask(acc_S, tSsRab, tScS_rc, pipe_rab, k_state, alpha, spec, seq, m_block, n_block,
                                   row_first)
            tOrP.store(cute.make_tensor(acc_S.iterator, wgmma_acc_as_operand_a(acc_S.layout)).load().to(self.dtype))

    @cute.jit
    def fp8_p_words(self, acc_S, tSsRab, tScS_rc, pipe_rab, k_state, alpha: Float32, seq, m_block: Int32,
                    n_block: Int32, row_first: Int32, scales, p_scale, first: cutlass.Constexpr[bool], dk=None):
        """(e4m3 words of this block's P in operand order, the output rows' rescale or None).
        Scaled P: the block's descales (:meth:`block_descales`) enter the scores and P's
        multiplier; ``first``: the tile's first block, its rows' scale starts afresh; ``dk``:
        two_direction, the block's :meth:`key_descales` if loaded already."""
        if const_expr(self.scaled_p):
            if const_expr(self.two_direction):
                # dq and dk enter the scores here, dv the output's columns (rescale_v_columns).
                if const_expr(dk is None):
                    dk = self.key_descales(scales, n_block, tScS_rc)
                self.scale_scores_by_tokens(acc_S, dk, scales)
                qk_descale, dv = Float32(1.0), Float32(1.0)
            else:
                qk_descale, dv = self.block_descales(scales, n_block)
            self.add_rab_silu_mask(acc_S, tSsRab, tScS_rc, pipe_rab, k_state, alpha, self.mask, seq, m_block,
                                   n_block, row_first, qk_descale)
            half_alpha = alpha * Float32(0.5) if const_expr(self.has_rab) else alpha * qk_descale * Float32(0.5)
            if const_expr(first):
                p_scale.fill(0.0)
            rescale = cute.make_rmem_tensor(cute.make_layout(2), Float32)
            return silu_to_scaled_fp8_words(acc_S, half_alpha, dv, p_scale, rescale), rescale
        qk_descale = self.qk_descale if const_expr(self.has_rab) else None
        self.add_rab_silu_mask(acc_S, tSsRab, tScS_rc, pipe_rab, k_state, alpha, self.mask, seq, m_block, n_block,
                               row_first, qk_descale)
        if const_expr(self.early_silu):
            return fp8_words(acc_S), None
        return silu_to_fp8_words(acc_S, alpha * Float32(0.5)), None

    @cute.jit
    def tile_descales(self, batch: Int32, head: Int32, m_block: Int32, q_start: Int32, k_start: Int32, seq,
                      tScS_rc):
        """Scaled P: (batch, head, q descale of this query tile), else None. two_direction:
        (batch, head, q descales of the thread's two rows, the sequence's first and last key
        tokens); token indices are clamped into the sequence (rows past it are never stored,
        keys past it are masked)."""
        if const_expr(not self.scaled_p):
            return None
        mDescaleQ = self.descales[0]
        if const_expr(self.two_direction):
            q_last = q_start + seq.seqlen_q - 1
            row0 = q_start + m_block * self.tile_m
            dq0 = mDescaleQ[cutlass.min(row0 + tScS_rc[0, 0][0], q_last), head]
            dq1 = mDescaleQ[cutlass.min(row0 + tScS_rc[1, 0][0], q_last), head]
            return batch, head, dq0, dq1, k_start, k_start + seq.seqlen_k - 1
        block = cutlass.min(m_block * self.tile_m // BLOCK_TOKENS, mDescaleQ.shape[1] - 1)
        return batch, head, mDescaleQ[batch, block, head]

    @cute.jit
    def block_descales(self, scales, n_block: Int32):
        """(q descale x k descale, v descale) of key block ``n_block`` of a tile (``scales``:
        :meth:`tile_descales`); the block index is clamped into the tables."""
        batch, head, dq = scales
        mDescaleK, mDescaleV = self.descales[1], self.descales[2]
        block = cutlass.min(n_block * self.tile_n // BLOCK_TOKENS, mDescaleK.shape[1] - 1)
        return dq * mDescaleK[batch, block, head], mDescaleV[batch, block, head]

    @cute.jit
    def key_descales(self, scales, n_block: Int32, tScS_rc):
        """two_direction: the k descales (per token) of the thread's score columns in block
        ``n_block``, (tile_n / 4,) fp32."""
        _, head, _, _, k_start, k_last = scales
        mDescaleK = self.descales[1]
        key0 = k_start + n_block * self.tile_n
        dk = cute.make_rmem_tensor(cute.make_layout(cute.size(tScS_rc.shape[1])), Float32)
        for j in cutlass.range_constexpr(cute.size(dk)):
            dk[j] = mDescaleK[cutlass.min(key0 + tScS_rc[0, j][1], k_last), head]
        return dk

    @cute.jit
    def scale_scores_by_tokens(self, acc_S, dk, scales):
        """two_direction: scores[r, c] *= dq[r] dk[c] (per-token descales: :meth:`tile_descales`,
        :meth:`key_descales`)."""
        dq0, dq1 = scales[2], scales[3]
        rc = cute.make_tensor(acc_S.iterator, wgmma_acc_rows_cols(acc_S.layout))
        for j in cutlass.range_constexpr(cute.size(rc.shape[1])):
            rc[0, j] = rc[0, j] * (dk[j] * dq0)
            rc[1, j] = rc[1, j] * (dk[j] * dq1)

    @cute.jit
    def v_descale_block(self, n_block: Int32):
        """The V descale table's block of key block ``n_block`` (clamped into the table)."""
        return cutlass.min(n_block * self.tile_n // BLOCK_TOKENS, self.descales[2].shape[1] - 1)

    @cute.jit
    def v_column_ratios(self, tOcO_rc, scales, n_prev: Int32, n_block: Int32):
        """two_direction: the output accumulates in units of the current key block's V descales
        (per dim); moving from ``n_prev``'s block to ``n_block``'s, each of the thread's columns
        takes dv_prev * (1 / dv_new), (D / 4,) fp32 (loaded and computed before they are needed,
        see :meth:`rescale_v_columns`)."""
        batch, head = scales[0], scales[1]
        mDescaleV = self.descales[2]
        return dim_descales(mDescaleV[batch, self.v_descale_block(n_prev), head, 0, None], tOcO_rc,
                            mDescaleV[batch, self.v_descale_block(n_block), head, 1, None])

    def ratios_or_load(self, ratios, tOcO_rc, scales, n_prev, n_block):
        # Plain Python (traced inline): the DSL's preprocessing would turn the choice into a
        # runtime select.
        return self.v_column_ratios(tOcO_rc, scales, n_prev, n_block) if ratios is None else ratios

    @cute.jit
    def rescale_v_columns(self, acc_O, ratios, tOcO_rc, scales, n_prev: Int32, n_block: Int32):
        """two_direction: the output's columns times :meth:`v_column_ratios` (None: computed here)
        when the key block moves to another V descale block (after the previous P.V is complete,
        before the next one is issued)."""
        if self.v_descale_block(n_prev) != self.v_descale_block(n_block):
            scale_columns(acc_O, self.ratios_or_load(ratios, tOcO_rc, scales, n_prev, n_block))

    @cute.jit
    def scores_to_p_deferred(self, acc_S, tSsRab, tScS_rc, pipe_rab, k_state, alpha, spec: cutlass.Constexpr, seq,
                             m_block, n_block, row_first, mixed=None):
        """Like :meth:`scores_to_p` but into a fresh register tile: the previous P is still being
        read by the in-flight P.V WGMMA. ``mixed``: the block-sparse flag, loaded ahead."""
        self.add_rab_silu_mask(acc_S, tSsRab, tScS_rc, pipe_rab, k_state, alpha, spec, seq, m_block, n_block,
                               row_first, mixed=mixed)
        acc_A = cute.make_tensor(acc_S.iterator, wgmma_acc_as_operand_a(acc_S.layout))
        rP = cute.make_rmem_tensor(acc_A.layout, self.dtype)
        rP.store(acc_A.load().to(self.dtype))
        return rP



class HstuForwardFp8Sm90(HstuForwardSm90):
    """The forward with e4m3 q, k and V^T (8-bit WGMMA, instruction K 32), a 16-bit output (and
    rab), and scalar descales: scores = (q8 . k8) dq dk, P cast to e4m3 (saturating), out =
    (P8 . v8) dv / S (docs/operator.md, FP8). The same warp roles, pipelines and barriers as
    :class:`HstuForwardSm90`, except that:

    * V arrives as its token-contiguous copy V^T (H, D, W) (hopper.vt.VTransposeSm90): an 8-bit
      WGMMA reads both smem operands K-major only, and P.V reduces over keys. Each sequence's keys
      start 16-token aligned there (fp8_format.vt_column_start): a TMA box must start 16-byte
      aligned along the contiguous dimension (an unaligned start is an illegal instruction);
    * P is packed from the score accumulator into the 8-bit register operand with no data
      movement, V^T's keys being stored in that order (common.fp8.silu_to_fp8_words,
      words_to_operand_a; fp8_format.KEY_AT_COLUMN); with scaled P (quant modes >= 1) each row's
      running power-of-two scale enters the packing (common.fp8.silu_to_scaled_fp8_words); with
      ``two_direction`` (quant mode 1) the per-token q and k descales scale the scores and the
      per-(block, dim) V descales the output's columns;
    * past seqlen_k the V^T tile's key columns are zeroed, not V's rows."""

    @cute.jit
    def __call__(self, mQ, mK, mV, mO, mOffsetsQ, mOffsetsK, mSeqUsedQ, mSeqUsedK, mNumContexts, mNumTargets, mFunc, mFuncBlocks, mRab,
                 alpha, inv_scale, window_left, window_right, group_size, is_delta_q, num_m_blocks, num_sms,
                 bh_per_section, mTileCounter, mDescaleQ, mDescaleK, mDescaleV, stream):
        self.compile_forward(mQ, mK, mV, mO, SequenceArgs(mOffsetsQ, mOffsetsK, mSeqUsedQ, mSeqUsedK, mNumContexts,
                                                          mNumTargets, mFunc, mFuncBlocks), mRab,
                             ScoreScalars(alpha, inv_scale, window_left, window_right, group_size, is_delta_q),
                             num_m_blocks, num_sms, bh_per_section, mTileCounter, (mDescaleQ, mDescaleK, mDescaleV),
                             stream)
