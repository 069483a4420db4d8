"""Skinny dense GEMM for Hopper (sm_90a) in CuTe DSL: y[M, N] = x[M, K] @ W[N, K]^T, M <= 64.

Design (docs/kernels.md §7 row 1, §1.1; §5 for PDL):
- Swap-AB: the weight is the wide WGMMA "A" operand (a 128-row weight tile = two m64 WGMMAs of one
  warpgroup), the <= 64 tokens are the WGMMA "N" side (N = 8, 16, 32 or 64: cute_host.TOKEN_TILES;
  the registry sends it at most cute_host.HOPPER_MAX_TOKENS). The accumulator is y^T for the tile,
  128 x N fp32.
- TMA loads of weight and token tiles into a multi-stage mbarrier pipeline (PipelineTmaAsync);
  warp 0 produces, the warpgroup consumes. Out-of-bounds rows/columns (N = 576, M < token tile)
  are zero-filled by TMA, and the epilogue stores only in-bounds elements.
- Split-K so that small matrices fill the 132 SMs: grid = (weight tiles, 1, splits). With one
  split the epilogue writes bf16 y directly; with several, each split writes an fp32 partial
  y^T slice into a workspace and a second small kernel (same host call, PDL-launched) sums the
  splits and casts to bf16 (cute_parts.reduce). Options: `fused_reduce`, where the last
  split of each tile to finish does the sum in the GEMM kernel (cute_parts.fixup); `keep_partials`,
  where nothing sums them and the caller's next kernel adds them as it reads them (linear_partials;
  there an unsplit shape writes its one fp32 partial to the workspace too, not bf16 y).
  Splits, pipeline depth and reduction follow the H200 measurements in
  experiments/notes/skinny_gemm.md (bench runs 1 and 2).
- PDL: the kernel issues its first weight-tile loads before `griddepcontrol.wait` (weights never
  depend on the previous kernel), so they overlap the previous kernel's tail; the token loads and
  every global write come after the wait.

Numerics: bf16 products accumulated in fp32 by the tensor cores; split-K partials summed in fp32.
Not bit-identical to cuBLAS (different summation order); GPU tests compare with a float64
reference at 1e-2 relative error.
"""
# No `from __future__ import annotations`: CuTe DSL evaluates the kernels' annotations at trace time.

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.tensor_utils as tensor_utils
import cutlass.utils.hopper_helpers as sm90_utils
import torch
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

from .. import cute_common
from ..cute_pipelines import deferred_pipeline
from . import cute_host, cute_parts
from .cute_host import K_TILE, TOKEN_TILES, WEIGHT_TILE, choose_splits, choose_stages, split_counters, supports, token_tile


