"""Routed MXFP4 experts for Blackwell (sm_100a B200 / sm_103a GB300) in CuTe DSL, tcgen05 + TMEM.

NEVER RUN: no Blackwell GPU is available to this project. The kernel is compiled for sm_100a and
sm_103a in CI (tests/test_moe_cute_compile.py checks the PTX for tcgen05) and is registered as
`moe_experts` "cute_sm100" for Blackwell capabilities only (10.0, 10.3), so nothing else ever
dispatches to it; tests/gpu/test_moe_gpu.py (the Blackwell per-pair test and the op test) must
pass on a B200/GB300 before its results are trusted there.

Why software dequantisation and not the native block-scaled MMA (docs/kernels.md §4.3 GB300
path, §7 row 2): tcgen05's MXFP4 kinds (mxf8f6f4, mxf4) need the tokens in an 8-bit or 4-bit MX
format too; FP8 E4M3 tokens carry ~3.6 % rms rounding per element, which alone breaks the op's
1e-2 contract. So the weights are dequantised to bf16 as on Hopper (cute_sm90.py: the same
exact bit trick, scale 2^(s-64), tokens times 2^63) and the MMA is kind::f16 with bf16 A and B.
The native path (MXF8 tokens x MXF4 weights, scales via tcgen05.cp into TMEM) is the next step
where the accuracy budget allows it.

Design (same grid and contract as cute_sm90.expert_pass; docs/kernels.md §4.3):
- grid = (row tiles, slots); 128 weight rows per CTA (pass 1: 64 w1 + the same 64 w3 rows) as
  the UMMA M side, the slot's tokens as N = 16 (the smallest N of an M = 128 UMMA).
- Each of the 128 threads owns one weight row: per 64-element K stage it loads the row's 32 code
  bytes (two 16-byte loads, prefetched two stages ahead in registers) and 2 scale bytes,
  dequantises them into 32 bf16 pairs and writes them into the stage's swizzled shared-memory A
  tile (one 16-byte vector per packed word; the K order inside each octet is
  expert_layout.octet_permutation, applied to the tokens as well), fences the async proxy and
  arrives on the stage's full barrier (PipelineAsyncUmma, 128 producers).
- The tokens (B) arrive by TMA (PipelineTmaUmma). Warp 0 waits for both halves of a stage,
  issues the UMMAs into the TMEM accumulator and releases the stage with a tcgen05 commit.
- Epilogue: TMEM -> registers. Pass 2 stores fp32 outputs per (slot, token, row). Pass 1 swaps
  rows through shared memory so that one thread holds gate (row r) and up (row r + 64), applies
  SiTU and stores act * 2^63 in bf16 in the octet K order that pass 2 reads.
"""
# No `from __future__ import annotations`: CuTe DSL evaluates the kernels' annotations at trace time.
import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.tensor_utils as tensor_utils
import cutlass.utils.blackwell_helpers as sm100_utils
import torch
from cutlass import Float32, Int32, Uint32
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05
from cutlass.memory import SmemAllocator, TmemAllocator, get_num_tmem_alloc_cols

from .. import cute_common
from ..cute_pipelines import deferred_pipeline
from . import cute_sm90, expert_layout, reference

ROW_TILE = 128
GLU_ROWS = ROW_TILE // 2
K_STAGE = 64  # bf16 elements per row per stage: one 128-byte swizzle row
TOKENS = 16  # UMMA N for M = 128 must be a multiple of 16
STAGES = 4
THREADS = 128



