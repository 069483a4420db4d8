"""The K3 op references (kernels/kda, kernels/mla, kernels/moe) and the latent-MoE block built on
them (dspark/targets/kimi_k3/moe.py) against straightforward float64 computations, and their
token invariance (a token's bits do not depend on its batch)."""
import dataclasses
import math

import pytest
import torch

from dspark.kernels import ops
from dspark.kernels.mxfp4 import dequantise, pack
from dspark.targets.kimi_k3.config import K3_TINY
from dspark.targets.kimi_k3.moe import LatentMoEWeights, latent_moe


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(torch.randint(0, 2**31 - 1, ()).item())


def randn(gen, *shape, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


# ---------------------------------------------------------------- KDA
H, D = 2, 8
W = H * D
LOWER_BOUND, EPS, L2_EPS = -5.0, 1e-5, 1e-6


def kda_inputs(gen, B, T):
    return dict(
        q_in=randn(gen, B, T, W), k_in=randn(gen, B, T, W), v_in=randn(gen, B, T, W),
        f=randn(gen, B, T, W), beta_in=randn(gen, B, T, H), gate_in=randn(gen, B, T, W),
        conv_weight=randn(gen, 3, W, 4, scale=0.5), conv_state=randn(gen, B, 3, W, 3),
        A_log=randn(gen, H, scale=0.5), dt_bias=randn(gen, W, scale=0.5), o_norm_weight=1 + randn(gen, D, scale=0.1),
        state=randn(gen, B, H, D, D, scale=0.3),
    )


def kda_naive(inp, b, n):
    """Float64 token-by-token recurrence of docs/kimi-k3.md §2.1 for request b -> (o [n, W], S, window)."""
    d = {k: v.double() for k, v in inp.items()}
    seq = torch.cat([d["conv_state"][b], torch.stack([d["q_in"][b], d["k_in"][b], d["v_in"][b]]).transpose(1, 2)], -1)
    S = d["state"][b].clone()
    outs = []
    for t in range(n):
        conv = sum(d["conv_weight"][..., j] * seq[..., t + j] for j in range(4))
        q, k, v = torch.nn.functional.silu(conv).view(3, H, D)
        q = q / torch.sqrt((q**2).sum(-1, keepdim=True) + L2_EPS) / math.sqrt(D)
        k = k / torch.sqrt((k**2).sum(-1, keepdim=True) + L2_EPS)
        g = LOWER_BOUND * torch.sigmoid(torch.exp(d["A_log"])[:, None] * (d["f"][b, t].view(H, D) + d["dt_bias"].view(H, D)))
        beta = torch.sigmoid(d["beta_in"][b, t])
        o = torch.zeros(H, D, dtype=torch.float64)
        for h in range(H):
            S[h] = torch.diag(torch.exp(g[h])) @ S[h]
            u = beta[h] * (v[h] - S[h].T @ k[h])
            S[h] = S[h] + torch.outer(k[h], u)
            o[h] = S[h].T @ q[h]
        o = o / torch.sqrt((o**2).mean(-1, keepdim=True) + EPS) * d["o_norm_weight"]
        outs.append((o * torch.sigmoid(d["gate_in"][b, t].view(H, D))).reshape(W))
    return torch.stack(outs) if outs else torch.zeros(0, W), S, seq[..., n : n + 3]


def run_verify(inp, lengths):
    return ops.kda_verify(**inp, lengths=torch.tensor(lengths), lower_bound=LOWER_BOUND, eps=EPS)


def test_kda_matches_float64_recurrence_and_is_output_only(gen):
    inp = kda_inputs(gen, 2, 6)
    before = {k: v.clone() for k, v in inp.items()}
    out, records = run_verify(inp, [6, 4])
    for k in inp:
        assert torch.equal(inp[k], before[k]), f"verify modified {k}"
    assert torch.equal(out[1, 4:], torch.zeros(2, W)), "padding positions must be zero"
    for b, n in ((0, 6), (1, 4)):
        o, S, window = kda_naive(inp, b, n)
        torch.testing.assert_close(out[b, :n].double(), o, rtol=1e-4, atol=1e-5)
        state, conv = inp["state"][b : b + 1].clone(), inp["conv_state"][b : b + 1].clone()
        sub = type(records)(*(x[b : b + 1] for x in (records.keys, records.updates, records.decays,
                                                        records.conv_inputs, records.lengths)))
        ops.kda_commit(state, conv, sub, torch.tensor([n]))
        torch.testing.assert_close(state[0].double(), S, rtol=1e-4, atol=1e-5)
        assert torch.equal(conv[0], window.float())


def test_kda_commit_is_bitwise_sequential_and_verify_is_token_invariant(gen):
    T = 5
    inp = kda_inputs(gen, 2, T)
    out, records = run_verify(inp, [T, 3])
    for n in range(T + 1):
        state, conv = inp["state"].clone(), inp["conv_state"].clone()
        ops.kda_commit(state, conv, records, torch.tensor([n, min(n, 3)]))
        # sequential: request 0 alone, one token per verify + commit
        seq_state, seq_conv = inp["state"][:1].clone(), inp["conv_state"][:1].clone()
        for t in range(n):
            one = {k: (v[:1, t : t + 1] if v.dim() >= 3 and k not in ("conv_weight", "conv_state", "state") else v)
                   for k, v in inp.items()}
            one["conv_state"], one["state"] = seq_conv, seq_state
            o1, r1 = run_verify(one, [1])
            assert torch.equal(o1[0, 0], out[0, t]), f"token {t}: block and single-token outputs differ"
            ops.kda_commit(seq_state, seq_conv, r1, torch.tensor([1]))
        assert torch.equal(state[0], seq_state[0]) and torch.equal(conv[0], seq_conv[0]), f"n={n}"
        if n == 0:
            assert torch.equal(state, inp["state"]) and torch.equal(conv, inp["conv_state"])


def test_kda_runs_in_float64_for_float64_inputs(gen):
    """Kernel tests use the reference as a float64 oracle: float64 inputs (state kept fp32)."""
    inp = kda_inputs(gen, 1, 4)
    wide = {k: (v if k == "state" else v.double()) for k, v in inp.items()}
    out, records = run_verify(wide, [4])
    assert out.dtype == torch.float64 and records.keys.dtype == torch.float64
    o, S, _ = kda_naive(inp, 0, 4)
    torch.testing.assert_close(out[0], o, rtol=1e-10, atol=1e-12)
    state = wide["state"].clone()
    ops.kda_commit(state, wide["conv_state"].clone(), records, torch.tensor([4]))
    torch.testing.assert_close(state[0].double(), S, rtol=1e-7, atol=1e-9)  # fp32 rounding of the float64 state


def test_kda_rejects_bad_shapes(gen):
    inp = kda_inputs(gen, 1, 2)
    inp["dt_bias"] = inp["dt_bias"][:-1]
    with pytest.raises(ValueError, match="dt_bias"):
        run_verify(inp, [2])


def kda_pools(gen, B, T, pool_rows, layers, layer):
    """KDA inputs whose state and conv window are one layer's view of 5-D pools [S, layers, ...]
    (rows of random values, the ones no request uses included), and B distinct slots in random order."""
    inp = kda_inputs(gen, B, T)
    pool = randn(gen, pool_rows, layers, H, D, D, scale=0.3)
    conv_pool = randn(gen, pool_rows, layers, 3, W, 3)
    inp["state"], inp["conv_state"] = pool[:, layer], conv_pool[:, layer]
    slots = torch.randperm(pool_rows, generator=gen)[:B]
    return inp, pool, conv_pool, slots


def test_kda_on_slot_pools_equals_gathered_states_bitwise(gen):
    """With slots, verify reads and commit advances rows slots[b] of per-layer pool views (a
    slot stride of the whole 5-D pool), with the bits of the same ops on gathered contiguous
    states; verify leaves the pools alone and commit touches only the slots' rows of its layer."""
    B, T, layer = 3, 5, 1
    inp, pool, conv_pool, slots = kda_pools(gen, B, T, pool_rows=7, layers=3, layer=layer)
    assert not inp["state"].is_contiguous() and not inp["conv_state"].is_contiguous()
    gathered = dict(inp, state=inp["state"].index_select(0, slots), conv_state=inp["conv_state"].index_select(0, slots))
    pool_before, conv_before = pool.clone(), conv_pool.clone()
    lengths = [T, 3, 0]
    out, records = run_verify(gathered, lengths)
    out_pool, records_pool = ops.kda_verify(**inp, lengths=torch.tensor(lengths), lower_bound=LOWER_BOUND, eps=EPS,
                                            slots=slots)
    assert torch.equal(pool, pool_before) and torch.equal(conv_pool, conv_before), "verify modified the pools"
    assert torch.equal(out_pool, out)
    for name in ("keys", "updates", "decays", "conv_inputs", "lengths"):
        assert torch.equal(getattr(records_pool, name), getattr(records, name)), name

    accepted = torch.tensor([4, 3, 0])
    ops.kda_commit(gathered["state"], gathered["conv_state"], records, accepted)
    ops.kda_commit(inp["state"], inp["conv_state"], records_pool, accepted, slots=slots)
    expected, expected_conv = pool_before.clone(), conv_before.clone()
    expected[:, layer].index_copy_(0, slots, gathered["state"])
    expected_conv[:, layer].index_copy_(0, slots, gathered["conv_state"])
    assert torch.equal(pool, expected), "state pool differs (slots' rows or rows outside slots)"
    assert torch.equal(conv_pool, expected_conv), "conv pool differs (slots' rows or rows outside slots)"
    assert not torch.equal(pool[slots[0], layer], pool_before[slots[0], layer]), "the accepted tokens moved nothing"


def test_kda_commit_layers_equals_each_layers_commit_from_records_verify_filled(gen):
    """Three layers' verifies fill their views of one stacked set of records (allocate_records(leading=
    (3,)), poisoned first) with the bits a verify allocating its own gives; kda_commit_layers over the
    5-D pools seen layer-major then equals kda_commit layer by layer, bitwise, rows outside the slots
    untouched, a count of 0 included. A wrong stack fails."""
    from dspark.kernels.kda.reference import allocate_records, layer_records

    B, T, layers = 3, 4, 3
    inp, pool, conv_pool, slots = kda_pools(gen, B, T, pool_rows=6, layers=layers, layer=0)
    lengths = torch.tensor([T, 2, 3])
    stacked = allocate_records(B, T, H, D, conv_pool.dtype, "cpu", lengths, leading=(layers,))
    for name in ("keys", "updates", "decays", "conv_inputs"):
        getattr(stacked, name).fill_(float("nan"))
    alone = []
    for layer in range(layers):
        layer_inp = dict(inp, state=pool[:, layer], conv_state=conv_pool[:, layer],
                         q_in=randn(gen, B, T, W))  # each layer its own queries: the records differ by layer
        _, own = ops.kda_verify(**layer_inp, lengths=lengths, lower_bound=LOWER_BOUND, eps=EPS, slots=slots)
        _, filled = ops.kda_verify(**layer_inp, lengths=lengths, lower_bound=LOWER_BOUND, eps=EPS, slots=slots,
                                   records=layer_records(stacked, layer))
        for name in ("keys", "updates", "decays", "conv_inputs"):
            assert torch.equal(getattr(filled, name), getattr(own, name)), (layer, name)
        alone.append(own)
    accepted = torch.tensor([3, 0, 2])
    want, want_conv = pool.clone(), conv_pool.clone()
    for layer in range(layers):
        ops.kda_commit(want[:, layer], want_conv[:, layer], alone[layer], accepted, slots=slots)
    got, got_conv = pool.clone(), conv_pool.clone()
    ops.kda_commit_layers(got.transpose(0, 1), got_conv.transpose(0, 1), stacked, accepted, slots=slots)
    assert torch.equal(got, want) and torch.equal(got_conv, want_conv)
    assert not torch.equal(got, pool), "the accepted tokens moved nothing"
    swapped = dataclasses.replace(stacked, keys=stacked.keys.flip(0))
    wrong = pool.clone()
    ops.kda_commit_layers(wrong.transpose(0, 1), conv_pool.clone().transpose(0, 1), swapped, accepted, slots=slots)
    assert not torch.equal(wrong, want)
    with pytest.raises(ValueError, match="states / conv_states"):
        ops.kda_commit_layers(pool[:, 0], conv_pool[:, 0], stacked, accepted, slots=slots)


@pytest.mark.parametrize("bad_slots", [torch.tensor([0, 1]), torch.tensor([[0, 1, 2]]),
                                       torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([0.0, 1.0, 2.0]),
                                       [0, 1, 2], torch.tensor([0, 1, 7])])
def test_kda_refuses_bad_slots_naming_the_field(gen, bad_slots):
    inp, _, _, _ = kda_pools(gen, 3, 2, pool_rows=7, layers=2, layer=0)
    with pytest.raises(ValueError, match="slots"):
        ops.kda_verify(**inp, lengths=torch.tensor([2, 2, 2]), lower_bound=LOWER_BOUND, eps=EPS, slots=bad_slots)
    records = run_verify(dict(inp, state=inp["state"][:3], conv_state=inp["conv_state"][:3]), [2, 2, 2])[1]
    with pytest.raises(ValueError, match="slots"):
        ops.kda_commit(inp["state"], inp["conv_state"], records, torch.tensor([1, 1, 1]), slots=bad_slots)


def test_kda_commit_refuses_a_repeated_slot_and_a_pool_without_slots(gen):
    inp, _, _, _ = kda_pools(gen, 2, 2, pool_rows=5, layers=2, layer=1)
    records = run_verify(dict(inp, state=inp["state"][:2], conv_state=inp["conv_state"][:2]), [2, 2])[1]
    with pytest.raises(ValueError, match="slots"):
        ops.kda_commit(inp["state"], inp["conv_state"], records, torch.tensor([1, 1]), slots=torch.tensor([3, 3]))
    with pytest.raises(ValueError, match="state"):  # 5 rows for 2 requests, and no slots to pick them
        ops.kda_commit(inp["state"], inp["conv_state"], records, torch.tensor([1, 1]))


# ---------------------------------------------------------------- MLA
def test_mla_matches_unabsorbed_float64_and_is_token_invariant(gen):
    Hq, R, P, nope, vdim, T, L = 3, 16, 4, 8, 8, 4, 12
    w_uk, w_uv = randn(gen, Hq, nope, R, scale=0.3), randn(gen, Hq, vdim, R, scale=0.3)
    cache = randn(gen, 3, L, R + P)
    slots, cache_lens, lengths = torch.tensor([2, 0]), torch.tensor([5, 2]), torch.tensor([4, 3])
    q_nope, q_pe = randn(gen, 2, T, Hq, nope), randn(gen, 2, T, Hq, P)
    q_latent = torch.einsum("bthn,hnr->bthr", q_nope, w_uk)
    scale = (nope + P) ** -0.5
    out = ops.mla_verify_attention(q_latent, q_pe, cache, slots, cache_lens, lengths, scale)
    c = cache.double()
    for b in range(2):
        rows = c[slots[b]]
        k_nope = torch.einsum("hnr,lr->hln", w_uk.double(), rows[:, :R])
        v = torch.einsum("hvr,lr->hlv", w_uv.double(), rows[:, :R])
        for j in range(int(lengths[b])):
            visible = int(cache_lens[b]) + j + 1
            s = (torch.einsum("hn,hln->hl", q_nope[b, j].double(), k_nope[:, :visible])
                 + q_pe[b, j].double() @ rows[:visible, R:].T) * scale
            expected = torch.einsum("hl,hlv->hv", torch.softmax(s, -1), v[:, :visible])
            got = torch.einsum("hvr,hr->hv", w_uv.double(), out[b, j].double())
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(out[1, 3], torch.zeros(Hq, R))
    # token invariance: request 1 alone, one query at a time
    for j in range(3):
        single = ops.mla_verify_attention(q_latent[1:, j : j + 1], q_pe[1:, j : j + 1], cache, slots[1:],
                                          cache_lens[1:] + j, torch.tensor([1]), scale)
        assert torch.equal(single[0, 0], out[1, j])


# ---------------------------------------------------------------- MoE
def moe_weights(gen, cfg):
    E, Dm, Lt, I, S = cfg.num_experts, cfg.hidden_size, cfg.latent_size, cfg.moe_intermediate_size, cfg.shared_intermediate_size
    w1, w3, w2 = randn(gen, E, I, Lt, scale=Lt**-0.5), randn(gen, E, I, Lt, scale=Lt**-0.5), randn(gen, E, Lt, I, scale=I**-0.5)
    (p1, s1), (p3, s3), (p2, s2) = pack(w1), pack(w3), pack(w2)
    return LatentMoEWeights.from_parts(
        gate=randn(gen, E, Dm, scale=Dm**-0.5), score_bias=randn(gen, E, scale=0.1),
        latent_down=randn(gen, Lt, Dm, scale=Dm**-0.5), latent_norm=1 + randn(gen, Lt, scale=0.1),
        latent_up=randn(gen, Dm, Lt, scale=Lt**-0.5), shared_gate=randn(gen, S, Dm, scale=Dm**-0.5),
        shared_up=randn(gen, S, Dm, scale=Dm**-0.5), shared_down=randn(gen, Dm, S, scale=S**-0.5),
        w1_packed=p1, w1_scale=s1, w3_packed=p3, w3_scale=s3, w2_packed=p2, w2_scale=s2,
    )


def test_latent_moe_matches_dense_float64_loop_and_is_token_invariant(gen):
    cfg = K3_TINY
    wts = moe_weights(gen, cfg)
    x = randn(gen, 5, cfg.hidden_size)
    out = latent_moe(x, wts, cfg)
    ids, weights = ops.moe_route(x, wts.gate, wts.score_bias, cfg.num_experts_per_token, cfg.routed_scaling_factor)
    torch.testing.assert_close(weights.sum(-1), torch.full((5,), cfg.routed_scaling_factor))

    def situ(g, u):
        return cfg.situ_beta * torch.tanh(g / cfg.situ_beta) * torch.sigmoid(g) * cfg.situ_linear_beta * torch.tanh(u / cfg.situ_linear_beta)

    d = {k: getattr(wts, k).double() for k in ("gate", "score_bias", "latent_down", "latent_norm", "latent_up",
                                                "shared_gate", "shared_up", "shared_down")}
    for m in range(5):
        xm = x[m].double()
        scores = torch.sigmoid(d["gate"] @ xm)
        chosen = torch.topk(scores + d["score_bias"], cfg.num_experts_per_token).indices
        assert torch.equal(chosen, ids[m])
        w = scores[chosen] / scores[chosen].sum() * cfg.routed_scaling_factor
        h = d["latent_down"] @ xm
        routed = torch.zeros_like(h)
        for e, we in zip(chosen.tolist(), w):
            w1, w3, w2 = (dequantise(getattr(wts, f"{n}_packed")[e], getattr(wts, f"{n}_scale")[e], torch.float64)
                          for n in ("w1", "w3", "w2"))
            routed += we * (w2 @ situ(w1 @ h, w3 @ h))
        routed = routed / torch.sqrt((routed**2).mean() + cfg.rms_norm_eps) * d["latent_norm"]
        expected = d["latent_up"] @ routed + d["shared_down"] @ situ(d["shared_gate"] @ xm, d["shared_up"] @ xm)
        torch.testing.assert_close(out[m].double(), expected, rtol=1e-4, atol=1e-5)
        assert torch.equal(latent_moe(x[m : m + 1], wts, cfg)[0], out[m]), f"token {m} not invariant"


# ---------------------------------------------------------------- linear
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_reference_is_row_invariant_and_matches_float64(gen, dtype):
    """Each row of the CPU reference equals the same row computed alone, bit for bit. The case
    that broke it: the CPU's bf16 bmm rounded one element of about 1 in 150 two-row products
    differently from the one-row product (2 of 20 seeds of test_k3_target's bf16 rollback test);
    2000 draws miss such a difference with probability ~(1 - 1/150)^2000 < 1e-5."""
    for _ in range(2000):
        x, w = randn(gen, 2, 64, dtype=dtype), randn(gen, 64, 64, scale=0.15, dtype=dtype)
        y = ops.linear(x, w)
        for i in range(2):
            assert torch.equal(ops.linear(x[i : i + 1], w), y[i : i + 1]), f"row {i} of a {dtype} product"
    want = x.double() @ w.double().t()
    assert ((y.double() - want).abs() <= 1e-5 + 8e-3 * want.abs()).all()


# ---------------------------------------------------------------- per-head linear (MLA absorption)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_linear_heads_matches_float64_and_is_token_invariant(gen, dtype, tol):
    M, Hh, N, K = 5, 3, 7, 24
    x, w = randn(gen, M, Hh, K, dtype=dtype), randn(gen, Hh, N, K, scale=K**-0.5, dtype=dtype)
    want = torch.einsum("mhk,hnk->mhn", x.double(), w.double())
    got = ops.linear_heads(x, w)
    assert got.shape == (M, Hh, N) and got.dtype == dtype
    assert ((got.double() - want).norm() / want.norm()).item() < tol
    # a token's bits do not depend on the tokens beside it (CPU reference)
    assert torch.equal(ops.linear_heads(x[2:3], w), got[2:3])


def test_linear_heads_rejects_mismatched_heads(gen):
    with pytest.raises(ValueError, match="x/weight"):
        ops.linear_heads(randn(gen, 2, 3, 4), randn(gen, 2, 5, 4))


def test_moe_experts_matches_a_float64_loop_and_is_token_invariant(gen):
    E, L, I, M, k = 6, 64, 32, 5, 3
    (p1, s1), (p3, s3), (p2, s2) = (pack(randn(gen, E, I, L, scale=L**-0.5)), pack(randn(gen, E, I, L, scale=L**-0.5)),
                                    pack(randn(gen, E, L, I, scale=I**-0.5)))
    experts = (p1, s1, p3, s3, p2, s2)
    latent = randn(gen, M, L)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(M)])
    route_weights = torch.rand(M, k, generator=gen) + 0.1
    beta, linear_beta = 4.0, 25.0
    out = ops.moe_experts(latent, ids, route_weights, *experts, beta, linear_beta)
    assert out.dtype == torch.float32 and out.shape == (M, L)
    w1, w3, w2 = (dequantise(p, s, torch.float64) for p, s in ((p1, s1), (p3, s3), (p2, s2)))
    for m in range(M):
        h = latent[m].double()
        expected = torch.zeros(L, dtype=torch.float64)
        for e, we in zip(ids[m].tolist(), route_weights[m].double()):
            g, u = w1[e] @ h, w3[e] @ h
            act = beta * torch.tanh(g / beta) * torch.sigmoid(g) * linear_beta * torch.tanh(u / linear_beta)
            expected += we * (w2[e] @ act)
        torch.testing.assert_close(out[m].double(), expected, rtol=1e-4, atol=1e-5)
        single = ops.moe_experts(latent[m : m + 1], ids[m : m + 1], route_weights[m : m + 1], *experts, beta, linear_beta)
        assert torch.equal(single[0], out[m]), f"token {m} not invariant"
    with pytest.raises(ValueError, match="w2_packed"):
        ops.moe_experts(latent, ids, route_weights, p1, s1, p3, s3, p1, s1, beta, linear_beta)


