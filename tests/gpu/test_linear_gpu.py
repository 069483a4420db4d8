"""GPU numerics of the CuTe DSL skinny GEMM at every Kimi K3 trunk shape and M in {1, 2, 4, 8, 16}
(and 24, 32, 64 on Hopper, whose token tiles reach 64):
kernels/linear/cute_sm90.py on Hopper (run on the H200), cute_sm100.py on Blackwell (never run
yet: this file is what must pass on a B200/GB300 before that kernel is trusted).

Each case draws fresh random bf16 inputs (never zeros), poisons the output and the split-K
workspace with NaN, and compares with a float64 reference: relative Frobenius error <= 1e-2
(bf16 output rounding alone is ~2e-3), no NaN left, so every element was written.
"""
import pytest
import torch

from dspark.kernels import cute_common, registry

if not cute_common.cutlass_available():  # the kernel modules import cutlass at their top
    pytest.skip("nvidia-cutlass-dsl / tvm-ffi not installed", allow_module_level=True)
from dspark.kernels.linear import cute_host, cute_sm90, cute_sm100

CAPABILITY = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
KERNELS = {(9, 0): cute_sm90, (10, 0): cute_sm100, (10, 3): cute_sm100}
kernel = KERNELS.get(CAPABILITY)
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(kernel is None, reason="CuTe DSL linear kernels exist for sm_90, sm_100, sm_103 only"),
    pytest.mark.skipif(not cute_common.cutlass_available(), reason="nvidia-cutlass-dsl / tvm-ffi not installed"),
]


def compile_for(n: int, k: int, m: int, **options):
    """(compiled kernel, splits) of this GPU's implementation for m tokens."""
    if kernel is cute_sm90:
        return cute_sm90.compile_skinny_gemm(
            n, k, cute_sm90.token_tile(m), torch.bfloat16, cute_common.target_arch(), **options
        )
    return cute_sm100.compile_skinny_gemm(n, k, torch.bfloat16, cute_common.target_arch(), **options)

TOKEN_COUNTS = (1, 2, 4, 8, 16) + ((24, 32, 64) if kernel is cute_sm90 else ())
REL_TOL = 1e-2


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("name", sorted(cute_host.K3_TRUNK_SHAPES))
def test_every_k3_shape_and_token_count(name):
    n, k = cute_host.K3_TRUNK_SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    # Scaled so that outputs are O(1): weights ~ 1/sqrt(K), activations ~ 1.
    weight = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)
    x_all = torch.randn(max(TOKEN_COUNTS), k, device="cuda", generator=gen).to(torch.bfloat16)
    # Rows are independent, so one float64 reference serves every M (the first M rows).
    ref_all = x_all.double() @ weight.double().t()
    for m in TOKEN_COUNTS:
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        _, splits = compile_for(n, k, m)
        workspace = torch.full((splits, m, n), float("nan"), dtype=torch.float32, device="cuda")
        kernel.skinny_gemm(x_all[:m], weight, out, workspace)
        torch.cuda.synchronize()
        assert not out.isnan().any(), f"{name} M={m}: {out.isnan().sum().item()} elements not written"
        err = relative_error(out, ref_all[:m])
        assert err <= REL_TOL, f"{name} M={m} splits={splits}: relative error {err:.2e} > {REL_TOL}"
        # the fused split-K reduction re-arms its arrival counters for the next call
        assert (cute_host.split_counters(weight.device, n) == 0).all()


def test_registry_picks_the_cute_kernel_and_falls_back_for_unsupported_shapes():
    registry.overrides.pop("linear", None)
    n, k = 1536, 7168
    weight = torch.randn(n, k, device="cuda").to(torch.bfloat16)
    x = torch.randn(4, k, device="cuda").to(torch.bfloat16)
    assert registry.select("linear", x, weight).name == kernel.__name__.rsplit(".", 1)[-1]
    from dspark.kernels import ops

    err = relative_error(ops.linear(x, weight), x.double() @ weight.double().t())
    assert err <= REL_TOL
    # 17 tokens, fp32 and a transposed weight are outside the kernel: the reference takes them.
    too_many = torch.randn(17, k, device="cuda").to(torch.bfloat16)
    assert registry.select("linear", too_many, weight).name == "reference"
    if kernel is cute_sm90:  # the Hopper kernel takes up to 64 rows once HOPPER_MAX_TOKENS allows it
        previous = cute_host.HOPPER_MAX_TOKENS
        cute_host.HOPPER_MAX_TOKENS = cute_host.TOKEN_TILES[-1]
        try:
            assert registry.select("linear", too_many, weight).name == "cute_sm90"
            assert registry.select("linear", torch.randn(65, k, device="cuda").to(torch.bfloat16), weight).name == "reference"
        finally:
            cute_host.HOPPER_MAX_TOKENS = previous
    assert registry.select("linear", x.float(), weight.float()).name == "reference"
    assert registry.select("linear", x[:, :n], weight.t()).name == "reference"


def test_unaligned_token_view_and_steady_state_has_no_recompiles():
    n, k = 3584, 7168
    weight = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
    base = torch.randn(9, k + 1, device="cuda").to(torch.bfloat16)
    x = base[1:, 1:]  # non-contiguous and misaligned: the wrapper must copy it
    ref = x.double() @ weight.double().t()
    kernel.linear(x.contiguous(), weight)  # warm the cache for this key
    compiles = kernel._cache.compiles
    for _ in range(3):
        out = kernel.linear(x, weight)
        assert relative_error(out, ref) <= REL_TOL
    assert kernel._cache.compiles == compiles


