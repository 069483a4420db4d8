"""DSpark drafter model and Drafter wrapper (docs/dspark-algorithm.md §2-3, §11)."""
import copy
import math
import dataclasses

import pytest
import torch

from dspark.config import SamplingParams
from dspark.drafters.dspark.config import K3_DSPARK, DSparkConfig
from dspark.drafters.dspark.drafter import DSparkDrafter
from dspark.drafters.dspark.model import KEPT_AT_LOAD, DSparkModel
from dspark.protocols import Drafter
from dspark_fixtures import SyntheticTarget, one_thread, small_config  # noqa: F401 (autouse fixture)

ATTENTION = ["gqa", "mla"]


def make_model(target, attention_type="gqa", seed=0, **overrides):
    torch.manual_seed(seed)
    return DSparkModel(small_config(target, attention_type, **overrides), *target.embedding_weights())


def reference_block_hidden(model, fused, anchor, block_tokens):
    """One block, float64, written as plain attention over [context rows < anchor ; block rows]."""
    x = model.embed_tokens[block_tokens].double()
    positions = anchor + torch.arange(block_tokens.shape[0])
    for layer in model.layers:
        attn = layer.self_attn
        xn = layer.input_layernorm(x)
        rows = torch.cat([attn.kv_rows(fused[:anchor], torch.arange(anchor)), attn.kv_rows(xn, positions)])
        k, v = attn.keys_values(rows)
        q = attn.queries(xn, positions)
        probs = (torch.einsum("ghd,shd->hgs", q, k) * attn.scale).softmax(-1)
        x = x + attn.o_proj(torch.einsum("hgs,shd->ghd", probs, v).flatten(-2))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.final_norm(x)


