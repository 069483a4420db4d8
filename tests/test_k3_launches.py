"""Launches per layer of the K3 forward, counted on the CPU (tests/launch_counter.py), pinned so
that they cannot creep back (docs/kimi-k3.md §8.5).

A layer's count is the forward of the first i + 1 layers minus that of the first i (k3-tiny
keeps K3's layer pattern: layer 1 is KDA + latent MoE, layer 7 gated MLA + latent MoE, neither
sealing an AttnRes block). The rank is rank 0 of 4 with the busiest rank's routing and the
collectives omitted, as experiments/step_bench.py builds k3-rank; the whole model is k3-slice's
code path. Op calls are what the ops' kernels launch (one or a few each on the GPU); glue is the
torch ops between them, one GPU kernel each. A change that removes launches updates these pins.
The MLA layer has no rms_norm call: mla_cache_rows normalises the query's c_q (q_a_layernorm) in
the launch that writes the cache rows.
"""
import pytest
import torch

from dspark.targets.kimi_k3 import K3_TINY, K3Model, K3Target, Shard, first_layers
from dspark.targets.kimi_k3.model import DecodeState
from launch_counter import counting

KDA_MOE, MLA_MOE = 1, 7  # k3-tiny layers of each kind, away from a block seal

# {(world, layer): (op calls by op, glue by aten op)}
PINNED = {
    (4, KDA_MOE): ({"add_attn_res_mix_norm": 2, "linear": 2, "linear_partials": 3, "kda_verify": 1,
                    "moe_dispatch_inputs": 1, "moe_route_logits": 1, "moe_experts": 1, "moe_tail_inputs": 1},
                   {}),
    (4, MLA_MOE): ({"add_attn_res_mix_norm": 2, "linear": 1, "linear_partials": 4,
                    "mla_cache_rows": 1, "mla_absorb_q": 1, "mla_verify_attention": 1, "mla_absorb_output": 1,
                    "moe_dispatch_inputs": 1, "moe_route_logits": 1, "moe_experts": 1, "moe_tail_inputs": 1},
                   {}),
    (1, KDA_MOE): ({"add_attn_res_mix_norm": 2, "linear": 3, "linear_partials": 3, "kda_verify": 1, "moe_route": 1,
                    "moe_experts": 1, "moe_tail_inputs": 1},
                   {}),
    (1, MLA_MOE): ({"add_attn_res_mix_norm": 2, "linear": 2, "linear_partials": 4,
                    "mla_cache_rows": 1, "mla_absorb_q": 1, "mla_verify_attention": 1, "mla_absorb_output": 1,
                    "moe_route": 1, "moe_experts": 1, "moe_tail_inputs": 1},
                   {}),
}


def forward_launches(layers: int, world: int, batch: int, tokens: int):
    cfg = first_layers(K3_TINY, layers)
    shard = Shard(0, world)
    model = K3Model.random(cfg, seed=3, dtype=torch.bfloat16, shard=shard,
                           routing="busiest" if world > 1 else "exact")
    target = K3Target(model, max_slots=batch, max_seq_len=32)
    target.lengths.fill_(5)
    slots = torch.arange(batch)
    state = DecodeState(kda=target._kda_pools, mla=target._mla_pools, slots=slots,
                        cache_lens=target.lengths.index_select(0, slots))
    ids = torch.randint(0, cfg.vocab_size, (batch, tokens))
    lengths = torch.full((batch,), tokens)
    model.forward(ids, lengths, state)  # the first call builds the busiest rank's tables
    with counting() as launches:
        model.forward(ids, lengths, state)
    assert not launches.syncs, f"the forward reads device values on the host: {launches}"
    return launches


@pytest.mark.parametrize("world, layer", sorted(PINNED))
@pytest.mark.parametrize("batch, tokens", [(1, 8), (2, 3)])
def test_launches_per_layer_are_pinned(world, layer, batch, tokens):
    before = forward_launches(layer, world, batch, tokens)
    after = forward_launches(layer + 1, world, batch, tokens)
    ops, glue = after.ops - before.ops, after.glue - before.glue
    assert (before.ops - after.ops, before.glue - after.glue) == ({}, {})  # a layer only adds
    want_ops, want_glue = PINNED[world, layer]
    kind = K3_TINY.layer_type(layer)
    assert (dict(ops), dict(glue)) == (want_ops, want_glue), (
        f"world {world}, {kind} layer {layer}: {sum(ops.values())} op calls {dict(ops)}, "
        f"{sum(glue.values())} glue {dict(glue)}")