def test_the_cpu_reference_keeps_small_experts_dequantised_until_their_weights_change(gen, monkeypatch):
    """moe_experts' CPU reference dequantises a touched expert once and reuses it while neither its
    codes nor its scales are written; an in-place write to either (their version) rebuilds it, and a
    new tensor with the same values starts with none kept. The result equals a cold call's every time."""
    from dspark.kernels.moe import reference as moe_ref

    E, L, I, M, k = 4, 64, 32, 3, 2
    experts = [t for pair in (pack(randn(gen, E, I, L, scale=L**-0.5)), pack(randn(gen, E, I, L, scale=L**-0.5)),
                              pack(randn(gen, E, L, I, scale=I**-0.5))) for t in pair]
    latent, route_weights = randn(gen, M, L), torch.rand(M, k, generator=gen) + 0.1
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(M)])
    calls = []
    real = moe_ref.dequantise
    monkeypatch.setattr(moe_ref, "dequantise", lambda *a: calls.append(a) or real(*a))

    def run():
        calls.clear()
        return ops.moe_experts(latent, ids, route_weights, *experts, 4.0, 25.0)

    first = run()
    touched = len(ids.unique())
    assert len(calls) == 3 * touched
    assert torch.equal(run(), first) and calls == []  # kept
    with torch.no_grad():
        experts[5].add_(1)  # w2's scales written in place: w2 of every touched expert is rebuilt
    changed = run()
    assert len(calls) == touched and not torch.equal(changed, first)
    experts[4] = experts[4].clone()  # w2's codes as a new tensor: nothing kept on it
    assert torch.equal(run(), changed) and len(calls) == touched


