"""Skinny dense GEMM for Blackwell (sm_100a B200 / sm_103a GB300) in CuTe DSL, tcgen05 + TMEM.

UNTESTED ON HARDWARE: no Blackwell GPU is available to this project yet. The kernel is compiled
for sm_100a and sm_103a in CI (tests/test_linear_cute_compile.py checks the PTX for tcgen05) but
has never run; it is registered for capability 10.x and must be validated with
tests/gpu/test_linear_gpu.py on a B200/GB300 before it is trusted.

Same design as the Hopper kernel (kernels/linear/cute_sm90.py; docs/kernels.md §7 row 1, GB300
note): swap-AB with a 128-row weight tile as the tcgen05 M side and the tokens as N = 16 (the
smallest N of an M = 128 UMMA), TMA into a multi-stage mbarrier pipeline, fp32 accumulator in
tensor memory, split-K with the Hopper-measured default (two-pass reduction,
cute_parts.reduce; the fused last-CTA one, cute_parts.fixup, is an option), PDL.
Warp 0 issues the TMA loads and the MMAs (one thread issues a UMMA for the whole CTA); all four
warps read the accumulator out of TMEM in the epilogue.
"""
# No `from __future__ import annotations`: CuTe DSL evaluates the kernels' annotations at trace time.
import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.tensor_utils as tensor_utils
import cutlass.utils.blackwell_helpers as sm100_utils
import torch
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from .. import cute_common
from ..cute_pipelines import deferred_pipeline
from . import cute_host, cute_parts
from .cute_host import K_TILE, MAX_TOKENS, WEIGHT_TILE, choose_splits, choose_stages, split_counters, supports

TOKENS = 16  # UMMA N for M = 128 must be a multiple of 16
B200_SMS = 148  # split-K is balanced for this many SMs when no GPU is visible (CPU compile checks)


def _num_sms() -> int:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return B200_SMS


