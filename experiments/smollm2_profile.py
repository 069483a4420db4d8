"""Where the SmolLM2 recipe's GPU time goes (issue 13): a self-distillation decode step and a
drafter training step, timed and profiled at the recipe's sizes.

The weights are random at SmolLM2-135M's shapes (or the real ones with --gguf): the cost of a step
does not depend on the values, and this needs no GGUF staging. For each piece it reports the wall
time with a synchronize around it, the GPU time the profiler saw in it, the number of kernels and
host-side aten calls, the largest GPU kernels and host ops by name, and (warmup_s) the seconds of the
warm-up calls before them, where a compiled piece compiles:

- decode: a plain-decoding engine step at --slots requests (half greedy, half T = 1), each with a
  --context-token committed prefix, as experiments/smollm2_dspark.py's self-distillation runs it;
- capture: the target prefill that gives one training batch its logits and taps;
- train_before / train_after: one DSpark training step (the batch's capture, forward, backward, clip,
  AdamW) before issue 33 and now, in one run on the same batches (training_pieces says what each is);
  both in the precision the recipe trains in (TF32 float32 matmuls, the backbone under bf16 autocast);
- train_ablation: the DFlash ablation's step as train_after runs it (cross-entropy alone, no Markov head);
- train_after_graphs (on a GPU, compiled): train_after with the blocks' pass compiled in torch.compile's
  "reduce-overhead" mode, its forward and backward replayed as CUDA graphs (TrainConfig.compile_mode);
- held_out (--pieces checks): one held-out acceptance measurement (calibrate.run_rounds) as training
  runs it (checks_piece); held_out_graphed (on a GPU): the same with every batch size of the run in a
  CUDA graph, the engine's steps and the drafter's (the recipe's --graph-buckets batch);
- capture_taps, capture_taps_autocast, store_online (--pieces capture): what a step pays for the
  sequences of its batch that the capture store does not hold (capture_pieces says what each is);
- capture_precision (--pieces precision, meaningful with --gguf): what bf16 capture operands change in
  the taps and in the teacher's distribution, beside what the store's bf16 rounding already changes.

    python experiments/smollm2_profile.py --pieces train --out experiments/results/h200/smollm2_profile_train.json
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

from dspark.config import SamplingParams
from dspark.cuda_graphs import buckets_up_to
from dspark.drafters.dspark import DSparkDrafter
from dspark.drafters.dspark.calibrate import run_rounds
from dspark.drafters.dspark.capture import CaptureStore
from dspark.drafters.dspark.loss import metrics_to_floats
from dspark.drafters.dspark.train import capture, compiled_blocks_forward, epoch_batches, train_step_loss
from dspark.engine import Engine
from dspark.files import write_atomic
from dspark.provenance import provenance
from dspark.targets.llama import LlamaConfig, LlamaLayerWeights, LlamaTarget, LlamaWeights, load_llama_gguf, weights_to

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("smollm2_dspark", REPO / "experiments" / "smollm2_dspark.py")
recipe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(recipe)

# SmolLM2-135M-Instruct's shapes (the GGUF's metadata); EOS = <|im_end|>.
SMOLLM2 = LlamaConfig(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                      intermediate_size=1536, rope_theta=100000.0, rms_norm_eps=1e-5, context_length=8192,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


def random_weights(c: LlamaConfig, seed: int) -> LlamaWeights:
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.02

    hd = c.head_dim
    layers = [LlamaLayerWeights(torch.ones(c.hidden_size), r((c.num_heads + 2 * c.num_kv_heads) * hd, c.hidden_size),
                                r(c.hidden_size, c.num_heads * hd), torch.ones(c.hidden_size),
                                r(2 * c.intermediate_size, c.hidden_size), r(c.hidden_size, c.intermediate_size))
              for _ in range(c.num_layers)]
    embedding = r(c.vocab_size, c.hidden_size)
    return LlamaWeights(embedding, layers, torch.ones(c.hidden_size), embedding)


def measured(fn, repeats: int) -> dict:
    """Median wall ms of fn() with a synchronize around each call, then one profiled call: GPU
    time, kernel count, host aten calls and the largest contributors."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    walls = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        walls.append(1e3 * (time.perf_counter() - t0))
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        fn()
        sync()
    gpu, gpu_calls, host_calls = collections.Counter(), collections.Counter(), collections.Counter()
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            gpu[evt.name] += evt.time_range.elapsed_us()
            gpu_calls[evt.name] += 1
        elif evt.name.startswith("aten::"):
            host_calls[evt.name] += 1
    walls.sort()
    return {"wall_ms": round(walls[len(walls) // 2], 2), "gpu_ms": round(sum(gpu.values()) / 1e3, 2),
            "kernels": sum(gpu_calls.values()), "aten_calls": sum(host_calls.values()),
            "top_gpu": [{"name": n[:120], "calls": gpu_calls[n], "ms": round(us / 1e3, 2)} for n, us in gpu.most_common(12)],
            "top_host": host_calls.most_common(12)}


def warm_up(fn, calls: int) -> float:
    """Seconds of `calls` calls of fn() with a synchronize after them: a compiled piece's compiles (its
    first batch, and a batch whose shapes make it compile again), then the allocator's warm-up."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return round(time.perf_counter() - t0, 2)


def decode_piece(config, weights, args) -> dict:
    target = LlamaTarget(config, weights, max_slots=args.slots, max_seq_len=args.context + 64, attention="batched")
    engine = Engine(target, eos_token_ids=())
    g = torch.Generator().manual_seed(args.seed)
    for i in range(args.slots):
        engine.add_request(torch.randint(3, config.vocab_size, (args.context,), generator=g),
                           SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, max_tokens=48, seed=i))
        if (i + 1) % args.prefill_chunk == 0:
            engine.step()  # admit in chunks, as generate_sequences does
    engine.step()
    return measured(engine.step, 3)


def step_runner(model, cfg, sequences, masks, captured_for, fused: bool, read_every_step: bool):
    """One DSpark training step as the Trainer runs it (loss, backward, clip, AdamW), on a fixed batch:
    captured_for() gives the batch's capture (an online prefill, or a store lookup). read_every_step:
    the metrics and the gradient norm read back every step (the Trainer before log_every)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=fused or None)
    forward = compiled_blocks_forward(cfg)  # as the Trainer compiles it

    def step():
        loss, metrics = train_step_loss(model, captured_for(), sequences, masks, cfg, torch.Generator().manual_seed(0),
                                        forward=forward)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        if read_every_step:
            metrics_to_floats(metrics)
            float(norm)

    return step


def training_pieces(config, weights, args, out: dict, save) -> None:
    """capture, train_before, train_after, train_ablation, each over the profiled batches (over_batches), into
    `out`, saved after each batch: a call cut off by its time limit keeps what it measured.

    train_before is the step rounds 1-7 trained with: the batch prefilled into the target every step
    (capture), anchor chunks of 128 through the dense-masked SDPA, the float32 LM head and loss on every
    slot, metrics read back every step. train_after is the recipe's step now: the batch's taps and LM-head
    input looked up in a bf16 capture store, every anchor through FlexAttention's block mask, the loss on
    the supervised slots only, anchor and length buckets, the blocks' pass compiled, fused AdamW, metrics
    left on the device. train_ablation is train_after's step for the DFlash ablation (its own model and
    AdamW, the same batches). train_after_graphs (CUDA, compiled) is train_after with the blocks' pass
    replayed as CUDA graphs: what that takes off the host's gap between the step's kernels."""
    # The recipe's own drafter and training settings (its defaults), at this run's batch.
    ns = recipe.parse(["run", "--batch-size", str(args.batch_size), "--seed", str(args.seed)])
    batches = profiled_batches(args, ns, config)
    ns.anchor_bucket, ns.length_bucket = batches[0][2]["buckets"]
    if args.anchor_bucket:  # batches of fewer anchors pad to less, at the price of a compiled shape per bucket
        ns.anchor_bucket = args.anchor_bucket
    target = LlamaTarget(config, weights, max_slots=args.batch_size, max_seq_len=ns.length_bucket, attention="batched")
    model, ablation_model = (recipe.new_model(target, name, ns) for name in ("dspark", "dflash_ablation"))
    cuda = target.device.type == "cuda"
    if cuda:
        model.autocast_dtype = ablation_model.autocast_dtype = torch.bfloat16
    fast = dict(compile=cuda and args.compile, attention="flex" if cuda else "sdpa")
    after = dataclasses.replace(recipe.train_configs(ns)["dspark"], **fast)
    ablation = dataclasses.replace(recipe.train_configs(ns)["dflash_ablation"], **fast)
    before = dataclasses.replace(after, fast=False, attention="sdpa", compile=False, anchor_bucket=0, length_bucket=0,
                                 anchor_chunk=args.anchor_chunk, recompute=args.recompute, teacher="logits")
    out["batches"] = [data for _, _, data in batches]
    taps = tuple(model.config.target_layer_ids)
    graphs = dataclasses.replace(after, compile_mode="reduce-overhead") if cuda and after.compile else None
    measurements: dict[str, list[dict]] = {"capture": [], "train_before": [], "train_after": [], "train_ablation": []}
    if graphs is not None:
        measurements["train_after_graphs"] = []
    peak: dict[str, float] = {}
    with recipe.tf32_on_cuda(target.device):  # the precision the recipe trains in, capture included
        for n, (sequences, masks, _) in enumerate(batches):
            measurements["capture"].append(measured(lambda: capture(target, sequences, taps), 3))
            store = CaptureStore(target, sequences, taps + (target.num_layers,), dtype=torch.bfloat16)
            store.fill(progress=False)
            pick = list(range(len(sequences)))
            model.train()
            ablation_model.train()
            pieces = (("train_before", model, before, lambda: capture(target, sequences, taps), False, True),
                      ("train_after", model, after, lambda: store.batch(pick), cuda, False),
                      ("train_ablation", ablation_model, ablation, lambda: store.batch(pick), cuda, False))
            if graphs is not None:
                pieces += (("train_after_graphs", model, graphs, lambda: store.batch(pick), cuda, False),)
            for name, piece_model, cfg, captured_for, fused, read in pieces:
                step = step_runner(piece_model, cfg, sequences, masks, captured_for, fused, read)
                warm = warm_up(step, args.warmup if n == 0 else 1)  # compiles once per shape, then the allocator
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                measurements[name].append({**measured(step, 3), "warmup_s": warm})
                if cuda:
                    peak[name] = max(peak.get(name, 0.0), round(torch.cuda.max_memory_allocated() / 2**30, 2))
            for name, taken in measurements.items():
                out[name] = over_batches(taken)
            for name, cfg in (("train_before", before), ("train_after", after), ("train_ablation", ablation),
                              ("train_after_graphs", graphs)):
                if cfg is None:
                    continue
                out[name]["config"] = {k: v for k, v in vars(cfg).items() if k in PROFILED_SETTINGS}
                if name in peak:
                    out[name]["peak_memory_gib"] = peak[name]
            save()
            del store
        model.eval()
        ablation_model.eval()


def checks_piece(config, weights, args, out: dict, save) -> None:
    """held_out: one held-out acceptance measurement (calibrate.run_rounds over --held-out-prompts random
    prompts, --held-out-tokens each) as training runs it, with a random DSpark drafter, on the batched
    target. Host-bound where its steps run eagerly: ~45 host ops a layer (a compiled verify cut the wall 5%
    for 8 s of compiles, and was removed: experiments/notes/smollm2.md). held_out_graphed: the same check
    with every batch size in a CUDA graph, captures included."""
    ns = recipe.parse(["run", "--seed", str(args.seed)])
    g = torch.Generator().manual_seed(args.seed)
    held_out = [torch.randint(3, config.vocab_size, (args.seq_len // 4,), generator=g) for _ in range(args.held_out_prompts)]
    target = LlamaTarget(config, weights, max_slots=args.held_out_prompts, max_seq_len=args.seq_len + 160,
                         attention="batched")
    model = recipe.new_model(target, "dspark", ns)
    model.eval()
    drafter = DSparkDrafter(model, args.held_out_prompts, max_seq_len=args.seq_len + 160)

    def check():
        with torch.no_grad():
            run_rounds(target, drafter, held_out, max_new_tokens=args.held_out_tokens)

    warm = warm_up(check, 1)
    out["held_out"] = {**measured(check, 1), "warmup_s": warm}
    save()
    if target.device.type != "cuda":
        return
    # the same check with every batch size of its run in a CUDA graph (the recipe's --graph-buckets batch):
    # the engine's steps and the drafter's drafts and commits, their captures counted (a check builds its
    # engine afresh, as the recipe's do)
    buckets = buckets_up_to(args.held_out_prompts)
    graphed = DSparkDrafter(model, args.held_out_prompts, max_seq_len=args.seq_len + 160, cuda_graphs=True,
                            graph_buckets=buckets)

    def check_graphed():
        with torch.no_grad():
            run_rounds(target, graphed, held_out, max_new_tokens=args.held_out_tokens, graph_buckets=buckets)

    warm = warm_up(check_graphed, 1)
    out["held_out_graphed"] = {**measured(check_graphed, 1), "warmup_s": warm, "graph_buckets": list(buckets)}
    save()


def capture_pieces(config, weights, args, out: dict, save) -> None:
    """What a training step pays for the part of its batch the capture store does not hold, over the
    profiled batches (over_batches): capture_taps, the target's taps and LM-head input as the recipe's
    online capture takes them now (causal_taps: float32 weights, TF32 matmuls); capture_taps_autocast,
    the same forward under bf16 autocast (bf16 GEMMs and attention, float32 residual; the store keeps
    bf16 anyway); capture_taps_compiled, the same forward through torch.compile
    (LlamaTarget(compiled_taps=True): fused norms, rotations and activations); capture_taps_flex, the
    compiled forward with FlexAttention for SDPA (taps_attention="flex": TF32 attention matmuls);
    capture_taps_flex_bf16, that with bf16 matmul and attention operands (taps_precision="bfloat16"); store_online,
    CaptureStore.batch with nothing cached (the capture plus the gather and the per-row copies into
    the batch)."""
    ns = recipe.parse(["run", "--batch-size", str(args.batch_size), "--seed", str(args.seed)])
    batches = profiled_batches(args, ns, config)
    target = LlamaTarget(config, weights, max_slots=args.batch_size, max_seq_len=batches[0][2]["buckets"][1],
                         attention="batched")
    compiled, flex, flex_bf16 = (
        LlamaTarget(config, weights, max_slots=args.batch_size, max_seq_len=batches[0][2]["buckets"][1],
                    attention="batched", compiled_taps=True, taps_attention=name, taps_precision=precision)
        for name, precision in (("sdpa", "float32"), ("flex", "float32"), ("flex", "bfloat16")))
    layers = tuple(recipe.drafter_config(target, "dspark", ns.layers, ns.markov_rank).target_layer_ids) + (config.num_layers,)
    out["capture_batches"] = [data for _, _, data in batches]
    cuda = target.device.type == "cuda"
    autocast = torch.autocast(target.device.type, dtype=torch.bfloat16, enabled=cuda)
    measurements: dict[str, list[dict]] = {"capture_taps": [], "store_online": [], "capture_taps_autocast": [],
                                           "capture_taps_compiled": [], "capture_taps_flex": [], "capture_taps_flex_bf16": []}
    with recipe.tf32_on_cuda(target.device):
        for sequences, _, _ in batches:
            store = CaptureStore(target, sequences, layers, dtype=torch.bfloat16, budget_bytes=0)
            store.fill(progress=False)
            pieces = {"capture_taps": lambda: capture(target, sequences, layers, logits=False),
                      "store_online": lambda: store.batch(list(range(len(sequences)))),
                      "capture_taps_compiled": lambda: capture(compiled, sequences, layers, logits=False),
                      "capture_taps_flex": lambda: capture(flex, sequences, layers, logits=False),
                      "capture_taps_flex_bf16": lambda: capture(flex_bf16, sequences, layers, logits=False)}
            for name, fn in pieces.items():
                warm = warm_up(fn, 2)  # allocator warm-up; the compiled pass compiles (again when shapes go symbolic)
                measurements[name].append({**measured(fn, 5), "warmup_s": warm})
            with autocast:
                pieces["capture_taps"]()
                measurements["capture_taps_autocast"].append(measured(pieces["capture_taps"], 5))
            for name, taken in measurements.items():
                out[name] = over_batches(taken)
            save()


def precision_piece(config, weights, args, out: dict, save) -> None:
    """capture_precision: over the profiled batches, the bf16-operand capture (taps_precision="bfloat16")
    against the float32 one (full float32 matmuls: TF32 off), beside the float32 taps rounded to bf16 as
    the capture store keeps them. Per tap, the relative error (norm over the real positions); for the
    LM head's input, the teacher's distribution softmax(h E^T) at every real position: the mean L1
    distance sum_v |p_v - p'_v| (the L1 term's own measure) and how often the argmax changes."""
    ns = recipe.parse(["run", "--batch-size", str(args.batch_size), "--seed", str(args.seed)])
    batches = profiled_batches(args, ns, config)
    make = lambda precision: LlamaTarget(  # noqa: E731
        config, weights, max_slots=args.batch_size, max_seq_len=batches[0][2]["buckets"][1], attention="batched",
        taps_precision=precision)
    full, bf16 = make("float32"), make("bfloat16")
    layers = tuple(recipe.drafter_config(full, "dspark", ns.layers, ns.markov_rank).target_layer_ids) + (config.num_layers,)
    head = weights.output
    sums: dict[str, collections.Counter] = {"bf16_operands": collections.Counter(), "bf16_store": collections.Counter()}
    positions = 0
    for sequences, _, _ in batches:
        real = (torch.arange(max(len(s) for s in sequences)) < torch.tensor([len(s) for s in sequences])[:, None]).to(head.device)
        want = {layer: t[real] for layer, t in capture(full, sequences, layers, logits=False)[1].items()}
        compared = {"bf16_operands": {layer: t[real] for layer, t in capture(bf16, sequences, layers, logits=False)[1].items()},
                    "bf16_store": {layer: t.to(torch.bfloat16).float() for layer, t in want.items()}}
        for name, taps in compared.items():
            for layer in layers:
                a, b = want[layer].double(), taps[layer].double()
                sums[name][f"tap {layer} err2"] += (a - b).square().sum().item()
                sums[name][f"tap {layer} norm2"] += a.square().sum().item()
        for chunk in torch.split(torch.arange(len(want[config.num_layers]), device=head.device), 1024):
            p = torch.softmax(want[config.num_layers][chunk] @ head.T, dim=-1)
            for name, taps in compared.items():
                q = torch.softmax(taps[config.num_layers][chunk] @ head.T, dim=-1)
                sums[name]["l1"] += (p - q).abs().sum().item()
                sums[name]["argmax_changed"] += (p.argmax(-1) != q.argmax(-1)).sum().item()
        positions += len(want[config.num_layers])
    out["capture_precision"] = {
        "positions": positions, "batches": [data for _, _, data in batches],
        **{name: {"tap_relative_error": {str(layer): round((c[f"tap {layer} err2"] / c[f"tap {layer} norm2"]) ** 0.5, 6)
                                         for layer in layers},
                  "teacher_l1_mean": round(c["l1"] / positions, 6),
                  "teacher_argmax_changed": round(c["argmax_changed"] / positions, 6)}
           for name, c in sums.items()}}
    save()


def profiled_batches(args, ns, config) -> list[tuple[list[torch.Tensor], list[torch.Tensor], dict]]:
    """--batches of the recipe's first epoch from --sequences, at evenly spaced quantiles of their
    supervised tokens (a step's loss and its capture grow with them; the first batch alone is one
    length group's), each with the recipe's one-shape buckets of that file; without a file, one batch
    of random sequences of lengths in [--seq-len / 2, --seq-len], a quarter of each a prompt."""
    if args.sequences:
        sequences, masks = recipe.load_training_sequences(Path(args.sequences))
        cfg = dataclasses.replace(recipe.train_configs(ns)["dspark"], anchor_bucket=0, length_bucket=0)
        supervised = [int(m.sum()) for m in masks]
        epoch = sorted(epoch_batches(supervised, cfg, 0), key=lambda b: sum(supervised[i] for i in b))
        picks = [epoch[int((k + 0.5) * len(epoch) / args.batches)] for k in range(args.batches)]
        buckets = recipe.static_buckets(sequences, masks, ns.num_anchors)
        batches = [([sequences[i] for i in pick], [masks[i] for i in pick]) for pick in picks]
        source = Path(args.sequences).name
    else:
        g = torch.Generator().manual_seed(args.seed)
        lengths = torch.randint(args.seq_len // 2, args.seq_len + 1, (args.batch_size,), generator=g).tolist()
        seqs = [torch.randint(3, config.vocab_size, (n,), generator=g) for n in lengths]
        batches = [(seqs, [torch.cat([torch.zeros(n // 4, dtype=torch.long), torch.ones(n - n // 4, dtype=torch.long)])
                           for n in lengths])]
        buckets = recipe.static_buckets(*batches[0], ns.num_anchors)
        source = "random"
    return [(seqs, ms, {"source": source, "lengths": [len(s) for s in seqs], "supervised": [int(m.sum()) for m in ms],
                        "buckets": list(buckets)}) for seqs, ms in batches]


def over_batches(measurements: list[dict]) -> dict:
    """One piece over the profiled batches: the mean of each figure (the average step's), the largest
    contributors of the costliest batch, and each batch's figures."""
    figures = ("wall_ms", "gpu_ms", "kernels", "aten_calls")
    costliest = max(measurements, key=lambda m: m["wall_ms"])
    out = {k: round(sum(m[k] for m in measurements) / len(measurements), 2) for k in figures}
    if "warmup_s" in measurements[0]:  # summed: what the piece's compiles cost over these batches
        figures += ("warmup_s",)
        out["warmup_s"] = round(sum(m["warmup_s"] for m in measurements), 2)
    return {**out, "top_gpu": costliest["top_gpu"], "top_host": costliest["top_host"],
            "per_batch": [{k: m[k] for k in figures} for m in measurements]}


PROFILED_SETTINGS = ("fast", "attention", "teacher", "anchor_chunk", "recompute", "anchor_bucket", "length_bucket",
                     "compile", "compile_mode", "num_anchors", "batch_size")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default=None, help="real SmolLM2 weights (default: random at its shapes)")
    ap.add_argument("--slots", type=int, default=1024)
    ap.add_argument("--context", type=int, default=512, help="committed tokens per request in the decode step")
    ap.add_argument("--prefill-chunk", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--sequences", default=str(REPO / "experiments/data/smollm2_selfdistil_58278.npz"),
                    help="the training batches: the recipe's, from this file ('' random sequences of --seq-len)")
    ap.add_argument("--batches", type=int, default=5,
                    help="batches of the file's first epoch profiled, at evenly spaced quantiles of supervised tokens")
    ap.add_argument("--seq-len", type=int, default=768,
                    help="without --sequences: the longest sequence (lengths in [half, this])")
    ap.add_argument("--anchor-chunk", type=int, default=128, help="train_before's anchor chunks")
    ap.add_argument("--anchor-bucket", type=int, default=0,
                    help="train_after's anchor bucket (0: the recipe's one-shape bucket of the data)")
    ap.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=False,
                    help="train_before's chunks recompute their activations in backward (rounds 5-7 trained without)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                    help="train_after compiles the blocks' pass, as the recipe does on a GPU")
    ap.add_argument("--warmup", type=int, default=3, help="unmeasured steps before each training piece (compiles)")
    ap.add_argument("--held-out-prompts", type=int, default=64, help="the checks piece's prompts")
    ap.add_argument("--held-out-tokens", type=int, default=128)
    ap.add_argument("--pieces", default="decode,train", help="comma-separated: decode, capture, precision, train, checks")
    ap.add_argument("--reference-loss", action="store_true",
                    help="the training step with the torch reference of draft_loss_terms (default on CUDA: Triton)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cpu only checks that the script runs: its times mean nothing")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.batches < 1:
        ap.error(f"--batches={args.batches}: must be at least 1")
    if args.anchor_bucket < 0:
        ap.error(f"--anchor-bucket={args.anchor_bucket}: must be >= 0 (0: the recipe's)")
    if args.reference_loss:
        from dspark.kernels import registry

        registry.use("draft_loss_terms", "reference")
    if args.gguf:
        config, weights, _ = load_llama_gguf(args.gguf)
    else:
        config, weights = SMOLLM2, random_weights(SMOLLM2, args.seed)
    weights = weights_to(weights, args.device)
    result = {**provenance(args.device), "settings": vars(args), "weights": "gguf" if args.gguf else "random"}
    pieces = args.pieces.split(",")

    def save() -> None:
        write_atomic(args.out, json.dumps(result, indent=1) + "\n")

    if "decode" in pieces:
        result["decode"] = decode_piece(config, weights, args)
        save()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if "capture" in pieces:
        capture_pieces(config, weights, args, result, save)
    if "precision" in pieces:
        precision_piece(config, weights, args, result, save)
    if "train" in pieces:
        try:
            training_pieces(config, weights, args, result, save)
        except (recipe.RecipeError, ValueError) as error:
            print(f"smollm2_profile: error: {error}", file=sys.stderr)
            return 2
    if "checks" in pieces:
        checks_piece(config, weights, args, result, save)
    save()
    for name in ("decode", "capture", "capture_taps", "capture_taps_autocast", "capture_taps_compiled", "capture_taps_flex",
                 "capture_taps_flex_bf16", "store_online", "train_before", "train_after", "train_ablation",
                 "train_after_graphs", "held_out", "held_out_graphed"):
        if name in result:
            r = result[name]
            top = f"{r['top_gpu'][0]['name'][:60]} {r['top_gpu'][0]['ms']} ms" if r["top_gpu"] else "-"
            warm = f"  warm-up {r['warmup_s']:6.1f} s" if "warmup_s" in r else ""
            print(f"{name:22s} wall {r['wall_ms']:7.1f} ms  gpu {r['gpu_ms']:7.1f} ms  kernels {r['kernels']:7.1f}  "
                  f"aten {r['aten_calls']:7.1f}{warm}  top: {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
