"""CPU-only compile checks of the CuTe DSL KDA verify/commit kernels (kernels/kda/cute_kernel.py).

Nothing runs here (no GPU): each variant is traced, lowered and assembled by ptxas for Hopper
(sm_90a) and GB300 (sm_103a) at Kimi K3 dims (H=96 heads are a runtime grid size; D=128 is
compiled in) for T in {1, 8}, and the PTX is checked for what the design relies on: no local
memory for the register-resident state; in the V-split variant the cluster exchange for the
head-wide RMSNorm ordered after its barrier; fast math without IEEE division slow paths; the
TMA-unit state copy (bulk_state) armed on an mbarrier and waited for; per-block named barriers
(group_sync); the slot-indexed builds' one load of the request's slot.
The argument checks of the torch wrappers run on CPU tensors without compiling anything.
"""
import re
import subprocess
import sys

import pytest
import torch

from dspark.kernels import cute_common
from dspark.kernels.kda import cute_host as kda_cute

needs_cutlass = pytest.mark.skipif(not cute_common.cutlass_available(), reason="nvidia-cutlass-dsl / tvm-ffi not installed")

HEAD_DIM = 128  # Kimi K3 KDA head_dim (docs/kimi-k3.md §1.2)


def _ptx_of(compiled, tmp_path) -> str:
    ptx = compiled.__ptx__
    if ptx is None:  # some versions only write the file
        files = sorted(tmp_path.glob("*.ptx"))
        assert files, "no PTX was written"
        ptx = files[-1].read_text()
    return ptx


@needs_cutlass
@pytest.mark.parametrize("arch, tokens", [("sm_90a", 8), ("sm_103a", 1)])
def test_default_verify_compiles_without_spills(arch, tokens, tmp_path):
    block_v = kda_cute.default_variant(HEAD_DIM, "verify")["block_v"]  # one CTA per head: no cluster
    compiled = kda_cute.compile_verify(arch, HEAD_DIM, block_v, tokens, torch.bfloat16, torch.bfloat16,
                                       extra_options=("--keep-ptx", f"--dump-dir {tmp_path}"))
    ptx = _ptx_of(compiled, tmp_path)
    assert f".target {arch}" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx  # state slice stays in registers


@needs_cutlass
@pytest.mark.parametrize("arch", ["sm_90a", "sm_103a"])
def test_v_split_verify_compiles_with_the_cluster_exchange(arch, tmp_path):
    compiled = kda_cute.compile_verify(arch, HEAD_DIM, 32, 8, torch.bfloat16, torch.bfloat16,
                                       extra_options=("--keep-ptx", f"--dump-dir {tmp_path}"))
    ptx = _ptx_of(compiled, tmp_path)
    assert "ld.shared::cluster" in ptx and "barrier.cluster.wait" in ptx  # V-split RMSNorm exchange
    # the remote reads must stay after the cluster barrier that publishes the partial sums
    assert ptx.index("barrier.cluster.wait") < ptx.index("ld.shared::cluster")
    assert "ld.local" not in ptx and "st.local" not in ptx


@needs_cutlass
@pytest.mark.parametrize("arch", ["sm_90a", "sm_103a"])
def test_commit_compiles_without_spills(arch, tmp_path):
    compiled = kda_cute.compile_commit(arch, HEAD_DIM, kda_cute.default_variant(HEAD_DIM, "commit")["block_v"], torch.bfloat16,
                                       extra_options=("--keep-ptx", f"--dump-dir {tmp_path}"))
    ptx = _ptx_of(compiled, tmp_path)
    assert f".target {arch}" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx


@needs_cutlass
@pytest.mark.parametrize("arch, block_v, cols, row_chunks", [("sm_90a", 128, 2, 8), ("sm_103a", 128, 4, 8)])
def test_fast_math_layouts_compile_without_ieee_division(arch, block_v, cols, row_chunks, tmp_path):
    """The layout options (columns per thread, row chunks) and fast math: no local memory, and
    the sigmoids and L2 norms use approximate reciprocals (no div.rn / rcp.rn slow paths)."""
    compiled = kda_cute.compile_verify(arch, HEAD_DIM, block_v, 8, torch.bfloat16, torch.bfloat16,
                                       extra_options=("--keep-ptx", f"--dump-dir {tmp_path}"), cols=cols,
                                       row_chunks=row_chunks, fast_math=True)
    ptx = _ptx_of(compiled, tmp_path)
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert "div.rn.f32" not in ptx and "rcp.rn.f32" not in ptx and "rcp.approx" in ptx