def test_record_selections_names_fallbacks_and_what_blocks_a_capture(gen):
    """registry.record_selections: each select() of the block, the implementation it ran, and
    whether the device's default passed the call on (a fallback); a CUDA call that runs an
    implementation reading device values on the host blocks a CUDA-graph capture."""
    import dataclasses

    from dspark.kernels import registry

    op = "test_probe_selections"
    registry.register(op, "host_reading", priority=0, reads_device_values=True)(lambda x: x)
    registry.register(op, "fast", priority=10, supports=lambda x: x.shape[0] <= 4)(lambda x: x)
    try:
        with registry.record_selections() as seen:
            registry.select(op, randn(gen, 2))
            registry.select(op, randn(gen, 8))
        registry.select(op, randn(gen, 8))  # outside the block: not recorded
        assert [(s.chosen.name, s.preferred, s.fallback) for s in seen] == [
            ("fast", "fast", False), ("host_reading", "fast", True)]
        assert not any(s.blocks_capture for s in seen)  # on the CPU the values are host values
        on_cuda = dataclasses.replace(seen[1], device="cuda:0")
        assert on_cuda.blocks_capture
        assert str(on_cuda) == (f"{op} on cuda:0 ran 'host_reading' ('fast' does not take arguments "
                                "[((8,), torch.float32)])")
    finally:
        registry._IMPLS.pop(op)
        registry._resolved.clear()


