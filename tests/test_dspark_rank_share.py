"""One tensor-parallel rank's share of the DSpark drafter (drafters/dspark/config.py rank_share,
docs/kimi-k3.md §8.6): what the drafter bench times at the rank's shape."""
import dataclasses

import pytest
import torch

from dspark.config import SamplingParams
from dspark.drafters.dspark.config import K3_DSPARK, K3_TINY_DSPARK, rank_share
from dspark.drafters.dspark.drafter import DSparkDrafter
from dspark.drafters.dspark.model import DSparkModel

# The tensors a rank divides, by name suffix; every other one is whole. markov_w1 is divided
# only because its rows are the vocabulary's: a real rank keeps it whole (each needs all of
# W1[previous token]), and a lookup reads one row of either.
SPLIT_ROWS = ("q_b_proj.weight", "kv_b_proj.weight", "gate_proj.weight", "up_proj.weight", "markov_w1.weight",
              "markov_w2.weight", "q_proj.weight", "k_proj.weight", "v_proj.weight")
SPLIT_COLUMNS = ("o_proj.weight", "down_proj.weight")


def build(config):
    torch.manual_seed(0)
    table = torch.randn(config.vocab_size, config.hidden_size) * 0.02
    return DSparkModel(config, table, table.clone())


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("attention_type", ["mla", "gqa"])
def test_every_tensor_of_the_share_is_the_whole_or_its_rank_slice(world, attention_type):
    whole = dataclasses.replace(K3_TINY_DSPARK, attention_type=attention_type, num_kv_heads=4, head_dim=16)
    full, share = build(whole.validate()), build(rank_share(whole, world))
    shapes = {name: tuple(p.shape) for name, p in share.named_parameters()}
    assert set(shapes) == {name for name, _ in full.named_parameters()}
    for name, p in full.named_parameters():
        want = list(p.shape)
        if name.endswith(SPLIT_ROWS):
            want[0] //= world
        elif name.endswith(SPLIT_COLUMNS):
            want[1] //= world
        assert shapes[name] == tuple(want), name
    assert share.lm_head.shape[0] == full.lm_head.shape[0] // world


def test_the_k3_share_at_tp16_holds_what_a_rank_holds():
    share = rank_share(K3_DSPARK, 16)
    assert (share.num_heads, share.intermediate_size, share.vocab_size) == (4, 896, 10240)
    assert (share.q_lora_rank, share.kv_lora_rank, share.markov_rank, share.hidden_size) == (1536, 512, 256, 7168)
    assert share.mask_token_id == 163837 - 15 * 10240  # the last rank's local row of the mask token
    assert rank_share(K3_DSPARK, 1) is K3_DSPARK


def test_a_share_drafts_a_block():
    share = rank_share(K3_TINY_DSPARK, 4)
    drafter = DSparkDrafter(build(share), 1, max_seq_len=64)
    g = torch.Generator().manual_seed(1)
    drafter.start(0, torch.randint(0, share.vocab_size, (20,), generator=g),
                  {layer: torch.randn(20, share.target_hidden_size, generator=g) for layer in share.target_layer_ids})
    proposal = drafter.propose([0], torch.tensor([3]), share.block_size, [SamplingParams(temperature=0.0)], [None])
    assert proposal.tokens.shape == (1, share.block_size)
    assert 0 <= int(proposal.tokens.min()) and int(proposal.tokens.max()) < share.vocab_size


@pytest.mark.parametrize("world, message", [
    (0, "world=0: must be an integer >= 1"),
    (3, "world=3: does not divide DSparkConfig.num_heads=4"),
    (8, "world=8: does not divide DSparkConfig.num_heads=4"),
])
def test_a_world_that_cannot_split_the_drafter_is_named(world, message):
    with pytest.raises(ValueError, match=message):
        rank_share(K3_TINY_DSPARK, world)


def test_a_mask_row_outside_the_last_rank_is_named():
    config = dataclasses.replace(K3_TINY_DSPARK, mask_token_id=5).validate()
    with pytest.raises(ValueError, match=r"mask_token_id=5 is not in the last rank's rows \[192, 256\)"):
        rank_share(config, 4)