class SkinnyGemmSm100:
    """One compiled instance per (N, K, splits, dtype, arch); M (<= 16) is a runtime value."""

    def __init__(self, n: int, k: int, splits: int, stages: int, fused_reduce: bool, use_pdl: bool):
        self.n, self.k, self.splits, self.use_pdl = n, k, splits, use_pdl
        self.fused_reduce = fused_reduce
        self.mma_tiler = (WEIGHT_TILE, TOKENS, K_TILE)
        self.k_tiles = math.ceil(k / K_TILE)
        self.k_tiles_per_split = math.ceil(self.k_tiles / splits)
        self.stages = min(stages, self.k_tiles_per_split)
        self.threads = 128

    @cute.jit
    def __call__(
        self,
        x: cute.Tensor,
        w: cute.Tensor,
        y: cute.Tensor,
        workspace: cute.Tensor,
        counters: cute.Tensor,
        stream: cuda.CUstream,
    ):
        """Same contract as SkinnyGemmSm90.__call__."""
        ab_dtype = w.element_type
        self.ab_dtype = ab_dtype
        m = x.shape[0]
        n, k = self.n, self.k
        mA = cute.make_tensor(w.iterator, cute.make_layout((n, k, 1), stride=(k, 1, n * k)))
        mB = cute.make_tensor(x.iterator, cute.make_layout((m, k, 1), stride=(k, 1, m * k)))
        mY = cute.make_tensor(y.iterator, cute.make_layout((n, m, 1), stride=(1, n, m * n)))
        if cutlass.const_expr(self.splits == 1):
            mC = mY
        else:
            mC = cute.make_tensor(
                workspace.iterator, cute.make_layout((n, m, self.splits), stride=(1, n, m * n))
            )
        self.c_layout = tensor_utils.LayoutEnum.from_tensor(mC)

        tiled_mma = sm100_utils.make_trivial_tiled_mma(
            ab_dtype,
            ab_dtype,
            OperandMajorMode.K,
            OperandMajorMode.K,
            cutlass.Float32,
            tcgen05.CtaGroup.ONE,
            self.mma_tiler[:2],
        )
        a_smem_staged = sm100_utils.make_smem_layout_a(tiled_mma, self.mma_tiler, ab_dtype, self.stages)
        b_smem_staged = sm100_utils.make_smem_layout_b(tiled_mma, self.mma_tiler, ab_dtype, self.stages)
        cluster_layout_vmnk = cute.tiled_divide(cute.make_layout((1, 1, 1)), (tiled_mma.thr_id.shape,))
        a_smem = cute.slice_(a_smem_staged, (None, None, None, 0))
        b_smem = cute.slice_(b_smem_staged, (None, None, None, 0))
        tma_a, tma_tensor_a = cute.nvgpu.make_tiled_tma_atom_A(
            cpasync.CopyBulkTensorTileG2SOp(), mA, a_smem, self.mma_tiler, tiled_mma, cluster_layout_vmnk.shape
        )
        tma_b, tma_tensor_b = cute.nvgpu.make_tiled_tma_atom_B(
            cpasync.CopyBulkTensorTileG2SOp(), mB, b_smem, self.mma_tiler, tiled_mma, cluster_layout_vmnk.shape
        )
        self.tma_bytes = cute.size_in_bytes(ab_dtype, a_smem) + cute.size_in_bytes(ab_dtype, b_smem)
        acc_shape = tiled_mma.partition_shape_C(self.mma_tiler[:2])
        self.tmem_cols = cutlass.memory.get_num_tmem_alloc_cols(tiled_mma.make_fragment_C(acc_shape))

        @cute.struct
        class SharedStorage:
            ab_barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            acc_barriers: cute.struct.MemRange[cutlass.Int64, 2]
            tmem_holding_buf: cutlass.Int32
            arrival: cutlass.Int32
            sA: cute.struct.Align[cute.struct.MemRange[ab_dtype, cute.cosize(a_smem_staged)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[ab_dtype, cute.cosize(b_smem_staged)], 1024]

        self.shared_storage = SharedStorage
        self.kernel(
            tiled_mma,
            tma_a,
            tma_tensor_a,
            tma_b,
            tma_tensor_b,
            mC,
            mY,
            counters,
            cluster_layout_vmnk,
            a_smem_staged,
            b_smem_staged,
        ).launch(
            grid=(cute.ceil_div(n, WEIGHT_TILE), 1, self.splits),
            block=[self.threads, 1, 1],
            stream=stream,
            use_pdl=self.use_pdl,
        )
        if cutlass.const_expr(self.splits > 1 and not self.fused_reduce):
            cute_parts.reduce(workspace, y, m * n, self.splits, self.use_pdl, stream)

    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        mC: cute.Tensor,
        mY: cute.Tensor,
        counters: cute.Tensor,
        cluster_layout_vmnk: cute.Layout,
        a_smem_staged: cute.ComposedLayout,
        b_smem_staged: cute.ComposedLayout,
    ):
        warp_idx, tidx, tile_idx, split_idx, k_begin, k_count = cute_parts.split_coordinates(
            tma_a, tma_b, self.k_tiles_per_split, self.k_tiles
        )

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        mainloop = deferred_pipeline(pipeline.PipelineTmaUmma, storage.ab_barriers, self.stages, 1,
                                     tx_count=self.tma_bytes, cta_layout=cluster_layout_vmnk)
        acc_pipeline = deferred_pipeline(pipeline.PipelineUmmaAsync, storage.acc_barriers, 1, self.threads,
                                         cta_layout=cluster_layout_vmnk)
        tmem = cutlass.memory.TmemAllocator(
            storage.tmem_holding_buf.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=1, num_threads=self.threads),
        )
        pipeline.pipeline_init_arrive(cluster_shape_mn=cluster_layout_vmnk, is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
        sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
        # (tile, k-tile) partitions of the weight and token matrices, as in the CUTLASS example
        gA = cute.local_tile(mA, cute.slice_(self.mma_tiler, (None, 0, None)), (None, None, None))
        gB = cute.local_tile(mB, cute.slice_(self.mma_tiler, (0, None, None)), (None, None, None))
        thr_mma = tiled_mma.get_slice(0)
        tAsA, tAgA = cpasync.tma_partition(
            tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 3), cute.group_modes(thr_mma.partition_A(gA), 0, 3)
        )
        tBsB, tBgB = cpasync.tma_partition(
            tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 3), cute.group_modes(thr_mma.partition_B(gB), 0, 3)
        )
        tAgA = tAgA[(None, tile_idx, None, 0)]
        tBgB = tBgB[(None, 0, None, 0)]
        tCrA = tiled_mma.make_fragment_A(sA)
        tCrB = tiled_mma.make_fragment_B(sB)
        acc_layout = tiled_mma.make_fragment_C(tiled_mma.partition_shape_C(self.mma_tiler[:2])).layout

        pipeline.pipeline_init_wait(cluster_shape_mn=cluster_layout_vmnk)
        tmem.allocate(self.tmem_cols)
        tmem.wait_for_alloc()
        tCtAcc = cute.make_tensor(tmem.retrieve_ptr(cutlass.Float32), acc_layout)

        # Prologue: weight tiles before the PDL wait, token tiles after it (see cute_sm90).
        prefetch = cutlass.min(self.stages, k_count)
        producer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        producer = cute_parts.prefetch_weights(mainloop, producer, tma_a, tAgA, tAsA, k_begin, prefetch, warp_idx)
        cute.arch.griddepcontrol_wait()
        if warp_idx == 0:
            cute_parts.load_tokens(mainloop, tma_b, tBgB, tBsB, k_begin, prefetch, self.stages, commit=False)

            # Main loop: UMMAs on a full stage; the release is a tcgen05 commit, so the stage
            # frees when those UMMAs complete, and the refill waits for exactly that.
            consumer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            num_k_blocks = cute.size(tCrA, mode=[2])
            tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
            for _ in cutlass.range(k_count, unroll=1):
                mainloop.consumer_wait(consumer)
                for k_block in cutlass.range(num_k_blocks, unroll_full=True):
                    coord = (None, None, k_block, consumer.index)
                    cute.gemm(tiled_mma, tCtAcc, tCrA[coord], tCrB[coord], tCtAcc)
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                mainloop.consumer_release(consumer)
                consumer.advance()
                if producer.count < k_count:
                    producer = cute_parts.refill_stage(mainloop, producer, tma_a, tAgA, tAsA, tma_b, tBgB, tBsB, k_begin,
                                                       commit=False)
            acc_pipeline.producer_commit(
                pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            )
        cute.arch.griddepcontrol_launch_dependents()

        # Epilogue: TMEM -> registers (all four warps), in-bounds elements -> global.
        tmem.relinquish_alloc_permit()
        acc_pipeline.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))
        tile_mn = self.mma_tiler[:2]
        t2r_atom = sm100_utils.get_tmem_load_op(
            (*tile_mn, K_TILE), self.c_layout, mC.element_type, cutlass.Float32, tile_mn, False
        )
        acc_tile = cute.flat_divide(tCtAcc[((None, None), 0, 0)], tile_mn)
        t2r = tcgen05.make_tmem_copy(t2r_atom, acc_tile[(None, None, 0, 0)])
        thr_t2r = t2r.get_slice(tidx)
        tTR_tAcc = thr_t2r.partition_S(acc_tile)[(None, None, None, 0, 0)]
        gC = cute.local_tile(mC, self.mma_tiler, (tile_idx, 0, None, split_idx), proj=(1, 1, None))
        coords = cute.local_tile(
            cute.make_identity_tensor(mC.shape), self.mma_tiler, (tile_idx, 0, None, split_idx), proj=(1, 1, None)
        )
        tTR_gC = thr_t2r.partition_D(cute.flat_divide(gC, tile_mn))[(None, None, None, 0, 0)]
        tTR_cC = thr_t2r.partition_D(cute.flat_divide(coords, tile_mn))[(None, None, None, 0, 0)]
        acc = cute.make_rmem_tensor(tTR_gC.shape, cutlass.Float32)
        cute.copy(t2r, tTR_tAcc, acc)
        out = cute.make_rmem_tensor(tTR_gC.shape, mC.element_type)
        out.store(acc.load().to(mC.element_type))
        for i in cutlass.range_constexpr(cute.size(out)):
            if cute.elem_less(tTR_cC[i], mC.shape):
                tTR_gC[i] = out[i]

        if cutlass.const_expr(self.splits > 1 and self.fused_reduce):
            cute_parts.fixup(
                mC, mY, counters, storage.arrival.ptr, tile_idx, tidx, WEIGHT_TILE, TOKENS, self.splits
            )
        pipeline.sync(barrier_id=2)
        tmem.free(tCtAcc.iterator)
        if warp_idx == 0:
            mainloop.producer_tail(producer)


