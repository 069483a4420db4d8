"""The faster DSpark training path (issue 33): the heads' DeepSpec start, the warmup-stable-decay
schedule, the vocabulary-wide seam, the supervised-rows step, block-sparse (FlexAttention)
attention and the capture store, each against the reference it replaces."""
import dataclasses
import math
import time

import pytest
import torch

from dspark.drafters.dspark import DSparkModel
from dspark.drafters.dspark import flex
from dspark.drafters.dspark.capture import CaptureStore, capture
from dspark.drafters.dspark.loss import metrics_to_floats, row_sums, slot_sums
from dspark.drafters.dspark.model import _block_mask
from dspark.drafters.dspark.steps import blocks_forward, make_batch
from dspark.drafters.dspark.train import (
    TrainConfig,
    Trainer,
    capture_layers,
    compiled_blocks_forward,
    lr_area,
    lr_factor,
    train,
    train_step_loss,
)
from dspark.targets.llama import LlamaConfig, LlamaLayerWeights, LlamaTarget, LlamaWeights
from dspark_fixtures import SyntheticTarget, one_thread, small_config  # noqa: F401 (autouse fixture)

SEED = int(torch.randint(0, 2**31 - 1, ()))  # fresh inputs every run (pytest prints it with a failure)


TINY = LlamaConfig(vocab_size=61, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=48,
                   rope_theta=10000.0, rms_norm_eps=1e-5, context_length=256, tie_word_embeddings=True)


def tiny_llama(seed: int, max_slots: int = 4, config: LlamaConfig = TINY, max_seq_len: int = 128) -> LlamaTarget:
    """A random Llama (4 layers of width 32 unless `config` says otherwise) whose logits are its LM head
    over its final-normed hidden state (as SmolLM2's), tied embeddings; weights large enough that its
    distributions are not flat."""
    c = config
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g) / shape[-1] ** 0.5  # noqa: E731
    hd = c.head_dim
    layers = [LlamaLayerWeights(1 + 0.1 * torch.randn(c.hidden_size, generator=g),
                                r((c.num_heads + 2 * c.num_kv_heads) * hd, c.hidden_size), r(c.hidden_size, c.num_heads * hd),
                                1 + 0.1 * torch.randn(c.hidden_size, generator=g), r(2 * c.intermediate_size, c.hidden_size),
                                r(c.hidden_size, c.intermediate_size)) for _ in range(c.num_layers)]
    embedding = 0.4 * torch.randn(c.vocab_size, c.hidden_size, generator=g)  # logits of std ~2: neither flat nor one-hot
    return LlamaTarget(c, LlamaWeights(embedding, layers, torch.ones(c.hidden_size), embedding), max_slots=max_slots,
                       max_seq_len=max_seq_len, attention="batched")


def llama_drafter(target, **overrides) -> DSparkModel:
    torch.manual_seed(SEED % 1000)
    config = small_config(target, "gqa", target_layer_ids=(0, 2), mask_token_id=target.vocab_size, markov_rank=16,
                          head_dim=8, **overrides)
    return DSparkModel(config, *target.embedding_weights())


