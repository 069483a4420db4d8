"""The DSpark drafter's backbone on the GPU: its fused block attention (one masked
scaled_dot_product_attention call, drafters/dspark/model.py) under the bf16 autocast the trainer
uses, against the float64 per-block reference; and a training step without recomputation against
one with it."""
import copy
import gc

import pytest
import torch

from dspark.config import SamplingParams
from dspark.drafters.dspark.drafter import DSparkDrafter
from dspark.drafters.dspark.model import DSparkModel
from dspark.drafters.dspark.train import TrainConfig, capture, train_step_loss
from dspark_fixtures import SyntheticTarget, small_config
from test_dspark_model import reference_block_hidden

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("attention_type", ["gqa", "mla"])
def test_backbone_under_bf16_autocast_matches_the_float64_reference(attention_type):
    target = SyntheticTarget(seed=11)
    torch.manual_seed(11)
    model = DSparkModel(small_config(target, attention_type), *target.embedding_weights())
    ref = copy.deepcopy(model).double()
    gpu = model.cuda()
    gpu.autocast_dtype = torch.bfloat16
    B, A, S, G = 3, 5, 40, model.config.block_size
    tokens = torch.randint(0, target.vocab_size, (B, S))
    taps = {layer: torch.randn(B, S, target.hidden_size) for layer in model.config.target_layer_ids}
    anchors = torch.stack([torch.randperm(S - 1)[:A].sort().values for _ in range(B)])
    anchors[0, 0] = 0  # a block with no context row at all
    block = gpu.block_inputs(tokens.gather(1, anchors))
    positions = anchors[..., None] + torch.arange(G)
    with torch.no_grad():
        fused = gpu.fuse_taps({k: v.cuda() for k, v in taps.items()})
        rows = gpu.context_rows(fused, torch.arange(S, device="cuda").expand(B, S))
        visible = torch.arange(S) < anchors[..., None]
        hidden = gpu.backbone(block.cuda(), positions.cuda(), rows, visible.cuda()).float().cpu()
        fused64 = ref.fuse_taps({k: v.double() for k, v in taps.items()})
        errors = torch.stack([(hidden[b, a].double() - reference_block_hidden(ref, fused64[b], int(anchors[b, a]),
                                                                             block[b, a])).abs().max()
                              for b in range(B) for a in range(A)])
    # bf16 keeps 8 bits of mantissa: a unit-scale (final-normed) hidden is off by ~1e-2 after a
    # few bf16 projections; a wrong mask or a wrong block would be off by O(1).
    assert torch.isfinite(hidden).all()
    assert errors.max() < 0.1, errors.max()
    assert errors.mean() < 0.03, errors.mean()