class SkinnyGemmSm90:
    """One compiled instance per (N, K, token tile, splits, dtype); M is a runtime value."""

    def __init__(
        self, n: int, k: int, tokens: int, splits: int, stages: int, fused_reduce: bool, use_pdl: bool,
        keep_partials: bool = False,
    ):
        if fused_reduce and keep_partials:
            raise ValueError("fused_reduce and keep_partials: the partials are either summed here or kept")
        self.n, self.k, self.tokens, self.splits, self.use_pdl = n, k, tokens, splits, use_pdl
        self.fused_reduce, self.keep_partials = fused_reduce, keep_partials
        self.tile_mnk = (WEIGHT_TILE, tokens, K_TILE)
        self.k_tiles = math.ceil(k / K_TILE)
        self.k_tiles_per_split = math.ceil(self.k_tiles / splits)
        self.stages = min(stages, self.k_tiles_per_split)  # no deeper than a split's work
        self.threads = 128  # one warpgroup

    # ---------------------------------------------------------------- host side
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
        """x [M, K], w [N, K], y [M, N]; workspace [splits, M, N] fp32 (any contents) and
        counters [weight tiles] int32, zero between calls (both unused with 1 split).

        `stream` is bound to torch's current stream by TVM-FFI (compiled with an env stream).
        """
        ab_dtype = w.element_type
        self.ab_dtype = ab_dtype
        m = x.shape[0]
        n, k = self.n, self.k
        # GEMM views in (rows, K, batch) form. The accumulator tile is y^T: (weight rows, tokens).
        mA = cute.make_tensor(w.iterator, cute.make_layout((n, k, 1), stride=(k, 1, n * k)))
        rows = x.stride[0]  # the token rows may be strided (a column slice of a wider GEMM's output)
        mB = cute.make_tensor(x.iterator, cute.make_layout((m, k, 1), stride=(rows, 1, m * rows)))
        mY = cute.make_tensor(y.iterator, cute.make_layout((n, m, 1), stride=(1, n, m * n)))
        if cutlass.const_expr(self.splits == 1 and not self.keep_partials):
            mC = mY
        else:
            # batch mode = split index: split s writes workspace[s, :, :]^T
            mC = cute.make_tensor(
                workspace.iterator, cute.make_layout((n, m, self.splits), stride=(1, n, m * n))
            )

        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            ab_dtype,
            ab_dtype,
            OperandMajorMode.K,
            OperandMajorMode.K,
            cutlass.Float32,
            (1, 1, 1),
            tiler_mn=(64, self.tokens),
        )
        a_smem_staged = sm90_utils.make_smem_layout_a(
            tensor_utils.LayoutEnum.ROW_MAJOR, self.tile_mnk, ab_dtype, self.stages
        )
        b_smem_staged = sm90_utils.make_smem_layout_b(
            tensor_utils.LayoutEnum.ROW_MAJOR, self.tile_mnk, ab_dtype, self.stages
        )
        a_smem = cute.slice_(a_smem_staged, (None, None, 0))
        b_smem = cute.slice_(b_smem_staged, (None, None, 0))
        tma_a, tma_tensor_a = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mA, a_smem, (WEIGHT_TILE, K_TILE)
        )
        tma_b, tma_tensor_b = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mB, b_smem, (self.tokens, K_TILE)
        )

        @cute.struct
        class SharedStorage:
            barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sA: cute.struct.Align[cute.struct.MemRange[ab_dtype, cute.cosize(a_smem_staged)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[ab_dtype, cute.cosize(b_smem_staged)], 1024]
            arrival: cutlass.Int32  # split-K: how many splits of this tile finished before us

        self.shared_storage = SharedStorage
        grid = (cute.ceil_div(n, WEIGHT_TILE), 1, self.splits)
        self.gemm_kernel(
            tma_a, tma_tensor_a, tma_b, tma_tensor_b, mC, mY, counters, tiled_mma, a_smem_staged, b_smem_staged
        ).launch(grid=grid, block=[self.threads, 1, 1], stream=stream, use_pdl=self.use_pdl)

        if cutlass.const_expr(self.splits > 1 and not self.fused_reduce and not self.keep_partials):
            cute_parts.reduce(workspace, y, m * n, self.splits, self.use_pdl, stream)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def gemm_kernel(
        self,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        mC: cute.Tensor,
        mY: cute.Tensor,
        counters: cute.Tensor,
        tiled_mma: cute.TiledMma,
        a_smem_staged: cute.ComposedLayout,
        b_smem_staged: cute.ComposedLayout,
    ):
        ab_dtype = self.ab_dtype
        warp_idx, tidx, tile_idx, split_idx, k_begin, k_count = cute_parts.split_coordinates(
            tma_a, tma_b, self.k_tiles_per_split, self.k_tiles
        )

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        a_stage_bytes = cute.size_in_bytes(ab_dtype, cute.slice_(a_smem_staged, (None, None, 0)))
        b_stage_bytes = cute.size_in_bytes(ab_dtype, cute.slice_(b_smem_staged, (None, None, 0)))
        mainloop = deferred_pipeline(pipeline.PipelineTmaAsync, storage.barriers, self.stages, self.threads // 32,
                                     tx_count=a_stage_bytes + b_stage_bytes)
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
        sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)

        # (tile rows, K_TILE, all k-tiles) views of this CTA's weight rows and of the tokens
        gA = cute.local_tile(mA, self.tile_mnk, (tile_idx, 0, None, 0), proj=(1, None, 1))
        gB = cute.local_tile(mB, self.tile_mnk, (tile_idx, 0, None, 0), proj=(None, 1, 1))
        tAsA, tAgA = cpasync.tma_partition(
            tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
        )
        tBsB, tBgB = cpasync.tma_partition(
            tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
        )

        thr_mma = tiled_mma.get_slice(tidx)
        tCsA = thr_mma.partition_A(sA)
        tCsB = thr_mma.partition_B(sB)
        tCrA = tiled_mma.make_fragment_A(tCsA)
        tCrB = tiled_mma.make_fragment_B(tCsB)
        gC = cute.local_tile(mC, self.tile_mnk, (tile_idx, 0, None, split_idx), proj=(1, 1, None))
        tCgC = thr_mma.partition_C(gC)
        accumulators = cute.make_rmem_tensor(tCgC.shape, cutlass.Float32)

        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

        # Prologue. Weight tiles first, before waiting on the previous grid (PDL): they do not
        # depend on it. Token tiles (the previous kernel's output) only after the wait.
        prefetch = cutlass.min(self.stages, k_count)
        producer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        producer = cute_parts.prefetch_weights(mainloop, producer, tma_a, tAgA, tAsA, k_begin, prefetch, warp_idx)
        cute.arch.griddepcontrol_wait()
        if warp_idx == 0:
            cute_parts.load_tokens(mainloop, tma_b, tBgB, tBsB, k_begin, prefetch, self.stages, commit=True)

        # Main loop: wait for a stage, issue its WGMMAs, release the stage consumed one
        # iteration earlier (its WGMMAs are then known complete) and refill that stage.
        consumer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        num_k_blocks = cute.size(tCrA, mode=[2])
        # Zeroed accumulators and ACCUMULATE always on: no first-iteration special case.
        accumulators.fill(0.0)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        for k_iter in cutlass.range(k_count, unroll=1):
            mainloop.consumer_wait(consumer)
            warpgroup.fence()
            for k_block in cutlass.range(num_k_blocks, unroll_full=True):
                coord = (None, None, k_block, consumer.index)
                cute.gemm(tiled_mma, accumulators, tCrA[coord], tCrB[coord], accumulators)
            warpgroup.commit_group()
            consumer.advance()
            if k_iter > 0:
                warpgroup.wait_group(1)
                mainloop.consumer_release(release)
                release.advance()
            # Refill only after a release: in iteration 0 no stage is free yet, and warp 0
            # blocking there would stall the warpgroup-wide WGMMAs of the next iteration.
            if k_iter > 0 and warp_idx == 0 and producer.count < k_count:
                producer = cute_parts.refill_stage(mainloop, producer, tma_a, tAgA, tAsA, tma_b, tBgB, tBsB, k_begin,
                                                   commit=True)
        warpgroup.wait_group(0)
        # Every load is issued: let the next kernel start its own weight prefetch.
        cute.arch.griddepcontrol_launch_dependents()

        # Epilogue: registers -> global, in-bounds elements only (N % 128 and M < tokens tails).
        out = cute.make_rmem_tensor(tCgC.shape, mC.element_type)
        out.store(accumulators.load().to(mC.element_type))
        coords = cute.make_identity_tensor(mC.shape)
        tCcC = thr_mma.partition_C(
            cute.local_tile(coords, self.tile_mnk, (tile_idx, 0, None, split_idx), proj=(1, 1, None))
        )
        for i in cutlass.range_constexpr(cute.size(out)):
            if cute.elem_less(tCcC[i], mC.shape):
                tCgC[i] = out[i]

        if cutlass.const_expr(self.splits > 1 and self.fused_reduce):
            cute_parts.fixup(
                mC, mY, counters, storage.arrival.ptr, tile_idx, tidx, WEIGHT_TILE, self.tokens, self.splits
            )


