"""GPU numerics of the MXFP4 expert op `moe_experts` (kernels/moe/cute_sm90.py, run on the H200;
the Blackwell build of cute_sm100.py has its own tests here that have never run) and of the K3
latent-MoE block built on it (dspark/targets/kimi_k3/moe.py) at full K3 MoE shapes (E 896,
top-16, latent 3584, I 3072, shared 6144, D 7168) for T in {1, 2, 4, 8, 16}.

Random MXFP4 codes are drawn directly as uint8 on the GPU with E8M0 scales around 2^-7.5, so
gate/up and the expert outputs are O(1). Two routings: one where every token's experts are
distinct from every other token's ("disjoint") and one where all tokens share 12 of their 16
experts ("repeated", exercising slots with up to T tokens). Outputs are poisoned with NaN; the
comparison is against float64 math on the dequantised weights (expert passes and the op) and,
for the whole block on CUDA, against the same block on the CPU in float32 with the reference ops (fewer
experts there, so the CPU copy stays small), relative Frobenius error <= 1e-2, no NaN.
"""
import dataclasses

import pytest
import torch

from dspark.kernels import cute_common, ops, registry
from dspark.kernels.moe import expert_layout
from dspark.kernels.mxfp4 import dequantise
from dspark.targets.kimi_k3.config import K3
from dspark.targets.kimi_k3.moe import LatentMoEWeights, latent_moe

if not cute_common.cutlass_available():  # the kernel modules import cutlass at their top
    pytest.skip("nvidia-cutlass-dsl / tvm-ffi not installed", allow_module_level=True)
from dspark.kernels.moe import cute_sm90, cute_sm100  # noqa: E402

CAPABILITY = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
hopper = pytest.mark.skipif(CAPABILITY != (9, 0), reason="the sm_90a kernels (cute_sm90.py)")
blackwell = pytest.mark.skipif(
    CAPABILITY not in ((10, 0), (10, 3)), reason="the sm_100a/sm_103a kernel (cute_sm100.py; never run so far)"
)

