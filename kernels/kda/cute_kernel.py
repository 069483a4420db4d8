"""KDA verify + commit as CuTe DSL kernels, shared by the sm_90a and sm_100a/sm_103a builds.

The recurrence is SIMT work (fp32 FMAs, warp shuffles, shared-memory broadcasts): no wgmma or
tcgen05, so the same kernel body is compiled for Hopper and Blackwell; only the target differs
(docs/kernels.md §7 rows 4-5: one SIMT kernel for both). The host side (options,
argument checks, compile cache, torch wrappers) is kda/cute_host.py.

Verify (one launch per layer, output-only; docs/kimi-k3.md §2.1, §2.3 "output-only verify"):
  grid (V-split, head, request), cluster = the V-splits of one head (block_v columns per CTA;
  the default is one CTA per head). Each CTA holds a [D x BV] slice of the fp32 state in
  registers (read once, never written), recomputes the head's conv4+SiLU, L2 norms, gate and
  beta for all T tokens into shared memory, runs the T-step delta rule, and writes per-position
  records (k, u, exp(g)) for commit. The head-wide RMSNorm of the output needs the sum of squares
  over all V columns: the V-split CTAs of one head exchange their partial sums through
  distributed shared memory inside the cluster.
Commit (one launch for a stack of layers): replays the accepted prefix from the records
  (S <- exp(g) * S; S <- S + k u^T) and shifts the conv window by the accepted count. Records
  do not depend on block_v, so verify and commit pick theirs independently.

Slot pools (slot_indexed builds; docs/kernels.md §10.3, §10.4): the state and conv window are
  a target's per-slot pools, read (verify) and advanced in place (commit) at row slots[b] of
  request b, so no gather or scatter copies surround the kernels. The row is looked up once per
  CTA (state_row) and enters every state and conv address; the pools' slot (and layer) strides
  are runtime values, 64-bit because a pool of all layers passes 2^31 elements. Unindexed builds
  use row b and never read the slots argument.

Thread layout of a state slice (options cols C, row_chunks RC): warp w owns state rows
[kc*R, (kc+1)*R) with kc = w % RC and R = D / RC, and column block vc = w // RC; lane l owns
columns vc*32*C + l + 32*c for c < C. A warp reads rows of the state (32 consecutive floats,
coalesced), reads k/q/exp(g) as shared-memory broadcasts (one per row, shared by the thread's C
columns: more columns per thread means fewer shared-memory reads per FMA), and reduces over its
R rows serially; the RC row chunks are summed through shared memory in a fixed order, so every
thread of a column gets the same bits, and verify and commit apply the same mul + fma per step
whatever either's layout.
"""
# No `from __future__ import annotations`: CuTe DSL evaluates the device functions' annotations.

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.memory import SmemAllocator

from ..cute_common import compile_options

L2_EPS = 1e-6  # q, k <- x / sqrt(sum x^2 + 1e-6) (docs/kimi-k3.md §2.1 step 2)
BULK_COPY_PTX = ("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
                 "[{$r0}], [{$r1}], {$r2}, [{$r3}];")
REMOTE_LOAD_PTX = ("{ .reg .u32 remote; mapa.shared::cluster.u32 remote, {$r0}, {$r1}; "
                   "ld.shared::cluster.f32 {$w0}, [remote]; }")


def _tree_sum(values, first: int, count: int, stride: int):
    """Pairwise sum of values[first + stride * a] for a < count (a power of two), a fixed order."""
    if count == 1:
        return values[first]
    half = count // 2
    return _tree_sum(values, first, half, stride) + _tree_sum(values, first + half * stride, half, stride)


def _warp_sum(x):
    for i in range(5):  # plain helper, unrolled while tracing
        x = x + cute.arch.shuffle_sync_bfly(x, offset=1 << (4 - i))
    return x


