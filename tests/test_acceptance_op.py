"""The acceptance ops on the CPU: the reference implementations are the samplers of
kernels/acceptance/reference.py (re-exported by dspark.sampling), ops.* dispatches to them on
CPU tensors, and the pieces of the Triton implementation that run without a GPU (argument
checks, the registry predicate, the split, and the top-k / top-p threshold that must reproduce
the sampler's filtered set exactly). The kernels themselves run in
tests/gpu/test_acceptance_gpu.py (CI has no triton and no GPU)."""
import pytest
import torch

from dspark import sampling
from dspark.kernels import ops, registry
from dspark.kernels.acceptance import triton as acceptance_triton


def _random_block(B=5, k=4, V=97, dense_q=True, filters=True, dtype=torch.float32):
    """A verified block with mixed per-request parameters (greedy, temperatures, top-k, top-p)."""
    T = k + 1
    logits = (torch.randn(B, T, V) * (1 + 4 * torch.rand(B, 1, 1))).to(dtype)
    q = (logits[:, :k].float() + torch.randn(B, k, V)).softmax(-1)
    drafts = torch.multinomial(q.reshape(-1, V), 1).view(B, k)
    temperature = torch.where(torch.rand(B) < 0.3, 0.0, torch.rand(B) + 0.3)
    top_k = torch.where(torch.rand(B) < 0.5, torch.randint(1, 30, (B,)), 0) if filters else torch.zeros(B, dtype=torch.long)
    top_p = torch.where(torch.rand(B) < 0.5, torch.rand(B) * 0.8 + 0.15, 1.0) if filters else torch.ones(B)
    params = sampling.SamplingTensors(temperature, top_k, top_p, all_greedy=False, filters=filters)
    return dict(target_logits=logits, draft_tokens=drafts, num_drafts=torch.randint(0, k + 1, (B,)),
                draft_probs=q if dense_q else None, sampling=params, uniforms=torch.rand(B, k),
                race_noise=torch.empty(B, V).exponential_())


def test_reference_implementations_are_the_samplers_themselves():
    assert registry.implementations("rejection_sample")["reference"].fn is sampling.rejection_sample
    assert registry.implementations("synthetic_sample")["reference"].fn is sampling.synthetic_sample
    assert set(registry.implementations("rejection_sample")) >= {"reference", "triton"}


@pytest.mark.parametrize("dense_q", [False, True])
def test_ops_on_cpu_tensors_dispatch_to_the_reference_and_match_the_sampler(dense_q):
    block = _random_block(dense_q=dense_q)
    tensors = [block[n] for n in ("target_logits", "draft_tokens", "num_drafts", "uniforms", "race_noise")]
    assert registry.select("rejection_sample", *tensors).name == "reference"
    got = ops.rejection_sample(**block)
    want = sampling.rejection_sample(**block)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert (want[0] < block["num_drafts"]).any() or (want[0] == block["num_drafts"]).any()

    rates = torch.tensor([0.9, 0.6, 0.5, 0.2])
    args = (block["target_logits"], block["draft_tokens"], block["num_drafts"], rates, block["sampling"],
            block["uniforms"], block["race_noise"])
    got, want = ops.synthetic_sample(*args), sampling.synthetic_sample(*args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_filter_threshold_keeps_the_samplers_filtered_set(dtype):
    # bf16 logits have ties at the top-k / top-p boundary, where the sampler's set depends on its
    # sort's order of equal keys: there the threshold must keep as many tied tokens as the
    # sampler (lowest indices first); every token not tied at the boundary must agree exactly.
    B, T, V = 6, 3, 2000
    logits = (torch.randn(B, T, V) * 2).to(dtype)
    temperature = torch.rand(B) + 0.3
    top_k = torch.tensor([0, 5, 50, 0, 300, 7])
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.99, 0.8, 1.0])
    params = sampling.SamplingTensors(temperature, top_k, top_p, all_greedy=False, filters=True)
    want = sampling.processed_probs(logits.reshape(B * T, V), params.expand(T)).view(B, T, V) > 0
    value, index = acceptance_triton.filter_threshold(logits, T, params)
    assert value.shape == (B, T) and index.dtype == torch.int32
    scaled = logits.float() / temperature[:, None, None]
    vocab = torch.arange(V)
    tied = scaled == value[..., None]
    got = (scaled > value[..., None]) | (tied & (vocab <= index[..., None]))
    assert torch.equal(got & ~tied, want & ~tied)
    assert torch.equal(got.sum(-1), want.sum(-1))
    if dtype == torch.float32:
        assert torch.equal(got, want)
    else:
        assert (tied.sum(-1) > 1).any()  # the case this test is for did occur
    assert (want.sum(-1) > 1).any() and (want.sum(-1) < V).all()  # the filters did cut something