class MxFp4ExpertGemmSm100:
    def __init__(self, experts: int, rows: int, k: int, glu: bool, situ_beta: float, situ_linear_beta: float):
        self.experts, self.rows, self.k, self.glu = experts, rows, k, glu
        self.situ_beta, self.situ_linear_beta = situ_beta, situ_linear_beta
        self.stages_total = k // K_STAGE
        self.mma_tiler = (ROW_TILE, TOKENS, K_STAGE)
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
        """Same contract as MxFp4ExpertGemmSm90.__call__, with tokens = 16 and the octet K order."""
        slots = slot_expert.shape[0]
        k = self.k
        mB = cute.make_tensor(xb.iterator, cute.make_layout((TOKENS, k, slots), stride=(k, 1, TOKENS * k)))
        tiled_mma = sm100_utils.make_trivial_tiled_mma(
            cutlass.BFloat16, cutlass.BFloat16, OperandMajorMode.K, OperandMajorMode.K, Float32,
            tcgen05.CtaGroup.ONE, self.mma_tiler[:2],
        )
        a_smem_staged = sm100_utils.make_smem_layout_a(tiled_mma, self.mma_tiler, cutlass.BFloat16, STAGES)
        b_smem_staged = sm100_utils.make_smem_layout_b(tiled_mma, self.mma_tiler, cutlass.BFloat16, STAGES)
        cluster_layout_vmnk = cute.tiled_divide(cute.make_layout((1, 1, 1)), (tiled_mma.thr_id.shape,))
        b_smem = cute.slice_(b_smem_staged, (None, None, None, 0))
        tma_b, tma_tensor_b = cute.nvgpu.make_tiled_tma_atom_B(
            cpasync.CopyBulkTensorTileG2SOp(), mB, b_smem, self.mma_tiler, tiled_mma, cluster_layout_vmnk.shape
        )
        self.b_bytes = cute.size_in_bytes(cutlass.BFloat16, b_smem)
        acc_shape = tiled_mma.partition_shape_C(self.mma_tiler[:2])
        self.tmem_cols = get_num_tmem_alloc_cols(tiled_mma.make_fragment_C(acc_shape))

        @cute.struct
        class SharedStorage:
            a_barriers: cute.struct.MemRange[cutlass.Int64, STAGES * 2]
            b_barriers: cute.struct.MemRange[cutlass.Int64, STAGES * 2]
            acc_barriers: cute.struct.MemRange[cutlass.Int64, 2]
            tmem_holding_buf: cutlass.Int32
            sA: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(a_smem_staged)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(b_smem_staged)], 1024]
            exchange: cute.struct.Align[cute.struct.MemRange[Float32, ROW_TILE * TOKENS], 16]

        self.shared_storage = SharedStorage
        self.kernel(
            tiled_mma, wa, sa, wb, sb, slot_expert, tma_b, tma_tensor_b, out, cluster_layout_vmnk,
            a_smem_staged, b_smem_staged,
        ).launch(grid=(self.row_tiles, slots, 1), block=[THREADS, 1, 1], stream=stream)

    @cute.jit
    def load_stage(self, wa, sa, wb, sb, expert, row, use_b, stage, raw: cute.Tensor, scales: cute.Tensor):
        """This thread's row: 32 code bytes (8 int32) and 2 scale bytes of K stage `stage`."""
        for half in cutlass.range_constexpr(2):
            dst = cute.local_tile(raw, (4,), (half,))
            if use_b:
                cute.autovec_copy(cute.local_tile(wb[expert, row, None], (4,), (stage * 2 + half,)), dst)
                scales[half] = sb[expert, row, stage * 2 + half].to(Int32)
            else:
                cute.autovec_copy(cute.local_tile(wa[expert, row, None], (4,), (stage * 2 + half,)), dst)
                scales[half] = sa[expert, row, stage * 2 + half].to(Int32)

    @cute.jit
    def dequantise_into(self, raw: cute.Tensor, scales: cute.Tensor, sA_row: cute.Tensor):
        """Word q (elements 8q..8q+7) -> 4 bf16 pairs (i, i+4) -> one 16-byte vector at 8q."""
        words = cute.make_rmem_tensor((4,), Uint32)
        octet = cute.recast_tensor(words, cutlass.BFloat16)
        for q in cutlass.range_constexpr(8):
            exponent = (scales[q // 4] + (127 - 64)).to(Uint32)  # bf16 2^(scale - 64)
            scale2 = Int32(exponent << 7 | exponent << 23)
            word = raw[q].to(Uint32)
            for i in cutlass.range_constexpr(4):
                x = word >> (4 * i)
                bits = ((x << 6) & expert_layout.MAGNITUDE_BITS) | ((x << 12) & expert_layout.SIGN_BITS)
                words[i] = cute.arch.fma_packed_bf16x2(Int32(bits), scale2, Int32(0))
            cute.autovec_copy(octet, cute.local_tile(sA_row, (8,), (q,)))

    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        wa: cute.Tensor,
        sa: cute.Tensor,
        wb: cute.Tensor,
        sb: cute.Tensor,
        slot_expert: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        out: cute.Tensor,
        cluster_layout_vmnk: cute.Layout,
        a_smem_staged: cute.ComposedLayout,
        b_smem_staged: cute.ComposedLayout,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        tile_idx, slot, _ = cute.arch.block_idx()
        expert = slot_expert[slot]
        if expert >= 0:
            # this thread's weight row; in pass 1 rows 64..127 of the tile are w3's
            use_b = False
            row = tile_idx * ROW_TILE + tidx
            if cutlass.const_expr(self.glu):
                use_b = tidx >= GLU_ROWS
                row = tile_idx * GLU_ROWS + tidx % GLU_ROWS
            raw0 = cute.make_rmem_tensor((8,), Int32)
            raw1 = cute.make_rmem_tensor((8,), Int32)
            scales0 = cute.make_rmem_tensor((2,), Int32)
            scales1 = cute.make_rmem_tensor((2,), Int32)
            self.load_stage(wa, sa, wb, sb, expert, row, use_b, 0, raw0, scales0)
            self.load_stage(wa, sa, wb, sb, expert, row, use_b, 1, raw1, scales1)

            storage = SmemAllocator().allocate(self.shared_storage)
            a_pipe, b_pipe, acc_pipe, tmem = self.make_pipelines(storage, cluster_layout_vmnk)

            sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
            sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
            gB = cute.local_tile(mB, cute.slice_(self.mma_tiler, (0, None, None)), (None, None, None))
            thr_mma = tiled_mma.get_slice(0)
            tBsB, tBgB = cpasync.tma_partition(
                tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 3), cute.group_modes(thr_mma.partition_B(gB), 0, 3)
            )
            tBgB = tBgB[(None, 0, None, slot)]
            tCrA = tiled_mma.make_fragment_A(sA)
            tCrB = tiled_mma.make_fragment_B(sB)
            acc_layout = tiled_mma.make_fragment_C(tiled_mma.partition_shape_C(self.mma_tiler[:2])).layout
            # (row, k, stage) view of the A tiles for the dequantising writers (the staged
            # layout's domain is ((128, 16), 1, 4, stages) = row + 128 k + 8192 stage)
            sA_rows = cute.make_tensor(
                sA.iterator,
                cute.composition(a_smem_staged.outer, cute.make_layout((ROW_TILE, K_STAGE, STAGES), stride=(1, ROW_TILE, ROW_TILE * K_STAGE))),
            )

            pipeline.pipeline_init_wait(cluster_shape_mn=cluster_layout_vmnk)
            tmem.allocate(self.tmem_cols)
            tmem.wait_for_alloc()
            tCtAcc = cute.make_tensor(tmem.retrieve_ptr(Float32), acc_layout)

            b_producer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES)
            if warp_idx == 0:
                for _ in cutlass.range(cutlass.min(STAGES, self.stages_total), unroll=1):
                    self.issue_tokens(b_pipe, b_producer, tma_b, tBgB, tBsB)
                    b_producer.advance()

            a_producer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES)
            consumer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
            num_k_blocks = cute.size(tCrA, mode=[2])
            tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
            for pair in cutlass.range(self.stages_total // 2, unroll=1):
                for half in cutlass.range_constexpr(2):
                    stage = pair * 2 + half
                    raw = raw0 if half == 0 else raw1
                    scales = scales0 if half == 0 else scales1
                    # every thread dequantises its row of the next A stage
                    a_pipe.producer_acquire(a_producer)
                    self.dequantise_into(raw, scales, sA_rows[(tidx, None, a_producer.index)])
                    cute.arch.fence_proxy("async.shared", space="cta")  # generic writes -> UMMA reads
                    a_pipe.producer_commit(a_producer)
                    a_producer.advance()
                    ahead = cutlass.min(stage + 2, self.stages_total - 1)
                    self.load_stage(wa, sa, wb, sb, expert, row, use_b, ahead, raw, scales)
                    # warp 0 multiplies the stage once both A and B are in
                    if warp_idx == 0:
                        a_pipe.consumer_wait(consumer)
                        b_pipe.consumer_wait(consumer)
                        for k_block in cutlass.range(num_k_blocks, unroll_full=True):
                            coord = (None, None, k_block, consumer.index)
                            cute.gemm(tiled_mma, tCtAcc, tCrA[coord], tCrB[coord], tCtAcc)
                            tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                        a_pipe.consumer_release(consumer)
                        b_pipe.consumer_release(consumer)
                        consumer.advance()
                        if b_producer.count < self.stages_total:
                            self.issue_tokens(b_pipe, b_producer, tma_b, tBgB, tBsB)
                            b_producer.advance()
            if warp_idx == 0:
                acc_pipe.producer_commit(pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1))

            tmem.relinquish_alloc_permit()
            acc_pipe.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))
            self.store_tile(tCtAcc, storage, out, slot, tile_idx, tidx)
            pipeline.sync(barrier_id=3)
            tmem.free(tCtAcc.iterator)
            if warp_idx == 0:
                b_pipe.producer_tail(b_producer)

    @cute.jit
    def make_pipelines(self, storage, cluster_layout_vmnk):
        """A: the 128 dequantising threads produce, the MMA consumes; B: TMA produces; the
        accumulator: the MMA's commit produces, the epilogue's 128 threads consume; and the
        TMEM allocator."""
        a_pipe = deferred_pipeline(pipeline.PipelineAsyncUmma, storage.a_barriers, STAGES, 1, producers=THREADS,
                                   cta_layout=cluster_layout_vmnk)
        b_pipe = deferred_pipeline(pipeline.PipelineTmaUmma, storage.b_barriers, STAGES, 1, tx_count=self.b_bytes,
                                   cta_layout=cluster_layout_vmnk)
        acc_pipe = deferred_pipeline(pipeline.PipelineUmmaAsync, storage.acc_barriers, 1, THREADS,
                                     cta_layout=cluster_layout_vmnk)
        tmem = TmemAllocator(
            storage.tmem_holding_buf.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=1, num_threads=THREADS),
        )
        pipeline.pipeline_init_arrive(cluster_shape_mn=cluster_layout_vmnk, is_relaxed=True)
        return a_pipe, b_pipe, acc_pipe, tmem

    @cute.jit
    def issue_tokens(self, b_pipe, b_producer, tma_b, tBgB, tBsB):
        """Warp 0: TMA the tokens of K stage b_producer.count."""
        b_pipe.producer_acquire(b_producer)
        cute.copy(tma_b, tBgB[(None, b_producer.count)], tBsB[(None, b_producer.index)],
                  tma_bar_ptr=b_pipe.producer_get_barrier(b_producer))

    @cute.jit
    def store_tile(self, tCtAcc, storage, out, slot, tile_idx, tidx):
        """Epilogue: TMEM -> registers (thread t holds tile row t's tokens); pass 1 the SiTU-GLU
        activations (store_act, through shared memory), pass 2 the fp32 outputs."""
        tile_mn = self.mma_tiler[:2]
        t2r_atom = sm100_utils.get_tmem_load_op(
            (*tile_mn, K_STAGE), tensor_utils.LayoutEnum.COL_MAJOR, Float32, Float32, tile_mn, False
        )
        acc_tile = cute.flat_divide(tCtAcc[((None, None), 0, 0)], tile_mn)
        t2r = tcgen05.make_tmem_copy(t2r_atom, acc_tile[(None, None, 0, 0)])
        thr_t2r = t2r.get_slice(tidx)
        tTR_tAcc = thr_t2r.partition_S(acc_tile)[(None, None, None, 0, 0)]
        coords = thr_t2r.partition_D(cute.flat_divide(cute.make_identity_tensor(tile_mn), tile_mn))[
            (None, None, None, 0, 0)
        ]
        acc = cute.make_rmem_tensor(coords.shape, Float32)
        cute.copy(t2r, tTR_tAcc, acc)
        if cutlass.const_expr(self.glu):
            exchange = storage.exchange.get_tensor(cute.make_layout((ROW_TILE, TOKENS), stride=(TOKENS, 1)))
            for i in cutlass.range_constexpr(cute.size(acc)):
                tile_row, token = coords[i]
                exchange[tile_row, token] = acc[i]
            pipeline.sync(barrier_id=2)
            self.store_act(exchange, out, slot, tile_idx, tidx)
        else:
            for i in cutlass.range_constexpr(cute.size(acc)):
                tile_row, token = coords[i]
                out[slot, token, tile_idx * ROW_TILE + tile_row] = acc[i]

    @cute.jit
    def store_act(self, exchange: cute.Tensor, out: cute.Tensor, slot, tile_idx, tidx):
        """Threads 0..63: SiTU-GLU (docs/kimi-k3.md §1.2) of gate row t and up row t + 64."""
        beta, linear_beta = self.situ_beta, self.situ_linear_beta
        if tidx < GLU_ROWS:
            r = tile_idx * GLU_ROWS + tidx
            # octet order (expert_layout.octet_permutation): element p of an octet sits at 2 (p % 4) + p // 4
            within = r % 8
            position = r - within + 2 * (within % 4) + within // 4
            for token in cutlass.range_constexpr(TOKENS):
                gate = exchange[tidx, token]
                up = exchange[tidx + GLU_ROWS, token]
                sigmoid = Float32(1.0) / (Float32(1.0) + cute.math.exp(-gate))
                act = (beta * cute.math.tanh(gate / beta) * sigmoid) * (linear_beta * cute.math.tanh(up / linear_beta))
                act = act * Float32(2.0**expert_layout.B_SCALE_LOG2)
                out[slot, token, position] = act.to(cutlass.BFloat16)