def data(target, n: int, seed: int, lengths=(9, 40)) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Random sequences, each with a prompt of a few tokens outside the loss mask."""
    g = torch.Generator().manual_seed(seed)
    seqs, masks = [], []
    for _ in range(n):
        length = int(torch.randint(*lengths, (), generator=g))
        prompt = int(torch.randint(1, 5, (), generator=g))
        seqs.append(torch.randint(0, target.vocab_size, (length,), generator=g))
        masks.append(torch.cat([torch.zeros(prompt, dtype=torch.long), torch.ones(length - prompt, dtype=torch.long)]))
    return seqs, masks


# ---- the heads' start ---------------------------------------------------------------------------
def test_heads_start_as_deepspec_does():
    target = SyntheticTarget(vocab_size=512, seed=SEED % 97)
    model = DSparkModel(small_config(target, "gqa", markov_rank=64, markov_head_type="gated"), *target.embedding_weights())
    w1 = model.markov_head.markov_w1.weight
    assert 0.9 < float(w1.detach().std()) < 1.1  # torch's nn.Embedding default, N(0, 1): what the recipe used to train from
    layers_before = {k: v.clone() for k, v in model.layers.state_dict().items()}
    model.init_heads_like_deepspec()
    heads = model.markov_head, model.confidence_head
    weights = [m.weight for h in heads for m in h.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))]
    assert len(weights) == 4  # W1, W2, the gate and the confidence projection
    for w in weights:
        # N(0, 0.02): the sample std of >= 64 draws is within 25% of 0.02 with overwhelming odds.
        assert abs(float(w.detach().std()) / 0.02 - 1) < 0.25 and abs(float(w.detach().mean())) < 0.01, w.shape
    biases = [m.bias for h in heads for m in h.modules() if isinstance(m, torch.nn.Linear) and m.bias is not None]
    assert len(biases) == 2 and all(torch.equal(b, torch.zeros_like(b)) for b in biases)
    for key, value in model.layers.state_dict().items():  # only the heads change
        assert torch.equal(value, layers_before[key]), key


# ---- the schedule -------------------------------------------------------------------------------
def test_wsd_warms_up_holds_the_peak_and_decays_linearly_over_its_last_share():
    cfg = TrainConfig(steps=200, warmup_frac=0.05, schedule="wsd", decay_frac=0.15)
    factors = [lr_factor(s, cfg) for s in range(cfg.steps)]
    assert factors[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])  # 5% of 200 steps of warm-up
    assert factors[10:170] == [1.0] * 160  # the peak until the last 30 steps (15%)
    assert factors[170:] == pytest.approx([(200 - s) / 30 for s in range(170, 200)])  # linear to 0
    assert lr_area(200, cfg) == pytest.approx(cfg.lr * (5.5 + 160 + sum((200 - s) / 30 for s in range(170, 200))))
    # cosine keeps its shape: warm-up then half a cosine from the peak to 0
    cos = TrainConfig(steps=200, warmup_frac=0.05)
    assert [lr_factor(s, cos) for s in (9, 10, 105, 199)] == pytest.approx(
        [1.0, 1.0, 0.5 * (1 + math.cos(math.pi * 95 / 190)), 0.5 * (1 + math.cos(math.pi * 189 / 190))])
    assert lr_factor(199, TrainConfig(steps=200, schedule="wsd", decay_frac=0.0)) == 1.0  # a leg that others continue
    with pytest.raises(ValueError, match="TrainConfig.schedule='linear'"):
        TrainConfig(schedule="linear").validate()
    with pytest.raises(ValueError, match=r"TrainConfig.decay_frac=1.0: must be in \[0, 1\)"):
        TrainConfig(schedule="wsd", decay_frac=1.0).validate()


def test_row_sums_equal_slot_sums_over_the_same_slots():
    g = torch.Generator().manual_seed(SEED)
    B, A, G = 3, 5, 7
    ce, l1, conf = torch.rand(B, A, G, generator=g) * 3, torch.rand(B, A, G, generator=g) * 2, torch.randn(B, A, G, generator=g)
    lengths = torch.randint(0, G + 1, (B, A), generator=g)  # a supervised prefix per block, some empty
    mask = torch.arange(G) < lengths[..., None]
    cfg = TrainConfig()
    dense = slot_sums(ce, l1, conf, mask, cfg)
    sel = mask.flatten().nonzero().squeeze(1)
    rows = row_sums(ce.flatten()[sel], l1.flatten()[sel], conf.flatten()[sel], sel % G, sel // G, B * A, G, cfg)
    for key in dense:
        torch.testing.assert_close(rows[key], dense[key], rtol=1e-6, atol=1e-6, msg=key)
    assert float(dense["blocks"]) == int((lengths > 0).sum()) and float(dense["tau"]) > float(dense["blocks"])


# ---- the fast step against the reference ---------------------------------------------------------
def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def reference_and_fast_steps(model, captured, seqs, masks, **loss):
    """{"reference": ..., "fast": ...}: (loss, metrics read back, gradients) of one batch through the
    reference step (anchor chunks of 4) and the fast step (buckets padding anchors and length), with
    TrainConfig's `loss` options (weights) in both."""
    results = {}
    for name, cfg in (("reference", TrainConfig(num_anchors=9, anchor_chunk=4, **loss)),
                      ("fast", TrainConfig(num_anchors=9, fast=True, anchor_bucket=8, length_bucket=16, **loss))):
        model.zero_grad(set_to_none=True)
        step_loss, metrics = train_step_loss(model, captured, seqs, masks, cfg, torch.Generator().manual_seed(SEED))
        step_loss.backward()
        floats = metrics_to_floats(metrics)
        # accept unrounded: metrics_to_floats rounds it to 4 places, where two rates 1e-7 apart
        # (float32 summation order) can read 1e-4 apart.
        floats["accept"] = metrics["accept"].tolist()
        results[name] = (step_loss.detach(), floats, grads(model))
    return results


@pytest.mark.parametrize("attention_type,markov", [("gqa", "vanilla"), ("mla", "gated")])
def test_fast_step_equals_the_reference_step(attention_type, markov):
    """All anchors at once, supervised rows only, the seam (vanilla) or the gated head's path,
    teacher rows only where read, buckets padding anchors and length: the reference's loss,
    metrics and gradients up to float32 summation order."""
    target = SyntheticTarget(seed=SEED % 89)
    seqs, masks = data(target, 4, SEED % 1013)
    captured = capture(target, seqs, (0, 2))
    torch.manual_seed(SEED % 101)
    model = DSparkModel(small_config(target, attention_type, markov_head_type=markov), *target.embedding_weights())
    results = reference_and_fast_steps(model, captured, seqs, masks)
    (loss0, m0, g0), (loss1, m1, g1) = results["reference"], results["fast"]
    torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=1e-6)
    for key in ("ce", "l1", "conf", "tau"):
        assert m1[key] == pytest.approx(m0[key], rel=1e-5), key
    assert m1["accept"] == pytest.approx(m0["accept"], abs=1e-5)
    assert set(g1) == set(g0) and any(g.abs().max() > 0 for g in g0.values())
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-6, msg=name)


