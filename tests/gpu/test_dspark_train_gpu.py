"""The fast DSpark training step on the GPU (issue 33), at the SmolLM2 drafter's widths: FlexAttention's
block-sparse pass against the dense SDPA pass (loss and gradients), the compiled step against the eager
one and no recompilation from batch to batch of one bucketed shape, and the bf16 capture store against
online capture through a real (random) Llama target."""
import dataclasses
import time

import pytest
import torch

from dspark.drafters.dspark.capture import BatchCapture, CaptureStore, capture
from dspark.drafters.dspark.config import DSparkConfig
from dspark.drafters.dspark.model import DSparkModel
from dspark.drafters.dspark.train import TrainConfig, Trainer, capture_layers, train_step_loss
from dspark.targets.llama import weights_to

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

V, D, TAPS = 49152, 576, (1, 7, 14, 21, 27)  # SmolLM2's vocabulary and width, the recipe's taps of its 30 layers


def smollm2_sized_drafter(seed: int, layers: int = 2) -> DSparkModel:
    """The recipe's drafter shape (GQA 9 x 64, 3 KV heads, FFN 1536, Markov rank 256, block 7) around a
    random frozen embedding and LM head of SmolLM2's size."""
    config = DSparkConfig(name="gpu-test", vocab_size=V, hidden_size=D, num_layers=layers, num_heads=9, num_kv_heads=3,
                          head_dim=64, intermediate_size=1536, attention_type="gqa", rope_theta=100000.0,
                          rope_interleaved=False, max_position_embeddings=2048, target_hidden_size=D, target_num_layers=30,
                          target_layer_ids=TAPS, block_size=7, mask_token_id=V, markov_rank=256).validate()
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(V, D, generator=g) * 0.05
    torch.manual_seed(seed)
    model = DSparkModel(config, embed.cuda(), embed.cuda())
    model.init_heads_like_deepspec()
    return model.cuda()