@pytest.mark.parametrize("inference", [False, True])
@pytest.mark.parametrize("attention_type", ATTENTION)
def test_batched_blocks_match_per_block_float64_reference(attention_type, inference):
    """Both passes (training; drafting, where MLA attends in its latent space) against the
    expanded per-block float64 reference."""
    target = SyntheticTarget(seed=1)
    model = make_model(target, attention_type, seed=1)
    ref = copy.deepcopy(model).double()
    B, A, S, G = 2, 3, 20, model.config.block_size
    tokens = torch.randint(0, target.vocab_size, (B, S))
    taps = {layer: torch.randn(B, S, target.hidden_size) for layer in model.config.target_layer_ids}
    anchors = torch.stack([torch.randperm(S - 1)[:A].sort().values for _ in range(B)])
    anchors[0, 0] = 0  # an anchor with no context at all
    block = model.block_inputs(tokens.gather(1, anchors))
    positions = anchors[..., None] + torch.arange(G)
    with torch.no_grad():
        fused = model.fuse_taps(taps)
        rows = model.context_rows(fused, torch.arange(S).expand(B, S))
        visible = torch.arange(S) < anchors[..., None]
        hidden = model.backbone(block, positions, rows, visible, inference=inference)
        fused64 = ref.fuse_taps({k: v.double() for k, v in taps.items()})
        for b in range(B):
            for a in range(A):
                expected = reference_block_hidden(ref, fused64[b], int(anchors[b, a]), block[b, a])
                torch.testing.assert_close(hidden[b, a].double(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inference", [False, True])
@pytest.mark.parametrize("attention_type", ATTENTION)
def test_a_pass_sharing_its_rope_tables_and_mask_equals_layers_making_their_own(attention_type, inference, dtype):
    """backbone makes one BlockPass (RoPE tables, block mask) for every layer, and a drafting pass
    (inference) does each residual add in the norm after it and SwiGLU's product in its activation's op;
    each layer making its own tables from positions and visibility (shared=None), with the torch adds,
    norms and SwiGLU of DecoderLayer.forward, must give the same hidden bit for bit."""
    target = SyntheticTarget(seed=4)
    model = make_model(target, attention_type, seed=int(torch.randint(0, 2**31, ()))).to(dtype)
    with torch.no_grad():  # norms that scale: at their initial ones a norm's rounding order would not show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    B, A, S, G = 2, 3, 16, model.config.block_size
    taps = {layer: torch.randn(B, S, target.hidden_size, dtype=dtype) for layer in model.config.target_layer_ids}
    anchors = torch.stack([torch.randperm(S - 1)[:A].sort().values + 1 for _ in range(B)])
    block = model.block_inputs(torch.randint(0, target.vocab_size, (B, A)))
    positions = anchors[..., None] + torch.arange(G)
    visible = torch.arange(S) < anchors[..., None]
    with torch.no_grad():
        rows = model.context_rows(model.fuse_taps(taps), torch.arange(S).expand(B, S))
        x = model.embed_block(block)
        for layer, layer_rows in zip(model.layers, rows):
            x = layer(x, positions, layer_rows, visible, inference)
        own = model.final_norm(x)
        shared = model.backbone(block, positions, rows, visible, inference=inference)
    assert torch.equal(shared, own)


def tiny_k3_drafter():
    """(a K3-shaped tiny drafter with random weights, a function drafting one greedy block of it over a
    24-token context): the same context and anchor at every call."""
    from dspark.drafters.dspark.config import K3_TINY_DSPARK

    config = dataclasses.replace(K3_TINY_DSPARK, markov_rank=8).validate()
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    table = torch.randn(config.vocab_size, config.hidden_size, generator=gen)
    model = DSparkModel(config, table, table * 0.1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    prompt = torch.randint(0, config.vocab_size, (24,), generator=gen)
    taps = {layer: torch.randn(24, config.target_hidden_size, generator=gen) for layer in config.target_layer_ids}
    anchor, greedy = torch.tensor([7]), [SamplingParams(temperature=0.0)]

    def draft():
        drafter = DSparkDrafter(model, 1, max_seq_len=64)
        drafter.start(0, prompt, taps)
        return drafter.draft([0], anchor, greedy, [None])

    return model, draft


def test_paired_projections_keep_the_parameters_and_the_drafting_pass():
    """pair_projections lays gate|up and q_a|kv_a out in one storage each: the state dict (names, values)
    is unchanged, each pair reads as one weight, a drafting pass over the cache equals the unpaired one
    to fp32 rounding (one GEMM where there were two), and a .to() that moves the weights undoes the
    layout, the pass then taking two GEMMs again."""
    from dspark.drafters.dspark.model import _one_weight

    model, draft = tiny_k3_drafter()
    before = {k: v.clone() for k, v in model.state_dict().items()}

    layer = model.layers[0]
    assert _one_weight(layer.mlp.gate_proj, layer.mlp.up_proj) is None  # as built: two GEMMs
    want = draft()
    model.pair_projections()
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], v) for k, v in before.items())
    assert _one_weight(layer.mlp.gate_proj, layer.mlp.up_proj) is not None
    assert _one_weight(layer.self_attn.q_a_proj, layer.self_attn.kv_a_proj_with_mqa) is not None
    got = draft()
    assert torch.equal(got.tokens, want.tokens)
    torch.testing.assert_close(got.confidence_logits, want.confidence_logits, rtol=1e-5, atol=1e-5)
    model.double()
    assert _one_weight(layer.mlp.gate_proj, layer.mlp.up_proj) is None  # moved: two GEMMs again
    assert torch.equal(draft().tokens, want.tokens)


def test_a_drafting_pass_adds_its_output_projections_partials_in_the_norms(monkeypatch):
    """With the CPU among OUTPUTS_AS_PARTIALS_ON (a GPU's default), a drafting pass over the cache leaves
    MLA's o_proj and SwiGLU's down as split-K partials (ops.linear_partials, two a layer) and the norm
    after each adds them (ops.add_rms_norm): the same drafts as the pass with reduced outputs, and its
    confidence logits to fp32 rounding (the CPU's reference GEMM sums in another order than nn.Linear)."""
    from dspark.drafters.dspark import model as model_module
    from dspark.kernels import ops

    model, draft = tiny_k3_drafter()

    want = draft()
    partial_deltas = []
    real_norm = ops.add_rms_norm

    def spy(residual, delta, weight, eps):
        partial_deltas.append(delta.dim() == residual.dim() + 1)
        return real_norm(residual, delta, weight, eps)

    monkeypatch.setattr(model_module, "OUTPUTS_AS_PARTIALS_ON", ("cpu",))
    monkeypatch.setattr(ops, "add_rms_norm", spy)
    got = draft()
    assert partial_deltas == [True, True] * model.config.num_layers
    assert torch.equal(got.tokens, want.tokens)
    torch.testing.assert_close(got.confidence_logits, want.confidence_logits, rtol=1e-5, atol=1e-5)


