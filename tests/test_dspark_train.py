"""DSpark drafter training (docs/dspark-algorithm.md §6) on the synthetic learnable target."""
import dataclasses
import json
import math
import time

import pytest
import torch

from dspark.drafters.dspark import DSparkDrafter, DSparkModel
from dspark.drafters.dspark.calibrate import run_rounds
from dspark.drafters.dspark.train import (
    TrainConfig,
    Trainer,
    build_blocks,
    dspark_loss,
    generate_sequences,
    response_loss_masks,
    sample_anchors,
    capture,
    epoch_batches,
    train,
    train_step_loss,
    train_together,
)
from dspark.drafters.dspark.loss import metrics_to_floats
from dspark_fixtures import SyntheticTarget, one_thread, small_config  # noqa: F401 (autouse fixture)


def test_loss_matches_float64_reference():
    g = torch.Generator().manual_seed(0)
    N, G, V = 5, 7, 11
    draft = torch.randn(N, G, V, generator=g).requires_grad_()
    tgt = torch.randn(N, G, V, generator=g) * 2
    labels = torch.randint(0, V, (N, G), generator=g)
    conf = torch.randn(N, G, generator=g, requires_grad=True)
    mask = torch.rand(N, G, generator=g) > 0.3
    cfg = TrainConfig()
    loss, metrics = dspark_loss(draft, tgt, labels, conf, mask, cfg)
    draft_ref, conf_ref = draft.detach().double(), conf.detach().double()
    sums = {"ce": 0.0, "l1": 0.0, "conf": 0.0}
    wsum = 0.0
    for n in range(N):
        for k in range(G):
            if not mask[n, k]:
                continue
            w = math.exp(-k / 4.0)  # exp(-(k-1)/4) with 1-based k
            pd = torch.softmax(draft_ref[n, k], 0)
            pt = torch.softmax(tgt[n, k].double(), 0)
            l1 = float((pd - pt).abs().sum())  # full L1, not halved
            c_star = min(max(1 - 0.5 * l1, 0.0), 1.0)
            s = torch.sigmoid(conf_ref[n, k])
            sums["ce"] += w * -math.log(float(pd[labels[n, k]]))
            sums["l1"] += w * l1
            sums["conf"] += w * float(-(c_star * torch.log(s) + (1 - c_star) * torch.log(1 - s)))
            wsum += w
    expected = {key: v / wsum for key, v in sums.items()}
    for key in expected:
        assert metrics[key] == pytest.approx(expected[key], rel=1e-5)
    assert loss.item() == pytest.approx(0.1 * expected["ce"] + 0.9 * expected["l1"] + expected["conf"], rel=1e-5)
    # The soft label is detached: the confidence term alone sends no gradient into the draft logits.
    conf_only, _ = dspark_loss(draft, tgt, labels, conf, mask, TrainConfig(ce_weight=0.0, l1_weight=0.0))
    conf_only.backward()
    assert draft.grad is None or draft.grad.abs().max() == 0
    assert conf.grad[mask].abs().min() > 0 and conf.grad[~mask].abs().max() == 0


def test_anchors_and_blocks_follow_the_spec():
    g = torch.Generator().manual_seed(1)
    B, S, G, MASK = 3, 20, 7, 99
    tokens = torch.randint(0, 50, (B, S), generator=g)
    lengths = torch.tensor([20, 13, 6])
    loss_mask = (torch.rand(B, S, generator=g) > 0.2).long()
    anchors, keep = sample_anchors(loss_mask, lengths, 8, g)
    block, positions, labels, prev, eval_mask = build_blocks(tokens, lengths, loss_mask, anchors, keep, G, MASK)
    for b in range(B):
        valid = [a for a in range(int(lengths[b]) - 1) if loss_mask[b, a] and loss_mask[b, a + 1]]
        chosen = anchors[b][keep[b]].tolist()
        assert len(chosen) == min(8, len(valid)) and chosen == sorted(set(chosen)) and set(chosen) <= set(valid)
        for i, a in enumerate(anchors[b].tolist()):
            if not keep[b, i]:
                assert not eval_mask[b, i].any()
                continue
            assert block[b, i].tolist() == [int(tokens[b, a])] + [MASK] * (G - 1)
            assert positions[b, i].tolist() == list(range(a, a + G))
            ok = True
            for k in range(1, G + 1):  # 1-based slot k: label tok[a+k], previous token tok[a+k-1]
                ok = ok and a + k < lengths[b] and bool(loss_mask[b, a + k])
                assert bool(eval_mask[b, i, k - 1]) == ok
                if ok:
                    assert labels[b, i, k - 1] == tokens[b, a + k] and prev[b, i, k - 1] == tokens[b, a + k - 1]