@pytest.mark.parametrize("op", ["kda_verify", "kda_commit", "kda_commit_layers", "mla_verify_attention", "moe_experts",
                                "rejection_sample", "synthetic_sample"])
def test_the_references_that_read_device_values_say_so(op):
    from dspark.kernels import registry

    assert registry.implementations(op)["reference"].reads_device_values
    assert not any(impl.reads_device_values for name, impl in registry.implementations(op).items()
                   if name != "reference")


def test_router_logits_are_the_fp32_router_and_what_moe_route_selects_from(gen):
    """moe_router_logits (the rank's router GEMM alone, gathered before the selection) equals
    x gate^T in float64 to fp32 rounding (1e-5 relative: bf16 inputs are exact in fp32, sums of
    64 products), and moe_route is moe_route_logits of it, bit for bit."""
    x = randn(gen, 5, K3_TINY.hidden_size, dtype=torch.bfloat16)
    gate = randn(gen, K3_TINY.num_experts, K3_TINY.hidden_size, dtype=torch.bfloat16)
    bias = randn(gen, K3_TINY.num_experts, scale=0.1)
    logits = ops.moe_router_logits(x, gate)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits.double(), x.double() @ gate.double().t(), rtol=1e-5, atol=1e-5)
    ids, weights = ops.moe_route(x, gate, bias, K3_TINY.num_experts_per_token, 2.5)
    ids_l, weights_l = ops.moe_route_logits(logits, bias, K3_TINY.num_experts_per_token, 2.5)
    assert torch.equal(ids, ids_l) and torch.equal(weights, weights_l)
    with pytest.raises(ValueError, match="x / gate_weight"):
        ops.moe_router_logits(x, gate[:, :-1])


