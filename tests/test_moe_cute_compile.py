"""CPU checks of the CuTe DSL MXFP4 expert kernels (docs/kernels.md §1.4 tier (b), §4.3).

Compile-only (no GPU here): the Hopper kernel must lower to wgmma with A from registers (the
dequantised weights) and B from shared memory, fed by TMA, with no local-memory spills; the
Blackwell build must lower to tcgen05. Plus the host-side pieces that run on any device: the K
permutation and the expert lists, against direct loops; and the registration: both builds are
registered for `moe_experts` by module path, on their own GPU families only.
"""
import pytest
import torch

from dspark.kernels import cute_common
from dspark.kernels.moe import expert_layout
from dspark.targets.kimi_k3.config import K3

needs_cutlass = pytest.mark.skipif(not cute_common.cutlass_available(), reason="nvidia-cutlass-dsl not installed")


@pytest.fixture
def _ptx_dump_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --keep-ptx writes the .ptx into the working directory


@needs_cutlass
@pytest.mark.usefixtures("_ptx_dump_dir")
@pytest.mark.parametrize("glu, tokens, loader", [(True, 8, "registers"), (False, 16, "registers"), (True, 16, "tma"), (False, 8, "tma")])
def test_sm90a_expert_kernel_compiles_to_register_a_wgmma(glu, tokens, loader):
    from dspark.kernels.moe import cute_sm90

    rows, k = (K3.moe_intermediate_size, K3.latent_size) if glu else (K3.latent_size, K3.moe_intermediate_size)
    compiled = cute_sm90.compile_expert_gemm(
        K3.num_experts, rows, k, tokens, glu, "sm_90a", loader=loader, extra_options=("--keep-ptx",)
    )
    ptx = compiled.__ptx__
    # register-A form: "wgmma... {a regs}, b-descriptor" (no A descriptor), m64 x tokens x k16
    wgmmas = [line for line in ptx.splitlines() if f"wgmma.mma_async.sync.aligned.m64n{tokens}k16.f32.bf16.bf16" in line]
    assert wgmmas and all(line.count("{") == 2 for line in wgmmas)  # SS form would have one
    assert "cp.async.bulk.tensor" in ptx  # TMA for the tokens
    # 16-byte code loads: from global (registers loader) or from the TMA-filled shared memory
    assert ("ld.global.v4" in ptx) == (loader == "registers") and ("ld.shared.v4" in ptx) == (loader == "tma")
    assert "fma.rn.bf16x2" in ptx  # the scale, one multiply per bf16 pair
    assert ".local" not in ptx  # no spills
    assert ("tanh" in ptx or "ex2" in ptx) == glu  # SiTU epilogue only in pass 1


@needs_cutlass
@pytest.mark.usefixtures("_ptx_dump_dir")
def test_sm90a_pass2_with_a_k_split_compiles_and_reads_its_split_from_the_grid():
    from dspark.kernels.moe import cute_sm90

    ptx = cute_sm90.compile_expert_gemm(K3.num_experts, K3.latent_size, K3.moe_intermediate_size, 8, False, "sm_90a",
                                        loader="tma", extra_options=("--keep-ptx",), splits=4).__ptx__
    assert "%ctaid.z" in ptx  # the split is the grid's third index
    assert "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16" in ptx and "cp.async.bulk.tensor" in ptx
    assert ".local" not in ptx


def test_k_splits_that_the_kernel_cannot_take_are_refused_by_value():
    from dspark.kernels.moe import cute_sm90

    k = K3.moe_intermediate_size  # 24 chunks of 128
    cute_sm90.check_splits(4, k, glu=False, loader="tma")  # 6 chunks each
    for splits, glu, loader in ((2, True, "tma"), (2, False, "registers"), (5, False, "tma"), (8, False, "tma")):
        with pytest.raises(ValueError, match=f"splits={splits}"):
            cute_sm90.check_splits(splits, k, glu=glu, loader=loader)


def test_auto_splits_fill_the_sms_at_a_ranks_few_slots(monkeypatch):
    from dspark.kernels.moe import cute_sm90

    monkeypatch.setattr(cute_sm90, "PASS2_SPLITS", "auto")
    cpu = torch.device("cpu")  # the rule's own SM count (an H200's 132)
    rows, k = K3.latent_size, K3.moe_intermediate_size  # 28 row tiles, 24 K chunks
    assert cute_sm90.pass2_splits(rows, k, 3, cpu) == 4  # 84 CTAs -> 336, past 2 a SM
    assert cute_sm90.pass2_splits(rows, k, 8, cpu) == 2  # 224 -> 448
    assert cute_sm90.pass2_splits(rows, k, 16, cpu) == 1  # 448 already
    monkeypatch.setattr(cute_sm90, "PASS2_SPLITS", 1)
    assert cute_sm90.pass2_splits(rows, k, 3, cpu) == 1