def make_data(target, n, seed):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, target.vocab_size - 1, (8,), generator=g) for _ in range(n)]
    return generate_sequences(target, prompts, 56, temperature=1.0, generator=g)


def test_training_lowers_loss_and_raises_acceptance_length(tmp_path):
    """GQA backbone here; the MLA backbone is trained to AL > 2.5 in test_dspark_engine.py."""
    target = SyntheticTarget(seed=0)
    torch.manual_seed(0)
    model = DSparkModel(small_config(target, "gqa"), *target.embedding_weights())
    drafter = DSparkDrafter(model, max_slots=target.max_slots, max_seq_len=target.max_seq_len)
    held_out = [torch.randint(0, target.vocab_size - 1, (8,)) for _ in range(8)]
    before = run_rounds(target, drafter, held_out, max_new_tokens=40).acceptance_length
    history = train(target, model, make_data(target, 64, seed=1), out_dir=tmp_path, progress=False,
                    config=TrainConfig(steps=80, batch_size=8, num_anchors=32, lr=3e-3))
    after = run_rounds(target, drafter, held_out, max_new_tokens=40).acceptance_length
    first = sum(h["loss"] for h in history[:10]) / 10
    last = sum(h["loss"] for h in history[-10:]) / 10
    assert last < 0.8 * first
    assert before < 1.3 and after > 2.5, (before, after)
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert [row["step"] for row in log] == list(range(1, 81)) and {"ce", "l1", "conf", "tau", "lr"} <= set(log[0])


def test_resumed_run_equals_unbroken_run(tmp_path):
    target = SyntheticTarget(seed=2)
    data = make_data(target, 16, seed=3)
    cfg = TrainConfig(steps=6, batch_size=4, num_anchors=8, lr=1e-3, seed=5)

    def fresh():
        torch.manual_seed(7)
        return DSparkModel(small_config(target, "gqa", markov_head_type="gated"), *target.embedding_weights())

    straight = fresh()
    # The unbroken run also reuses cached captures: it must match the run that prefills every step.
    train(target, straight, data, config=cfg, out_dir=tmp_path / "a", progress=False, cache_captures=True)
    split = fresh()
    train(target, split, data, config=cfg, out_dir=tmp_path / "b", progress=False, stop_after=4)
    resumed = fresh()  # a new process: weights, optimizer and step come from the checkpoint
    # A deadline already past ends the call after one step, with a checkpoint to resume from.
    history = train(target, resumed, data, config=cfg, out_dir=tmp_path / "b", progress=False, resume=True,
                    deadline=time.time() - 1)
    assert [m["step"] for m in history] == [5]
    resumed = fresh()
    train(target, resumed, data, config=cfg, out_dir=tmp_path / "b", progress=False, resume=True)
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    assert len((tmp_path / "b" / "train_log.jsonl").read_text().splitlines()) == 6
    with pytest.raises(ValueError, match="TrainConfig.batch_size=0"):
        train(target, resumed, data, config=TrainConfig(batch_size=0))