def test_the_ablations_cross_entropy_step_skips_the_teacher_and_the_zero_markov_columns(monkeypatch):
    """The DFlash ablation (a frozen all-zero W2, cross-entropy alone): the fast step calls the head
    with no teacher and without the Markov columns (r = 0), and still gives the reference step's loss
    and gradients; the terms it did not compute read back as None, not as numbers."""
    from dspark.drafters.dspark import steps

    target = SyntheticTarget(seed=SEED % 89)
    seqs, masks = data(target, 4, SEED % 1013)
    captured = capture(target, seqs, (0, 2))
    torch.manual_seed(SEED % 101)
    model = DSparkModel(small_config(target, "gqa"), *target.embedding_weights())
    with torch.no_grad():
        model.markov_head.markov_w2.weight.zero_()
    for name, param in model.named_parameters():
        if name.startswith(("markov_head.", "confidence_head.")):
            param.requires_grad_(False)
    calls = []
    real_op = steps.ops.draft_head_loss

    def spy(hidden, prev_embedding, lm_head, markov_w2, target_probs, rows, labels, **options):
        calls.append((prev_embedding.shape[1], markov_w2.shape[1], target_probs, rows))
        return real_op(hidden, prev_embedding, lm_head, markov_w2, target_probs, rows, labels, **options)

    monkeypatch.setattr(steps.ops, "draft_head_loss", spy)
    ablation = dict(ce_weight=1.0, l1_weight=0.0, conf_weight=0.0)
    results = reference_and_fast_steps(model, captured, seqs, masks, **ablation)
    assert calls == [(0, 0, None, None)]
    (loss0, m0, g0), (loss1, m1, g1) = results["reference"], results["fast"]
    torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=1e-6)
    assert m1["ce"] == pytest.approx(m0["ce"], rel=1e-5)
    assert m0["l1"] is not None and m1["l1"] is None and m1["conf"] is None and m1["tau"] is None
    assert set(g1) == set(g0) and not any(n.startswith("markov_head.") for n in g1)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-6, msg=name)
    # A W2 written in place is read again: its bias is no longer zero, so the head gets its columns.
    with torch.no_grad():
        model.markov_head.markov_w2.weight[0, 0] = 1.0
    train_step_loss(model, captured, seqs, masks, TrainConfig(**ablation, num_anchors=9, fast=True), torch.Generator().manual_seed(SEED))
    assert calls[-1][:2] == (model.config.markov_rank,) * 2


def test_a_config_with_every_loss_weight_zero_is_refused():
    with pytest.raises(ValueError, match="ce_weight, l1_weight, conf_weight: all 0"):
        TrainConfig(ce_weight=0.0, l1_weight=0.0, conf_weight=0.0).validate()


def test_the_fast_step_checks_its_labels_on_the_host():
    """The loss op is told its indices are checked (no read back from the device): the step checks the
    labels against the LM head's vocabulary itself, before copying them, and names them."""
    target = SyntheticTarget(seed=SEED % 89)
    seqs, masks = data(target, 3, SEED % 1013)
    captured = capture(target, seqs, (0, 2))
    torch.manual_seed(SEED % 101)
    model = DSparkModel(small_config(target, "gqa"), *target.embedding_weights())
    cfg = TrainConfig(num_anchors=9, fast=True)
    bad = [s.clone() for s in seqs]
    bad[1][masks[1].bool()] = target.vocab_size  # every supervised token of one sequence past the vocabulary
    with pytest.raises(ValueError, match=rf"batch: labels .* must lie in \[0, {target.vocab_size}\), got values in "
                                         rf"\[\d+, {target.vocab_size}\]"):
        train_step_loss(model, captured, bad, masks, cfg, torch.Generator().manual_seed(SEED))