@needs_cutlass
@pytest.mark.usefixtures("_ptx_dump_dir")
@pytest.mark.parametrize("arch, glu", [("sm_103a", True), ("sm_103a", False), ("sm_100a", True)])
def test_blackwell_expert_kernel_compiles_to_tcgen05(arch, glu):
    # The tcgen05 kernel has never run (no Blackwell GPU here): this is all the checking it gets.
    from dspark.kernels.moe import cute_sm100

    rows, k = (K3.moe_intermediate_size, K3.latent_size) if glu else (K3.latent_size, K3.moe_intermediate_size)
    ptx = cute_sm100.compile_expert_gemm(K3.num_experts, rows, k, glu, arch, extra_options=("--keep-ptx",)).__ptx__
    assert "tcgen05.mma.cta_group::1.kind::f16" in ptx and "tcgen05.ld" in ptx  # UMMA into TMEM, TMEM -> registers
    assert "cp.async.bulk.tensor" in ptx  # TMA for the tokens
    assert "st.shared.v4" in ptx  # dequantised octets written as 16-byte vectors
    assert "fence.proxy.async.shared::cta" in ptx  # generic-proxy writes made visible to the UMMA
    assert ".local" not in ptx


def test_expert_kernels_register_lazily_for_their_own_families():
    import subprocess
    import sys

    # a fresh interpreter: the registry loads every op package, yet no kernel module (nor cutlass)
    probe = ("import sys; from dspark.kernels import registry; "
             "impls = registry.implementations('moe_experts'); "
             "print(sorted((n, i.min_capability, i.max_capability) for n, i in impls.items())); "
             "print(sorted(m for m in sys.modules if m.startswith(('cutlass', 'dspark.kernels.moe.cute'))))")
    lines = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.splitlines()
    assert lines == [str([("cute_sm100", (10, 0), (10, 3)), ("cute_sm90", (9, 0), (9, 0)), ("reference", None, None)]),
                     "[]"]


def test_octet_permutation_matches_the_blackwell_dequantiser():
    perm = expert_layout.octet_permutation()
    # position 2i holds nibble i of the word, position 2i + 1 nibble i + 4
    assert perm.tolist() == [i + 4 * half for i in range(4) for half in (0, 1)]
    x = torch.randn(2, 16)
    assert torch.equal(expert_layout.permute_k(x, "sm100")[:, 8:], x[:, 8:][:, perm])


@needs_cutlass
@pytest.mark.usefixtures("_ptx_dump_dir")
def test_list_kernel_compiles():
    from dspark.kernels.moe import cute_sm90

    for tile in (8, 16):
        ptx = cute_sm90.compile_lists_kernel(tile, K3.num_experts_per_token, "sm_90a", extra_options=("--keep-ptx",)).__ptx__
        assert ptx.count("bar.sync") == 2 and ".local" not in ptx


def test_chunk_permutation_is_the_register_fragment_order():
    perm = expert_layout.chunk_permutation()
    assert sorted(perm.tolist()) == list(range(expert_layout.K_CHUNK))
    # Thread c (lane % 4) of a quad owns, for each k16 block ki, logical columns 2c + v0 + 8 v2
    # (PTX wgmma A register fragment); they must be its contiguous 32-element MX group.
    for c in range(4):
        owned = {int(perm[16 * ki + 2 * c + v0 + 8 * v2]) for ki in range(8) for v0 in (0, 1) for v2 in (0, 1)}
        assert owned == set(range(32 * c, 32 * c + 32))
    # the bf16 pair of one register (v0 = 0, 1) is nibbles i and i + 4 of one 32-bit word
    for logical in range(0, expert_layout.K_CHUNK, 2):
        low, high = int(perm[logical]), int(perm[logical + 1])
        assert high == low + 4 and low // 8 == high // 8 and low % 8 < 4


def test_permute_k_permutes_each_chunk():
    x = torch.randn(3, 2 * expert_layout.K_CHUNK)
    perm = expert_layout.chunk_permutation()
    y = expert_layout.permute_k(x)
    assert torch.equal(y[:, :128], x[:, perm]) and torch.equal(y[:, 128:], x[:, 128 + perm])
    with pytest.raises(ValueError, match="multiple of 128"):
        expert_layout.permute_k(torch.randn(2, 100))


