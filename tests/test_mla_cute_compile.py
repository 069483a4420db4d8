"""CPU-only compile checks of the CuTe DSL MLA verify attention (docs/kernels.md §1.4 tier (b)).

Nothing runs here (no GPU): each variant is traced, lowered and assembled for its target with the
target named explicitly, and the PTX must contain the tensor-core instructions the design relies
on: WGMMA m64n32k16 (Q.K^T, per warpgroup) and m64n256k16 (P.V) for sm_90a, plus TMA and PDL;
mma.sync m16n8k16 fed by ldmatrix (.trans for V) for the never-run sm_100a/sm_103a build.
The host-side heuristics and argument checks are tested too. Skips without nvidia-cutlass-dsl.
"""
import pytest
import torch

from dspark.kernels import cute_common
from dspark.kernels.mla import cute_host as mla_common

if cute_common.cutlass_available():
    from dspark.kernels.mla import cute_sm90, cute_sm100

needs_cutlass = pytest.mark.skipif(not cute_common.cutlass_available(), reason="nvidia-cutlass-dsl not installed")
HEADS = 96
RANK_HEADS = 96 // 16  # one rank of K3 served TP16 (docs/kimi-k3.md §8)


@pytest.fixture(autouse=True)
def _ptx_dump_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --keep-ptx writes the .ptx into the working directory


@needs_cutlass
@pytest.mark.parametrize("split_kv", [False, True])
def test_sm90a_compiles_to_wgmma_with_tma_and_pdl(split_kv):
    # the split-S structure: each warpgroup computes S for 32 keys and exchanges row maxima
    compiled = cute_sm90.compile_mla_verify(
        HEADS, split_kv, torch.int64, "sm_90a", extra_options=("--keep-ptx",), qk_one_warpgroup=False
    )
    ptx = compiled.__ptx__
    assert "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16" in ptx  # S = Q.K^T
    assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16" in ptx  # O += P.V
    assert "cp.async.bulk.tensor" in ptx  # TMA loads of Q and the cache
    assert "griddepcontrol.wait" in ptx  # PDL
    assert "bar.sync" in ptx or "barrier.sync" in ptx  # named barriers between the warpgroups
    # the split variant launches the combine kernel after the attention kernel
    assert ptx.count(".entry") == (2 if split_kv else 1)


@needs_cutlass
def test_sm90a_producer_warpgroup_variant_moves_registers_with_setmaxnreg():
    compiled = cute_sm90.compile_mla_verify(
        HEADS, True, torch.int64, "sm_90a", extra_options=("--keep-ptx",), producer_warpgroup=True,
        qk_one_warpgroup=False,
    )
    ptx = compiled.__ptx__
    assert f"setmaxnreg.dec.sync.aligned.u32 \t{cute_sm90.PRODUCER_REGS};" in ptx
    assert f"setmaxnreg.inc.sync.aligned.u32 \t{cute_sm90.MATH_REGS};" in ptx
    assert ".reqntid 384, 1, 1" in ptx  # 2 math warpgroups + 1 producer warpgroup
    assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16" in ptx


@needs_cutlass
def test_sm90a_default_qk_one_warpgroup_uses_full_width_qk():
    assert cute_sm90.resolve_variant()["qk_one_warpgroup"]  # the measured-fastest default
    compiled = cute_sm90.compile_mla_verify(HEADS, True, torch.int64, "sm_90a", extra_options=("--keep-ptx",))
    ptx = compiled.__ptx__
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in ptx  # all of S in warpgroup 0
    assert "wgmma.mma_async.sync.aligned.m64n32k16" not in ptx
    assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16" in ptx
    assert ".reqntid 384, 1, 1" in ptx and "bar.arrive" in ptx  # producer warpgroup; P handed over
    assert "cp.async.bulk.prefetch" not in ptx
    prefetching = cute_sm90.compile_mla_verify(
        HEADS, True, torch.int64, "sm_90a", extra_options=("--keep-ptx",), l2_prefetch=True
    )
    assert "cp.async.bulk.prefetch.tensor.3d.L2.global.tile" in prefetching.__ptx__


@needs_cutlass
def test_sm90a_cluster_pairs_load_cache_tiles_with_tma_multicast():
    compiled = cute_sm90.compile_mla_verify(
        HEADS, True, torch.int64, "sm_90a", extra_options=("--keep-ptx",), cluster_pairs=True,
        partial_dtype=torch.bfloat16,
    )
    ptx = compiled.__ptx__
    assert "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster" in ptx
    assert "mapa.shared::cluster" in ptx  # consumers release the stage in the partner CTA too
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in ptx


