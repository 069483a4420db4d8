"""One rank of K3 at deployment shape (docs/kimi-k3.md §8) is the right share of the model.

k3-tiny in float64 is cut into 2 and 4 ranks (weights.shard_tensors); every rank runs in its own
thread with real collectives between them (a barrier and a sum / concatenation, the same result
on every rank), and the ranks' output must be the whole model's. Layer by layer, each rank's
partial output of a row-parallel projection, summed where the all-reduce would be, must be the
whole layer's output.

Tolerance 5e-5 on logits of unit scale: the model is float64 but the router, the KDA state and
the logits are float32 by design, so sharded and whole differ by float32 rounding in another
summation order (observed about 4e-6); a shard-math error (a head, an expert or a rank's partial
sum lost or counted twice) moves them by 1e-2 or more.
"""
import dataclasses
import threading

import pytest
import torch

from dspark.kernels.kda.reference import allocate_records
from dspark.targets.kimi_k3 import K3, K3_TINY, K3Model, K3Target, Shard, first_layers, load_target
from dspark.targets.kimi_k3.parallel import (OmittedCollectives, RankParallel, busiest_rank_experts, busiest_table,
                                             exact_local_pairs)
from dspark.targets.kimi_k3.weights import random_tensors, shard_tensors, tensor_specs

TOL = dict(rtol=5e-5, atol=5e-5)


class ThreadGroup:
    """Collectives between `world` threads, one per rank: every rank deposits its tensor, waits
    for the others, and computes the same sum / concatenation in rank order."""

    def __init__(self, world: int):
        self.world = world
        self.barrier = threading.Barrier(world, timeout=120)
        self.deposited = [None] * world

    def member(self, rank: int):
        group = self

        class Member:
            def all_reduce(self, x):
                return group._exchange(rank, x, lambda parts: sum(parts[1:], parts[0]))

            def all_gather(self, x):
                return group._exchange(rank, x, lambda parts: torch.cat(parts, dim=-1))

        return Member()

    def _exchange(self, rank, x, combine):
        self.deposited[rank] = x
        self.barrier.wait()
        result = combine(list(self.deposited))
        self.barrier.wait()  # nobody deposits the next tensor before everyone has combined this one
        return result