def test_length_groups_batch_similar_lengths_and_keep_every_sequence_once_per_epoch():
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    supervised = torch.randint(1, 400, (203,), generator=gen).tolist()
    plain_cfg = TrainConfig(batch_size=8, seed=3)
    grouped_cfg = TrainConfig(batch_size=8, seed=3, length_groups=5)
    padding = {}
    for name, cfg in (("plain", plain_cfg), ("grouped", grouped_cfg)):
        batches = epoch_batches(supervised, cfg, epoch=2)
        assert all(len(b) == 8 for b in batches) and len(batches) == 203 // 8
        flat = [i for b in batches for i in b]
        assert len(set(flat)) == len(flat)  # nobody twice in an epoch
        assert batches == epoch_batches(supervised, cfg, epoch=2)  # a resumed run draws the same
        padding[name] = sum(max(supervised[i] for i in b) * len(b) - sum(supervised[i] for i in b) for b in batches)
    # The same sequences leave the epoch in both (the groups only reorder the shuffled ones).
    assert sorted(i for b in epoch_batches(supervised, plain_cfg, 2) for i in b) == \
        sorted(i for b in epoch_batches(supervised, grouped_cfg, 2) for i in b)
    assert padding["grouped"] < 0.5 * padding["plain"], padding
    assert epoch_batches(supervised, plain_cfg, 2) != epoch_batches(supervised, plain_cfg, 3)
    with pytest.raises(ValueError, match="TrainConfig.length_groups=-1"):
        TrainConfig(length_groups=-1).validate()
    with pytest.raises(ValueError, match="TrainConfig.recompute=1"):
        TrainConfig(recompute=1).validate()


@pytest.mark.parametrize("recompute", [True, False])
def test_anchor_chunks_give_the_same_loss_and_gradients(recompute):
    target = SyntheticTarget(seed=4)
    data = make_data(target, 4, seed=4)
    torch.manual_seed(3)
    model = DSparkModel(small_config(target, "mla"), *target.embedding_weights())
    results = []
    for chunk in (0, 3):
        model.zero_grad(set_to_none=True)
        cfg = TrainConfig(num_anchors=10, anchor_chunk=chunk, recompute=recompute)
        loss, metrics = train_step_loss(model, capture(target, data, model.config.target_layer_ids), data,
                                        [torch.ones_like(s) for s in data], cfg, torch.Generator().manual_seed(9))
        loss.backward()
        floats = metrics_to_floats(metrics) | {"accept": metrics["accept"].tolist()}  # unrounded: see test_dspark_train_fast
        results.append((loss.detach(), floats, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss0, m0, g0), (loss1, m1, g1) = results
    torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=1e-6)
    assert m1["tau"] == pytest.approx(m0["tau"], rel=1e-5) and m1["accept"] == pytest.approx(m0["accept"], abs=1e-5)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-6, msg=name)
    assert any(g.abs().max() > 0 for g in g0.values())


