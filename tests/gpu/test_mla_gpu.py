"""GPU numerics of the CuTe DSL MLA verify attention (kernels/mla/cute_sm90.py on Hopper; the
Blackwell cute_sm100.py has never run: this file is what must pass on a B200/GB300 first).

Oracle: the reference contract (kernels/mla/reference.py) computed vectorised in float32 on the
GPU (the reference loops per query, too slow at 32k keys), TF32 off. Every case draws fresh
random bf16 inputs, poisons the output and the split-KV partials with NaN, and requires a
relative Frobenius error <= 1e-2 (bf16 P and bf16 output rounding are ~3e-3) and no NaN, so every
element was written. Cases: T in {1, 4, 8, 16} x contexts {1k, 8k, 32k} x B in {1, 2}; with B = 2
the requests have different cache lengths and slots and the second one is padded (lengths < T).
"""
import pytest
import torch

from dspark.kernels import cute_common, registry

if not cute_common.cutlass_available():  # the kernel modules import cutlass at their top
    pytest.skip("nvidia-cutlass-dsl / tvm-ffi not installed", allow_module_level=True)

CAPABILITY = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
if CAPABILITY == (9, 0):
    from dspark.kernels.mla import cute_sm90 as kernel
elif CAPABILITY in ((10, 0), (10, 3)):
    from dspark.kernels.mla import cute_sm100 as kernel
else:
    kernel = None
from dspark.kernels.mla import cute_host as mla_common
from dspark.kernels.mla import cute_sm90

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(kernel is None, reason="CuTe DSL MLA kernels exist for sm_90, sm_100, sm_103 only"),
    pytest.mark.skipif(not cute_common.cutlass_available(), reason="nvidia-cutlass-dsl / tvm-ffi not installed"),
]

HEADS = 96  # Kimi K3 MLA heads (docs/kimi-k3.md §3)
SCALE = 192**-0.5  # qk_head_dim^-1/2
REL_TOL = 1e-2


def oracle(q_latent, q_pe, kv_cache, slots, cache_lens, lengths, scale):
    """The reference's contract in float32, one batched matmul per request."""
    B, T, H, R = q_latent.shape
    out = torch.zeros(B, T, H, R, dtype=torch.float32, device=q_latent.device)
    for b in range(B):
        slot, start, n = int(slots[b]), int(cache_lens[b]), int(lengths[b])
        if n == 0:
            continue
        keys = start + n
        rows = kv_cache[slot, :keys].float()
        q = torch.cat([q_latent[b, :n], q_pe[b, :n]], dim=-1).float()  # [n, H, 576]
        scores = torch.einsum("thd,ld->thl", q, rows) * scale
        visible = torch.arange(keys, device=rows.device)[None, :] < (start + torch.arange(n, device=rows.device) + 1)[:, None]
        scores.masked_fill_(~visible[:, None, :], float("-inf"))
        out[b, :n] = torch.einsum("thl,lr->thr", torch.softmax(scores, dim=-1), rows[:, :R])
    return out


