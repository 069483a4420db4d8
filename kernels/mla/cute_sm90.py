"""Absorbed-MLA multi-token verify attention for Hopper (sm_90a) in CuTe DSL: TMA + WGMMA.

Design (docs/kernels.md §2, §7 row 6; docs/kimi-k3.md §3 absorbed form;
measurements: experiments/notes/mla.md):
- One CTA = 64 query rows (heads x tokens of one request, rows r = j*H + h) x one KV split.
  Grid (row tiles, splits, B). Two math warpgroups split O by columns (256 each, 128 fp32
  registers per thread) + a TMA producer warp.
- Shared memory (~226 KB, 1 CTA/SM): Q 64 x 576 (loaded once), 2 pipeline stages of 64 cache
  rows x 576 (c_kv and k_pe parts in separate buffers), P 64 x 64 bf16, row statistics.
- The producer streams cache tiles with TMA (9 boxes of 64 x 64 per tile) into an mbarrier
  pipeline (PipelineTmaAsync); the cache is a [slots, max_len, 576] TMA tensor with the slot as a
  coordinate, so rows past max_len are zero-filled (and masked).
- V is the c_kv part of the same tile: a 64-dim block of 64 rows x 128 bytes (128B swizzle) is
  both the K-major K of Q.K^T and the MN-major V of P.V, so each tile is loaded once.
- Default (`qk_one_warpgroup`, the fastest measured on the H200): warpgroup 0 computes S = Q.K^T
  (m64n64k16 over 576) and the online softmax (fp32, log2 domain), writes P (bf16) and the per-row
  rescale factors to smem and signals warpgroup 1 (bar.arrive / bar.sync); both then do
  O_half += P.V_half (m64n256k16). Warpgroup 0 lets its P.V run into the next Q.K^T (one wait
  covers both). Needs the producer warpgroup (384 threads) so that setmaxnreg gives the math
  warpgroups 240 registers. Reason for one S warpgroup: Q.K^T split over both warpgroups
  (`qk_one_warpgroup=False`, m64n32k16 each, row maxima exchanged through smem) reads 1.5x the
  shared-memory bandwidth the tensor cores' rate allows; it was 1.2-1.4x slower on the H200.
- Options: `producer_warpgroup` (for the split-S variant), `l2_prefetch` (TMA prefetch of cache
  tiles into L2 ahead of the two stages), `cluster_pairs` (two row tiles in a cluster, each CTA
  loads half of every cache tile with TMA multicast into both: half the L2->SM traffic).
- The bottom-right causal mask (query j sees rows < cache_lens[b] + j + 1) is applied only to
  tiles that reach past the first query's limit (the last one or two tiles).
- Split-KV: each split covers a contiguous range of 64-row KV tiles of [0, keys this row tile
  needs); with several splits it writes O/l (fp32) and the log2-sum-exp per row, and the
  combine kernel (below, PDL-launched) merges them; with one split the kernel writes bf16
  output directly (zeros for padding queries).

Not done: softmax(t) is not overlapped with Q.K^T(t+1) (FA3 / FlashMLA "seesaw"; two stages of
64 x 576 leave no room), no persistent scheduling.
"""# No `from __future__ import annotations`: CuTe DSL evaluates the kernels' annotations at trace time.

import math
from types import SimpleNamespace

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.tensor_utils as tensor_utils
import cutlass.utils.hopper_helpers as sm90_utils
import torch
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warp, warpgroup
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from .. import cute_common
from ..cute_pipelines import deferred_pipeline
from . import cute_host as mla_common
from .cute_host import COMBINE_THREADS, COMBINE_UNROLL, HEAD_DIM, KV_TILE, LATENT, ROPE, ROWS_PER_TILE

K_BLOCK = 64  # 64 bf16 = 128 bytes: one 128B-swizzle row; 576 = 9 blocks (8 of c_kv, 1 of k_pe)
LATENT_BLOCKS = LATENT // K_BLOCK
STAGES = 2
MATH_WARPGROUPS = 2
PRODUCER_WARP = 4 * MATH_WARPGROUPS  # warp index of the TMA producer
# With producer_warpgroup the producer warp comes with three idle warps (a whole warpgroup), so
# setmaxnreg can move registers to the math warpgroups (whose O accumulators alone take 128).
PRODUCER_REGS, MATH_REGS = 24, 240
DEFAULT_PRODUCER_WARPGROUP = False
DEFAULT_QK_ONE_WARPGROUP = True  # the fastest variant at every shape on the H200 (experiments/notes/mla.md)
DEFAULT_L2_PREFETCH = False
DEFAULT_CLUSTER_PAIRS = False
# split-KV partial outputs O/l: bf16 halves the partials' write + combine read traffic
DEFAULT_PARTIAL_DTYPE = torch.float32
L2_PREFETCH_AHEAD = 4  # KV tiles
S_COLS = KV_TILE // MATH_WARPGROUPS  # S columns (cache rows) per warpgroup
O_COLS = LATENT // MATH_WARPGROUPS  # output columns per warpgroup
LOG2E = 1.4426950408889634
# Named barriers (0 is __syncthreads): row-max exchange and P-complete, both math warpgroups.
BAR_ROW_MAX, BAR_P_READY, BAR_ROW_SUM = 1, 2, 3
BAR_P_FREE = BAR_ROW_MAX  # qk_one_warpgroup: warpgroup 1 is done with P (no row-max exchange there)
BF16 = cutlass.BFloat16
NEG_INF = -math.inf


def smem_layouts():
    """Shared-memory layouts (call inside a CuTe DSL trace), all 128B-swizzled 64-column blocks:
    Q (64, 64, 9 blocks), K (64 keys, 64, 8 c_kv blocks x stages), k_pe (64, 64, stages),
    V = the c_kv bytes of K read MN-major (512 dims, 64 keys, stages), P (64, 64, 1)."""
    row_major, col_major = tensor_utils.LayoutEnum.ROW_MAJOR, tensor_utils.LayoutEnum.COL_MAJOR
    block_tile = (ROWS_PER_TILE, KV_TILE, K_BLOCK)
    q_layout = sm90_utils.make_smem_layout_a(row_major, block_tile, BF16, LATENT_BLOCKS + 1)
    k_layout = sm90_utils.make_smem_layout_b(row_major, block_tile, BF16, LATENT_BLOCKS * STAGES)
    kpe_layout = sm90_utils.make_smem_layout_b(row_major, block_tile, BF16, STAGES)
    v_layout = sm90_utils.make_smem_layout_b(col_major, (ROWS_PER_TILE, LATENT, KV_TILE), BF16, STAGES)
    p_layout = sm90_utils.make_smem_layout_a(row_major, (ROWS_PER_TILE, O_COLS, KV_TILE), BF16, 1)
    return q_layout, k_layout, kpe_layout, v_layout, p_layout


