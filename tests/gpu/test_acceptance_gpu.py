"""The Triton acceptance kernels (kernels/acceptance/triton.py) against the reference samplers
(kernels/acceptance/reference.py, re-exported by dspark.sampling) on the GPU.

Decisions: for many random verified blocks, with the same uniforms and race noise, num_accepted
and every next token must equal the sampler's (run on the same GPU tensors): greedy, standard
with and without draft probabilities, temperatures, top-k, top-p, mixed per-request parameters,
the synthetic mode; V = 163,840 (Kimi K3) and a small V; outputs poisoned first. Filtered cases
use fp32 logits: with bf16 logits tied tokens at the top-k / top-p boundary make the sampler's
own set depend on its sort's order of equal keys (see filter_threshold).
Distribution: over many requests at a small vocabulary the emitted tokens follow the processed
target distribution (chi-square against the closed form), and a deliberately broken variant
built from the same kernels (resampling from p instead of the residual) fails the same test.
"""
import pytest
import torch
from scipy import stats

from dspark import sampling
from dspark.kernels import ops, registry
from dspark.kernels.acceptance import triton as acceptance

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not acceptance.triton_available(), reason="triton not installed"),
]

K3_VOCAB = 163_840
POISON = -7


def random_block(B, k, V, mode, *, dense_q, dtype=torch.float32, gen=None):
    """A verified block whose drafts are often right (peaky targets, drafts near the target).

    mode: greedy | temperature | top_k | top_p | mixed (every kind, per request)."""
    dev = "cuda"
    T = k + 1

    def rand(*shape):
        return torch.rand(*shape, device=dev, generator=gen)

    scale = 1 + 9 * rand(B, 1, 1)  # per-request peakiness: from flat to nearly deterministic
    logits = torch.randn(B, T, V, device=dev, generator=gen) * scale
    draft_logits = logits[:, :k] + torch.randn(B, k, V, device=dev, generator=gen) * scale * 0.3
    q = draft_logits.softmax(-1)
    if dense_q:
        drafts = torch.multinomial(q.reshape(-1, V), 1, generator=gen).view(B, k)
    else:  # one-hot proposals: the draft's argmax, now and then a random token
        drafts = torch.where(rand(B, k) < 0.8, draft_logits.argmax(-1),
                             torch.randint(0, V, (B, k), device=dev, generator=gen))
    temperature = rand(B) * 1.2 + 0.3
    top_k = torch.zeros(B, dtype=torch.long, device=dev)
    top_p = torch.ones(B, device=dev)
    if mode == "greedy":
        temperature.zero_()
    if mode in ("top_k", "mixed"):
        top_k = torch.randint(1, 60, (B,), device=dev, generator=gen)
    if mode in ("top_p", "mixed"):
        top_p = rand(B) * 0.5 + 0.45
    if mode == "mixed":  # some requests greedy, some unfiltered, some with one filter only
        temperature = torch.where(rand(B) < 0.25, 0.0, temperature)
        top_k = torch.where(rand(B) < 0.5, top_k, 0)
        top_p = torch.where(rand(B) < 0.5, top_p, 1.0)
    all_greedy = bool((temperature == 0).all())
    filters = bool(((top_k > 0) | (top_p < 1)).any())
    params = sampling.SamplingTensors(temperature, top_k, top_p, all_greedy=all_greedy, filters=filters)
    num_drafts = torch.randint(0, k + 1, (B,), device=dev, generator=gen)
    # the first request verifies all k drafts (rejections are likely) or none (a bonus for sure)
    num_drafts[0] = k if bool(rand(1) < 0.5) else 0
    return dict(target_logits=logits.to(dtype), draft_tokens=drafts, num_drafts=num_drafts,
                draft_probs=q if dense_q else None, sampling=params, uniforms=rand(B, k),
                race_noise=torch.empty(B, V, device=dev).exponential_(generator=gen))


def poisoned_out(B):
    return (torch.full((B,), POISON, dtype=torch.long, device="cuda"),
            torch.full((B,), POISON, dtype=torch.long, device="cuda"))


def assert_same_decisions(ours, ref, block, what):
    num_acc, next_tok = ours
    assert (num_acc != POISON).all() and (next_tok != POISON).all(), f"{what}: outputs not written"
    assert torch.equal(num_acc, ref[0]), f"{what}: num_accepted {num_acc.tolist()} != {ref[0].tolist()}"
    assert torch.equal(next_tok, ref[1]), f"{what}: next token {next_tok.tolist()} != {ref[1].tolist()}"