def test_moe_tail_inputs_are_the_norm_window_beside_the_shared_activation(gen):
    """moe_tail_inputs: the window of RMSNorm(routed) normalised over the whole row, then SiTU-GLU,
    both as float64 formulas (1e-6: fp32 arithmetic on O(1) values, one rounding to fp32 at the
    end), and bit for bit the rms_norm and situ_glu ops it replaces; one row alone gives that
    row's bits (token invariance)."""
    cfg = K3_TINY
    L, S, start, width = 32, 12, 8, 16
    routed = randn(gen, 5, L, scale=3.0)
    norm = 1 + randn(gen, L, scale=0.1)
    gate_up = randn(gen, 5, 2 * S, scale=2.0)
    out = ops.moe_tail_inputs(routed, norm, gate_up, start, width, 1e-6, cfg.situ_beta, cfg.situ_linear_beta)
    assert out.shape == (5, width + S) and out.dtype == torch.float32
    r, g, u = routed.double(), gate_up[:, :S].double(), gate_up[:, S:].double()
    normed = r / torch.sqrt((r * r).mean(-1, keepdim=True) + 1e-6) * norm.double()
    act = (cfg.situ_beta * torch.tanh(g / cfg.situ_beta) * torch.sigmoid(g)
           * cfg.situ_linear_beta * torch.tanh(u / cfg.situ_linear_beta))
    torch.testing.assert_close(out.double(), torch.cat([normed[:, start : start + width], act], dim=-1),
                               rtol=1e-6, atol=1e-6)
    separate = torch.cat([ops.rms_norm(routed, norm, 1e-6)[:, start : start + width],
                          ops.situ_glu(gate_up[:, :S], gate_up[:, S:], cfg.situ_beta, cfg.situ_linear_beta)], dim=-1)
    assert torch.equal(out, separate)
    for m in range(5):
        one = ops.moe_tail_inputs(routed[m : m + 1], norm, gate_up[m : m + 1], start, width, 1e-6, cfg.situ_beta,
                                  cfg.situ_linear_beta)
        assert torch.equal(one[0], out[m]), f"row {m} not invariant"
    bf16 = ops.moe_tail_inputs(routed, norm.bfloat16(), gate_up.bfloat16(), 0, L, 1e-6, 4.0, 25.0)
    assert bf16.dtype == torch.bfloat16  # the output GEMM's dtype: the shared projection's


