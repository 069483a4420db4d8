"""Triton kernels of the on-device acceptance (kernels/acceptance/triton.py wraps them).

Imported only when triton is installed (the registry imports kernels/acceptance on CPU-only CI
machines too, where triton is absent).

Split-row structure (docs/kernels.md §7 row 9, "tiny reduce + acceptance kernel"):
  1. `row_partials`: grid (split, position, request). Each program reads one chunk of one logits
     row once and writes its partials: the online-softmax (max, sum of exp) of the scaled,
     filtered logits, the raw-logit (max, first argmax) for greedy rows, and the exponential-race
     (max key, its index) over the chunk, the position's own draft token left out.
  2. `accept`: one program per request combines the partials of all its positions at once,
     decides the acceptance chain (docs/vllm-integration.md §6.1) and writes num_accepted and the
     next token.
  3. Only with dense draft probabilities q: `residual_partials` races max(p - q, 0) over the row
     where a sampled request rejected, and `residual_pick` combines it.
With programmatic dependent launch (the wrapper's pdl option) each kernel after the first may be
launched while its predecessor runs; it waits in griddepcontrol.wait before its first load, so
only the launch latency overlaps, never the data. Without the option no griddepcontrol is emitted.

The race argmax_v p(v) / E_v of reference.race is computed in the log domain,
argmax_v s(v) - log E_v with s the scaled logit (same argmax; p is exp(s - max) / sum). With a
one-hot draft x, the residual max(p - onehot(x), 0) is p without x, so its race is the race over
the row with x left out: that is why every position's partial leaves its own draft token out and
the combine adds it back for the bonus race. Ties go to the lowest index, like torch.argmax.
"""
import triton
import triton.language as tl

# Sizes that change from call to call (positions, drafts, steps, splits) are not value-specialised,
# so one compile serves every batch and k; `vocab` and the strides are (their divisibility by 16
# lets the row loads vectorise).
INDEX_NONE = tl.constexpr(2147483647)  # larger than any vocabulary index: loses every lowest-index tie-break


@triton.jit
def _kept(s, vocab_idx, floor_value, floor_index, FILTERED: tl.constexpr):
    """Tokens that survive: finite, and with filters above the row's threshold (value, index):
    s > value, or s == value and index <= floor_index (see triton.filter_threshold)."""
    keep = s != float("-inf")
    if FILTERED:
        keep = keep & ((s > floor_value) | ((s == floor_value) & (vocab_idx <= floor_index)))
    return keep