_cache = cute_common.CompileCache()


def compile_skinny_gemm(
    n: int,
    k: int,
    tokens: int,
    dtype: torch.dtype,
    arch: str,
    use_pdl: bool = True,
    stages: int | None = None,
    fused_reduce: bool = False,
    splits: int | None = None,
    extra_options: tuple = (),
    keep_partials: bool = False,
):
    """Compiled kernel for weight [n, k] and up to `tokens` rows, cached per (shape, dtype, arch).

    M (<= tokens) is a runtime value, so one compile serves every token count of a bucket.
    Defaults are the configuration measured best on the H200 (bench run 2): choose_splits,
    choose_stages and the two-pass split-K reduction (a second small kernel). `fused_reduce`
    instead sums the partials in the GEMM kernel (the last CTA of each tile does it: one launch,
    but serial, and slower than two passes for M >= 4 in run 2). `stages` and `splits` override
    the heuristics (for benchmarking them). `keep_partials` leaves the GEMM's fp32 partials in
    the workspace, unsummed (one launch; linear_partials).
    `extra_options` are added to cute.compile's (e.g. "--keep-ptx" for tests).
    Returns (compiled function taking (x, w, y, workspace, counters) torch tensors, split-K factor).
    """
    if tokens not in TOKEN_TILES:
        raise ValueError(f"tokens={tokens} must be one of {TOKEN_TILES}")
    k_tiles = math.ceil(k / K_TILE)
    if splits is None:
        splits = choose_splits(n, k)
    elif not 1 <= splits <= k_tiles or math.ceil(k_tiles / math.ceil(k_tiles / splits)) != splits:
        raise ValueError(f"splits={splits} must leave no split of the {k_tiles} k-tiles empty")
    if stages is None:
        stages = choose_stages(n, splits)
    elif stages < 2:
        raise ValueError(f"stages={stages} must be at least 2")
    key = ("linear_sm90", n, k, tokens, splits, stages, fused_reduce, keep_partials, dtype, arch, use_pdl,
           tuple(extra_options))

    def build():
        ab = cute_common.torch_to_cutlass_dtype(dtype)
        m = cute.sym_int()
        # rows at any stride that keeps TMA's 16-byte alignment (x_rows_supported)
        x = make_fake_tensor(ab, (m, k), (cute.sym_int(divisibility=8), 1), assumed_align=16)
        w = make_fake_compact_tensor(ab, (n, k), stride_order=(1, 0), assumed_align=16)
        y = make_fake_compact_tensor(ab, (m, n), stride_order=(1, 0), assumed_align=16)
        workspace = make_fake_compact_tensor(
            cutlass.Float32, (splits, m, n), stride_order=(2, 1, 0), assumed_align=16
        )
        counters = make_fake_compact_tensor(cutlass.Int32, (math.ceil(n / WEIGHT_TILE),), assumed_align=16)
        gemm = SkinnyGemmSm90(n, k, tokens, splits, stages, fused_reduce, use_pdl, keep_partials)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        return cute.compile(gemm, x, w, y, workspace, counters, stream, options=cute_common.compile_options(arch, *extra_options))

    return _cache.get(key, build), splits


