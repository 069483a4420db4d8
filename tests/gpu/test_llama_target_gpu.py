"""SmolLM2 LlamaTarget on CUDA with attention="batched" (the path GPU training, self-distillation and the
recipe's decoding use): float32 logits and taps agree with the CPU per-query reference, greedy speculation
with a DSpark drafter emits plain greedy decoding's tokens on the same GPU target, and the engine's CUDA
graphs of its decode steps emit the eager steps' tokens.

Tolerances: logits (O(10)) atol 2e-3 (cuBLAS reduction orders over 30 layers; the CPU batched
path measures ~1e-5); taps relative 1e-4. The GPU path is not row-invariant, so a greedy divergence
is accepted only at a near tie: the two top logits of plain decoding within 2e-3 at the first
differing token.
"""
import importlib.util
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from dspark.config import SamplingParams, SpecConfig  # noqa: E402
from dspark.drafters.dspark import DSparkDrafter, DSparkModel  # noqa: E402
from dspark.drafters.ngram import NgramDrafter  # noqa: E402
from dspark.engine import Engine  # noqa: E402
from dspark.graph_step import GraphedRunner, capturable  # noqa: E402
from dspark.targets.gguf_assets import MissingAssetError, find_smollm2_gguf  # noqa: E402
from dspark.targets.llama import LlamaTarget, load_llama_gguf, weights_to  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("smollm2_dspark", REPO / "experiments" / "smollm2_dspark.py")
recipe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(recipe)

try:
    CONFIG, WEIGHTS, _ = load_llama_gguf(find_smollm2_gguf())
except MissingAssetError as error:
    pytest.skip(str(error), allow_module_level=True)


def test_batched_cuda_matches_cpu_per_query_reference():
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    cpu = LlamaTarget(CONFIG, WEIGHTS, max_slots=2, max_seq_len=64)
    cuda = LlamaTarget(CONFIG, weights_to(WEIGHTS, "cuda"), max_slots=2, max_seq_len=64, attention="batched")
    prompts = [torch.randint(0, CONFIG.vocab_size, (n,), generator=g) for n in (17, 9)]
    drafts = torch.randint(0, CONFIG.vocab_size, (2, 6), generator=g)
    taps = (3, 27)
    for target in (cpu, cuda):
        target.outs = [target.prefill([0, 1], [p.to(target.device) for p in prompts], taps)]
        target.outs.append(target.verify([1, 0], drafts.to(target.device), torch.tensor([6, 4]), taps))
    for a, b, lengths in zip(cuda.outs, cpu.outs, ((17, 9), (6, 4))):
        for r, n in enumerate(lengths):
            rows = min(n, a.logits.shape[1])  # prefill: the last position's logits only
            torch.testing.assert_close(a.logits[r, :rows].cpu(), b.logits[r, :rows], rtol=0, atol=2e-3)
            for layer in taps:
                ref = b.taps[layer][r, :n]
                assert ((a.taps[layer][r, :n].cpu() - ref).norm() / ref.norm()).item() < 1e-4


