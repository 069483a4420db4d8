"""The CPU-checkable parts of experiments/step_bench.py on the rank (docs/kimi-k3.md §8): kernels
classed by the op that launched them, the layer count that fits a GPU, the floors from the
experts a step counted."""
import importlib.util
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dspark import roofline
from dspark.kernels import ops
from dspark.targets.kimi_k3 import K3, K3_SLICE, K3_TINY, K3Model, K3Target, Shard
from dspark.targets.kimi_k3.parallel import RankParallel
from dspark.targets.kimi_k3.weights import random_tensors

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "step_bench.py"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("step_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA


def cpu_event(name, parent=None, kernels=()):
    return SimpleNamespace(name=name, cpu_parent=parent, device_type=CPU,
                           kernels=[SimpleNamespace(name=k, duration=us) for k, us in kernels])


def device_event(name, us, annotation=False):
    return SimpleNamespace(name=name, device_type=CUDA, kernels=[], is_user_annotation=annotation,
                           time_range=SimpleNamespace(elapsed_us=lambda: us))


def test_kernels_take_the_class_of_the_outermost_scope_else_their_name(bench):
    experts = cpu_event("dspark:experts")
    linear_inside = cpu_event("dspark:trunk GEMMs", parent=experts)
    gemm_inside = cpu_event("aten::mm", parent=linear_inside, kernels=[("gemm_a", 5.0)])
    attention = cpu_event("dspark:attention", kernels=[("MlaVerify_k", 7.0)])
    glue = cpu_event("aten::add", kernels=[("add_kernel", 1.0)])
    device = [device_event("gemm_a", 5.0), device_event("MlaVerify_k", 7.0), device_event("add_kernel", 1.0),
              # launched twice, linked once: the other by name
              device_event("route_kernel", 2.0), device_event("KdaVerify_x", 3.0), device_event("KdaVerify_x", 3.0)]
    routing = cpu_event("dspark:routing", kernels=[("route_kernel", 2.0)])
    kda = cpu_event("dspark:KDA", kernels=[("KdaVerify_x", 3.0)])
    by_class, attribution = bench.kernels_by_class(
        [experts, linear_inside, gemm_inside, attention, glue, routing, kda, *device])
    assert by_class["experts"] == {"kernels": 1, "us": 5.0}
    assert by_class["attention"] == {"kernels": 1, "us": 7.0}
    assert by_class["norms/glue"] == {"kernels": 1, "us": 1.0}
    assert by_class["routing"] == {"kernels": 1, "us": 2.0}
    assert by_class["KDA"] == {"kernels": 2, "us": 6.0}
    assert attribution == {"scope": 5, "name": 1}
    assert sum(v["kernels"] for v in by_class.values()) == len(device)


def test_every_launch_is_classed_exactly_once_and_annotations_are_not_launches(bench):
    """What made the rank's GPU test read sum(by class) 99 != launches 98, and the k3-slice step
    read 185 launches for 123: a kernel the profiler linked to two CPU ops (or a link without its
    launch) counted twice, and the device-timeline ranges of the op scopes counted as launches."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    us = [float(u) for u in torch.rand(7, generator=gen) * 10 + 1]
    gemms = cpu_event("dspark:trunk GEMMs")
    # the same launch linked to its op and again to the op's parent; a link whose launch the
    # profile dropped; a legacy link of the scope's own range
    gemm = cpu_event("aten::mm", parent=gemms, kernels=[("nvjet_gemm", us[0])])
    gemm_again = cpu_event("aten::matmul", parent=gemms, kernels=[("nvjet_gemm", us[0]), ("lost_kernel", 1.0)])
    scope_range = cpu_event("dspark:experts", kernels=[("dspark:experts", 50.0)])
    experts = cpu_event("cute_call", parent=scope_range, kernels=[("expert_kernel_a", us[1])])
    glue = cpu_event("aten::add", kernels=[("add_kernel", us[2])])
    launches = [device_event("nvjet_gemm", us[0]), device_event("expert_kernel_a", us[1]),
                device_event("add_kernel", us[2]), device_event("Memcpy DtoD", us[3]),
                device_event("route_kernel", us[4])]
    annotations = [device_event("dspark:trunk GEMMs", 30.0, annotation=True),
                   device_event("dspark:experts", 50.0, annotation=True),
                   device_event("dspark:norms/glue", 5.0)]  # by its name alone
    events = [gemms, gemm, gemm_again, scope_range, experts, glue, *annotations, *launches]
    summary = bench.summarise_profile(events)
    by_class = summary["by_class"]
    assert summary["launches"] == len(launches) == sum(c["kernels"] for c in by_class.values())
    assert math.isclose(summary["gpu_kernel_ms"] * 1e3, sum(us[:5]))
    assert math.isclose(sum(c["us"] for c in by_class.values()), sum(us[:5]))
    assert {k: v["kernels"] for k, v in by_class.items() if v["kernels"]} == {
        "trunk GEMMs": 1, "experts": 1, "norms/glue": 2, "routing": 1}
    assert summary["attribution"] == {"scope": 3, "name": 2}
    assert not any(row["name"].startswith("dspark:") for row in summary["top"])


def test_the_slice_profile_counts_its_kernels_not_its_op_ranges(bench):
    """The k3-slice's 185 = 123 launches + 62 op ranges (one per op call that launched work,
    a slice profile's top list)."""
    ranges = [device_event(f"dspark:{cls}", 1.0, annotation=True) for cls, n in
              (("trunk GEMMs", 29), ("experts", 3), ("routing", 3), ("norms/glue", 19), ("KDA", 6),
               ("attention", 1), ("sampling", 1)) for _ in range(n)]
    kernels = [device_event(f"kernel_{j}", 1.0) for j in range(123)]
    summary = bench.summarise_profile(ranges + kernels)
    assert len(ranges) == 62 and summary["launches"] == 123


@pytest.mark.parametrize("name, cls", [
    ("kernel_cutlass_gemm_kernel_dsparkkernelslinearcute_sm90SkinnyGemmSm90_object_at__CopyAtom", "trunk GEMMs"),
    ("nvjet_sm90_tss_64x8_64x16_4x1_v_bz_splitK_TNT", "trunk GEMMs"),
    ("kernel_cutlass_reduce_kernel_tensorptrf32gmemalign16odiv716871div7168", "trunk GEMMs"),
    ("kernel_cutlass_expert_kernel_tma_dsparkkernelsmoecute_sm90MxFp4ExpertGemmSm90_object", "experts"),
    ("combine_kernel", "experts"), ("gather_tokens_kernel", "experts"),
    ("kernel_cutlass_lists_kernel_tensorptri64gmemo1", "experts"),
    ("kernel_cutlass_kernel_dsparkkernelsmlacute_sm90MlaVerifySm90_object_at", "attention"),
    ("kernel_cutlass_combine_kernel_tensorptrf32gmemalign16o512i64div512", "attention"),
    ("kernel_cutlass_verify_kernel_dsparkkernelskdacute_kernelKdaVerify_object", "KDA"),
    ("route_kernel", "routing"), ("router_logits_kernel", "routing"), ("accept", "sampling"),
    ("attn_res_mix_norm_kernel", "norms/glue"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>", "norms/glue"),
])
def test_kernel_names_of_an_h200_profile_are_classed(bench, name, cls):
    assert bench.class_of_kernel(name) == cls


def test_op_scopes_name_the_rank_step_and_restore_the_ops(bench):
    """A k3-tiny rank step profiled on the CPU under op_scopes: every class's scope is there, the
    reference MoE op's own linear calls sit inside the experts scope, and afterwards the ops are
    the originals again."""
    from torch.profiler import ProfilerActivity, profile

    originals = (ops.linear, ops.moe_router_logits, RankParallel.__dict__["all_gather"])
    shard = Shard(1, 2)
    model = K3Model(K3_TINY, random_tensors(K3_TINY, 2, torch.float32, "cpu", shard), shard=shard, routing="busiest")
    target = K3Target(model, max_slots=1, max_seq_len=16)
    with bench.op_scopes(), profile(activities=[ProfilerActivity.CPU]) as prof:
        target.verify([0], torch.tensor([[3, 4, 5]]), [3])
    assert (ops.linear, ops.moe_router_logits, RankParallel.__dict__["all_gather"]) == originals
    scopes = {event.name for event in prof.events() if event.name.startswith("dspark:")}
    assert scopes >= {"dspark:trunk GEMMs", "dspark:experts", "dspark:attention", "dspark:KDA", "dspark:routing",
                      "dspark:norms/glue", "dspark:collective stand-ins"}
    nested = [e for e in prof.events() if e.name == "dspark:trunk GEMMs" and bench.scope_class(e) == "experts"]
    assert nested  # the reference expert op multiplies through ops.linear


def test_layers_that_fit_fill_the_memory_given(bench):
    shard = Shard(0, 16)
    per_layer, outside = bench.layer_bytes(K3, shard)
    assert sum(per_layer) + outside == pytest.approx(sum(roofline.rank_weight_bytes(K3, shard).values()))
    for n in (1, 40, 93):
        need = outside + sum(per_layer[:n]) + bench.state_bytes(K3, shard, 2, 9000, n) + bench.WORKSPACE_BYTES
        assert bench.layers_that_fit(K3, shard, need, 2, 9000) == n
        if n < 93:
            assert bench.layers_that_fit(K3, shard, need + per_layer[n] / 2, 2, 9000) == n


def test_floors_from_counted_and_uniform_routing(bench):
    row = {"batch": 1, "T": 8, "context": 8192, "graph_ms": 4.0, "eager_ms": 9.0}
    bench.add_floors(row, K3_SLICE, Shard(), [100, 110, 120], 4.2e12)
    counted = roofline.step_cost(K3_SLICE, tokens_per_request=8, context=8192, routed_experts=110)
    assert row["floor_bytes"] == counted.total_bytes
    assert row["floor_ms"] == pytest.approx(1e3 * counted.total_bytes / 4.2e12)
    assert row["floor_fraction"] == pytest.approx(row["floor_ms"] / 4.0)
    assert row["uniform_experts_per_layer"] == pytest.approx(120.28, abs=0.01)
    assert row["floor_uniform_ms"] > row["floor_ms"]  # 110 experts counted against 120.28 expected
    assert row["mode"] == "graph" and row["ms_per_layer"] == 1.0
    rank_row = {"batch": 1, "T": 1, "context": 8192, "eager_ms": 5.0}
    bench.add_floors(rank_row, K3, Shard(0, 16), [3] * 92, 4.2e12)
    assert rank_row["mode"] == "eager"
    assert rank_row["floor_bytes"] == roofline.step_cost(K3, context=8192, shard=Shard(0, 16), routed_experts=3).total_bytes


def test_a_step_that_would_fall_back_to_a_host_reading_reference_stops_before_timing(bench, monkeypatch, capsys):
    """check_capturable names the op whose implementation reads device values on the host; main
    turns it into one line on stderr and exit 2. fallbacks counts every fallback by op."""
    import dataclasses

    from dspark.kernels import registry

    reference = registry.implementations("mla_verify_attention")["reference"]
    linear_reference = registry.implementations("linear")["reference"]
    shapes = (((2, 8, 6, 512), torch.bfloat16),)
    mla = registry.Selection("mla_verify_attention", "cuda:0", reference, "cute_sm90", shapes)
    gemm = registry.Selection("linear", "cuda:0", linear_reference, "cute_sm90", (((32, 7168), torch.bfloat16),))
    assert bench.fallbacks([gemm, gemm, mla]) == {"linear: cute_sm90 -> reference": 2,
                                                  "mla_verify_attention: cute_sm90 -> reference": 1}
    bench.check_capturable([gemm], "k3-rank B=4")  # cuBLAS: captured like any kernel
    bench.check_capturable([dataclasses.replace(mla, device="cpu")], "on the CPU")
    with pytest.raises(bench.StepNotCapturable, match=r"k3-rank B=2 .*mla_verify_attention on cuda:0 ran 'reference' "
                                                      r"\('cute_sm90' does not take arguments"):
        bench.check_capturable([gemm, mla], "k3-rank B=2 context=8192 T=8")

    def stop(args):
        raise bench.StepNotCapturable("k3-rank B=2 context=8192 T=8: cannot be graphed")

    monkeypatch.setattr(bench, "run", stop)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert bench.main(["--target", "k3-rank", "--layers", "2", "--batch", "2"]) == 2
    err = capsys.readouterr().err
    assert err == "step_bench: k3-rank B=2 context=8192 T=8: cannot be graphed\n"


def test_a_cpu_verify_records_every_op_and_blocks_nothing(bench):
    from dspark.kernels import registry

    target = K3Target(K3Model.random(K3_TINY, seed=1), max_slots=2, max_seq_len=16)
    with registry.record_selections() as seen:
        target.verify([0, 1], torch.randint(0, K3_TINY.vocab_size, (2, 3)), [3, 2])
    ran = {s.op for s in seen}
    assert {"linear", "kda_verify", "mla_verify_attention", "moe_route", "moe_experts", "rms_norm"} <= ran
    assert all(s.chosen.name == "reference" and not s.fallback for s in seen)
    assert not any(s.blocks_capture for s in seen)


def test_the_launch_switches_are_set_and_restored(bench):
    from dspark.kernels import triton_common
    from dspark.kernels.linear import cute_host

    # the defaults until measured at the rank's shapes
    assert cute_host.FUSED_REDUCE is False and triton_common.PDL is False and cute_host.HOPPER_MAX_TOKENS == 16
    with bench.applied("linear_fused_reduce=1,triton_pdl=1,linear_hopper_rows=64"):
        assert cute_host.FUSED_REDUCE is True and triton_common.PDL is True and cute_host.HOPPER_MAX_TOKENS == 64
    assert cute_host.FUSED_REDUCE is False and triton_common.PDL is False and cute_host.HOPPER_MAX_TOKENS == 16
    with pytest.raises(SystemExit, match="linear_fused_reduce='2'"):
        with bench.applied("linear_fused_reduce=2"):
            pass


def test_the_glue_switches_are_set_and_restored(bench):
    """mix_tiles (the AttnRes mix's checkpoints in 2-D tiles) and tail_block (the MoE tail's shared columns
    per program): off and 1024 until measured on a GPU."""
    from dspark.kernels.moe import triton as moe_triton
    from dspark.kernels.rmsnorm import triton as norm_triton

    assert norm_triton.MIX_SCORE_TILES is False and moe_triton.TAIL_BLOCK == 1024
    with bench.applied("mix_tiles=1,tail_block=256"):
        assert norm_triton.MIX_SCORE_TILES is True and moe_triton.TAIL_BLOCK == 256
        assert norm_triton.score_tile(3) == 4 and norm_triton.score_tile(8) == 2 and norm_triton.score_tile(0) == 0
    assert norm_triton.MIX_SCORE_TILES is False and moe_triton.TAIL_BLOCK == 1024
    assert norm_triton.score_tile(8) == 0
    with pytest.raises(SystemExit, match="tail_block='300'"):
        with bench.applied("tail_block=300"):
            pass


def test_the_router_logits_rows_are_a_switch_one_by_default(bench):
    from dspark.kernels.moe import triton as moe_triton

    assert moe_triton.GEMV_MAX_ROWS == 1  # one row in one launch: measured faster than cuBLAS's; 2-4 rows are not
    with bench.applied("router_gemv_rows=0"):
        assert moe_triton.GEMV_MAX_ROWS == 0
    assert moe_triton.GEMV_MAX_ROWS == 1
    with pytest.raises(SystemExit, match="router_gemv_rows='3'"):
        with bench.applied("router_gemv_rows=3"):
            pass


def test_the_expert_kernels_k_split_is_a_switch_off_by_default(bench):
    from dspark.kernels import cute_common

    if not cute_common.cutlass_available():
        pytest.skip("nvidia-cutlass-dsl not installed")
    from dspark.kernels.moe import cute_sm90

    assert cute_sm90.PASS2_SPLITS == 1  # until the rank's step measures it
    with bench.applied("moe_pass2_splits=auto"):
        assert cute_sm90.PASS2_SPLITS == "auto"
    assert cute_sm90.PASS2_SPLITS == 1
    with pytest.raises(SystemExit, match="moe_pass2_splits='5'"):
        with bench.applied("moe_pass2_splits=5"):
            pass