@pytest.mark.parametrize("field, change", [
    ("routed", lambda a: {**a, "routed": a["routed"].bfloat16()}),
    ("latent_norm", lambda a: {**a, "latent_norm": a["latent_norm"][:-1]}),
    ("shared_gate_up", lambda a: {**a, "shared_gate_up": a["shared_gate_up"][:, :-1]}),
    ("start / width", lambda a: {**a, "start": 20, "width": 16}),
    ("start / width", lambda a: {**a, "width": 0}),
])
def test_moe_tail_inputs_refuse_bad_arguments_naming_the_field(gen, field, change):
    good = dict(routed=randn(gen, 3, 32), latent_norm=randn(gen, 32), shared_gate_up=randn(gen, 3, 24), start=8,
                width=16)
    args = change(good)
    with pytest.raises(ValueError, match=field):
        ops.moe_tail_inputs(args["routed"], args["latent_norm"], args["shared_gate_up"], args["start"], args["width"],
                            1e-6, 4.0, 25.0)


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_mla_cache_rows_land_past_each_committed_length_and_padding_on_the_spare_row(gen, index_dtype):
    """mla_cache_rows: token j of request b at row cache_lens[b] + j of slot slots[b], as
    [RMSNorm(c_kv) | k_pe] (the norm against float64 to fp32 rounding, 1e-6; k_pe exact); a padding
    token on the slot's spare row; every other row untouched."""
    B, T, R, P, L = 3, 4, 16, 8, 20
    cache = randn(gen, 5, L + 1, R + P)
    before = cache.clone()
    kv = randn(gen, B * T, R + P + 6, scale=2.0)[:, 3 : 3 + R + P]  # strided rows: the fused GEMM's columns
    weight = 1 + randn(gen, R, scale=0.1)
    slots = torch.tensor([4, 0, 2], dtype=index_dtype)
    cache_lens = torch.tensor([0, 7, L - 2], dtype=index_dtype)
    lengths = torch.tensor([4, 1, 2], dtype=index_dtype)
    ops.mla_cache_rows(kv, weight, 1e-6, cache, slots, cache_lens, lengths)
    touched = torch.zeros(5, L + 1, dtype=torch.bool)
    for b in range(B):
        for j in range(int(lengths[b])):
            slot, row = int(slots[b]), int(cache_lens[b]) + j
            x = kv[b * T + j].double()
            normed = x[:R] / torch.sqrt((x[:R] ** 2).mean() + 1e-6) * weight.double()
            torch.testing.assert_close(cache[slot, row, :R].double(), normed, rtol=1e-6, atol=1e-6)
            assert torch.equal(cache[slot, row, R:], kv[b * T + j, R:])
            touched[slot, row] = True
        touched[int(slots[b]), L] = True  # padding rows land on the spare row
    assert torch.equal(cache[~touched], before[~touched])
    spare_written = [int(slots[b]) for b in range(B) if int(lengths[b]) < T]
    for slot in spare_written:
        assert not torch.equal(cache[slot, L], before[slot, L])


def test_mla_cache_rows_refuse_bad_arguments_naming_the_field(gen):
    cache, kv, weight = randn(gen, 2, 9, 24), randn(gen, 6, 24), randn(gen, 16)
    index = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="lengths"):
        ops.mla_cache_rows(kv, weight, 1e-6, cache, index, index, index[:1])
    with pytest.raises(ValueError, match="kv / norm_weight"):
        ops.mla_cache_rows(kv[:5], weight, 1e-6, cache, index, index, index)
    with pytest.raises(ValueError, match="cache"):
        ops.mla_cache_rows(kv, weight, 1e-6, cache[..., :20], index, index, index)


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-6), (torch.bfloat16, 8e-3)])
def test_mla_cache_rows_with_q_return_the_query_norm_and_write_the_same_rows(gen, dtype, rtol):
    """q = (c_q, q_norm_weight), c_q and kv column slices of one q_a | kv_a GEMM output: the op returns
    K3's RMSNorm of every c_q row (padding tokens' too), a new contiguous tensor in c_q's dtype, bit for
    bit ops.rms_norm's, and against float64 within its roundings (fp32: 1e-6; bf16: two roundings of at
    most 2^-8 each, bf16 keeping 8 significant bits, so 2^-7 = 7.8e-3 relative and fp32's error: 8e-3); the
    cache rows bit for bit those written without q."""
    B, T, R, P, Q, L = 3, 4, 16, 8, 24, 20
    fused = randn(gen, B * T, Q + R + P + 6, scale=2.0, dtype=dtype)
    c_q, kv = fused[:, 2 : 2 + Q], fused[:, 2 + Q : 2 + Q + R + P]
    weight, q_weight = (1 + randn(gen, R, scale=0.3)).to(dtype), (1 + randn(gen, Q, scale=0.3)).to(dtype)
    slots, cache_lens, lengths = torch.tensor([4, 0, 2]), torch.tensor([0, 7, L - 2]), torch.tensor([4, 1, 2])
    cache = randn(gen, 5, L + 1, R + P, dtype=dtype)
    plain = cache.clone()
    assert ops.mla_cache_rows(kv, weight, 1e-6, plain, slots, cache_lens, lengths) is None
    got = ops.mla_cache_rows(kv, weight, 1e-6, cache, slots, cache_lens, lengths, q=(c_q, q_weight))
    assert got.shape == (B * T, Q) and got.dtype == dtype and got.is_contiguous()
    assert torch.equal(cache, plain)
    assert torch.equal(got, ops.rms_norm(c_q, q_weight, 1e-6))
    x = c_q.double()
    want = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-6) * q_weight.double()
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=1e-6)
    unweighted = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-6)
    assert not torch.allclose(unweighted, want, rtol=rtol, atol=1e-6)  # the comparison sees the weight