@triton.jit(do_not_specialize=["num_positions", "num_drafts_max", "steps"])
def row_partials(
    logits_ptr, stride_lb, stride_lt,
    noise_ptr, stride_nb, stride_nv,
    drafts_ptr, stride_db, stride_dk,
    temperature_ptr, floor_value_ptr, floor_index_ptr,
    part_f_ptr, part_i_ptr,
    num_positions, num_drafts_max, vocab, steps,
    BLOCK: tl.constexpr, FILTERED: tl.constexpr, GREEDY_ONLY: tl.constexpr, PDL: tl.constexpr,
):
    split = tl.program_id(0)
    if PDL:  # `accept` may launch now; it waits for this grid before its first load
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(1)
    b = tl.program_id(2)
    row = logits_ptr + b.to(tl.int64) * stride_lb + t.to(tl.int64) * stride_lt
    noise_row = noise_ptr + b.to(tl.int64) * stride_nb
    temperature = tl.load(temperature_ptr + b)
    temperature = tl.where(temperature == 0.0, 1.0, temperature)  # greedy rows: as processed_probs
    floor_value = 0.0  # no filters: unused
    floor_index = 0
    if FILTERED:
        floor_value = tl.load(floor_value_ptr + b * num_positions + t)
        floor_index = tl.load(floor_index_ptr + b * num_positions + t)
    # this position's draft token is left out of the race (see the module docstring)
    left_out = tl.load(drafts_ptr + b * stride_db + t * stride_dk, mask=t < num_drafts_max, other=-1).to(tl.int32)

    lanes = tl.arange(0, BLOCK)
    raw_best = tl.full([BLOCK], float("-inf"), tl.float32)
    raw_index = tl.full([BLOCK], INDEX_NONE, tl.int32)
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_sum = tl.zeros([BLOCK], tl.float32)
    race_best = tl.full([BLOCK], float("-inf"), tl.float32)
    race_index = tl.full([BLOCK], INDEX_NONE, tl.int32)
    start = split * steps * BLOCK
    for step in range(steps):
        idx = start + step * BLOCK + lanes
        in_row = idx < vocab
        x = tl.load(row + idx, mask=in_row, other=float("-inf")).to(tl.float32)
        # strict '>' while a lane walks up the row keeps its first occurrence of the maximum
        better = x > raw_best
        raw_index = tl.where(better, idx, raw_index)
        raw_best = tl.where(better, x, raw_best)
        if not GREEDY_ONLY:
            s = tl.math.div_rn(x, temperature)  # IEEE division, the bits of logits / temperature
            keep = in_row & _kept(s, idx, floor_value, floor_index, FILTERED)
            s = tl.where(keep, s, float("-inf"))
            new_max = tl.maximum(lane_max, s)
            rescale = tl.where(new_max == float("-inf"), 0.0, tl.exp(lane_max - new_max))
            lane_sum = lane_sum * rescale + tl.where(keep, tl.exp(s - new_max), 0.0)
            lane_max = new_max
            noise = tl.load(noise_row + idx * stride_nv, mask=in_row, other=1.0)
            key = tl.where(keep & (idx != left_out), s - tl.log(noise), float("-inf"))
            better = key > race_best
            race_index = tl.where(better, idx, race_index)
            race_best = tl.where(better, key, race_best)

    out = (b * num_positions + t) * tl.num_programs(0) + split
    row_max = tl.max(lane_max, 0)
    row_sum = tl.sum(tl.where(lane_max == float("-inf"), 0.0, lane_sum * tl.exp(lane_max - row_max)), 0)
    raw_max = tl.max(raw_best, 0)
    race_max = tl.max(race_best, 0)
    tl.store(part_f_ptr + out * 4 + 0, row_max)
    tl.store(part_f_ptr + out * 4 + 1, row_sum)
    tl.store(part_f_ptr + out * 4 + 2, raw_max)
    tl.store(part_f_ptr + out * 4 + 3, race_max)
    tl.store(part_i_ptr + out * 2 + 0, tl.min(tl.where(raw_best == raw_max, raw_index, INDEX_NONE), 0))
    tl.store(part_i_ptr + out * 2 + 1, tl.min(tl.where(race_best == race_max, race_index, INDEX_NONE), 0))


@triton.jit
def _combine_max(values, indices):
    """(max, lowest index attaining it) over a vector of partial maxima."""
    best = tl.max(values, 0)
    return best, tl.min(tl.where(values == best, indices, INDEX_NONE), 0)


@triton.jit
def _combine_rows(values, indices):
    """Per row of [positions, splits] partial maxima: (max, lowest index attaining it)."""
    best = tl.max(values, 1)
    return best, tl.min(tl.where(values == best[:, None], indices, INDEX_NONE), 1)


