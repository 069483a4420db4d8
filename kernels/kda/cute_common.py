"""KDA verify + commit as CuTe DSL kernels, shared by the sm_90a and sm_100a/sm_103a builds.

The recurrence is SIMT work (fp32 FMAs, warp shuffles, shared-memory broadcasts): no wgmma or
tcgen05, so the same kernel body is compiled for Hopper and Blackwell; only the target differs
(spec: kernels.md §7 rows 4-5, "same kernel (SIMT-heavy, portable)").

Verify (one launch per layer, output-only; spec: kimi-k3.md §2.1, §2.3 "output-only verify"):
  grid (V-split, head, request), cluster = the V-splits of one head (block_v columns per CTA;
  the default is one CTA per head, the fastest on the H200: experiments/notes/kda.md). Each CTA holds a
  [D x BV] slice of the fp32 state in registers (read once, never written), recomputes the
  head's conv4+SiLU, L2 norms, gate and beta for all T tokens into shared memory, runs the
  T-step delta rule, and writes per-position records (k, u, exp(g)) for commit. The head-wide
  RMSNorm of the output needs the sum of squares over all V columns: the V-split CTAs of one
  head exchange their partial sums through distributed shared memory inside the cluster.
Commit (one launch for a stack of layers): replays the accepted prefix from the records
  (S <- exp(g) * S; S <- S + k u^T) and shifts the conv window by the accepted count. Records
  do not depend on block_v, so verify and commit pick theirs independently (commit: 4 CTAs/head).

Thread layout of a state slice (options cols C, row_chunks RC): warp w owns state rows
[kc*R, (kc+1)*R) with kc = w % RC and R = D / RC, and column block vc = w // RC; lane l owns
columns vc*32*C + l + 32*c for c < C. A warp reads rows of the state (32 consecutive floats,
coalesced), reads k/q/exp(g) as shared-memory broadcasts (one per row, shared by the thread's C
columns: more columns per thread means fewer shared-memory reads per FMA), and reduces over its
R rows serially; the RC row chunks are summed through shared memory in a fixed order, so every
thread of a column gets the same bits, and verify and commit apply the same mul + fma per step
whatever either's layout.
"""
import functools

import torch

from ..cute_common import CompileCache, compile_options, torch_to_cutlass_dtype
from .reference import KDARecords

ROW_CHUNKS = 4  # default row_chunks: the warps a column's rows are split over; partial dots meet in smem
MAX_TOKENS = 16  # verify width supported: T = 1..16 (k <= 15 drafts)
L2_EPS = 1e-6  # q, k <- x / sqrt(sum x^2 + 1e-6) (kimi-k3.md §2.1 step 2)

_cache = CompileCache()


def default_variant(head_dim: int, op: str) -> dict:
    """Kernel options per op, from the H200 benches at K3 dims, B=1, T=8 (experiments/notes/kda.md).

    Verify: one CTA per head (no cluster exchange, the q/k conv not repeated per V-split: 17.2 us
    vs 28.9 us with 4 CTAs/head, session 2 round 1), fast math (17.2 vs 18.8 us, same errors), the
    state copied by the TMA unit with per-block barriers and PDL (17.1 us, round 2). The default is
    the combination that passed every GPU test in round 2: with register state loads
    (bulk_state=False) verify's outputs were NOT bitwise equal to one-token decode in round 2 (3
    failing cases, cause not found), so those remain options for measurement only. Commit: 4 CTAs
    per head with the TMA-unit state copy and PDL, the commit that passed the bitwise decode test
    with this verify (6.5 us per layer in the all-layers launch; 5.5 us with register loads)."""
    if op == "verify":
        return dict(block_v=head_dim, cols=1, row_chunks=ROW_CHUNKS, fast_math=True, bulk_state=True,
                    group_sync=True, pdl=True)
    return dict(block_v=32, cols=1, row_chunks=ROW_CHUNKS, bulk_state=True, pdl=True)


def resolve_variant(head_dim: int, op: str, **given) -> dict:
    """The default variant of `op` with the options the caller gave (None = default)."""
    variant = default_variant(head_dim, op)
    variant.update({name: value for name, value in given.items() if value is not None})
    return variant


def _check_head_dim(head_dim: int, block_v: int) -> None:
    if head_dim % 32 != 0 or head_dim > 128:
        raise ValueError(f"head_dim={head_dim}: the CuTe KDA kernels need a multiple of 32, at most 128")
    if block_v % 32 != 0 or head_dim % block_v != 0:
        raise ValueError(f"block_v={block_v}: must be a multiple of 32 that divides head_dim={head_dim}")
    if head_dim // block_v > 8:
        raise ValueError(f"block_v={block_v}: more than 8 V-splits per head (cluster limit)")


# ----------------------------------------------------------------------------------------------
# verify


def _check_layout(head_dim: int, block_v: int, cols: int, row_chunks: int) -> None:
    """The thread layout of a [head_dim x block_v] state slice (see the module docstring)."""
    if cols not in (1, 2, 4) or block_v % (32 * cols) != 0:
        raise ValueError(f"cols={cols}: must be 1, 2 or 4 with 32*cols dividing block_v={block_v}")
    if row_chunks not in (2, 4, 8) or head_dim % row_chunks != 0:
        raise ValueError(f"row_chunks={row_chunks}: must be 2, 4 or 8 and divide head_dim={head_dim}")
    threads = row_chunks * block_v // cols
    if not head_dim <= threads <= 1024:
        raise ValueError(f"row_chunks={row_chunks}, block_v={block_v}, cols={cols}: {threads} threads per CTA, "
                         f"need head_dim={head_dim}..1024")


BULK_COPY_PTX = ("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
                 "[{$r0}], [{$r1}], {$r2}, [{$r3}];")