@pytest.mark.parametrize("context", [37, 2048])
def test_latent_mla_attention_at_k3_width_matches_float64(context):
    """One MLA layer of K3's drafter (64 heads, hidden 7168, latent 512 + rope 64) in bf16 on the
    GPU, the drafting pass (latent attention, its scores a bf16 product with float32 output)
    against the expanded training pass in float64: within 1.5e-2 relative (bf16 operands; a dropped
    mask or a missing W_UV is off by O(1)). Outputs are poisoned first, never zero inputs."""
    import dataclasses

    from dspark.drafters.dspark.config import K3_DSPARK
    from dspark.drafters.dspark.model import MLAAttention

    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    c = dataclasses.replace(K3_DSPARK, num_layers=1).validate()
    attn64 = MLAAttention(c).double().cuda()
    for p in attn64.parameters():
        p.data.normal_(0, p.shape[-1] ** -0.5)
    attn = copy.deepcopy(attn64).to(torch.bfloat16)
    B, G = 2, c.block_size
    x = torch.randn(B, 1, G, c.hidden_size, dtype=torch.float64, device="cuda")
    positions = (torch.tensor([context, context // 2], device="cuda")[:, None, None] + torch.arange(G, device="cuda"))
    rows = attn64.kv_rows(torch.randn(B, context, c.hidden_size, dtype=torch.float64, device="cuda"),
                          torch.arange(context, device="cuda").expand(B, context))
    visible = (torch.arange(context, device="cuda") < torch.tensor([context, context // 2], device="cuda")[:, None])[:, None]
    with torch.no_grad():
        want = attn64(x, positions, rows, visible)
        got = torch.full_like(want, float("nan"))
        got.copy_(attn(x.bfloat16(), positions, rows.bfloat16(), visible, inference=True))
    assert torch.isfinite(got).all()
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 1.5e-2, rel


@pytest.mark.parametrize("world", [1, 16])
def test_a_drafting_pass_over_the_cache_at_k3_width_matches_float64(world):
    """One MLA layer of K3's drafter (all 64 heads, or a TP16 rank's 4) in bf16 drafting over its
    cache pool in place (the target's CuTe MLA kernels: the block's rows written past each
    length, 7 x H queries as heads of one token), against the expanded training pass in float64
    over gathered rows at 2k and 600 rows: within 1.5e-2 relative, and no implementation that
    reads lengths on the host (a draft graph could not capture it)."""
    import dataclasses

    from dspark.drafters.dspark.config import K3_DSPARK, rank_share
    from dspark.drafters.dspark.model import BlockPass, CachedContext, MLAAttention
    from dspark.kernels import registry

    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    c = dataclasses.replace(rank_share(K3_DSPARK, world), num_layers=1).validate()
    attn64 = MLAAttention(c).double().cuda()
    for p in attn64.parameters():
        p.data.normal_(0, p.shape[-1] ** -0.5)
    attn = copy.deepcopy(attn64).to(torch.bfloat16)
    G, dev = c.block_size, "cuda"
    slots, length = torch.tensor([1, 0], device=dev), torch.tensor([2048, 600], device=dev)
    pool64 = torch.randn(3, 2048 + G, attn.row_width, dtype=torch.float64, device=dev)
    rows = pool64[:, :2048].index_select(0, slots)
    visible = (torch.arange(2048, device=dev) < length[:, None])[:, None]
    x = torch.randn(2, 1, G, c.hidden_size, dtype=torch.float64, device=dev)
    positions = (length[:, None] + torch.arange(G, device=dev))[:, None]
    pool = pool64.bfloat16()
    with torch.no_grad():
        want = attn64(x, positions, rows, visible)
        shared = BlockPass(attn.rotary, positions, visible, G)
        with registry.record_selections() as chosen:
            got = attn(x.bfloat16(), positions, CachedContext(pool, slots, length, 2048), visible, inference=True,
                       shared=shared)
    assert not [s for s in chosen if s.blocks_capture], [str(s) for s in chosen]
    assert {s.op: s.chosen.name for s in chosen}["mla_verify_attention"].startswith("cute"), [str(s) for s in chosen]
    assert torch.isfinite(got).all()
    rel = ((got.double() - want).norm() / want.norm()).item()
    assert rel < 1.5e-2, rel


def test_a_step_without_recompute_equals_one_with_it():
    target = SyntheticTarget(seed=12)
    data = [torch.randint(0, target.vocab_size, (n,)) for n in (30, 41, 25)]
    torch.manual_seed(12)
    model = DSparkModel(small_config(target, "gqa"), *target.embedding_weights()).cuda()
    model.autocast_dtype = torch.bfloat16
    captured = capture(target, data, model.config.target_layer_ids)
    results = []
    for recompute in (True, False):
        model.zero_grad(set_to_none=True)
        cfg = TrainConfig(num_anchors=12, anchor_chunk=4, recompute=recompute)
        loss, _ = train_step_loss(model, captured, data, [torch.ones_like(s) for s in data], cfg,
                                  torch.Generator().manual_seed(5))
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss0, g0), (loss1, g1) = results
    # The loss is the same forward either way; the gradients differ only by the order of atomic
    # float32 accumulations (the attention's and the embedding's backward are not deterministic).
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=0)
    for name in g0:
        assert (g1[name] - g0[name]).norm() <= 1e-3 * g0[name].norm() + 1e-9, name
    assert any(g.abs().max() > 0 for g in g0.values())


def test_graphed_drafts_and_commits_equal_eager_ones():
    """The same float32 model behind an eager and a graphed drafter, through 20 rounds of batches
    of 1, 3 (bucket 4, padded) and 5 (bucket 8) requests whose contexts cross the 64 and 128 buckets:
    equal drafts, confidences to 1e-5, cache rows to 1e-5 (a padded bucket runs its GEMMs at other
    shapes) and equal lengths; a graphed propose does not synchronise."""
    target = SyntheticTarget(seed=13)
    torch.manual_seed(13)
    temps = (0.9, 1.1, 1.3, 1.0, 0.8, 1.5, 2.0)  # calibrated: the graph must not upload them
    model = DSparkModel(small_config(target, "gqa", confidence_temperatures=temps), *target.embedding_weights()).cuda()
    eager = DSparkDrafter(model, max_slots=8, max_seq_len=200)
    graphed = DSparkDrafter(model, max_slots=8, max_seq_len=200, cuda_graphs=True)
    d, T, greedy = target.hidden_size, 8, SamplingParams(temperature=0.0)
    g = torch.Generator().manual_seed(13)
    for slot in range(5):
        n = 50 if slot == 0 else int(torch.randint(60, 80, (), generator=g))  # slot 0 alone first: bucket 64
        prompt = torch.randint(0, target.vocab_size, (n,), generator=g)
        taps = {layer: torch.randn(n, d, generator=g).cuda() for layer in eager.tap_layers}
        for drafter in (eager, graphed):
            drafter.start(slot, prompt, taps)
    batches = [[0], [1, 2, 3], [4, 0, 2, 1, 3]]
    for round_ in range(20):
        slots = batches[round_ % 3]
        B = len(slots)
        anchors = torch.randint(0, target.vocab_size, (B,), generator=g).cuda()
        gens = [torch.Generator()] * B
        a = eager.propose(slots, anchors, 7, [greedy] * B, gens)
        b = graphed.propose(slots, anchors, 7, [greedy] * B, gens)
        assert torch.equal(a.tokens, b.tokens), round_
        torch.testing.assert_close(b.confidence_logits, a.confidence_logits, rtol=1e-5, atol=1e-5)
        index = next(d for d in graphed._graphs._drafts.values() if d.slots[:B] == tuple(slots)).index.tolist()
        assert len(set(index)) == len(index), index  # padding rows never share a batch row's slot
        kept = torch.randint(3, T + 1, (B,), generator=g).cuda()
        taps = {layer: torch.randn(B, T, d, generator=g).cuda() for layer in eager.tap_layers}
        tokens = torch.cat([anchors[:, None], a.tokens], dim=1)
        eager.commit(slots, tokens, kept, taps)
        graphed.commit(slots, tokens, kept, taps)
        assert graphed._lengths == eager._lengths == graphed._lengths_device.tolist()
        for x, y in zip(graphed._cache, eager._cache):
            torch.testing.assert_close(x[:, :200], y[:, :200], rtol=1e-5, atol=1e-5)
    assert max(eager._lengths) > 128
    assert graphed._graphs.replays == {"draft": 20, "commit": 20}
    assert {key[1] for key in graphed._graphs._drafts} >= {64, 128}
    assert {key[0] for key in graphed._graphs._commits} == {1, 4, 8}
    slots = [1, 2, 3]
    anchors = torch.randint(0, target.vocab_size, (3,), generator=g).cuda()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graphed.propose(slots, anchors, 7, [greedy] * 3, [torch.Generator()] * 3)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_an_engine_with_a_graphed_drafter_runs_the_steps_of_one_with_an_eager_drafter():
    """A float32 Llama target (random weights) on the GPU, three requests (bucket 4, then smaller
    as they end at different lengths): the graphed drafter drafts what the eager one drafts, so
    both engines run the same steps and emit the same tokens."""
    from types import SimpleNamespace

    from dspark.config import SpecConfig
    from dspark.engine import Engine
    from dspark.targets.llama import LlamaConfig, LlamaLayerWeights, LlamaTarget, LlamaWeights

    c = LlamaConfig(vocab_size=300, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=128,
                    rope_theta=10000.0, rms_norm_eps=1e-5, context_length=512, tie_word_embeddings=False,
                    bos_token_id=1, eos_token_id=2)
    g = torch.Generator().manual_seed(14)

    def r(*shape):
        return (torch.randn(*shape, generator=g) * 0.2).cuda()

    hd = c.hidden_size // c.num_heads
    layers = [LlamaLayerWeights(torch.ones(c.hidden_size, device="cuda"), r((c.num_heads + 2 * c.num_kv_heads) * hd, c.hidden_size),
                                r(c.hidden_size, c.num_heads * hd), torch.ones(c.hidden_size, device="cuda"),
                                r(2 * c.intermediate_size, c.hidden_size), r(c.hidden_size, c.intermediate_size))
              for _ in range(c.num_layers)]
    weights = LlamaWeights(r(c.vocab_size, c.hidden_size), layers, torch.ones(c.hidden_size, device="cuda"),
                           r(c.vocab_size, c.hidden_size))
    target = LlamaTarget(c, weights, max_slots=4, max_seq_len=256, attention="batched")
    shape = SimpleNamespace(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=c.num_layers, max_seq_len=256)
    torch.manual_seed(14)
    model = DSparkModel(small_config(shape, "gqa"), *target.embedding_weights()).cuda()
    prompts = [torch.randint(3, c.vocab_size, (n,), generator=g).tolist() for n in (30, 70, 45)]
    outs, steps = [], []
    for graphs in (False, True):
        drafter = DSparkDrafter(model, 4, max_seq_len=256, cuda_graphs=graphs)
        engine = Engine(target, drafter, SpecConfig(num_speculative_tokens=7))
        outs.append([o.token_ids for o in engine.generate(
            prompts, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (40, 25, 33)])])
        steps.append(engine.metrics.num_steps)
    assert outs[0] == outs[1] and [len(o) for o in outs[0]] == [40, 25, 33]
    assert steps[0] == steps[1], steps
    # The graphed drafter commits on the device inside the engine's step (eager here: the Llama
    # target is not captured), never through a commit graph of its own.
    assert drafter._graphs.replays == {"draft": steps[1], "commit": 0}


def test_a_graphed_drafter_on_a_graphed_target_launches_steps_ahead():
    """k3-slice on the GPU (every op on a kernel that a graph captures; k3-tiny's dims send KDA to
    its reference, which reads the slots on the host and so cannot be captured) with its step
    graphs and a graphed one-layer DSpark drafter at K3's width (random weights): the drafter
    commits on the device inside each step's graph and settles at the readback, so steps are
    launched ahead; the outputs equal those of the same engine reading every step back first
    (the same kernels on the same batches), greedy, three requests ending at different max_tokens."""
    from dspark.build import build_target
    from dspark.config import SpecConfig
    from dspark.drafters.dspark.config import preset_for_target
    from dspark.engine import Engine

    g = torch.Generator().manual_seed(15)
    runs = []
    for ahead in (False, True):
        target = build_target("k3-slice", max_slots=4, max_seq_len=96, device="cuda", seed=0)
        if not runs:
            prompts = [torch.randint(3, target.vocab_size, (n,), generator=g).tolist() for n in (9, 14, 6)]
            params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (30, 22, 26)]
        config = preset_for_target(target.hidden_size, target.vocab_size, target.num_layers, drafter_layers=1)
        torch.manual_seed(15)
        embed, lm_head = target.embedding_weights()
        model = DSparkModel(config, embed, lm_head).to(device="cuda", dtype=embed.dtype)
        drafter = DSparkDrafter(model, 4, max_seq_len=96, cuda_graphs=True)
        engine = Engine(target, drafter, SpecConfig(num_speculative_tokens=7), cuda_graphs=True, launch_ahead=ahead)
        outs = [o.token_ids for o in engine.generate(prompts, params)]
        runs.append((outs, engine.metrics.num_launched_ahead, dict(drafter._graphs.replays)))
        # A k3-slice is ~58 GB: the first must be gone before the second is built, and engines
        # and their graphs sit in reference cycles (tests/gpu/conftest.py).
        del engine, drafter, model, target
        gc.collect()
        torch.cuda.empty_cache()
    (want, none_ahead, _), (got, ahead, replays) = runs
    assert got == want and [len(o) for o in want] == [30, 22, 26]
    assert none_ahead == 0 and ahead >= 3, f"{ahead} steps launched ahead"
    # The drafter's commits ride in the engine's step graph: none replays a commit graph of its own.
    assert replays["draft"] > 0 and replays["commit"] == 0, replays


def test_a_dspark_drafter_built_for_a_cuda_target_replays_graphs_unless_told_not_to(tmp_path):
    """build_drafter on a CUDA target: graphed greedy drafting by default; eager when the batch-1
    profile turns graphs off, when asked, or when drafting samples (the graphs draft greedily)."""
    from dspark.build import build_drafter
    from dspark.config import Profile, SpecConfig
    from dspark.drafters.dspark import save_checkpoint

    target = SyntheticTarget(seed=4, max_slots=2, max_seq_len=64)
    save_checkpoint(DSparkModel(small_config(target), *target.embedding_weights()), tmp_path)
    # The drafter reads only the target's device, sizes and shared embeddings.
    target.device, target.embedding, target.lm_head = torch.device("cuda"), target.embedding.cuda(), target.lm_head.cuda()
    spec = dict(num_speculative_tokens=2, drafter="dspark", drafter_path=str(tmp_path))
    assert build_drafter(SpecConfig(**spec), target)._graphs is not None
    assert build_drafter(SpecConfig(**spec), target, cuda_graphs=False)._graphs is None
    assert build_drafter(SpecConfig(**spec, batch1_profile=Profile(cuda_graphs=False)), target)._graphs is None
    assert build_drafter(SpecConfig(**spec, draft_sample_method="probabilistic"), target)._graphs is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_drafters_rmsnorm_on_cuda_matches_float64(dtype):
    """RMSNorm takes torch's fused CUDA kernel when x and the weight share a dtype: fp32 statistics
    and scale, one rounding to x's dtype at the end, as the CPU ops compute. Against float64 within
    one rounding of the output (bf16: 2^-8 relative; fp32: 1e-5); a missing eps, weight or square
    root is off by far more."""
    from dspark.drafters.dspark.model import RMSNorm

    d = 7168
    norm = RMSNorm(d, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(d) * 0.5 + 1.0)
    x = torch.randn(13, d, dtype=torch.float64) * 3.0
    x[0] *= 1e-3  # a row small enough for eps to matter
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    gpu = norm.to(device="cuda", dtype=dtype)
    got = gpu(x.to(device="cuda", dtype=dtype)).double().cpu()
    # the input's own rounding to bf16 moves the result by up to the same again
    tol = 2 * 2.0**-8 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