def test_generated_sequences_admit_a_few_per_step_with_per_prompt_temperatures():
    """admit_per_step bounds how many prompts one prefill takes while the others decode, without
    changing any response; a list of temperatures gives each prompt its own (the seeds are drawn
    in prompt order either way, so each response matches the run at its prompt's temperature)."""
    target = SyntheticTarget(seed=8, max_slots=5)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, target.vocab_size, (int(n),), generator=g) for n in (3, 8, 5, 12, 4, 6, 7, 2, 9, 5, 3)]
    prefill_sizes = []
    prefill = target.prefill
    target.prefill = lambda slots, *rest: prefill_sizes.append(len(slots)) or prefill(slots, *rest)
    runs = {t: generate_sequences(target, prompts, 12, t, torch.Generator().manual_seed(4), eos_token_ids=())
            for t in (0.0, 1.0)}
    assert max(prefill_sizes) == target.max_slots and sum(prefill_sizes) == 2 * len(prompts)
    assert any(not torch.equal(a, b) for a, b in zip(runs[0.0], runs[1.0])), "T = 1 drew the greedy responses"
    prefill_sizes.clear()
    temperatures = [float(i % 2) for i in range(len(prompts))]
    mixed = generate_sequences(target, prompts, 12, temperatures, torch.Generator().manual_seed(4), eos_token_ids=(),
                               admit_per_step=2)
    assert max(prefill_sizes) == 2 and sum(prefill_sizes) == len(prompts)
    for i, s in enumerate(mixed):
        assert s.tolist() == runs[temperatures[i]][i].tolist(), i
    with pytest.raises(ValueError, match=r"temperature\[1\]=-0.5"):
        generate_sequences(target, prompts[:2], 4, [0.0, -0.5])
    with pytest.raises(ValueError, match="3 temperatures for 2 prompts"):
        generate_sequences(target, prompts[:2], 4, [0.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="admit_per_step=0"):
        generate_sequences(target, prompts[:2], 4, admit_per_step=0)


def test_generated_sequences_stop_at_eos_and_the_mask_ends_with_it():
    """Issue 13: a continuation ends with its first EOS (kept) and the loss mask covers exactly
    the response; with the same per-request seeds the stopped run is a prefix of the free one."""
    target = SyntheticTarget(seed=6)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, target.vocab_size, (int(n),), generator=g) for n in (3, 8, 5, 12, 4, 6)]
    for temperature in (0.0, 1.0):
        free = generate_sequences(target, prompts, 24, temperature, torch.Generator().manual_seed(3), eos_token_ids=())
        responses = [s[len(p):].tolist() for p, s in zip(prompts, free)]
        assert all(len(r) == 24 for r in responses)
        # An EOS that some responses emit mid-way: the most common token after the first position.
        eos = max(range(target.vocab_size), key=lambda t: sum(r[1:].count(t) for r in responses))
        stopped = generate_sequences(target, prompts, 24, temperature, torch.Generator().manual_seed(3), eos_token_ids=(eos,))
        cut = 0
        for p, r, s in zip(prompts, responses, stopped):
            expected = r[: r.index(eos) + 1] if eos in r else r
            cut += len(expected) < len(r)
            assert s.tolist() == p.tolist() + expected
        assert cut > 0, "no response was cut: the test shows nothing"
        masks = response_loss_masks(prompts, stopped)
        for p, s, m in zip(prompts, stopped, masks):
            assert m.shape == s.shape and m[: len(p)].sum() == 0 and bool(m[len(p):].all())
    with pytest.raises(ValueError, match=r"loss_masks\[0\] has shape"):
        longer = [torch.cat([m, torch.ones(3, dtype=torch.long)]) for m in masks]
        train(target, DSparkModel(small_config(target, "gqa"), *target.embedding_weights()), stopped, loss_masks=longer,
              config=TrainConfig(steps=1, batch_size=2, num_anchors=4), progress=False)


def test_drafters_trained_together_equal_drafters_trained_apart(tmp_path):
    """train_together (one capture per batch for every drafter, with the union of their taps)
    gives each drafter what train() gives it alone, also when stopped and resumed midway."""
    target = SyntheticTarget(seed=6)
    data = make_data(target, 12, seed=6)
    base = TrainConfig(steps=4, batch_size=4, num_anchors=8, lr=1e-3, seed=5)
    configs = {"dspark": base, "ablation": dataclasses.replace(base, ce_weight=1.0, l1_weight=0.0, conf_weight=0.0)}

    def fresh():
        torch.manual_seed(7)
        return {"dspark": DSparkModel(small_config(target, "gqa"), *target.embedding_weights()),
                "ablation": DSparkModel(small_config(target, "mla", target_layer_ids=(1, 2)), *target.embedding_weights())}

    apart = fresh()
    for name, model in apart.items():
        train(target, model, data, config=configs[name], progress=False)
    first = {name: Trainer(m, data, None, configs[name], tmp_path / name) for name, m in fresh().items()}
    train_together(target, first, progress=False, stop_after=2)
    for trainer in first.values():
        trainer.close()
    together = fresh()  # a new process: weights, optimizer and step come from the checkpoints
    trainers = {name: Trainer(m, data, None, configs[name], tmp_path / name, resume=True) for name, m in together.items()}
    history = train_together(target, trainers, progress=False)
    assert {name: [h["step"] for h in steps] for name, steps in history.items()} == {"dspark": [3, 4], "ablation": [3, 4]}
    for name in apart:
        for (key, a), b in zip(apart[name].state_dict().items(), together[name].state_dict().values()):
            assert torch.equal(a, b), (name, key)
    other = Trainer(fresh()["dspark"], data, None, dataclasses.replace(base, seed=6))
    with pytest.raises(ValueError, match="trainer 'other'.*lockstep needs the same batches"):
        train_together(target, {"dspark": Trainer(fresh()["dspark"], data, None, base), "other": other}, progress=False)