class StateSliceKernel:
    """What verify and commit share: the thread layout of a [head_dim x block_v] fp32 state slice
    (module docstring) and its copy from global to shared memory on the TMA unit (bulk_state)."""

    def __init__(self, head_dim: int, block_v: int, cols: int, row_chunks: int, bulk_state: bool, pdl: bool,
                 slot_indexed: bool):
        self.D, self.BV, self.C, self.RC = head_dim, block_v, cols, row_chunks
        self.NV = head_dim // block_v  # V-split CTAs per head (= cluster size)
        self.R = head_dim // row_chunks  # state rows per thread
        self.NT = row_chunks * block_v // cols  # threads per CTA
        self.bulk_state, self.pdl, self.slot_indexed = bulk_state, pdl, slot_indexed

    def state_row(self, slots: cute.Tensor, b):
        """The pool row of request b: slots[b] in slot_indexed builds, else b; Int64, so that
        row times the slot stride cannot overflow."""
        if cutlass.const_expr(self.slot_indexed):
            return slots[b]
        return Int64(b)

    @cute.jit
    def setup_bulk_state(self, smem: SmemAllocator, tidx: Int32):
        """Shared memory for the state slice and the mbarrier its copy completes on, armed."""
        state_s = smem.allocate_tensor(Float32, cute.make_layout((self.D, self.BV), stride=(self.BV, 1)), 128)
        mbar = smem.allocate_tensor(Int64, cute.make_layout(1), 8)
        if tidx == 0:
            cute.arch.mbarrier_init(mbar.iterator, 1)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        return state_s, mbar

    @cute.jit
    def start_state_copy(self, state_row0: cute.Pointer, smem: cute.Tensor, mbar: cute.Pointer, lane: Int32,
                         warp: Int32):
        """Start the copy of the CTA's state slice into `smem` on the TMA unit (cp.async.bulk: no
        registers, no per-thread requests); state_row0 points at row 0, column vs*block_v of the
        slice. Register loads (32 x 4-byte loads per thread) took ~7 us for the 64 KB of a head,
        far under the per-SM bandwidth; bulk copies are the Hopper way to stream a large
        contiguous block into an SM. Warp 0 issues the copies (a whole-head slice is one contiguous
        block, cut in 32 pieces; a narrower slice is one copy per row) and lane 0 arms the mbarrier
        with the byte count."""
        D, BV = self.D, self.BV
        contiguous = BV == D
        pieces = 32 if contiguous else D  # copies per slice
        rows_per_piece = D // 32 if contiguous else 1
        if warp == 0:
            if lane == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(mbar, D * BV * 4)
            for i in cutlass.range_constexpr(pieces // 32):
                row = (lane + 32 * i) * rows_per_piece
                cute.arch.inline_ptx(
                    BULK_COPY_PTX,
                    read_only_args=[smem.iterator + row * BV, state_row0 + row * D, Int32(rows_per_piece * BV * 4),
                                    mbar],
                )

    @cute.jit
    def read_state_slice(self, S: cute.Tensor, state_s: cute.Tensor, row0: Int32, col0: Int32):
        """This thread's rows row0.. and columns col0 + 32 c of the slice, from shared memory into
        registers (once the bulk copy's mbarrier has completed)."""
        for i in cutlass.range_constexpr(self.R):
            for c in cutlass.range_constexpr(self.C):
                S[i * self.C + c] = state_s[row0 + i, col0 + 32 * c]


class KdaVerify(StateSliceKernel):
    """The verify kernel of one variant (options: kda/cute_host.compile_verify)."""

    def __init__(self, head_dim: int, block_v: int, max_tokens: int, conv_dtype, cols: int, row_chunks: int,
                 fast_math: bool, bulk_state: bool, group_sync: bool, pdl: bool, probe: bool, slot_indexed: bool):
        super().__init__(head_dim, block_v, cols, row_chunks, bulk_state, pdl, slot_indexed)
        D, BV, C, RC, NT = head_dim, block_v, cols, row_chunks, self.NT
        self.TM, self.conv_dtype, self.fast_math, self.probe = max_tokens, conv_dtype, fast_math, probe
        self.NWARPS = NT // 32
        self.NCONV = 2 * D + BV  # conv outputs per token in this CTA: q (D), k (D), this CTA's v slice (BV)
        self.CONV_ROUNDS = (self.NCONV + NT - 1) // NT  # conv channels per thread
        self.PER_LANE = D // 32
        # partial sums per dot product and column: short dependent FMA chains (more columns per
        # thread give independent chains of their own)
        self.ACC = max(1, 4 // C)
        self.OUT_ROUNDS = (max_tokens * BV + NT - 1) // NT  # output elements per thread (t-major, column tidx % BV)
        self.SCALE = D**-0.5
        self.CLUSTER = [self.NV, 1, 1] if self.NV > 1 else None  # one CTA per head: a plain launch
        # group_sync: the RC warps of one column block exchange partial sums among themselves, so
        # each step waits on a named barrier of its block (ids 1..GROUPS) instead of the whole CTA
        self.GROUP_SYNC = group_sync and self.NWARPS // RC > 1

    def reciprocal(self, x):
        # fast_math: rcp.approx (~1 ulp) instead of the IEEE division's slow path
        if self.fast_math:
            return cute.arch.rcp_approx(x)
        return Float32(1.0) / x

    def sigmoid(self, x):
        return self.reciprocal(Float32(1.0) + cute.math.exp(-x))

    def mark(self, marks: cute.Tensor, phase: int):
        """Probe build: clock64 and %globaltimer at the phase boundary `phase` (0..4)."""
        if cutlass.const_expr(self.probe):
            marks[phase] = cute.arch.clock64()
            marks[5 + phase] = cute.arch.globaltimer()

    @cute.jit
    def __call__(
        self, q_in: cute.Tensor, k_in: cute.Tensor, v_in: cute.Tensor, f: cute.Tensor,
        beta_in: cute.Tensor, gate_in: cute.Tensor, conv_weight: cute.Tensor, conv_state: cute.Tensor,
        a_log: cute.Tensor, dt_bias: cute.Tensor, o_norm_weight: cute.Tensor, state: cute.Tensor,
        lengths: cute.Tensor, slots: cute.Tensor, out: cute.Tensor, rec_k: cute.Tensor, rec_u: cute.Tensor,
        rec_eg: cute.Tensor, rec_x: cute.Tensor, probe_out: cute.Tensor, lower_bound: Float32, eps: Float32,
        stream,
    ):
        batch = q_in.shape[0]  # the state is a pool of any number of rows in slot_indexed builds
        heads = state.shape[1]
        self.verify_kernel(
            q_in, k_in, v_in, f, beta_in, gate_in, conv_weight, conv_state, a_log, dt_bias,
            o_norm_weight, state, lengths, slots, out, rec_k, rec_u, rec_eg, rec_x, probe_out, lower_bound, eps,
        ).launch(grid=[self.NV, heads, batch], block=[self.NT, 1, 1], cluster=self.CLUSTER, stream=stream,
                 use_pdl=self.pdl)

    @cute.kernel
    def verify_kernel(
        self, q_in: cute.Tensor, k_in: cute.Tensor, v_in: cute.Tensor, f: cute.Tensor,
        beta_in: cute.Tensor, gate_in: cute.Tensor, conv_weight: cute.Tensor, conv_state: cute.Tensor,
        a_log: cute.Tensor, dt_bias: cute.Tensor, o_norm_weight: cute.Tensor, state: cute.Tensor,
        lengths: cute.Tensor, slots: cute.Tensor, out: cute.Tensor, rec_k: cute.Tensor, rec_u: cute.Tensor,
        rec_eg: cute.Tensor, rec_x: cute.Tensor, probe_out: cute.Tensor, lower_bound: Float32, eps: Float32,
    ):
        D, BV, TM, C, R = self.D, self.BV, self.TM, self.C, self.R
        tidx, _, _ = cute.arch.thread_idx()
        vs, h, b = cute.arch.block_idx()
        if cutlass.const_expr(self.pdl):
            # launched early (programmatic dependent launch): wait for the previous kernel's
            # results before touching memory; only the launch latency overlaps its tail
            cute.arch.griddepcontrol_wait()
        marks = cute.make_rmem_tensor((10,), Int64)  # probe: clock64 and globaltimer at 5 points
        self.mark(marks, 0)
        warp = tidx // 32
        lane = tidx % 32
        kc = warp % self.RC
        v_first = (warp // self.RC) * 32 * C + lane  # this thread's columns: v_first + 32 * c, c < C
        T = q_in.shape[1]
        # positions at or beyond lengths[b] are padding: no records, zero output
        n_valid = cutlass.min(lengths[b].to(Int32), T)
        row = self.state_row(slots, b)  # request b's row of the state and conv pools

        smem = SmemAllocator()
        conv_s, eg_s, part_s, beta_s, kq_s, ssq_s, tot_s, o_s = self.allocate_shared(smem)
        S = cute.make_rmem_tensor((R * C,), Float32)
        if cutlass.const_expr(self.bulk_state):
            # the slice streams into shared memory on the TMA unit while the prologue runs
            state_s, mbar = self.setup_bulk_state(smem, tidx)
            self.start_state_copy(state.iterator + cute.crd2idx((row, h, 0, vs * BV), state.layout), state_s,
                                  mbar.iterator, lane, warp)

        # Every global load of the CTA is issued before the first use or store, so the prologue
        # costs one memory round trip: the gate and norm weight for the output, f / dt_bias /
        # beta for the decays, the conv inputs, taps and window, then the state.
        gate_pre, norm_weight, a_log_h, f_pre, bias, beta_raw = self.load_gate_and_decay_inputs(
            gate_in, o_norm_weight, a_log, dt_bias, f, beta_in, tidx, vs, h, b, T)
        xs, taps = self.load_conv_inputs(q_in, k_in, v_in, conv_weight, conv_state, tidx, vs, h, b, row, T)
        # The state slice last: its 64 KB per head are the bulk of the loads and are first needed
        # by the recurrence, so the conv inputs above do not queue behind them.
        if cutlass.const_expr(not self.bulk_state):
            for i in cutlass.range_constexpr(R):
                for c in cutlass.range_constexpr(C):
                    S[i * C + c] = state[row, h, kc * R + i, vs * BV + v_first + 32 * c]

        self.conv_silu(xs, taps, conv_s, rec_x, tidx, vs, h, b, T)
        # Prologue 2: decay exp(g) per key channel, g = lb * sigmoid(exp(A_log[h]) (f + dt_bias)).
        if tidx < D:
            a = cute.math.exp(a_log_h)
            for t in cutlass.range_constexpr(TM):
                if t < T:
                    g = lower_bound * self.sigmoid(a * (f_pre[t] + bias))
                    eg_s[t, tidx] = cute.math.exp(g)
        if tidx < T:
            beta_s[tidx] = self.sigmoid(beta_raw)
        self.mark(marks, 1)
        cute.arch.sync_threads()
        self.normalize_qk(conv_s, eg_s, kq_s, rec_k, rec_eg, warp, lane, vs, h, b, T, n_valid)
        cute.arch.sync_threads()
        self.mark(marks, 2)

        if cutlass.const_expr(self.pdl):
            # the next kernel may launch now; it waits for this grid to finish before it reads
            cute.arch.griddepcontrol_launch_dependents()
        if cutlass.const_expr(self.bulk_state):
            cute.arch.mbarrier_wait(mbar.iterator, 0)
            self.read_state_slice(S, state_s, kc * R, v_first)
        self.delta_rule(S, conv_s, eg_s, part_s, beta_s, kq_s, o_s, rec_u, warp, kc, v_first, vs, h, b, T, n_valid)
        cute.arch.sync_threads()
        self.mark(marks, 3)

        self.gated_rmsnorm(o_s, ssq_s, tot_s, gate_pre, norm_weight, out, eps, tidx, warp, lane, vs, h, b, T, n_valid)
        if cutlass.const_expr(self.NV > 1):
            # keep this CTA's shared memory alive until every peer has read it
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        self.mark(marks, 4)
        if cutlass.const_expr(self.probe):
            if tidx == 0:
                for m in cutlass.range_constexpr(10):
                    probe_out[b, h, vs, m] = marks[m]

    @cute.jit
    def allocate_shared(self, smem: SmemAllocator):
        """conv outputs (q, k, v per token), exp(g), the row chunks' partial dots (double
        buffered), beta, k.q, the RMSNorm sums and the output o_t."""
        D, BV, TM, RC = self.D, self.BV, self.TM, self.RC
        conv_s = smem.allocate_tensor(Float32, cute.make_layout((TM, self.NCONV), stride=(self.NCONV, 1)), 16)
        eg_s = smem.allocate_tensor(Float32, cute.make_layout((TM, D), stride=(D, 1)), 16)
        part_s = smem.allocate_tensor(
            Float32, cute.make_layout((2, 2, RC, BV), stride=(2 * RC * BV, RC * BV, BV, 1)), 16
        )
        beta_s = smem.allocate_tensor(Float32, cute.make_layout(TM), 16)
        kq_s = smem.allocate_tensor(Float32, cute.make_layout(TM), 16)
        ssq_s = smem.allocate_tensor(Float32, cute.make_layout(TM), 16)
        tot_s = smem.allocate_tensor(Float32, cute.make_layout(TM), 16)
        if cutlass.const_expr(self.GROUP_SYNC):
            # column blocks run their steps independently: q_t may still be read by another block
            o_s = smem.allocate_tensor(Float32, cute.make_layout((TM, BV), stride=(BV, 1)), 16)
        else:
            # o_t[v] is stored over q_t's first BV columns: q_t is dead once step t's barrier passed
            o_s = conv_s
        return conv_s, eg_s, part_s, beta_s, kq_s, ssq_s, tot_s, o_s

    @cute.jit
    def load_gate_and_decay_inputs(self, gate_in: cute.Tensor, o_norm_weight: cute.Tensor, a_log: cute.Tensor,
                                   dt_bias: cute.Tensor, f: cute.Tensor, beta_in: cute.Tensor, tidx: Int32,
                                   vs: Int32, h: Int32, b: Int32, T: Int32):
        """The output gate and norm weight of this thread's output elements; A_log, dt_bias and f
        of its key channel (tidx < D) and beta of its token (tidx < T)."""
        D, BV, TM = self.D, self.BV, self.TM
        gate_pre = cute.make_rmem_tensor((self.OUT_ROUNDS,), Float32)
        for r in cutlass.range_constexpr(self.OUT_ROUNDS):
            t_out = (tidx + r * self.NT) // BV
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
        return gate_pre, norm_weight, a_log_h, f_pre, bias, beta_raw

    @cute.jit
    def conv_channel(self, j: Int32, vs: Int32, h: Int32):
        """Conv channel j of this CTA: q (j < D), k (j < 2D) or this CTA's v columns -> (projection,
        channel); warp-uniform (D and the thread count are multiples of 32)."""
        D = self.D
        proj = Int32(2)
        ch = h * D + vs * self.BV + (j - 2 * D)
        if j < D:
            proj = Int32(0)
            ch = h * D + j
        elif j < 2 * D:
            proj = Int32(1)
            ch = h * D + (j - D)
        return proj, ch

    @cute.jit
    def load_inputs(self, src: cute.Tensor, b: Int32, ch: Int32, T: Int32, xs: cute.Tensor, base: cutlass.Constexpr):
        # every token's load is issued before any use: one memory round trip, not T
        for t in cutlass.range_constexpr(self.TM):
            if t < T:
                # rounded to the window's dtype, so a position reads the same value here as later
                # from the committed window
                xs[base + t] = src[b, t, ch].to(self.conv_dtype).to(Float32)

    @cute.jit
    def load_conv_inputs(self, q_in: cute.Tensor, k_in: cute.Tensor, v_in: cute.Tensor, conv_weight: cute.Tensor,
                         conv_state: cute.Tensor, tidx: Int32, vs: Int32, h: Int32, b: Int32, row: Int64, T: Int32):
        """This thread's conv channels: the T inputs of request b, the 4 taps and the 3 window
        values each (the window from pool row `row`)."""
        D, TM = self.D, self.TM
        xs = cute.make_rmem_tensor((self.CONV_ROUNDS * TM,), Float32)
        taps = cute.make_rmem_tensor((self.CONV_ROUNDS * 7,), Float32)  # 4 weights, 3 window values
        for r in cutlass.range_constexpr(self.CONV_ROUNDS):
            j = tidx + r * self.NT
            if j < self.NCONV:
                # conv_channel's choice, with each branch's loads issued inside it
                proj = Int32(2)
                ch = h * D + vs * self.BV + (j - 2 * D)
                if j < D:
                    proj = Int32(0)
                    ch = h * D + j
                    self.load_inputs(q_in, b, ch, T, xs, r * TM)
                elif j < 2 * D:
                    proj = Int32(1)
                    ch = h * D + (j - D)
                    self.load_inputs(k_in, b, ch, T, xs, r * TM)
                else:
                    self.load_inputs(v_in, b, ch, T, xs, r * TM)
                for i in cutlass.range_constexpr(4):
                    taps[r * 7 + i] = conv_weight[proj, ch, i]
                for i in cutlass.range_constexpr(3):
                    taps[r * 7 + 4 + i] = conv_state[row, proj, ch, i].to(Float32)
        return xs, taps

    @cute.jit
    def conv_silu(self, xs: cute.Tensor, taps: cute.Tensor, conv_s: cute.Tensor, rec_x: cute.Tensor, tidx: Int32,
                  vs: Int32, h: Int32, b: Int32, T: Int32):
        """Prologue 1: causal conv4 + SiLU of q, k (whole head) and v (this CTA's columns); the
        rounded inputs are recorded for commit's window shift."""
        TM = self.TM
        for r in cutlass.range_constexpr(self.CONV_ROUNDS):
            j = tidx + r * self.NT
            if j < self.NCONV:
                proj, ch = self.conv_channel(j, vs, h)
                window = cute.make_rmem_tensor((TM + 3,), Float32)
                for i in cutlass.range_constexpr(3):
                    window[i] = taps[r * 7 + 4 + i]
                for t in cutlass.range_constexpr(TM):
                    if t < T:
                        window[t + 3] = xs[r * TM + t]
                        if proj == 2:
                            rec_x[b, proj, ch, t] = xs[r * TM + t].to(self.conv_dtype)
                        elif vs == 0:  # q/k channels are loaded by every V-split; one records them
                            rec_x[b, proj, ch, t] = xs[r * TM + t].to(self.conv_dtype)
                for t in cutlass.range_constexpr(TM):
                    if t < T:
                        y = (taps[r * 7] * window[t] + taps[r * 7 + 1] * window[t + 1]
                             + taps[r * 7 + 2] * window[t + 2] + taps[r * 7 + 3] * window[t + 3])
                        conv_s[t, j] = y * self.sigmoid(y)

    @cute.jit
    def normalize_qk(self, conv_s: cute.Tensor, eg_s: cute.Tensor, kq_s: cute.Tensor, rec_k: cute.Tensor,
                     rec_eg: cute.Tensor, warp: Int32, lane: Int32, vs: Int32, h: Int32, b: Int32, T: Int32,
                     n_valid: Int32):
        """Prologue 3: L2-normalise q (times D^-1/2) and k, one warp per token; k.q for the output;
        the k and exp(g) records."""
        D, PER_LANE, SCALE = self.D, self.PER_LANE, self.SCALE
        for t in cutlass.range(warp, T, self.NWARPS):
            qv = cute.make_rmem_tensor((PER_LANE,), Float32)
            kv = cute.make_rmem_tensor((PER_LANE,), Float32)
            ssq_q = Float32(0.0)
            ssq_k = Float32(0.0)
            for e in cutlass.range_constexpr(PER_LANE):
                qv[e] = conv_s[t, lane + 32 * e]
                kv[e] = conv_s[t, D + lane + 32 * e]
                ssq_q = ssq_q + qv[e] * qv[e]
                ssq_k = ssq_k + kv[e] * kv[e]
            ssq_q = _warp_sum(ssq_q) + Float32(L2_EPS)
            ssq_k = _warp_sum(ssq_k) + Float32(L2_EPS)
            inv_q = Float32(0.0)
            inv_k = Float32(0.0)
            if cutlass.const_expr(self.fast_math):
                inv_q = cute.math.rsqrt(ssq_q) * Float32(SCALE)
                inv_k = cute.math.rsqrt(ssq_k)
            dot = Float32(0.0)
            for e in cutlass.range_constexpr(PER_LANE):
                qn = Float32(0.0)
                kn = Float32(0.0)
                if cutlass.const_expr(self.fast_math):
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
            dot = _warp_sum(dot)
            if lane == 0:
                kq_s[t] = dot

    @cute.jit
    def delta_rule(self, S: cute.Tensor, conv_s: cute.Tensor, eg_s: cute.Tensor, part_s: cute.Tensor,
                   beta_s: cute.Tensor, kq_s: cute.Tensor, o_s: cute.Tensor, rec_u: cute.Tensor, warp: Int32,
                   kc: Int32, v_first: Int32, vs: Int32, h: Int32, b: Int32, T: Int32, n_valid: Int32):
        """The delta rule, one token per step. o_t = S_t^T q = (decayed S)^T q + (k.q) u, so both
        reductions over rows happen before the update and each step needs one barrier."""
        D, C, R, RC, ACC = self.D, self.C, self.R, self.RC, self.ACC
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
            if cutlass.const_expr(self.GROUP_SYNC):
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
                    rec_u[b, t, h, vs * self.BV + v_local] = u_record
            for i in cutlass.range_constexpr(R):
                key = conv_s[t, D + kc * R + i]
                for c in cutlass.range_constexpr(C):
                    S[i * C + c] = cute.math.fma(key, u[c], S[i * C + c])

    @cute.jit
    def gated_rmsnorm(self, o_s: cute.Tensor, ssq_s: cute.Tensor, tot_s: cute.Tensor, gate_pre: cute.Tensor,
                      norm_weight: Float32, out: cute.Tensor, eps: Float32, tidx: Int32, warp: Int32, lane: Int32,
                      vs: Int32, h: Int32, b: Int32, T: Int32, n_valid: Int32):
        """Gated RMSNorm over the head's D output channels (docs/kimi-k3.md §2.1 step 6); the V-split
        CTAs of a head add up their sums of squares through distributed shared memory."""
        D, BV = self.D, self.BV
        for t in cutlass.range(warp, T, self.NWARPS):
            ssq = Float32(0.0)
            for e in cutlass.range_constexpr(BV // 32):
                o = o_s[t, lane + 32 * e]
                ssq = ssq + o * o
            ssq = _warp_sum(ssq)
            if lane == 0:
                ssq_s[t] = ssq
        cute.arch.sync_threads()
        if cutlass.const_expr(self.NV > 1):
            # partial sums of the other V-splits of this head, read from their shared memory
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
            if tidx < T:
                total = Float32(0.0)
                for r in cutlass.range_constexpr(self.NV):
                    total = total + cute.arch.inline_ptx(
                        REMOTE_LOAD_PTX, write_only_types=[Float32], read_only_args=[ssq_s.iterator + tidx, Int32(r)],
                    )
                tot_s[tidx] = total
        else:
            if tidx < T:
                tot_s[tidx] = ssq_s[tidx]
        cute.arch.sync_threads()

        for r in cutlass.range_constexpr(self.OUT_ROUNDS):
            t = (tidx + r * self.NT) // BV
            v = tidx % BV
            if t < T:
                result = Float32(0.0)
                if t < n_valid:
                    inv_rms = cute.math.rsqrt(tot_s[t] / Float32(D) + eps)
                    result = o_s[t, v] * inv_rms * norm_weight * self.sigmoid(gate_pre[r])
                out[b, t, h * D + vs * BV + v] = result.to(out.element_type)


class KdaCommit(StateSliceKernel):
    """The commit kernel of one variant (options: kda/cute_host.compile_commit)."""

    def __init__(self, head_dim: int, block_v: int, max_tokens: int, cols: int, row_chunks: int, bulk_state: bool,
                 pdl: bool, slot_indexed: bool):
        super().__init__(head_dim, block_v, cols, row_chunks, bulk_state, pdl, slot_indexed)
        self.TM = max_tokens
        self.CONV_PER_CTA = 3 * head_dim // self.NV  # conv channels (q, k, v of this head) shifted by each CTA
        self.STAGE_ROUNDS = (max_tokens * head_dim + self.NT - 1) // self.NT  # k / exp(g) elements staged per thread

    @cute.jit
    def __call__(
        self, state: cute.Tensor, conv_state: cute.Tensor, rec_k: cute.Tensor, rec_u: cute.Tensor,
        rec_eg: cute.Tensor, rec_x: cute.Tensor, num_tokens: cute.Tensor, slots: cute.Tensor, stream,
    ):
        layers = state.shape[0]
        batch = rec_u.shape[1]  # the state is a pool of any number of rows in slot_indexed builds
        heads = state.shape[2]
        self.commit_kernel(state, conv_state, rec_k, rec_u, rec_eg, rec_x, num_tokens, slots).launch(
            grid=[self.NV, heads, layers * batch], block=[self.NT, 1, 1], stream=stream, use_pdl=self.pdl
        )

    @cute.kernel
    def commit_kernel(
        self, state: cute.Tensor, conv_state: cute.Tensor, rec_k: cute.Tensor, rec_u: cute.Tensor,
        rec_eg: cute.Tensor, rec_x: cute.Tensor, num_tokens: cute.Tensor, slots: cute.Tensor,
    ):
        D, BV, TM, C, R = self.D, self.BV, self.TM, self.C, self.R
        tidx, _, _ = cute.arch.thread_idx()
        vs, h, layer_batch = cute.arch.block_idx()
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()  # the records come from the verify kernels before
            cute.arch.griddepcontrol_launch_dependents()
        batch = rec_u.shape[1]
        layer = layer_batch // batch
        b = layer_batch % batch
        row = self.state_row(slots, b)  # request b's row of this layer's state and conv pools
        warp = tidx // 32
        lane = tidx % 32
        kc = warp % self.RC
        v_first = vs * BV + (warp // self.RC) * 32 * C + lane  # this thread's columns: v_first + 32 * c
        n = cutlass.min(num_tokens[b].to(Int32), rec_u.shape[2])  # never replay past the verified T
        smem = SmemAllocator()
        k_s = smem.allocate_tensor(Float32, cute.make_layout((TM, D), stride=(D, 1)), 16)
        eg_s = smem.allocate_tensor(Float32, cute.make_layout((TM, D), stride=(D, 1)), 16)
        if cutlass.const_expr(self.bulk_state):
            state_s, mbar = self.setup_bulk_state(smem, tidx)

        # zero accepted tokens leaves state and window untouched (no stale write-back)
        if n > 0:
            # Issue every global load first (state slice, these columns' u, this head's k and
            # exp(g) rows), so the replay costs one memory round trip instead of one per token.
            S = cute.make_rmem_tensor((R * C,), Float32)
            if cutlass.const_expr(self.bulk_state):
                # the slice streams into shared memory on the TMA unit while the records load
                self.start_state_copy(state.iterator + cute.crd2idx((layer, row, h, 0, vs * BV), state.layout),
                                      state_s, mbar.iterator, lane, warp)
            else:
                for i in cutlass.range_constexpr(R):
                    for c in cutlass.range_constexpr(C):
                        S[i * C + c] = state[layer, row, h, kc * R + i, v_first + 32 * c]
            u_pre = cute.make_rmem_tensor((TM * C,), Float32)
            for t in cutlass.range_constexpr(TM):
                if t < n:
                    for c in cutlass.range_constexpr(C):
                        u_pre[t * C + c] = rec_u[layer, b, t, h, v_first + 32 * c]
            k_pre = cute.make_rmem_tensor((self.STAGE_ROUNDS,), Float32)
            eg_pre = cute.make_rmem_tensor((self.STAGE_ROUNDS,), Float32)
            for r in cutlass.range_constexpr(self.STAGE_ROUNDS):
                t = (tidx + r * self.NT) // D
                if t < n:
                    k_pre[r] = rec_k[layer, b, t, h, (tidx + r * self.NT) % D]
                    eg_pre[r] = rec_eg[layer, b, t, h, (tidx + r * self.NT) % D]

            self.shift_conv_window(conv_state, rec_x, tidx, vs, h, layer, b, row, n)
            for r in cutlass.range_constexpr(self.STAGE_ROUNDS):
                t = (tidx + r * self.NT) // D
                if t < n:
                    k_s[t, (tidx + r * self.NT) % D] = k_pre[r]
                    eg_s[t, (tidx + r * self.NT) % D] = eg_pre[r]
            cute.arch.sync_threads()
            if cutlass.const_expr(self.bulk_state):
                cute.arch.mbarrier_wait(mbar.iterator, 0)
                self.read_state_slice(S, state_s, kc * R, v_first - vs * BV)

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
                    state[layer, row, h, kc * R + i, v_first + 32 * c] = S[i * C + c]

    @cute.jit
    def shift_conv_window(self, conv_state: cute.Tensor, rec_x: cute.Tensor, tidx: Int32, vs: Int32, h: Int32,
                          layer: Int32, b: Int32, row: Int64, n: Int32):
        """conv window (pool row `row`) <- the last 3 of [window; request b's first n inputs]
        (independent of the state)."""
        D = self.D
        for j in cutlass.range(tidx, self.CONV_PER_CTA, self.NT):
            ch_all = vs * self.CONV_PER_CTA + j
            proj = ch_all // D
            ch = h * D + ch_all % D
            old0 = conv_state[layer, row, proj, ch, 0]
            old1 = conv_state[layer, row, proj, ch, 1]
            old2 = conv_state[layer, row, proj, ch, 2]
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
                conv_state[layer, row, proj, ch, i] = value


def build_verify(arch: str, head_dim: int, block_v: int, max_tokens: int, in_dtype, conv_dtype, cols: int,
                 row_chunks: int, fast_math: bool, bulk_state: bool, group_sync: bool, pdl: bool, probe: bool,
                 slot_indexed: bool, extra_options):
    """cute.compile of the verify kernel for symbolic B, T, W, H and pool rows S (head_dim is
    compiled in)."""
    kernel = KdaVerify(head_dim, block_v, max_tokens, conv_dtype, cols, row_chunks, fast_math, bulk_state,
                       group_sync, pdl, probe, slot_indexed)
    sym = cute.sym_int
    B, T, W, H, S = sym(), sym(), sym(), sym(), sym()
    fake = cute.runtime.make_fake_compact_tensor
    pool = cute.runtime.make_fake_tensor
    f32 = cutlass.Float32
    D = head_dim
    wide = cute.sym_int64  # slot strides: a pool of all layers passes 2^31 elements

    def btw(dtype):
        return fake(dtype, (B, T, W), stride_order=(2, 1, 0))

    def rows(width):
        """[B, T, width] inputs with their own batch and token strides (contiguous columns): the
        column slices of the fused input GEMM's output go in as they are, with no copy."""
        return cute.runtime.make_fake_tensor(in_dtype, (B, T, width), stride=(cute.sym_int64(), cute.sym_int64(), 1))

    def bthd():
        return fake(f32, (B, T, H, D), stride_order=(3, 2, 1, 0))

    args = (
        rows(W), rows(W), rows(W), rows(W), rows(H), rows(W),
        fake(f32, (3, W, 4), stride_order=(2, 1, 0)),
        pool(conv_dtype, (S, 3, W, 3), stride=(wide(), sym(), 3, 1)),  # rows [3, W, 3], any slot stride
        fake(f32, (sym(),)), fake(f32, (W,)), fake(f32, (D,)),
        pool(f32, (S, H, D, D), stride=(wide(), D * D, D, 1)),  # rows [H, D, D], any slot stride
        fake(cutlass.Int64, (B,)), fake(cutlass.Int64, (B,)), btw(in_dtype), bthd(), bthd(), bthd(),
        fake(conv_dtype, (B, 3, W, T), stride_order=(3, 2, 1, 0)),
        fake(cutlass.Int64, (sym(), sym(), sym(), sym()), stride_order=(3, 2, 1, 0)),
        Float32(0.0), Float32(0.0), cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
    )
    return cute.compile(kernel, *args, options=compile_options(arch, *extra_options))


def build_commit(arch: str, head_dim: int, block_v: int, max_tokens: int, conv_dtype, cols: int, row_chunks: int,
                 bulk_state: bool, pdl: bool, slot_indexed: bool, extra_options):
    """cute.compile of the commit kernel for symbolic L, B, T, W, H and pool rows S (head_dim is
    compiled in)."""
    kernel = KdaCommit(head_dim, block_v, max_tokens, cols, row_chunks, bulk_state, pdl, slot_indexed)
    sym = cute.sym_int
    L, B, T, W, H, S = sym(), sym(), sym(), sym(), sym(), sym()
    fake = cute.runtime.make_fake_compact_tensor
    pool = cute.runtime.make_fake_tensor
    f32 = cutlass.Float32
    D = head_dim
    wide = cute.sym_int64  # layer and slot strides: a pool of all layers passes 2^31 elements

    def lbthd():
        return fake(f32, (L, B, T, H, D), stride_order=(4, 3, 2, 1, 0))

    args = (
        pool(f32, (L, S, H, D, D), stride=(wide(), wide(), D * D, D, 1)),  # rows [H, D, D]
        pool(conv_dtype, (L, S, 3, W, 3), stride=(wide(), wide(), sym(), 3, 1)),  # rows [3, W, 3]
        lbthd(), lbthd(), lbthd(), fake(conv_dtype, (L, B, 3, W, T), stride_order=(4, 3, 2, 1, 0)),
        fake(cutlass.Int64, (B,)), fake(cutlass.Int64, (B,)),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
    )
    return cute.compile(kernel, *args, options=compile_options(arch, *extra_options))
