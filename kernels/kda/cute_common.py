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

Thread layout of a state slice: warp w owns state rows [kc*R, (kc+1)*R) with kc = w % 4 and
column block vc = w // 4; lane l owns column vc*32 + l. A warp reads rows of the state (32
consecutive floats, coalesced), reads k/q/exp(g) as shared-memory broadcasts, and reduces over
its R rows serially; the 4 row chunks are summed through shared memory in a fixed order, so every
thread of a column gets the same bits, and verify and commit apply the same mul + fma per step.
"""
import torch

from ..cute_common import CompileCache, compile_options, torch_to_cutlass_dtype
from .reference import KDARecords

ROW_CHUNKS = 4  # state rows are split over 4 warps; their partial dot products meet in smem
MAX_TOKENS = 16  # verify width supported: T = 1..16 (k <= 15 drafts)
L2_EPS = 1e-6  # q, k <- x / sqrt(sum x^2 + 1e-6) (kimi-k3.md §2.1 step 2)

_cache = CompileCache()


def default_block_v(head_dim: int, op: str) -> int:
    """State columns per CTA, from the H200 bench at K3 dims, B=1, T=8 (experiments/notes/kda.md):
    verify is fastest with one CTA per head (no cluster exchange, the q/k conv not repeated per
    V-split: 20.6 us vs 30.2 us with 4 CTAs/head); commit with 4 CTAs per head (8.4 vs 10.0 us)."""
    if op == "verify":
        return head_dim
    return 32


def _check_head_dim(head_dim: int, block_v: int) -> None:
    if head_dim % 32 != 0 or head_dim > 128:
        raise ValueError(f"head_dim={head_dim}: the CuTe KDA kernels need a multiple of 32, at most 128")
    if block_v % 32 != 0 or head_dim % block_v != 0:
        raise ValueError(f"block_v={block_v}: must be a multiple of 32 that divides head_dim={head_dim}")
    if head_dim // block_v > 8:
        raise ValueError(f"block_v={block_v}: more than 8 V-splits per head (cluster limit)")


# ----------------------------------------------------------------------------------------------
# verify


def _build_verify(arch: str, head_dim: int, block_v: int, max_tokens: int, in_dtype, conv_dtype, extra_options):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32
    from cutlass.memory import SmemAllocator

    D, BV, TM = head_dim, block_v, max_tokens
    NV = D // BV  # V-split CTAs per head (= cluster size)
    R = D // ROW_CHUNKS  # state rows per thread
    NT = ROW_CHUNKS * BV  # threads per CTA
    NWARPS = NT // 32
    NCONV = 2 * D + BV  # conv outputs per token in this CTA: q (D), k (D), this CTA's v slice (BV)
    PER_LANE = D // 32
    ACC = 4  # partial sums per row-chunk dot product (R = 32 rows -> chains of 8 FMAs)
    OUT_ROUNDS = (TM * BV + NT - 1) // NT  # output elements per thread (t-major, column tidx % BV)
    SCALE = D**-0.5

    def sigmoid(x):
        return Float32(1.0) / (Float32(1.0) + cute.math.exp(-x))

    def warp_sum(x):
        for i in range(5):  # plain helper, unrolled while tracing
            x = x + cute.arch.shuffle_sync_bfly(x, offset=1 << (4 - i))
        return x

    @cute.jit
    def load_projection(q_in, k_in, v_in, proj, b, t, ch):
        value = Float32(0.0)
        if proj == 0:
            value = q_in[b, t, ch].to(Float32)
        elif proj == 1:
            value = k_in[b, t, ch].to(Float32)
        else:
            value = v_in[b, t, ch].to(Float32)
        return value

    @cute.kernel
    def verify_kernel(
        q_in: cute.Tensor, k_in: cute.Tensor, v_in: cute.Tensor, f: cute.Tensor,
        beta_in: cute.Tensor, gate_in: cute.Tensor, conv_weight: cute.Tensor, conv_state: cute.Tensor,
        a_log: cute.Tensor, dt_bias: cute.Tensor, o_norm_weight: cute.Tensor, state: cute.Tensor,
        lengths: cute.Tensor, out: cute.Tensor, rec_k: cute.Tensor, rec_u: cute.Tensor,
        rec_eg: cute.Tensor, rec_x: cute.Tensor, lower_bound: Float32, eps: Float32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        vs, h, b = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32
        kc = warp % ROW_CHUNKS
        v_local = (warp // ROW_CHUNKS) * 32 + lane
        v_col = vs * BV + v_local
        T = q_in.shape[1]
        # positions at or beyond lengths[b] are padding: no records, zero output
        n_valid = cutlass.min(lengths[b].to(Int32), T)

        smem = SmemAllocator()
        conv_s = smem.allocate_tensor(Float32, cute.make_layout((TM, NCONV), stride=(NCONV, 1)), 16)
        eg_s = smem.allocate_tensor(Float32, cute.make_layout((TM, D), stride=(D, 1)), 16)
        part_s = smem.allocate_tensor(
            Float32, cute.make_layout((2, 2, ROW_CHUNKS, BV), stride=(2 * ROW_CHUNKS * BV, ROW_CHUNKS * BV, BV, 1)), 16
        )
        beta_s = smem.allocate_tensor(Float32, cute.make_layout(TM), 16)
        kq_s = smem.allocate_tensor(Float32, cute.make_layout(TM), 16)
        ssq_s = smem.allocate_tensor(Float32, cute.make_layout(TM), 16)
        tot_s = smem.allocate_tensor(Float32, cute.make_layout(TM), 16)

        # o_t[v] is stored over q_t's first BV columns: q_t is dead once step t's barrier passed
        o_s = conv_s

        # Issue the state loads first: their latency hides behind the prologue below.
        S = cute.make_rmem_tensor((R,), Float32)
        for i in cutlass.range_constexpr(R):
            S[i] = state[b, h, kc * R + i, v_col]
        # Also prefetch what later phases read from global memory (f for the decay, the output
        # gate and norm weight), so that latency overlaps the conv loads instead of adding
        # round trips of its own.
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

        # Prologue 1: causal conv4 + SiLU of q, k (whole head) and v (this CTA's columns).
        for j in cutlass.range(tidx, NCONV, NT):
            proj = Int32(2)
            ch = h * D + vs * BV + (j - 2 * D)
            if j < D:
                proj = Int32(0)
                ch = h * D + j
            elif j < 2 * D:
                proj = Int32(1)
                ch = h * D + (j - D)
            w0 = conv_weight[proj, ch, 0]
            w1 = conv_weight[proj, ch, 1]
            w2 = conv_weight[proj, ch, 2]
            w3 = conv_weight[proj, ch, 3]
            window = cute.make_rmem_tensor((TM + 3,), Float32)
            for i in cutlass.range_constexpr(3):
                window[i] = conv_state[b, proj, ch, i].to(Float32)
            # inputs are rounded to the window's dtype first, so a position reads the same value
            # here as later from the committed window; they are recorded for the window shift
            for t in cutlass.range_constexpr(TM):
                if t < T:
                    x = load_projection(q_in, k_in, v_in, proj, b, t, ch).to(rec_x.element_type)
                    window[t + 3] = x.to(Float32)
                    if proj == 2:
                        rec_x[b, proj, ch, t] = x
                    elif vs == 0:  # q/k channels are loaded by every V-split; one records them
                        rec_x[b, proj, ch, t] = x
            for t in cutlass.range_constexpr(TM):
                if t < T:
                    y = w0 * window[t] + w1 * window[t + 1] + w2 * window[t + 2] + w3 * window[t + 3]
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
            norm_q = cute.math.sqrt(warp_sum(ssq_q) + Float32(L2_EPS))
            norm_k = cute.math.sqrt(warp_sum(ssq_k) + Float32(L2_EPS))
            dot = Float32(0.0)
            for e in cutlass.range_constexpr(PER_LANE):
                qn = qv[e] / norm_q * Float32(SCALE)
                kn = kv[e] / norm_k
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

        # The delta rule, one token per step. o_t = S_t^T q = (decayed S)^T q + (k.q) u, so both
        # reductions over rows happen before the update and each step needs one barrier.
        for t in cutlass.range(T):
            buf = t % 2
            # 4 interleaved partial sums per dot product: short dependent FMA chains
            acc_k = cute.make_rmem_tensor((ACC,), Float32)
            acc_q = cute.make_rmem_tensor((ACC,), Float32)
            for a in cutlass.range_constexpr(ACC):
                acc_k[a] = Float32(0.0)
                acc_q[a] = Float32(0.0)
            for i in cutlass.range_constexpr(R):
                S[i] = S[i] * eg_s[t, kc * R + i]
                acc_k[i % ACC] = acc_k[i % ACC] + S[i] * conv_s[t, D + kc * R + i]
                acc_q[i % ACC] = acc_q[i % ACC] + S[i] * conv_s[t, kc * R + i]
            part_s[buf, 0, kc, v_local] = (acc_k[0] + acc_k[1]) + (acc_k[2] + acc_k[3])
            part_s[buf, 1, kc, v_local] = (acc_q[0] + acc_q[1]) + (acc_q[2] + acc_q[3])
            cute.arch.sync_threads()
            s_k = part_s[buf, 0, 0, v_local]
            s_q = part_s[buf, 1, 0, v_local]
            for c in cutlass.range_constexpr(1, ROW_CHUNKS):
                s_k = s_k + part_s[buf, 0, c, v_local]
                s_q = s_q + part_s[buf, 1, c, v_local]
            u = beta_s[t] * (conv_s[t, 2 * D + v_local] - s_k)
            for i in cutlass.range_constexpr(R):
                S[i] = cute.math.fma(conv_s[t, D + kc * R + i], u, S[i])
            if kc == 0:
                o_s[t, v_local] = s_q + kq_s[t] * u
                u_record = Float32(0.0)
                if t < n_valid:
                    u_record = u
                rec_u[b, t, h, v_col] = u_record
        cute.arch.sync_threads()

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

    @cute.jit
    def launch(
        q_in: cute.Tensor, k_in: cute.Tensor, v_in: cute.Tensor, f: cute.Tensor,
        beta_in: cute.Tensor, gate_in: cute.Tensor, conv_weight: cute.Tensor, conv_state: cute.Tensor,
        a_log: cute.Tensor, dt_bias: cute.Tensor, o_norm_weight: cute.Tensor, state: cute.Tensor,
        lengths: cute.Tensor, out: cute.Tensor, rec_k: cute.Tensor, rec_u: cute.Tensor,
        rec_eg: cute.Tensor, rec_x: cute.Tensor, lower_bound: Float32, eps: Float32, stream,
    ):
        batch = state.shape[0]
        heads = state.shape[1]
        verify_kernel(
            q_in, k_in, v_in, f, beta_in, gate_in, conv_weight, conv_state, a_log, dt_bias,
            o_norm_weight, state, lengths, out, rec_k, rec_u, rec_eg, rec_x, lower_bound, eps,
        ).launch(grid=[NV, heads, batch], block=[NT, 1, 1], cluster=[NV, 1, 1], stream=stream)

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
        Float32(0.0), Float32(0.0), cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
    )
    return cute.compile(launch, *args, options=compile_options(arch, *extra_options))


def compile_verify(arch: str, head_dim: int, block_v: int, max_tokens: int, in_dtype: torch.dtype,
                   conv_dtype: torch.dtype, extra_options: tuple[str, ...] = ()):
    """The compiled verify kernel for one variant (cached; CPU-only compile works with any arch).

    extra_options: more cute.compile flags, e.g. ("--keep-ptx",) to inspect the PTX (written to
    the current directory).
    """
    _check_head_dim(head_dim, block_v)
    if not 1 <= max_tokens <= MAX_TOKENS:
        raise ValueError(f"max_tokens={max_tokens}: must be in 1..{MAX_TOKENS}")
    key = ("kda_verify", arch, head_dim, block_v, max_tokens, in_dtype, conv_dtype, extra_options)
    return _cache.get(key, lambda: _build_verify(
        arch, head_dim, block_v, max_tokens, torch_to_cutlass_dtype(in_dtype), torch_to_cutlass_dtype(conv_dtype),
        extra_options))


# ----------------------------------------------------------------------------------------------
# commit


def _build_commit(arch: str, head_dim: int, block_v: int, conv_dtype, extra_options):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32
    from cutlass.memory import SmemAllocator

    D, BV = head_dim, block_v
    NV = D // BV
    R = D // ROW_CHUNKS
    NT = ROW_CHUNKS * BV
    CONV_PER_CTA = 3 * D // NV  # conv channels (q, k, v of this head) shifted by each CTA
    TM = MAX_TOKENS
    STAGE_ROUNDS = (TM * D + NT - 1) // NT  # k / exp(g) record elements staged per thread

    @cute.kernel
    def commit_kernel(
        state: cute.Tensor, conv_state: cute.Tensor, rec_k: cute.Tensor, rec_u: cute.Tensor,
        rec_eg: cute.Tensor, rec_x: cute.Tensor, num_tokens: cute.Tensor,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        vs, h, layer_batch = cute.arch.block_idx()
        batch = state.shape[1]
        layer = layer_batch // batch
        b = layer_batch % batch
        warp = tidx // 32
        lane = tidx % 32
        kc = warp % ROW_CHUNKS
        v_col = vs * BV + (warp // ROW_CHUNKS) * 32 + lane
        n = cutlass.min(num_tokens[b].to(Int32), rec_u.shape[2])  # never replay past the verified T
        smem = SmemAllocator()
        k_s = smem.allocate_tensor(Float32, cute.make_layout((TM, D), stride=(D, 1)), 16)
        eg_s = smem.allocate_tensor(Float32, cute.make_layout((TM, D), stride=(D, 1)), 16)

        # zero accepted tokens leaves state and window untouched (no stale write-back)
        if n > 0:
            # Issue every global load first (state slice, this column's u, this head's k and
            # exp(g) rows), so the replay costs one memory round trip instead of one per token.
            S = cute.make_rmem_tensor((R,), Float32)
            for i in cutlass.range_constexpr(R):
                S[i] = state[layer, b, h, kc * R + i, v_col]
            u_pre = cute.make_rmem_tensor((TM,), Float32)
            for t in cutlass.range_constexpr(TM):
                if t < n:
                    u_pre[t] = rec_u[layer, b, t, h, v_col]
            k_pre = cute.make_rmem_tensor((STAGE_ROUNDS,), Float32)
            eg_pre = cute.make_rmem_tensor((STAGE_ROUNDS,), Float32)
            for r in cutlass.range_constexpr(STAGE_ROUNDS):
                t = (tidx + r * NT) // D
                if t < n:
                    k_pre[r] = rec_k[layer, b, t, h, (tidx + r * NT) % D]
                    eg_pre[r] = rec_eg[layer, b, t, h, (tidx + r * NT) % D]

            # conv window <- the last 3 of [window; first n inputs] (independent of the state)
            for j in cutlass.range(tidx, CONV_PER_CTA, NT):
                c = vs * CONV_PER_CTA + j
                proj = c // D
                ch = h * D + c % D
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

            for t in cutlass.range_constexpr(TM):  # unrolled: u_pre is indexed by constants only
                if t < n:
                    # the same mul + fma as verify's in-register update, so the bits agree
                    for i in cutlass.range_constexpr(R):
                        S[i] = S[i] * eg_s[t, kc * R + i]
                        S[i] = cute.math.fma(k_s[t, kc * R + i], u_pre[t], S[i])
            for i in cutlass.range_constexpr(R):
                state[layer, b, h, kc * R + i, v_col] = S[i]

    @cute.jit
    def launch(
        state: cute.Tensor, conv_state: cute.Tensor, rec_k: cute.Tensor, rec_u: cute.Tensor,
        rec_eg: cute.Tensor, rec_x: cute.Tensor, num_tokens: cute.Tensor, stream,
    ):
        layers = state.shape[0]
        batch = state.shape[1]
        heads = state.shape[2]
        commit_kernel(state, conv_state, rec_k, rec_u, rec_eg, rec_x, num_tokens).launch(
            grid=[NV, heads, layers * batch], block=[NT, 1, 1], stream=stream
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
                   extra_options: tuple[str, ...] = ()):
    """The compiled commit kernel for one variant (cached), see compile_verify."""
    _check_head_dim(head_dim, block_v)
    key = ("kda_commit", arch, head_dim, block_v, conv_dtype, extra_options)
    return _cache.get(key, lambda: _build_commit(arch, head_dim, block_v, torch_to_cutlass_dtype(conv_dtype),
                                                 extra_options))


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
           block_v: int | None = None, records: KDARecords | None = None, out: torch.Tensor | None = None):
    """Output-only KDA verify, the reference kda_verify's contract. Returns (out, records).

    `records` and `out`, if given, are filled in place (records e.g. as views of stacked per-layer
    buffers from allocate_records(leading=(L,)), so that one commit launch replays every layer).
    records.lengths is the `lengths` tensor itself, not a copy; commit does not read it.
    """
    _require(state.dim() == 4 and state.dtype == torch.float32, "state.shape", (tuple(state.shape), state.dtype),
             "must be [B, H, D, D] fp32")
    B, H, D, D2 = state.shape
    _require(D == D2, "state.shape", tuple(state.shape), "must be [B, H, D, D]")
    block_v = block_v or default_block_v(D, "verify")
    _check_head_dim(D, block_v)
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
    kernel = compile_verify(arch, D, block_v, MAX_TOKENS, dtype, conv_state.dtype)
    c = torch.Tensor.contiguous
    kernel(c(q_in), c(k_in), c(v_in), c(f), c(beta_in), c(gate_in), c(conv_weight), c(conv_state), c(A_log),
           c(dt_bias), c(o_norm_weight), c(state), lengths, out, records.keys, records.updates, records.decays,
           records.conv_inputs, float(lower_bound), float(eps))
    return out, records


def _num_tokens_tensor(num_tokens, batch: int, device) -> torch.Tensor:
    num_tokens = torch.as_tensor(num_tokens, device=device)
    _require(tuple(num_tokens.shape) == (batch,) and not num_tokens.is_floating_point(), "num_tokens.shape",
             (tuple(num_tokens.shape), num_tokens.dtype), f"must be [{batch}] integer")
    return num_tokens.to(dtype=torch.int64).contiguous()


def commit_layers(states, conv_states, records: KDARecords, num_tokens, *, arch: str,
                  block_v: int | None = None) -> None:
    """Commit the first num_tokens[b] verified positions of L stacked layers in one launch.

    states [L, B, H, D, D] fp32 and conv_states [L, B, 3, W, 3], both contiguous and updated in
    place; records with a leading L (keys/updates/decays [L, B, T, H, D], conv_inputs
    [L, B, 3, W, T]); num_tokens [B] in 0..T, shared by the layers. Counts above T are clamped
    to T on the device; the caller keeps them <= lengths (no host sync to check it here).
    """
    _require(states.dim() == 5 and states.dtype == torch.float32 and states.is_contiguous(), "states.shape",
             (tuple(states.shape), states.dtype), "must be contiguous [L, B, H, D, D] fp32")
    L, B, H, D, _ = states.shape
    block_v = block_v or default_block_v(D, "commit")
    _check_head_dim(D, block_v)
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
    kernel = compile_commit(arch, D, block_v, conv_states.dtype)
    c = torch.Tensor.contiguous
    kernel(states, conv_states, c(records.keys), c(records.updates), c(records.decays), c(records.conv_inputs),
           _num_tokens_tensor(num_tokens, B, states.device))


def commit(state, conv_state, records: KDARecords, num_tokens, *, arch: str, block_v: int | None = None) -> None:
    """One layer (the reference kda_commit's contract): bring state [B, H, D, D] and conv_state
    [B, 3, W, 3] in place to the first num_tokens[b] verified positions; 0 leaves both untouched."""
    _require(state.dim() == 4, "state.shape", tuple(state.shape), "must be [B, H, D, D]")
    _require(conv_state.dim() == 4, "conv_state.shape", tuple(conv_state.shape), "must be [B, 3, W, 3]")
    stacked = KDARecords(records.keys.unsqueeze(0), records.updates.unsqueeze(0), records.decays.unsqueeze(0),
                         records.conv_inputs.unsqueeze(0), records.lengths)
    commit_layers(state.unsqueeze(0), conv_state.unsqueeze(0), stacked, num_tokens, arch=arch, block_v=block_v)