_cache = cute_common.CompileCache()


def compile_expert_gemm(
    experts: int,
    rows: int,
    k: int,
    glu: bool,
    arch: str,
    situ_beta: float = 4.0,
    situ_linear_beta: float = 25.0,
    extra_options: tuple = (),
):
    """Compiled Blackwell expert kernel (pass 1 if glu, else pass 2); slots of 16 token rows."""
    if arch not in ("sm_100a", "sm_103a"):
        raise ValueError(f"arch={arch!r}: the tcgen05 kernel targets sm_100a or sm_103a")
    if k % (2 * K_STAGE):
        raise ValueError(f"k={k}: the expert kernel needs a multiple of {2 * K_STAGE}")
    if rows % (GLU_ROWS if glu else ROW_TILE):
        raise ValueError(f"rows={rows}: not a multiple of the row tile")
    key = ("moe_sm100", experts, rows, k, glu, situ_beta, situ_linear_beta, arch, tuple(extra_options))

    def build():
        gemm = MxFp4ExpertGemmSm100(experts, rows, k, glu, situ_beta, situ_linear_beta)
        return cute_sm90.compile_expert_kernel(gemm, experts, rows, k, TOKENS, glu, arch, extra_options)

    return _cache.get(key, build)


def tokens_for_kernel(x: torch.Tensor, lists: expert_layout.ExpertLists) -> torch.Tensor:
    """x [T, K] bf16 -> the B operand [S, tokens, K]: gathered per slot, K-permuted (sm100 order), times 2^63."""
    return expert_layout.tokens_for_kernel(x, lists, "sm100")


