"""Device code shared by the skinny GEMM kernels (sm_90a and sm_100a/sm_103a): the TMA prologue of
their pipelines and the split-K reductions, the fused serial fix-up run inside the GEMM kernel and
the two-pass reduction, a second small kernel launched after it (docs/kernels.md §7 row 1)."""
# No `from __future__ import annotations`: CuTe DSL evaluates the device functions' annotations.

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import cpasync

REDUCE_THREADS = 256


@cute.jit
def split_coordinates(tma_a: cute.CopyAtom, tma_b: cute.CopyAtom, k_tiles_per_split: cutlass.Constexpr,
                      k_tiles: cutlass.Constexpr):
    """The start of both skinny GEMM kernels: warp 0 prefetches the two TMA descriptors, and this
    CTA learns its place, (warp_idx, tidx, tile_idx, split_idx, k_begin, k_count): weight tile
    tile_idx, split split_idx covering k-tiles [k_begin, k_begin + k_count) (choose_splits
    guarantees the range is non-empty)."""
    warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    tidx, _, _ = cute.arch.thread_idx()
    tile_idx, _, split_idx = cute.arch.block_idx()
    if warp_idx == 0:
        cpasync.prefetch_descriptor(tma_a)
        cpasync.prefetch_descriptor(tma_b)
    k_begin = split_idx * k_tiles_per_split
    k_count = cutlass.min(k_tiles_per_split, k_tiles - k_begin)
    return warp_idx, tidx, tile_idx, split_idx, k_begin, k_count


@cute.jit
def load_tile(mainloop, state, tma: cute.CopyAtom, gmem: cute.Tensor, smem: cute.Tensor, k_begin: cutlass.Int32):
    """TMA of k-tile k_begin + state.count of one operand into stage state.index, completing on
    that stage's barrier."""
    cute.copy(
        tma,
        gmem[(None, k_begin + state.count)],
        smem[(None, state.index)],
        tma_bar_ptr=mainloop.producer_get_barrier(state),
    )


@cute.jit
def prefetch_weights(mainloop, producer, tma_a: cute.CopyAtom, tAgA: cute.Tensor, tAsA: cute.Tensor,
                     k_begin: cutlass.Int32, prefetch: cutlass.Int32, warp_idx: cutlass.Int32):
    """First half of the prologue, issued before the PDL wait: warp 0 loads the first `prefetch`
    weight tiles of the split (weights never depend on the previous kernel, so the loads overlap
    its tail). Returns the advanced producer state."""
    if warp_idx == 0:
        for _ in cutlass.range(prefetch, unroll=1):
            mainloop.producer_acquire(producer)
            load_tile(mainloop, producer, tma_a, tAgA, tAsA, k_begin)
            producer.advance()
    return producer


@cute.jit
def load_tokens(mainloop, tma_b: cute.CopyAtom, tBgB: cute.Tensor, tBsB: cute.Tensor, k_begin: cutlass.Int32,
                prefetch: cutlass.Int32, stages: cutlass.Constexpr, commit: cutlass.Constexpr):
    """Second half of the prologue, after the PDL wait (the tokens are the previous kernel's
    output): the token tiles of the stages prefetch_weights filled, on the same barriers. `commit`:
    the pipeline's producer arrives on them too (PipelineTmaAsync; the UMMA pipeline needs none)."""
    token_loads = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
    for _ in cutlass.range(prefetch, unroll=1):
        load_tile(mainloop, token_loads, tma_b, tBgB, tBsB, k_begin)
        if cutlass.const_expr(commit):
            mainloop.producer_commit(token_loads)
        token_loads.advance()