def test_chunk_size_covers_the_vocabulary_in_block_multiples():
    for batch, positions, vocab in ((1, 8, 163_840), (4, 8, 163_840), (64, 16, 163_840), (3, 1, 97)):
        chunk = acceptance_triton.chunk_size(batch, positions, vocab, block=1024, target_programs=1024)
        splits = -(-vocab // chunk)
        assert chunk % 1024 == 0 and splits * chunk >= vocab and (splits - 1) * chunk < vocab
        assert batch * positions * splits <= max(1024, batch * positions) + batch * positions
    assert acceptance_triton.chunk_size(1, 8, 163_840, block=1024, target_programs=1024) == 2048


def test_registry_predicate_sends_what_the_kernels_do_not_take_to_the_reference():
    block = _random_block(B=2, k=4, V=50)
    args = [block[n] for n in ("target_logits", "draft_tokens", "num_drafts", "uniforms", "race_noise")]
    assert acceptance_triton.supports_rejection_sample(*args)
    assert acceptance_triton.supports_rejection_sample(*args, block["draft_probs"].bfloat16())
    assert not acceptance_triton.supports_rejection_sample(*args, block["draft_probs"].double())
    assert not acceptance_triton.supports_rejection_sample(args[0].double(), *args[1:])
    assert not acceptance_triton.supports_rejection_sample(*args[:4], args[4].double())
    long_block = torch.zeros(2, 16, dtype=torch.long)  # k = 16 drafts: more positions than the combine unrolls
    assert not acceptance_triton.supports_rejection_sample(torch.randn(2, 17, 50), long_block, *args[2:])
    assert acceptance_triton.supports_synthetic_sample(*args, torch.rand(4))


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(target_logits=torch.randn(2, 5)), "target_logits.shape"),
        (dict(draft_tokens=torch.zeros(2, 5, dtype=torch.long)), "draft_tokens.shape"),
        (dict(draft_tokens=torch.zeros(2, 4)), "draft_tokens.shape"),
        (dict(num_drafts=torch.ones(3, dtype=torch.long)), "num_drafts.shape"),
        (dict(uniforms=torch.rand(2, 2)), "uniforms.shape"),
        (dict(race_noise=torch.rand(2, 50).double()), "race_noise.shape"),
        (dict(draft_probs=torch.rand(2, 4, 49)), "draft_probs.shape"),
    ],
)
def test_triton_wrapper_rejects_bad_arguments_naming_the_field(change, field):
    block = _random_block(B=2, k=4, V=50)
    block.update(change)
    with pytest.raises(ValueError, match=field):
        acceptance_triton.rejection_sample(**block)


# ---- where triton is installed (not in CI): every kernel variant compiles for Hopper ----------

def _compile_all_variants(capability: int) -> dict[str, str]:
    """PTX of every constexpr variant the wrapper launches, built without a GPU (Triton 3.6's
    ASTSource + a named target)."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dspark.kernels.acceptance import triton_kernels as kernels

    pointers = {  # element types as the wrapper passes them (bf16 logits, int64 ids and outputs)
        "logits_ptr": "*bf16", "noise_ptr": "*fp32", "drafts_ptr": "*i64", "num_drafts_ptr": "*i64", "q_ptr": "*fp32",
        "uniforms_ptr": "*fp32", "rates_ptr": "*fp32", "temperature_ptr": "*fp32", "floor_value_ptr": "*fp32",
        "floor_index_ptr": "*i32", "part_f_ptr": "*fp32", "part_i_ptr": "*i32", "num_accepted_ptr": "*i64",
        "next_token_ptr": "*i64", "stop_f_ptr": "*fp32", "stop_i_ptr": "*i32", "res_f_ptr": "*fp32", "res_i_ptr": "*i32",
    }

    def build(fn, constexprs):
        names = fn.arg_names
        signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in names}
        source = ASTSource(fn=fn, signature=signature, constexprs={(names.index(n),): v for n, v in constexprs.items()})
        return triton_compile(source, target=GPUTarget("cuda", capability, 32), options={"num_warps": 4}).asm["ptx"]

    ptx = {}
    for filtered, pdl in ((False, False), (True, False), (False, True)):
        for greedy_only in (False, True):
            ptx[f"row_partials F={filtered} G={greedy_only} PDL={pdl}"] = build(
                kernels.row_partials, dict(BLOCK=1024, FILTERED=filtered, GREEDY_ONLY=greedy_only, PDL=pdl))
        for has_q, synthetic in ((False, False), (True, False), (False, True)):
            ptx[f"accept F={filtered} Q={has_q} S={synthetic} PDL={pdl}"] = build(
                kernels.accept, dict(POSITIONS=8, POSITIONS_POW2=8, SPLITS_POW2=128, FILTERED=filtered, HAS_Q=has_q, SYNTHETIC=synthetic,
                                     PDL=pdl))
        ptx[f"residual_partials F={filtered} PDL={pdl}"] = build(
            kernels.residual_partials, dict(BLOCK=1024, FILTERED=filtered, PDL=pdl))
    for pdl in (False, True):
        ptx[f"residual_pick PDL={pdl}"] = build(kernels.residual_pick, dict(SPLITS_POW2=128, PDL=pdl))
    return ptx


@pytest.mark.skipif(not acceptance_triton.triton_available(), reason="triton not installed (CI)")
def test_every_triton_kernel_variant_compiles_for_hopper_without_spills():
    for name, ptx in _compile_all_variants(90).items():
        assert ".target sm_90" in ptx, name
        assert "ld.local" not in ptx and "st.local" not in ptx, f"{name}: local memory (register spills)"
        # programmatic dependent launch only where asked for (row_partials only releases)
        assert ("griddepcontrol" in ptx) == ("PDL=True" in name), name
        if "PDL=True" in name and not name.startswith("row_partials"):
            assert "griddepcontrol.wait" in ptx, name