def expected_slots(ids: torch.Tensor, tile: int) -> list[tuple[int, list[int]]]:
    """(expert, token rows) per used slot, by a direct loop: experts ascending, each expert's tokens
    ascending, cut into runs of `tile`."""
    slots = []
    for expert in sorted(set(ids.flatten().tolist())):
        members = [t for t in range(ids.shape[0]) if expert in ids[t].tolist()]
        slots += [(expert, members[i : i + tile]) for i in range(0, len(members), tile)]
    return slots


def routing(tokens: int, top_k: int, experts: int, repeated: bool, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    pool = experts if not repeated else max(top_k + 2, experts // 40)  # few experts: many repeats
    return torch.stack([torch.randperm(pool, generator=gen)[:top_k] for _ in range(tokens)])


@pytest.mark.parametrize("tokens, top_k, experts, repeated", [
    (1, 16, 896, False), (5, 4, 10, True), (16, 16, 896, True),
    (32, 16, 896, True), (64, 16, 896, False), (40, 4, 10, True),  # past one slot per expert
])
def test_expert_lists_agree_with_a_direct_loop(tokens, top_k, experts, repeated):
    ids = routing(tokens, top_k, experts, repeated, seed=tokens * 1000 + top_k)
    tile = 8 if tokens <= 8 else 16
    lists = expert_layout.build_expert_lists(ids, experts, tile)
    used = expected_slots(ids, tile)
    slots = expert_layout.slot_count(tokens, top_k, experts, tile)
    if tokens <= tile:
        assert slots == min(experts, tokens * top_k)
    assert len(used) <= slots
    if repeated and tokens > tile:
        assert any(len(members) == tile for _, members in used[:-1]) and len(used) > len(set(e for e, _ in used))
    assert lists.slot_expert.tolist() == [e for e, _ in used] + [-1] * (slots - len(used))
    assert lists.slot_tokens.shape == (slots, tile)
    for slot, (expert, members) in enumerate(used):
        assert lists.slot_tokens[slot, : len(members)].tolist() == members
        for rank, t in enumerate(members):
            j = ids[t].tolist().index(expert)
            assert int(lists.pair_position[t, j]) == slot * tile + rank


def test_slot_count_holds_the_worst_routing():
    """Every token on the same k experts: each of them takes ceil(T / tile) slots."""
    for tokens, tile in ((17, 16), (32, 16), (64, 16), (9, 8)):
        ids = torch.arange(16).repeat(tokens, 1)
        used = len(expected_slots(ids, tile))
        assert used == 16 * -(-tokens // tile) <= expert_layout.slot_count(tokens, 16, 896, tile)


@pytest.mark.parametrize("tokens, repeated", [(5, False), (32, True), (48, False)])
def test_expert_passes_over_the_lists_equal_the_reference_op(tokens, repeated):
    """run_expert_passes with a float64 torch stand-in for the kernel's two passes (each slot: its
    expert's weights times its token rows) against kernels/moe/reference.py in float64: the lists
    and the gather back by pair_position route every (token, expert) pair, also past one slot per
    expert. A pair routed to a wrong slot or expert is off by O(1), far past the bound."""
    from dspark.kernels.moe import reference
    from dspark.kernels.mxfp4 import dequantise
    from dspark.kernels.numerics import situ

    experts, top_k, latent_dim, inter = 24, 4, 64, 32
    gen = torch.Generator().manual_seed(tokens)

    def mxfp4(rows, k):
        return (torch.randint(0, 256, (experts, rows, k // 2), dtype=torch.uint8, generator=gen),
                torch.randint(122, 128, (experts, rows, k // 32), dtype=torch.uint8, generator=gen))

    weights = (*mxfp4(inter, latent_dim), *mxfp4(inter, latent_dim), *mxfp4(latent_dim, inter))
    dense = [dequantise(weights[i], weights[i + 1]).double() for i in (0, 2, 4)]
    ids = routing(tokens, top_k, experts, repeated, seed=tokens)
    route_weights = torch.rand(tokens, top_k, generator=gen)
    latent = torch.randn(tokens, latent_dim, generator=gen)
    beta, linear_beta = 1.0, 0.5

    def tokens_for_kernel(x, lists):
        return x.double()[lists.slot_tokens]

    def expert_pass(packed_a, scale_a, packed_b, scale_b, lists, xb, out, glu, *betas):
        out.fill_(float("nan"))  # rows of unused slots stay NaN: the gather must never read them
        for slot, expert in enumerate(lists.slot_expert.tolist()):
            if expert < 0:
                continue
            if glu:
                out[slot] = situ(xb[slot] @ dense[0][expert].T, xb[slot] @ dense[1][expert].T, *betas).to(out.dtype)
            else:
                out[slot] = (xb[slot].double() @ dense[2][expert].T).to(out.dtype)

    tile = 8 if tokens <= 8 else 16
    lists = expert_layout.build_expert_lists(ids, experts, tile)
    out = expert_layout.run_expert_passes(latent, lists, weights, tokens_for_kernel, expert_pass, beta, linear_beta)
    ours = expert_layout.weighted_sum(route_weights.double(), out.double())
    ref = reference.moe_experts(latent.double(), ids, route_weights.double(), *weights, beta, linear_beta)
    assert not ours.isnan().any()
    # the passes hand the activation over in bf16, as the kernel does (run_expert_passes): 2^-9 per element
    assert ((ours - ref).norm() / ref.norm()).item() < 4e-3


@needs_cutlass
def test_kernel_token_operand_is_the_gathered_permuted_scaled_rows():
    from dspark.kernels.moe import cute_sm90, cute_sm100

    x = torch.randn(5, 256).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(20)[:4] for _ in range(5)])
    lists = expert_layout.build_expert_lists(ids, 20, 8)
    for module, order in ((cute_sm90, "sm90"), (cute_sm100, "sm100")):
        operand = module.tokens_for_kernel(x, lists)
        perm = expert_layout.chunk_permutation() if order == "sm90" else expert_layout.octet_permutation()
        for slot in range(lists.slot_tokens.shape[0]):
            for row in range(8):
                token = int(lists.slot_tokens[slot, row])
                expected = x[token].view(-1, perm.numel())[:, perm].flatten().double() * 2.0**63
                assert torch.equal(operand[slot, row].double(), expected)


def test_expert_lists_reject_bad_input():
    with pytest.raises(ValueError, match="ids"):
        expert_layout.build_expert_lists(torch.zeros(0, 4, dtype=torch.long), 896, 16)
    with pytest.raises(ValueError, match="ids"):
        expert_layout.build_expert_lists(torch.zeros(4, dtype=torch.long), 896, 16)


def test_dequantisation_bit_trick_is_exact_for_every_code_and_scale():
    # cute_sm90's dequantiser: code s|e1 e0|m -> bf16 bits (s << 15) | (e1 e0 m << 6), times the
    # bf16 2^(scale - 64); the tokens carry 2^63. Emulated here with torch's bf16 bit view.
    from dspark.kernels.mxfp4 import dequantise

    codes = torch.arange(256, dtype=torch.int32)  # every byte: two nibbles
    scales = torch.tensor([64, 100, 119, 120, 127, 150, 191], dtype=torch.int32)
    for scale in scales.tolist():
        halves = []
        for nibble in (codes & 0xF, codes >> 4):
            bits = ((nibble & 0x7) << 6) | ((nibble & 0x8) << 12)
            value = bits.to(torch.int16).view(torch.bfloat16).double()
            multiplier = torch.tensor([(scale + 63) << 7], dtype=torch.int16).view(torch.bfloat16).double()
            halves.append(value * multiplier * 2.0**63)
        ours = torch.stack(halves, -1).flatten()  # even index from the low nibble
        ref = dequantise(codes.to(torch.uint8).view(16, 16), torch.full((16, 1), scale, dtype=torch.uint8), torch.float64)
        assert torch.equal(ours, ref.flatten()), f"scale byte {scale}"


@needs_cutlass
def test_untileable_expert_shapes_go_to_the_reference():
    from dspark.kernels.moe import cute_sm90
    from dspark.kernels.mxfp4 import pack

    def experts(inter, latent, count=2):
        (w1, s1), (w3, s3), (w2, s2) = (pack(torch.randn(count, inter, latent)), pack(torch.randn(count, inter, latent)),
                                        pack(torch.randn(count, latent, inter)))
        return w1, s1, w3, s3, w2, s2

    assert cute_sm90.experts_supported(*experts(256, 256))
    assert not cute_sm90.experts_supported(*experts(32, 32))  # the tiny test config
    assert not cute_sm90.experts_supported(*experts(256, 384))  # latent not a multiple of 256
    # supports() also asks for a CUDA bf16 latent of 1..16 tokens: a CPU call is never taken
    latent, ids, weights = torch.randn(4, 256).bfloat16(), torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 2)
    assert not cute_sm90.supports(latent, ids, weights, *experts(256, 256))
