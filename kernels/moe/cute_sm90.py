"""Routed MXFP4 experts of K3's latent MoE on Hopper (sm_90a) in CuTe DSL: the `moe_experts` op.

Expert kernel (docs/kernels.md §4.3, §7 row 2): a grouped skinny GEMM over the slots of
expert_layout.build_expert_lists, grid = (row tiles of the expert's output, slots). Every touched
expert's weights are streamed from HBM exactly once per call, however many tokens chose it.
- Swap-AB: 128 dequantised weight rows are the WGMMA A operand (two m64 atoms of one warpgroup),
  the slot's tokens (N = 8 or 16, padded) are B, read from shared memory.
- A comes from registers (WGMMA RS): each thread takes, per 128-element K chunk, one contiguous
  16-byte run of packed E2M1 codes per row it owns (4 rows) and the one E8M0 scale of that run
  (the K permutation of expert_layout.chunk_permutation makes the run exactly one MX group), turns
  each 32-bit word into four bf16x2 fragment registers with shifts and masks, and applies the
  scale with one bf16x2 multiply.
- Two loaders (DEFAULT_LOADER): "tma" (default) brings the codes by TMA into a 6-stage
  shared-memory pipeline together with the tokens (B) and reads them with LDS.128; "registers"
  loads them straight from global memory two chunks ahead, with B in a 4-stage TMA pipeline.
- Dequantisation (Hopper has no E2M1 convert): a code s|e1 e0|m placed as bf16 bits
  (s << 15) | (e1 e0 m << 6) is exactly value * 2^-126 (e = 0 lands on the subnormal 0.5 * 2^-126
  * m, e > 0 on 2^(e-127) * (1 + m/2)). Multiplying by 2^(scale - 64) gives W * 2^-63 without
  overflow for every scale byte <= 191 (2^64); the tokens are multiplied by 2^63 (exact) before
  the kernel, so the tensor cores form W x exactly as the reference does. Scale bytes above 191
  (group scales > 2^64) are outside what this kernel computes.
- Pass 1 (glu=True): a CTA takes 64 w1 rows and the same 64 w3 rows (the two m64 atoms), so the
  SiTU-GLU epilogue has gate and up of one intermediate index in the same thread's registers;
  it writes act * 2^63 in bf16, K-permuted, for pass 2. Pass 2 (glu=False): 128 w2 rows, fp32
  outputs per (slot, token row); the routing weights and the top-k-ordered sum follow in torch
  (per-pair outputs + a deterministic reduce, no atomics).
"""
# No `from __future__ import annotations`: CuTe DSL evaluates the kernels' annotations at trace time.

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.tensor_utils as tensor_utils
import cutlass.utils.hopper_helpers as sm90_utils
import torch
from cutlass import Float32, Int32, Int64, Uint32
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
from cutlass.memory import SmemAllocator

from .. import cute_common
from ..cute_pipelines import deferred_pipeline
from . import expert_layout
from . import reference
from . import triton as moe_triton

ROW_TILE = 128  # weight rows per CTA: two m64 WGMMA atoms
GLU_ROWS = ROW_TILE // 2  # pass 1: 64 w1 rows + the same 64 w3 rows
K_CHUNK = expert_layout.K_CHUNK
B_STAGES = 4
THREADS = 128  # one warpgroup
PREFETCH_DEPTH = 2  # K chunks of raw codes in flight per thread (registers); measured in experiments/notes/moe.md
TMA_STAGES = 6  # "tma" loader: chunks of codes + tokens in the shared-memory pipeline (12 KB each at N = 16)
LOADERS = ("registers", "tma")
# How the codes reach the dequantiser: "registers" = per-thread 16-byte global loads prefetched
# PREFETCH_DEPTH chunks ahead (bytes in flight cost registers); "tma" = TMA into the shared-memory
# pipeline with the tokens. H200 round 2 (experiments/notes/moe.md): tma 72-73 % of the byte
# floor at T = 8 vs 62-63 % for registers, faster at every T, bit-identical outputs.
DEFAULT_LOADER = "tma"


def token_tile(tokens: int) -> int:
    """WGMMA N of a slot for a step of `tokens` tokens: 8 when they fit, else 16 (past 16 tokens an
    expert chosen by more of them takes several slots: expert_layout.build_expert_lists)."""
    return 8 if tokens <= 8 else 16