def random_batch(seed: int, B: int = 4, lengths=(300, 500)):
    """Sequences (a quarter prompt) and a bf16 capture as a store gives it: the taps stacked, the LM
    head's input (layer 30) last, of unit scale like the target's normed states."""
    g = torch.Generator().manual_seed(seed)
    ns = torch.randint(*lengths, (B,), generator=g).tolist()
    seqs = [torch.randint(0, V, (n,), generator=g) for n in ns]
    masks = [torch.cat([torch.zeros(n // 4, dtype=torch.long), torch.ones(n - n // 4, dtype=torch.long)]) for n in ns]
    layers = TAPS + (30,)
    stacked = torch.randn(B, max(ns), len(layers), D, generator=g).to(torch.bfloat16).cuda()
    captured = BatchCapture({layer: stacked[:, :, k] for k, layer in enumerate(layers)}, None, (layers, stacked))
    return seqs, masks, captured


def step(model, captured, seqs, masks, cfg, forward=None):
    model.zero_grad(set_to_none=True)
    loss, _ = train_step_loss(model, captured, seqs, masks, cfg, torch.Generator().manual_seed(7), forward=forward)
    loss.backward()
    return loss.detach().float(), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


BASE = TrainConfig(num_anchors=256, teacher="lm_head", fast=True, anchor_bucket=128, length_bucket=256)


def test_flex_attention_step_equals_the_dense_sdpa_step_in_float32():
    """Loss and every gradient of the block-sparse pass against the dense-mask pass, float32 operands
    (no autocast): they differ by the attention kernels' accumulation order and the TF32 that flex's
    Triton dots may use (2^-11 relative per product): bounded by 5e-3 of each gradient's norm."""
    model = smollm2_sized_drafter(1)
    seqs, masks, captured = random_batch(2)
    loss_dense, grads_dense = step(model, captured, seqs, masks, BASE)
    loss_flex, grads_flex = step(model, captured, seqs, masks, dataclasses.replace(BASE, attention="flex"))
    assert torch.isfinite(loss_flex) and abs(float(loss_flex - loss_dense)) <= 1e-4 * abs(float(loss_dense))
    assert set(grads_flex) == set(grads_dense)
    for name in grads_dense:
        assert relative(grads_flex[name], grads_dense[name]) < 5e-3, name


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_bf16_step_equals_the_eager_one_and_does_not_recompile_per_batch(mode):
    """The step as the recipe trains it (bf16 autocast, flex, buckets) compiled against eager: the same
    loss to bf16's resolution (the compiled graph fuses and rounds bf16 intermediates elsewhere, ~2^-8
    relative each) and gradients within 3% of their norms; then two more batches of the same bucketed
    shape (new anchors, other lengths) run without a recompilation. reduce-overhead: the compiled pass
    replayed as CUDA graphs (TrainConfig.compile_mode), each replay overwriting the last one's outputs."""
    model = smollm2_sized_drafter(3)
    model.autocast_dtype = torch.bfloat16
    cfg = dataclasses.replace(BASE, attention="flex", compile=True, compile_mode=mode, num_anchors=128)
    trainer = Trainer(model, *random_batch(4)[:2], cfg)  # its compiled forward, as training builds it
    seqs, masks, captured = random_batch(4)
    loss_eager, grads_eager = step(model, captured, seqs, masks, cfg)
    for _ in range(2):  # the first call compiles; the second shows a stable graph
        loss_compiled, grads_compiled = step(model, captured, seqs, masks, cfg, forward=trainer.forward)
    assert abs(float(loss_compiled - loss_eager)) <= 1e-2 * abs(float(loss_eager))
    for name in grads_eager:
        assert relative(grads_compiled[name], grads_eager[name]) < 3e-2, name
    with torch.compiler.set_stance("fail_on_recompile"):
        for seed in (5, 6):  # lengths in [300, 500): padded to 512; 128 anchors each
            other_seqs, other_masks, other = random_batch(seed)
            loss, _ = step(model, other, other_seqs, other_masks, cfg, forward=trainer.forward)
            assert torch.isfinite(loss)
    trainer.close()


def tiny_llama_on_cuda(seed: int):
    import test_dspark_train_fast as cpu_tests  # the CPU tests' random Llama, moved to the GPU

    cpu = cpu_tests.tiny_llama(seed)
    from dspark.targets.llama import LlamaTarget

    return LlamaTarget(cpu.config, weights_to(cpu.weights, "cuda"), max_slots=4, max_seq_len=128, attention="batched"), cpu_tests


@pytest.mark.parametrize("precision, bound", [("highest", 1e-5), ("high", 5e-3)])
def test_flex_capture_attention_gives_the_sdpa_capture_taps(precision, bound):
    """The compiled capture with FlexAttention (taps_attention="flex") against the one with SDPA, at
    SmolLM2's attention shape (9 query heads of 64 over 3 KV heads) over sequences of 2-6 of its
    128-row tiles: in float32 (matmul precision "highest") the same function to float rounding; with
    TF32 matmuls ("high", as the recipe trains), FlexAttention's matmuls round their operands to TF32
    as the capture's GEMMs already do, where SDPA's float32 kernel does not (relative L2 per tap)."""
    import test_dspark_train_fast as cpu_tests
    from dspark.targets.llama import LlamaConfig, LlamaTarget

    config = LlamaConfig(vocab_size=512, hidden_size=D, num_layers=3, num_heads=9, num_kv_heads=3, intermediate_size=1536,
                         rope_theta=100000.0, rms_norm_eps=1e-5, context_length=1024, tie_word_embeddings=True)
    cpu = cpu_tests.tiny_llama(23, config=config, max_seq_len=800)
    weights = weights_to(cpu.weights, "cuda")
    sdpa, flex = (LlamaTarget(config, weights, max_slots=4, max_seq_len=800, attention="batched", compiled_taps=True,
                              taps_attention=name) for name in ("sdpa", "flex"))
    g = torch.Generator().manual_seed(24)
    layers = (0, 2, config.num_layers)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    # A compile past the recompile limit would run FlexAttention uncompiled (densely) and pass unseen.
    strict = ({"fail_on_recompile_limit_hit": True} if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit")
              else {})
    try:
        for lengths in ([700, 257, 300, 129], [511, 200]):
            seqs = [torch.randint(0, config.vocab_size, (n,), generator=g) for n in lengths]
            with torch._dynamo.config.patch(**strict):
                want, got = sdpa.causal_taps(seqs, layers), flex.causal_taps(seqs, layers)
            for layer in layers:
                rows = torch.cat([want[layer][i, :n] for i, n in enumerate(lengths)])
                flex_rows = torch.cat([got[layer][i, :n] for i, n in enumerate(lengths)])
                assert relative(flex_rows, rows) < bound, (precision, lengths, layer, relative(flex_rows, rows))
                assert all(not got[layer][i, n:].any() for i, n in enumerate(lengths))
    finally:
        torch.set_float32_matmul_precision(before)


def test_bf16_capture_operands_stay_within_bf16_rounding_of_the_float32_capture():
    """The compiled FlexAttention capture with bf16 operands (taps_precision="bfloat16", bf16 tensor-core
    GEMMs and attention) against the same capture in float32 (matmul precision "highest"), at SmolLM2's
    attention shape over sequences of 2-6 of its tiles: each tap's relative L2 error above 1e-4 (the bf16
    path ran) and below 2e-2, padding zero."""
    import test_dspark_train_fast as cpu_tests
    from dspark.targets.llama import LlamaConfig, LlamaTarget

    config = LlamaConfig(vocab_size=512, hidden_size=D, num_layers=3, num_heads=9, num_kv_heads=3, intermediate_size=1536,
                         rope_theta=100000.0, rms_norm_eps=1e-5, context_length=1024, tie_word_embeddings=True)
    cpu = cpu_tests.tiny_llama(25, config=config, max_seq_len=800)
    weights = weights_to(cpu.weights, "cuda")
    full, bf16 = (LlamaTarget(config, weights, max_slots=4, max_seq_len=800, attention="batched", compiled_taps=True,
                              taps_attention="flex", taps_precision=p) for p in ("float32", "bfloat16"))
    g = torch.Generator().manual_seed(26)
    layers = (0, 2, config.num_layers)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        for lengths in ([700, 257, 300, 129], [511, 200]):
            seqs = [torch.randint(0, config.vocab_size, (n,), generator=g) for n in lengths]
            want, got = full.causal_taps(seqs, layers), bf16.causal_taps(seqs, layers)
            for layer in layers:
                rows = torch.cat([want[layer][i, :n] for i, n in enumerate(lengths)])
                bf16_rows = torch.cat([got[layer][i, :n] for i, n in enumerate(lengths)])
                assert 1e-4 < relative(bf16_rows, rows) < 2e-2, (lengths, layer, relative(bf16_rows, rows))
                assert all(not got[layer][i, n:].any() for i, n in enumerate(lengths))
    finally:
        torch.set_float32_matmul_precision(before)


def test_a_bf16_store_on_the_gpu_gives_the_online_capture_losses():
    """A store of taps and the LM head's input (float32 and bf16) against capturing the batch with the
    target's own logits, both through the fast step: float32 to the batched target's row-order noise,
    bf16 within its rounding (2^-8 relative per stored value)."""
    target, cpu_tests = tiny_llama_on_cuda(11)
    seqs, masks = cpu_tests.data(target, 6, 12)
    torch.manual_seed(13)
    model = cpu_tests.llama_drafter(target).cuda()
    # The tiny drafter's heads of 8 are below FlexAttention's GPU minimum: the store is what this checks.
    cfg = TrainConfig(num_anchors=12, fast=True, attention="sdpa")
    pick = [4, 1, 5]
    online = capture(target, [seqs[i] for i in pick], tuple(model.config.target_layer_ids))
    losses = {"online": float(train_step_loss(model, online, [seqs[i] for i in pick], [masks[i] for i in pick], cfg,
                                              torch.Generator().manual_seed(1))[0])}
    for dtype in (torch.float32, torch.bfloat16):
        store_cfg = dataclasses.replace(cfg, teacher="lm_head")
        store = CaptureStore(target, seqs, capture_layers(model, store_cfg), dtype=dtype)
        store.fill(progress=False)
        loss, _ = train_step_loss(model, store.batch(pick), [seqs[i] for i in pick], [masks[i] for i in pick], store_cfg,
                                  torch.Generator().manual_seed(1))
        losses[str(dtype)] = float(loss)
    assert losses["torch.float32"] == pytest.approx(losses["online"], rel=1e-4), losses
    assert losses["torch.bfloat16"] == pytest.approx(losses["online"], rel=2e-2), losses


def test_flex_attention_refuses_heads_below_its_gpu_minimum_naming_the_fix():
    from dspark.drafters.dspark import flex

    q = torch.randn(1, 2, 16, 8, device="cuda")
    with pytest.raises(ValueError, match="attention='flex': head dimensions 8 .* must be >= 16; train this drafter "
                                         "with attention='sdpa'"):
        flex.flex_attend(q, q, q, None, 1.0)


def test_a_steps_host_work_does_not_wait_for_the_gpu():
    """The block mask, the store's gather with its online capture, and the target's causal taps
    upload their host indices through pinned memory: queued behind a long kernel, each returns to the
    host before the kernel ends (a pageable copy would wait for the whole stream), and the values,
    read after it, are the ones computed with the stream idle."""
    from dspark.drafters.dspark import flex

    target, cpu_tests = tiny_llama_on_cuda(17)
    seqs, _ = cpu_tests.data(target, 6, 18)
    store = CaptureStore(target, seqs, (0, 2, target.num_layers), dtype=torch.float32,
                         budget_bytes=(len(seqs[0]) + len(seqs[1])) * 3 * target.hidden_size * 4)
    store.fill(progress=False)
    anchors = torch.sort(torch.randint(1, 40, (3, 12)), dim=1).values
    def uploaded_mask():
        mask = flex.block_mask(anchors, 48, 4, "cuda")
        return torch.cat([mask.kv_num_blocks.flatten(), mask.kv_indices.flatten()])

    work = {"block_mask": uploaded_mask,
            "store_batch": lambda: store.batch([4, 1, 5]).stacked[1],
            "causal_taps": lambda: target.causal_taps([seqs[i] for i in (2, 3)], (0, target.num_layers))[0]}
    idle = {name: fn().clone() for name, fn in work.items()}
    torch.cuda.synchronize()
    for name, fn in work.items():
        fn()  # allocator and pinned-block warm-up
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # ~1 s of a busy stream at the H100's clocks
        began = time.perf_counter()
        queued = fn()
        host = time.perf_counter() - began
        stream_left = not torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        assert stream_left, f"{name}: the stream went idle while the host worked ({host:.3f} s)"
        assert host < 0.3, f"{name}: {host:.3f} s on the host behind a busy stream: it waited for the GPU"
        torch.testing.assert_close(queued, idle[name], rtol=0, atol=0, msg=name)
