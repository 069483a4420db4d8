"""Launches of the DSpark drafter's greedy propose, counted on the CPU (tests/launch_counter.py) at a
rank's share of the K3 drafter's layout (k3-tiny's sizes, rank_share over 2), pinned so that they cannot
creep back. At a rank's share the propose is set by its launches, not its bytes (docs/kernels.md §10.11):
each residual add is done in the norm after it, SwiGLU's product in its activation's launch and RoPE in
MLA's absorb and cache-row ops, so a layer has no torch add, silu, product, rotation or cat between its
ops and GEMMs; with its projection pairs laid out as one weight each (pair_projections, as load_drafter
serves it on a GPU), gate|up and q_a|kv_a are one GEMM each; o_proj and down leave their split-K partials
to the norm after them (model.OUTPUTS_AS_PARTIALS_ON, counted here as a GPU runs it), so no reduction
launch follows them.
"""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from dspark.config import SamplingParams
from dspark.drafters.dspark import model as model_module
from dspark.drafters.dspark.config import K3_TINY_DSPARK, rank_share
from dspark.drafters.dspark.drafter import DSparkDrafter
from dspark.drafters.dspark.model import DSparkModel
from dspark.kernels import triton_common
from launch_counter import counting

LAYERS = K3_TINY_DSPARK.num_layers
# op calls per propose: two fused add + norms and one silu * up per layer, MLA's four ops over the cache
# (absorb_q rotates the queries' rope part, cache_rows the keys': no rotary op of their own; cache_rows
# also normalises c_q: no q_a norm of its own), and the Markov head's greedy chain
PINNED_OPS = {"add_rms_norm": 2 * LAYERS, "silu_mul": LAYERS, "linear_heads": LAYERS, "mla_absorb_q": LAYERS,
              "mla_cache_rows": LAYERS, "mla_verify_attention": LAYERS, "markov_greedy_draft": 1,
              "draft_confidence": 1, "linear_partials": 2 * LAYERS}  # o_proj and down, their partials added by the norms
# the torch GEMMs between them: q_a with kv_a, q_b and gate with up a layer (the pairs as one GEMM each once
# pair_projections laid them out, as load_drafter does on a GPU), and the lm_head
GEMMS = 3 * LAYERS + 1


def propose_launches(monkeypatch, dtype=torch.bfloat16, input_partials: bool = False):
    monkeypatch.setattr(model_module, "OUTPUTS_AS_PARTIALS_ON", ("cpu",))  # as on a GPU
    monkeypatch.setattr(model_module, "INPUTS_AS_PARTIALS_ON", ("cpu",) if input_partials else ())
    config = rank_share(K3_TINY_DSPARK, 2)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    table = torch.randn(config.vocab_size, config.hidden_size, generator=gen, dtype=dtype)
    model = DSparkModel(config, table, table * 0.1).to(dtype)
    model.pair_projections()
    drafter = DSparkDrafter(model, 1, max_seq_len=64)
    context = 20
    drafter.start(0, torch.randint(0, config.vocab_size, (context,), generator=gen),
                  {layer: torch.randn(context, config.target_hidden_size, generator=gen, dtype=dtype)
                   for layer in config.target_layer_ids})
    anchor = torch.randint(0, config.vocab_size, (1,), generator=gen)
    greedy = [SamplingParams(temperature=0.0)]
    drafter.propose([0], anchor, config.block_size, greedy, [None])  # first-call tables
    with counting() as launches:
        drafter.propose([0], anchor, config.block_size, greedy, [None])
    return launches


def test_a_propose_launches_the_pinned_ops_and_no_layer_glue(monkeypatch):
    launches = propose_launches(monkeypatch)
    assert dict(launches.ops) == PINNED_OPS, launches
    assert launches.glue["mm"] == GEMMS, launches
    assert not launches.syncs, f"the propose reads device values on the host: {launches}"
    # No torch add, silu or cat left between a layer's ops (the cache rows are kv_a's output as it is; the
    # q_a norm is in the cache rows' launch). The adds that remain: the eps of the first input norm,
    # unfused on the CPU (F.rms_norm's one launch on the GPU), the block's positions and the MLA op's
    # query ends. The dense block mask is never made: every layer attends over the cache in place
    # (BlockPass.mask is built on first use). After the greedy chain no torch op is left: the confidence
    # head's previous tokens, lookup, features, GEMV and sigmoid are draft_confidence's one launch.
    assert "silu" not in launches.glue and launches.glue["add"] == 1 + 2, launches
    assert not {"cat", "eye", "addmm", "sigmoid"} & set(launches.glue), launches
    # The setup before the first layer: the lengths' and the RoPE rows' gathers, the anchors' embedding
    # and one select against the mask token's row (model.DraftConstants holds what does not change);
    # no arange, compare, fill, copy, cos or sin. The greedy stage reads the head's bf16 product as it is.
    assert launches.glue["index_select"] == 2 and launches.glue["where"] == 1, launches
    made_per_pass = {"arange", "lt", "new_full", "copy_", "full_like", "ones_like", "fill_", "cos", "sin"}
    assert not made_per_pass & set(launches.glue), launches


def test_with_input_partials_the_consumers_add_the_gemms_splits(monkeypatch):
    """INPUTS_AS_PARTIALS_ON: each layer's paired q_a | kv_a and gate | up are the skinny GEMM's split-K
    partials (two more linear_partials op calls, two torch GEMMs fewer) and the cache rows' and the
    activation's launches add them: no other op or torch launch comes in."""
    launches = propose_launches(monkeypatch, input_partials=True)
    assert dict(launches.ops) == PINNED_OPS | {"linear_partials": 4 * LAYERS}, launches
    assert launches.glue["mm"] == GEMMS - 2 * LAYERS, launches
    default = propose_launches(monkeypatch)
    assert sum(launches.glue.values()) == sum(default.glue.values()) - 2 * LAYERS, (launches, default)


def test_the_drafter_benchs_switches_are_set_and_restored():
    """experiments/drafter_bench.py --setting draft_output_partials=0|1 flips model.OUTPUTS_AS_PARTIALS_ON
    for its block (on CUDA by default) and triton_pdl=0|1 triton_common.PDL, each restored after; another
    value is refused by name."""
    script = Path(__file__).resolve().parents[1] / "experiments" / "drafter_bench.py"
    sys.path.insert(0, str(script.parent))
    spec = importlib.util.spec_from_file_location("drafter_bench", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert model_module.OUTPUTS_AS_PARTIALS_ON == ("cuda",)
    with bench.switched("draft_output_partials=0", bench.SWITCHES):
        assert model_module.OUTPUTS_AS_PARTIALS_ON == ()
    assert model_module.OUTPUTS_AS_PARTIALS_ON == ("cuda",)
    with pytest.raises(SystemExit, match="draft_output_partials='2'"):
        with bench.switched("draft_output_partials=2", bench.SWITCHES):
            pass
    with bench.switched("draft_input_partials=1", bench.SWITCHES):
        assert model_module.INPUTS_AS_PARTIALS_ON == ("cuda",)
    assert model_module.INPUTS_AS_PARTIALS_ON == ()
    pdl = triton_common.PDL
    with bench.switched(f"triton_pdl={int(not pdl)}", bench.SWITCHES):
        assert triton_common.PDL is (not pdl)
    assert triton_common.PDL is pdl