class MlaVerifySm90:
    """One compiled instance per (heads, single or split-KV, index dtype); B, T, the number of
    splits, cache slots and max_len are runtime values."""

    def __init__(self, heads: int, split_kv: bool, warp_mma: bool = False, producer_warpgroup: bool = False,
                 qk_one_warpgroup: bool = False, l2_prefetch: bool = False,
                 cluster_pairs: bool = False):
        # warp_mma: mma.sync m16n8k16 fed by ldmatrix instead of WGMMA (the Blackwell build,
        # cute_sm100.py: WGMMA does not exist there); everything else is shared.
        self.heads, self.split_kv, self.warp_mma = heads, split_kv, warp_mma
        # qk_one_warpgroup: warpgroup 0 computes all of S (WGMMA m64n64k16, full rate for
        # shared memory; m64n32 needs 1.5x its bandwidth) and the softmax, hands P and the
        # rescale factors to warpgroup 1 through shared memory, and both do P.V on their
        # halves of O. No row-max exchange; needs the producer warpgroup's registers.
        self.qk_one_warpgroup = qk_one_warpgroup and not warp_mma
        self.producer_warpgroup = producer_warpgroup or self.qk_one_warpgroup
        # l2_prefetch: the producer also issues TMA prefetches (cp.async.bulk.prefetch.tensor)
        # of the cache tiles L2_PREFETCH_AHEAD ahead, so the stage loads hit L2.
        self.l2_prefetch = l2_prefetch
        # cluster_pairs: two CTAs (adjacent row tiles, same KV split) form a cluster and each
        # loads half of every cache tile with TMA multicast into both: half the L2->SM
        # traffic (~5 TB/s in the steady state of the unpaired kernel on the H200).
        self.cluster = 2 if cluster_pairs else 1
        self.threads = 128 * MATH_WARPGROUPS + (128 if self.producer_warpgroup else 32)

    # ---------------------------------------------------------------- host side
    @cute.jit
    def __call__(
        self,
        q_latent: cute.Tensor,
        q_pe: cute.Tensor,
        kv_cache: cute.Tensor,
        slots: cute.Tensor,
        cache_lens: cute.Tensor,
        lengths: cute.Tensor,
        out: cute.Tensor,
        o_partial: cute.Tensor,
        lse_partial: cute.Tensor,
        scale_log2: cutlass.Float32,
        splits: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        batch, tokens = q_latent.shape[0], q_latent.shape[1]
        rows = tokens * self.heads
        max_len, num_slots = kv_cache.shape[1], kv_cache.shape[0]
        # (rows, dims, batch) views: TMA zero-fills rows past T*H and past max_len.
        mQl = cute.make_tensor(q_latent.iterator, cute.make_layout((rows, LATENT, batch), stride=(LATENT, 1, rows * LATENT)))
        mQp = cute.make_tensor(q_pe.iterator, cute.make_layout((rows, ROPE, batch), stride=(ROPE, 1, rows * ROPE)))
        mKV = cute.make_tensor(
            kv_cache.iterator, cute.make_layout((max_len, HEAD_DIM, num_slots), stride=(HEAD_DIM, 1, max_len * HEAD_DIM))
        )
        mO = cute.make_tensor(out.iterator, cute.make_layout((rows, LATENT, batch), stride=(LATENT, 1, rows * LATENT)))

        q_layout, k_layout, kpe_layout, v_layout, p_layout = smem_layouts()
        block_layout = cute.slice_(k_layout, (None, None, 0))
        tma_q, tma_mQl = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mQl, block_layout, (ROWS_PER_TILE, K_BLOCK))
        tma_qpe, tma_mQp = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mQp, block_layout, (ROWS_PER_TILE, K_BLOCK))
        if cutlass.const_expr(self.cluster > 1):
            tma_kv, tma_mKV = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SMulticastOp(), mKV, block_layout, (KV_TILE, K_BLOCK),
                num_multicast=self.cluster,
            )
        else:
            tma_kv, tma_mKV = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mKV, block_layout, (KV_TILE, K_BLOCK))

        if cutlass.const_expr(self.warp_mma):
            # 4 warps x m16 rows = the same 64-row tile per warpgroup
            warp_atom = warp.MmaF16BF16Op(BF16, cutlass.Float32, (16, 8, 16))
            mma_qk = cute.make_tiled_mma(warp_atom, (4, 1, 1), permutation_mnk=(ROWS_PER_TILE, 16, 16))
            mma_pv = cute.make_tiled_mma(warp_atom, (4, 1, 1), permutation_mnk=(ROWS_PER_TILE, 16, 16))
        else:
            mma_qk = sm90_utils.make_trivial_tiled_mma(
                BF16, BF16, OperandMajorMode.K, OperandMajorMode.K, cutlass.Float32, (1, 1, 1),
                tiler_mn=(ROWS_PER_TILE, KV_TILE if self.qk_one_warpgroup else S_COLS),
            )
            mma_pv = sm90_utils.make_trivial_tiled_mma(
                BF16, BF16, OperandMajorMode.K, OperandMajorMode.MN, cutlass.Float32, (1, 1, 1),
                tiler_mn=(ROWS_PER_TILE, O_COLS),
            )

        @cute.struct
        class SharedStorage:
            kv_barriers: cute.struct.MemRange[cutlass.Int64, STAGES * 2]
            q_barriers: cute.struct.MemRange[cutlass.Int64, 2]
            row_max: cute.struct.MemRange[cutlass.Float32, MATH_WARPGROUPS * ROWS_PER_TILE]
            row_sum: cute.struct.MemRange[cutlass.Float32, MATH_WARPGROUPS * ROWS_PER_TILE]
            sQ: cute.struct.Align[cute.struct.MemRange[BF16, cute.cosize(q_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[BF16, cute.cosize(k_layout)], 1024]
            sKpe: cute.struct.Align[cute.struct.MemRange[BF16, cute.cosize(kpe_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[BF16, cute.cosize(p_layout)], 1024]

        self.shared_storage = SharedStorage
        # row tiles rounded up to whole clusters (an extra tile has no rows: never stored)
        grid = (cute.ceil_div(rows, ROWS_PER_TILE * self.cluster) * self.cluster, splits, batch)
        kernel = self.kernel(
            tma_q, tma_mQl, tma_qpe, tma_mQp, tma_kv, tma_mKV, mO, o_partial, lse_partial,
            slots, cache_lens, lengths, rows, splits, scale_log2, mma_qk, mma_pv,
            q_layout, k_layout, kpe_layout, v_layout, p_layout,
        )
        if cutlass.const_expr(self.cluster > 1):
            kernel.launch(grid=grid, block=[self.threads, 1, 1], cluster=(self.cluster, 1, 1), stream=stream, use_pdl=True)
        else:
            kernel.launch(grid=grid, block=[self.threads, 1, 1], stream=stream, use_pdl=True)
        if cutlass.const_expr(self.split_kv):
            combine(o_partial, lse_partial, lengths, out, self.heads, stream)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(
        self,
        tma_q: cute.CopyAtom,
        mQl: cute.Tensor,
        tma_qpe: cute.CopyAtom,
        mQp: cute.Tensor,
        tma_kv: cute.CopyAtom,
        mKV: cute.Tensor,
        mO: cute.Tensor,
        o_partial: cute.Tensor,
        lse_partial: cute.Tensor,
        slots: cute.Tensor,
        cache_lens: cute.Tensor,
        lengths: cute.Tensor,
        rows: cutlass.Int32,
        splits: cutlass.Int32,
        scale_log2: cutlass.Float32,
        mma_qk: cute.TiledMma,
        mma_pv: cute.TiledMma,
        q_layout: cute.ComposedLayout,
        k_layout: cute.ComposedLayout,
        kpe_layout: cute.ComposedLayout,
        v_layout: cute.ComposedLayout,
        p_layout: cute.ComposedLayout,
    ):
        heads = self.heads
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        row_tile, split, b = cute.arch.block_idx()
        if warp_idx == PRODUCER_WARP:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_qpe)
            cpasync.prefetch_descriptor(tma_kv)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        block_bytes = KV_TILE * K_BLOCK * 2
        consumer_warps = 4 * MATH_WARPGROUPS
        # With cluster pairs a stage is free only when the consumers of both CTAs released
        # it (the partner's multicast writes into it): every consumer warp arrives on the
        # empty barrier of each CTA of the pair.
        cluster_vmnk = cute.make_layout((1, self.cluster, 1, 1))
        kv_pipe = deferred_pipeline(pipeline.PipelineTmaAsync, storage.kv_barriers, STAGES, consumer_warps * self.cluster,
                                    tx_count=(LATENT_BLOCKS + 1) * block_bytes, cta_layout=cluster_vmnk)
        q_pipe = deferred_pipeline(pipeline.PipelineTmaAsync, storage.q_barriers, 1, consumer_warps,
                                   tx_count=(LATENT_BLOCKS + 1) * block_bytes)
        pipeline.pipeline_init_arrive(cluster_shape_mn=(self.cluster, 1), is_relaxed=True)

        sQ = storage.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        sK = storage.sK.get_tensor(k_layout.outer, swizzle=k_layout.inner)
        sKpe = storage.sKpe.get_tensor(kpe_layout.outer, swizzle=kpe_layout.inner)
        sV = storage.sK.get_tensor(v_layout.outer, swizzle=v_layout.inner)
        sP = storage.sP.get_tensor(p_layout.outer, swizzle=p_layout.inner)
        row_max_xchg = storage.row_max.get_tensor(cute.make_layout((ROWS_PER_TILE, MATH_WARPGROUPS)))
        row_sum_xchg = storage.row_sum.get_tensor(cute.make_layout((ROWS_PER_TILE, MATH_WARPGROUPS)))

        # ---- which keys this CTA covers (runtime: per-request lengths live on the GPU)
        cute.arch.griddepcontrol_wait()  # q and the cache rows come from earlier kernels
        slot = slots[b].to(cutlass.Int32)
        cache_len = cache_lens[b].to(cutlass.Int32)
        num_tokens = lengths[b].to(cutlass.Int32)
        row0 = row_tile * ROWS_PER_TILE
        first_token = row0 // heads
        # the keys the cluster's row tiles need (both CTAs of a pair walk the same tiles)
        group_row0 = (row_tile // self.cluster) * self.cluster * ROWS_PER_TILE
        group_first_token = group_row0 // heads
        group_last_row = cutlass.min(group_row0 + self.cluster * ROWS_PER_TILE, rows) - 1
        last_token = cutlass.min(group_last_row // heads, num_tokens - 1)
        keys = cutlass.Int32(0)
        if group_first_token < num_tokens:
            keys = cache_len + last_token + 1
        kv_tiles = (keys + KV_TILE - 1) // KV_TILE
        per_split = (kv_tiles + splits - 1) // splits
        tile_begin = split * per_split
        tile_count = cutlass.max(cutlass.min(kv_tiles - tile_begin, per_split), 0)
        # tiles from here on reach past what the first query of the tile may see
        first_masked_tile = (cache_len + first_token + 1) // KV_TILE

        pipeline.pipeline_init_wait(cluster_shape_mn=(self.cluster, 1))
        if cutlass.const_expr(self.producer_warpgroup):
            if warp_idx >= PRODUCER_WARP:
                cute.arch.setmaxregister_decrease(PRODUCER_REGS)

        if warp_idx == PRODUCER_WARP:
            self.produce(tma_q, mQl, tma_qpe, mQp, tma_kv, mKV, sQ, sK, sKpe, q_pipe, kv_pipe, cluster_vmnk, row_tile, b,
                         slot, tile_begin, tile_count)

        if cutlass.const_expr(self.qk_one_warpgroup):
            if warp_idx < PRODUCER_WARP:
                self.math_qk_one_warpgroup(
                    mma_qk, mma_pv, sQ, sK, sKpe, sV, sP, row_max_xchg, row_sum_xchg, q_pipe, kv_pipe, mO,
                    o_partial, lse_partial, b, split, row_tile, row0, rows, cache_len, num_tokens, tile_begin,
                    tile_count, first_masked_tile, scale_log2,
                )
        if cutlass.const_expr(not self.qk_one_warpgroup):
            if warp_idx < PRODUCER_WARP:
                self.math_split_s(
                    tidx, warp_idx, mma_qk, mma_pv, sQ, sK, sKpe, sV, sP, row_max_xchg, row_sum_xchg, q_pipe, kv_pipe,
                    mO, o_partial, lse_partial, b, split, row_tile, row0, rows, cache_len, num_tokens, tile_begin,
                    tile_count, first_masked_tile, scale_log2,
                )

    @cute.jit
    def produce(self, tma_q, mQl, tma_qpe, mQp, tma_kv, mKV, sQ, sK, sKpe, q_pipe, kv_pipe, cluster_vmnk, row_tile, b,
                slot, tile_begin, tile_count):
        """The TMA producer warp: Q once, then the split's cache tiles."""
        gQl = cute.local_tile(mQl, (ROWS_PER_TILE, K_BLOCK), (row_tile, None, b))
        gQp = cute.local_tile(mQp, (ROWS_PER_TILE, K_BLOCK), (row_tile, None, b))
        gKV = cute.local_tile(mKV, (KV_TILE, K_BLOCK), (None, None, slot))
        tQs, tQg = cpasync.tma_partition(tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2), cute.group_modes(gQl, 0, 2))
        tQps, tQpg = cpasync.tma_partition(tma_qpe, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2), cute.group_modes(gQp, 0, 2))
        # with cluster pairs each CTA loads its half of every 64x64 box, multicast to both
        rank = row_tile % self.cluster
        cluster_layout = cute.make_layout(self.cluster)
        tKs, tKg = cpasync.tma_partition(tma_kv, rank, cluster_layout, cute.group_modes(sK, 0, 2), cute.group_modes(gKV, 0, 2))
        tKps, tKpg = cpasync.tma_partition(tma_kv, rank, cluster_layout, cute.group_modes(sKpe, 0, 2), cute.group_modes(gKV, 0, 2))
        mcast_mask = None
        if cutlass.const_expr(self.cluster > 1):
            mcast_mask = cpasync.create_tma_multicast_mask(cluster_vmnk, (0, rank, 0, 0), 1)

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        q_pipe.producer_acquire(q_state)
        for kb in cutlass.range_constexpr(LATENT_BLOCKS):
            cute.copy(tma_q, tQg[(None, kb)], tQs[(None, kb)], tma_bar_ptr=q_pipe.producer_get_barrier(q_state))
        cute.copy(tma_qpe, tQpg[(None, 0)], tQps[(None, LATENT_BLOCKS)], tma_bar_ptr=q_pipe.producer_get_barrier(q_state))

        if cutlass.const_expr(self.l2_prefetch):
            for ahead in cutlass.range_constexpr(1, L2_PREFETCH_AHEAD):
                if ahead < tile_count:
                    cute.prefetch(tma_kv, tKg[(None, tile_begin + ahead, None)])
        producer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES)
        for t in cutlass.range(tile_count, unroll=1):
            kv_pipe.producer_acquire(producer)
            tile = tile_begin + t
            barrier = kv_pipe.producer_get_barrier(producer)
            for kb in cutlass.range_constexpr(LATENT_BLOCKS):
                cute.copy(tma_kv, tKg[(None, tile, kb)], tKs[(None, producer.index * LATENT_BLOCKS + kb)],
                          tma_bar_ptr=barrier, mcast_mask=mcast_mask)
            cute.copy(tma_kv, tKpg[(None, tile, LATENT_BLOCKS)], tKps[(None, producer.index)], tma_bar_ptr=barrier,
                      mcast_mask=mcast_mask)
            if cutlass.const_expr(self.l2_prefetch):
                # two stages cannot cover the load latency: pull later tiles into L2
                if t + L2_PREFETCH_AHEAD < tile_count:
                    cute.prefetch(tma_kv, tKg[(None, tile + L2_PREFETCH_AHEAD, None)])
            producer.advance()
        kv_pipe.producer_tail(producer)

    @cute.jit
    def wgmma_qk(self, mma_qk, acc_s, tSrQ, tSrK, tSrKpe, stage):
        """Issue S += Q . K^T over the 576 dims (8 c_kv blocks and the k_pe block of `stage`) as one
        WGMMA group; the caller waits for it."""
        mma_qk.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.fence()
        for kb in cutlass.range_constexpr(LATENT_BLOCKS):
            for k in cutlass.range_constexpr(K_BLOCK // 16):
                cute.gemm(mma_qk, acc_s, tSrQ[(None, None, k, kb)], tSrK[(None, None, k, stage * LATENT_BLOCKS + kb)], acc_s)
        for k in cutlass.range_constexpr(K_BLOCK // 16):
            cute.gemm(mma_qk, acc_s, tSrQ[(None, None, k, LATENT_BLOCKS)], tSrKpe[(None, None, k, stage)], acc_s)
        warpgroup.commit_group()
        return mma_qk  # set() rebinds it: the caller's loop must carry it

    @cute.jit
    def wgmma_pv(self, mma_pv, acc_o, tOrP, tOrV, stage):
        """Issue O += P . V (V = the c_kv bytes of `stage`) as one WGMMA group; the caller waits."""
        mma_pv.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.fence()
        for k in cutlass.range_constexpr(KV_TILE // 16):
            cute.gemm(mma_pv, acc_o, tOrP[(None, None, k, 0)], tOrV[(None, None, k, stage)], acc_o)
        warpgroup.commit_group()
        return mma_pv

    @cute.jit
    def split_s_operands(self, mma_qk, mma_pv, thr_qk, thr_pv, sQ, sK_half, sKpe_half, sP, sV_half, wg_tidx):
        """The split-S structure's MMA operands: shared-memory descriptors for WGMMA; for mma.sync,
        register fragments and the ldmatrix copies that fill them."""
        ops = SimpleNamespace()
        if cutlass.const_expr(not self.warp_mma):
            # WGMMA reads both operands from shared memory through descriptors
            ops.tSrQ = mma_qk.make_fragment_A(thr_qk.partition_A(sQ))
            ops.tSrK = mma_qk.make_fragment_B(thr_qk.partition_B(sK_half))
            ops.tSrKpe = mma_qk.make_fragment_B(thr_qk.partition_B(sKpe_half))
            ops.tOrP = mma_pv.make_fragment_A(thr_pv.partition_A(sP))
            ops.tOrV = mma_pv.make_fragment_B(thr_pv.partition_B(sV_half))
        else:
            # mma.sync takes registers: one 64-dim block of Q and K at a time, all of P
            # and of this stage's V half, loaded with ldmatrix (.trans for MN-major V)
            ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), BF16)
            ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), BF16)
            ops.copy_q = cute.make_tiled_copy_A(ldsm, mma_qk)
            ops.copy_k = cute.make_tiled_copy_B(ldsm, mma_qk)
            ops.copy_p = cute.make_tiled_copy_A(ldsm, mma_pv)
            ops.copy_v = cute.make_tiled_copy_B(ldsm_t, mma_pv)
            thr_copy_q = ops.copy_q.get_slice(wg_tidx)
            thr_copy_k = ops.copy_k.get_slice(wg_tidx)
            thr_copy_p = ops.copy_p.get_slice(wg_tidx)
            thr_copy_v = ops.copy_v.get_slice(wg_tidx)
            ops.rQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ[(None, None, 0)]))
            ops.rK = thr_qk.make_fragment_B(thr_qk.partition_B(sK_half[(None, None, 0)]))
            ops.rP = thr_pv.make_fragment_A(thr_pv.partition_A(sP[(None, None, 0)]))
            ops.rV = thr_pv.make_fragment_B(thr_pv.partition_B(sV_half[(None, None, 0)]))
            ops.sQ_copy = thr_copy_q.partition_S(sQ)
            ops.sK_copy = thr_copy_k.partition_S(sK_half)
            ops.sKpe_copy = thr_copy_k.partition_S(sKpe_half)
            ops.sP_copy = thr_copy_p.partition_S(sP)
            ops.sV_copy = thr_copy_v.partition_S(sV_half)
            ops.rQ_copy = thr_copy_q.retile(ops.rQ)
            ops.rK_copy = thr_copy_k.retile(ops.rK)
            ops.rP_copy = thr_copy_p.retile(ops.rP)
            ops.rV_copy = thr_copy_v.retile(ops.rV)
        return ops

    # ---------------------------------------------------------------- online softmax (log2 domain)
    # The m64 accumulators (S and O) give a thread two rows: element i is in row-half (i // 2) % 2.
    @cute.jit
    def thread_row_max(self, acc_s):
        """Max of S over this thread's elements of each of its two rows."""
        tile_max = cute.make_rmem_tensor((2,), cutlass.Float32)
        for r in cutlass.range_constexpr(2):
            tile_max[r] = NEG_INF
        for i in cutlass.range_constexpr(cute.size(acc_s)):
            r = (i // 2) % 2
            tile_max[r] = cute.arch.fmax(tile_max[r], acc_s[i])
        return tile_max

    def quad_max(self, m):
        """Max over the 4 lanes that share a row."""
        m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=1))
        return cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=2))

    def quad_sum(self, s):
        """Sum over the 4 lanes that share a row."""
        s = s + cute.arch.shuffle_sync_bfly(s, offset=1)
        return s + cute.arch.shuffle_sync_bfly(s, offset=2)

    @cute.jit
    def share_rows(self, values, xchg, row_in_tile, wg, lane, barrier_id: cutlass.Constexpr, take_max: cutlass.Constexpr):
        """Reduce the thread's two row values over the 4 lanes that share each row (max or sum, in
        place), publish them in xchg for the other warpgroup, and wait until both warpgroups have."""
        for r in cutlass.range_constexpr(2):
            v = values[r]
            if cutlass.const_expr(take_max):
                v = self.quad_max(v)
            else:
                v = self.quad_sum(v)
            values[r] = v
            if lane % 4 == 0:
                xchg[row_in_tile[r], wg] = v
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=128 * MATH_WARPGROUPS)

    @cute.jit
    def rebase_row(self, r, new_max, row_max, row_sum, base, rescale):
        """Row r's new running max, the base exp2 subtracts and the factor its sum and O are
        rescaled by. A row that has seen no key yet keeps max -inf: subtract 0 instead, so
        exp2(-inf - base) = 0 and no NaN appears."""
        b_r = new_max
        if new_max == NEG_INF:
            b_r = cutlass.Float32(0.0)
        base[r] = b_r
        rescale[r] = cute.arch.exp2(row_max[r] - b_r)
        row_max[r] = new_max
        row_sum[r] = row_sum[r] * rescale[r]

    @cute.jit
    def exponentiate(self, acc_s, acc_o, base, rescale, row_sum):
        """S -> P = exp2(S - base) (summed into the rows), and O rescaled to the new maxima."""
        for i in cutlass.range_constexpr(cute.size(acc_s)):
            r = (i // 2) % 2
            p = cute.arch.exp2(acc_s[i] - base[r])
            row_sum[r] = row_sum[r] + p
            acc_s[i] = p
        for i in cutlass.range_constexpr(cute.size(acc_o)):
            acc_o[i] = acc_o[i] * rescale[(i // 2) % 2]

    @cute.jit
    def empty_row_stats(self):
        """(running max = -inf, running sum = 0) of the thread's two rows, before any key."""
        row_max = cute.make_rmem_tensor((2,), cutlass.Float32)
        row_sum = cute.make_rmem_tensor((2,), cutlass.Float32)
        for r in cutlass.range_constexpr(2):
            row_max[r] = NEG_INF
            row_sum[r] = 0.0
        return row_max, row_sum

    @cute.jit
    def zero_o_accumulator(self, thr_pv):
        """(coordinates, fp32 accumulator set to zero) of this thread's share of the O tile."""
        cO = thr_pv.partition_C(cute.make_identity_tensor((ROWS_PER_TILE, O_COLS)))
        acc_o = cute.make_rmem_tensor(cO.shape, cutlass.Float32)
        acc_o.fill(0.0)
        return cO, acc_o

    @cute.jit
    def row_limits(self, coords, row0, cache_len, num_tokens):
        """(row_in_tile, key_limit): the thread's two rows of an m64 accumulator (row-half r holds
        coords[2 r]) and the keys each may see: query j sees keys < cache_len + j + 1, a padding
        query none."""
        row_in_tile = cute.make_rmem_tensor((2,), cutlass.Int32)
        key_limit = cute.make_rmem_tensor((2,), cutlass.Int32)
        for r in cutlass.range_constexpr(2):
            row = coords[2 * r][0]
            row_in_tile[r] = row
            token = (row0 + row) // self.heads
            limit = cache_len + token + 1
            if token >= num_tokens:
                limit = 0
            key_limit[r] = limit
        return row_in_tile, key_limit

    @cute.jit
    def row_normalizer(self, total, row_max, key_limit):
        """(1 / row sum, log2-sum-exp) of a row: 0 and -inf for a row that saw no key; with one
        split a padding query's output is zeros."""
        inv = cutlass.Float32(0.0)
        log_sum = cutlass.Float32(NEG_INF)
        if total > 0.0:
            inv = 1.0 / total
            log_sum = row_max + cute.math.log2(total, fastmath=True)
        if cutlass.const_expr(not self.split_kv):
            if key_limit == 0:  # padding query: zeros
                inv = cutlass.Float32(0.0)
        return inv, log_sum

    @cute.jit
    def store_output(self, acc_o, inv_sum, lse, thr_pv, cO, mO, o_partial, lse_partial, b, split, row_tile, wg, lane,
                     row0, row_in_tile, rows):
        """Epilogue of both math structures: O / row sum, then with one split the bf16 output
        (rows past T*H not stored), else the split's partial O and its rows' log2-sum-exp."""
        for i in cutlass.range_constexpr(cute.size(acc_o)):
            acc_o[i] = acc_o[i] * inv_sum[(i // 2) % 2]
        if cutlass.const_expr(not self.split_kv):
            gO = cute.local_tile(mO[(None, None, b)], (ROWS_PER_TILE, O_COLS), (row_tile, wg))
            tOgO = thr_pv.partition_C(gO)
            out = cute.make_rmem_tensor(cO.shape, mO.element_type)
            out.store(acc_o.load().to(mO.element_type))
            for i in cutlass.range_constexpr(cute.size(out)):
                if row0 + cO[i][0] < rows:
                    tOgO[i] = out[i]
        else:
            gO = cute.local_tile(o_partial[(b, split, None, None)], (ROWS_PER_TILE, O_COLS), (row_tile, wg))
            tOgO = thr_pv.partition_C(gO)
            partial = cute.make_rmem_tensor(cO.shape, o_partial.element_type)
            partial.store(acc_o.load().to(o_partial.element_type))
            cute.autovec_copy(partial, tOgO)
            if wg == 0 and lane % 4 == 0:
                for r in cutlass.range_constexpr(2):
                    lse_partial[b, split, row0 + row_in_tile[r]] = lse[r]

    @cute.jit
    def math_split_s(
        self, tidx, warp_idx, mma_qk, mma_pv, sQ, sK, sKpe, sV, sP, row_max_xchg, row_sum_xchg, q_pipe, kv_pipe, mO,
        o_partial, lse_partial, b, split, row_tile, row0, rows, cache_len, num_tokens, tile_begin, tile_count,
        first_masked_tile, scale_log2,
    ):
        """The math warpgroups of the split-S structure (qk_one_warpgroup=False, and the mma.sync
        build): each computes S for its 32 cache rows, the row maxima and sums are exchanged
        through shared memory, and each does O_half += P.V_half."""
        if cutlass.const_expr(self.producer_warpgroup):
            cute.arch.setmaxregister_increase(MATH_REGS)
        wg = warp_idx // 4
        wg_tidx = tidx % 128
        lane = tidx % 32
        thr_qk = mma_qk.get_slice(wg_tidx)
        thr_pv = mma_pv.get_slice(wg_tidx)

        # Q.K^T operands: all of Q, this warpgroup's 32 cache rows of each stage
        sK_half = cute.local_tile(sK, (S_COLS, K_BLOCK, LATENT_BLOCKS * STAGES), (wg, 0, 0))
        sKpe_half = cute.local_tile(sKpe, (S_COLS, K_BLOCK, STAGES), (wg, 0, 0))
        # P.V operands: all of P, this warpgroup's 256 latent columns of each stage
        sV_half = cute.local_tile(sV, (O_COLS, KV_TILE, STAGES), (wg, 0, 0))
        ops = self.split_s_operands(mma_qk, mma_pv, thr_qk, thr_pv, sQ, sK_half, sKpe_half, sP, sV_half, wg_tidx)
        # this warpgroup's P columns, addressed like its S accumulator
        sP_half = cute.local_tile(sP[(None, None, 0)], (ROWS_PER_TILE, S_COLS), (0, wg))
        tPsP = thr_qk.partition_C(sP_half)

        cS = thr_qk.partition_C(cute.make_identity_tensor((ROWS_PER_TILE, S_COLS)))
        acc_s = cute.make_rmem_tensor(cS.shape, cutlass.Float32)
        p_bf16 = cute.make_rmem_tensor(cS.shape, BF16)
        cO, acc_o = self.zero_o_accumulator(thr_pv)

        # The accumulator fragment of an m64nN WGMMA holds, per thread, two rows:
        # element i is in row-half (i // 2) % 2 (cS gives the coordinates).
        row_in_tile, key_limit = self.row_limits(cS, row0, cache_len, num_tokens)
        row_max, row_sum = self.empty_row_stats()

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        q_pipe.consumer_wait(q_state)
        consumer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
        for t in cutlass.range(tile_count, unroll=1):
            tile = tile_begin + t
            kv_pipe.consumer_wait(consumer)
            stage = consumer.index
            # ---- S = Q . K_half^T over the 576 dims
            acc_s.fill(0.0)
            if cutlass.const_expr(not self.warp_mma):
                mma_qk = self.wgmma_qk(mma_qk, acc_s, ops.tSrQ, ops.tSrK, ops.tSrKpe, stage)
                warpgroup.wait_group(0)
            else:
                for kb in cutlass.range_constexpr(LATENT_BLOCKS + 1):
                    cute.copy(ops.copy_q, ops.sQ_copy[(None, None, None, kb)], ops.rQ_copy)
                    if cutlass.const_expr(kb < LATENT_BLOCKS):
                        cute.copy(ops.copy_k, ops.sK_copy[(None, None, None, stage * LATENT_BLOCKS + kb)], ops.rK_copy)
                    else:
                        cute.copy(ops.copy_k, ops.sKpe_copy[(None, None, None, stage)], ops.rK_copy)
                    for k in cutlass.range_constexpr(K_BLOCK // 16):
                        cute.gemm(mma_qk, acc_s, ops.rQ[(None, None, k)], ops.rK[(None, None, k)], acc_s)

            # ---- scale (log2 domain) and the causal mask on the last tile(s)
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                acc_s[i] = acc_s[i] * scale_log2
            if tile >= first_masked_tile:
                key0 = tile * KV_TILE + wg * S_COLS
                for i in cutlass.range_constexpr(cute.size(acc_s)):
                    if key0 + cS[i][1] >= key_limit[(i // 2) % 2]:
                        acc_s[i] = NEG_INF

            # ---- row max: thread, quad (4 lanes share a row), then both warpgroups
            tile_max = self.thread_row_max(acc_s)
            self.share_rows(tile_max, row_max_xchg, row_in_tile, wg, lane, BAR_ROW_MAX, True)
            rescale = cute.make_rmem_tensor((2,), cutlass.Float32)
            base = cute.make_rmem_tensor((2,), cutlass.Float32)
            for r in cutlass.range_constexpr(2):
                other = row_max_xchg[row_in_tile[r], 1 - wg]
                new_max = cute.arch.fmax(row_max[r], cute.arch.fmax(tile_max[r], other))
                self.rebase_row(r, new_max, row_max, row_sum, base, rescale)
            self.exponentiate(acc_s, acc_o, base, rescale, row_sum)

            # ---- P -> shared memory, visible to the async proxy (WGMMA) of both warpgroups
            p_bf16.store(acc_s.load().to(BF16))
            cute.autovec_copy(p_bf16, tPsP)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=BAR_P_READY, number_of_threads=128 * MATH_WARPGROUPS)

            # ---- O_half += P . V_half
            if cutlass.const_expr(not self.warp_mma):
                mma_pv = self.wgmma_pv(mma_pv, acc_o, ops.tOrP, ops.tOrV, stage)
                warpgroup.wait_group(0)
            else:
                cute.copy(ops.copy_p, ops.sP_copy[(None, None, None, 0)], ops.rP_copy)
                cute.copy(ops.copy_v, ops.sV_copy[(None, None, None, stage)], ops.rV_copy)
                for k in cutlass.range_constexpr(KV_TILE // 16):
                    cute.gemm(mma_pv, acc_o, ops.rP[(None, None, k)], ops.rV[(None, None, k)], acc_o)
            kv_pipe.consumer_release(consumer)
            consumer.advance()

        cute.arch.griddepcontrol_launch_dependents()

        # ---- epilogue: full row sums (quad, then both warpgroups), normalise, store
        self.share_rows(row_sum, row_sum_xchg, row_in_tile, wg, lane, BAR_ROW_SUM, False)
        inv_sum = cute.make_rmem_tensor((2,), cutlass.Float32)
        lse = cute.make_rmem_tensor((2,), cutlass.Float32)
        for r in cutlass.range_constexpr(2):
            total = row_sum[r] + row_sum_xchg[row_in_tile[r], 1 - wg]
            inv_sum[r], lse[r] = self.row_normalizer(total, row_max[r], key_limit[r])
        self.store_output(acc_o, inv_sum, lse, thr_pv, cO, mO, o_partial, lse_partial, b, split, row_tile, wg, lane, row0,
                          row_in_tile, rows)

    @cute.jit
    def math_qk_one_warpgroup(
        self, mma_qk, mma_pv, sQ, sK, sKpe, sV, sP, alpha_xchg, stats_xchg, q_pipe, kv_pipe, mO, o_partial,
        lse_partial, b, split, row_tile, row0, rows, cache_len, num_tokens, tile_begin, tile_count,
        first_masked_tile, scale_log2,
    ):
        """The math warpgroups of the qk_one_warpgroup variant (see __init__)."""
        cute.arch.setmaxregister_increase(MATH_REGS)
        tidx, _, _ = cute.arch.thread_idx()
        wg = cute.arch.make_warp_uniform(cute.arch.warp_idx()) // 4
        wg_tidx = tidx % 128
        lane = tidx % 32
        thr_pv = mma_pv.get_slice(wg_tidx)
        sV_half = cute.local_tile(sV, (O_COLS, KV_TILE, STAGES), (wg, 0, 0))
        tOrP = mma_pv.make_fragment_A(thr_pv.partition_A(sP))
        tOrV = mma_pv.make_fragment_B(thr_pv.partition_B(sV_half))
        cO, acc_o = self.zero_o_accumulator(thr_pv)
        # Both m64 accumulators (S and O) give a thread the same two rows: element i is in
        # row-half (i // 2) % 2.
        row_in_tile, key_limit = self.row_limits(cO, row0, cache_len, num_tokens)
        inv_sum = cute.make_rmem_tensor((2,), cutlass.Float32)
        lse = cute.make_rmem_tensor((2,), cutlass.Float32)
        rescale = cute.make_rmem_tensor((2,), cutlass.Float32)
        consumer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
        threads = 128 * MATH_WARPGROUPS
        if wg == 0:
            # ---- S, softmax, P and O_left
            thr_qk = mma_qk.get_slice(wg_tidx)
            tSrQ = mma_qk.make_fragment_A(thr_qk.partition_A(sQ))
            tSrK = mma_qk.make_fragment_B(thr_qk.partition_B(sK))
            tSrKpe = mma_qk.make_fragment_B(thr_qk.partition_B(sKpe))
            tPsP = thr_qk.partition_C(sP[(None, None, 0)])
            cS = thr_qk.partition_C(cute.make_identity_tensor((ROWS_PER_TILE, KV_TILE)))
            acc_s = cute.make_rmem_tensor(cS.shape, cutlass.Float32)
            p_bf16 = cute.make_rmem_tensor(cS.shape, BF16)
            row_max, row_sum = self.empty_row_stats()
            base = cute.make_rmem_tensor((2,), cutlass.Float32)
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            q_pipe.consumer_wait(q_state)
            for t in cutlass.range(tile_count, unroll=1):
                tile = tile_begin + t
                kv_pipe.consumer_wait(consumer)
                stage = consumer.index
                acc_s.fill(0.0)
                mma_qk = self.wgmma_qk(mma_qk, acc_s, tSrQ, tSrK, tSrKpe, stage)
                warpgroup.wait_group(0)  # also the previous tile's P.V (O_left)
                if t > 0:
                    kv_pipe.consumer_release(release)
                    release.advance()

                for i in cutlass.range_constexpr(cute.size(acc_s)):
                    acc_s[i] = acc_s[i] * scale_log2
                if tile >= first_masked_tile:  # bottom-right causal mask, last tile(s) only
                    for i in cutlass.range_constexpr(cute.size(acc_s)):
                        if tile * KV_TILE + cS[i][1] >= key_limit[(i // 2) % 2]:
                            acc_s[i] = NEG_INF
                tile_max = self.thread_row_max(acc_s)
                for r in cutlass.range_constexpr(2):
                    new_max = cute.arch.fmax(row_max[r], self.quad_max(tile_max[r]))
                    self.rebase_row(r, new_max, row_max, row_sum, base, rescale)
                self.exponentiate(acc_s, acc_o, base, rescale, row_sum)

                if t > 0:  # warpgroup 1 has finished with the previous P and factors
                    cute.arch.barrier(barrier_id=BAR_P_FREE, number_of_threads=threads)
                p_bf16.store(acc_s.load().to(BF16))
                cute.autovec_copy(p_bf16, tPsP)
                if lane % 4 == 0:
                    for r in cutlass.range_constexpr(2):
                        alpha_xchg[row_in_tile[r], 0] = rescale[r]
                cute.arch.fence_view_async_shared()
                cute.arch.barrier_arrive(barrier_id=BAR_P_READY, number_of_threads=threads)

                mma_pv = self.wgmma_pv(mma_pv, acc_o, tOrP, tOrV, stage)  # waited for by the next tile's Q.K^T wait
                consumer.advance()
            warpgroup.wait_group(0)
            if tile_count > 0:
                kv_pipe.consumer_release(release)

            for r in cutlass.range_constexpr(2):
                total = row_sum[r]
                total = total + cute.arch.shuffle_sync_bfly(total, offset=1)
                total = total + cute.arch.shuffle_sync_bfly(total, offset=2)
                inv, lse[r] = self.row_normalizer(total, row_max[r], key_limit[r])
                inv_sum[r] = inv
                if lane % 4 == 0:
                    stats_xchg[row_in_tile[r], 0] = inv
            cute.arch.barrier_arrive(barrier_id=BAR_ROW_SUM, number_of_threads=threads)
        else:
            # ---- O_right: P.V with the P and rescale factors warpgroup 0 publishes
            for t in cutlass.range(tile_count, unroll=1):
                kv_pipe.consumer_wait(consumer)
                stage = consumer.index
                cute.arch.barrier(barrier_id=BAR_P_READY, number_of_threads=threads)
                for r in cutlass.range_constexpr(2):
                    rescale[r] = alpha_xchg[row_in_tile[r], 0]
                for i in cutlass.range_constexpr(cute.size(acc_o)):
                    acc_o[i] = acc_o[i] * rescale[(i // 2) % 2]
                mma_pv = self.wgmma_pv(mma_pv, acc_o, tOrP, tOrV, stage)
                warpgroup.wait_group(0)
                kv_pipe.consumer_release(consumer)
                if t + 1 < tile_count:
                    cute.arch.barrier_arrive(barrier_id=BAR_P_FREE, number_of_threads=threads)
                consumer.advance()
            cute.arch.barrier(barrier_id=BAR_ROW_SUM, number_of_threads=threads)
            for r in cutlass.range_constexpr(2):
                inv_sum[r] = stats_xchg[row_in_tile[r], 0]

        cute.arch.griddepcontrol_launch_dependents()
        self.store_output(acc_o, inv_sum, lse, thr_pv, cO, mO, o_partial, lse_partial, b, split, row_tile, wg, lane, row0,
                          row_in_tile, rows)


@cute.kernel
def combine_kernel(o_partial: cute.Tensor, lse_partial: cute.Tensor, lengths: cute.Tensor, out: cute.Tensor,
                   heads: cutlass.Constexpr):
    """One CTA per (query row, request); thread t owns output columns 4t .. 4t+3. The loops over the
    splits are unrolled COMBINE_UNROLL deep so that many splits' loads are in flight at once: at a
    rank's batch 1 the grid is only a few CTAs, and a loop that waits for each split's load in turn
    costs a memory latency per split (docs/kernels.md §10.5)."""
    cute.arch.griddepcontrol_wait()  # the partials come from the attention kernel
    tidx, _, _ = cute.arch.thread_idx()
    row, b, _ = cute.arch.block_idx()
    splits = o_partial.shape[1]
    top = cutlass.Float32(-math.inf)
    for s in cutlass.range(splits, unroll=COMBINE_UNROLL):
        top = cute.arch.fmax(top, lse_partial[b, s, row])
    acc = cute.make_rmem_tensor((4,), cutlass.Float32)
    acc.fill(0.0)
    total = cutlass.Float32(0.0)
    # a padding query (token >= lengths[b]) or a row that saw no key keeps zeros
    if row // heads < lengths[b].to(cutlass.Int32) and top != cutlass.Float32(-math.inf):
        for s in cutlass.range(splits, unroll=COMBINE_UNROLL):
            # an empty split (or one whose keys this row cannot see) has lse = -inf: weight 0
            weight = cute.arch.exp2(lse_partial[b, s, row] - top)
            total += weight
            for c in cutlass.range_constexpr(4):
                acc[c] = acc[c] + weight * o_partial[b, s, row, tidx * 4 + c].to(cutlass.Float32)
        for c in cutlass.range_constexpr(4):
            acc[c] = acc[c] / total
    for c in cutlass.range_constexpr(4):
        out[b, row, tidx * 4 + c] = acc[c].to(out.element_type)

@cute.jit
def combine(o_partial: cute.Tensor, lse_partial: cute.Tensor, lengths: cute.Tensor, out: cute.Tensor,
           heads: cutlass.Constexpr, stream: cuda.CUstream):
    """o_partial [B, splits, rows_pad, 512] fp32, lse_partial [B, splits, rows_pad] fp32 (log2
    units), out [B, T, H, 512] bf16 (written as [B, T*H, 512])."""
    batch, tokens = out.shape[0], out.shape[1]
    rows = tokens * heads
    out_rows = cute.make_tensor(
        out.iterator, cute.make_layout((batch, rows, LATENT), stride=(rows * LATENT, LATENT, 1))
    )
    combine_kernel(o_partial, lse_partial, lengths, out_rows, heads).launch(
        grid=(rows, batch, 1), block=[COMBINE_THREADS, 1, 1], stream=stream, use_pdl=True
    )


def index_dtype(dtype: torch.dtype):
    return {torch.int32: cutlass.Int32, torch.int64: cutlass.Int64}[dtype]


def fake_arguments(heads: int, index: torch.dtype, partial_dtype: torch.dtype = torch.float32) -> tuple:
    """Compile-time stand-ins for (q_latent, q_pe, kv_cache, slots, cache_lens, lengths, out,
    o_partial, lse): B, T, slots, max_len, splits and padded rows are symbolic."""
    batch, tokens, num_slots, max_len, splits, rows_pad = (cute.sym_int() for _ in range(6))
    q_latent = make_fake_compact_tensor(BF16, (batch, tokens, heads, LATENT), stride_order=(3, 2, 1, 0), assumed_align=16)
    q_pe = make_fake_compact_tensor(BF16, (batch, tokens, heads, ROPE), stride_order=(3, 2, 1, 0), assumed_align=16)
    kv_cache = make_fake_compact_tensor(BF16, (num_slots, max_len, HEAD_DIM), stride_order=(2, 1, 0), assumed_align=16)
    idx = index_dtype(index)
    align = torch.empty((), dtype=index).element_size()  # a slice like cache_lens[1:] is allowed
    slots, cache_lens, lengths = (make_fake_compact_tensor(idx, (batch,), assumed_align=align) for _ in range(3))
    out = make_fake_compact_tensor(BF16, (batch, tokens, heads, LATENT), stride_order=(3, 2, 1, 0), assumed_align=16)
    o_partial = make_fake_compact_tensor(
        cute_common.torch_to_cutlass_dtype(partial_dtype), (batch, splits, rows_pad, LATENT), stride_order=(3, 2, 1, 0),
        assumed_align=16,
    )
    lse = make_fake_compact_tensor(cutlass.Float32, (batch, splits, rows_pad), stride_order=(2, 1, 0), assumed_align=16)
    return q_latent, q_pe, kv_cache, slots, cache_lens, lengths, out, o_partial, lse


_cache = cute_common.CompileCache()


def resolve_variant(warp_mma: bool = False, producer_warpgroup: bool | None = None,
                    qk_one_warpgroup: bool | None = None, l2_prefetch: bool | None = None,
                    cluster_pairs: bool | None = None, partial_dtype: torch.dtype | None = None) -> dict:
    """The kernel variant with every unset flag at its default (DEFAULT_* above; the mma.sync build
    has only the split-S structure). See the kernel class for what each flag does."""
    variant = dict(
        warp_mma=warp_mma,
        producer_warpgroup=DEFAULT_PRODUCER_WARPGROUP if producer_warpgroup is None else producer_warpgroup,
        qk_one_warpgroup=DEFAULT_QK_ONE_WARPGROUP if qk_one_warpgroup is None else qk_one_warpgroup,
        l2_prefetch=DEFAULT_L2_PREFETCH if l2_prefetch is None else l2_prefetch,
        cluster_pairs=DEFAULT_CLUSTER_PAIRS if cluster_pairs is None else cluster_pairs,
        partial_dtype=DEFAULT_PARTIAL_DTYPE if partial_dtype is None else partial_dtype,
    )
    if warp_mma:
        variant.update(producer_warpgroup=False, qk_one_warpgroup=False, cluster_pairs=False)
    if variant["qk_one_warpgroup"]:
        variant["producer_warpgroup"] = True  # warpgroup 0 needs the 240 registers
    if variant["partial_dtype"] not in (torch.float32, torch.bfloat16):
        raise ValueError(f"partial_dtype={variant['partial_dtype']}: float32 or bfloat16")
    return variant


def compile_mla_verify(heads: int, split_kv: bool, index: torch.dtype, arch: str, extra_options: tuple = (),
                       **flags):
    """Compiled kernel for `heads` query heads, cached per (heads, split_kv, index dtype, arch,
    variant). split_kv=False: one split, the kernel writes the bf16 output; True: any number of
    splits (a runtime argument) and the combine kernel. B, T, cache slots and max_len are runtime.
    `flags` (resolve_variant): warp_mma (the mma.sync build of cute_sm100.py), producer_warpgroup,
    qk_one_warpgroup, l2_prefetch, cluster_pairs, partial_dtype."""
    if heads < 1:
        raise ValueError(f"heads={heads} must be positive")
    variant = resolve_variant(**flags)
    if (arch == "sm_90a") == variant["warp_mma"]:
        raise ValueError(f"arch={arch!r}: WGMMA is the sm_90a build, mma.sync the sm_100a/sm_103a build")
    key = ("mla_verify", heads, bool(split_kv), index, arch, tuple(extra_options), *sorted(variant.items(), key=str))

    def build():
        args = fake_arguments(heads, index, variant["partial_dtype"])
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        kernel = MlaVerifySm90(
            heads, bool(split_kv), variant["warp_mma"], variant["producer_warpgroup"], variant["qk_one_warpgroup"],
            variant["l2_prefetch"], variant["cluster_pairs"],
        )
        return cute.compile(
            kernel, *args, cutlass.Float32(1.0), cutlass.Int32(1), stream,
            options=cute_common.compile_options(arch, *extra_options),
        )

    return _cache.get(key, build)


def mla_verify_into(q_latent, q_pe, kv_cache, slots, cache_lens, lengths, scale: float, out: torch.Tensor,
                    splits: int | None = None, partials=None, **flags) -> torch.Tensor:
    """o_latent into a caller-given bf16 [B, T, H, 512] buffer (tests poison it first).
    `splits` overrides the heuristic (benchmarks); `partials` = (o_partial, lse) to reuse or poison
    (their dtype sets partial_dtype); `flags` pick a kernel variant (resolve_variant)."""
    if partials is not None:
        flags["partial_dtype"] = partials[0].dtype
    variant = resolve_variant(**flags)
    mla_common.check_arguments(q_latent, q_pe, kv_cache, slots, cache_lens, lengths)
    if out.shape != q_latent.shape or out.dtype != torch.bfloat16 or not out.is_contiguous() or out.data_ptr() % 16:
        raise ValueError(f"out: expected a contiguous bf16 {tuple(q_latent.shape)} tensor, got {out.dtype} {tuple(out.shape)}")
    B, T, H, _ = q_latent.shape
    if splits is None:
        num_sms = torch.cuda.get_device_properties(q_latent.device).multi_processor_count
        splits = mla_common.choose_splits(B, T, H, kv_cache.shape[1], num_sms)
    elif not 1 <= splits <= mla_common.MAX_SPLITS:
        raise ValueError(f"splits={splits} must be in 1..{mla_common.MAX_SPLITS}")
    compiled = compile_mla_verify(H, splits > 1, slots.dtype, cute_common.target_arch(q_latent.device), **variant)
    if partials is None:
        partials = mla_common.workspace(B, T, H, splits, q_latent.device, variant["partial_dtype"])
    o_partial, lse = partials
    compiled(q_latent, q_pe, kv_cache, slots, cache_lens, lengths, out, o_partial, lse, scale * LOG2E, splits)
    return out


def mla_verify_attention(q_latent, q_pe, kv_cache, slots, cache_lens, lengths, scale: float) -> torch.Tensor:
    out = torch.empty_like(q_latent)
    return mla_verify_into(q_latent, q_pe, kv_cache, slots, cache_lens, lengths, scale, out)