def expert_pass(packed_a, scale_a, packed_b, scale_b, lists: expert_layout.ExpertLists, xb: torch.Tensor,
                out: torch.Tensor, glu: bool, situ_beta: float = 4.0, situ_linear_beta: float = 25.0):
    """One pass into `out` [S, 16, rows] (pass 1: bf16 act, octet K order, times 2^63; pass 2:
    fp32); lists built with tile_tokens = 16 and xb = tokens_for_kernel(...). Never run."""
    experts, rows, half_k = packed_a.shape
    if xb.shape[1] != TOKENS or lists.slot_tokens.shape[1] != TOKENS:
        raise ValueError(f"xb/lists: the Blackwell kernel takes slots of {TOKENS} token rows, got {xb.shape[1]}")
    compiled = compile_expert_gemm(
        experts, rows, half_k * 2, glu, cute_common.target_arch(xb.device), situ_beta, situ_linear_beta
    )
    compiled(packed_a.view(torch.int32), scale_a, packed_b.view(torch.int32), scale_b, lists.slot_expert, xb, out)
    return out


def experts_supported(w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale) -> bool:
    """Expert shapes the kernel tiles: I a multiple of 64 (pass 1 rows) and of 128 (pass 2 K),
    latent a multiple of 128 (pass 2 rows, pass 1 K), contiguous packed codes."""
    _, inter, half_latent = w1_packed.shape
    latent = half_latent * 2
    return (inter % GLU_ROWS == 0 and latent % ROW_TILE == 0 and latent % (2 * K_STAGE) == 0
            and inter % (2 * K_STAGE) == 0
            and expert_layout.experts_contiguous((w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale)))


def supports(latent: torch.Tensor, ids: torch.Tensor, route_weights: torch.Tensor, *experts: torch.Tensor) -> bool:
    return (latent.is_cuda and latent.dim() == 2 and latent.dtype == torch.bfloat16
            and latent.shape[0] >= 1 and experts_supported(*experts))  # past 16 rows: several slots per expert


def moe_experts(latent, ids, route_weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale,
                situ_beta: float, situ_linear_beta: float) -> torch.Tensor:
    """ops.moe_experts (kernels/moe/reference.py is the contract) on the tcgen05 expert kernel;
    registered by kernels/moe/__init__.py for Blackwell. Never run (see the module docstring)."""
    experts = (w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale)
    reference.check_experts(latent, ids, route_weights, *experts)
    lists = expert_layout.build_expert_lists(ids, w1_packed.shape[0], TOKENS)
    expert_out = expert_layout.run_expert_passes(latent, lists, experts, tokens_for_kernel, expert_pass, situ_beta,
                                                 situ_linear_beta)
    return expert_layout.weighted_sum(route_weights, expert_out)