def run_ranks(group: ThreadGroup, fn):
    """fn(rank) in one thread per rank of `group`; their results, or the first exception raised
    (which breaks the group's barrier, so the other ranks stop waiting)."""
    results, errors = [None] * group.world, []

    def run(rank):
        try:
            results[rank] = fn(rank)
        except BaseException as error:  # noqa: BLE001 - re-raised in the main thread
            errors.append(error)
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(group.world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


@pytest.fixture(scope="module")
def whole_tensors():
    seed = int(torch.randint(0, 2**31 - 1, ()))
    return random_tensors(K3_TINY, seed, torch.float64, "cpu")


def ranks_of(tensors, world, collectives=None, routing="exact"):
    return [K3Model(K3_TINY, shard_tensors(K3_TINY, tensors, Shard(r, world)), shard=Shard(r, world),
                    collectives=None if collectives is None else collectives.member(r), routing=routing)
            for r in range(world)]


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_together_compute_the_whole_model(whole_tensors, world):
    gen = torch.Generator().manual_seed(world)
    prompts = torch.randint(0, K3_TINY.vocab_size, (2, 7), generator=gen)
    drafts = torch.randint(0, K3_TINY.vocab_size, (2, 4), generator=gen)
    whole = K3Target(K3Model(K3_TINY, dict(whole_tensors)), max_slots=2, max_seq_len=32)

    def steps(target):
        """A ragged prompt pass, a commit, a verify of 4: the logits of both passes and the state."""
        first = target.verify([0, 1], prompts, [7, 5]).logits
        target.commit([0, 1], [7, 5])
        second = target.verify([0, 1], drafts, [4, 4]).logits
        target.commit([0, 1], [2, 3])
        return first, second, target

    # the whole model first: it also imports every kernel module the ranks use (imports are not
    # thread safe)
    whole_first, whole_second, whole = steps(whole)
    group = ThreadGroup(world)
    ranks = ranks_of(whole_tensors, world, group)
    results = run_ranks(group, lambda r: steps(K3Target(ranks[r], max_slots=2, max_seq_len=32)))
    heads = K3_TINY.kda_num_heads // world
    for rank, (first, second, target) in enumerate(results):
        torch.testing.assert_close(first, whole_first, **TOL)
        torch.testing.assert_close(second, whole_second, **TOL)
        assert torch.equal(target.lengths, whole.lengths)
        # each rank carries its heads' KDA state and conv window, and the whole MLA cache
        mine = slice(rank * heads, (rank + 1) * heads)
        torch.testing.assert_close(target.kda_state, whole.kda_state[:, :, mine], **TOL)
        width = heads * K3_TINY.kda_head_dim
        conv = whole.conv_state.unflatten(3, (world, width))[:, :, :, rank]
        torch.testing.assert_close(target.conv_state, conv, **TOL)
        torch.testing.assert_close(target.mla_cache, whole.mla_cache, **TOL)


@pytest.mark.parametrize("world", [2, 4])
def test_partial_outputs_sum_to_the_whole_layer(whole_tensors, world):
    """KDA (layer 0), gated MLA (layer 3) and the dense FFN (layer 0): the rank's output before
    its all-reduce; the latent MoE (layer 1), whose gathers need the other ranks, in threads."""
    gen = torch.Generator().manual_seed(10 + world)
    B, T = 2, 3
    h = torch.randn(B * T, K3_TINY.hidden_size, generator=gen, dtype=torch.float64)
    lengths = torch.tensor([3, 2])
    whole = K3Target(K3Model(K3_TINY, dict(whole_tensors)), max_slots=2, max_seq_len=16)
    alone = ranks_of(whole_tensors, world)  # collectives omitted: all_reduce returns the partial
    rank_targets = [K3Target(model, max_slots=2, max_seq_len=16) for model in alone]
    # committed state, random: each rank holds its heads' KDA state and conv channels, all MLA rows
    state = torch.randn(whole.kda_state.shape, generator=gen)
    conv = torch.randn(whole.conv_state.shape, generator=gen, dtype=torch.float64)
    rows = torch.randn(whole._mla_rows.shape, generator=gen, dtype=torch.float64)
    heads = K3_TINY.kda_num_heads // world
    width = heads * K3_TINY.kda_head_dim
    for target in [whole, *rank_targets]:
        r = target.model.shard.rank
        part = slice(None) if target is whole else slice(r * heads, (r + 1) * heads)
        channels = slice(None) if target is whole else slice(r * width, (r + 1) * width)
        target.kda_state.copy_(state[:, :, part])
        target.conv_state.copy_(conv[:, :, :, channels])
        target._mla_rows.copy_(rows)
        target.lengths.fill_(4)
    index = torch.tensor([0, 1])

    def kda(target):
        k = target.model.kda_index[0]
        records = allocate_records(B, T, target.model.kda_heads, K3_TINY.kda_head_dim, target.conv_state.dtype, "cpu",
                                   lengths, dtype=h.dtype)
        return target.model._kda(0, h, B, T, lengths, *target._kda_pools[k], index, records)

    def mla(target):
        cache = target._mla_rows[target.model.mla_index[3]]
        return target.model._mla(3, h, B, T, lengths, cache, index, target.lengths.index_select(0, index))

    for name, layer in (("kda", kda), ("mla", mla), ("dense ffn", lambda t: t.model._ffn(0, h))):
        total = sum(layer(target) for target in rank_targets)
        torch.testing.assert_close(total, layer(whole), **TOL, msg=lambda m: f"{name}: {m}")
    group = ThreadGroup(world)
    together = ranks_of(whole_tensors, world, group)
    outputs = run_ranks(group, lambda r: together[r]._ffn(1, h))
    for output in outputs:
        torch.testing.assert_close(output, whole.model._ffn(1, h), **TOL)


def test_exact_local_pairs_keep_the_rank_share():
    gen = torch.Generator().manual_seed(0)
    experts, k, world, rows = 32, 4, 4, 50
    count = experts // world
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(rows)])
    weights = torch.rand(rows, k, generator=gen)
    seen = torch.zeros(rows, k, dtype=torch.long)
    for rank in range(world):
        local, local_weights = exact_local_pairs(ids, weights, rank * count, count)
        mine = (ids >= rank * count) & (ids < (rank + 1) * count)
        assert torch.equal(local[mine], ids[mine] - rank * count)
        assert torch.equal(local_weights[mine], weights[mine])
        assert torch.equal(local_weights[~mine], torch.zeros_like(weights[~mine]))
        assert ((local >= 0) & (local < count)).all()
        for row in local:  # the op takes distinct experts per row
            assert len(set(row.tolist())) == k
        seen += mine.long()
    assert torch.equal(seen, torch.ones_like(seen))  # every pair belongs to exactly one rank