@needs_cutlass
@pytest.mark.parametrize("arch, block_v", [("sm_90a", 128), ("sm_103a", 32)])
def test_bulk_state_variants_copy_the_state_on_the_tma_unit(arch, block_v, tmp_path):
    """bulk_state: the state slice arrives by cp.async.bulk on an mbarrier, waited for before use
    (a whole-head slice is 32 pieces issued by warp 0; a narrower one is one copy per row)."""
    options = ("--keep-ptx", f"--dump-dir {tmp_path}")
    verify = kda_cute.compile_verify(arch, HEAD_DIM, block_v, 8, torch.bfloat16, torch.bfloat16, extra_options=options,
                                     bulk_state=True)
    commit = kda_cute.compile_commit(arch, HEAD_DIM, block_v, torch.bfloat16, extra_options=options, bulk_state=True)
    for ptx in (_ptx_of(verify, tmp_path), _ptx_of(commit, tmp_path)):
        assert "ld.local" not in ptx and "st.local" not in ptx
        copy = ptx.index("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes")
        assert ptx.index("mbarrier.init") < copy < ptx.index("mbarrier.try_wait.parity")
        assert "mbarrier.arrive.expect_tx" in ptx


@needs_cutlass
@pytest.mark.parametrize("arch", ["sm_90a", "sm_103a"])
def test_slot_indexed_builds_read_the_slot_once_after_the_pdl_wait(arch, tmp_path):
    """The default verify and commit variants built for slot pools (K3Target's calls): each CTA
    loads its request's slot, the build's only 64-bit global load, after the programmatic-launch
    wait (a graph's previous node may write the slots) and before the state copy that starts at
    the slot's row; the unindexed builds load no slot."""
    options = ("--keep-ptx", f"--dump-dir {tmp_path}")
    verify_options = kda_cute.default_variant(HEAD_DIM, "verify")
    commit_options = kda_cute.default_variant(HEAD_DIM, "commit")
    assert verify_options["pdl"] and verify_options["bulk_state"] and commit_options["pdl"]
    verify_block_v, commit_block_v = verify_options.pop("block_v"), commit_options.pop("block_v")
    for slot_indexed in (True, False):
        verify = kda_cute.compile_verify(arch, HEAD_DIM, verify_block_v, 8, torch.bfloat16, torch.bfloat16,
                                         extra_options=options, slot_indexed=slot_indexed, **verify_options)
        commit = kda_cute.compile_commit(arch, HEAD_DIM, commit_block_v, torch.bfloat16, extra_options=options,
                                         slot_indexed=slot_indexed, **commit_options)
        for ptx in (_ptx_of(verify, tmp_path), _ptx_of(commit, tmp_path)):
            assert f".target {arch}" in ptx and "ld.local" not in ptx and "st.local" not in ptx
            assert ptx.count("ld.global.b64") == (1 if slot_indexed else 0)
            if slot_indexed:
                slot_load = ptx.index("ld.global.b64")
                assert ptx.index("griddepcontrol.wait") < slot_load < ptx.index("cp.async.bulk")


def _pools(B=2, S=5, layers=3, T=2, H=2, D=32):
    """Per-layer views of 5-D pools [S, layers, ...] (what K3Target passes), B slots and records."""
    W = H * D
    args = _small_inputs(B=B, T=T, H=H, D=D)
    args["state"] = torch.randn(S, layers, H, D, D)[:, 1]
    args["conv_state"] = torch.randn(S, layers, 3, W, 3)[:, 1]
    records = kda_cute.allocate_records(B, T, H, D, torch.float32, "cpu", args["lengths"])
    return args, torch.tensor([4, 0]), records