@needs_cutlass
@pytest.mark.parametrize("arch,split_kv", [("sm_103a", False), ("sm_103a", True), ("sm_100a", True)])
def test_blackwell_compiles_to_mma_sync_with_tma_and_pdl(arch, split_kv):
    # This variant has never run (no Blackwell GPU here): compiling is all the checking it gets.
    compiled = cute_sm100.compile_mla_verify(HEADS, split_kv, torch.int64, arch, extra_options=("--keep-ptx",))
    ptx = compiled.__ptx__
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx  # V read MN-major
    assert "wgmma" not in ptx  # Hopper-only instruction
    assert "cp.async.bulk.tensor" in ptx and "griddepcontrol.wait" in ptx
    assert ptx.count(".entry") == (2 if split_kv else 1)


@needs_cutlass
def test_each_build_refuses_the_other_architecture():
    with pytest.raises(ValueError, match="arch"):
        cute_sm100.compile_mla_verify(HEADS, True, torch.int64, "sm_90a")
    with pytest.raises(ValueError, match="arch"):
        cute_sm90.compile_mla_verify(HEADS, True, torch.int64, "sm_103a")


@needs_cutlass
def test_v_view_reads_the_same_bytes_as_k_view():
    # The design loads each cache tile once: block b of the c_kv part is K (keys x 64 dims,
    # K-major) for Q.K^T and, unchanged, V (dims x keys, MN-major) for P.V. Both views must map
    # every (key, dim, stage) to the same shared-memory offset and use the same swizzle.
    import cutlass
    import cutlass.cute as cute

    layouts = cute_sm90.smem_layouts
    found = {}

    @cute.jit
    def compare():
        _, k_layout, _, v_layout, _ = layouts()
        mismatches = 0
        for key in cutlass.range_constexpr(0, 64, 5):
            for dim in cutlass.range_constexpr(0, 512, 29):
                for stage in cutlass.range_constexpr(cute_sm90.STAGES):
                    k_offset = k_layout.outer((key, dim % 64, stage * cute_sm90.LATENT_BLOCKS + dim // 64))
                    v_offset = v_layout.outer((dim, key, stage))
                    if cutlass.const_expr(k_offset != v_offset):
                        mismatches += 1
        found["mismatches"] = mismatches
        found["swizzles"] = (str(k_layout.inner), str(v_layout.inner))

    compare()
    assert found["mismatches"] == 0
    assert found["swizzles"][0] == found["swizzles"][1] == "S<3,4,3>"  # 128B swizzle both


@needs_cutlass
def test_compile_cache_builds_each_key_once():
    before = cute_sm90._cache.compiles
    first = cute_sm90.compile_mla_verify(HEADS, True, torch.int32, "sm_90a")
    again = cute_sm90.compile_mla_verify(HEADS, True, torch.int32, "sm_90a")
    assert first is again
    assert cute_sm90._cache.compiles == before + 1


def test_splits_fill_one_wave_and_keep_enough_work_per_split():
    sms = mla_common.H200_SMS
    # T = 8: 12 row tiles of 64 (96 heads x 8 tokens); 8k keys = 128 KV tiles
    assert mla_common.choose_splits(1, 8, HEADS, 8192, sms) == 11  # 132 CTAs
    assert mla_common.choose_splits(1, 1, HEADS, 1024, sms) == 8  # 16 KV tiles, >= 2 each
    assert mla_common.choose_splits(1, 1, HEADS, 32768, sms) == mla_common.SPLITS_CAP
    for batch in (1, 2, 4):
        for tokens in (1, 4, 8, 16):
            for context in (256, 1024, 8192, 32768):
                splits = mla_common.choose_splits(batch, tokens, HEADS, context, sms)
                ctas = batch * mla_common.row_tiles(tokens, HEADS) * splits
                assert 1 <= splits <= mla_common.SPLITS_CAP
                assert splits == 1 or ctas <= sms  # at most one wave
                assert splits == 1 or context / 64 / splits >= mla_common.MIN_TILES_PER_SPLIT


def _arguments(B=2, T=4, H=HEADS, dtype=torch.bfloat16, index=torch.int64):
    return (
        torch.randn(B, T, H, 512).to(dtype), torch.randn(B, T, H, 64).to(dtype), torch.randn(3, 128, 576).to(dtype),
        torch.tensor([0, 2][:B], dtype=index), torch.tensor([5, 9][:B], dtype=index), torch.tensor([4, 3][:B], dtype=index),
    )


def test_argument_checks_name_the_field():
    q_latent, q_pe, kv, slots, cache_lens, lengths = _arguments()
    with pytest.raises(ValueError, match="q_pe"):
        mla_common.check_arguments(q_latent, q_pe[..., :32], kv, slots, cache_lens, lengths)
    with pytest.raises(ValueError, match="kv_cache"):
        mla_common.check_arguments(q_latent, q_pe, kv[..., :512], slots, cache_lens, lengths)
    with pytest.raises(ValueError, match="T=17"):
        mla_common.check_arguments(*_arguments(T=17))
    with pytest.raises(ValueError, match="q_latent: dtype"):
        mla_common.check_arguments(*_arguments(dtype=torch.float32))
    with pytest.raises(ValueError, match="lengths"):
        mla_common.check_arguments(q_latent, q_pe, kv, slots, cache_lens, lengths[:1])
    with pytest.raises(ValueError, match="slots/cache_lens/lengths"):
        mla_common.check_arguments(q_latent, q_pe, kv, slots.int(), cache_lens, lengths)
    with pytest.raises(ValueError, match="CUDA"):  # right shapes, but on the CPU
        mla_common.check_arguments(q_latent, q_pe, kv, slots, cache_lens, lengths)
    # the registry predicate turns the same checks into "not mine": CPU tensors go elsewhere
    assert not mla_common.supports(q_latent, q_pe, kv, slots, cache_lens, lengths)


@needs_cutlass
@pytest.mark.parametrize("arch,split_kv", [("sm_90a", False), ("sm_90a", True), ("sm_103a", False), ("sm_103a", True)])
def test_the_rank_heads_compile(arch, split_kv):
    # k3-rank's 6 heads: T x 6 query rows in one 64-row tile (B, T, slots, max_len are runtime
    # values: one build serves B = 1..8, T = 1..16)
    build = cute_sm90 if arch == "sm_90a" else cute_sm100
    ptx = build.compile_mla_verify(RANK_HEADS, split_kv, torch.int64, arch, extra_options=("--keep-ptx",)).__ptx__
    if arch == "sm_90a":
        assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16" in ptx
    else:
        assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx and "wgmma" not in ptx
    assert "cp.async.bulk.tensor" in ptx and "griddepcontrol.wait" in ptx
    assert ptx.count(".entry") == (2 if split_kv else 1)


@pytest.mark.parametrize("batch", [1, 2, 4, 8])
@pytest.mark.parametrize("tokens", [1, 8])
def test_the_rank_shapes_pass_every_check_but_the_device(batch, tokens):
    """The rank's verify at B = 1..8: a layer's pool of a layer-major cache (K3Target's layout)
    passes every argument check (on the CPU only the device check is left); a slot-major pool of
    several slots is refused as kv_cache (what made B = 2 fall back to the reference)."""
    layers, max_len = 3, 128
    q_latent = torch.randn(batch, tokens, RANK_HEADS, 512).bfloat16()
    q_pe = torch.randn(batch, tokens, RANK_HEADS, 64).bfloat16()
    index = (torch.arange(batch), torch.full((batch,), 100), torch.full((batch,), tokens))
    layer_major = torch.randn(layers, batch, max_len + 1, 576).bfloat16()
    with pytest.raises(ValueError, match="CUDA"):
        mla_common.check_arguments(q_latent, q_pe, layer_major[1], *index)
    if batch > 1:
        slot_major = torch.randn(batch, layers, max_len + 1, 576).bfloat16()[:, 1]  # the old [slots, layers, ...]
        with pytest.raises(ValueError, match="kv_cache: must be contiguous"):
            mla_common.check_arguments(q_latent, q_pe, slot_major, *index)
    splits = mla_common.choose_splits(batch, tokens, RANK_HEADS, 8192 + 16, mla_common.H200_SMS)
    assert batch * mla_common.row_tiles(tokens, RANK_HEADS) * splits <= mla_common.H200_SMS


def combine_loop_loads(ptx: str) -> int:
    """The most global loads in one basic block of the split combine's PTX: its unrolled loop body."""
    start = next(i for i in range(len(ptx)) if ptx.startswith(".entry", i) and "combine" in ptx[i:i + 200])
    body = ptx[start:ptx.index("\n}\n", start)]
    blocks, count = [], 0
    for line in body.splitlines():
        if line.startswith("$L") or " bra" in line:
            blocks.append(count)
            count = 0
        count += "ld.global" in line
    return max(blocks + [count])


@needs_cutlass
def test_the_split_combine_keeps_several_splits_loads_in_flight():
    # per split: its log-sum-exp and the thread's four partial columns; a loop left at one split a
    # pass (unroll=1) holds 5 loads a block and pays one memory latency per split (docs/kernels.md §10.5)
    ptx = cute_sm90.compile_mla_verify(RANK_HEADS, True, torch.int64, "sm_90a", extra_options=("--keep-ptx",)).__ptx__
    assert combine_loop_loads(ptx) >= 5 * mla_common.COMBINE_UNROLL
    assert combine_loop_loads(".entry kernel_combine(\n{\n$L1:\nld.global.b32 a;\nld.global.b32 b;\n@p bra $L1;\n}\n") == 2