@pytest.mark.parametrize("mode", ["greedy", "mixed"])
def test_first_token_after_prefill_without_drafts(mode):
    # k = 0 (the engine's prefill step): T = 1, the next token is the argmax or p's race
    block = random_block(6, 0, K3_VOCAB, mode, dense_q=False)
    assert_same_decisions(acceptance.rejection_sample(**block, out=poisoned_out(6)), sampling.rejection_sample(**block),
                          block, f"k=0 {mode}")


@pytest.mark.parametrize("mode, dense_q", [("temperature", False), ("mixed", True)])
def test_no_host_synchronisation_and_cuda_graph_replay(mode, dense_q):
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    block = random_block(2, 7, K3_VOCAB, mode, dense_q=dense_q, gen=gen)
    acceptance.rejection_sample(**block)  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call in the op raises
    try:
        acceptance.rejection_sample(**block)
    finally:
        torch.cuda.set_sync_debug_mode("default")

    # captured once, replayed on new inputs copied into the captured buffers
    out = poisoned_out(2)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        acceptance.rejection_sample(**block, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        acceptance.rejection_sample(**block, out=out)
    for i in range(4):
        fresh = random_block(2, 7, K3_VOCAB, mode, dense_q=dense_q, gen=gen)
        for name, tensor in fresh.items():
            if isinstance(tensor, torch.Tensor):
                block[name].copy_(tensor)
        for name in ("temperature", "top_k", "top_p"):
            getattr(block["sampling"], name).copy_(getattr(fresh["sampling"], name))
        out[0].fill_(POISON), out[1].fill_(POISON)
        graph.replay()
        assert_same_decisions(out, sampling.rejection_sample(**block), block, f"graph replay {i}")


@pytest.mark.parametrize("dense_q", [False, True])
def test_programmatic_dependent_launch_gives_the_same_decisions(dense_q):
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    for i in range(4):
        block = random_block(2, 7, K3_VOCAB, "temperature", dense_q=dense_q, gen=gen)
        assert_same_decisions(acceptance.rejection_sample(**block, out=poisoned_out(2), pdl=True),
                              sampling.rejection_sample(**block), block, f"pdl dense_q={dense_q} batch {i}")


def test_registry_picks_triton_on_cuda_and_the_op_agrees():
    registry.overrides.pop("rejection_sample", None)
    block = random_block(3, 5, 5000, "mixed", dense_q=True)
    tensors = [block[n] for n in ("target_logits", "draft_tokens", "num_drafts", "uniforms", "race_noise")]
    assert registry.select("rejection_sample", *tensors, block["draft_probs"]).name == "triton"
    assert_same_decisions(ops.rejection_sample(**block), sampling.rejection_sample(**block), block, "ops")
    # fp64 noise is outside the kernels: the reference takes it
    assert registry.select("rejection_sample", *tensors[:4], tensors[4].double()).name == "reference"


# ---- distribution ------------------------------------------------------------------------------

SMALL_V = 6


def broken_rejection_sample(target_logits, draft_tokens, num_drafts, draft_probs, sampling_tensors, uniforms, noise):
    """The GPU kernels composed into a lossy sampler: after a rejection, the next token is drawn
    from p (the synthetic kernel forced to stop at the same position) instead of the residual."""
    num_acc, _ = acceptance.rejection_sample(target_logits, draft_tokens, num_drafts, draft_probs, sampling_tensors,
                                             uniforms, noise)
    k = draft_tokens.shape[1]
    positions = torch.arange(k, device=num_acc.device)
    forced = (positions[None, :] >= num_acc[:, None]).float()  # u = 0 accepts, u = 1 rejects
    half = torch.full((k,), 0.5, device=num_acc.device)
    return acceptance.synthetic_sample(target_logits, draft_tokens, num_drafts, half, sampling_tensors, forced, noise)


def emitted_token_pvalues(sampler, temperature, top_k, n=60_000):
    """Chi-square p-values of the first two emitted tokens against the processed target p_0, p_1
    (the toy target's positions do not depend on the tokens before them, so each emitted token
    follows its own position's processed distribution)."""
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    k, dev = 2, "cuda"
    base = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, 1.5], [0.0, 2.5, 1.0, 1.0, -1.0, 0.3],
                         [1.0, 0.0, 0.0, 2.0, 0.5, 0.5]], device=dev)
    q = torch.tensor([[0.05, 0.05, 0.6, 0.1, 0.15, 0.05], [0.5, 0.02, 0.08, 0.2, 0.1, 0.1]], device=dev)
    params = sampling.SamplingTensors(torch.full((n,), temperature, device=dev),
                                      torch.full((n,), top_k, dtype=torch.long, device=dev),
                                      torch.ones(n, device=dev), all_greedy=False, filters=top_k > 0)
    drafts = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=gen) for i in range(k)], dim=1)
    num_acc, next_tok = sampler(base.expand(n, -1, -1), drafts, torch.full((n,), k, device=dev), q.expand(n, -1, -1),
                                params, torch.rand(n, k, device=dev, generator=gen),
                                torch.empty(n, SMALL_V, device=dev).exponential_(generator=gen))
    first = torch.where(num_acc >= 1, drafts[:, 0], next_tok)
    second = torch.where(num_acc >= 2, drafts[:, 1], next_tok)[num_acc >= 1]
    one = sampling.SamplingTensors(torch.tensor([temperature]), torch.tensor([top_k]), torch.ones(1), False, top_k > 0)
    pvalues = []
    for position, tokens in ((0, first), (1, second)):
        p = sampling.processed_probs(base[position:position + 1].cpu().double(), one)[0].double()
        observed = torch.bincount(tokens.cpu(), minlength=SMALL_V).double()
        support = p > 0
        assert observed[~support].sum() == 0, f"position {position}: filtered tokens were emitted"
        expected = p[support] / p[support].sum() * observed.sum()
        pvalues.append(stats.chisquare(observed[support].numpy(), expected.numpy()).pvalue)
    return pvalues


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.7, 4)])
def test_emitted_tokens_follow_the_target_distribution(temperature, top_k):
    assert min(emitted_token_pvalues(acceptance.rejection_sample, temperature, top_k)) > 1e-3