@pytest.mark.parametrize("slots", [torch.tensor([4]), torch.tensor([[4, 0]]), torch.tensor([4, 0], dtype=torch.int32),
                                   torch.tensor([4.0, 0.0]), None])
def test_slot_pools_are_checked_naming_the_field(slots):
    """Bad slots (shape, dtype) and a pool passed without slots are refused before any compile;
    slot values are the caller's contract (never read on the host)."""
    args, _, records = _pools()
    field = "slots" if slots is not None else "state.shape"
    with pytest.raises(ValueError, match=field):
        kda_cute.verify(*args.values(), lower_bound=-5.0, eps=1e-5, arch="sm_90a", slots=slots)
    with pytest.raises(ValueError, match="slots" if slots is not None else "states.shape"):
        kda_cute.commit(args["state"], args["conv_state"], records, torch.tensor([1, 1]), arch="sm_90a", slots=slots)


def test_slot_pools_need_contiguous_rows_and_one_row_count():
    args, slots, records = _pools()
    rows_strided = torch.randn(5, 2, 32, 64)[..., :32]  # [S, H, D, D] whose rows are not contiguous
    with pytest.raises(ValueError, match="state.stride"):
        kda_cute.verify(*dict(args, state=rows_strided).values(), lower_bound=-5.0, eps=1e-5, arch="sm_90a",
                        slots=slots)
    with pytest.raises(ValueError, match="states.stride"):
        kda_cute.commit(rows_strided, args["conv_state"], records, torch.tensor([1, 1]), arch="sm_90a", slots=slots)
    with pytest.raises(ValueError, match="conv_state.shape"):
        kda_cute.verify(*dict(args, conv_state=args["conv_state"][:4]).values(), lower_bound=-5.0, eps=1e-5,
                        arch="sm_90a", slots=slots)


@needs_cutlass
def test_group_sync_waits_on_one_named_barrier_per_column_block(tmp_path):
    """group_sync: the step barrier spans the 4 row-chunk warps (128 threads) of a column block,
    under a barrier id that depends on the warp (1 + column block), not the CTA-wide barrier 0."""
    compiled = kda_cute.compile_verify("sm_90a", HEAD_DIM, 128, 8, torch.bfloat16, torch.bfloat16,
                                       extra_options=("--keep-ptx", f"--dump-dir {tmp_path}"), group_sync=True)
    ptx = _ptx_of(compiled, tmp_path)
    assert re.search(r"bar\.sync\s+%r\d+, 128;", ptx)
    assert "ld.local" not in ptx and "st.local" not in ptx


@pytest.mark.parametrize(
    "block_v, cols, row_chunks, field",
    [(128, 3, 4, "cols"), (32, 2, 4, "cols"), (128, 1, 16, "row_chunks"), (32, 1, 2, "row_chunks"),
     (128, 4, 2, "row_chunks")],
)
def test_layout_options_are_checked_naming_the_field(block_v, cols, row_chunks, field):
    with pytest.raises(ValueError, match=field):
        kda_cute.compile_verify("sm_90a", HEAD_DIM, block_v, 8, torch.bfloat16, torch.bfloat16, cols=cols,
                                row_chunks=row_chunks)
    with pytest.raises(ValueError, match=field):
        kda_cute.compile_commit("sm_90a", HEAD_DIM, block_v, torch.bfloat16, cols=cols, row_chunks=row_chunks)


def _small_inputs(B=1, T=2, H=2, D=32):
    W = H * D
    r = torch.randn
    return dict(
        q_in=r(B, T, W), k_in=r(B, T, W), v_in=r(B, T, W), f=r(B, T, W), beta_in=r(B, T, H), gate_in=r(B, T, W),
        conv_weight=r(3, W, 4), conv_state=r(B, 3, W, 3), A_log=r(H), dt_bias=r(W), o_norm_weight=r(D),
        state=r(B, H, D, D), lengths=torch.full((B,), T),
    )


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(q_in=torch.randn(1, 17, 64), k_in=torch.randn(1, 17, 64), v_in=torch.randn(1, 17, 64),
              f=torch.randn(1, 17, 64), gate_in=torch.randn(1, 17, 64), beta_in=torch.randn(1, 17, 2)), "T"),
        (dict(state=torch.randn(1, 2, 16, 16)), "head_dim"),
        (dict(conv_weight=torch.randn(3, 64, 3)), "conv_weight"),
        (dict(dt_bias=torch.randn(64).double()), "dt_bias"),
        (dict(lengths=torch.ones(1)), "lengths"),
    ],
)
def test_verify_rejects_bad_arguments_naming_the_field(change, field):
    args = _small_inputs()
    args.update(change)
    with pytest.raises(ValueError, match=field):
        kda_cute.verify(*args.values(), lower_bound=-5.0, eps=1e-5, arch="sm_90a")