@pytest.mark.parametrize("tokens, experts", [(1, 3), (8, 12), (16, 12), (32, 31), (3, 7)])
def test_busiest_table_uses_every_expert_once_per_row(tokens, experts):
    table = busiest_table(tokens, experts, 56)
    assert table.shape[0] == tokens
    assert len(set(table.flatten().tolist())) == experts
    assert ((table >= 0) & (table < 56)).all()
    for row in table:
        assert len(set(row.tolist())) == len(row)


def test_busiest_rank_load_is_the_roofline_expectation():
    # docs/kimi-k3.md §6.5: 3.05 experts on the busiest of 16 ranks for one token, 12.28 for 8
    assert busiest_rank_experts(K3, 16, 1) == 3
    assert busiest_rank_experts(K3, 16, 8) == 12


def test_busiest_routing_runs_the_table():
    model = K3Model(K3_TINY, random_tensors(K3_TINY, 1, torch.float32, "cpu", Shard(1, 4)), shard=Shard(1, 4),
                    routing="busiest")
    target = K3Target(model, max_slots=1, max_seq_len=16)
    model.routing_log = []
    target.verify([0], torch.tensor([[5, 6, 7]]), [3])
    expected = busiest_table(3, busiest_rank_experts(K3_TINY, 4, 3), K3_TINY.num_experts // 4)
    moe_layers = K3_TINY.num_layers - K3_TINY.first_k_dense
    assert len(model.routing_log) == moe_layers
    for ids in model.routing_log:
        assert torch.equal(ids, expected)


def test_omitted_collectives_keep_shapes():
    omitted = OmittedCollectives(4)
    x = torch.randn(3, 5)
    assert omitted.all_reduce(x) is x
    assert torch.equal(omitted.all_gather(x), torch.cat([x] * 4, dim=-1))


def test_dispatch_inputs_are_the_partials_summed_split_and_gathered():
    """RankParallel.dispatch_inputs: with the omitted collectives one op writes the world's copies; with
    collectives that lack the fused gather, the op's one copy goes through their all_gather. Both give
    the split-order fp32 sum's router columns in fp32 and its latent columns rounded once to bf16."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    partials = torch.randn(3, 2, 8 + 24, generator=gen) * torch.tensor([1.0, 1e3, -1e3])[:, None, None]
    total = (partials[0] + partials[1]) + partials[2]
    want = (total[:, :8].repeat(1, 4), total[:, 8:].bfloat16().repeat(1, 4))

    class GatherOnly:  # real collectives: all_gather and all_reduce, no fused gather
        def all_gather(self, x):
            return torch.cat([x] * 4, dim=-1)

    for collectives in (OmittedCollectives(4), GatherOnly()):
        parallel = RankParallel(K3_TINY, Shard(0, 4), collectives)
        logits, latent = parallel.dispatch_inputs(partials, 8, torch.bfloat16)
        assert logits.dtype == torch.float32 and torch.equal(logits, want[0])
        assert latent.dtype == torch.bfloat16 and torch.equal(latent, want[1])
    with pytest.raises(ValueError, match="router_width"):
        parallel.dispatch_inputs(partials, 32, torch.bfloat16)
    with pytest.raises(ValueError, match="partials"):
        parallel.dispatch_inputs(partials.bfloat16(), 8, torch.bfloat16)


def test_rank_preset_builds_the_deployment_shape():
    """k3-rank at real dims, its first two layers (KDA + dense FFN, KDA + latent MoE): every tensor
    in the rank's shape, 56 experts per MoE layer, a verify step of the busiest rank's routing."""
    target = load_target("k3-rank", max_slots=1, max_seq_len=16, dtype=torch.bfloat16, layers=2)
    model = target.model
    assert model.shard == Shard(0, 16) and model.cfg == first_layers(K3, 2)
    held = {name: tuple(t.shape) for name, t in model.named_tensors()}
    specs = tensor_specs(model.cfg, model.shard)
    for name, (shape, _) in specs.items():
        if name in held:  # fused projections are held as row views of their GEMM's weight
            assert held[name] == shape, name
    assert model.moe[1].w1_packed.shape == (56, 3072, 1792)
    # the KDA input GEMM (4 x 768 + 128 + 6 rows) padded with zero rows to a multiple of 8 (CuTe tiles)
    fused, sizes = model.fused_inputs[0]
    assert sizes == [768] * 4 + [128, 6] and fused.shape[0] == 3208 and not fused[sum(sizes):].any()
    assert target.kda_state.shape[2:] == (6, 128, 128)
    model.routing_log = []
    out = target.verify([0], torch.randint(0, K3.vocab_size, (1, 8)), [8])
    assert out.logits.shape == (1, 8, K3.vocab_size) and torch.isfinite(out.logits).all()
    assert [len(ids.unique()) for ids in model.routing_log] == [12]


EIGHT_HEADS = dataclasses.replace(K3_TINY, kda_num_heads=8, mla_num_heads=8).validate()


@pytest.mark.parametrize("shard, cfg, words", [
    (Shard(2, 2), K3_TINY, "Shard.rank=2"), (Shard(-1, 2), K3_TINY, "Shard.rank=-1"),
    (Shard(0, 3), K3_TINY, "Shard.world=3: does not divide"),
    (Shard(0, 8), EIGHT_HEADS, "Shard.world=8: leaves 2 experts per rank, fewer than num_experts_per_token"),
])
def test_bad_shards_name_the_field(shard, cfg, words):
    with pytest.raises(ValueError, match=words.replace(".", r"\.")):
        shard.validate(cfg)


def test_layers_and_presets_are_checked():
    with pytest.raises(ValueError, match="layers=0"):
        first_layers(K3, 0)
    with pytest.raises(ValueError, match="layers=94"):
        load_target("k3-rank", max_slots=1, max_seq_len=16, layers=94)
    with pytest.raises(ValueError, match="k3-ranks"):
        load_target("k3-ranks", max_slots=1, max_seq_len=16)


def test_route_from_gathered_logits_is_moe_route():
    """The rank's router (logits of its experts, gathered, then ops.moe_route_logits) picks what
    the whole model's ops.moe_route picks: bit for bit from the same logits; from the gathered
    ones the same experts, weights to float32 rounding (the GEMMs of a part and of the whole
    round differently)."""
    from dspark.kernels import ops

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=gen)
    gate = torch.randn(16, 64, generator=gen) / 8
    bias = torch.randn(16, generator=gen) / 10
    ids, weights = ops.moe_route(x, gate, bias, 4, 2.5)
    scores = torch.sigmoid(x.double() @ gate.double().T)  # docs/kimi-k3.md §1.2, in float64
    chosen = torch.topk(scores + bias.double(), 4).indices
    assert torch.equal(ids, chosen)
    picked = scores.gather(1, chosen)
    torch.testing.assert_close(weights.double(), picked / picked.sum(1, keepdim=True) * 2.5, rtol=1e-6, atol=1e-6)
    same_ids, same_weights = ops.moe_route_logits(ops.linear(x, gate), bias, 4, 2.5)
    assert torch.equal(same_ids, ids) and torch.equal(same_weights, weights)
    gathered = torch.cat([ops.linear(x, part) for part in gate.chunk(4)], dim=-1)
    got_ids, got_weights = ops.moe_route_logits(gathered, bias, 4, 2.5)
    assert torch.equal(got_ids, ids)
    torch.testing.assert_close(got_weights, weights, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="top_k"):
        ops.moe_route_logits(gathered, bias, 17, 1.0)