def make_inputs(gen, B, T, context, lengths, index_dtype=torch.int64):
    """Requests whose last visible key is at most `context`; request 0 reaches exactly `context`."""
    max_len = context
    kv_cache = torch.randn(3, max_len, mla_common.HEAD_DIM, device="cuda", generator=gen).to(torch.bfloat16)
    q_latent = torch.randn(B, T, HEADS, mla_common.LATENT, device="cuda", generator=gen).to(torch.bfloat16)
    q_pe = torch.randn(B, T, HEADS, mla_common.ROPE, device="cuda", generator=gen).to(torch.bfloat16)
    lengths_t = torch.tensor(lengths, dtype=index_dtype, device="cuda")
    cache_lens = [context - lengths[0]] + [context // 2 + 37 - b for b in range(1, B)]
    slots = torch.tensor([2, 0][:B], dtype=index_dtype, device="cuda")
    return q_latent, q_pe, kv_cache, slots, torch.tensor(cache_lens, dtype=index_dtype, device="cuda"), lengths_t


def run_case(B, T, context, lengths, splits=None, index_dtype=torch.int64, **variant):
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    args = make_inputs(gen, B, T, context, lengths, index_dtype)
    if splits is None:
        splits = mla_common.choose_splits(B, T, HEADS, context, torch.cuda.get_device_properties(0).multi_processor_count)
    out = torch.full((B, T, HEADS, mla_common.LATENT), float("nan"), dtype=torch.bfloat16, device="cuda")
    partial_dtype = variant.get("partial_dtype", cute_sm90.DEFAULT_PARTIAL_DTYPE)
    o_partial, lse = mla_common.workspace(B, T, HEADS, splits, "cuda", partial_dtype)
    o_partial.fill_(float("nan"))
    lse.fill_(float("nan"))
    kernel.mla_verify_into(*args, SCALE, out, splits=splits, partials=(o_partial, lse), **variant)
    torch.cuda.synchronize()
    ref = oracle(*args, SCALE)
    label = f"B={B} T={T} context={context} lengths={lengths} splits={splits} {variant}"
    assert not out.isnan().any(), f"{label}: {out.isnan().sum().item()} elements not written"
    for b in range(B):
        assert torch.equal(out[b, lengths[b]:], torch.zeros_like(out[b, lengths[b]:])), f"{label}: padding not zero"
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err <= REL_TOL, f"{label}: relative error {err:.2e} > {REL_TOL}"


# Kernel variants (cute_sm90 flags): the default (warpgroup 0 does all of Q.K^T + softmax), the
# same with row-tile pairs sharing cache tiles through TMA multicast, and that with bf16 partials.
MAIN_VARIANTS = {
    "default": {},
    "cluster_pairs": {"cluster_pairs": True},
    "cluster_pairs+bf16_partials": {"cluster_pairs": True, "partial_dtype": torch.bfloat16},
}
if kernel is not None and kernel.__name__.endswith("sm100"):
    MAIN_VARIANTS = {"default": {}}  # the Blackwell build has no variants


@pytest.mark.parametrize("variant", sorted(MAIN_VARIANTS))
@pytest.mark.parametrize("context", [1024, 8192, 32768])
@pytest.mark.parametrize("T", [1, 4, 8, 16])
def test_one_request(T, context, variant):
    torch.backends.cuda.matmul.allow_tf32 = False
    run_case(1, T, context, [T], **MAIN_VARIANTS[variant])


@pytest.mark.parametrize("variant", sorted(MAIN_VARIANTS))
@pytest.mark.parametrize("context", [1024, 8192, 32768])
@pytest.mark.parametrize("T", [1, 4, 8, 16])
def test_two_requests_different_lengths_one_padded(T, context, variant):
    torch.backends.cuda.matmul.allow_tf32 = False
    run_case(2, T, context, [T, max(T - 3, 1) if T > 1 else 0], **MAIN_VARIANTS[variant])


@pytest.mark.parametrize("splits", [1, 3, 64])
def test_forced_splits_including_the_single_split_path(splits):
    # one split: the attention kernel writes bf16 itself; 64 splits at 1k: most splits are empty;
    # T = 3 has an odd number of row tiles (5): the cluster-pair kernel runs a sixth, empty one
    torch.backends.cuda.matmul.allow_tf32 = False
    run_case(2, 8, 1024 if splits == 64 else 8192, [8, 5], splits=splits)
    run_case(1, 1, 4000, [1], splits=splits)  # context not a multiple of the 64-row KV tile
    run_case(2, 3, 3000, [3, 2], splits=splits, cluster_pairs=True)


# S split over both warpgroups (288 threads, or 384 with a producer warpgroup + setmaxnreg) or
# all of S in warpgroup 0 (the default); TMA prefetches of cache tiles into L2; cluster pairs;
# bf16 split-KV partials.
VARIANTS = [
    dict(qk_one_warpgroup=False, producer_warpgroup=False),
    dict(qk_one_warpgroup=False, producer_warpgroup=True),
    dict(qk_one_warpgroup=False, cluster_pairs=True),
    dict(qk_one_warpgroup=True),
    dict(qk_one_warpgroup=True, l2_prefetch=True),
    dict(qk_one_warpgroup=True, cluster_pairs=True, l2_prefetch=True),
    dict(qk_one_warpgroup=True, partial_dtype=torch.bfloat16),
    dict(qk_one_warpgroup=True, cluster_pairs=True, partial_dtype=torch.bfloat16),
]


@pytest.mark.skipif(kernel is not None and kernel.__name__.endswith("sm100"), reason="Hopper-only variants")
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "+".join(
    k if on is True else f"{k}={str(on).split('.')[-1]}" for k, on in v.items() if on) or "split_s")
def test_every_kernel_variant(variant):
    torch.backends.cuda.matmul.allow_tf32 = False
    run_case(2, 8, 8192, [8, 6], **variant)
    run_case(1, 16, 2048, [16], splits=1, **variant)
    run_case(2, 1, 1000, [1, 0], splits=3, **variant)


def test_int32_indices_and_odd_lengths():
    torch.backends.cuda.matmul.allow_tf32 = False
    run_case(2, 5, 3000, [5, 2], index_dtype=torch.int32)


def test_registry_picks_the_cute_kernel():
    registry.overrides.pop("mla_verify_attention", None)
    gen = torch.Generator(device="cuda").manual_seed(1)
    args = make_inputs(gen, 2, 4, 2048, [4, 3])
    assert registry.select("mla_verify_attention", *args).name == kernel.__name__.rsplit(".", 1)[-1]
    from dspark.kernels import ops

    out = ops.mla_verify_attention(*args, SCALE)
    ref = oracle(*args, SCALE)
    assert ((out.float() - ref).norm() / ref.norm()).item() <= REL_TOL
    # fp32 inputs are outside the kernel: the reference takes them
    fp32_args = (args[0].float(), args[1].float(), args[2].float(), *args[3:])
    assert registry.select("mla_verify_attention", *fp32_args).name == "reference"