def test_mla_cache_rows_of_split_k_partials_are_those_of_the_reduced_gemm(gen):
    """dtype given: kv and c_q are one q_a | kv_a GEMM's float32 split-K partials [S, M, ...] (column slices
    of each partial); the op sums each in split order, rounds to dtype (sum_partials) and writes and returns
    what it does for the reduced GEMM's output, bit for bit; a malformed partials call names its argument."""
    from dspark.kernels.numerics import sum_partials

    S, B, T, R, P, Q, L = 4, 2, 3, 16, 8, 24, 20
    fused = randn(gen, S, B * T, Q + R + P + 4, scale=2.0)
    c_q, kv = fused[..., 4 : 4 + Q], fused[..., 4 + Q :]
    weight, q_weight = (1 + randn(gen, R, scale=0.3)).bfloat16(), (1 + randn(gen, Q, scale=0.3)).bfloat16()
    slots, cache_lens, lengths = torch.tensor([1, 0]), torch.tensor([2, L - 3]), torch.tensor([3, 2])
    cache = randn(gen, 3, L + 1, R + P, dtype=torch.bfloat16)
    reduced = cache.clone()
    want = ops.mla_cache_rows(sum_partials(kv, torch.bfloat16), weight, 1e-6, reduced, slots, cache_lens, lengths,
                              q=(sum_partials(c_q, torch.bfloat16), q_weight))
    got = ops.mla_cache_rows(kv, weight, 1e-6, cache, slots, cache_lens, lengths, q=(c_q, q_weight),
                             dtype=torch.bfloat16)
    assert torch.equal(got, want) and torch.equal(cache, reduced)
    short = cache.clone()
    ops.mla_cache_rows(kv[:-1], weight, 1e-6, short, slots, cache_lens, lengths, dtype=torch.bfloat16)
    assert not torch.equal(short, reduced)  # every part counts
    with pytest.raises(ValueError, match=r"kv: with dtype, float32 split-K partials \[S, M, R \+ P\], got "
                                         r"torch.bfloat16 \(6, 24\)"):
        ops.mla_cache_rows(sum_partials(kv, torch.bfloat16), weight, 1e-6, cache, slots, cache_lens, lengths,
                           dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"q: with dtype, c_q must be float32 split-K partials \[4, 6, Q\]"):
        ops.mla_cache_rows(kv, weight, 1e-6, cache, slots, cache_lens, lengths, q=(c_q[:2], q_weight),
                           dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"dtype: with partials, the GEMM's floating dtype, the cache's "
                                         r"torch.bfloat16; got torch.float16"):
        ops.mla_cache_rows(kv, weight, 1e-6, cache, slots, cache_lens, lengths, dtype=torch.float16)


def test_mla_absorb_output_of_a_gates_split_k_partials_is_that_of_the_reduced_gate(gen):
    """A gate [S, M, H*V] of float32 split-K partials (the K3 MLA input GEMM's, SPLIT_K_INTO_CONSUMERS):
    summed in split order and rounded to o_latent's dtype first, bit for bit the call on the reduced gate;
    partials of the wrong shape are refused by name."""
    from dspark.kernels.numerics import sum_partials

    M, H, V, R = 5, 3, 16, 32
    o_latent, w_uv = randn(gen, M, H, R, dtype=torch.bfloat16), randn(gen, H, V, R, scale=R**-0.5, dtype=torch.bfloat16)
    parts = randn(gen, 4, M, H * V + 6, scale=2.0)[..., 3 : 3 + H * V]
    want = ops.mla_absorb_output(o_latent, w_uv, sum_partials(parts, torch.bfloat16))
    assert torch.equal(ops.mla_absorb_output(o_latent, w_uv, parts), want)
    assert not torch.equal(ops.mla_absorb_output(o_latent, w_uv, parts[:-1]), want)
    with pytest.raises(ValueError, match=r"gate: as split-K partials, expected float32 \[S, 5, 48\], got "
                                         r"torch.float32 \(4, 5, 47\)"):
        ops.mla_absorb_output(o_latent, w_uv, parts[..., :-1])


def test_mla_cache_rows_with_q_are_token_invariant(gen):
    """A token's normalised c_q does not depend on the batch it comes in (the reference's rows are
    normalised one at a time on the CPU): the rows of one call of 12 tokens are those of 12 calls of one."""
    M, R, P, Q = 12, 16, 8, 40
    kv, c_q = randn(gen, M, R + P), randn(gen, M, Q, scale=3.0)
    weight, q_weight = 1 + randn(gen, R, scale=0.1), 1 + randn(gen, Q, scale=0.1)
    cache = randn(gen, 2, M + 2, R + P)
    one = torch.tensor([0])
    together = ops.mla_cache_rows(kv, weight, 1e-6, cache, one, one, torch.tensor([M]), q=(c_q, q_weight))
    for m in range(M):
        alone = ops.mla_cache_rows(kv[m : m + 1], weight, 1e-6, cache, one, one, one, q=(c_q[m : m + 1], q_weight))
        assert torch.equal(alone[0], together[m])