@pytest.mark.skipif(kernel is not cute_sm90, reason="the Hopper kernel reads strided token rows in place")
def test_a_column_slice_of_a_wider_output_is_read_in_place():
    """KDA's f_a: a 128-column slice of its fused input GEMM's [M, 3208] output (a rank's), at column 3072.
    TMA reads it where it lies (no copy): the same bits as the contiguous copy, and one compile for both."""
    n, k = 7168, 128
    weight = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
    for m in (1, 5, 16):
        fused = torch.randn(m, 3208, device="cuda").to(torch.bfloat16)
        x = fused[:, 3072 : 3072 + k]
        assert (m == 1 or not x.is_contiguous()) and cute_host.x_rows_supported(x)  # one row: contiguous
        compiles = kernel._cache.compiles
        contiguous = kernel.linear(x.contiguous(), weight)
        in_place = kernel.linear(x, weight)
        assert torch.equal(in_place, contiguous)
        assert relative_error(in_place, x.double() @ weight.double().t()) <= REL_TOL
        assert kernel._cache.compiles - compiles <= 1  # the token tile's build, shared by both
    assert not cute_host.x_rows_supported(fused[:, 3073 : 3073 + k])  # a 2-byte offset: copied


def test_runs_on_a_side_stream_and_in_a_cuda_graph():
    n, k = 7168, 12288
    weight = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
    x = torch.randn(8, k, device="cuda").to(torch.bfloat16)
    ref = x.double() @ weight.double().t()
    out = torch.full((8, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    kernel.skinny_gemm(x, weight, out)  # compile outside the capture
    out.fill_(float("nan"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kernel.skinny_gemm(x, weight, out)
    torch.cuda.current_stream().wait_stream(stream)
    assert relative_error(out, ref) <= REL_TOL

    _, splits = compile_for(n, k, 8)
    workspace = torch.empty((splits, 8, n), dtype=torch.float32, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel.skinny_gemm(x, weight, out, workspace)
    out.fill_(float("nan"))
    x.copy_(torch.randn_like(x))  # new inputs, same buffers: the replay must see them
    graph.replay()
    torch.cuda.synchronize()
    assert relative_error(out, x.double() @ weight.double().t()) <= REL_TOL


@pytest.mark.parametrize("name", ["kda_o/mla_o", "mla_kv_a", "router"])
def test_fused_split_k_reduction_variant(name):
    # The non-default fused reduction (last CTA of each tile sums the partials): same checks, and
    # its arrival counters must be re-armed after every call.
    n, k = cute_host.K3_TRUNK_SHAPES[name]
    weight = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
    for m in (1, 5, 16):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        compiled, splits = compile_for(n, k, m, fused_reduce=True)
        assert splits > 1
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        workspace = torch.full((splits, m, n), float("nan"), dtype=torch.float32, device="cuda")
        counters = cute_host.split_counters(x.device, n)
        for _ in range(2):
            compiled(x, weight, out, workspace, counters)
        torch.cuda.synchronize()
        assert not out.isnan().any()
        assert relative_error(out, x.double() @ weight.double().t()) <= REL_TOL
        assert (counters == 0).all()


# The rank's split GEMMs whose outputs a mix norm adds (docs/kimi-k3.md §8.5): o_proj, the MoE output
# GEMM (2 splits each); one of many splits (23); and an unsplit one (its one fp32 partial, unrounded)
PARTIALS_SHAPES = {"rank o_proj": (7168, 768), "rank moe output": (7168, 608), "mla_kv_a": (576, 7168),
                   "rank mla_kv_b": (1536, 512)}


@pytest.mark.skipif(kernel is not cute_sm90, reason="linear_partials has a Hopper kernel only")
@pytest.mark.parametrize("name", sorted(PARTIALS_SHAPES))
def test_linear_partials_sum_to_what_the_reduction_kernel_writes(name):
    """ops.linear_partials keeps the split-K partials in one launch: summed in split order and rounded
    (sum_partials), they equal the two-kernel GEMM's output bit for bit, and float64 to REL_TOL."""
    from dspark.kernels.numerics import sum_partials

    n, k = PARTIALS_SHAPES[name]
    weight = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
    for m in (1, 5, 16):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        splits = cute_host.choose_splits(n, k)
        workspace = torch.full((splits, m, n), float("nan"), dtype=torch.float32, device="cuda")
        partials = cute_sm90.linear_partials(x, weight, workspace=workspace)
        assert partials.data_ptr() == workspace.data_ptr() and partials.shape == (splits, m, n)
        assert partials.dtype == torch.float32  # unsplit too: its one partial, unrounded
        assert not partials.isnan().any()
        summed = sum_partials(partials, torch.bfloat16)
        assert torch.equal(summed, cute_sm90.linear(x, weight))
        assert relative_error(summed, x.double() @ weight.double().t()) <= REL_TOL
    assert [cute_host.choose_splits(*PARTIALS_SHAPES[s]) for s in ("rank o_proj", "mla_kv_a", "rank mla_kv_b")] \
        == [2, 23, 1]