def test_the_compiled_pass_equals_the_eager_one_and_one_shape_compiles_once(monkeypatch):
    """The trainer's torch.compile of the blocks' pass, traced by dynamo and AOTAutograd (the aot_eager
    backend: the graphs inductor would compile, run by eager kernels, as the CPU has no compiler to
    spare), gives the eager step's loss and gradients; two more batches of the same bucketed shape
    (other anchors and lengths) run on the same graphs."""
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, backend="aot_eager", **kw))
    target = SyntheticTarget(seed=SEED % 73)
    torch.manual_seed(SEED % 71)
    model = DSparkModel(small_config(target, "gqa"), *target.embedding_weights())
    cfg = TrainConfig(num_anchors=16, fast=True, anchor_bucket=16, length_bucket=64, compile=True)
    seqs, masks = data(target, 3, SEED % 997, lengths=(40, 60))
    trainer = Trainer(model, seqs, masks, cfg)
    torch._dynamo.reset()
    results = []
    for forward in (None, trainer.forward):
        model.zero_grad(set_to_none=True)
        captured = capture(target, seqs, (0, 2))
        loss, _ = train_step_loss(model, captured, seqs, masks, cfg, torch.Generator().manual_seed(SEED), forward=forward)
        loss.backward()
        results.append((loss.detach(), grads(model)))
    (loss0, g0), (loss1, g1) = results
    torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=1e-6)
    for name in g0:  # the same float32 ops, regrouped by the traced graph: ~1e-6
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-6, msg=name)
    with torch.compiler.set_stance("fail_on_recompile"):
        for seed in (1, 2):  # 40-59 tokens: padded to 64, 16 anchor slots each
            other, other_masks = data(target, 3, SEED % 991 + seed, lengths=(40, 60))
            loss, _ = train_step_loss(model, capture(target, other, (0, 2)), other, other_masks, cfg,
                                      torch.Generator().manual_seed(seed), forward=trainer.forward)
            loss.backward()
    trainer.close()


def test_the_compile_mode_reaches_torch_compile_and_needs_compile(monkeypatch):
    """TrainConfig.compile_mode: "reduce-overhead" (the blocks' pass replayed as CUDA graphs) is handed to
    torch.compile, "default" hands no mode; a mode without compile, or one torch.compile lacks here, is
    refused by name."""
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw) or fn)
    fast = dict(fast=True, compile=True)
    assert compiled_blocks_forward(TrainConfig(**fast).validate()) is not None and seen[-1] == {"dynamic": False}
    compiled_blocks_forward(TrainConfig(**fast, compile_mode="reduce-overhead").validate())
    assert seen[-1] == {"dynamic": False, "mode": "reduce-overhead"}
    assert compiled_blocks_forward(TrainConfig().validate()) is None and len(seen) == 2
    with pytest.raises(ValueError, match="TrainConfig.compile_mode='reduce-overhead': a mode of compile, which is off"):
        TrainConfig(fast=True, compile_mode="reduce-overhead").validate()
    with pytest.raises(ValueError, match=r"TrainConfig.compile_mode='max-autotune': must be one of"):
        TrainConfig(**fast, compile_mode="max-autotune").validate()