def test_a_drafting_pass_adds_its_input_partials_in_their_consumers(monkeypatch):
    """With the CPU among INPUTS_AS_PARTIALS_ON, each layer's paired q_a | kv_a and gate | up GEMMs leave
    their split-K partials (ops.linear_partials), which the cache rows' launch and silu_mul add (their
    partials forms): the same drafts as the pass through the reduced GEMMs, and its confidence logits to
    fp32 rounding."""
    from dspark.drafters.dspark import model as model_module
    from dspark.kernels import ops

    model, draft = tiny_k3_drafter()
    model.pair_projections()  # as load_drafter lays them out on a GPU: one GEMM a pair
    want = draft()
    partial_inputs = []
    real_act, real_rows = ops.silu_mul, ops.mla_cache_rows

    def act_spy(gate, up, dtype=None):
        partial_inputs.append(("silu_mul", dtype is not None and gate.dim() == 5 and gate.dtype == torch.float32))
        return real_act(gate, up, dtype)

    def rows_spy(kv, *args, q=None, dtype=None):
        partial_inputs.append(("cache_rows", dtype is not None and kv.dim() == 3 and q[0].dim() == 3))
        return real_rows(kv, *args, q=q, dtype=dtype)

    monkeypatch.setattr(model_module, "INPUTS_AS_PARTIALS_ON", ("cpu",))
    monkeypatch.setattr(ops, "silu_mul", act_spy)
    monkeypatch.setattr(ops, "mla_cache_rows", rows_spy)
    got = draft()
    assert partial_inputs == [("cache_rows", True), ("silu_mul", True)] * model.config.num_layers
    assert torch.equal(got.tokens, want.tokens)
    torch.testing.assert_close(got.confidence_logits, want.confidence_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_mla_latent_attention_equals_the_expanded_one(dtype):
    """The drafting pass's latent MLA attention (W_UK folded into the queries, W_UV after the sum)
    is the training pass's function: in float64 to rounding (1e-12 relative; a reassociation, seen
    ~4e-16), in bf16 both within 1.5e-2 of the float64 result (bf16 operands and float32 scores in
    both; seen 5-6e-3 for each)."""
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    target = SyntheticTarget(seed=5)
    model = make_model(target, "mla", seed=5)
    attn = copy.deepcopy(model.layers[0].self_attn).double()
    B, A, S, G = 3, 2, 23, model.config.block_size
    x = torch.randn(B, A, G, model.config.hidden_size, dtype=torch.float64)
    positions = torch.randint(0, S, (B, A, 1)) + torch.arange(G)
    rows = attn.kv_rows(torch.randn(B, S, model.config.hidden_size, dtype=torch.float64), torch.arange(S).expand(B, S))
    visible = torch.arange(S) < torch.randint(0, S, (B, A, 1))  # some blocks see no context at all
    visible[0, 0] = False
    with torch.no_grad():
        want = attn(x, positions, rows, visible)
        low = copy.deepcopy(attn).to(dtype)
        got = low(x.to(dtype), positions, rows.to(dtype), visible, inference=True).double()
        expanded = low(x.to(dtype), positions, rows.to(dtype), visible).double()
    bound = 1e-12 if dtype == torch.float64 else 1.5e-2
    for out in (got, expanded):
        assert torch.isfinite(out).all()
        assert ((out - want).norm() / want.norm()).item() < bound
    with torch.no_grad():  # the comparison can fail: the latent path with the context mask dropped
        leaked = low(x.to(dtype), positions, rows.to(dtype), torch.ones_like(visible), inference=True).double()
    assert ((leaked - want).norm() / want.norm()).item() > 0.1  # seen 0.65-0.81


@pytest.mark.parametrize("attention_type", ATTENTION)
def test_context_strictly_before_anchor_and_block_is_bidirectional(attention_type):
    target = SyntheticTarget(seed=2)
    model = make_model(target, attention_type, seed=2)
    S, anchor, G = 16, 9, model.config.block_size
    fused = torch.randn(1, S, model.config.hidden_size)
    block = model.block_inputs(torch.tensor([[5]]))
    positions = (anchor + torch.arange(G)).view(1, 1, G)
    visible = (torch.arange(S) < anchor).view(1, 1, S)

    def run(f, blk):
        with torch.no_grad():
            return model.backbone(blk, positions, model.context_rows(f, torch.arange(S)[None]), visible)

    base = run(fused, block)
    later = fused.clone()
    later[:, anchor:] = torch.randn(1, S - anchor, model.config.hidden_size)
    torch.testing.assert_close(run(later, block), base, rtol=0, atol=0)  # rows >= anchor are invisible
    earlier = fused.clone()
    earlier[:, anchor - 1] += 1.0
    assert (run(earlier, block) - base).abs().max() > 1e-3  # the row just before the anchor is seen
    changed_tail = block.clone()
    changed_tail[..., -1] = 3
    assert (run(fused, changed_tail)[..., 0, :] - base[..., 0, :]).abs().max() > 1e-4  # slot 1 sees slot G


@pytest.mark.parametrize("kind", ["vanilla", "gated"])
def test_markov_and_confidence_heads_follow_the_formulas(kind):
    target = SyntheticTarget(seed=3)
    model = make_model(target, "gqa", seed=3, markov_head_type=kind).double()
    hidden = torch.randn(5, model.config.hidden_size, dtype=torch.float64)
    prev = torch.randint(0, target.vocab_size, (5,))
    logits, conf = model.head_outputs(hidden, prev)
    w1 = model.markov_head.markov_w1.weight[prev]
    if kind == "gated":
        gate_proj = model.markov_head.gate_proj
        w1 = torch.sigmoid(torch.cat([hidden, w1], -1) @ gate_proj.weight.t() + gate_proj.bias) * w1
    expected = hidden @ model.lm_head.double().t() + w1 @ model.markov_head.markov_w2.weight.t()
    torch.testing.assert_close(logits.double(), expected, rtol=1e-5, atol=1e-5)
    proj = model.confidence_head.proj
    expected_conf = torch.cat([hidden, model.markov_head.markov_w1.weight[prev]], -1) @ proj.weight[0] + proj.bias
    torch.testing.assert_close(conf.double(), expected_conf, rtol=1e-5, atol=1e-5)


def reference_processed(logits, temperature, top_k, top_p):
    z = logits.double() / temperature
    order = sorted(range(z.shape[0]), key=lambda i: -float(z[i]))
    keep = order[:top_k] if top_k else order
    probs = torch.softmax(z[keep], 0)
    kept, mass = [], 0.0
    for i, p in zip(keep, probs.tolist()):
        if kept and mass >= top_p:
            break
        kept.append(i)
        mass += p
    out = torch.zeros_like(z)
    out[kept] = torch.softmax(z[kept], 0)
    return out


def start_request(target, drafter, slot, prompt):
    out = target.prefill([slot], [prompt], drafter.tap_layers)
    drafter.start(slot, prompt, {layer: t[0] for layer, t in out.taps.items()})
    return out


@pytest.mark.parametrize("attention_type", ATTENTION)
def test_probabilistic_drafts_return_processed_markov_corrected_softmax(attention_type):
    target = SyntheticTarget(seed=4)
    model = make_model(target, attention_type, seed=4)
    drafter = DSparkDrafter(model, max_slots=4, max_seq_len=64, draft_sample_method="probabilistic")
    assert isinstance(drafter, Drafter)
    prompts = [torch.randint(0, 60, (n,)) for n in (12, 7, 9)]
    for slot, p in enumerate(prompts):
        start_request(target, drafter, slot, p)
    sampling = [SamplingParams(temperature=0.9, top_k=12), SamplingParams(temperature=0.0),
                SamplingParams(temperature=1.2, top_p=0.7)]
    anchors = torch.tensor([3, 17, 40])
    gens = [torch.Generator().manual_seed(10 + i) for i in range(3)]
    prop = drafter.propose([0, 1, 2], anchors, 7, sampling, gens)
    again = drafter.propose([0, 1, 2], anchors, 7, sampling, [torch.Generator().manual_seed(10 + i) for i in range(3)])
    assert torch.equal(prop.tokens, again.tokens)  # seeded requests are reproducible
    # Independent float64 recomputation of Z_k with the sampled previous tokens.
    ref = copy.deepcopy(model).double().requires_grad_(False)
    for r, (prompt, params) in enumerate(zip(prompts, sampling)):
        taps = target.forward(prompt)[1]
        fused = ref.fuse_taps({k: v.double() for k, v in taps.items()})
        hidden = reference_block_hidden(ref, fused, prompt.shape[0], ref.block_inputs(anchors[r]))
        prev = torch.cat([anchors[r : r + 1], prop.tokens[r, :-1]])
        logits, conf = ref.head_outputs(hidden, prev)
        torch.testing.assert_close(prop.confidence[r].double(), torch.sigmoid(conf), rtol=1e-4, atol=1e-5)
        for k in range(7):
            if params.greedy:
                expected = torch.nn.functional.one_hot(logits[k].argmax(), target.vocab_size).double()
            else:
                expected = reference_processed(logits[k], params.temperature, params.top_k, params.top_p)
            torch.testing.assert_close(prop.probs[r, k].double(), expected, rtol=1e-4, atol=1e-5)
            assert prop.probs[r, k, prop.tokens[r, k]] > 0  # the draft lies in the support of q


@pytest.mark.parametrize("attention_type", ATTENTION)
def test_commit_keeps_only_accepted_rows_like_a_fresh_start(attention_type):
    """Incremental cache after commits with rejections == a fresh start on the committed text."""
    target = SyntheticTarget(seed=5)
    model = make_model(target, attention_type, seed=5)
    drafter = DSparkDrafter(model, max_slots=2, max_seq_len=64)
    prompt = torch.randint(0, 60, (10,))
    start_request(target, drafter, 0, prompt)
    committed = prompt.clone()
    anchor = torch.tensor([7])
    greedy = [SamplingParams(temperature=0.0)]
    for kept in (3, 1, 8, 5):  # anchor + accepted drafts kept in each round
        prop = drafter.propose([0], anchor, 7, greedy, [torch.Generator()])
        verify_tokens = torch.cat([anchor, prop.tokens[0]])[None]
        out = target.verify([0], verify_tokens, torch.tensor([8]), drafter.tap_layers)
        target.commit([0], torch.tensor([kept]))
        drafter.commit([0], verify_tokens, torch.tensor([kept]), out.taps)
        committed = torch.cat([committed, verify_tokens[0, :kept]])
        anchor = torch.randint(0, 60, (1,))
    assert drafter.context_length(0) == committed.shape[0]
    fresh = DSparkDrafter(model, max_slots=2, max_seq_len=64)
    start_request(SyntheticTarget(seed=5), fresh, 1, committed)
    for a, b in zip(drafter.context_rows(0), fresh.context_rows(1)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    p1 = drafter.propose([0], anchor, 7, greedy, [torch.Generator()])
    p2 = fresh.propose([1], anchor, 7, greedy, [torch.Generator()])
    assert torch.equal(p1.tokens, p2.tokens)
    drafter.crop(0, prompt.shape[0])
    assert drafter.context_length(0) == prompt.shape[0]
    drafter.release([0])
    with pytest.raises(ValueError, match="slot=0"):
        drafter.propose([0], anchor, 7, greedy, [torch.Generator()])


def test_bad_input_names_the_field():
    target = SyntheticTarget(seed=6)
    with pytest.raises(ValueError, match="target_layer_ids"):
        small_config(target, target_layer_ids=(0, target.num_layers - 1))  # the last layer is not tappable
    with pytest.raises(ValueError, match="markov_head_type"):
        small_config(target, markov_head_type="rnn")
    drafter = DSparkDrafter(make_model(target), max_slots=1, max_seq_len=16)
    with pytest.raises(ValueError, match="k=8"):
        drafter.propose([], torch.tensor([], dtype=torch.long), 8, [], [])
    with pytest.raises(ValueError, match=r"missing target layers \[2\]"):
        drafter.start(0, torch.tensor([1, 2]), {0: torch.randn(2, target.hidden_size)})
    with pytest.raises(ValueError, match="context of 17 tokens exceeds max_seq_len=16"):
        drafter.start(0, torch.zeros(17, dtype=torch.long), {layer: torch.randn(17, target.hidden_size) for layer in (0, 2)})


def test_loading_target_layers_checks_every_tensor_and_keeps_the_qk_norms():
    target = SyntheticTarget(seed=7)
    model = make_model(target)
    layers = [{name: torch.randn_like(p) for name, p in layer.named_parameters() if name not in KEPT_AT_LOAD}
              for layer in model.layers]
    model.load_decoder_layers(layers)
    for layer, given in zip(model.layers, layers):
        assert all(torch.equal(dict(layer.named_parameters())[name], t) for name, t in given.items())
        assert torch.equal(layer.self_attn.q_norm.weight, torch.ones_like(layer.self_attn.q_norm.weight))
    with pytest.raises(ValueError, match="layers: 1 given for a drafter of 2 layers"):
        model.load_decoder_layers(layers[:1])
    with pytest.raises(ValueError, match=r"layers\[1\]: missing 'mlp.up_proj.weight'"):
        model.load_decoder_layers([layers[0], {k: v for k, v in layers[1].items() if k != "mlp.up_proj.weight"}])
    with pytest.raises(ValueError, match=r"layers\[0\].self_attn.q_proj.weight: shape \(3, 4\)"):
        model.load_decoder_layers([{**layers[0], "self_attn.q_proj.weight": torch.randn(3, 4)}, layers[1]])
    with pytest.raises(ValueError, match="'self_attn.k_norm.weight' is not a loadable parameter"):
        model.load_decoder_layers([{**layers[0], "self_attn.k_norm.weight": torch.randn(16)}, layers[1]])
    with pytest.raises(ValueError, match="attention_type='mla'"):
        make_model(target, "mla").load_decoder_layers(layers)


def test_k3_dspark_preset_has_the_published_parameter_count():
    """5 MLA layers at K3 dims: 2,387,907,841 drafter-owned parameters (4,775,815,682 bf16 bytes)
    plus the 163840 x 7168 embedding copy = 3.562B, as published (docs/kimi-k3.md §4)."""
    c = K3_DSPARK
    assert (c.hidden_size, c.num_layers, c.num_heads, c.intermediate_size, c.block_size) == (7168, 5, 64, 14336, 7)
    assert c.target_layer_ids == (2, 23, 47, 71, 89) and c.mask_token_id == 163837 and c.markov_rank == 256
    with torch.device("meta"):
        embed = torch.empty(c.vocab_size, c.hidden_size)
        model = DSparkModel(c, embed, embed)
    owned = model.state_dict()
    assert len(owned) + 1 == 68  # + the embedding copy in the published file
    assert sum(t.numel() for t in owned.values()) == 2_387_907_841
    assert tuple(owned["layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape) == (576, 7168)
    assert tuple(owned["context_proj.weight"].shape) == (7168, 5 * 7168)
    assert tuple(owned["confidence_head.proj.weight"].shape) == (1, 7168 + 256)
    with pytest.raises(ValueError, match="mask_token_id"):
        dataclasses.replace(c, mask_token_id=c.vocab_size + 1).validate()
    assert DSparkConfig.from_json_dict(c.to_json_dict()) == c


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_scores_depend_only_on_relative_position(interleaved):
    from dspark.drafters.dspark.model import Rotary

    rot = Rotary(16, 50000.0, interleaved, None)
    q, k = torch.randn(1, 16, dtype=torch.float64), torch.randn(1, 16, dtype=torch.float64)

    def score(m, n):
        return float((rot(q.float(), torch.tensor(m)) * rot(k.float(), torch.tensor(n))).sum())

    assert score(5, 2) == pytest.approx(score(105, 102), rel=1e-4, abs=1e-4)
    assert abs(score(5, 2) - score(5, 4)) > 1e-3
    assert float(rot(q.float(), torch.tensor(37)).norm()) == pytest.approx(float(q.norm()), rel=1e-5)


def test_yarn_frequencies_and_scales():
    """DeepSeek YaRN (docs/kimi-k3.md §4: factor 32 over 32768): the fastest dims keep their
    frequency, the slowest are divided by the factor; mscale_all_dim=1 gives a softmax scale of
    (0.1 ln 32 + 1)^2 and unit cos/sin scale."""
    from dspark.drafters.dspark.model import Rotary

    scaling = K3_DSPARK.rope_scaling
    rot = Rotary(64, 50000.0, True, scaling)
    original = 1.0 / 50000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    ratio = original / rot.inv_freq.double()
    assert ratio[0] == pytest.approx(1.0) and ratio[-1] == pytest.approx(32.0, rel=1e-5)
    assert bool((ratio[1:] >= ratio[:-1] * (1 - 1e-6)).all())  # monotone blend between the two (float32 rounding)
    assert rot.attention_scale == pytest.approx((0.1 * math.log(32.0) + 1.0) ** 2)
    assert rot.cos_sin_scale == pytest.approx(1.0)


def test_dedicated_mask_id_is_an_extra_embedding_row_that_is_never_drafted():
    """mask_token_id = vocab_size: block mask slots read one extra frozen row (the mean of the
    target's rows), no real token's row; the drafts and q cover the real vocabulary only."""
    target = SyntheticTarget(seed=7)
    V = target.vocab_size
    model = make_model(target, "gqa", seed=7, mask_token_id=V)
    assert "mask_embedding" not in model.state_dict()  # derived from the target, never saved
    torch.testing.assert_close(model.mask_embedding.double(), target.embedding.double().mean(0), rtol=1e-6, atol=1e-6)
    anchors = torch.randint(0, V, (2, 3))
    block = model.block_inputs(anchors)
    assert bool((block[..., 1:] == V).all()) and torch.equal(block[..., 0], anchors)
    extended = torch.cat([target.embedding, model.mask_embedding[None]])
    torch.testing.assert_close(model.embed_block(block), extended[block], rtol=0, atol=0)

    drafter = DSparkDrafter(model, max_slots=2, max_seq_len=64, draft_sample_method="probabilistic")
    prompt = torch.randint(0, V, (11,))
    start_request(target, drafter, 0, prompt)
    # Flat logits at a high temperature: any token is drafted sometime, the mask id never is.
    sampling = [SamplingParams(temperature=50.0)]
    seen = torch.cat([drafter.propose([0], torch.randint(0, V, (1,)), 7, sampling,
                                      [torch.Generator().manual_seed(s)]).tokens for s in range(30)]).flatten()
    prop = drafter.propose([0], torch.tensor([3]), 7, sampling, [torch.Generator().manual_seed(0)])
    assert prop.probs.shape[-1] == V and bool((seen < V).all()) and len(set(seen.tolist())) > V // 2
    # The mask row matters: another extra row gives other drafts' distributions.
    model.mask_embedding = model.mask_embedding + 1.0
    other = drafter.propose([0], torch.tensor([3]), 7, sampling, [torch.Generator().manual_seed(0)])
    assert (other.probs - prop.probs).abs().max() > 1e-4


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-5), (torch.float32, 1e-4)])
def test_a_drafting_pass_over_the_cache_in_place_equals_the_expanded_attention(dtype, tol):
    """MLAAttention through the target's MLA ops over the drafter's cache pool (CachedContext:
    the block's rows written past each slot's length, G x H queries as heads of one token) against
    the expanded training pass over gathered rows: ragged lengths, one of them 0, slots out of
    order; rows before each length untouched. Relative error within `tol` (the RoPE tables are
    float32 in either pass)."""
    from dspark.drafters.dspark.config import K3_TINY_DSPARK
    from dspark.drafters.dspark.model import BlockPass, CachedContext, MLAAttention

    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    c = K3_TINY_DSPARK
    attn = MLAAttention(c).to(dtype)
    for p in attn.parameters():
        p.data.normal_(0, p.shape[-1] ** -0.5)
    G, slots, length, room = c.block_size, torch.tensor([2, 0, 3]), torch.tensor([9, 0, 20]), 24
    pool = torch.randn(4, room + G, attn.row_width, dtype=dtype)
    context = int(length.max())
    rows = pool[:, :context].index_select(0, slots).clone()
    visible = (torch.arange(context) < length[:, None])[:, None]
    x = torch.randn(3, 1, G, c.hidden_size, dtype=dtype)
    positions = (length[:, None] + torch.arange(G))[:, None]
    before = pool.clone()
    with torch.no_grad():
        want = attn(x, positions, rows, visible)
        shared = BlockPass(attn.rotary, positions, visible, G)
        got = attn(x, positions, CachedContext(pool, slots, length, context), visible, inference=True, shared=shared)
    assert ((got - want).norm() / want.norm()).item() < tol
    for s, n in zip(slots.tolist(), length.tolist()):
        assert torch.equal(pool[s, :n], before[s, :n])
        assert not torch.equal(pool[s, n : n + G], before[s, n : n + G])  # the block's rows went here


@pytest.mark.parametrize("attention_type", ATTENTION)
@pytest.mark.parametrize("dedicated_mask", [False, True])
def test_a_drafts_setup_read_from_its_constants_is_the_backbones_pass_bit_for_bit(attention_type, dedicated_mask):
    """DSparkModel.draft_backbone, whose setup reads the drafter's DraftConstants (the RoPE rows gathered
    from a table, the block embedded from the anchors' rows and the mask token's, the context mask made
    only if a layer asks), against backbone(block_inputs(anchors)) over the same cache, bit for bit."""
    from dspark.drafters.dspark.model import CachedContext

    target = SyntheticTarget(seed=int(torch.randint(0, 1000, ())))
    V, G = target.vocab_size, small_config(target, attention_type).block_size
    model = make_model(target, attention_type, seed=5, **({"mask_token_id": V} if dedicated_mask else {}))
    drafter = DSparkDrafter(model, max_slots=3, max_seq_len=64)
    for slot, n in ((0, 9), (2, 17)):
        start_request(target, drafter, slot, torch.randint(0, V, (n,)))
    index, anchors, context = torch.tensor([2, 0]), torch.randint(0, V, (2,)), 17
    lengths = drafter._lengths_device.index_select(0, index)
    rows = [CachedContext(cache, index, lengths, context) for cache in drafter._cache]
    with torch.no_grad():
        got = model.draft_backbone(anchors, rows, drafter._constants, lengths, context)
        visible = (torch.arange(context) < lengths[:, None]).unsqueeze(1)
        positions = (lengths[:, None] + torch.arange(G)).unsqueeze(1)
        want = model.backbone(model.block_inputs(anchors).unsqueeze(1), positions, rows, visible, inference=True)[:, 0]
    assert got.shape == want.shape and torch.equal(got, want)


def test_a_position_tables_rows_are_the_rotary_tables_bit_for_bit():
    """Rotary.table_rows of a position_table against Rotary.tables at the same (YaRN-scaled) positions."""
    from dspark.drafters.dspark.model import Rotary

    scaling = {"factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
               "mscale": 1.0, "mscale_all_dim": 1.0}
    rot = Rotary(64, 50000.0, True, scaling)
    table = rot.position_table(9000, torch.device("cpu"))
    assert table.shape == (2, 9000, 32) and table.dtype == torch.float32
    for B, G in ((1, 7), (3, 5), (4, 16)):
        positions = (torch.randint(0, 9000 - G, (B, 1)) + torch.arange(G)).unsqueeze(1)  # [B, 1, G]
        got, want = Rotary.table_rows(table, positions), rot.tables(positions)
        assert all(g.shape == w.shape and g.is_contiguous() and torch.equal(g, w) for g, w in zip(got, want))


def test_a_drafters_graph_buckets_are_checked_by_name():
    """DSparkDrafter(graph_buckets=...): the batch sizes its draft and commit graphs are captured for,
    refused by name when malformed, on any device (graphs need CUDA; the buckets are checked anyway)."""
    target = SyntheticTarget(seed=2)
    model = make_model(target, "mla", seed=2)
    DSparkDrafter(model, max_slots=4, max_seq_len=32, graph_buckets=(1, 4, 16))
    with pytest.raises(ValueError, match=r"DSparkDrafter.graph_buckets=\(0, 2\): must be a non-empty tuple"):
        DSparkDrafter(model, max_slots=4, max_seq_len=32, graph_buckets=(0, 2))