def test_commit_rejects_bad_shapes_naming_the_field():
    state = torch.randn(1, 2, 32, 32)
    conv_state = torch.randn(1, 3, 64, 3)
    records = kda_cute.allocate_records(1, 2, 2, 32, torch.float32, "cpu", torch.tensor([2]))
    with pytest.raises(ValueError, match="conv_states.shape"):
        kda_cute.commit(state, conv_state[:, :, :32], records, torch.tensor([1]), arch="sm_90a")
    with pytest.raises(ValueError, match="num_tokens.shape"):
        kda_cute.commit(state, conv_state, records, torch.tensor([1, 1, 1]), arch="sm_90a")
    with pytest.raises(ValueError, match="records.conv_inputs"):
        kda_cute.commit(state, conv_state.double(), records, torch.tensor([1]), arch="sm_90a")


def test_registry_sends_shapes_the_kernels_do_not_take_to_the_reference():
    args = _small_inputs(D=16)  # k3-tiny's head_dim: below the kernels' 32-column warps
    assert not kda_cute.supports_verify(*args.values())
    assert not kda_cute.supports_commit(args["state"], args["conv_state"])
    k3 = _small_inputs(H=1, D=128, T=8)
    assert kda_cute.supports_verify(*k3.values()) and kda_cute.supports_commit(k3["state"], k3["conv_state"])


@pytest.mark.parametrize("option, field", [(dict(block_v=32), "block_v=32"), (dict(bulk_state=False), "bulk_state")])
def test_verify_variants_not_verified_bitwise_are_refused_unless_asked_for(option, field):
    """V-split verify and register state loads are benchmark-only (experimental_variant=True):
    the refusal names the option; asked for, they pass on to the argument checks."""
    args = _small_inputs(D=64)
    with pytest.raises(ValueError, match=field):
        kda_cute.verify(*args.values(), lower_bound=-5.0, eps=1e-5, arch="sm_90a", **option)
    args["lengths"] = torch.ones(1)  # a float tensor: the next check down refuses it
    with pytest.raises(ValueError, match="lengths"):
        kda_cute.verify(*args.values(), lower_bound=-5.0, eps=1e-5, arch="sm_90a", experimental_variant=True, **option)


def test_kernel_modules_are_imported_by_their_first_call_not_by_the_registry():
    """Importing dspark.kernels and listing every op's implementations imports no cutlass; a CuTe
    DSL implementation's module (cutlass at its top) is imported by its first call."""
    code = """
import sys
import torch
from dspark.kernels import ops, registry
for op in ("linear", "kda_verify", "kda_commit", "kda_commit_layers", "mla_verify_attention"):
    registry.implementations(op)
print(sorted(m for m in sys.modules if m.split(".")[0] in ("cutlass", "tvm_ffi")))
linear = registry.implementations("linear")["cute_sm90"].fn
assert "dspark.kernels.linear.cute_sm90" not in sys.modules
if registry.implementations("linear")["cute_sm90"].available():
    try:
        linear(torch.ones(2, 64, dtype=torch.bfloat16), torch.ones(8, 64, dtype=torch.bfloat16))
    except ValueError as error:  # CPU tensors: the kernel module's own check refuses them
        print("refused:", error)
    print("dspark.kernels.linear.cute_sm90" in sys.modules)
"""
    lines = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert lines[0] == "[]"
    if cute_common.cutlass_available():
        assert lines[1].startswith("refused: cute_sm90 linear: unsupported x") and lines[2] == "True"