def test_buckets_pad_shapes_without_changing_the_anchors():
    target = SyntheticTarget(seed=3)
    seqs, masks = data(target, 3, SEED % 997, lengths=(30, 34))  # 25-31 anchors in the longest: not a multiple of 16
    plain = make_batch(seqs, masks, TrainConfig(num_anchors=50), torch.Generator().manual_seed(SEED), 7, 63)
    padded = make_batch(seqs, masks, TrainConfig(num_anchors=50, anchor_bucket=16, length_bucket=64),
                        torch.Generator().manual_seed(SEED), 7, 63)
    A = plain.anchors.shape[1]
    assert padded.width == 64 and A % 16 and padded.anchors.shape[1] == -(-A // 16) * 16
    assert torch.equal(padded.anchors[:, :A], plain.anchors) and not padded.keep[:, A:].any()
    assert torch.equal(padded.eval_mask[:, :A], plain.eval_mask) and not padded.eval_mask[:, A:].any()
    capped = make_batch(seqs, masks, TrainConfig(num_anchors=5, anchor_bucket=4), torch.Generator().manual_seed(SEED), 7, 63)
    assert capped.anchors.shape[1] == 8 and int(capped.keep.sum(1).max()) == 5  # the cap, rounded up to the bucket


# ---- block-sparse attention ---------------------------------------------------------------------
def random_anchors(g, B, A, S, padded_from):
    """Sorted distinct anchors in [0, S - 1) per sequence, the blocks from padded_from[b] on padding (anchor 0)."""
    anchors = torch.stack([torch.randperm(S - 1, generator=g)[:A].sort().values for _ in range(B)])
    keep = torch.arange(A) < torch.tensor(padded_from)[:, None]
    return torch.where(keep, anchors, 0), keep


def test_tile_masks_cover_exactly_the_visible_pairs():
    """Every 128 x 128 tile with a visible (slot, key) pair is computed; a tile marked full has
    every pair visible; shapes that are not multiples of 128 and padding blocks included."""
    g = torch.Generator().manual_seed(SEED)
    B, A, G, S = 3, 45, 7, 300  # 315 slots, 615 keys
    anchors, keep = random_anchors(g, B, A, S, padded_from=[45, 30, 0])
    visible = torch.arange(S) < anchors[..., None]
    dense = _block_mask(visible, G)  # [B, Q, S + Q]: the reference element mask
    mask_mod = flex.slot_mask(anchors, S, G)
    q, kv = torch.arange(A * G), torch.arange(S + A * G)
    for b in range(B):
        assert torch.equal(mask_mod(torch.tensor(b), 0, q[:, None], kv[None, :]), dense[b])
    partial, full = flex.tile_masks(anchors, S, G)
    Qt, Kt = partial.shape[1:]
    tiles = torch.nn.functional.pad(dense, (0, Kt * 128 - dense.shape[2], 0, Qt * 128 - dense.shape[1]))
    tiles = tiles.view(B, Qt, 128, Kt, 128)
    # padding rows/columns past the ends are False, so "every pair" is checked over the real ones only
    real = torch.nn.functional.pad(torch.ones_like(dense), (0, Kt * 128 - dense.shape[2], 0, Qt * 128 - dense.shape[1]))
    real = real.view(B, Qt, 128, Kt, 128)
    any_visible = tiles.any(4).any(2)
    all_visible = (tiles | ~real).all(4).all(2)
    assert not (any_visible & ~(partial | full)).any(), "a tile with visible pairs would be skipped"
    assert not (full & ~all_visible).any(), "a tile marked full has a hidden pair"
    assert not (partial & full).any()
    assert (full.sum() > 0) and (~(partial | full)).sum() > 0  # the test covers all three kinds


@pytest.mark.parametrize("attention_type", ["gqa", "mla"])
# On the CPU flex attention runs uncompiled, the dense form it warns about: that is what is compared here.
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")
def test_flex_attention_pass_equals_the_dense_sdpa_pass(attention_type):
    """The backbone through FlexAttention's BlockMask (its CPU form: forward only) equals the one
    through SDPA's dense mask, float32, on a pass long enough for several tiles."""
    g = torch.Generator().manual_seed(SEED)
    target = SyntheticTarget(seed=SEED % 83)
    torch.manual_seed(SEED % 79)
    model = DSparkModel(small_config(target, attention_type), *target.embedding_weights()).eval()
    c = model.config
    B, A, G, S = 2, 30, c.block_size, 170
    anchors, _ = random_anchors(g, B, A, S, padded_from=[30, 22])
    positions = anchors[..., None] + torch.arange(G)
    block = torch.randint(0, c.vocab_size, (B, A, G), generator=g)
    fused = torch.randn(B, S, c.hidden_size, generator=g)
    rows = model.context_rows(fused, torch.arange(S).expand(B, S))
    with torch.no_grad():
        dense = model.backbone(block, positions, rows, torch.arange(S) < anchors[..., None])
        sparse = torch.full_like(dense, float("nan"))
        sparse.copy_(model.backbone(block, positions, rows, None, flex_mask=flex.block_mask(anchors, S, G, "cpu")))
    # float32 both ways, the softmax over <= 380 keys summed in another order: ~1e-6.
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="exactly one of context_visible and flex_mask"):
        model.backbone(block, positions, rows, None)


def test_a_compiled_flex_pass_traces_its_block_mask_once_per_shape(monkeypatch):
    """The blocks' pass with a BlockMask through torch.compile (dynamo, aot_eager: the CPU's flex
    kernel is forward only) equals the dense SDPA pass, and a new batch's anchors (a new mask_mod
    over new tensors, new tiles) reuse the graph: no recompilation per step."""
    target = SyntheticTarget(seed=SEED % 67)
    torch.manual_seed(SEED % 61)
    model = DSparkModel(small_config(target, "gqa"), *target.embedding_weights()).eval()
    c = model.config
    forward = torch.compile(blocks_forward, backend="aot_eager")
    torch._dynamo.reset()
    B, A, G, S = 2, 20, c.block_size, 150
    for i in range(3):
        g = torch.Generator().manual_seed(SEED + i)
        anchors, _ = random_anchors(g, B, A, S, padded_from=[20, 13 + i])
        positions = anchors[..., None] + torch.arange(G)
        block = torch.randint(0, c.vocab_size, (B, A, G), generator=g)
        features = torch.randn(B, S, len(c.target_layer_ids) * c.target_hidden_size, generator=g)
        with torch.no_grad(), torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            dense = blocks_forward(model, features, block, positions, torch.arange(S) < anchors[..., None], None)
            sparse = forward(model, features, block, positions, None, flex.block_mask(anchors, S, G, "cpu"))
        torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-5)


