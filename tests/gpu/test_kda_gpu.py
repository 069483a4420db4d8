"""GPU numerics of the CuTe DSL KDA verify + commit kernels (kernels/kda/cute_kernel.py) at Kimi K3
dims (H=96 heads, D=128) against the torch reference (kernels/kda/reference.py, run in float64)
and, when importable, fla's fused_recurrent_kda as an independent oracle.

Every case draws fresh random inputs (never zeros) and poisons outputs and records with NaN.
Tolerances (fp32 state, fp32 arithmetic with approximate exp and, by default, approximate
reciprocals in the sigmoids and L2 norms): committed state and records
<= 1e-4 relative (Frobenius) error vs float64; the bf16 output <= 1e-2 (bf16 rounding alone
is ~4e-3). The commit-vs-sequential-decode check is bitwise: T tokens verified at once and
committed equals T one-token verify+commit steps exactly, state, conv window and outputs. So is
the slot-pool check: verify and commit by slot on per-layer views of 5-D pools of random rows
equal the same kernels on the gathered rows, and rows outside the slots keep their values.
"""
import pytest
import torch

from dspark.kernels import cute_common, ops, registry
from dspark.kernels.kda import cute_host as kda_cute
from dspark.kernels.kda import reference

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not cute_common.cutlass_available(), reason="nvidia-cutlass-dsl / tvm-ffi not installed"),
]

HEADS, HEAD_DIM = 96, 128  # Kimi K3 (docs/kimi-k3.md §1.2)
LOWER_BOUND, EPS = -5.0, 1e-5
TOKEN_COUNTS = (1, 2, 4, 8, 16)
STATE_TOL, OUT_TOL = 1e-4, 1e-2


def arch() -> str:
    return cute_common.target_arch()