def test_the_distribution_test_fails_for_resampling_from_p():
    assert emitted_token_pvalues(broken_rejection_sample, 1.0, 0)[0] < 1e-6


# ---- decisions over many random blocks (last: the longest part of the file) -----------------

CASES = [  # (B, k, V, batches)
    (1, 7, K3_VOCAB, 10),
    (4, 7, K3_VOCAB, 5),
    (8, 4, 1000, 20),
]


@pytest.mark.parametrize("mode", ["greedy", "temperature", "top_k", "top_p", "mixed"])
@pytest.mark.parametrize("dense_q", [False, True])
@pytest.mark.parametrize("B, k, V, batches", CASES)
def test_rejection_sample_decisions_equal_the_samplers(mode, dense_q, B, k, V, batches):
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    outcomes = torch.zeros(2, dtype=torch.long)  # (rejections, all accepted) seen: the paths ran
    for i in range(batches):
        dtype = torch.bfloat16 if mode in ("greedy", "temperature") and i % 2 else torch.float32
        block = random_block(B, k, V, mode, dense_q=dense_q, dtype=dtype, gen=gen)
        ref = sampling.rejection_sample(**block)
        ours = acceptance.rejection_sample(**block, out=poisoned_out(B))
        assert_same_decisions(ours, ref, block, f"{mode} dense_q={dense_q} B={B} V={V} batch {i} {dtype}")
        outcomes += torch.stack([(ref[0] < block["num_drafts"]).sum(), (ref[0] == block["num_drafts"]).sum()]).cpu()
    assert (outcomes > 0).all(), f"only one kind of outcome: {outcomes.tolist()}"


@pytest.mark.parametrize("mode", ["greedy", "temperature", "mixed"])
@pytest.mark.parametrize("V", [K3_VOCAB, 1000])
def test_synthetic_sample_decisions_equal_the_samplers(mode, V):
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    k = 7
    rates = torch.tensor(sampling.conditional_rates(sampling.acceptance_length_to_rates(4.3, k)), device="cuda")
    for i in range(8):
        block = random_block(4, k, V, mode, dense_q=False, gen=gen)
        args = (block["target_logits"], block["draft_tokens"], block["num_drafts"], rates, block["sampling"],
                block["uniforms"], block["race_noise"])
        assert_same_decisions(acceptance.synthetic_sample(*args, out=poisoned_out(4)),
                              sampling.synthetic_sample(*args), block, f"synthetic {mode} V={V} batch {i}")