# ---- the capture store --------------------------------------------------------------------------
def test_causal_taps_equal_the_taps_of_a_verify_on_free_slots():
    """LlamaTarget.causal_taps (no cache, no logits) gives the taps verify on free slots gives, ragged
    sequences padded with zeros, to float32 summation order (1e-5); capture without logits chunks it by
    max_slots and a logits-free store fills from it; a token outside the vocabulary is named by its sequence."""
    target = tiny_llama(SEED, max_slots=2)
    g = torch.Generator().manual_seed(SEED)
    seqs = [torch.randint(0, target.vocab_size, (int(n),), generator=g) for n in torch.randint(3, 41, (5,), generator=g)]
    layers = (-1, 0, 2, target.num_layers)
    _, want = capture(target, seqs, layers)
    got_logits, got = capture(target, seqs, layers, logits=False)
    assert got_logits is None and set(got) == set(layers)
    for layer in layers:
        assert got[layer].shape == want[layer].shape
        torch.testing.assert_close(got[layer], want[layer], rtol=1e-5, atol=1e-5, msg=f"seed {SEED}: layer {layer}")
        for i, s in enumerate(seqs):
            assert not got[layer][i, len(s):].any() and got[layer][i, : len(s)].abs().sum() > 0
    store = CaptureStore(target, seqs, (0, 2, target.num_layers), dtype=torch.float32)
    store.fill(progress=False)
    batch = store.batch([4, 1])
    for layer in (0, 2):
        torch.testing.assert_close(batch.taps[layer][0, : len(seqs[4])], want[layer][4, : len(seqs[4])],
                                   rtol=1e-5, atol=1e-5)
    bad = [seqs[0], seqs[1].clone()]
    bad[1][-1] = target.vocab_size
    with pytest.raises(ValueError, match=rf"sequences\[1\]: token {target.vocab_size} outside the vocabulary"):
        target.causal_taps(bad, layers)


@pytest.mark.long
@pytest.mark.parametrize("taps_attention", ["sdpa", "flex"])
def test_compiled_causal_taps_equal_the_eager_ones(taps_attention):
    """LlamaTarget(compiled_taps=True) runs causal_taps' layers through torch.compile, one graph for all of
    them (the first batch compiles at most one); its taps, every one asked for, equal the eager pass's to
    float32 rounding of the fused elementwise work, over three batch shapes (the third after the shapes went symbolic, 250 tokens: two of FlexAttention's 128-row tiles, the
    second partial), padding still zero. With taps_attention="flex" the attention is FlexAttention under
    causal_block_mask (on the CPU in float32, so to rounding as well)."""
    tiny = tiny_llama(SEED, max_slots=4)
    eager = LlamaTarget(tiny.config, tiny.weights, max_slots=4, max_seq_len=256, attention="batched")
    compiled = LlamaTarget(tiny.config, tiny.weights, max_slots=4, max_seq_len=256, attention="batched",
                           compiled_taps=True, taps_attention=taps_attention)
    g = torch.Generator().manual_seed(SEED)
    layers = (-1, 1, compiled.num_layers)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for count, longest in ((3, 41), (4, 41), (2, 250)):
        lengths = torch.randint(3, longest + 1, (count,), generator=g).tolist()
        lengths[0] = longest
        seqs = [torch.randint(0, eager.vocab_size, (n,), generator=g) for n in lengths]
        want, got = eager.causal_taps(seqs, layers), compiled.causal_taps(seqs, layers)
        if count == 3:  # one layer's graph serves every layer (none if an earlier test compiled the same); a graph
            # per layer would also hit dynamo's recompile limit
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs <= 1
        assert set(got) == set(layers)
        for layer in layers:
            torch.testing.assert_close(got[layer], want[layer], rtol=1e-5, atol=1e-5,
                                       msg=f"seed {SEED}: layer {layer}, lengths {lengths}")
            for i, s in enumerate(seqs):
                assert not got[layer][i, len(s):].any()
    assert compiled._compiled_layer is not None and eager._compiled_layer is None


