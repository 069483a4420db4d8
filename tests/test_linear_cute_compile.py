"""CPU-only compile checks of the CuTe DSL skinny GEMM (docs/kernels.md §1.4 tier (b)).

Nothing runs here (no GPU): each kernel variant is traced, lowered and assembled for its target
with the target named explicitly, and the PTX must contain the tensor-core instructions the design
relies on: `wgmma` for sm_90a (Hopper), `tcgen05` for sm_103a (GB300). Shapes: a split-K one
(KDA o_proj), one with an N tail (MLA kv_a, N = 576) and a no-split wide one (KDA q/k/v/g), each
at M = 1, 8, 16, 32 and 64 (token tiles 8, 16, 32 and 64 on Hopper). Skips when nvidia-cutlass-dsl is
not installed.
"""
import pytest
import torch

from dspark.kernels import cute_common
from dspark.kernels.linear import cute_host

if cute_common.cutlass_available():
    from dspark.kernels.linear import cute_sm90, cute_sm100

pytestmark = pytest.mark.skipif(not cute_common.cutlass_available(), reason="nvidia-cutlass-dsl not installed")

SHAPES = {"kda_o": (7168, 12288), "mla_kv_a": (576, 7168), "kda_qkvg": (49152, 7168)}
TOKEN_COUNTS = (1, 8, 16, 32, 64)


@pytest.fixture(autouse=True)
def _ptx_dump_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --keep-ptx writes the .ptx into the working directory


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_sm90a_compiles_to_wgmma_with_tma_and_pdl(name):
    n, k = SHAPES[name]
    for tokens in sorted({cute_host.token_tile(m) for m in TOKEN_COUNTS}):
        compiled, splits = cute_sm90.compile_skinny_gemm(
            n, k, tokens, torch.bfloat16, "sm_90a", extra_options=("--keep-ptx",)
        )
        ptx = compiled.__ptx__
        assert f"wgmma.mma_async.sync.aligned.m64n{tokens}k16.f32.bf16.bf16" in ptx
        assert "cp.async.bulk.tensor" in ptx  # TMA loads
        assert "griddepcontrol.wait" in ptx  # PDL
        assert ".local" not in ptx  # no register spills to local memory
        assert splits == cute_host.choose_splits(n, k)


@pytest.mark.parametrize("arch", ["sm_103a", "sm_100a"])
def test_blackwell_compiles_to_tcgen05(arch):
    # The tcgen05 kernel has never run (no Blackwell GPU here): this is all the checking it gets.
    for name in ("kda_o", "mla_kv_a") if arch == "sm_103a" else ("kda_qkvg",):
        n, k = SHAPES[name]
        compiled, splits = cute_sm100.compile_skinny_gemm(n, k, torch.bfloat16, arch, extra_options=("--keep-ptx",))
        ptx = compiled.__ptx__
        assert "tcgen05.mma" in ptx and "tcgen05.ld" in ptx  # UMMA into TMEM, TMEM -> registers
        assert "cp.async.bulk.tensor" in ptx and "griddepcontrol.wait" in ptx
        assert ".local" not in ptx
        assert ptx.count(".entry") == (2 if splits > 1 else 1)  # GEMM (+ split-K reduce kernel)


def test_fused_and_two_pass_split_k_variants_compile():
    two_pass, splits = cute_sm90.compile_skinny_gemm(
        7168, 12288, 16, torch.bfloat16, "sm_90a", extra_options=("--keep-ptx",)
    )
    fused, _ = cute_sm90.compile_skinny_gemm(
        7168, 12288, 16, torch.bfloat16, "sm_90a", fused_reduce=True, extra_options=("--keep-ptx",)
    )
    assert splits > 1
    assert "atom.global.acq_rel.add" in fused.__ptx__ and "atom.global" not in two_pass.__ptx__
    # the two-pass variant launches a second (reduce) kernel
    assert two_pass.__ptx__.count(".entry") == 2 and fused.__ptx__.count(".entry") == 1


def test_compile_cache_builds_each_key_once():
    before = cute_sm90._cache.compiles
    first, _ = cute_sm90.compile_skinny_gemm(1536, 7168, 16, torch.bfloat16, "sm_90a")
    again, _ = cute_sm90.compile_skinny_gemm(1536, 7168, 16, torch.bfloat16, "sm_90a")
    assert first is again
    assert cute_sm90._cache.compiles == before + 1


def test_defaults_are_the_configurations_measured_best_on_the_h200():
    # bench run 2 (experiments/notes/skinny_gemm.md): K = 512 is not split, unsplit matrices that
    # fit in one wave at three CTAs per SM get 4 stages, everything else 5.
    table = cute_host.K3_TRUNK_SHAPES
    assert cute_host.choose_splits(*table["mla_kv_b"]) == 1
    assert cute_host.choose_splits(*table["kda_qkvg"]) == 1
    assert cute_host.choose_splits(*table["router"]) > 8
    assert cute_host.choose_stages(table["kda_qkvg"][0], 1) == 4
    assert cute_host.choose_stages(table["lm_head"][0], 1) == 5
    assert cute_host.choose_stages(table["kda_o/mla_o"][0], 7) == 5