@cute.jit
def refill_stage(mainloop, producer, tma_a: cute.CopyAtom, tAgA: cute.Tensor, tAsA: cute.Tensor,
                 tma_b: cute.CopyAtom, tBgB: cute.Tensor, tBsB: cute.Tensor, k_begin: cutlass.Int32,
                 commit: cutlass.Constexpr):
    """Main loop: once the stage `producer` points at is free, load the next k-tile of weights and
    tokens into it (`commit` as in load_tokens). Returns the advanced producer state."""
    mainloop.producer_acquire(producer)
    load_tile(mainloop, producer, tma_a, tAgA, tAsA, k_begin)
    load_tile(mainloop, producer, tma_b, tBgB, tBsB, k_begin)
    if cutlass.const_expr(commit):
        mainloop.producer_commit(producer)
    producer.advance()
    return producer


@cute.jit
def fixup(
    partials: cute.Tensor,
    y: cute.Tensor,
    counters: cute.Tensor,
    arrival_ptr: cute.Pointer,
    tile_idx: cutlass.Int32,
    tidx: cutlass.Int32,
    tile_rows: cutlass.Constexpr,
    tokens: cutlass.Constexpr,
    splits: cutlass.Constexpr,
):
    """The fused split-K reduction, a @cute.jit device function.

    Serial fixup (the CUDA threadFenceReduction pattern): every split of a weight tile has stored
    its fp32 partial; a gpu-scope fence publishes it, one thread counts the arrival on the tile's
    counter, and the last split to arrive sums all partials of the tile in split order
    (deterministic) and writes y, then re-arms the counter to zero for the next call. Each of the
    tile's threads owns one weight row (= one y column), so loads are coalesced.

    partials: (N, M, splits) fp32 view; y: (N, M, 1) view of y[M, N]; counters: (tiles,) int32;
    arrival_ptr: one int32 of shared memory; the CTA has `tile_rows` threads.
    """
    cute.arch.fence_acq_rel_gpu()
    cute.arch.sync_threads()
    arrival = cute.make_tensor(arrival_ptr, cute.make_layout(1))
    if tidx == 0:
        arrival[0] = cute.arch.atomic_add(
            counters.iterator + tile_idx, cutlass.Int32(1), sem="acq_rel", scope="gpu"
        )
    cute.arch.sync_threads()
    if arrival[0] == splits - 1:
        cute.arch.fence_acq_rel_gpu()
        row = tile_idx * tile_rows + tidx
        for token in cutlass.range_constexpr(tokens):
            if row < y.shape[0] and token < y.shape[1]:
                total = cutlass.Float32(0.0)
                for split in cutlass.range_constexpr(splits):
                    total += partials[row, token, split]
                y[row, token, 0] = total.to(y.element_type)
        if tidx == 0:
            counters[tile_idx] = cutlass.Int32(0)


@cute.kernel
def reduce_kernel(partials: cute.Tensor, y: cute.Tensor, total: cutlass.Int32, splits: cutlass.Constexpr):
    """partials (M*N, splits) -> y (M*N,): one thread per element of y, summed in split order."""
    cute.arch.griddepcontrol_wait()  # the partials come from the previous kernel
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = bidx * REDUCE_THREADS + tidx
    if i < total:
        acc = cutlass.Float32(0.0)
        for split in cutlass.range_constexpr(splits):
            acc += partials[i, split]
        y[i] = acc.to(y.element_type)


@cute.jit
def reduce(
    workspace: cute.Tensor,
    y: cute.Tensor,
    total: cutlass.Int32,
    splits: cutlass.Constexpr,
    use_pdl: cutlass.Constexpr,
    stream,
):
    """The two-pass split-K reduction: a second small kernel, launched right after the GEMM on the
    same stream (PDL), sums the fp32 partials workspace[splits, M, N] (compact) in split order
    (deterministic) and writes y[M, N] (compact) in y's dtype, total = M * N. Loads and stores are
    coalesced and every split's partial is read once."""
    partials = cute.make_tensor(workspace.iterator, cute.make_layout((total, splits), stride=(1, total)))
    y_flat = cute.make_tensor(y.iterator, cute.make_layout(total))
    reduce_kernel(partials, y_flat, total, splits).launch(
        grid=(cute.ceil_div(total, REDUCE_THREADS), 1, 1),
        block=[REDUCE_THREADS, 1, 1],
        stream=stream,
        use_pdl=use_pdl,
    )