@triton.jit(do_not_specialize=["num_drafts_max", "num_splits"])
def accept(
    part_f_ptr, part_i_ptr,
    logits_ptr, stride_lb, stride_lt,
    noise_ptr, stride_nb, stride_nv,
    drafts_ptr, stride_db, stride_dk,
    num_drafts_ptr,
    q_ptr, stride_qb, stride_qk, stride_qv,
    uniforms_ptr, stride_ub, stride_uk,
    rates_ptr,
    temperature_ptr, floor_value_ptr, floor_index_ptr,
    num_accepted_ptr, next_token_ptr, stop_f_ptr, stop_i_ptr,
    num_drafts_max, num_splits,
    POSITIONS: tl.constexpr, POSITIONS_POW2: tl.constexpr, SPLITS_POW2: tl.constexpr,
    FILTERED: tl.constexpr, HAS_Q: tl.constexpr, SYNTHETIC: tl.constexpr, PDL: tl.constexpr,
):
    """Acceptance chain of one request (reference.rejection_sample / synthetic_sample).

    Every position is decided at once, as vectors over positions: one [positions, splits] tile
    of partials and one reduction per statistic, instead of a serial chain of reductions; the
    chain itself is then "the first position not accepted", a min over positions."""
    b = tl.program_id(0)
    if PDL:  # every row_partials program is complete and its partials visible
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    temperature = tl.load(temperature_ptr + b)
    greedy = temperature == 0.0
    temperature = tl.where(greedy, 1.0, temperature)
    num_drafts = tl.load(num_drafts_ptr + b).to(tl.int32)
    t = tl.arange(0, POSITIONS_POW2)
    in_t = t < POSITIONS

    # combine each row's partials
    splits = tl.arange(0, SPLITS_POW2)
    part = (b * POSITIONS + t[:, None]) * num_splits + splits[None, :]
    in_part = in_t[:, None] & (splits[None, :] < num_splits)
    part_max = tl.load(part_f_ptr + part * 4 + 0, mask=in_part, other=float("-inf"))
    part_sum = tl.load(part_f_ptr + part * 4 + 1, mask=in_part, other=0.0)
    row_max = tl.max(part_max, 1)
    row_sum = tl.sum(tl.where(part_max == float("-inf"), 0.0, part_sum * tl.exp(part_max - row_max[:, None])), 1)
    _, argmax = _combine_rows(tl.load(part_f_ptr + part * 4 + 2, mask=in_part, other=float("-inf")),
                              tl.load(part_i_ptr + part * 2 + 0, mask=in_part, other=INDEX_NONE))
    race_key, race_token = _combine_rows(tl.load(part_f_ptr + part * 4 + 3, mask=in_part, other=float("-inf")),
                                         tl.load(part_i_ptr + part * 2 + 1, mask=in_part, other=INDEX_NONE))

    # the draft token x of each position: p(x), and its race key to put it back in
    has_draft = t < num_drafts_max
    x = tl.load(drafts_ptr + b * stride_db + t * stride_dk, mask=has_draft, other=0).to(tl.int32)
    logit_x = tl.load(logits_ptr + b.to(tl.int64) * stride_lb + t * stride_lt + x, mask=has_draft,
                      other=float("-inf")).to(tl.float32)
    s_x = tl.math.div_rn(logit_x, temperature)
    floor_value = 0.0  # no filters: unused
    floor_index = 0
    if FILTERED:
        floor_value = tl.load(floor_value_ptr + b * POSITIONS + t, mask=in_t, other=float("inf"))
        floor_index = tl.load(floor_index_ptr + b * POSITIONS + t, mask=in_t, other=0)
    x_kept = has_draft & _kept(s_x, x, floor_value, floor_index, FILTERED)
    noise_x = tl.load(noise_ptr + b.to(tl.int64) * stride_nb + x * stride_nv, mask=has_draft, other=1.0)
    key_x = tl.where(x_kept, s_x - tl.log(noise_x), float("-inf"))
    x_wins = x_kept & ((key_x > race_key) | ((key_x == race_key) & (x < race_token)))
    race_with_x = tl.where(x_wins, x, race_token)  # the race over the whole processed row
    p_x = tl.where(x_kept, tl.exp(s_x - row_max) / row_sum, 0.0)

    valid = t < num_drafts
    u = tl.load(uniforms_ptr + b * stride_ub + t * stride_uk, mask=has_draft, other=1.0)
    if SYNTHETIC:
        accepted = u < tl.load(rates_ptr + t, mask=has_draft, other=0.0)
        candidate = tl.where(greedy, argmax, race_with_x)
    else:
        if HAS_Q:
            q_x = tl.load(q_ptr + b.to(tl.int64) * stride_qb + t * stride_qk + x * stride_qv, mask=has_draft,
                          other=1.0).to(tl.float32)
        else:
            q_x = 1.0
        # greedy rows: p is the one-hot of the argmax, so p(x) > u q(x) iff x is the argmax
        accepted = tl.where(greedy, x == argmax, p_x > u * q_x)
        # first rejection (t < num_drafts): the residual race; bonus (t == num_drafts): p's race
        if HAS_Q:
            residual_token = race_with_x  # replaced by residual_pick unless its mass vanishes
        else:
            # one-hot residual p - onehot(x) is p without x; no mass left: resample from p
            residual_token = tl.where(1.0 - p_x > 1e-8, race_token, race_with_x)
        candidate = tl.where(greedy, argmax, tl.where(valid, residual_token, race_with_x))
    accepted = accepted & valid

    # the first position not accepted (position k never is: it has no draft)
    num_accepted = tl.min(tl.where(in_t & (accepted == 0), t, POSITIONS_POW2), 0)
    at_stop = t == num_accepted
    tl.store(num_accepted_ptr + b, num_accepted.to(tl.int64))
    tl.store(next_token_ptr + b, tl.sum(tl.where(at_stop, candidate, 0), 0).to(tl.int64))
    if HAS_Q:
        tl.store(stop_f_ptr + b * 2 + 0, tl.sum(tl.where(at_stop, row_max, 0.0), 0))
        tl.store(stop_f_ptr + b * 2 + 1, tl.sum(tl.where(at_stop, row_sum, 0.0), 0))
        tl.store(stop_i_ptr + b * 2 + 0, num_accepted)
        tl.store(stop_i_ptr + b * 2 + 1, ((num_accepted < num_drafts) & (greedy == 0)).to(tl.int32))