@pytest.mark.parametrize("field, make_q", [
    (r"q: expected a \(c_q, q_norm_weight\) pair of tensors, got torch.float32 \(6, 12\)", lambda c, w: c),
    (r"q: expected a \(c_q, q_norm_weight\) pair of tensors, got tuple of \['torch.float32 \(6, 12\)'\]",
     lambda c, w: (c,)),
    (r"q: expected a \(c_q, q_norm_weight\) pair of tensors, got tuple of \[.*'list'\]", lambda c, w: (c, [1.0])),
    (r"q: c_q must be \[6, Q\] \(a row per kv row\), got \(5, 12\)", lambda c, w: (c[:5], w)),
    (r"q: c_q must be \[6, Q\] \(a row per kv row\), got \(72,\)", lambda c, w: (c.reshape(-1), w)),
    (r"q: q_norm_weight must be \[12\] for c_q \(6, 12\), got \(11,\)", lambda c, w: (c, w[:11])),
    (r"q: c_q and q_norm_weight must be floating point, got torch.int64 and torch.float32",
     lambda c, w: (c.long(), w)),
    (r"q: c_q's rows must be contiguous \(stride 1 along Q\), got strides \(1, 6\)",
     lambda c, w: (c.t().contiguous().t(), w)),
])
def test_mla_cache_rows_refuse_a_bad_q_naming_it(gen, field, make_q):
    cache, kv, weight = randn(gen, 2, 9, 24), randn(gen, 6, 24), randn(gen, 16)
    index = torch.tensor([0, 1])
    c_q, q_weight = randn(gen, 6, 12), randn(gen, 12)
    before = cache.clone()
    with pytest.raises(ValueError, match=field):
        ops.mla_cache_rows(kv, weight, 1e-6, cache, index, index, index, q=make_q(c_q, q_weight))
    assert torch.equal(cache, before)  # refused before anything is written


def test_mla_cache_rows_triton_takes_q_only_within_its_widths_and_dtypes():
    """The Triton implementation's `supports` sees q's tensors (ops passes them to the registry): K3's
    widths in bf16 are taken; a c_q wider than MAX_WIDTH or in float64 goes to the next implementation."""
    from dspark.kernels.mla import triton as mla_triton

    M, R, P, Q = 4, 512, 64, 1536
    kv, c_q = torch.empty(M, R + P, dtype=torch.bfloat16), torch.empty(M, Q, dtype=torch.bfloat16)
    weight, q_weight = torch.empty(R, dtype=torch.bfloat16), torch.empty(Q, dtype=torch.bfloat16)
    cache, index = torch.empty(3, 9, R + P, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.long)
    args = (kv, weight, cache, index, index, index)
    assert mla_triton.supports(*args) and mla_triton.supports(*args, c_q, q_weight)
    wide = torch.empty(M, mla_triton.MAX_WIDTH + 1, dtype=torch.bfloat16)
    assert not mla_triton.supports(*args, wide, torch.empty(wide.shape[1], dtype=torch.bfloat16))
    assert not mla_triton.supports(*args, c_q.double(), q_weight)



def test_mla_absorptions_are_the_per_head_products_and_the_gate(gen):
    """mla_absorb_q: W_UK_h^T q_nope_h per head against float64 (1e-5: fp32 sums of 16 products)
    and q_pe copied out exactly; mla_absorb_output: sigmoid(gate) * W_UV_h o_latent_h against
    float64; both bit for bit the linear_heads / sigmoid_gate ops they replace, and token-invariant."""
    M, H, R, nope, P, V = 5, 3, 32, 16, 8, 16
    q = randn(gen, M, H, nope + P)
    w_uk_t = randn(gen, H, R, nope, scale=nope**-0.5)
    q_latent, q_pe = ops.mla_absorb_q(q, w_uk_t)
    assert q_latent.is_contiguous() and q_pe.is_contiguous()
    want = torch.einsum("mhk,hrk->mhr", q[:, :, :nope].double(), w_uk_t.double())
    torch.testing.assert_close(q_latent.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(q_pe, q[:, :, nope:])
    assert torch.equal(q_latent, ops.linear_heads(q[:, :, :nope], w_uk_t))
    o_latent = randn(gen, M, H, R)
    w_uv = randn(gen, H, V, R, scale=R**-0.5)
    gate = randn(gen, M, H * V + 4)[:, 2 : 2 + H * V]  # a column slice of the fused input GEMM's output
    out = ops.mla_absorb_output(o_latent, w_uv, gate)
    product = torch.einsum("mhr,hvr->mhv", o_latent.double(), w_uv.double()).reshape(M, H * V)
    torch.testing.assert_close(out.double(), product * torch.sigmoid(gate.double()), rtol=1e-5, atol=1e-5)
    assert torch.equal(out, ops.sigmoid_gate(ops.linear_heads(o_latent, w_uv).reshape(M, H * V), gate))
    for m in range(M):
        assert torch.equal(ops.mla_absorb_q(q[m : m + 1], w_uk_t)[0][0], q_latent[m])
        assert torch.equal(ops.mla_absorb_output(o_latent[m : m + 1], w_uv, gate[m : m + 1])[0], out[m])
    with pytest.raises(ValueError, match="q / w_uk_t"):
        ops.mla_absorb_q(q[:, :2], w_uk_t)
    with pytest.raises(ValueError, match="gate"):
        ops.mla_absorb_output(o_latent, w_uv, gate[:, :-1])


def test_silu_mul_of_split_k_partials_sums_them_rounded_then_activates():
    """silu_mul(gate, up, dtype) with a gate | up GEMM's split-K partials: each summed in split order,
    rounded to dtype (sum_partials, the reduction's rounding), then the activation, bit for bit on the CPU;
    a malformed call names its argument."""
    from dspark.kernels.numerics import sum_partials

    partials = torch.randn(5, 3, 2, 40) * 3  # [S, ..., 2n]
    gate, up = partials.chunk(2, dim=-1)
    got = ops.silu_mul(gate, up, torch.bfloat16)
    want = torch.nn.functional.silu(sum_partials(gate.flatten(1, -2), torch.bfloat16)) \
        * sum_partials(up.flatten(1, -2), torch.bfloat16)
    assert got.shape == (3, 2, 20) and got.dtype == torch.bfloat16 and torch.equal(got, want.view(3, 2, 20))
    assert not torch.equal(got, ops.silu_mul(gate[:-1], up[:-1], torch.bfloat16))
    with pytest.raises(ValueError, match=r"silu_mul: with dtype, up must be split-K partials .*torch.bfloat16 \(5, 3, 2, 20\)"):
        ops.silu_mul(gate, up.bfloat16(), torch.bfloat16)
    with pytest.raises(ValueError, match=r"silu_mul: dtype must be a floating torch.dtype, got torch.int64"):
        ops.silu_mul(gate, up, torch.long)