@pytest.mark.parametrize("world, layer", sorted(PINNED))
def test_without_split_k_into_consumers_three_gemms_a_layer_reduce_their_own_splits(world, layer, monkeypatch):
    """SPLIT_K_INTO_CONSUMERS (on): attention's and the FFN's output projections (layers 1 and 7 seal no
    block) hand their split-K partials to the mix norm, the shared gate|up GEMM to moe_tail_inputs, and an
    MLA layer's input GEMM to the cache rows' and the output gate's launches. Off, each is a linear
    again, one launch more on the GPU (its reduction)."""
    from dspark.targets.kimi_k3 import model as k3_model

    monkeypatch.setattr(k3_model, "SPLIT_K_INTO_CONSUMERS", False)
    before = forward_launches(layer, world, 1, 8)
    ops = forward_launches(layer + 1, world, 1, 8).ops - before.ops
    want_ops = dict(PINNED[world, layer][0])
    # a rank's one GEMM over the FFN's input keeps its partials (DISPATCH_IN_ONE_GEMM, INPUTS_IN_ONE_GEMM):
    # the shared gate|up's go with it
    reduced = (2 if world > 1 else 3) + (layer == MLA_MOE)
    want_ops["linear"] += reduced
    want_ops["linear_partials"] -= reduced
    assert dict(ops) == {op: n for op, n in want_ops.items() if n}


@pytest.mark.parametrize("layer", [KDA_MOE, MLA_MOE])
def test_without_the_dispatch_gemm_a_rank_runs_the_router_and_latent_down_apart(layer, monkeypatch):
    """DISPATCH_IN_ONE_GEMM (on): a rank's router and latent down are one GEMM whose partials
    moe_dispatch_inputs adds, splits and gathers. Off: the router's logits op, a linear and two
    gathers (repeat: the omitted collectives' copies)."""
    from dspark.targets.kimi_k3 import moe as k3_moe

    monkeypatch.setattr(k3_moe, "DISPATCH_IN_ONE_GEMM", False)
    before = forward_launches(layer, 4, 1, 8)
    after = forward_launches(layer + 1, 4, 1, 8)
    want_ops = dict(PINNED[4, layer][0])
    del want_ops["moe_dispatch_inputs"]
    # the router's logits op and latent down's linear in place of the inputs GEMM, the shared gate|up its
    # own GEMM's partials again
    want_ops.update(linear=want_ops["linear"] + 1, moe_router_logits=1)
    assert (dict(after.ops - before.ops), dict(after.glue - before.glue)) == (want_ops, {"repeat": 2})


@pytest.mark.parametrize("layer", [KDA_MOE, MLA_MOE])
def test_without_the_inputs_gemm_a_rank_runs_the_shared_gate_up_apart(layer, monkeypatch):
    """INPUTS_IN_ONE_GEMM (on): the shared experts' gate|up rows are in the rank's dispatch GEMM, its
    partials' column window going to moe_tail_inputs. Off: a GEMM of its own, one more launch."""
    from dspark.targets.kimi_k3 import moe as k3_moe

    monkeypatch.setattr(k3_moe, "INPUTS_IN_ONE_GEMM", False)
    before = forward_launches(layer, 4, 1, 8)
    after = forward_launches(layer + 1, 4, 1, 8)
    want_ops = dict(PINNED[4, layer][0])
    want_ops["linear_partials"] += 1
    assert (dict(after.ops - before.ops), dict(after.glue - before.glue)) == (want_ops, {})


def test_the_counter_sees_glue_and_op_calls_and_not_views():
    from dspark.kernels import ops

    x = torch.randn(4, 8)
    w = torch.randn(6, 8)
    with counting() as launches:
        y = ops.linear(x, w)  # one op call; its reference's own aten ops are not glue
        z = y[:, :3].contiguous() + 1.0  # a copy and an add
        z.view(-1).t()  # views: nothing
        torch.empty(3)  # an allocation: nothing
        float(z[0, 0])  # a host read
    assert dict(launches.ops) == {"linear": 1}
    assert dict(launches.glue) == {"clone": 1, "add": 1}
    assert dict(launches.syncs) == {"_local_scalar_dense": 1}
    assert launches.total == 3