@triton.jit(do_not_specialize=["num_positions", "steps"])
def residual_partials(
    logits_ptr, stride_lb, stride_lt,
    noise_ptr, stride_nb, stride_nv,
    q_ptr, stride_qb, stride_qk, stride_qv,
    temperature_ptr, floor_value_ptr, floor_index_ptr,
    stop_f_ptr, stop_i_ptr, res_f_ptr, res_i_ptr,
    num_positions, vocab, steps,
    BLOCK: tl.constexpr, FILTERED: tl.constexpr, PDL: tl.constexpr,
):
    """Race over max(p - q, 0) at the rejected position n of a sampled request (dense q):
    per chunk the (max of residual / E, its index) and the residual mass."""
    split = tl.program_id(0)
    b = tl.program_id(1)
    if PDL:  # `accept` is complete and its stop rows visible
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # requests that need no residual race load nothing and store an empty partial
    needed = tl.load(stop_i_ptr + b * 2 + 1) != 0
    n = tl.load(stop_i_ptr + b * 2 + 0)
    row_max = tl.load(stop_f_ptr + b * 2 + 0)
    row_sum = tl.load(stop_f_ptr + b * 2 + 1)
    temperature = tl.load(temperature_ptr + b)
    floor_value = 0.0  # no filters: unused
    floor_index = 0
    if FILTERED:
        floor_value = tl.load(floor_value_ptr + b * num_positions + n)
        floor_index = tl.load(floor_index_ptr + b * num_positions + n)
    row = logits_ptr + b.to(tl.int64) * stride_lb + n.to(tl.int64) * stride_lt
    q_row = q_ptr + b.to(tl.int64) * stride_qb + n.to(tl.int64) * stride_qk
    noise_row = noise_ptr + b.to(tl.int64) * stride_nb
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_index = tl.full([BLOCK], INDEX_NONE, tl.int32)
    lane_mass = tl.zeros([BLOCK], tl.float32)
    start = split * steps * BLOCK
    for step in range(steps):
        idx = start + step * BLOCK + lanes
        in_row = (idx < vocab) & needed
        s = tl.math.div_rn(tl.load(row + idx, mask=in_row, other=float("-inf")).to(tl.float32), temperature)
        keep = in_row & _kept(s, idx, floor_value, floor_index, FILTERED)
        p = tl.where(keep, tl.exp(s - row_max) / row_sum, 0.0)
        q = tl.load(q_row + idx * stride_qv, mask=in_row, other=0.0).to(tl.float32)
        residual = tl.where(in_row, tl.maximum(p - q, 0.0), 0.0)
        lane_mass += residual
        key = tl.where(in_row, residual / tl.load(noise_row + idx * stride_nv, mask=in_row, other=1.0),
                       float("-inf"))
        better = key > best
        best_index = tl.where(better, idx, best_index)
        best = tl.where(better, key, best)
    race_max, race_arg = _combine_max(best, best_index)
    out = b * tl.num_programs(0) + split
    tl.store(res_f_ptr + out * 2 + 0, race_max)
    tl.store(res_f_ptr + out * 2 + 1, tl.sum(lane_mass, 0))
    tl.store(res_i_ptr + out, race_arg)


@triton.jit(do_not_specialize=["num_splits"])
def residual_pick(res_f_ptr, res_i_ptr, stop_i_ptr, next_token_ptr, num_splits, SPLITS_POW2: tl.constexpr,
                  PDL: tl.constexpr):
    """The residual's race winner becomes the next token where a sampled request rejected and
    the residual has mass (else `accept` already wrote the race over p, as the sampler does)."""
    b = tl.program_id(0)
    if PDL:  # the residual partials are complete and visible
        tl.extra.cuda.gdc_wait()
    splits = tl.arange(0, SPLITS_POW2)
    in_splits = splits < num_splits
    part = b * num_splits + splits
    mass = tl.sum(tl.load(res_f_ptr + part * 2 + 1, mask=in_splits, other=0.0), 0)
    _, token = _combine_max(tl.load(res_f_ptr + part * 2 + 0, mask=in_splits, other=float("-inf")),
                            tl.load(res_i_ptr + part, mask=in_splits, other=INDEX_NONE))
    rejected = tl.load(stop_i_ptr + b * 2 + 1) != 0
    tl.store(next_token_ptr + b, token.to(tl.int64), mask=rejected & (mass > 1e-8))