TOKEN_COUNTS = (1, 2, 4, 8, 16)
REL_TOL = 1e-2
SHARED_EXPERTS = 12  # "repeated" routing: experts every token picks


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def random_mxfp4(gen, experts, rows, k):
    packed = torch.randint(0, 256, (experts, rows, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
    # scales 2^-8 .. 2^-7: the codes' RMS is ~2.9, so weights are ~1/sqrt(K)
    scale = torch.randint(119, 121, (experts, rows, k // 32), dtype=torch.uint8, device="cuda", generator=gen)
    return packed, scale


def make_weights(cfg, gen) -> LatentMoEWeights:
    E, D, L, I, S = cfg.num_experts, cfg.hidden_size, cfg.latent_size, cfg.moe_intermediate_size, cfg.shared_intermediate_size

    def dense(n, k):
        return (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)

    w1, s1 = random_mxfp4(gen, E, I, L)
    w3, s3 = random_mxfp4(gen, E, I, L)
    w2, s2 = random_mxfp4(gen, E, L, I)
    return LatentMoEWeights.from_parts(
        gate=dense(E, D),
        score_bias=torch.zeros(E, device="cuda"),
        latent_down=dense(L, D),
        latent_norm=(1 + 0.1 * torch.randn(L, device="cuda", generator=gen)).to(torch.bfloat16),
        latent_up=dense(D, L),
        shared_gate=dense(S, D),
        shared_up=dense(S, D),
        shared_down=dense(D, S),
        w1_packed=w1, w1_scale=s1, w3_packed=w3, w3_scale=s3, w2_packed=w2, w2_scale=s2,
    )


@pytest.fixture(scope="module")
def weights():
    return make_weights(K3, torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31))


def routing_ids(kind: str, tokens: int, gen) -> torch.Tensor:
    E, k = K3.num_experts, K3.num_experts_per_token
    order = torch.randperm(E, device="cuda", generator=gen)
    if kind == "disjoint":
        return order[: tokens * k].view(tokens, k)
    common = order[:SHARED_EXPERTS]
    rows = []
    for t in range(tokens):
        own = order[SHARED_EXPERTS + t * (k - SHARED_EXPERTS) : SHARED_EXPERTS + (t + 1) * (k - SHARED_EXPERTS)]
        row = torch.cat([common, own])
        rows.append(row[torch.randperm(k, device="cuda", generator=gen)])
    return torch.stack(rows)


def expert_reference(weights, latent, ids, cfg):
    """float64 per-pair expert outputs [T, k, latent] on the dequantised weights."""
    ref = torch.empty(*ids.shape, cfg.latent_size, dtype=torch.float64, device="cuda")
    h = latent.double()
    for e in ids.unique().tolist():
        rows, slots_k = (ids == e).nonzero(as_tuple=True)
        w1 = dequantise(weights.w1_packed[e], weights.w1_scale[e]).double()
        w3 = dequantise(weights.w3_packed[e], weights.w3_scale[e]).double()
        w2 = dequantise(weights.w2_packed[e], weights.w2_scale[e]).double()
        g, u = h[rows] @ w1.t(), h[rows] @ w3.t()
        a = (cfg.situ_beta * torch.tanh(g / cfg.situ_beta) * torch.sigmoid(g)) * (
            cfg.situ_linear_beta * torch.tanh(u / cfg.situ_linear_beta))
        ref[rows, slots_k] = a @ w2.t()
    return ref


def poisoned_expert_passes(module, weights, latent, lists, splits: int = 1, **options) -> torch.Tensor:
    """Both passes of `module`'s expert kernel over `lists`, into buffers poisoned with NaN ->
    per-pair outputs [T, k, latent] (K3 shapes); splits > 1: pass 2's K split, its partials added
    here in float64."""
    cfg = K3
    slots, tile = lists.slot_tokens.shape
    xb = module.tokens_for_kernel(latent, lists)
    act = torch.full((slots, tile, cfg.moe_intermediate_size), float("nan"), dtype=torch.bfloat16, device="cuda")
    module.expert_pass(weights.w1_packed, weights.w1_scale, weights.w3_packed, weights.w3_scale,
                       lists, xb, act, True, cfg.situ_beta, cfg.situ_linear_beta, **options)
    y = torch.full((splits * slots, tile, cfg.latent_size), float("nan"), dtype=torch.float32, device="cuda")
    module.expert_pass(weights.w2_packed, weights.w2_scale, weights.w2_packed, weights.w2_scale, lists, act, y, False,
                       **options, **({"splits": splits} if splits > 1 else {}))
    torch.cuda.synchronize()
    return y.double().view(splits, -1, cfg.latent_size).sum(dim=0)[lists.pair_position]


@hopper
@pytest.mark.parametrize("loader, splits", [("registers", 1), ("tma", 1), ("tma", 4)])
@pytest.mark.parametrize("kind", ["disjoint", "repeated"])
def test_expert_kernels_match_float64_per_pair(weights, kind, loader, splits):
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    cfg = K3
    latent_all = torch.randn(max(TOKEN_COUNTS), cfg.latent_size, device="cuda", generator=gen).to(torch.bfloat16)
    for tokens in TOKEN_COUNTS:
        ids = routing_ids(kind, tokens, gen)
        latent = latent_all[:tokens]
        tile = cute_sm90.token_tile(tokens)
        lists = expert_layout.build_expert_lists(ids, cfg.num_experts, tile)
        out = poisoned_expert_passes(cute_sm90, weights, latent, lists, splits, loader=loader)
        name = f"{kind} {loader} splits={splits} T={tokens}"
        assert not out.isnan().any(), f"{name}: {out.isnan().sum().item()} outputs not written"
        err = relative_error(out, expert_reference(weights, latent, ids, cfg))
        assert err <= REL_TOL, f"{name}: relative error {err:.2e} > {REL_TOL}"
        if kind == "repeated":
            assert int((lists.slot_expert >= 0).sum()) == SHARED_EXPERTS + tokens * (cfg.num_experts_per_token - SHARED_EXPERTS)


def weighted_sum_reference(weights, latent, ids, route_weights, cfg):
    """float64 ops.moe_experts: the per-pair outputs weighted and summed over the top-k."""
    return (route_weights.double().unsqueeze(-1) * expert_reference(weights, latent, ids, cfg)).sum(dim=1)


@pytest.mark.skipif(CAPABILITY not in ((9, 0), (10, 0), (10, 3)), reason="no CuTe DSL expert kernel for this GPU")
@pytest.mark.parametrize("kind", ["disjoint", "repeated"])
# cute_sm90.COMBINE and PASS2_SPLITS (Hopper's kernel only; the torch combine takes no split)
@pytest.mark.parametrize("combine, splits", [("torch", 1), ("triton", 1), ("triton", 3)])
def test_moe_experts_op_matches_float64(weights, kind, combine, splits, monkeypatch):
    monkeypatch.setattr(cute_sm90, "COMBINE", combine)
    monkeypatch.setattr(cute_sm90, "PASS2_SPLITS", splits)
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    cfg = K3
    latent_all = torch.randn(max(TOKEN_COUNTS), cfg.latent_size, device="cuda", generator=gen).to(torch.bfloat16)
    expected_impl = "cute_sm90" if CAPABILITY == (9, 0) else "cute_sm100"
    for tokens in TOKEN_COUNTS:
        ids = routing_ids(kind, tokens, gen)
        route_weights = torch.rand(tokens, cfg.num_experts_per_token, device="cuda", generator=gen) + 0.1
        latent = latent_all[:tokens]
        args = (latent, ids, route_weights, *weights.experts)
        assert registry.select("moe_experts", *args).name == expected_impl
        out = ops.moe_experts(*args, cfg.situ_beta, cfg.situ_linear_beta)
        torch.cuda.synchronize()
        assert out.dtype == torch.float32 and out.shape == (tokens, cfg.latent_size)
        assert not out.isnan().any(), f"{kind} {combine} splits={splits} T={tokens}"
        err = relative_error(out, weighted_sum_reference(weights, latent, ids, route_weights, cfg))
        assert err <= REL_TOL, f"{kind} {combine} splits={splits} T={tokens}: relative error {err:.2e} > {REL_TOL}"


@hopper
@pytest.mark.parametrize("kind", ["disjoint", "repeated"])
def test_lists_in_the_token_gather_give_the_same_bits(weights, kind, monkeypatch):
    """DEFAULT_LISTS = "fused" (the lists built in the token gather's launch, moe_triton.lists_and_tokens):
    the same lists and operand as the list kernel and gather_tokens, so ops.moe_experts gives the same bits."""
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    cfg = K3
    latent_all = torch.randn(max(TOKEN_COUNTS), cfg.latent_size, device="cuda", generator=gen).to(torch.bfloat16)
    for tokens in TOKEN_COUNTS:
        ids = routing_ids(kind, tokens, gen)
        route_weights = torch.rand(tokens, cfg.num_experts_per_token, device="cuda", generator=gen) + 0.1
        args = (latent_all[:tokens], ids, route_weights, *weights.experts, cfg.situ_beta, cfg.situ_linear_beta)
        monkeypatch.setattr(cute_sm90, "DEFAULT_LISTS", "device")
        apart = ops.moe_experts(*args)
        monkeypatch.setattr(cute_sm90, "DEFAULT_LISTS", "fused")
        fused = ops.moe_experts(*args)
        assert not fused.isnan().any() and torch.equal(fused, apart), f"{kind} T={tokens}"


@hopper
@pytest.mark.parametrize("tokens", [32, 64])
@pytest.mark.parametrize("kind", ["random", "repeated"])
def test_steps_past_16_tokens_take_several_slots_per_expert(weights, kind, tokens):
    """B x T > 16 rows (batch 4 or 8 at k = 7): an expert chosen by more than 16 tokens takes
    several slots (expert_layout.build_expert_lists). The passes write every pair (outputs
    poisoned with NaN) and the op matches float64, with no fallback to the reference."""
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    cfg = K3
    if kind == "repeated":  # 12 experts chosen by every token: each takes tokens / 16 slots
        ids = routing_ids(kind, tokens, gen)
    else:
        ids = torch.stack([torch.randperm(cfg.num_experts, device="cuda", generator=gen)[: cfg.num_experts_per_token]
                           for _ in range(tokens)])
    latent = torch.randn(tokens, cfg.latent_size, device="cuda", generator=gen).to(torch.bfloat16)
    tile = cute_sm90.token_tile(tokens)
    lists = expert_layout.build_expert_lists(ids, cfg.num_experts, tile)
    if kind == "repeated":
        assert int((lists.slot_expert >= 0).sum()) == SHARED_EXPERTS * tokens // tile + tokens * (cfg.num_experts_per_token - SHARED_EXPERTS)
    out = poisoned_expert_passes(cute_sm90, weights, latent, lists)
    assert not out.isnan().any(), f"{kind} T={tokens}: {out.isnan().sum().item()} outputs not written"
    err = relative_error(out, expert_reference(weights, latent, ids, cfg))
    assert err <= REL_TOL, f"{kind} T={tokens} passes: relative error {err:.2e} > {REL_TOL}"
    route_weights = torch.rand(tokens, cfg.num_experts_per_token, device="cuda", generator=gen) + 0.1
    args = (latent, ids, route_weights, *weights.experts)
    assert registry.select("moe_experts", *args).name == "cute_sm90"
    routed = ops.moe_experts(*args, cfg.situ_beta, cfg.situ_linear_beta)
    err = relative_error(routed, weighted_sum_reference(weights, latent, ids, route_weights, cfg))
    assert err <= REL_TOL, f"{kind} T={tokens} op: relative error {err:.2e} > {REL_TOL}"


@pytest.mark.skipif(CAPABILITY not in ((9, 0), (10, 0), (10, 3)), reason="no CuTe DSL expert kernel for this GPU")
@pytest.mark.parametrize("kind", ["random", "repeated"])
def test_block_on_cuda_matches_the_cpu_reference(kind):
    """kimi_k3/moe.py with the default CUDA kernels
    against the same block on the CPU in float32, where every op is its reference. 32 experts keep
    the CPU copy small; every other shape is K3's. The CPU reference runs once, on all the tokens:
    its rows do not depend on the rows beside them (kernels/linear/reference.py), so its first T
    rows are the reference for T tokens."""
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    cfg = dataclasses.replace(K3, num_experts=32)
    weights = make_weights(cfg, gen)
    if kind == "repeated":  # a few experts win every token's top-16 (the bias chooses, never weighs)
        weights.score_bias[torch.randperm(cfg.num_experts, device="cuda", generator=gen)[:SHARED_EXPERTS]] = 10.0
    on_cpu = LatentMoEWeights(**{f.name: _float32_on_cpu(getattr(weights, f.name)) for f in dataclasses.fields(weights)})
    x_all = torch.randn(max(TOKEN_COUNTS), cfg.hidden_size, device="cuda", generator=gen).to(torch.bfloat16)
    ref_all = latent_moe(x_all.cpu().float(), on_cpu, cfg)
    for tokens in (1, 4, 16):
        x = x_all[:tokens]
        latent = torch.empty(tokens, cfg.latent_size, dtype=torch.bfloat16, device="cuda")
        ids = torch.zeros(tokens, cfg.num_experts_per_token, dtype=torch.long, device="cuda")
        assert registry.select("moe_experts", latent, ids, ids.float(), *weights.experts).name != "reference"
        ours = latent_moe(x, weights, cfg)
        torch.cuda.synchronize()
        assert not ours.isnan().any(), f"{kind} T={tokens}"
        err = relative_error(ours.cpu(), ref_all[:tokens])
        assert err <= REL_TOL, f"{kind} T={tokens}: relative error {err:.2e} > {REL_TOL}"


def _float32_on_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy, floating tensors in float32 (exact from bf16; the packed MXFP4 bytes as they are).
    A bf16 block on the CPU took minutes on the H200's host, most of it in bf16 matmuls."""
    tensor = tensor.cpu()
    return tensor.float() if tensor.is_floating_point() else tensor


@hopper
def test_expert_lists_match_a_host_loop_on_the_gpu():
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    for tokens in TOKEN_COUNTS:
        ids = routing_ids("repeated", tokens, gen)
        lists = expert_layout.build_expert_lists(ids, K3.num_experts, cute_sm90.token_tile(tokens))
        tile = lists.slot_tokens.shape[1]
        for t in range(tokens):
            for j in range(ids.shape[1]):
                slot, rank = divmod(int(lists.pair_position[t, j]), tile)
                assert int(lists.slot_expert[slot]) == int(ids[t, j])
                assert int(lists.slot_tokens[slot, rank]) == t


@hopper
@pytest.mark.parametrize("kind", ["disjoint", "repeated"])
def test_device_list_kernel_equals_the_torch_lists(kind):
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    for tokens in TOKEN_COUNTS:
        ids = routing_ids(kind, tokens, gen)
        tile = cute_sm90.token_tile(tokens)
        expected = expert_layout.build_expert_lists(ids, K3.num_experts, tile)
        got = cute_sm90.build_expert_lists_device(ids, K3.num_experts, tile)
        torch.cuda.synchronize()
        assert torch.equal(got.slot_expert, expected.slot_expert), f"{kind} T={tokens}"
        assert torch.equal(got.slot_tokens, expected.slot_tokens), f"{kind} T={tokens}"
        assert torch.equal(got.pair_position, expected.pair_position), f"{kind} T={tokens}"


@blackwell
@pytest.mark.parametrize("kind", ["disjoint", "repeated"])
def test_blackwell_expert_kernels_match_float64_per_pair(weights, kind):
    """What must pass on a B200/GB300 before cute_sm100.py is trusted (it has never run)."""
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    cfg = K3
    latent_all = torch.randn(max(TOKEN_COUNTS), cfg.latent_size, device="cuda", generator=gen).to(torch.bfloat16)
    for tokens in TOKEN_COUNTS:
        ids = routing_ids(kind, tokens, gen)
        latent = latent_all[:tokens]
        lists = expert_layout.build_expert_lists(ids, cfg.num_experts, cute_sm100.TOKENS)
        out = poisoned_expert_passes(cute_sm100, weights, latent, lists)
        assert not out.isnan().any(), f"{kind} T={tokens}: outputs not written"
        err = relative_error(out, expert_reference(weights, latent, ids, cfg))
        assert err <= REL_TOL, f"{kind} T={tokens}: relative error {err:.2e} > {REL_TOL}"