class MxFp4ExpertGemmSm90:
    """One compiled instance per (experts, rows, K, tokens, glu, splits); the slot count is a runtime
    value. splits > 1 (pass 2, TMA loader): each CTA multiplies one of `splits` equal K ranges and
    writes its fp32 partial as slot `split * slots + slot`; the combine adds the splits."""

    def __init__(self, experts: int, rows: int, k: int, tokens: int, glu: bool, situ_beta: float,
                 situ_linear_beta: float, depth: int, loader: str, splits: int = 1):
        self.experts, self.rows, self.k, self.tokens, self.glu, self.depth = experts, rows, k, tokens, glu, depth
        self.loader, self.splits = loader, splits
        self.situ_beta, self.situ_linear_beta = situ_beta, situ_linear_beta
        self.chunks = k // K_CHUNK // splits  # K chunks of one CTA
        self.tile_mnk = (ROW_TILE, tokens, K_CHUNK)
        self.row_tiles = rows // (GLU_ROWS if glu else ROW_TILE)

    @cute.jit
    def __call__(
        self,
        wa: cute.Tensor,
        sa: cute.Tensor,
        wb: cute.Tensor,
        sb: cute.Tensor,
        slot_expert: cute.Tensor,
        xb: cute.Tensor,
        out: cute.Tensor,
        stream: cuda.CUstream,
    ):
        """wa/wb: packed codes viewed as int32 [E, rows, K/8]; sa/sb: E8M0 scales uint8
        [E, rows, K/32] (wb/sb: w3 in pass 1, unused in pass 2); slot_expert int32 [S];
        xb: tokens bf16 [S, tokens, K] (K-permuted, times 2^63); out: pass 1 bf16 [S, tokens,
        rows] (K-permuted act times 2^63), pass 2 fp32 [S, tokens, rows]."""
        slots = slot_expert.shape[0]
        k = self.k
        mB = cute.make_tensor(
            xb.iterator, cute.make_layout((self.tokens, k, slots), stride=(k, 1, self.tokens * k))
        )
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            cutlass.BFloat16,
            cutlass.BFloat16,
            OperandMajorMode.K,
            OperandMajorMode.K,
            Float32,
            (1, 1, 1),
            tiler_mn=(64, self.tokens),
            a_source=warpgroup.OperandSource.RMEM,
        )
        b_smem_staged = sm90_utils.make_smem_layout_b(
            tensor_utils.LayoutEnum.ROW_MAJOR, self.tile_mnk, cutlass.BFloat16, B_STAGES
        )
        b_smem = cute.slice_(b_smem_staged, (None, None, 0))
        tma_b, tma_tensor_b = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mB, b_smem, (self.tokens, K_CHUNK)
        )

        if cutlass.const_expr(self.loader == "tma"):
            self.launch_tma(wa, sa, wb, sb, slot_expert, mB, out, tiled_mma, stream)
        else:
            @cute.struct
            class SharedStorage:
                barriers: cute.struct.MemRange[cutlass.Int64, B_STAGES * 2]
                sB: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(b_smem_staged)], 1024]

            self.shared_storage = SharedStorage
            self.expert_kernel(wa, sa, wb, sb, slot_expert, tma_b, tma_tensor_b, out, tiled_mma, b_smem_staged).launch(
                grid=(self.row_tiles, slots, 1), block=[THREADS, 1, 1], stream=stream
            )

    @cute.jit
    def launch_tma(self, wa, sa, wb, sb, slot_expert, mB, out, tiled_mma, stream):
        """The TMA-loader variant: packed codes and tokens share one TMA_STAGES-deep pipeline."""
        slots = slot_expert.shape[0]
        words = self.k // 8  # int32 words of codes per row
        # codes as (rows, K words, experts); a stage holds two 64-row halves x 16 words (128 K)
        mWa = cute.make_tensor(wa.iterator, cute.make_layout((self.rows, words, self.experts), stride=(words, 1, self.rows * words)))
        mWb = cute.make_tensor(wb.iterator, cute.make_layout((self.rows, words, self.experts), stride=(words, 1, self.rows * words)))
        half_staged = cute.make_layout((GLU_ROWS, K_CHUNK // 8, TMA_STAGES), stride=(K_CHUNK // 8, 1, GLU_ROWS * K_CHUNK // 8))
        half_smem = cute.slice_(half_staged, (None, None, 0))
        tma_lo, tma_tensor_lo = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mWa, half_smem, (GLU_ROWS, K_CHUNK // 8)
        )
        tma_hi, tma_tensor_hi = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mWb, half_smem, (GLU_ROWS, K_CHUNK // 8)
        )
        b_smem_staged = sm90_utils.make_smem_layout_b(
            tensor_utils.LayoutEnum.ROW_MAJOR, self.tile_mnk, cutlass.BFloat16, TMA_STAGES
        )
        tma_b, tma_tensor_b = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mB, cute.slice_(b_smem_staged, (None, None, 0)), (self.tokens, K_CHUNK)
        )

        @cute.struct
        class SharedStorageTma:
            barriers: cute.struct.MemRange[cutlass.Int64, TMA_STAGES * 2]
            sLo: cute.struct.Align[cute.struct.MemRange[Int32, cute.cosize(half_staged)], 1024]
            sHi: cute.struct.Align[cute.struct.MemRange[Int32, cute.cosize(half_staged)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(b_smem_staged)], 1024]

        self.shared_storage_tma = SharedStorageTma
        self.expert_kernel_tma(
            sa, sb, slot_expert, tma_lo, tma_tensor_lo, tma_hi, tma_tensor_hi, tma_b, tma_tensor_b, out,
            tiled_mma, half_staged, b_smem_staged,
        ).launch(grid=(self.row_tiles, slots, self.splits), block=[THREADS, 1, 1], stream=stream)

    # ------------------------------------------------------------------ device helpers
    @cute.jit
    def load_raw(self, w: cute.Tensor, s: cute.Tensor, expert, rows_of, chunk, c, raw: cute.Tensor, scales: cute.Tensor):
        """Thread c's 16 code bytes (4 int32) and its scale byte for each of its 4 rows."""
        for r in cutlass.range_constexpr(4):
            row = rows_of[r]
            src = cute.local_tile(w[expert, row, None], (4,), (chunk * 4 + c,))
            dst = cute.local_tile(raw, (4,), (r,))
            cute.autovec_copy(src, dst)
            scales[r] = s[expert, row, chunk * 4 + c].to(Int32)

    @cute.jit
    def load_raw_glu(self, wa, sa, wb, sb, expert, rows_of, chunk, c, raw, scales):
        """Pass 1: rows 0, 1 (m-atom 0) come from w1, rows 2, 3 (m-atom 1) from w3."""
        for r in cutlass.range_constexpr(4):
            row = rows_of[r]
            w = wa if r < 2 else wb
            s = sa if r < 2 else sb
            src = cute.local_tile(w[expert, row, None], (4,), (chunk * 4 + c,))
            dst = cute.local_tile(raw, (4,), (r,))
            cute.autovec_copy(src, dst)
            scales[r] = s[expert, row, chunk * 4 + c].to(Int32)

    @cute.jit
    def dequantise(self, raw: cute.Tensor, scales: cute.Tensor, frag32: cute.Tensor):
        """raw codes -> the bf16x2 A fragment (see expert_layout.chunk_permutation).

        frag32 is the A fragment viewed as 32-bit words, indexed (v1 + 2*v2, m-atom, ki)."""
        for r in cutlass.range_constexpr(4):
            mi, v1 = r // 2, r % 2
            exponent = (scales[r] + (127 - 64)).to(Uint32)  # bf16 2^(scale - 64)
            scale2 = Int32(exponent << 7 | exponent << 23)
            for q in cutlass.range_constexpr(4):
                word = raw[r * 4 + q].to(Uint32)
                for i in cutlass.range_constexpr(4):
                    x = word >> (4 * i)
                    bits = ((x << 6) & expert_layout.MAGNITUDE_BITS) | ((x << 12) & expert_layout.SIGN_BITS)
                    rho = 4 * q + i
                    ki, v2 = rho // 2, rho % 2
                    frag32[v1 + 2 * v2, mi, ki] = cute.arch.fma_packed_bf16x2(
                        Int32(bits), scale2, Int32(0)
                    )

    # ------------------------------------------------------------------ kernel
    @cute.kernel
    def expert_kernel(
        self,
        wa: cute.Tensor,
        sa: cute.Tensor,
        wb: cute.Tensor,
        sb: cute.Tensor,
        slot_expert: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        out: cute.Tensor,
        tiled_mma: cute.TiledMma,
        b_smem_staged: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        tile_idx, slot, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        expert = slot_expert[slot]
        if expert >= 0:
            lane = tidx % 32
            g, c = lane // 4, lane % 4
            # Weight rows of this thread: (m-atom mi, half v1) -> r = 2*mi + v1.
            rows_of = cute.make_rmem_tensor((4,), Int32)
            for r in cutlass.range_constexpr(4):
                mi, v1 = r // 2, r % 2
                in_atom = warp_idx * 16 + v1 * 8 + g
                if cutlass.const_expr(self.glu):
                    rows_of[r] = tile_idx * GLU_ROWS + in_atom
                else:
                    rows_of[r] = tile_idx * ROW_TILE + mi * 64 + in_atom

            # `depth` register buffers of raw codes: chunk i + depth is loaded while chunk i
            # is dequantised (the loads in flight per CTA are depth x 8 KB)
            raws = [cute.make_rmem_tensor((16,), Int32) for _ in range(self.depth)]
            scale_bufs = [cute.make_rmem_tensor((4,), Int32) for _ in range(self.depth)]
            for j in cutlass.range_constexpr(self.depth):
                self.load_chunk(wa, sa, wb, sb, expert, rows_of, j, c, raws[j], scale_bufs[j])

            storage = SmemAllocator().allocate(self.shared_storage)
            b_stage_bytes = cute.size_in_bytes(cutlass.BFloat16, cute.slice_(b_smem_staged, (None, None, 0)))
            mainloop = self.make_mainloop(storage, B_STAGES, b_stage_bytes)
            sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
            gB = cute.local_tile(mB, self.tile_mnk, (0, 0, None, slot), proj=(None, 1, 1))
            tBsB, tBgB = cpasync.tma_partition(
                tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
            )
            thr_mma, tCrB, frag, frag32, accumulators = self.make_fragments(tiled_mma, tidx, sB)

            pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))
            prefetch = cutlass.min(B_STAGES, self.chunks)
            producer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, B_STAGES)
            if warp_idx == 0:
                for _ in cutlass.range(prefetch, unroll=1):
                    self.issue_tokens(mainloop, producer, tma_b, tBgB, tBsB)
                    producer.advance()

            consumer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, B_STAGES)
            release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, B_STAGES)
            for group in cutlass.range(self.chunks // self.depth, unroll=1):
                for j in cutlass.range_constexpr(self.depth):
                    chunk = group * self.depth + j
                    raw, scales = raws[j], scale_bufs[j]
                    release, producer = self.free_previous_stage(
                        chunk, warp_idx, mainloop, release, producer,
                        lambda p: self.issue_tokens(mainloop, p, tma_b, tBgB, tBsB))
                    self.dequantise(raw, scales, frag32)
                    # Prefetch `depth` chunks ahead into the buffer just consumed (the last
                    # chunk is re-read past the end: an L2 hit, simpler than predicates).
                    ahead = cutlass.min(chunk + self.depth, self.chunks - 1)
                    self.load_chunk(wa, sa, wb, sb, expert, rows_of, ahead, c, raw, scales)
                    mainloop.consumer_wait(consumer)
                    self.multiply_chunk(tiled_mma, accumulators, frag, tCrB, consumer.index)
                    consumer.advance()
            self.drain_and_store(mainloop, release, thr_mma, accumulators, out, slot, tile_idx)

    @cute.jit
    def load_scales(self, sa, sb, expert, scale_rows, chunk, c, scales: cute.Tensor):
        """The E8M0 byte of thread c's MX group in each of its 4 rows (rows 0, 1: sa; 2, 3: sb)."""
        for r in cutlass.range_constexpr(4):
            s = sa if r < 2 else sb
            scales[r] = s[expert, scale_rows[r], chunk * 4 + c].to(Int32)

    @cute.kernel
    def expert_kernel_tma(
        self,
        sa: cute.Tensor,
        sb: cute.Tensor,
        slot_expert: cute.Tensor,
        tma_lo: cute.CopyAtom,
        mLo: cute.Tensor,
        tma_hi: cute.CopyAtom,
        mHi: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        out: cute.Tensor,
        tiled_mma: cute.TiledMma,
        half_staged: cute.Layout,
        b_smem_staged: cute.ComposedLayout,
    ):
        """Same math as expert_kernel; the codes arrive by TMA into a TMA_STAGES-deep shared-
        memory pipeline (with the tokens), so the bytes in flight do not cost registers."""
        tidx, _, _ = cute.arch.thread_idx()
        tile_idx, slot, split = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        expert = slot_expert[slot]
        # This CTA's K range starts at chunk `first` (None: the whole K, the code of splits = 1 unchanged)
        first, out_slot = None, slot
        if cutlass.const_expr(self.splits > 1):
            first = split * self.chunks
            out_slot = split * slot_expert.shape[0] + slot
        if expert >= 0:
            if warp_idx == 0:
                cpasync.prefetch_descriptor(tma_lo)
                cpasync.prefetch_descriptor(tma_hi)
            lane = tidx % 32
            g, c = lane // 4, lane % 4
            # Row of each (m-atom mi, half v1) inside its 64-row half tile, and in the scales.
            half_rows = cute.make_rmem_tensor((4,), Int32)
            scale_rows = cute.make_rmem_tensor((4,), Int32)
            for r in cutlass.range_constexpr(4):
                mi, v1 = r // 2, r % 2
                half_rows[r] = warp_idx * 16 + v1 * 8 + g
                if cutlass.const_expr(self.glu):
                    scale_rows[r] = tile_idx * GLU_ROWS + half_rows[r]
                else:
                    scale_rows[r] = tile_idx * ROW_TILE + mi * GLU_ROWS + half_rows[r]
            # half tiles: pass 1 = (w1 rows, w3 rows) of tile t; pass 2 = w2 row halves 2t, 2t+1
            lo_tile, hi_tile = tile_idx, tile_idx
            if cutlass.const_expr(not self.glu):
                lo_tile, hi_tile = 2 * tile_idx, 2 * tile_idx + 1

            scale_bufs = [cute.make_rmem_tensor((4,), Int32) for _ in range(2)]
            self.load_scales(sa, sb, expert, scale_rows, self.chunk_of(first, 0), c, scale_bufs[0])
            self.load_scales(sa, sb, expert, scale_rows, self.chunk_of(first, 1), c, scale_bufs[1])

            storage = SmemAllocator().allocate(self.shared_storage_tma)
            lo_bytes = cute.size_in_bytes(Int32, cute.slice_(half_staged, (None, None, 0)))
            b_stage_bytes = cute.size_in_bytes(cutlass.BFloat16, cute.slice_(b_smem_staged, (None, None, 0)))
            mainloop = self.make_mainloop(storage, TMA_STAGES, 2 * lo_bytes + b_stage_bytes)
            sLo = storage.sLo.get_tensor(half_staged)
            sHi = storage.sHi.get_tensor(half_staged)
            sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
            half_tiler = (GLU_ROWS, K_CHUNK // 8)
            gLo = cute.local_tile(mLo, half_tiler, (lo_tile, None, expert))
            gHi = cute.local_tile(mHi, half_tiler, (hi_tile, None, expert))
            tLs, tLg = cpasync.tma_partition(tma_lo, 0, cute.make_layout(1), cute.group_modes(sLo, 0, 2), cute.group_modes(gLo, 0, 2))
            tHs, tHg = cpasync.tma_partition(tma_hi, 0, cute.make_layout(1), cute.group_modes(sHi, 0, 2), cute.group_modes(gHi, 0, 2))
            gB = cute.local_tile(mB, self.tile_mnk, (0, 0, None, slot), proj=(None, 1, 1))
            tBsB, tBgB = cpasync.tma_partition(
                tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
            )
            thr_mma, tCrB, frag, frag32, accumulators = self.make_fragments(tiled_mma, tidx, sB)
            raw = cute.make_rmem_tensor((16,), Int32)

            pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))
            producer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, TMA_STAGES)
            if warp_idx == 0:
                for _ in cutlass.range(cutlass.min(TMA_STAGES, self.chunks), unroll=1):
                    self.issue_stage(mainloop, producer, tma_lo, tLg, tLs, tma_hi, tHg, tHs, tma_b, tBgB, tBsB, first)
                    producer.advance()

            consumer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, TMA_STAGES)
            release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, TMA_STAGES)
            for pair in cutlass.range(self.chunks // 2, unroll=1):
                for j in cutlass.range_constexpr(2):
                    chunk = pair * 2 + j
                    scales = scale_bufs[j]
                    mainloop.consumer_wait(consumer)
                    # this thread's 16 code bytes of each of its 4 rows (LDS.128; a quad reads
                    # 64 contiguous bytes, two rows per 8 lanes: no bank conflicts)
                    for r in cutlass.range_constexpr(4):
                        source = sLo if r < 2 else sHi
                        row_words = source[(half_rows[r], None, consumer.index)]
                        cute.autovec_copy(cute.local_tile(row_words, (4,), (c,)), cute.local_tile(raw, (4,), (r,)))
                    release, producer = self.free_previous_stage(
                        chunk, warp_idx, mainloop, release, producer,
                        lambda p: self.issue_stage(mainloop, p, tma_lo, tLg, tLs, tma_hi, tHg, tHs, tma_b, tBgB, tBsB,
                                                   first))
                    self.dequantise(raw, scales, frag32)
                    ahead = cutlass.min(chunk + 2, self.chunks - 1)
                    self.load_scales(sa, sb, expert, scale_rows, self.chunk_of(first, ahead), c, scales)
                    self.multiply_chunk(tiled_mma, accumulators, frag, tCrB, consumer.index)
                    consumer.advance()
            self.drain_and_store(mainloop, release, thr_mma, accumulators, out, out_slot, tile_idx)

    @staticmethod
    def chunk_of(first, chunk):
        """The K chunk of a CTA's local chunk `chunk`: offset by its split's first chunk (None: no split)."""
        return chunk if first is None else first + chunk

    @cute.jit
    def drain_and_store(self, mainloop, release, thr_mma, accumulators, out, slot, tile_idx):
        """After the last chunk: wait for its WGMMAs, free its stage, write the tile."""
        warpgroup.wait_group(0)
        mainloop.consumer_release(release)
        self.store_tile(thr_mma, accumulators, out, slot, tile_idx)

    @cute.jit
    def free_previous_stage(self, chunk, warp_idx, mainloop, release, producer, refill):
        """The previous chunk's WGMMAs read `frag` and a B stage: wait for them, free that stage,
        and have warp 0 refill it with the next chunk (refill(producer) issues its TMA). Returns
        the advanced (release, producer) states."""
        warpgroup.wait_group(0)
        if chunk > 0:
            mainloop.consumer_release(release)
            release.advance()
            if warp_idx == 0 and producer.count < self.chunks:
                refill(producer)
                producer.advance()
        return release, producer

    @cute.jit
    def issue_stage(self, mainloop, producer, tma_lo, tLg, tLs, tma_hi, tHg, tHs, tma_b, tBgB, tBsB, first=None):
        """Warp 0: TMA the two code halves and the tokens of the CTA's K chunk producer.count (offset
        by its split's first chunk)."""
        mainloop.producer_acquire(producer)
        barrier = mainloop.producer_get_barrier(producer)
        chunk = self.chunk_of(first, producer.count)
        cute.copy(tma_lo, tLg[(None, chunk)], tLs[(None, producer.index)], tma_bar_ptr=barrier)
        cute.copy(tma_hi, tHg[(None, chunk)], tHs[(None, producer.index)], tma_bar_ptr=barrier)
        cute.copy(tma_b, tBgB[(None, chunk)], tBsB[(None, producer.index)], tma_bar_ptr=barrier)
        mainloop.producer_commit(producer)

    @cute.jit
    def load_chunk(self, wa, sa, wb, sb, expert, rows_of, chunk, c, raw, scales):
        if cutlass.const_expr(self.glu):
            self.load_raw_glu(wa, sa, wb, sb, expert, rows_of, chunk, c, raw, scales)
        else:
            self.load_raw(wa, sa, expert, rows_of, chunk, c, raw, scales)

    # ------------------------------------------------------------------ pieces both loaders share
    @cute.jit
    def make_mainloop(self, storage, stages, tx_count):
        """The TMA pipeline of one CTA: warp 0's TMA produces, the 4 warps consume."""
        mainloop = deferred_pipeline(pipeline.PipelineTmaAsync, storage.barriers, stages, THREADS // 32, tx_count=tx_count)
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
        return mainloop

    @cute.jit
    def make_fragments(self, tiled_mma, tidx, sB):
        """(thread MMA slice, B fragments over the stages, the A fragment and its 32-bit view,
        zeroed fp32 accumulators)."""
        thr_mma = tiled_mma.get_slice(tidx)
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        a_shape = thr_mma.partition_A(cute.make_identity_tensor((ROW_TILE, K_CHUNK))).shape
        frag = cute.make_rmem_tensor(a_shape, cutlass.BFloat16)
        frag32 = cute.recast_tensor(frag, Uint32)
        acc_shape = thr_mma.partition_C(cute.make_identity_tensor((ROW_TILE, self.tokens))).shape
        accumulators = cute.make_rmem_tensor(acc_shape, Float32)
        accumulators.fill(0.0)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        return thr_mma, tCrB, frag, frag32, accumulators

    @cute.jit
    def multiply_chunk(self, tiled_mma, accumulators, frag, tCrB, stage):
        """The WGMMAs of one K chunk: the dequantised A fragment times B stage `stage`."""
        warpgroup.fence()
        for k_block in cutlass.range(cute.size(frag, mode=[2]), unroll_full=True):
            cute.gemm(tiled_mma, accumulators, frag[(None, None, k_block)], tCrB[(None, None, k_block, stage)], accumulators)
        warpgroup.commit_group()

    @cute.jit
    def issue_tokens(self, mainloop, producer, tma_b, tBgB, tBsB):
        """Warp 0 ("registers" loader): TMA the tokens of K chunk producer.count."""
        mainloop.producer_acquire(producer)
        cute.copy(tma_b, tBgB[(None, producer.count)], tBsB[(None, producer.index)],
                  tma_bar_ptr=mainloop.producer_get_barrier(producer))
        mainloop.producer_commit(producer)

    @cute.jit
    def store_tile(self, thr_mma, accumulators, out, slot, tile_idx):
        """Epilogue: pass 1 the SiTU-GLU activations (store_act), pass 2 the fp32 outputs."""
        coords = thr_mma.partition_C(cute.make_identity_tensor((ROW_TILE, self.tokens)))
        if cutlass.const_expr(self.glu):
            self.store_act(accumulators, coords, out, slot, tile_idx)
        else:
            for i in cutlass.range_constexpr(cute.size(accumulators)):
                row, token = coords[i]
                out[slot, token, tile_idx * ROW_TILE + row] = accumulators[i]

    @cute.jit
    def store_act(self, accumulators: cute.Tensor, coords: cute.Tensor, out: cute.Tensor, slot, tile_idx):
        """SiTU-GLU (docs/kimi-k3.md §1.2 hidden_act) of (w1 row, w3 row) = (m-atom 0, m-atom 1)
        values of the same register position; stored K-permuted and times 2^63 for pass 2."""
        beta, linear_beta = self.situ_beta, self.situ_linear_beta
        per_atom = cute.size(accumulators, mode=[0])
        for i in cutlass.range_constexpr(per_atom):
            gate = accumulators[i, 0, 0]
            up = accumulators[i, 1, 0]
            row, token = coords[i, 0, 0]
            sigmoid = Float32(1.0) / (Float32(1.0) + cute.math.exp(-gate))
            act = (beta * cute.math.tanh(gate / beta) * sigmoid) * (linear_beta * cute.math.tanh(up / linear_beta))
            act = act * Float32(2.0**expert_layout.B_SCALE_LOG2)
            # position of intermediate index r in the K-permuted layout (inverse of chunk_permutation)
            r = tile_idx * GLU_ROWS + row
            within = r % K_CHUNK
            c, q, v0, i4 = within // 32, (within % 32) // 8, (within % 8) // 4, within % 4
            rho = 4 * q + i4
            logical = 16 * (rho // 2) + 2 * c + v0 + 8 * (rho % 2)
            out[slot, token, r - within + logical] = act.to(cutlass.BFloat16)




_cache = cute_common.CompileCache()


def check_splits(splits: int, k: int, glu: bool, loader: str) -> None:
    """A K split (pass 2, TMA loader): every split an even number of chunks (the main loop takes
    them in pairs)."""
    if splits == 1:
        return
    if glu or loader != "tma":
        raise ValueError(f"splits={splits}: only pass 2 (glu=False) with the 'tma' loader splits K")
    chunks = k // K_CHUNK
    if splits < 1 or chunks % splits or (chunks // splits) % 2:
        raise ValueError(f"splits={splits}: must split the {chunks} K chunks into equal, even counts")


def check_expert_shape(experts: int, rows: int, k: int, glu: bool) -> None:
    if k % (PREFETCH_DEPTH * K_CHUNK):
        raise ValueError(f"k={k}: the expert kernel needs a multiple of {PREFETCH_DEPTH * K_CHUNK}")
    tile = GLU_ROWS if glu else ROW_TILE
    if rows % tile:
        raise ValueError(f"rows={rows}: the expert kernel needs a multiple of {tile}")
    if experts < 1:
        raise ValueError(f"experts={experts} must be positive")


def compile_expert_gemm(
    experts: int,
    rows: int,
    k: int,
    tokens: int,
    glu: bool,
    arch: str,
    situ_beta: float = 4.0,
    situ_linear_beta: float = 25.0,
    depth: int = PREFETCH_DEPTH,
    loader: str = "registers",
    extra_options: tuple = (),
    splits: int = 1,
):
    """Compiled pass-1 (glu) or pass-2 expert kernel for weights [experts, rows, k] (MXFP4) and
    slots of `tokens` (8 or 16) rows. The slot count is a runtime value. `depth`: chunks of raw
    codes prefetched in registers (must divide the k / 128 chunks). `splits`: pass 2 with the TMA
    loader only, K split that many ways (check_splits)."""
    if tokens not in (8, 16):
        raise ValueError(f"tokens={tokens} must be 8 or 16")
    check_expert_shape(experts, rows, k, glu)
    if depth < 1 or (k // K_CHUNK) % depth:
        raise ValueError(f"depth={depth} must divide the {k // K_CHUNK} K chunks")
    if loader not in LOADERS:
        raise ValueError(f"loader={loader!r}: expected one of {LOADERS}")
    check_splits(splits, k, glu, loader)
    key = ("moe_sm90", experts, rows, k, tokens, glu, situ_beta, situ_linear_beta, depth, loader, arch, tuple(extra_options),
           splits)

    def build():
        gemm = MxFp4ExpertGemmSm90(experts, rows, k, tokens, glu, situ_beta, situ_linear_beta, depth, loader, splits)
        return compile_expert_kernel(gemm, experts, rows, k, tokens, glu, arch, extra_options)

    return _cache.get(key, build)


def compile_expert_kernel(gemm, experts: int, rows: int, k: int, tokens: int, glu: bool, arch: str, extra_options: tuple):
    """cute.compile of an expert kernel object (the Hopper or the Blackwell class) for weights
    [experts, rows, k] and slots of `tokens` rows; the slot count stays symbolic."""
    slots = cute.sym_int()
    packed = make_fake_compact_tensor(cutlass.Int32, (experts, rows, k // 8), stride_order=(2, 1, 0), assumed_align=16)
    scale = make_fake_compact_tensor(cutlass.Uint8, (experts, rows, k // 32), stride_order=(2, 1, 0), assumed_align=16)
    slot_expert = make_fake_compact_tensor(cutlass.Int32, (slots,), assumed_align=4)
    xb = make_fake_compact_tensor(cutlass.BFloat16, (slots, tokens, k), stride_order=(2, 1, 0), assumed_align=16)
    out_dtype = cutlass.BFloat16 if glu else cutlass.Float32
    # a K split writes splits x slots partial slots: its own symbolic count
    out_slots = slots if getattr(gemm, "splits", 1) == 1 else cute.sym_int()
    out = make_fake_compact_tensor(out_dtype, (out_slots, tokens, rows), stride_order=(2, 1, 0), assumed_align=16)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(gemm, packed, scale, packed, scale, slot_expert, xb, out, stream,
                        options=cute_common.compile_options(arch, *extra_options))


def _as_words(packed: torch.Tensor) -> torch.Tensor:
    return packed.view(torch.int32)  # [E, rows, K/2] uint8 -> [E, rows, K/8] int32, no copy


def expert_pass(
    packed_a, scale_a, packed_b, scale_b, lists: expert_layout.ExpertLists, xb: torch.Tensor, out: torch.Tensor,
    glu: bool, situ_beta: float = 4.0, situ_linear_beta: float = 25.0, depth: int = PREFETCH_DEPTH,
    loader: str | None = None, splits: int = 1,
):
    """Run one pass into `out` (caller-allocated; tests poison it). xb [S, tokens, K] bf16 must be
    K-permuted and times 2^63 (`tokens_for_kernel`). `loader` None = DEFAULT_LOADER. splits > 1
    (pass 2): out is [splits * S, tokens, rows], split j's partial sums at slots j * S + s."""
    experts, rows, half_k = packed_a.shape
    tokens = xb.shape[1]
    if out.shape[0] != splits * xb.shape[0]:
        raise ValueError(f"out: {out.shape[0]} slots for {splits} split(s) of {xb.shape[0]} slots")
    compiled = compile_expert_gemm(
        experts, rows, half_k * 2, tokens, glu, cute_common.target_arch(xb.device), situ_beta, situ_linear_beta, depth,
        loader or DEFAULT_LOADER, splits=splits,
    )
    compiled(_as_words(packed_a), scale_a, _as_words(packed_b), scale_b, lists.slot_expert, xb, out)
    return out


def tokens_for_kernel(x: torch.Tensor, lists: expert_layout.ExpertLists) -> torch.Tensor:
    """x [T, K] bf16 -> the B operand [S, tokens, K]: gathered per slot, K-permuted (sm90 order), times 2^63."""
    return expert_layout.tokens_for_kernel(x, lists, "sm90")


LIST_THREADS = expert_layout.DEVICE_LIST_PAIRS  # one thread per (token, expert) pair


def _build_lists_kernel(tile_tokens: int, top_k: int):
    """One CTA that builds expert_layout.ExpertLists (same contents as build_expert_lists, one launch
    instead of ~16 torch kernels). Thread p owns pair p = t * k + j: its rank among the pairs of
    the same expert is the number of earlier pairs with that expert (earlier = smaller token), it
    opens a slot if its rank is 0, and its slot is the number of slot-opening pairs with a smaller
    expert id (slots in ascending expert order). O(P) per thread over the ids in shared memory."""

    @cute.jit
    def build(ids_s: cute.Tensor, pairs, slot_expert: cute.Tensor, slot_tokens: cute.Tensor,
              pair_position: cute.Tensor, tidx):
        opens_s = SmemAllocator().allocate_tensor(Int32, cute.make_layout(LIST_THREADS), 16)
        expert = ids_s[tidx]
        rank = Int32(0)
        for q in cutlass.range(pairs, unroll=1):
            if q < tidx and ids_s[q] == expert:
                rank += 1
        opens_s[tidx] = Int32(1) if rank == 0 and tidx < pairs else Int32(0)
        cute.arch.sync_threads()
        slot = Int32(0)
        for q in cutlass.range(pairs, unroll=1):
            if opens_s[q] == 1 and ids_s[q] < expert:
                slot += 1
        if tidx < pairs:
            if rank == 0:
                slot_expert[slot] = expert
            position = slot * tile_tokens + rank
            slot_tokens[position] = (tidx // top_k).to(Int64)
            pair_position[tidx] = position.to(Int64)

    @cute.jit
    def clear(slot_expert: cute.Tensor, slot_tokens: cute.Tensor, tidx):
        """unused slots: expert -1; padding rows: token 0"""
        slots = slot_expert.shape[0]
        for i in cutlass.range(tidx, slots, LIST_THREADS, unroll=1):
            slot_expert[i] = Int32(-1)
        for i in cutlass.range(tidx, slots * tile_tokens, LIST_THREADS, unroll=1):
            slot_tokens[i] = Int64(0)

    @cute.kernel
    def lists_kernel(ids: cute.Tensor, slot_expert: cute.Tensor, slot_tokens: cute.Tensor, pair_position: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        pairs = ids.shape[0]
        ids_s = SmemAllocator().allocate_tensor(Int32, cute.make_layout(LIST_THREADS), 16)
        clear(slot_expert, slot_tokens, tidx)
        expert = Int32(-1)
        if tidx < pairs:
            expert = ids[tidx].to(Int32)
        ids_s[tidx] = expert
        cute.arch.sync_threads()
        build(ids_s, pairs, slot_expert, slot_tokens, pair_position, tidx)

    @cute.jit
    def launch(ids: cute.Tensor, slot_expert: cute.Tensor, slot_tokens: cute.Tensor, pair_position: cute.Tensor, stream):
        lists_kernel(ids, slot_expert, slot_tokens, pair_position).launch(
            grid=(1, 1, 1), block=[LIST_THREADS, 1, 1], stream=stream
        )

    return launch


def compile_lists_kernel(tile_tokens: int, top_k: int, arch: str, extra_options: tuple = ()):
    key = ("moe_lists", tile_tokens, top_k, arch, tuple(extra_options))

    def build():
        pairs, slots, padded = cute.sym_int(), cute.sym_int(), cute.sym_int()
        ids = make_fake_compact_tensor(cutlass.Int64, (pairs,), assumed_align=8)
        slot_expert = make_fake_compact_tensor(cutlass.Int32, (slots,), assumed_align=4)
        slot_tokens = make_fake_compact_tensor(cutlass.Int64, (padded,), assumed_align=8)
        pair_position = make_fake_compact_tensor(cutlass.Int64, (pairs,), assumed_align=8)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        return cute.compile(
            _build_lists_kernel(tile_tokens, top_k), ids, slot_expert, slot_tokens, pair_position, stream,
            options=cute_common.compile_options(arch, *extra_options),
        )

    return _cache.get(key, build)


def build_expert_lists_device(ids: torch.Tensor, num_experts: int, tile_tokens: int) -> expert_layout.ExpertLists:
    """expert_layout.build_expert_lists in one CuTe kernel launch (same outputs; no host sync)."""
    expert_layout.check_device_list_ids(ids, tile_tokens, "list kernel")
    lists = expert_layout.empty_device_lists(ids, num_experts, tile_tokens)
    compiled = compile_lists_kernel(tile_tokens, ids.shape[1], cute_common.target_arch(ids.device))
    compiled(ids.contiguous().view(-1), lists.slot_expert, lists.slot_tokens.view(-1), lists.pair_position.view(-1))
    return lists


# How moe_experts builds its expert lists for up to one slot per expert (at most `token_tile`
# rows): "device" = the one-launch list kernel above, then gather_tokens' launch for the B operand;
# "fused" = one Triton launch for both (kernels/moe/triton.py lists_and_tokens, whose programs each
# derive the lists from the ids); "torch" = expert_layout.build_expert_lists (~16 small kernels: a
# sort, a scan, scatters). The list kernel equals the torch lists on the H200 (tests/gpu/test_moe_gpu.py;
# experiments/notes/moe.md); experiments/step_bench.py --setting moe_lists=torch|device|fused times each.
# "fused" saves a launch a MoE layer but repeats the lists' O(pairs^2) comparisons in every program: on
# the rank's few pairs it ran as fast as the two launches, and on the slice's 128 pairs (T = 8, 16
# experts a token) its step was slower (experiments/notes/rank.md, "Seventh round"), so it is not the default.
DEFAULT_LISTS = "device"


# Pass 2's K split (MxFp4ExpertGemmSm90 splits): 1 = none; "auto" = pass2_splits's rule. A rank's
# step has few slots (3 at batch 1 on the busiest of 16 ranks: docs/kimi-k3.md §8.3), so pass 2 runs
# 28 CTAs a slot on 132 SMs, and each CTA walks its 24 K chunks one after another; split, more CTAs
# share the SMs and each walks fewer. The triton combine adds the splits in the launch it already
# is. Off until experiments/step_bench.py --setting moe_pass2_splits=auto measures it.
PASS2_SPLITS: int | str = 1
# "auto" splits until pass 2 has at least this many CTAs per SM (three fit one SM's shared memory).
PASS2_CTAS_PER_SM = 2


def pass2_splits(rows: int, k: int, slots: int, device: torch.device) -> int:
    """How many ways pass 2 splits K for `slots` slots of w2 [rows, k] (PASS2_SPLITS; "auto": the
    fewest splits that give PASS2_CTAS_PER_SM CTAs per SM, at most 4, each an even chunk count)."""
    if PASS2_SPLITS != "auto":
        return PASS2_SPLITS
    chunks = k // K_CHUNK
    ctas = rows // ROW_TILE * slots
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    usable = [s for s in (1, 2, 3, 4) if chunks % s == 0 and (chunks // s) % 2 == 0]
    return next((s for s in usable if ctas * s >= PASS2_CTAS_PER_SM * sms), usable[-1])


# How moe_experts adds up each token's expert outputs: "torch" = gather them into [T, k, latent],
# then one multiply and one reduction (expert_layout.weighted_sum); "triton" = one launch that
# reads each pair's row where pass 2 wrote it and adds them in top-k order
# (kernels/moe/triton.py:weighted_combine). On the H200 the k3-slice step with "triton" ran
# fewer launches and was no slower (experiments/step_bench.py --setting moe_combine=torch times the
# other; experiments/notes/step.md); both match float64 on the GPU (tests/gpu/test_moe_gpu.py).
# Fewer launches per layer is #12's goal.
COMBINE = "triton"


def expert_lists(latent: torch.Tensor, ids: torch.Tensor, num_experts: int) -> expert_layout.ExpertLists:
    tile = token_tile(latent.shape[0])
    if DEFAULT_LISTS in ("device", "fused") and latent.shape[0] <= tile:  # the list kernel: one slot per expert
        return build_expert_lists_device(ids, num_experts, tile)
    return expert_layout.build_expert_lists(ids, num_experts, tile)


def expert_lists_and_tokens(latent: torch.Tensor, ids: torch.Tensor, num_experts: int):
    """(the expert lists, the B operand): one Triton launch where DEFAULT_LISTS is "fused" and one slot per
    expert holds the tokens (moe_triton.lists_and_tokens); else the lists, then tokens_for_kernel."""
    tile = token_tile(latent.shape[0])
    if DEFAULT_LISTS == "fused" and latent.shape[0] <= tile and expert_layout.TOKEN_GATHER == "triton":
        return moe_triton.lists_and_tokens(latent, ids, num_experts, tile,
                                           expert_layout.permutation("sm90", latent.device), expert_layout.B_SCALE_LOG2)
    lists = expert_lists(latent, ids, num_experts)
    return lists, tokens_for_kernel(latent, lists)


def routed_experts(latent: torch.Tensor, ids: torch.Tensor, experts: tuple, situ_beta: float, situ_linear_beta: float,
                   lists: expert_layout.ExpertLists | None = None):
    """The expert passes on the latent: [T, latent] bf16 -> expert outputs [T, k, latent] fp32
    (unweighted, in top-k order). `experts` = (w1_packed, w1_scale, w3_packed, w3_scale,
    w2_packed, w2_scale); `lists` are built from `ids` unless given."""
    lists = expert_lists(latent, ids, experts[0].shape[0]) if lists is None else lists
    return expert_layout.run_expert_passes(latent, lists, experts, tokens_for_kernel, expert_pass, situ_beta,
                                           situ_linear_beta)


def experts_supported(w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale) -> bool:
    """Expert shapes the kernel tiles: I a multiple of 64 (pass 1) and latent of 128 (pass 2),
    both K multiples of PREFETCH_DEPTH x 128 (chunks per main-loop step), contiguous packed codes."""
    num_experts, inter, half_latent = w1_packed.shape
    latent = half_latent * 2
    return (
        inter % GLU_ROWS == 0
        and latent % ROW_TILE == 0
        and latent % (PREFETCH_DEPTH * K_CHUNK) == 0
        and inter % (PREFETCH_DEPTH * K_CHUNK) == 0
        and expert_layout.experts_contiguous((w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale))
    )


def supports(latent: torch.Tensor, ids: torch.Tensor, route_weights: torch.Tensor, *experts: torch.Tensor) -> bool:
    return (latent.is_cuda and latent.dim() == 2 and latent.dtype == torch.bfloat16
            and latent.shape[0] >= 1 and experts_supported(*experts))


def moe_experts(latent, ids, route_weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale,
                situ_beta: float, situ_linear_beta: float) -> torch.Tensor:
    """ops.moe_experts (kernels/moe/reference.py is the contract) on the MXFP4 expert kernel;
    registered by kernels/moe/__init__.py."""
    experts = (w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale)
    reference.check_experts(latent, ids, route_weights, *experts)
    lists, xb = expert_lists_and_tokens(latent, ids, w1_packed.shape[0])
    splits = pass2_splits(w2_packed.shape[1], 2 * w2_packed.shape[2], lists.slot_expert.shape[0],
                          latent.device) if COMBINE == "triton" else 1
    rows = expert_layout.slot_outputs(latent, lists, experts, tokens_for_kernel, expert_pass, situ_beta,
                                      situ_linear_beta, splits, xb=xb)
    if COMBINE == "triton":  # adds the splits too
        return moe_triton.weighted_combine(rows, lists.pair_position, route_weights.float())
    return expert_layout.weighted_sum(route_weights, rows[0][lists.pair_position])