@pytest.mark.parametrize("taps_attention", ["sdpa", "flex"])
def test_bf16_causal_taps_round_the_matmul_operands_only(taps_attention):
    """taps_precision="bfloat16" gives float32 taps from bf16 matmul and attention operands: against the
    float32 pass, the relative error of every tap is that of bf16 operands (above 1e-4, so the precision
    took effect; below 2e-2), padding stays zero and the model's own weights stay float32. The compiled
    pass (FlexAttention or SDPA) equals the eager bf16 pass to the rounding of bf16 operands that the two
    may round at different points (rtol 2e-2 in norm)."""
    tiny = tiny_llama(SEED, max_slots=4)
    make = lambda **kw: LlamaTarget(tiny.config, tiny.weights, max_slots=4, max_seq_len=256,  # noqa: E731
                                    attention="batched", **kw)
    full, eager_bf16 = make(), make(taps_precision="bfloat16")
    compiled_bf16 = make(taps_precision="bfloat16", compiled_taps=True, taps_attention=taps_attention)
    g = torch.Generator().manual_seed(SEED)
    layers = (-1, 1, full.num_layers)
    lengths = [41] + torch.randint(3, 41, (2,), generator=g).tolist()
    seqs = [torch.randint(0, full.vocab_size, (n,), generator=g) for n in lengths]
    want, rounded, compiled = (t.causal_taps(seqs, layers) for t in (full, eager_bf16, compiled_bf16))

    def relative(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    for layer in layers:
        assert rounded[layer].dtype == compiled[layer].dtype == torch.float32
        error = relative(rounded[layer], want[layer])
        assert (layer == -1 and error == 0) or 1e-4 < error < 2e-2, f"seed {SEED}: layer {layer}: {error}"
        assert relative(compiled[layer], rounded[layer]) < 2e-2, f"seed {SEED}: layer {layer}"
        for i, s in enumerate(seqs):
            assert not rounded[layer][i, len(s):].any() and not compiled[layer][i, len(s):].any()
    assert all(t.dtype == torch.float32 for layer in full.weights.layers for t in vars(layer).values())
    assert eager_bf16.taps_layers()[0].qkv.dtype == torch.bfloat16
    assert eager_bf16.taps_layers()[0].attn_norm.dtype == torch.float32
    with pytest.raises(ValueError, match=r"taps_precision='float16': must be one of \('float32', 'bfloat16'\)"):
        make(taps_precision="float16")


def test_causal_block_mask_reads_the_tiles_below_the_diagonal_whole_and_the_diagonal_masked():
    """causal_block_mask's tiles, built on the host: query tile i has its diagonal tile partial (under
    causal_mask) and tiles 0..i-1 full, for lengths inside one tile, at a tile's edge and past it."""
    from dspark.flex_tiles import TILE
    from dspark.targets.llama import causal_block_mask

    for length in (5, TILE, TILE + 1, 3 * TILE - 7):
        tiles = -(-length // TILE)
        mask = causal_block_mask(length, "cpu")
        assert mask.seq_lengths == (length, length) and mask.BLOCK_SIZE == (TILE, TILE)
        partial = torch.zeros(tiles, tiles, dtype=torch.bool)
        full = torch.zeros(tiles, tiles, dtype=torch.bool)
        for i in range(tiles):
            partial[i, mask.kv_indices[0, 0, i, : mask.kv_num_blocks[0, 0, i]].long()] = True
            full[i, mask.full_kv_indices[0, 0, i, : mask.full_kv_num_blocks[0, 0, i]].long()] = True
        assert torch.equal(partial, torch.eye(tiles, dtype=torch.bool)), length
        assert torch.equal(full, torch.ones(tiles, tiles, dtype=torch.bool).tril(-1)), length
        q, kv = torch.arange(length)[:, None], torch.arange(length)
        assert torch.equal(mask.mask_mod(0, 0, q, kv), q >= kv)


def test_flex_taps_attention_needs_the_compiled_pass_and_a_known_name():
    tiny = tiny_llama(SEED)
    make = lambda **kw: LlamaTarget(tiny.config, tiny.weights, max_slots=2, max_seq_len=64, attention="batched", **kw)  # noqa: E731
    with pytest.raises(ValueError, match=r"taps_attention='flex': must be one of \('sdpa', 'flex'\), 'flex' with "
                                         r"compiled_taps=True"):
        make(taps_attention="flex")
    with pytest.raises(ValueError, match=r"taps_attention='dense': must be one of"):
        make(compiled_taps=True, taps_attention="dense")


def test_causal_taps_launch_as_many_ops_for_one_sequence_as_for_many():
    """The online capture's cost on a GPU was its launches (one SDPA per sequence per layer): causal_taps
    now dispatches the same float ops whatever the batch size, and a row's taps stay its own to float
    rounding."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            # The layers' float work, which runs on the GPU; the token ids are padded on the host.
            self.ops += any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in torch.utils._pytree.tree_leaves(out))
            return out

    target = tiny_llama(SEED % 1019, max_slots=8)
    g = torch.Generator().manual_seed(SEED)
    seqs = [torch.randint(0, target.vocab_size, (int(n),), generator=g) for n in torch.randint(3, 41, (7,), generator=g)]
    layers = (0, target.num_layers)
    counts, taps = [], []
    for batch in ([seqs[0]], seqs):
        with Count() as count:
            taps.append(target.causal_taps(batch, layers))
        counts.append(count.ops)
    assert counts[0] == counts[1], f"ops for 1 and {len(seqs)} sequences: {counts}"
    for layer in layers:
        n = len(seqs[0])
        torch.testing.assert_close(taps[1][layer][0, :n], taps[0][layer][0, :n], rtol=1e-5, atol=1e-5)


def test_a_store_gives_the_online_capture_losses_and_keeps_what_fits():
    """Taps and the LM head's input captured once (float32) give the losses of capturing every
    step with the target's own logits; bf16 within its rounding; a byte budget caches the first
    sequences and captures the rest per batch, to the same values."""
    target = tiny_llama(SEED % 1009)
    seqs, masks = data(target, 6, SEED % 991)
    model = llama_drafter(target)
    online_cfg = TrainConfig(num_anchors=12)
    store_cfg = dataclasses.replace(online_cfg, teacher="lm_head")
    pick = [4, 1, 5]
    online = capture(target, [seqs[i] for i in pick], tuple(model.config.target_layer_ids))
    stores = {}
    for name, dtype, budget in (("all", torch.float32, None), ("part", torch.float32, 0), ("bf16", torch.bfloat16, None)):
        store = CaptureStore(target, seqs, capture_layers(model, store_cfg), dtype=dtype, budget_bytes=budget)
        if name == "part":  # room for the first two sequences only
            store = CaptureStore(target, seqs, capture_layers(model, store_cfg), dtype=dtype,
                                 budget_bytes=(len(seqs[0]) + len(seqs[1])) * store.row_bytes)
            assert store.cached == 2
        store.fill(progress=False)
        stores[name] = store
    losses = {}
    for name, cfg, captured in (("online", online_cfg, online), *((n, store_cfg, s.batch(pick)) for n, s in stores.items())):
        loss, _ = train_step_loss(model, captured, [seqs[i] for i in pick], [masks[i] for i in pick], cfg,
                                  torch.Generator().manual_seed(SEED))
        losses[name] = loss.item()
    # The same float32 ops (the LM head over the final-normed state) in another order: ~1e-6.
    assert losses["all"] == pytest.approx(losses["online"], rel=1e-5)
    # bf16 taps and LM-head input: each value within 2^-8 relative; the loss moves far less.
    assert losses["bf16"] == pytest.approx(losses["online"], rel=2e-2) and losses["bf16"] != losses["all"]
    whole, part = stores["all"].batch(pick, width=48), stores["part"].batch(pick, width=48)
    assert part.stacked[1].shape == (3, 48, 3, target.hidden_size)
    # Cached or captured now, the same values, up to the batched target's float32 rounding over another
    # batch shape (its GEMMs and its padded SDPA block differently: not bitwise, seen up to ~1.1e-6 on
    # values of unit scale); a wrong row or position moves them by O(1).
    torch.testing.assert_close(part.stacked[1], whole.stacked[1], rtol=1e-5, atol=1e-5)


def test_a_saved_store_loads_only_for_the_same_sequences(tmp_path):
    target = tiny_llama(SEED % 1013)
    seqs, _ = data(target, 5, SEED % 983)
    store = CaptureStore(target, seqs, (0, 2, 4), fingerprint="gguf-a")
    store.fill(progress=False)
    store.save(tmp_path / "capture.bin")
    again = CaptureStore(target, seqs, (0, 2, 4), fingerprint="gguf-a")
    again.taps.fill_(float("nan"))
    assert again.load(tmp_path / "capture.bin") and torch.equal(again.taps, store.taps)
    assert not CaptureStore(target, seqs, (0, 2, 4), fingerprint="gguf-b").load(tmp_path / "capture.bin")
    assert not CaptureStore(target, seqs[:4] + [seqs[0]], (0, 2, 4), fingerprint="gguf-a").load(tmp_path / "capture.bin")
    with pytest.raises(ValueError, match="fill"):
        CaptureStore(target, seqs, (0, 2, 4)).batch([0])


# ---- the loop -----------------------------------------------------------------------------------
def test_a_resumed_fast_run_equals_an_unbroken_one(tmp_path):
    """The fast step on a store, WSD, metrics read every 3 steps: stopping and resuming (weights,
    AdamW's moments, the schedule's position) gives the unbroken run's weights bit for bit."""
    target = tiny_llama(SEED % 977)
    seqs, masks = data(target, 12, SEED % 971)
    cfg = TrainConfig(steps=7, batch_size=4, num_anchors=8, lr=2e-3, schedule="wsd", decay_frac=0.3, teacher="lm_head",
                      fast=True, anchor_bucket=4, length_bucket=16, log_every=3, seed=SEED % 61)

    def fresh():
        model = llama_drafter(target)
        model.init_heads_like_deepspec()
        return model

    store = CaptureStore(target, seqs, capture_layers(fresh(), cfg), dtype=torch.float32)
    store.fill(progress=False)
    straight = fresh()
    history = train(target, straight, seqs, loss_masks=masks, config=cfg, out_dir=tmp_path / "a", progress=False, store=store)
    assert [h["step"] for h in history] == list(range(1, 8)) and all(isinstance(h["loss"], float) for h in history)
    assert [h["lr"] for h in history] == pytest.approx([cfg.lr * lr_factor(s, cfg) for s in range(7)])
    split = fresh()
    train(target, split, seqs, loss_masks=masks, config=cfg, out_dir=tmp_path / "b", progress=False, store=store,
          deadline=time.time() - 1)  # stops after its first step
    resumed = fresh()
    train(target, resumed, seqs, loss_masks=masks, config=cfg, out_dir=tmp_path / "b", progress=False, store=store,
          resume=True)
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    log = (tmp_path / "b" / "train_log.jsonl").read_text().splitlines()
    assert len(log) == 7
    with pytest.raises(ValueError, match="store: holds 11 sequences"):
        train(target, fresh(), seqs, loss_masks=masks, config=cfg, progress=False, store=CaptureStore(target, seqs[:11], (0,)))