def _bulk_state_copier(head_dim: int, block_v: int):
    """A @cute.jit function that starts the copy of one CTA's [head_dim x block_v] fp32 state
    slice from global to shared memory on the TMA unit (cp.async.bulk, no registers, no per-thread
    requests) and a function that waits for it. Run 1-2 of session 2 measured the register loads
    (32 x 4-byte loads per thread) at ~7 us for the 64 KB of a head, far under the per-SM
    bandwidth; bulk copies are the Hopper way to stream a large contiguous block into an SM.

    start(state_row0, smem, mbar, lane, warp): warp 0 issues the copies (a whole-head slice is one
    contiguous block, cut in 32 pieces; a narrower slice is one copy per row) and lane 0 arms the
    mbarrier with the byte count; state_row0 points at row 0, column vs*block_v of the slice.
    """
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32

    D, BV = head_dim, block_v
    CONTIGUOUS = BV == D
    PIECES = 32 if CONTIGUOUS else D  # copies per slice
    ROWS_PER_PIECE = D // 32 if CONTIGUOUS else 1
    PIECE_BYTES = ROWS_PER_PIECE * BV * 4
    GLOBAL_ROW = D  # floats between rows of the state in global memory

    @cute.jit
    def start(state_row0: cute.Pointer, smem: cute.Tensor, mbar: cute.Pointer, lane: Int32, warp: Int32):
        if warp == 0:
            if lane == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(mbar, D * BV * 4)
            for i in cutlass.range_constexpr(PIECES // 32):
                row = (lane + 32 * i) * ROWS_PER_PIECE
                cute.arch.inline_ptx(
                    BULK_COPY_PTX,
                    read_only_args=[smem.iterator + row * BV, state_row0 + row * GLOBAL_ROW, Int32(PIECE_BYTES),
                                    mbar],
                )

    return start


def _tree_sum(values, first: int, count: int, stride: int):
    """Pairwise sum of values[first + stride * a] for a < count (a power of two), a fixed order."""
    if count == 1:
        return values[first]
    half = count // 2
    return _tree_sum(values, first, half, stride) + _tree_sum(values, first + half * stride, half, stride)


def _build_verify(arch: str, head_dim: int, block_v: int, max_tokens: int, in_dtype, conv_dtype, cols: int,
                  row_chunks: int, fast_math: bool, bulk_state: bool, group_sync: bool, pdl: bool, probe: bool,
                  extra_options):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64
    from cutlass.memory import SmemAllocator

    D, BV, TM, C, RC = head_dim, block_v, max_tokens, cols, row_chunks
    NV = D // BV  # V-split CTAs per head (= cluster size)
    R = D // RC  # state rows per thread
    NT = RC * BV // C  # threads per CTA
    NWARPS = NT // 32
    NCONV = 2 * D + BV  # conv outputs per token in this CTA: q (D), k (D), this CTA's v slice (BV)
    CONV_ROUNDS = (NCONV + NT - 1) // NT  # conv channels per thread
    PER_LANE = D // 32
    # partial sums per dot product and column: short dependent FMA chains (more columns per
    # thread give independent chains of their own)
    ACC = max(1, 4 // C)
    OUT_ROUNDS = (TM * BV + NT - 1) // NT  # output elements per thread (t-major, column tidx % BV)
    SCALE = D**-0.5
    CLUSTER = [NV, 1, 1] if NV > 1 else None  # one CTA per head: a plain launch
    # group_sync: the RC warps of one column block exchange partial sums among themselves, so
    # each step waits on a named barrier of its block (ids 1..GROUPS) instead of the whole CTA
    GROUPS = NWARPS // RC
    GROUP_SYNC = group_sync and GROUPS > 1
    copy_state = _bulk_state_copier(D, BV)

    def reciprocal(x):
        # fast_math: rcp.approx (~1 ulp) instead of the IEEE division's slow path
        if fast_math:
            return cute.arch.rcp_approx(x)
        return Float32(1.0) / x

    def sigmoid(x):
        return reciprocal(Float32(1.0) + cute.math.exp(-x))

    def warp_sum(x):
        for i in range(5):  # plain helper, unrolled while tracing
            x = x + cute.arch.shuffle_sync_bfly(x, offset=1 << (4 - i))
        return x

    @cute.jit
    def load_inputs(src: cute.Tensor, b: Int32, ch: Int32, T: Int32, xs: cute.Tensor, base: cutlass.Constexpr):
        # every token's load is issued before any use: one memory round trip, not T
        for t in cutlass.range_constexpr(TM):
            if t < T:
                # rounded to the window's dtype, so a position reads the same value here as later
                # from the committed window
                xs[base + t] = src[b, t, ch].to(conv_dtype).to(Float32)

    @cute.kernel
    def verify_kernel(
        q_in: cute.Tensor, k_in: cute.Tensor, v_in: cute.Tensor, f: cute.Tensor,
        beta_in: cute.Tensor, gate_in: cute.Tensor, conv_weight: cute.Tensor, conv_state: cute.Tensor,
        a_log: cute.Tensor, dt_bias: cute.Tensor, o_norm_weight: cute.Tensor, state: cute.Tensor,
        lengths: cute.Tensor, out: cute.Tensor, rec_k: cute.Tensor, rec_u: cute.Tensor,
        rec_eg: cute.Tensor, rec_x: cute.Tensor, probe_out: cute.Tensor, lower_bound: Float32, eps: Float32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        vs, h, b = cute.arch.block_idx()
        if cutlass.const_expr(pdl):
            # launched early (programmatic dependent launch): wait for the previous kernel's
            # results before touching memory; only the launch latency overlaps its tail
            cute.arch.griddepcontrol_wait()
        marks = cute.make_rmem_tensor((10,), Int64)  # probe: clock64 and globaltimer at 5 points
        if cutlass.const_expr(probe):
            marks[0] = cute.arch.clock64()
            marks[5] = cute.arch.globaltimer()
        warp = tidx // 32
        lane = tidx % 32
        kc = warp % RC
        v_first = (warp // RC) * 32 * C + lane  # this thread's columns: v_first + 32 * c, c < C
        T = q_in.shape[1]
        # positions at or beyond lengths[b] are padding: no records, zero output
        n_valid = cutlass.min(lengths[b].to(Int32), T)

        smem = SmemAllocator()
        conv_s = smem.allocate_tensor(Float32, cute.make_layout((TM, NCONV), stride=(NCONV, 1)), 16)
        eg_s = smem.allocate_tensor(Float32, cute.make_layout((TM, D), stride=(D, 1)), 16)
        part_s = smem.allocate_tensor(
            Float32, cute.make_layout((2, 2, RC, BV), stride=(2 * RC * BV, RC * BV, BV, 1)), 16
        )
        beta_s = smem.allocate_tensor(Float32, cute.make_layout(TM), 16)
        kq_s = smem.allocate_tensor(Float32, cute.make_layout(TM), 16)
        ssq_s = smem.allocate_tensor(Float32, cute.make_layout(TM), 16)
        tot_s = smem.allocate_tensor(Float32, cute.make_layout(TM), 16)

        if cutlass.const_expr(GROUP_SYNC):
            # column blocks run their steps independently: q_t may still be read by another block
            o_s = smem.allocate_tensor(Float32, cute.make_layout((TM, BV), stride=(BV, 1)), 16)
        else:
            # o_t[v] is stored over q_t's first BV columns: q_t is dead once step t's barrier passed
            o_s = conv_s

        S = cute.make_rmem_tensor((R * C,), Float32)
        if cutlass.const_expr(bulk_state):
            # the slice streams into shared memory on the TMA unit while the prologue runs
            state_s = smem.allocate_tensor(Float32, cute.make_layout((D, BV), stride=(BV, 1)), 128)
            mbar = smem.allocate_tensor(Int64, cute.make_layout(1), 8)
            if tidx == 0:
                cute.arch.mbarrier_init(mbar.iterator, 1)
                cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()
            copy_state(state.iterator + (b * state.shape[1] + h) * D * D + vs * BV, state_s, mbar.iterator, lane, warp)

        # Every global load of the CTA is issued before the first use or store, so the prologue
        # costs one memory round trip: the gate and norm weight for the output, f / dt_bias /
        # beta for the decays, the conv inputs, taps and window, then the state.
        gate_pre = cute.make_rmem_tensor((OUT_ROUNDS,), Float32)
        for r in cutlass.range_constexpr(OUT_ROUNDS):
            t_out = (tidx + r * NT) // BV
            if t_out < T:
                gate_pre[r] = gate_in[b, t_out, h * D + vs * BV + tidx % BV].to(Float32)
        norm_weight = o_norm_weight[vs * BV + tidx % BV].to(Float32)
        a_log_h = a_log[h].to(Float32)
        f_pre = cute.make_rmem_tensor((TM,), Float32)
        bias = Float32(0.0)
        if tidx < D:
            bias = dt_bias[h * D + tidx].to(Float32)
            for t in cutlass.range_constexpr(TM):
                if t < T:
                    f_pre[t] = f[b, t, h * D + tidx].to(Float32)
        beta_raw = Float32(0.0)
        if tidx < T:
            beta_raw = beta_in[b, tidx, h].to(Float32)
        # conv channel j of this CTA: q (j < D), k (j < 2D) or this CTA's v columns; the
        # projection is warp-uniform (D and the thread count are multiples of 32)
        xs = cute.make_rmem_tensor((CONV_ROUNDS * TM,), Float32)
        taps = cute.make_rmem_tensor((CONV_ROUNDS * 7,), Float32)  # 4 weights, 3 window values
        for r in cutlass.range_constexpr(CONV_ROUNDS):
            j = tidx + r * NT
            if j < NCONV:
                proj = Int32(2)
                ch = h * D + vs * BV + (j - 2 * D)
                if j < D:
                    proj = Int32(0)
                    ch = h * D + j
                    load_inputs(q_in, b, ch, T, xs, r * TM)
                elif j < 2 * D:
                    proj = Int32(1)
                    ch = h * D + (j - D)
                    load_inputs(k_in, b, ch, T, xs, r * TM)
                else:
                    load_inputs(v_in, b, ch, T, xs, r * TM)
                for i in cutlass.range_constexpr(4):
                    taps[r * 7 + i] = conv_weight[proj, ch, i]
                for i in cutlass.range_constexpr(3):
                    taps[r * 7 + 4 + i] = conv_state[b, proj, ch, i].to(Float32)

        # The state slice last: its 64 KB per head are the bulk of the loads and are first needed
        # by the recurrence, so the conv inputs above do not queue behind them (round 1: the
        # prologue took 7.3 us with the state loads issued first).
        if cutlass.const_expr(not bulk_state):
            for i in cutlass.range_constexpr(R):
                for c in cutlass.range_constexpr(C):
                    S[i * C + c] = state[b, h, kc * R + i, vs * BV + v_first + 32 * c]

        # Prologue 1: causal conv4 + SiLU of q, k (whole head) and v (this CTA's columns); the
        # rounded inputs are recorded for commit's window shift.
        for r in cutlass.range_constexpr(CONV_ROUNDS):
            j = tidx + r * NT
            if j < NCONV:
                proj = Int32(2)
                ch = h * D + vs * BV + (j - 2 * D)
                if j < D:
                    proj = Int32(0)
                    ch = h * D + j
                elif j < 2 * D:
                    proj = Int32(1)
                    ch = h * D + (j - D)
                window = cute.make_rmem_tensor((TM + 3,), Float32)
                for i in cutlass.range_constexpr(3):
                    window[i] = taps[r * 7 + 4 + i]
                for t in cutlass.range_constexpr(TM):
                    if t < T:
                        window[t + 3] = xs[r * TM + t]
                        if proj == 2:
                            rec_x[b, proj, ch, t] = xs[r * TM + t].to(conv_dtype)
                        elif vs == 0:  # q/k channels are loaded by every V-split; one records them
                            rec_x[b, proj, ch, t] = xs[r * TM + t].to(conv_dtype)
                for t in cutlass.range_constexpr(TM):
                    if t < T:
                        y = (taps[r * 7] * window[t] + taps[r * 7 + 1] * window[t + 1]
                             + taps[r * 7 + 2] * window[t + 2] + taps[r * 7 + 3] * window[t + 3])
                        conv_s[t, j] = y * sigmoid(y)

        # Prologue 2: decay exp(g) per key channel, g = lb * sigmoid(exp(A_log[h]) (f + dt_bias)).
        if tidx < D:
            a = cute.math.exp(a_log_h)
            for t in cutlass.range_constexpr(TM):
                if t < T:
                    g = lower_bound * sigmoid(a * (f_pre[t] + bias))
                    eg_s[t, tidx] = cute.math.exp(g)
        if tidx < T:
            beta_s[tidx] = sigmoid(beta_raw)
        if cutlass.const_expr(probe):
            marks[1] = cute.arch.clock64()
            marks[6] = cute.arch.globaltimer()
        cute.arch.sync_threads()

        # Prologue 3: L2-normalise q (times D^-1/2) and k, one warp per token; k.q for the output.
        for t in cutlass.range(warp, T, NWARPS):
            qv = cute.make_rmem_tensor((PER_LANE,), Float32)
            kv = cute.make_rmem_tensor((PER_LANE,), Float32)
            ssq_q = Float32(0.0)
            ssq_k = Float32(0.0)
            for e in cutlass.range_constexpr(PER_LANE):
                qv[e] = conv_s[t, lane + 32 * e]
                kv[e] = conv_s[t, D + lane + 32 * e]
                ssq_q = ssq_q + qv[e] * qv[e]
                ssq_k = ssq_k + kv[e] * kv[e]
            ssq_q = warp_sum(ssq_q) + Float32(L2_EPS)
            ssq_k = warp_sum(ssq_k) + Float32(L2_EPS)
            inv_q = Float32(0.0)
            inv_k = Float32(0.0)
            if cutlass.const_expr(fast_math):
                inv_q = cute.math.rsqrt(ssq_q) * Float32(SCALE)
                inv_k = cute.math.rsqrt(ssq_k)
            dot = Float32(0.0)
            for e in cutlass.range_constexpr(PER_LANE):
                qn = Float32(0.0)
                kn = Float32(0.0)
                if cutlass.const_expr(fast_math):
                    qn = qv[e] * inv_q
                    kn = kv[e] * inv_k
                else:
                    qn = qv[e] / cute.math.sqrt(ssq_q) * Float32(SCALE)
                    kn = kv[e] / cute.math.sqrt(ssq_k)
                conv_s[t, lane + 32 * e] = qn
                conv_s[t, D + lane + 32 * e] = kn
                dot = dot + qn * kn
                if vs == 0:  # records are zero at padding positions (as the reference's)
                    k_record = Float32(0.0)
                    eg_record = Float32(0.0)
                    if t < n_valid:
                        k_record = kn
                        eg_record = eg_s[t, lane + 32 * e]
                    rec_k[b, t, h, lane + 32 * e] = k_record
                    rec_eg[b, t, h, lane + 32 * e] = eg_record
            dot = warp_sum(dot)
            if lane == 0:
                kq_s[t] = dot
        cute.arch.sync_threads()
        if cutlass.const_expr(probe):
            marks[2] = cute.arch.clock64()
            marks[7] = cute.arch.globaltimer()

        if cutlass.const_expr(pdl):
            # the next kernel may launch now; it waits for this grid to finish before it reads
            cute.arch.griddepcontrol_launch_dependents()
        if cutlass.const_expr(bulk_state):
            cute.arch.mbarrier_wait(mbar.iterator, 0)
            for i in cutlass.range_constexpr(R):
                for c in cutlass.range_constexpr(C):
                    S[i * C + c] = state_s[kc * R + i, v_first + 32 * c]

        # The delta rule, one token per step. o_t = S_t^T q = (decayed S)^T q + (k.q) u, so both
        # reductions over rows happen before the update and each step needs one barrier.
        for t in cutlass.range(T):
            buf = t % 2
            acc_k = cute.make_rmem_tensor((ACC * C,), Float32)
            acc_q = cute.make_rmem_tensor((ACC * C,), Float32)
            for a in cutlass.range_constexpr(ACC * C):
                acc_k[a] = Float32(0.0)
                acc_q[a] = Float32(0.0)
            for i in cutlass.range_constexpr(R):
                decay = eg_s[t, kc * R + i]
                key = conv_s[t, D + kc * R + i]
                query = conv_s[t, kc * R + i]
                for c in cutlass.range_constexpr(C):
                    S[i * C + c] = S[i * C + c] * decay
                    a = (i % ACC) * C + c
                    acc_k[a] = acc_k[a] + S[i * C + c] * key
                    acc_q[a] = acc_q[a] + S[i * C + c] * query
            for c in cutlass.range_constexpr(C):
                part_s[buf, 0, kc, v_first + 32 * c] = _tree_sum(acc_k, c, ACC, C)
                part_s[buf, 1, kc, v_first + 32 * c] = _tree_sum(acc_q, c, ACC, C)
            if cutlass.const_expr(GROUP_SYNC):
                cute.arch.barrier(barrier_id=1 + warp // RC, number_of_threads=RC * 32)
            else:
                cute.arch.sync_threads()
            u = cute.make_rmem_tensor((C,), Float32)
            for c in cutlass.range_constexpr(C):
                v_local = v_first + 32 * c
                s_k = part_s[buf, 0, 0, v_local]
                for chunk in cutlass.range_constexpr(1, RC):
                    s_k = s_k + part_s[buf, 0, chunk, v_local]
                u[c] = beta_s[t] * (conv_s[t, 2 * D + v_local] - s_k)
                if kc == 0:  # one row chunk writes the output and the record
                    s_q = part_s[buf, 1, 0, v_local]
                    for chunk in cutlass.range_constexpr(1, RC):
                        s_q = s_q + part_s[buf, 1, chunk, v_local]
                    o_s[t, v_local] = s_q + kq_s[t] * u[c]
                    u_record = Float32(0.0)
                    if t < n_valid:
                        u_record = u[c]
                    rec_u[b, t, h, vs * BV + v_local] = u_record
            for i in cutlass.range_constexpr(R):
                key = conv_s[t, D + kc * R + i]
                for c in cutlass.range_constexpr(C):
                    S[i * C + c] = cute.math.fma(key, u[c], S[i * C + c])
        cute.arch.sync_threads()
        if cutlass.const_expr(probe):
            marks[3] = cute.arch.clock64()
            marks[8] = cute.arch.globaltimer()

        # Gated RMSNorm over the head's D output channels (kimi-k3.md §2.1 step 6).
        for t in cutlass.range(warp, T, NWARPS):
            ssq = Float32(0.0)
            for e in cutlass.range_constexpr(BV // 32):
                o = o_s[t, lane + 32 * e]
                ssq = ssq + o * o
            ssq = warp_sum(ssq)
            if lane == 0:
                ssq_s[t] = ssq
        cute.arch.sync_threads()
        if cutlass.const_expr(NV > 1):
            # partial sums of the other V-splits of this head, read from their shared memory
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
            if tidx < T:
                total = Float32(0.0)
                for r in cutlass.range_constexpr(NV):
                    total = total + cute.arch.inline_ptx(
                        "{ .reg .u32 remote; mapa.shared::cluster.u32 remote, {$r0}, {$r1}; "
                        "ld.shared::cluster.f32 {$w0}, [remote]; }",
                        write_only_types=[Float32],
                        read_only_args=[ssq_s.iterator + tidx, Int32(r)],
                    )
                tot_s[tidx] = total
        else:
            if tidx < T:
                tot_s[tidx] = ssq_s[tidx]
        cute.arch.sync_threads()

        for r in cutlass.range_constexpr(OUT_ROUNDS):
            t = (tidx + r * NT) // BV
            v = tidx % BV
            if t < T:
                result = Float32(0.0)
                if t < n_valid:
                    inv_rms = cute.math.rsqrt(tot_s[t] / Float32(D) + eps)
                    result = o_s[t, v] * inv_rms * norm_weight * sigmoid(gate_pre[r])
                out[b, t, h * D + vs * BV + v] = result.to(out.element_type)

        if cutlass.const_expr(NV > 1):
            # keep this CTA's shared memory alive until every peer has read it
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        if cutlass.const_expr(probe):
            marks[4] = cute.arch.clock64()
            marks[9] = cute.arch.globaltimer()
            if tidx == 0:
                for m in cutlass.range_constexpr(10):
                    probe_out[b, h, vs, m] = marks[m]

    @cute.jit
    def launch(
        q_in: cute.Tensor, k_in: cute.Tensor, v_in: cute.Tensor, f: cute.Tensor,
        beta_in: cute.Tensor, gate_in: cute.Tensor, conv_weight: cute.Tensor, conv_state: cute.Tensor,
        a_log: cute.Tensor, dt_bias: cute.Tensor, o_norm_weight: cute.Tensor, state: cute.Tensor,
        lengths: cute.Tensor, out: cute.Tensor, rec_k: cute.Tensor, rec_u: cute.Tensor,
        rec_eg: cute.Tensor, rec_x: cute.Tensor, probe_out: cute.Tensor, lower_bound: Float32, eps: Float32,
        stream,
    ):
        batch = state.shape[0]
        heads = state.shape[1]
        verify_kernel(
            q_in, k_in, v_in, f, beta_in, gate_in, conv_weight, conv_state, a_log, dt_bias,
            o_norm_weight, state, lengths, out, rec_k, rec_u, rec_eg, rec_x, probe_out, lower_bound, eps,
        ).launch(grid=[NV, heads, batch], block=[NT, 1, 1], cluster=CLUSTER, stream=stream, use_pdl=pdl)

    sym = cute.sym_int
    B, T, W, H = sym(), sym(), sym(), sym()
    fake = cute.runtime.make_fake_compact_tensor
    f32 = cutlass.Float32

    def btw(dtype):
        return fake(dtype, (B, T, W), stride_order=(2, 1, 0))

    def bthd():
        return fake(f32, (B, T, H, D), stride_order=(3, 2, 1, 0))

    args = (
        btw(in_dtype), btw(in_dtype), btw(in_dtype), btw(in_dtype),
        fake(in_dtype, (B, T, H), stride_order=(2, 1, 0)), btw(in_dtype),
        fake(f32, (3, W, 4), stride_order=(2, 1, 0)),
        fake(conv_dtype, (B, 3, W, 3), stride_order=(3, 2, 1, 0)),
        fake(f32, (sym(),)), fake(f32, (W,)), fake(f32, (D,)),
        fake(f32, (B, H, D, D), stride_order=(3, 2, 1, 0)),
        fake(cutlass.Int64, (B,)), btw(in_dtype), bthd(), bthd(), bthd(),
        fake(conv_dtype, (B, 3, W, T), stride_order=(3, 2, 1, 0)),
        fake(cutlass.Int64, (sym(), sym(), sym(), sym()), stride_order=(3, 2, 1, 0)),
        Float32(0.0), Float32(0.0), cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
    )
    return cute.compile(launch, *args, options=compile_options(arch, *extra_options))


def compile_verify(arch: str, head_dim: int, block_v: int, max_tokens: int, in_dtype: torch.dtype,
                   conv_dtype: torch.dtype, extra_options: tuple[str, ...] = (), *, cols: int = 1,
                   row_chunks: int = ROW_CHUNKS, fast_math: bool = False, bulk_state: bool = False,
                   group_sync: bool = False, pdl: bool = False, probe: bool = False):
    """The compiled verify kernel for one variant (cached; CPU-only compile works with any arch).

    cols / row_chunks: the thread layout (state columns per thread, warps a column's rows are
    split over); fast_math: approximate reciprocals in the sigmoids and L2 norms; bulk_state: the
    state slice is copied into shared memory by the TMA unit (cp.async.bulk) instead of register
    loads; group_sync: each step's barrier spans only the warps of one column block (named
    barriers), so blocks do not wait for each other; pdl: programmatic dependent launch (the
    kernel waits for its predecessor before any memory access and lets its successor launch
    after the prologue); probe: thread 0
    of each CTA writes clock64 and %globaltimer at 5 phase boundaries into probe_out (diagnostic).
    extra_options: more cute.compile flags, e.g. ("--keep-ptx",) to inspect the PTX (written to
    the current directory).
    """
    _check_head_dim(head_dim, block_v)
    _check_layout(head_dim, block_v, cols, row_chunks)
    if not 1 <= max_tokens <= MAX_TOKENS:
        raise ValueError(f"max_tokens={max_tokens}: must be in 1..{MAX_TOKENS}")
    key = ("kda_verify", arch, head_dim, block_v, max_tokens, in_dtype, conv_dtype, cols, row_chunks, fast_math,
           bulk_state, group_sync, pdl, probe, extra_options)
    return _cache.get(key, lambda: _build_verify(
        arch, head_dim, block_v, max_tokens, torch_to_cutlass_dtype(in_dtype), torch_to_cutlass_dtype(conv_dtype),
        cols, row_chunks, fast_math, bulk_state, group_sync, pdl, probe, extra_options))


# ----------------------------------------------------------------------------------------------
# commit


def _build_commit(arch: str, head_dim: int, block_v: int, conv_dtype, cols: int, row_chunks: int, bulk_state: bool,
                  pdl: bool, extra_options):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64
    from cutlass.memory import SmemAllocator

    D, BV, C, RC = head_dim, block_v, cols, row_chunks
    NV = D // BV
    R = D // RC
    NT = RC * BV // C
    CONV_PER_CTA = 3 * D // NV  # conv channels (q, k, v of this head) shifted by each CTA
    TM = MAX_TOKENS
    STAGE_ROUNDS = (TM * D + NT - 1) // NT  # k / exp(g) record elements staged per thread
    copy_state = _bulk_state_copier(D, BV)

    @cute.kernel
    def commit_kernel(
        state: cute.Tensor, conv_state: cute.Tensor, rec_k: cute.Tensor, rec_u: cute.Tensor,
        rec_eg: cute.Tensor, rec_x: cute.Tensor, num_tokens: cute.Tensor,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        vs, h, layer_batch = cute.arch.block_idx()
        if cutlass.const_expr(pdl):
            cute.arch.griddepcontrol_wait()  # the records come from the verify kernels before
            cute.arch.griddepcontrol_launch_dependents()
        batch = state.shape[1]
        layer = layer_batch // batch
        b = layer_batch % batch
        warp = tidx // 32
        lane = tidx % 32
        kc = warp % RC
        v_first = vs * BV + (warp // RC) * 32 * C + lane  # this thread's columns: v_first + 32 * c
        n = cutlass.min(num_tokens[b].to(Int32), rec_u.shape[2])  # never replay past the verified T
        smem = SmemAllocator()
        k_s = smem.allocate_tensor(Float32, cute.make_layout((TM, D), stride=(D, 1)), 16)
        eg_s = smem.allocate_tensor(Float32, cute.make_layout((TM, D), stride=(D, 1)), 16)
        if cutlass.const_expr(bulk_state):
            state_s = smem.allocate_tensor(Float32, cute.make_layout((D, BV), stride=(BV, 1)), 128)
            mbar = smem.allocate_tensor(Int64, cute.make_layout(1), 8)
            if tidx == 0:
                cute.arch.mbarrier_init(mbar.iterator, 1)
                cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()

        # zero accepted tokens leaves state and window untouched (no stale write-back)
        if n > 0:
            # Issue every global load first (state slice, these columns' u, this head's k and
            # exp(g) rows), so the replay costs one memory round trip instead of one per token.
            S = cute.make_rmem_tensor((R * C,), Float32)
            if cutlass.const_expr(bulk_state):
                # the slice streams into shared memory on the TMA unit while the records load
                heads = state.shape[2]
                copy_state(state.iterator + ((layer * batch + b) * heads + h) * D * D + vs * BV, state_s,
                           mbar.iterator, lane, warp)
            else:
                for i in cutlass.range_constexpr(R):
                    for c in cutlass.range_constexpr(C):
                        S[i * C + c] = state[layer, b, h, kc * R + i, v_first + 32 * c]
            u_pre = cute.make_rmem_tensor((TM * C,), Float32)
            for t in cutlass.range_constexpr(TM):
                if t < n:
                    for c in cutlass.range_constexpr(C):
                        u_pre[t * C + c] = rec_u[layer, b, t, h, v_first + 32 * c]
            k_pre = cute.make_rmem_tensor((STAGE_ROUNDS,), Float32)
            eg_pre = cute.make_rmem_tensor((STAGE_ROUNDS,), Float32)
            for r in cutlass.range_constexpr(STAGE_ROUNDS):
                t = (tidx + r * NT) // D
                if t < n:
                    k_pre[r] = rec_k[layer, b, t, h, (tidx + r * NT) % D]
                    eg_pre[r] = rec_eg[layer, b, t, h, (tidx + r * NT) % D]

            # conv window <- the last 3 of [window; first n inputs] (independent of the state)
            for j in cutlass.range(tidx, CONV_PER_CTA, NT):
                ch_all = vs * CONV_PER_CTA + j
                proj = ch_all // D
                ch = h * D + ch_all % D
                old0 = conv_state[layer, b, proj, ch, 0]
                old1 = conv_state[layer, b, proj, ch, 1]
                old2 = conv_state[layer, b, proj, ch, 2]
                for i in cutlass.range_constexpr(3):
                    src = n + i  # position in [window (3); inputs (T)]
                    value = old2
                    if src == 0:
                        value = old0
                    elif src == 1:
                        value = old1
                    elif src == 2:
                        value = old2
                    else:
                        value = rec_x[layer, b, proj, ch, src - 3]
                    conv_state[layer, b, proj, ch, i] = value

            for r in cutlass.range_constexpr(STAGE_ROUNDS):
                t = (tidx + r * NT) // D
                if t < n:
                    k_s[t, (tidx + r * NT) % D] = k_pre[r]
                    eg_s[t, (tidx + r * NT) % D] = eg_pre[r]
            cute.arch.sync_threads()
            if cutlass.const_expr(bulk_state):
                cute.arch.mbarrier_wait(mbar.iterator, 0)
                for i in cutlass.range_constexpr(R):
                    for c in cutlass.range_constexpr(C):
                        S[i * C + c] = state_s[kc * R + i, v_first - vs * BV + 32 * c]

            for t in cutlass.range_constexpr(TM):  # unrolled: u_pre is indexed by constants only
                if t < n:
                    # the same mul + fma as verify's in-register update, so the bits agree
                    for i in cutlass.range_constexpr(R):
                        decay = eg_s[t, kc * R + i]
                        key = k_s[t, kc * R + i]
                        for c in cutlass.range_constexpr(C):
                            S[i * C + c] = S[i * C + c] * decay
                            S[i * C + c] = cute.math.fma(key, u_pre[t * C + c], S[i * C + c])
            for i in cutlass.range_constexpr(R):
                for c in cutlass.range_constexpr(C):
                    state[layer, b, h, kc * R + i, v_first + 32 * c] = S[i * C + c]

    @cute.jit
    def launch(
        state: cute.Tensor, conv_state: cute.Tensor, rec_k: cute.Tensor, rec_u: cute.Tensor,
        rec_eg: cute.Tensor, rec_x: cute.Tensor, num_tokens: cute.Tensor, stream,
    ):
        layers = state.shape[0]
        batch = state.shape[1]
        heads = state.shape[2]
        commit_kernel(state, conv_state, rec_k, rec_u, rec_eg, rec_x, num_tokens).launch(
            grid=[NV, heads, layers * batch], block=[NT, 1, 1], stream=stream, use_pdl=pdl
        )

    sym = cute.sym_int
    L, B, T, W, H = sym(), sym(), sym(), sym(), sym()
    fake = cute.runtime.make_fake_compact_tensor
    f32 = cutlass.Float32

    def lbthd():
        return fake(f32, (L, B, T, H, D), stride_order=(4, 3, 2, 1, 0))

    args = (
        fake(f32, (L, B, H, D, D), stride_order=(4, 3, 2, 1, 0)),
        fake(conv_dtype, (L, B, 3, W, 3), stride_order=(4, 3, 2, 1, 0)),
        lbthd(), lbthd(), lbthd(), fake(conv_dtype, (L, B, 3, W, T), stride_order=(4, 3, 2, 1, 0)),
        fake(cutlass.Int64, (B,)),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
    )
    return cute.compile(launch, *args, options=compile_options(arch, *extra_options))


def compile_commit(arch: str, head_dim: int, block_v: int, conv_dtype: torch.dtype,
                   extra_options: tuple[str, ...] = (), *, cols: int = 1, row_chunks: int = ROW_CHUNKS,
                   bulk_state: bool = False, pdl: bool = False):
    """The compiled commit kernel for one variant (cached), see compile_verify."""
    _check_head_dim(head_dim, block_v)
    _check_layout(head_dim, block_v, cols, row_chunks)
    key = ("kda_commit", arch, head_dim, block_v, conv_dtype, cols, row_chunks, bulk_state, pdl, extra_options)
    return _cache.get(key, lambda: _build_commit(arch, head_dim, block_v, torch_to_cutlass_dtype(conv_dtype),
                                                 cols, row_chunks, bulk_state, pdl, extra_options))


# ----------------------------------------------------------------------------------------------
# which calls the kernels take (the registry sends the others to the reference)

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _head_dim_ok(state: torch.Tensor) -> bool:
    D = state.shape[-1]
    return D % 32 == 0 and D <= 128 and state.dtype == torch.float32


def supports_verify(q_in, k_in, v_in, f, beta_in, gate_in, conv_weight, conv_state, A_log, dt_bias,
                    o_norm_weight, state, lengths) -> bool:
    return (_head_dim_ok(state) and q_in.dim() == 3 and 1 <= q_in.shape[1] <= MAX_TOKENS
            and q_in.dtype in _DTYPES and conv_state.dtype in _DTYPES)


def supports_commit(state, conv_state) -> bool:
    return _head_dim_ok(state) and conv_state.dtype in _DTYPES


# ----------------------------------------------------------------------------------------------
# torch-facing wrappers (contract: kernels/kda/reference.py; records are its KDARecords)


def _require(cond: bool, field: str, value, what: str) -> None:
    if not cond:
        raise ValueError(f"kda: {field}={value} {what}")


def allocate_records(batch: int, tokens: int, heads: int, head_dim: int, conv_dtype: torch.dtype,
                     device, lengths: torch.Tensor, leading: tuple[int, ...] = ()) -> KDARecords:
    """Uninitialised record buffers for verify; `leading` = (L,) stacks L layers for one commit."""
    per_position = (*leading, batch, tokens, heads, head_dim)
    return KDARecords(
        keys=torch.empty(per_position, device=device, dtype=torch.float32),
        updates=torch.empty(per_position, device=device, dtype=torch.float32),
        decays=torch.empty(per_position, device=device, dtype=torch.float32),
        conv_inputs=torch.empty((*leading, batch, 3, heads * head_dim, tokens), device=device, dtype=conv_dtype),
        lengths=lengths,
    )


def verify(q_in, k_in, v_in, f, beta_in, gate_in, conv_weight, conv_state, A_log, dt_bias,
           o_norm_weight, state, lengths, *, lower_bound: float, eps: float, arch: str,
           block_v: int | None = None, cols: int | None = None, row_chunks: int | None = None,
           fast_math: bool | None = None, bulk_state: bool | None = None, group_sync: bool | None = None,
           pdl: bool | None = None, records: KDARecords | None = None, out: torch.Tensor | None = None,
           probe: torch.Tensor | None = None):
    """Output-only KDA verify, the reference kda_verify's contract. Returns (out, records).

    block_v, cols, row_chunks, fast_math, bulk_state, group_sync, pdl: kernel options (None = default_variant's);
    probe: an
    int64 [B, H, head_dim // block_v, 10] tensor selects the probe build, which writes each CTA's
    clock64 (0..4) and %globaltimer (5..9) at kernel start, after the conv, before the
    recurrence, after it, and at the end (diagnostic; see experiments/kda_bench.py).

    `records` and `out`, if given, are filled in place (records e.g. as views of stacked per-layer
    buffers from allocate_records(leading=(L,)), so that one commit launch replays every layer).
    records.lengths is the `lengths` tensor itself, not a copy; commit does not read it.
    """
    _require(state.dim() == 4 and state.dtype == torch.float32, "state.shape", (tuple(state.shape), state.dtype),
             "must be [B, H, D, D] fp32")
    B, H, D, D2 = state.shape
    _require(D == D2, "state.shape", tuple(state.shape), "must be [B, H, D, D]")
    variant = resolve_variant(D, "verify", block_v=block_v, cols=cols, row_chunks=row_chunks, fast_math=fast_math,
                              bulk_state=bulk_state, group_sync=group_sync, pdl=pdl)
    _check_head_dim(D, variant["block_v"])
    _check_layout(D, variant["block_v"], variant["cols"], variant["row_chunks"])
    W = H * D
    _require(q_in.dim() == 3 and q_in.shape[0] == B and q_in.shape[2] == W, "q_in.shape", tuple(q_in.shape),
             f"must be [B={B}, T, W={W}]")
    T = q_in.shape[1]
    _require(1 <= T <= MAX_TOKENS, "T", T, f"must be in 1..{MAX_TOKENS}")
    dtype = q_in.dtype
    for name, x in (("k_in", k_in), ("v_in", v_in), ("f", f), ("gate_in", gate_in)):
        _require(x.shape == q_in.shape and x.dtype == dtype, f"{name}.shape/dtype", (tuple(x.shape), x.dtype),
                 f"must match q_in {tuple(q_in.shape)} {dtype}")
    _require(tuple(beta_in.shape) == (B, T, H) and beta_in.dtype == dtype, "beta_in.shape/dtype",
             (tuple(beta_in.shape), beta_in.dtype), f"must be [{B}, {T}, {H}] {dtype}")
    _require(tuple(conv_weight.shape) == (3, W, 4) and conv_weight.dtype == torch.float32, "conv_weight.shape",
             (tuple(conv_weight.shape), conv_weight.dtype), f"must be [3, {W}, 4] fp32")
    _require(tuple(conv_state.shape) == (B, 3, W, 3), "conv_state.shape", tuple(conv_state.shape),
             f"must be [{B}, 3, {W}, 3]")
    _require(A_log.dim() == 1 and A_log.shape[0] >= H and A_log.dtype == torch.float32, "A_log.shape",
             (tuple(A_log.shape), A_log.dtype), f"must be fp32 with at least {H} entries")
    _require(tuple(dt_bias.shape) == (W,) and dt_bias.dtype == torch.float32, "dt_bias.shape",
             (tuple(dt_bias.shape), dt_bias.dtype), f"must be [{W}] fp32")
    _require(tuple(o_norm_weight.shape) == (D,) and o_norm_weight.dtype == torch.float32, "o_norm_weight.shape",
             (tuple(o_norm_weight.shape), o_norm_weight.dtype), f"must be [{D}] fp32")
    _require(tuple(lengths.shape) == (B,) and not lengths.is_floating_point(), "lengths.shape",
             (tuple(lengths.shape), lengths.dtype), f"must be [{B}] integer")
    lengths = lengths.to(device=state.device, dtype=torch.int64)

    if out is None:
        out = torch.empty_like(q_in)
    _require(out.shape == q_in.shape and out.dtype == dtype and out.is_contiguous(), "out.shape",
             (tuple(out.shape), out.dtype), f"must be contiguous {tuple(q_in.shape)} {dtype}")
    if records is None:
        records = allocate_records(B, T, H, D, conv_state.dtype, state.device, lengths)
    else:
        for name in ("keys", "updates", "decays"):
            x = getattr(records, name)
            _require(tuple(x.shape) == (B, T, H, D) and x.dtype == torch.float32 and x.is_contiguous(),
                     f"records.{name}.shape", tuple(x.shape), f"must be contiguous [{B}, {T}, {H}, {D}] fp32")
        x = records.conv_inputs
        _require(tuple(x.shape) == (B, 3, W, T) and x.dtype == conv_state.dtype and x.is_contiguous(),
                 "records.conv_inputs.shape", (tuple(x.shape), x.dtype),
                 f"must be contiguous [{B}, 3, {W}, {T}] {conv_state.dtype}")
        records.lengths = lengths
    if probe is not None:
        shape = (B, H, D // variant["block_v"], 10)
        _require(tuple(probe.shape) == shape and probe.dtype == torch.int64 and probe.is_contiguous(), "probe.shape",
                 (tuple(probe.shape), probe.dtype), f"must be contiguous {list(shape)} int64")
    kernel = compile_verify(arch, D, variant["block_v"], MAX_TOKENS, dtype, conv_state.dtype, cols=variant["cols"],
                            row_chunks=variant["row_chunks"], fast_math=variant["fast_math"],
                            bulk_state=variant["bulk_state"], group_sync=variant["group_sync"], pdl=variant["pdl"],
                            probe=probe is not None)
    c = torch.Tensor.contiguous
    kernel(c(q_in), c(k_in), c(v_in), c(f), c(beta_in), c(gate_in), c(conv_weight), c(conv_state), c(A_log),
           c(dt_bias), c(o_norm_weight), c(state), lengths, out, records.keys, records.updates, records.decays,
           records.conv_inputs, probe if probe is not None else _no_probe(state.device), float(lower_bound),
           float(eps))
    return out, records


@functools.cache
def _no_probe(device: torch.device) -> torch.Tensor:
    """The probe argument of the builds without the probe (never read or written)."""
    return torch.zeros((1, 1, 1, 1), device=device, dtype=torch.int64)


def _num_tokens_tensor(num_tokens, batch: int, device) -> torch.Tensor:
    num_tokens = torch.as_tensor(num_tokens, device=device)
    _require(tuple(num_tokens.shape) == (batch,) and not num_tokens.is_floating_point(), "num_tokens.shape",
             (tuple(num_tokens.shape), num_tokens.dtype), f"must be [{batch}] integer")
    return num_tokens.to(dtype=torch.int64).contiguous()


def commit_layers(states, conv_states, records: KDARecords, num_tokens, *, arch: str,
                  block_v: int | None = None, cols: int | None = None, row_chunks: int | None = None,
                  bulk_state: bool | None = None, pdl: bool | None = None) -> None:
    """Commit the first num_tokens[b] verified positions of L stacked layers in one launch.

    states [L, B, H, D, D] fp32 and conv_states [L, B, 3, W, 3], both contiguous and updated in
    place; records with a leading L (keys/updates/decays [L, B, T, H, D], conv_inputs
    [L, B, 3, W, T]); num_tokens [B] in 0..T, shared by the layers. Counts above T are clamped
    to T on the device; the caller keeps them <= lengths (no host sync to check it here).
    block_v, cols, row_chunks, bulk_state, pdl: kernel options (None = default_variant's).
    """
    _require(states.dim() == 5 and states.dtype == torch.float32 and states.is_contiguous(), "states.shape",
             (tuple(states.shape), states.dtype), "must be contiguous [L, B, H, D, D] fp32")
    L, B, H, D, _ = states.shape
    variant = resolve_variant(D, "commit", block_v=block_v, cols=cols, row_chunks=row_chunks, bulk_state=bulk_state,
                              pdl=pdl)
    _check_head_dim(D, variant["block_v"])
    _check_layout(D, variant["block_v"], variant["cols"], variant["row_chunks"])
    W = H * D
    _require(tuple(conv_states.shape) == (L, B, 3, W, 3) and conv_states.is_contiguous(), "conv_states.shape",
             tuple(conv_states.shape), f"must be contiguous [{L}, {B}, 3, {W}, 3]")
    T = records.keys.shape[2] if records.keys.dim() == 5 else -1
    for name in ("keys", "updates", "decays"):
        x = getattr(records, name)
        _require(tuple(x.shape) == (L, B, T, H, D) and x.dtype == torch.float32, f"records.{name}.shape",
                 tuple(x.shape), f"must be [{L}, {B}, T, {H}, {D}] fp32")
    x = records.conv_inputs
    _require(tuple(x.shape) == (L, B, 3, W, T) and x.dtype == conv_states.dtype, "records.conv_inputs.shape",
             (tuple(x.shape), x.dtype), f"must be [{L}, {B}, 3, {W}, {T}] {conv_states.dtype}")
    kernel = compile_commit(arch, D, variant["block_v"], conv_states.dtype, cols=variant["cols"],
                            row_chunks=variant["row_chunks"], bulk_state=variant["bulk_state"], pdl=variant["pdl"])
    c = torch.Tensor.contiguous
    kernel(states, conv_states, c(records.keys), c(records.updates), c(records.decays), c(records.conv_inputs),
           _num_tokens_tensor(num_tokens, B, states.device))


def commit(state, conv_state, records: KDARecords, num_tokens, *, arch: str, block_v: int | None = None,
           cols: int | None = None, row_chunks: int | None = None, bulk_state: bool | None = None,
           pdl: bool | None = None) -> None:
    """One layer (the reference kda_commit's contract): bring state [B, H, D, D] and conv_state
    [B, 3, W, 3] in place to the first num_tokens[b] verified positions; 0 leaves both untouched."""
    _require(state.dim() == 4, "state.shape", tuple(state.shape), "must be [B, H, D, D]")
    _require(conv_state.dim() == 4, "conv_state.shape", tuple(conv_state.shape), "must be [B, 3, W, 3]")
    stacked = KDARecords(records.keys.unsqueeze(0), records.updates.unsqueeze(0), records.decays.unsqueeze(0),
                         records.conv_inputs.unsqueeze(0), records.lengths)
    commit_layers(state.unsqueeze(0), conv_state.unsqueeze(0), stacked, num_tokens, arch=arch, block_v=block_v,
                  cols=cols, row_chunks=row_chunks, bulk_state=bulk_state, pdl=pdl)