def make_inputs(batch, tokens, *, heads=HEADS, head_dim=HEAD_DIM, dtype=torch.bfloat16, seed=None):
    """Random K3-like inputs on the GPU; magnitudes keep sigmoid/exp in their working range."""
    gen = torch.Generator(device="cuda").manual_seed(seed if seed is not None else torch.seed() % 2**31)
    width = heads * head_dim

    def randn(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(dt)

    return dict(
        q_in=randn(batch, tokens, width), k_in=randn(batch, tokens, width), v_in=randn(batch, tokens, width),
        f=randn(batch, tokens, width), beta_in=randn(batch, tokens, heads), gate_in=randn(batch, tokens, width),
        conv_weight=randn(3, width, 4, scale=0.5, dt=torch.float32),
        conv_state=randn(batch, 3, width, 3),
        A_log=randn(heads, scale=0.5, dt=torch.float32),
        dt_bias=randn(width, scale=0.5, dt=torch.float32),
        o_norm_weight=1.0 + randn(head_dim, scale=0.1, dt=torch.float32),
        state=randn(batch, heads, head_dim, head_dim, scale=0.1, dt=torch.float32),
        lengths=torch.full((batch,), tokens, device="cuda", dtype=torch.int64),
    )


def as_float64(inputs):
    """Inputs for the reference in float64. The state stays fp32 (the reference's contract); the
    reference's arithmetic promotes it to float64 at the first decay, and commit rounds the
    float64 result back into the fp32 state."""
    return {k: (v.double() if v.is_floating_point() and k != "state" else v) for k, v in inputs.items()}


def relative_error(out, ref) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def poisoned_records(batch, tokens, inputs, leading=()):
    records = kda_cute.allocate_records(batch, tokens, HEADS, HEAD_DIM, inputs["conv_state"].dtype, "cuda",
                                        inputs["lengths"], leading)
    for x in (records.keys, records.updates, records.decays, records.conv_inputs):
        x.fill_(float("nan"))
    return records


RECORD_FIELDS = ("keys", "updates", "decays", "conv_inputs")


def cute_verify(inputs, **kw):
    out = torch.full_like(inputs["q_in"], float("nan"))
    return kda_cute.verify(*inputs.values(), lower_bound=LOWER_BOUND, eps=EPS, arch=arch(), out=out, **kw)


# every accepted count 0..T at T in {1, 2, 8, 16} with one CTA per head (verify's default), 4
# V-split CTAs per head (block_v 32: the cluster exchange; an experimental verify variant, not
# bitwise equal to one-token decode), then the other options: exact math,
# columns per thread / row chunks, the state copied by the TMA unit (bulk) and
# per-column-block barriers (group), each with a commit variant of its own (records do not depend
# on the layout)
BULK = dict(block_v=128, bulk_state=True)
BULK_GROUP = dict(block_v=128, bulk_state=True, group_sync=True)
V_SPLIT = dict(block_v=32, experimental_variant=True)
CASES = [(8, V_SPLIT, dict(block_v=32)), (16, V_SPLIT, dict(block_v=32))] + [
    (t, dict(block_v=128), dict(block_v=128)) for t in (1, 8, 16)] + [
    (4, dict(block_v=128, fast_math=False), dict(block_v=32)),
    (8, dict(block_v=128, cols=2, row_chunks=8), dict(block_v=64, bulk_state=True)),
    (8, BULK, BULK),
    (16, dict(V_SPLIT, bulk_state=True), dict(block_v=64, bulk_state=True)),
    (4, dict(block_v=128, cols=2, row_chunks=8, bulk_state=True, group_sync=True), dict(block_v=32, bulk_state=True)),
    (8, dict(block_v=128, group_sync=True), dict(block_v=32)),
    (16, BULK_GROUP, BULK),
    (2, {}, {}),  # the defaults at T = 2 (the other T values run them through the (128, T) rows)
]


@pytest.mark.parametrize("tokens, verify_kw, commit_kw", CASES)
def test_verify_and_every_commit_count_match_the_float64_reference(tokens, verify_kw, commit_kw):
    batch = 2
    inputs = make_inputs(batch, tokens)
    state_before, conv_before = inputs["state"].clone(), inputs["conv_state"].clone()
    out, records = cute_verify(inputs, records=poisoned_records(batch, tokens, inputs), **verify_kw)
    torch.cuda.synchronize()
    # verify is output-only: the state and conv window are bitwise untouched
    assert torch.equal(inputs["state"], state_before) and torch.equal(inputs["conv_state"], conv_before)
    assert not out.isnan().any(), f"T={tokens}: {out.isnan().sum().item()} outputs not written"
    for name in RECORD_FIELDS:
        assert not getattr(records, name).isnan().any(), f"T={tokens}: records.{name} not fully written"

    ref_inputs = as_float64(inputs)
    ref_out, ref_records = reference.kda_verify(*ref_inputs.values(), lower_bound=LOWER_BOUND, eps=EPS)
    err = relative_error(out, ref_out)
    assert err <= OUT_TOL, f"T={tokens}: output relative error {err:.2e} > {OUT_TOL}"
    for name in ("keys", "updates", "decays"):
        err = relative_error(getattr(records, name), getattr(ref_records, name))
        assert err <= STATE_TOL, f"T={tokens}: records.{name} relative error {err:.2e} > {STATE_TOL}"
    assert torch.equal(records.conv_inputs.double(), ref_records.conv_inputs)

    for accepted in range(tokens + 1):
        state, conv_state = state_before.clone(), conv_before.clone()
        kda_cute.commit(state, conv_state, records, torch.full((batch,), accepted, device="cuda"), arch=arch(),
                        **commit_kw)
        ref_state, ref_conv = ref_inputs["state"].clone(), ref_inputs["conv_state"].clone()
        reference.kda_commit(ref_state, ref_conv, ref_records, torch.full((batch,), accepted, device="cuda"))
        torch.cuda.synchronize()
        if accepted == 0:  # zero accepted: nothing moves (the stale-state bug of vllm#52942)
            assert torch.equal(state, state_before) and torch.equal(conv_state, conv_before)
        err = relative_error(state, ref_state)
        assert err <= STATE_TOL, f"T={tokens} accepted={accepted}: state relative error {err:.2e} > {STATE_TOL}"
        assert torch.equal(conv_state.double(), ref_conv), f"T={tokens} accepted={accepted}: conv window differs"


# the default and the fastest-looking options together (state copied by the TMA unit, per-block
# barriers, programmatic dependent launch) through the batch / padding / stacked-layer / fla checks
CANDIDATE = (dict(block_v=128, bulk_state=True, group_sync=True, pdl=True),
             dict(block_v=32, bulk_state=True, pdl=True))
DEFAULT_AND_CANDIDATE = pytest.mark.parametrize("verify_kw, commit_kw", [({}, {}), CANDIDATE],
                                                ids=["default", "candidate"])


@DEFAULT_AND_CANDIDATE
def test_per_request_accepted_counts_and_padding_lengths(verify_kw, commit_kw):
    """Requests in one batch accept different counts; a request shorter than T is padding beyond."""
    batch, tokens = 3, 8
    inputs = make_inputs(batch, tokens)
    inputs["lengths"] = torch.tensor([8, 5, 1], device="cuda")
    accepted = torch.tensor([3, 5, 0], device="cuda")
    out, records = cute_verify(inputs, records=poisoned_records(batch, tokens, inputs), **verify_kw)
    for name in RECORD_FIELDS:  # padding positions hold zeros, as the reference's
        assert not getattr(records, name).isnan().any(), f"records.{name} not fully written"
    ref_inputs = as_float64(inputs)
    ref_out, ref_records = reference.kda_verify(*ref_inputs.values(), lower_bound=LOWER_BOUND, eps=EPS)
    for b, n in enumerate(inputs["lengths"].tolist()):
        err = relative_error(out[b, :n], ref_out[b, :n])
        assert err <= OUT_TOL, f"request {b}: output relative error {err:.2e}"
        assert torch.equal(out[b, n:].float(), ref_out[b, n:].float()), f"request {b}: padding output differs"
    state, conv_state = inputs["state"].clone(), inputs["conv_state"].clone()
    kda_cute.commit(state, conv_state, records, accepted, arch=arch(), **commit_kw)
    reference.kda_commit(ref_inputs["state"], ref_inputs["conv_state"], ref_records, accepted)
    assert relative_error(state, ref_inputs["state"]) <= STATE_TOL
    assert torch.equal(conv_state.double(), ref_inputs["conv_state"])
    for name in ("keys", "updates", "decays"):
        assert relative_error(getattr(records, name), getattr(ref_records, name)) <= STATE_TOL, name


# Only the verify variants that pass this check are offered without experimental_variant
# (cute_host.check_verified_variant; the V-split and register-load variants did not).
@pytest.mark.parametrize("tokens, verify_kw, commit_kw", [(2, {}, {}), (8, {}, {}), (16, {}, {}),
                                                       (8, BULK, BULK), (8, BULK_GROUP, dict(block_v=128))])
def test_commit_equals_sequential_one_token_decode_bitwise(tokens, verify_kw, commit_kw):
    batch = 2
    inputs = make_inputs(batch, tokens)
    out_all, records = cute_verify(inputs, **verify_kw)
    for accepted in (0, 1, tokens // 2, tokens):
        state, conv_state = inputs["state"].clone(), inputs["conv_state"].clone()
        kda_cute.commit(state, conv_state, records, torch.full((batch,), accepted, device="cuda"), arch=arch(),
                        **commit_kw)

        seq_state, seq_conv = inputs["state"].clone(), inputs["conv_state"].clone()
        for t in range(accepted):
            step = dict(inputs, state=seq_state, conv_state=seq_conv,
                        lengths=torch.ones(batch, device="cuda", dtype=torch.int64))
            for name in ("q_in", "k_in", "v_in", "f", "beta_in", "gate_in"):
                step[name] = inputs[name][:, t:t + 1].contiguous()
            out_t, rec_t = cute_verify(step, **verify_kw)
            assert torch.equal(out_t[:, 0], out_all[:, t]), f"T={tokens}: output {t} differs from one-token decode"
            kda_cute.commit(seq_state, seq_conv, rec_t, torch.ones(batch, device="cuda", dtype=torch.int64), arch=arch(),
                            **commit_kw)
        assert torch.equal(state, seq_state), f"T={tokens} accepted={accepted}: state not bitwise equal"
        assert torch.equal(conv_state, seq_conv), f"T={tokens} accepted={accepted}: conv window not bitwise equal"


@DEFAULT_AND_CANDIDATE
def test_one_launch_commits_a_stack_of_layers(verify_kw, commit_kw):
    layers, batch, tokens = 3, 2, 4
    per_layer = [make_inputs(batch, tokens) for _ in range(layers)]
    stacked = poisoned_records(batch, tokens, per_layer[0], leading=(layers,))
    views = []
    for layer, inputs in enumerate(per_layer):
        view = reference.KDARecords(*(getattr(stacked, n)[layer] for n in RECORD_FIELDS), inputs["lengths"])
        views.append(cute_verify(inputs, records=view, **verify_kw)[1])
    accepted = torch.tensor([2, 4], device="cuda")
    states = torch.stack([x["state"] for x in per_layer])
    conv_states = torch.stack([x["conv_state"] for x in per_layer])
    kda_cute.commit_layers(states, conv_states, stacked, accepted, arch=arch(), **commit_kw)
    for layer, inputs in enumerate(per_layer):
        state, conv_state = inputs["state"].clone(), inputs["conv_state"].clone()
        kda_cute.commit(state, conv_state, views[layer], accepted, arch=arch(), **commit_kw)
        assert torch.equal(states[layer], state) and torch.equal(conv_states[layer], conv_state)


def random_pools(pool_rows, layers, conv_dtype, batch):
    """5-D state and conv pools [S, layers, ...] of random values (K3Target's layout: a layer's
    view has the slot stride of all layers) and `batch` distinct slots in random order."""
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    pool = torch.randn(pool_rows, layers, HEADS, HEAD_DIM, HEAD_DIM, device="cuda", generator=gen) * 0.1
    conv_pool = torch.randn(pool_rows, layers, 3, HEADS * HEAD_DIM, 3, device="cuda", generator=gen).to(conv_dtype)
    slots = torch.randperm(pool_rows, device="cuda", generator=gen)[:batch]
    return pool, conv_pool, slots


# the defaults and the candidate; register state loads (verify's experimental variant and a
# commit without the TMA-unit copy: the slot enters the per-thread addresses instead of the bulk
# copy's start); V-split CTAs whose bulk copies start mid-row
SLOT_CASES = [({}, {}), CANDIDATE,
              (dict(block_v=128, bulk_state=False, experimental_variant=True), dict(block_v=32, bulk_state=False)),
              (dict(V_SPLIT, bulk_state=True), dict(block_v=64, bulk_state=True))]


@pytest.mark.parametrize("verify_kw, commit_kw", SLOT_CASES)
def test_slot_pools_equal_gathered_states_bitwise(verify_kw, commit_kw):
    """verify and commit with slots on one layer's view of 5-D pools give the bits of the same
    kernels on the slots' rows gathered into contiguous states: outputs, records, and the
    committed rows; verify leaves the pools alone and commit changes only the slots' rows of its
    layer (every other row keeps its random values)."""
    batch, tokens, layer = 3, 8, 1
    inputs = make_inputs(batch, tokens)
    inputs["lengths"] = torch.tensor([8, 5, 1], device="cuda")
    pool, conv_pool, slots = random_pools(6, 3, inputs["conv_state"].dtype, batch)
    pooled = dict(inputs, state=pool[:, layer], conv_state=conv_pool[:, layer])
    gathered = dict(inputs, state=pooled["state"].index_select(0, slots),
                    conv_state=pooled["conv_state"].index_select(0, slots))
    pool_before, conv_before = pool.clone(), conv_pool.clone()

    out, records = cute_verify(gathered, records=poisoned_records(batch, tokens, inputs), **verify_kw)
    out_pool, records_pool = cute_verify(pooled, records=poisoned_records(batch, tokens, inputs), slots=slots,
                                         **verify_kw)
    torch.cuda.synchronize()
    assert torch.equal(pool, pool_before) and torch.equal(conv_pool, conv_before), "verify wrote the pools"
    assert not out.isnan().any() and torch.equal(out_pool, out)
    for name in RECORD_FIELDS:
        assert torch.equal(getattr(records_pool, name), getattr(records, name)), name

    accepted = torch.tensor([3, 5, 0], device="cuda")
    kda_cute.commit(gathered["state"], gathered["conv_state"], records, accepted, arch=arch(), **commit_kw)
    kda_cute.commit(pooled["state"], pooled["conv_state"], records_pool, accepted, arch=arch(), slots=slots,
                    **commit_kw)
    expected, expected_conv = pool_before.clone(), conv_before.clone()
    expected[:, layer].index_copy_(0, slots, gathered["state"])
    expected_conv[:, layer].index_copy_(0, slots, gathered["conv_state"])
    torch.cuda.synchronize()
    assert not torch.equal(expected, pool_before), "the accepted tokens moved nothing"
    assert torch.equal(pool, expected), "state pool: a slot's row differs or a row outside slots changed"
    assert torch.equal(conv_pool, expected_conv), "conv pool: a slot's row differs or a row outside slots changed"


@DEFAULT_AND_CANDIDATE
def test_one_launch_commits_a_stack_of_layers_in_slot_pools(verify_kw, commit_kw):
    """commit_layers on the 5-D pools seen layer-major ([L, S, ...] views: layer and slot strides
    both free) equals one slot-indexed commit per layer, bitwise, rows outside slots untouched."""
    layers, batch, tokens = 3, 2, 4
    per_layer = [make_inputs(batch, tokens) for _ in range(layers)]
    pool, conv_pool, slots = random_pools(5, layers, per_layer[0]["conv_state"].dtype, batch)
    stacked = poisoned_records(batch, tokens, per_layer[0], leading=(layers,))
    views = []
    for layer, inputs in enumerate(per_layer):
        view = reference.KDARecords(*(getattr(stacked, n)[layer] for n in RECORD_FIELDS), inputs["lengths"])
        pooled = dict(inputs, state=pool[:, layer], conv_state=conv_pool[:, layer])
        views.append(cute_verify(pooled, records=view, slots=slots, **verify_kw)[1])
    accepted = torch.tensor([2, 4], device="cuda")
    expected, expected_conv = pool.clone(), conv_pool.clone()
    for layer in range(layers):
        kda_cute.commit(expected[:, layer], expected_conv[:, layer], views[layer], accepted, arch=arch(), slots=slots,
                        **commit_kw)
    pool_before = pool.clone()
    kda_cute.commit_layers(pool.transpose(0, 1), conv_pool.transpose(0, 1), stacked, accepted, arch=arch(),
                           slots=slots, **commit_kw)
    torch.cuda.synchronize()
    assert not torch.equal(pool, pool_before)
    assert torch.equal(pool, expected) and torch.equal(conv_pool, expected_conv)


@pytest.mark.parametrize("batch, tokens", [(1, 8), (3, 1), (2, 16)])
def test_strided_inputs_equal_contiguous_ones_bitwise(monkeypatch, batch, tokens):
    """Column slices of one wider buffer, as the model's fused input GEMM gives them (the fused
    row order q|k|v|g|f_a|beta, here with f as well, beta last and 16-byte aligned), go into the
    kernel as they are with STRIDED_INPUTS and give exactly the output and records of their
    contiguous copies."""
    inputs = make_inputs(batch, tokens)
    names = ("q_in", "k_in", "v_in", "gate_in", "f", "beta_in")
    fused = torch.cat([inputs[n] for n in names] + [inputs["beta_in"][..., :8]], dim=-1)  # rows wider than the parts
    start = 0
    strided = dict(inputs)
    for n in names:
        width = inputs[n].shape[-1]
        strided[n] = fused[..., start : start + width]
        start += width
        assert torch.equal(strided[n], inputs[n]) and (tokens * batch == 1 or not strided[n].is_contiguous())
    monkeypatch.setattr(kda_cute, "STRIDED_INPUTS", True)
    out_strided, records_strided = cute_verify(strided)
    out, records = cute_verify(inputs)
    assert torch.equal(out_strided, out) and not out.isnan().any()
    for name in RECORD_FIELDS:
        assert torch.equal(getattr(records_strided, name), getattr(records, name)), name


def test_probe_build_writes_ordered_clocks_and_the_same_results():
    batch, tokens = 2, 8
    inputs = make_inputs(batch, tokens)
    out, records = cute_verify(inputs)
    probe = torch.full((batch, HEADS, 1, 10), -1, device="cuda", dtype=torch.int64)
    out_probe, records_probe = cute_verify(inputs, probe=probe)
    assert torch.equal(out, out_probe)
    for name in RECORD_FIELDS:
        assert torch.equal(getattr(records, name), getattr(records_probe, name)), name
    cycles, nanoseconds = probe[..., :5], probe[..., 5:]
    assert (cycles[..., 1:] >= cycles[..., :-1]).all() and (cycles[..., 4] > cycles[..., 0]).all()
    assert (nanoseconds[..., 1:] >= nanoseconds[..., :-1]).all() and (nanoseconds[..., 0] > 0).all()


def _conv_silu_float32(inputs, proj_name, proj):
    """SiLU(causal conv4) of one projection in float32 torch, an input for the fla oracle."""
    x = torch.cat([inputs["conv_state"][:, proj].transpose(1, 2), inputs[proj_name]], dim=1).float()  # [B, 3+T, W]
    w = inputs["conv_weight"][proj]  # [W, 4]
    tokens = inputs[proj_name].shape[1]
    y = sum(w[:, j] * x[:, j:j + tokens] for j in range(4))
    return torch.nn.functional.silu(y)


@pytest.mark.parametrize("tokens, verify_kw, commit_kw", [(1, {}, {}), (16, {}, {}), (8, *CANDIDATE)])
def test_against_fla_fused_recurrent_kda(tokens, verify_kw, commit_kw):
    fla_kda = pytest.importorskip("fla.ops.kda")
    batch = 2
    inputs = make_inputs(batch, tokens)
    out, records = cute_verify(inputs, **verify_kw)
    state = inputs["state"].clone()
    conv_state = inputs["conv_state"].clone()
    kda_cute.commit(state, conv_state, records, torch.full((batch,), tokens, device="cuda"), arch=arch(), **commit_kw)

    split = lambda x: x.reshape(batch, tokens, HEADS, HEAD_DIM).contiguous()  # noqa: E731
    q, k, v = (split(_conv_silu_float32(inputs, n, p)) for p, n in enumerate(("q_in", "k_in", "v_in")))
    o_fla, state_fla = fla_kda.fused_recurrent_kda(
        q, k, v, split(inputs["f"].float()), inputs["beta_in"].float(),
        A_log=inputs["A_log"][:HEADS].contiguous(), dt_bias=inputs["dt_bias"], initial_state=inputs["state"].clone(),
        output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, lower_bound=LOWER_BOUND,
    )
    o = o_fla.float()
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + EPS) * inputs["o_norm_weight"]
    o = o.reshape(batch, tokens, -1) * torch.sigmoid(inputs["gate_in"].float())
    err_state = relative_error(state, state_fla)
    err_out = relative_error(out, o)
    assert err_state <= STATE_TOL, f"T={tokens}: state vs fla relative error {err_state:.2e}"
    assert err_out <= OUT_TOL, f"T={tokens}: output vs fla relative error {err_out:.2e}"


def test_registry_dispatches_to_the_cute_kernels():
    name = "cute_sm90" if arch() == "sm_90a" else "cute_sm100"
    assert registry.resolve("kda_verify", "cuda").name == name
    assert registry.resolve("kda_commit", "cuda").name == name
    assert registry.resolve("kda_commit_layers", "cuda").name == name
    batch, tokens = 1, 4
    inputs = make_inputs(batch, tokens)
    out, records = ops.kda_verify(*inputs.values(), lower_bound=LOWER_BOUND, eps=EPS)
    ops.kda_commit(inputs["state"], inputs["conv_state"], records, torch.full((batch,), 2, device="cuda"))
    assert not out.isnan().any()


def test_the_ops_commit_every_layer_in_one_call_as_the_target_does():
    """The K3 target's path through the ops: each layer's kda_verify fills its views of stacked records
    (given, poisoned), then one kda_commit_layers on the pools seen layer-major; bitwise what a verify
    allocating its records and a kda_commit per layer give."""
    layers, batch, tokens = 3, 2, 4
    per_layer = [make_inputs(batch, tokens) for _ in range(layers)]
    pool, conv_pool, slots = random_pools(5, layers, per_layer[0]["conv_state"].dtype, batch)
    stacked = poisoned_records(batch, tokens, per_layer[0], leading=(layers,))
    accepted = torch.tensor([3, 1], device="cuda")
    expected, expected_conv = pool.clone(), conv_pool.clone()
    for layer, inputs in enumerate(per_layer):
        pooled = dict(inputs, state=pool[:, layer], conv_state=conv_pool[:, layer])
        view = reference.layer_records(stacked, layer)
        out, filled = ops.kda_verify(*pooled.values(), lower_bound=LOWER_BOUND, eps=EPS, slots=slots, records=view)
        own_out, own = ops.kda_verify(*pooled.values(), lower_bound=LOWER_BOUND, eps=EPS, slots=slots)
        assert torch.equal(out, own_out)
        for field in RECORD_FIELDS:
            assert torch.equal(getattr(filled, field), getattr(own, field)), (layer, field)
        ops.kda_commit(expected[:, layer], expected_conv[:, layer], own, accepted, slots=slots)
    ops.kda_commit_layers(pool.transpose(0, 1), conv_pool.transpose(0, 1), stacked, accepted, slots=slots)
    torch.cuda.synchronize()
    assert torch.equal(pool, expected) and torch.equal(conv_pool, expected_conv)