def _checked_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x as the kernel takes it (rows TMA can read in place, else a contiguous copy), after refusing what
    it cannot compute."""
    if not supports(x, weight, TOKEN_TILES[-1]):
        raise ValueError(
            f"cute_sm90 linear: unsupported x {tuple(x.shape)} {x.dtype} / weight {tuple(weight.shape)} "
            f"{weight.dtype} stride {weight.stride()} (needs M <= {TOKEN_TILES[-1]}, K and N multiples of 8, "
            "bf16/fp16, contiguous weight)"
        )
    if not cute_host.x_rows_supported(x):
        x = x.clone(memory_format=torch.contiguous_format)
    return x


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, workspace: torch.Tensor | None = None):
    """out[M, N] = x @ weight^T into a caller-given buffer (tests poison it first).

    `workspace` ([splits, M, N] fp32) may be given to reuse or poison it; it is allocated if None.
    """
    x = _checked_rows(x, weight)
    m, n = x.shape[0], weight.shape[0]
    if out.shape != (m, n) or out.dtype != x.dtype or not out.is_contiguous() or out.device != x.device:
        raise ValueError(f"out must be a contiguous {x.dtype} [{m}, {n}] tensor on {x.device}, got {out.dtype} {tuple(out.shape)}")
    compiled, splits = compile_skinny_gemm(n, weight.shape[1], token_tile(m), x.dtype, cute_common.target_arch(x.device),
                                           fused_reduce=cute_host.FUSED_REDUCE)
    if workspace is None:
        # fp32 split-K partials; with one split it is never touched (the caching allocator makes
        # the allocation free, and the compiled signature stays the same).
        workspace = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    elif workspace.shape != (splits, m, n) or workspace.dtype != torch.float32:
        raise ValueError(f"workspace must be fp32 [{splits}, {m}, {n}], got {workspace.dtype} {tuple(workspace.shape)}")
    compiled(x, weight, out, workspace, split_counters(x.device, n))
    return out


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    return skinny_gemm(x, weight, out)


def linear_partials(x: torch.Tensor, weight: torch.Tensor, workspace: torch.Tensor | None = None) -> torch.Tensor:
    """ops.linear_partials: one launch, the split-K partials left unsummed in `workspace`, [splits, M, N]
    fp32 (an unsplit shape writes its one fp32 partial there too, unrounded). Allocated when None
    (tests pass it poisoned)."""
    x = _checked_rows(x, weight)
    m, n = x.shape[0], weight.shape[0]
    compiled, splits = compile_skinny_gemm(n, weight.shape[1], token_tile(m), x.dtype, cute_common.target_arch(x.device),
                                           keep_partials=True)
    workspace = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if workspace is None else workspace
    if workspace.shape != (splits, m, n) or workspace.dtype != torch.float32 or not workspace.is_contiguous():
        raise ValueError(f"workspace must be a contiguous fp32 [{splits}, {m}, {n}] tensor, got {workspace.dtype} "
                         f"{tuple(workspace.shape)}")
    # a keep_partials build never writes y; the compiled signature still takes one
    unused_y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    compiled(x, weight, unused_y, workspace, split_counters(x.device, n))
    return workspace