def assert_equal_up_to_a_near_tie(prompt: list[int], want: list[int], got: list[int]) -> None:
    """got's greedy tokens are want's, or they part where the GPU target's two top logits after want's
    common prefix are within 2e-3 (its matmuls block by batch shape, so a near tie may go either way)."""
    if got == want:
        return
    first = next(i for i, (a, b) in enumerate(zip(want, got)) if a != b)
    reference = LlamaTarget(CONFIG, weights_to(WEIGHTS, "cuda"), max_slots=1, max_seq_len=256, attention="batched")
    context = torch.tensor(prompt + want[:first], device="cuda")
    top2 = reference.prefill([0], [context]).logits[0, -1].topk(2).values
    assert float(top2[0] - top2[1]) < 2e-3, (first, want, got)


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager_drafter", "graphed_drafter"])
def test_greedy_speculation_equals_plain_decoding_on_the_gpu_target(cuda_graphs):
    target = LlamaTarget(CONFIG, weights_to(WEIGHTS, "cuda"), max_slots=2, max_seq_len=256, attention="batched")
    cfg = recipe.drafter_config(target, "gpu_test", layers=1, markov_rank=32)  # the recipe's, dedicated mask id
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    drafter = DSparkDrafter(DSparkModel(cfg, *target.embedding_weights()).cuda(), 2, max_seq_len=256,
                            cuda_graphs=cuda_graphs)
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    prompts = [torch.randint(0, CONFIG.vocab_size, (n,), generator=g).tolist() for n in (20, 12)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    plain = Engine(target, None, SpecConfig(num_speculative_tokens=0)).generate(prompts, params)
    spec = Engine(target, drafter, SpecConfig(num_speculative_tokens=7)).generate(prompts, params)
    if cuda_graphs:  # two requests, then one: buckets 2 and 1, contexts past 64
        assert drafter._graphs.replays["draft"] >= 7, drafter._graphs.replays  # commits ride in the engine's step
    for prompt, p, s in zip(prompts, plain, spec):
        assert_equal_up_to_a_near_tie(prompt, p.token_ids, s.token_ids)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("drafter", ["plain", "ngram"])
def test_cuda_graphs_of_the_batched_target_emit_the_eager_steps_tokens(drafter, batch):
    """The batched target declares supports_cuda_graphs, so the engine replays its decode steps as CUDA
    graphs (verify of a device index of slots, device lengths and kept counts, nothing read on the host:
    the capture runs the step under sync-debug "error" first). Their greedy tokens are the eager steps'.
    Batch 1 replays bucket 1, the eager step's shapes: identical tokens. Batch 3 runs in the bucket of 4
    (a padding row on the free slot, verifying 0 tokens), whose matmuls block differently from the eager
    batch of 3: a divergence passes only at a near tie, the two top logits within 2e-3."""
    target = LlamaTarget(CONFIG, weights_to(WEIGHTS, "cuda"), max_slots=4, max_seq_len=256, attention="batched")
    assert capturable(target)
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    prompts = [torch.randint(0, CONFIG.vocab_size, (n,), generator=g).tolist() for n in (20, 12, 33)[:batch]]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    spec = SpecConfig(num_speculative_tokens=0 if drafter == "plain" else 3)
    make = lambda: None if drafter == "plain" else NgramDrafter()  # noqa: E731
    eager = Engine(target, make(), spec, cuda_graphs=False).generate(prompts, params)
    engine = Engine(target, make(), spec, cuda_graphs=True)
    graphed = engine.generate(prompts, params)
    assert isinstance(engine.runner, GraphedRunner)
    replays = sum(engine.runner.replays.values())
    assert replays >= engine.metrics.num_steps > 0, (engine.runner.replays, engine.metrics.num_steps)
    for prompt, e, r in zip(prompts, eager, graphed):
        if batch == 1:
            assert r.token_ids == e.token_ids
        else:
            assert_equal_up_to_a_near_tie(prompt, e.token_ids, r.token_ids)
    assert target.cache_lengths == [0] * target.max_slots


def test_graph_buckets_up_to_the_batch_replay_a_run_past_eight_requests():
    """Engine(graph_buckets=buckets_up_to(12)) over 12 requests of different lengths: every step replays a
    graph (the batch shrinks 12 -> ... as requests finish, each size in a bucket of its own or at most
    twice it), none runs eagerly, and the tokens are the eager steps' up to near ties (two top logits
    within 2e-3: a bucket's matmuls block differently from the eager batch's)."""
    from dspark.cuda_graphs import buckets_up_to

    target = LlamaTarget(CONFIG, weights_to(WEIGHTS, "cuda"), max_slots=12, max_seq_len=256, attention="batched")
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    prompts = [torch.randint(0, CONFIG.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(5, 40, (12,), generator=g)]
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 4 * i, ignore_eos=True) for i in range(12)]
    spec = SpecConfig(num_speculative_tokens=3)
    eager = Engine(target, NgramDrafter(), spec, cuda_graphs=False).generate(prompts, params)
    engine = Engine(target, NgramDrafter(), spec, cuda_graphs=True, graph_buckets=buckets_up_to(12))
    graphed = engine.generate(prompts, params)
    assert sum(engine.runner.replays.values()) >= engine.metrics.num_steps > 0, engine.runner.replays
    for prompt, e, r in zip(prompts, eager, graphed):
        assert_equal_up_to_a_near_tie(prompt, e.token_ids, r.token_ids)