def test_split_heuristic_fills_the_gpu_and_never_leaves_a_split_empty():
    for n, k in cute_host.K3_TRUNK_SHAPES.values():
        if k <= 512:
            continue  # small K is deliberately not split (see the test above)
        splits = cute_host.choose_splits(n, k)
        k_tiles = -(-k // cute_host.K_TILE)
        per_split = -(-k_tiles // splits)
        assert (splits - 1) * per_split < k_tiles  # the last split has work
        ctas = -(-n // cute_host.WEIGHT_TILE) * splits
        # small matrices are split until they occupy most SMs (at most one partial wave idle)
        assert ctas >= min(cute_host.H200_SMS // 2, -(-n // cute_host.WEIGHT_TILE) * k_tiles)


def test_shape_check_accepts_k3_shapes_and_rejects_what_the_kernel_cannot_take():
    for n, k in cute_host.K3_TRUNK_SHAPES.values():
        for m in (1, 16):
            assert cute_host.shape_supported(m, n, k, torch.bfloat16, (k, 1))
    assert not cute_host.shape_supported(17, 1536, 7168, torch.bfloat16, (7168, 1))  # > 16 tokens
    # The Hopper kernel's tiles reach 64 rows; the registry sends it HOPPER_MAX_TOKENS.
    assert cute_host.shape_supported(64, 1536, 7168, torch.bfloat16, (7168, 1), max_tokens=cute_host.TOKEN_TILES[-1])
    assert not cute_host.shape_supported(65, 1536, 7168, torch.bfloat16, (7168, 1), max_tokens=cute_host.TOKEN_TILES[-1])
    assert [cute_host.token_tile(m) for m in (1, 8, 9, 16, 17, 32, 33, 64)] == [8, 8, 16, 16, 32, 32, 64, 64]
    with pytest.raises(ValueError, match="m=65: more tokens than the largest tile"):
        cute_host.token_tile(65)
    assert not cute_host.shape_supported(0, 1536, 7168, torch.bfloat16, (7168, 1))
    assert not cute_host.shape_supported(4, 1536, 7168, torch.float32, (7168, 1))  # dtype
    assert not cute_host.shape_supported(4, 1536, 7164, torch.bfloat16, (7164, 1))  # K % 8
    assert not cute_host.shape_supported(4, 1536, 7168, torch.bfloat16, (1, 1536))  # transposed weight
    # CPU tensors never go to the CUDA kernel
    assert not cute_host.supports(torch.ones(4, 7168, dtype=torch.bfloat16), torch.ones(64, 7168, dtype=torch.bfloat16))


def test_token_rows_the_hopper_kernel_reads_in_place():
    fused = torch.ones(3, 3208, dtype=torch.bfloat16)
    assert cute_host.x_rows_supported(fused[:, 3072:3200])  # KDA's f_a on a rank: row 6416 bytes, offset 6144
    assert cute_host.x_rows_supported(fused)
    assert not cute_host.x_rows_supported(fused[:, 3073:3201])  # base 2 bytes off 16
    assert not cute_host.x_rows_supported(torch.ones(3, 3209, dtype=torch.bfloat16)[:, :128])  # row 6418 bytes
    assert not cute_host.x_rows_supported(fused.t())  # column-major
    assert not cute_host.x_rows_supported(torch.ones(3, 128))  # fp32 is not a kernel dtype


def test_the_partials_build_is_the_gemm_alone():
    # keep_partials (ops.linear_partials): the split GEMM's partials stay in the workspace for the next
    # kernel to add; no reduction kernel, no arrival counters
    kept, splits = cute_sm90.compile_skinny_gemm(7168, 768, 8, torch.bfloat16, "sm_90a", keep_partials=True,
                                                 extra_options=("--keep-ptx",))
    ptx = kept.__ptx__
    assert splits > 1 and ptx.count(".entry") == 1
    assert "atom.global" not in ptx and ".local" not in ptx and "wgmma.mma_async" in ptx
    # an unsplit shape keeps its one partial in fp32 too: the epilogue stores fp32, never rounds to bf16
    unsplit, splits = cute_sm90.compile_skinny_gemm(1536, 512, 8, torch.bfloat16, "sm_90a", keep_partials=True,
                                                    extra_options=("--keep-ptx",))
    plain, _ = cute_sm90.compile_skinny_gemm(1536, 512, 8, torch.bfloat16, "sm_90a", extra_options=("--keep-ptx",))
    assert splits == 1 and unsplit.__ptx__.count(".entry") == 1
    assert "cvt.rn.bf16" not in unsplit.__ptx__ and "cvt.rn.bf16" in plain.__ptx__
    with pytest.raises(ValueError, match="fused_reduce and keep_partials"):
        cute_sm90.compile_skinny_gemm(7168, 768, 8, torch.bfloat16, "sm_90a", keep_partials=True, fused_reduce=True)


# k3-rank's split GEMMs (one rank of TP16, docs/kimi-k3.md §8.1): KDA input rows (q|k|v|g|f_a|b,
# padded to 8), latent down (28 splits of 2 tiles), shared gate|up, o_proj
RANK_SPLIT_SHAPES = {"kda_in": (3208, 7168), "latent_down": (224, 7168), "shared_gate_up": (768, 7168),
                     "o_proj": (7168, 768)}


@pytest.mark.parametrize("name", sorted(RANK_SPLIT_SHAPES))
@pytest.mark.parametrize("arch", ["sm_90a", "sm_103a"])
def test_the_rank_split_gemms_compile_with_the_fused_reduction(name, arch):
    # cute_host.FUSED_REDUCE: one launch per linear (the last CTA of each tile sums the splits)
    n, k = RANK_SPLIT_SHAPES[name]
    if arch == "sm_90a":
        compiled, splits = cute_sm90.compile_skinny_gemm(n, k, 8, torch.bfloat16, arch, fused_reduce=True,
                                                         extra_options=("--keep-ptx",))
    else:
        compiled, splits = cute_sm100.compile_skinny_gemm(n, k, torch.bfloat16, arch, fused_reduce=True,
                                                          extra_options=("--keep-ptx",))
    ptx = compiled.__ptx__
    assert splits > 1 and ptx.count(".entry") == 1
    assert "atom.global.acq_rel.add" in ptx and ".local" not in ptx