_cache = cute_common.CompileCache()


def compile_skinny_gemm(
    n: int,
    k: int,
    dtype: torch.dtype,
    arch: str,
    use_pdl: bool = True,
    fused_reduce: bool = False,
    extra_options: tuple = (),
):
    """Compiled Blackwell kernel for weight [n, k] and up to 16 tokens; same contract and (Hopper-
    tuned, unmeasured here) defaults as cute_sm90.compile_skinny_gemm."""
    if arch not in ("sm_100a", "sm_103a"):
        raise ValueError(f"arch={arch!r}: the tcgen05 kernel targets sm_100a or sm_103a")
    num_sms = _num_sms()
    splits = choose_splits(n, k, num_sms)
    stages = choose_stages(n, splits, num_sms)
    key = ("linear_sm100", n, k, splits, stages, fused_reduce, dtype, arch, use_pdl, tuple(extra_options))

    def build():
        ab = cute_common.torch_to_cutlass_dtype(dtype)
        m = cute.sym_int()
        x = make_fake_compact_tensor(ab, (m, k), stride_order=(1, 0), assumed_align=16)
        w = make_fake_compact_tensor(ab, (n, k), stride_order=(1, 0), assumed_align=16)
        y = make_fake_compact_tensor(ab, (m, n), stride_order=(1, 0), assumed_align=16)
        workspace = make_fake_compact_tensor(cutlass.Float32, (splits, m, n), stride_order=(2, 1, 0), assumed_align=16)
        counters = make_fake_compact_tensor(cutlass.Int32, (math.ceil(n / WEIGHT_TILE),), assumed_align=16)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        gemm = SkinnyGemmSm100(n, k, splits, stages, fused_reduce, use_pdl)
        options = cute_common.compile_options(arch, *extra_options)
        return cute.compile(gemm, x, w, y, workspace, counters, stream, options=options)

    return _cache.get(key, build), splits


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, workspace: torch.Tensor | None = None):
    """out[M, N] = x @ weight^T on Blackwell (see the module docstring: never run on hardware)."""
    if not supports(x, weight):
        raise ValueError(
            f"cute_sm100 linear: unsupported x {tuple(x.shape)} {x.dtype} / weight {tuple(weight.shape)} "
            f"{weight.dtype} (needs M <= {MAX_TOKENS}, K and N multiples of 8, bf16/fp16, contiguous weight)"
        )
    m, n = x.shape[0], weight.shape[0]
    if out.shape != (m, n) or out.dtype != x.dtype or not out.is_contiguous() or out.device != x.device:
        raise ValueError(f"out must be a contiguous {x.dtype} [{m}, {n}] tensor on {x.device}, got {out.dtype} {tuple(out.shape)}")
    if not x.is_contiguous() or x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)
    compiled, splits = compile_skinny_gemm(n, weight.shape[1], x.dtype, cute_common.target_arch(x.device),
                                           fused_reduce=cute_host.FUSED_REDUCE)
    if workspace is None:
        workspace = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    compiled(x, weight, out, workspace, split_counters(x.device, n))
    return out


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    return skinny_gemm(x, weight, out)
