"""The DSpark drafter network: fused target context, a parallel block backbone, and the heads.

Design notes: docs/dspark-algorithm.md §2 (architecture), docs/kimi-k3.md §4 (the
published K3 drafter shape). Shapes: B = sequences/requests, A = blocks per sequence (anchors),
G = block size (gamma), S = context rows, d = hidden size, V = vocab, W = one cached context row.

Attention is swappable: every attention module turns a (normed) hidden row into one flat cache
row of width W (`kv_rows`), expands cache rows into per-head keys/values (`keys_values`) and
builds queries (`queries`); `BlockAttention.forward` does the rest (context keys strictly before
each block's anchor, bidirectional inside the block, docs/dspark-algorithm.md §2.3). A drafting
pass (`inference=True`) may compute the same function another way: MLA attends in its latent
space there instead of expanding every context row per head (docs/dspark-algorithm.md §2.3).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dspark.kernels import ops, registry
from dspark.kernels.numerics import is_partials_of
from dspark.kernels.rmsnorm.reference import rms_norm_scaled_in_fp32
from dspark.kernels.rotary.reference import rotary as rotary_formula
from dspark.policy import calibrated_confidence, temperature_tensor

from .config import DSparkConfig
from .flex import flex_attend
from .heads import ConfidenceHead, MarkovHead, init_like_deepspec

# The devices on which a drafting pass leaves its output projections (MLA's o_proj over the cache,
# SwiGLU's down) as their split-K partials (ops.linear_partials) for the add + norm after each to add
# (ops.add_rms_norm), where the GEMM's reduction kernel added them: two launches a layer fewer where
# cuBLAS would have split them, none where it would not (a TP16 share's; docs/kernels.md §10.11). Not
# the CPU, which launches nothing: there the pass stays bit for bit the unfused layers' nn.Linear (the
# CPU's row-invariant reference GEMM sums in another order).
# experiments/drafter_bench.py --setting draft_output_partials=0 times the reduced outputs.
OUTPUTS_AS_PARTIALS_ON: tuple[str, ...] = ("cuda",)
# The devices on which a drafting pass multiplies a layer's two paired GEMMs over its input, MLA's
# q_a | kv_a and SwiGLU's gate | up, as the skinny GEMM's split-K partials (ops.linear_partials) and their
# consumers add them (the cache rows' launch, ops.mla_cache_rows(dtype=...); the activation's,
# ops.silu_mul(dtype=...)), where cuBLAS split each GEMM and launched a reduction after it: two launches
# fewer a layer, at the skinny GEMM's speed in place of cuBLAS's (docs/kernels.md §10.11). Off until a GPU
# has timed it: experiments/drafter_bench.py --setting draft_input_partials=1.
INPUTS_AS_PARTIALS_ON: tuple[str, ...] = ()


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dtype == self.weight.dtype:
            if not x.is_contiguous() and not (torch.is_grad_enabled() and x.requires_grad):
                # strided rows (the q_a norm of a paired q_a | kv_a GEMM's output), which F.rms_norm
                # would copy first: the op reads them in place (docs/kernels.md §10.11; no backward)
                rows = x.reshape(-1, x.shape[-1])
                return ops.rms_norm_scaled_in_fp32(rows, self.weight, self.eps).view(x.shape)
            # torch's fused CUDA kernel, one launch for the same math (fp32 statistics and scale,
            # one rounding at the end) where rms_norm_scaled_in_fp32's torch ops are nine launches:
            # 21 norms in a K3 drafter's propose (experiments/notes/step.md). Mixed dtypes (autocast
            # training) keep those ops.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return rms_norm_scaled_in_fp32(x, self.weight, self.eps)


def _at_least_float32(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


class Rotary(nn.Module):
    """RoPE over the last `dim` features of a head, optionally YaRN-extended (DeepSeek-V3's YaRN:
    frequencies blended between interpolated and original by a linear ramp over the correction
    range [beta_fast, beta_slow]; cos/sin scaled by mscale(factor, mscale)/mscale(factor,
    mscale_all_dim); the attention scale gains mscale(factor, mscale_all_dim)^2)."""

    def __init__(self, dim: int, theta: float, interleaved: bool, scaling: dict | None):
        super().__init__()
        self.dim = dim
        self.interleaved = interleaved
        exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
        inv_freq = 1.0 / theta**exponents
        self.cos_sin_scale = 1.0
        self.attention_scale = 1.0
        if scaling is not None:
            factor = float(scaling["factor"])
            original = float(scaling["original_max_position_embeddings"])
            beta_fast, beta_slow = float(scaling.get("beta_fast", 32)), float(scaling.get("beta_slow", 1))

            def correction_dim(rotations: float) -> float:
                return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

            low = max(math.floor(correction_dim(beta_fast)), 0)
            high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
            if low == high:
                high += 0.001
            ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
            keep_original = 1.0 - ramp  # high-frequency dims keep their original frequency
            inv_freq = inv_freq / factor * ramp + inv_freq * keep_original
            mscale, mscale_all = float(scaling.get("mscale", 1.0)), float(scaling.get("mscale_all_dim", 0.0))
            self.cos_sin_scale = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
            self.attention_scale = _yarn_mscale(factor, mscale_all) ** 2
        # A plain attribute, not a buffer: model.to(bfloat16) must not round the frequencies.
        self.inv_freq = inv_freq.float()

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [..., 1, dim/2] of positions [...]: what forward multiplies by, which every
        layer of one pass shares (the layers' Rotary modules are built from one config)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        angles = positions.float().unsqueeze(-1) * self.inv_freq  # [..., dim/2]
        return (angles.cos() * self.cos_sin_scale).unsqueeze(-2), (angles.sin() * self.cos_sin_scale).unsqueeze(-2)

    def position_table(self, count: int, device: torch.device) -> torch.Tensor:
        """[2, count, dim/2] float32: tables() of positions 0..count-1, cos then sin, for table_rows to
        gather from."""
        cos, sin = self.tables(torch.arange(count, device=device))
        return torch.stack([cos.squeeze(-2), sin.squeeze(-2)])

    @staticmethod
    def table_rows(table: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tables(positions) read from a position_table in one gather (computing them is six launches):
        the same values, each elementwise op having run on the same float position."""
        rows = table.index_select(1, positions.reshape(-1))  # [2, N, dim/2]
        shape = (*positions.shape, 1, table.shape[-1])
        return rows[0].view(shape), rows[1].view(shape)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, tables=None) -> torch.Tensor:
        """x [..., heads, dim], positions [...] (long) -> rotated x; tables: tables(positions),
        made once for several calls."""
        cos, sin = self.tables(positions) if tables is None else tables
        if torch.is_grad_enabled() and x.requires_grad:
            # a training pass: the torch formula, which autograd differentiates (the op's kernel
            # has no backward)
            return rotary_formula(x, cos, sin, self.interleaved)
        return ops.rotary(x, cos, sin, self.interleaved)  # one launch on CUDA where the formula is nine


class BlockAttention(nn.Module):
    """Shared forward of the block attention (docs/dspark-algorithm.md §2.3, paper eq. 3)."""

    num_heads: int
    scale: float
    row_width: int  # W, the width of one cached context row

    def kv_rows(self, x: torch.Tensor, positions: torch.Tensor, rope=None) -> torch.Tensor:
        """rope (here and in queries): Rotary.tables(positions), when made once for every layer."""
        raise NotImplementedError

    def keys_values(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def queries(self, x: torch.Tensor, positions: torch.Tensor, rope=None) -> torch.Tensor:
        raise NotImplementedError

    def forward(
        self,
        x: torch.Tensor,  # [B, A, G, d], already input-layernormed
        positions: torch.Tensor,  # [B, A, G]
        context_rows: torch.Tensor,  # [B, S, W]
        context_visible: torch.Tensor,  # [B, A, S] bool: row j is before block a's anchor
        inference: bool = False,  # a drafting pass; the layouts here have no faster exact form for it
        shared: "BlockPass | None" = None,  # what the pass's layers share, made once (None: made here)
    ) -> torch.Tensor:
        shared = shared or BlockPass(self.rotary, positions, context_visible, x.shape[2])
        context_rows = _context_rows(context_rows)
        q = self.queries(x, positions, shared.rope)  # [B, A, G, H, dk]
        k_blk, v_blk = self.keys_values(self.kv_rows(x, positions, shared.rope))  # [B, A, G, H, dk|dv]
        k_ctx, v_ctx = self.keys_values(context_rows)  # [B, S, H, dk|dv]
        B, A, G = q.shape[:3]
        if shared.flex_mask is not None:  # the same function, block-sparse (drafters/dspark/flex.py)
            return self.o_proj(self._flex(q, (k_ctx, k_blk), (v_ctx, v_blk), shared.flex_mask).to(x.dtype))
        # One fused attention call (F.scaled_dot_product_attention) over every block slot at once:
        # keys are the S context rows followed by the A * G block rows, and the mask lets a slot see
        # the context rows before its anchor and the rows of its own block. Written as separate
        # float32 einsums, the [B, H, A, G, S] scores and their masked, concatenated and soft-maxed
        # copies were the bulk of a training step's memory traffic (experiments/notes/smollm2.md).
        # The rows of other blocks are masked, not skipped, so trainers bound A per call (anchor_chunk).
        queries = q.flatten(1, 2).transpose(1, 2)  # [B, H, A * G, dk]
        keys = torch.cat([k_ctx, k_blk.flatten(1, 2)], dim=1).transpose(1, 2)  # [B, H, S + A * G, dk]
        values = torch.cat([v_ctx, v_blk.flatten(1, 2)], dim=1).transpose(1, 2)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=shared.mask[:, None], scale=self.scale)
        return self.o_proj(out.transpose(1, 2).unflatten(1, (A, G)).flatten(-2).to(x.dtype))

    def _flex(self, q, keys, values, mask) -> torch.Tensor:
        """FlexAttention over [context rows, block rows] -> [B, A, G, H * dv]. Its kernels take one
        dtype (SDPA's autocast casts them; flex_attention is not on autocast's lists), so the keys
        and values take the queries' (bf16 under the trainer's autocast, where the context rows,
        made outside it, are float32)."""
        B, A, G = q.shape[:3]
        dtype = q.dtype
        heads_first = lambda t: t.to(dtype).transpose(1, 2)  # noqa: E731  [B, rows, H, d] -> [B, H, rows, d]
        queries = heads_first(q.flatten(1, 2))
        keys = heads_first(torch.cat([keys[0].to(dtype), keys[1].flatten(1, 2).to(dtype)], dim=1))
        values = heads_first(torch.cat([values[0].to(dtype), values[1].flatten(1, 2).to(dtype)], dim=1))
        out = flex_attend(queries, keys, values, mask, self.scale)  # [B, H, A * G, dv]
        return out.transpose(1, 2).unflatten(1, (A, G)).flatten(-2)


class BlockPass:
    """What every layer of one pass over the blocks shares, made once instead of per layer (in a
    K3 drafter's propose, ~100 of its ~670 launches were these, repeated five times:
    experiments/notes/step.md): the RoPE tables of the block positions and the block mask, and
    the mask's per-head form for the latent attention."""

    def __init__(self, rotary: "Rotary | None", positions: torch.Tensor, context_visible, G: int,
                 flex_mask=None, rope=None, cache_counts: tuple[torch.Tensor, ...] | None = None):
        """context_visible: [B, A, S] bool, or a function that makes it (a drafting pass whose layers
        never build the mask then never launches it); flex_mask: a FlexAttention BlockMask of the same
        mask (flex.block_mask), in place of context_visible: the attention then runs block-sparse
        (training only). rope, cache_counts: rotary.tables(positions) and cache_counts' result where the
        caller has them already (DraftConstants)."""
        if rope is None and rotary is not None:
            rope = rotary.tables(positions)
        self.rope = rope
        self.flex_mask = flex_mask
        self._context_visible, self._G = context_visible, G
        self._mask: torch.Tensor | None = None
        self._hidden_per_head: dict[int, torch.Tensor] = {}
        self._cache_counts = cache_counts
        # set by a drafting pass whose norms take split-K partials (DSparkModel._drafting_layers): the
        # layers' output projections may hand theirs over unreduced (_project_out); and whose cache rows
        # and SwiGLU activations take their input GEMMs' (INPUTS_AS_PARTIALS_ON)
        self.output_partials = False
        self.input_partials = False

    @property
    def mask(self) -> torch.Tensor | None:
        """[B, A * G, S + A * G] bool (None with a flex_mask), made when a layer first asks: a drafting
        pass whose layers all attend over the cache in place never does, and its propose is spared the
        mask's launches."""
        if self._mask is None and self.flex_mask is None:
            visible = self._context_visible
            self._mask = _block_mask(visible() if callable(visible) else visible, self._G)
        return self._mask

    def cache_counts(self, lengths: torch.Tensor, G: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[B] counts of a drafting pass over the cache in place, from the committed lengths (made
        once per pass, for every layer): G, the block rows each request writes; lengths + G - 1
        and 1, the MLA op's cache_lens and query count that let one query see the first
        length + G rows."""
        if self._cache_counts is None:
            self._cache_counts = (torch.full_like(lengths, G), lengths + (G - 1), torch.ones_like(lengths))
        return self._cache_counts

    def hidden_per_head(self, heads: int) -> torch.Tensor:
        """[B, A * G * heads, S + A * G] bool: True where a (slot, head) score row may not look."""
        found = self._hidden_per_head.get(heads)
        if found is None:
            B, rows, keys = self.mask.shape
            found = ~self.mask[:, :, None, :].expand(-1, -1, heads, -1).reshape(B, rows * heads, keys)
            self._hidden_per_head[heads] = found
        return found


@dataclass
class CachedContext:
    """A drafting pass's context read where it lives (DSparkDrafter's cache): one layer's pool
    [slots, rows, W], the batch's slots `index` [B] and committed `lengths` [B], and `context`,
    a bound on every length (the rows a gathered copy holds). An MLA layer drafting one block per
    request attends through the target's MLA ops over the pool itself
    (MLAAttention._cached_forward); other layers read `rows()`."""

    cache: torch.Tensor
    index: torch.Tensor
    lengths: torch.Tensor
    context: int

    def rows(self) -> torch.Tensor:
        """The first `context` rows of each request's slot [B, context, W] (rows past a length are
        masked out by the caller's context_visible)."""
        return self.cache[:, : self.context].index_select(0, self.index)


class DraftConstants:
    """What every drafting pass of one drafter reads and none writes, made once on its device, outside
    any CUDA graph, so that a pass launches only the setup that depends on its requests (a handful of
    launches where it was seventeen at the K3 drafter's propose: docs/kernels.md §10.11): the block
    offsets 0..G-1 and which of them holds the anchor, the RoPE tables of every position a draft can
    reach (`positions`: the drafter's rows, its scratch rows included), and the MLA op's per-request
    counts that do not change (G block rows, one query), for up to `rows` requests a pass."""

    def __init__(self, model: "DSparkModel", positions: int, rows: int, device: torch.device):
        G = model.config.block_size
        self.block_size, self.rows = G, rows
        self.offsets = torch.arange(G, device=device)
        self.anchor_slot = (self.offsets == 0).unsqueeze(-1)  # [G, 1]
        rotary = model._rotary()
        self.rope_table = rotary.position_table(positions, device) if rotary is not None else None
        self.block_rows = torch.full((rows,), G, dtype=torch.long, device=device)
        self.ones = torch.ones(rows, dtype=torch.long, device=device)

    def block_pass(self, model: "DSparkModel", lengths: torch.Tensor,
                   context: int) -> tuple[torch.Tensor, "BlockPass"]:
        """(positions [B, 1, G], the pass's BlockPass) of a draft of one block per request after
        `lengths` [B] committed rows, reading at most `context` cache rows: three launches (the
        positions, the RoPE rows' gather, the MLA op's query ends); the context mask only if a layer
        asks for it (one that does not attend over the cache in place)."""
        B, G = lengths.shape[0], self.block_size
        positions = (lengths[:, None] + self.offsets).unsqueeze(1)
        rope = Rotary.table_rows(self.rope_table, positions) if self.rope_table is not None else None
        if B <= self.rows:
            counts = (self.block_rows[:B], lengths + (G - 1), self.ones[:B])
        else:  # more rows than slots (a slot drafted twice): made for this pass
            counts = (torch.full_like(lengths, G), lengths + (G - 1), torch.ones_like(lengths))

        def visible() -> torch.Tensor:  # [B, 1, S]
            return (torch.arange(context, device=lengths.device) < lengths[:, None]).unsqueeze(1)

        return positions, BlockPass(model._rotary(), positions, visible, G, rope=rope, cache_counts=counts)


def _context_rows(context: "torch.Tensor | CachedContext") -> torch.Tensor:
    return context.rows() if isinstance(context, CachedContext) else context


def _block_mask(context_visible: torch.Tensor, G: int) -> torch.Tensor:
    """[B, A * G, S + A * G] bool: a block slot sees the context rows before its anchor, then the
    rows of its own block (never an empty row) and none of the other blocks'."""
    B, A, _ = context_visible.shape
    sees_context = context_visible[:, :, None, :].expand(-1, -1, G, -1).flatten(1, 2)  # [B, A * G, S]
    own_block = torch.eye(A, dtype=torch.bool, device=context_visible.device).repeat_interleave(G, 0).repeat_interleave(G, 1)
    return torch.cat([sees_context, own_block.expand(B, -1, -1)], dim=-1)


def _product_float32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b ([B, M, K] x [B, K, N]) in float32 or wider: bf16/fp16 operands are multiplied into a
    float32 result (cuBLAS with a float32 output on CUDA; widened first on the CPU, which has no
    such kernel), so attention scores are not rounded to bf16 before the softmax."""
    if a.dtype in (torch.bfloat16, torch.float16):
        if a.is_cuda:
            return torch.bmm(a, b, out_dtype=torch.float32)
        return torch.bmm(a.float(), b.float())
    return torch.bmm(a, b)


def _project_out(linear: nn.Linear, x: torch.Tensor, partials: bool) -> torch.Tensor:
    """linear(x) [..., N]; with `partials` (and x in the weight's dtype), its split-K partials
    [S, ..., N] in fp32 for the add + norm after it to add (ops.add_rms_norm)."""
    if not partials or x.dtype != linear.weight.dtype:
        return linear(x)
    return ops.linear_partials(x.reshape(-1, x.shape[-1]), linear.weight).view(-1, *x.shape[:-1], linear.out_features)


def _one_weight(first: nn.Linear, second: nn.Linear) -> torch.Tensor | None:
    """The two projections' weights as one [N1 + N2, K] tensor without a copy, where they lie one after
    the other in one storage (DSparkModel.pair_projections); None where they do not."""
    a, b = first.weight, second.weight
    if (a.dtype != b.dtype or a.device != b.device or a.shape[1:] != b.shape[1:] or not a.is_contiguous()
            or not b.is_contiguous() or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
            or b.storage_offset() != a.storage_offset() + a.numel()):
        return None
    return a.detach().as_strided((a.shape[0] + b.shape[0], a.shape[1]), (a.shape[1], 1))


class MLAAttention(BlockAttention):
    """Multi-head latent attention as in the K3 drafter (DeepSeek-V3 MLA, no output gate).

    Cache row = [RMSNorm(c_kv) (kv_lora_rank) | RoPE(k_pe) (qk_rope_head_dim)], 576 wide for K3.
    """

    def __init__(self, c: DSparkConfig):
        super().__init__()
        self.num_heads, self.kv_lora_rank = c.num_heads, c.kv_lora_rank
        self.nope, self.rope_dim, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.row_width = c.kv_lora_rank + c.qk_rope_head_dim
        self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.q_b_proj = nn.Linear(c.q_lora_rank, c.num_heads * c.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.v_head_dim, c.hidden_size, bias=False)
        self.rotary = Rotary(c.qk_rope_head_dim, c.rope_theta, c.rope_interleaved, c.rope_scaling) if c.use_rope else None
        self.scale = c.qk_head_dim**-0.5 * (self.rotary.attention_scale if self.rotary else 1.0)
        self._w_uk_t: tuple | None = None  # (kv_b_proj's identity and version, W_UK^T): _absorbed_weights

    def kv_rows(self, x, positions, rope=None):
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        if self.rotary is not None:
            k_pe = self.rotary(k_pe.unsqueeze(-2), positions, rope).squeeze(-2)
        return torch.cat([self.kv_a_layernorm(latent), k_pe], dim=-1)

    def keys_values(self, rows):
        latent, k_pe = rows.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(latent).unflatten(-1, (self.num_heads, self.nope + self.v_dim))
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.unsqueeze(-2).expand(*k_nope.shape[:-1], self.rope_dim)], dim=-1)
        return k, v

    def queries(self, x, positions, rope=None):
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).unflatten(-1, (self.num_heads, self.nope + self.rope_dim))
        if self.rotary is None:
            return q
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        return torch.cat([q_nope, self.rotary(q_pe, positions, rope)], dim=-1)

    def forward(self, x, positions, context_rows, context_visible, inference: bool = False, shared=None):
        if not inference:
            return super().forward(x, positions, context_rows, context_visible, shared=shared)
        if isinstance(context_rows, CachedContext) and x.shape[1] == 1 and shared is not None:
            out = self._cached_forward(x, positions, context_rows, shared)
            if out is not None:
                return out
        return self._latent_forward(x, positions, _context_rows(context_rows), context_visible, shared)

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK^T [H, R, nope] contiguous, W_UV [H, v, R]) from kv_b_proj, as the target's MLA ops
        take them; W_UK^T is a copy, remade when the weight changes (its version counter)."""
        weight = self.kv_b_proj.weight
        w_k, w_v = weight.unflatten(0, (self.num_heads, self.nope + self.v_dim)).split([self.nope, self.v_dim], dim=1)
        key = (weight.data_ptr(), weight._version, weight.dtype, weight.device)
        if self._w_uk_t is None or self._w_uk_t[0] != key:
            self._w_uk_t = (key, w_k.transpose(1, 2).contiguous())
        return self._w_uk_t[1], w_v

    def _cached_forward(self, x, positions, context: CachedContext, shared: "BlockPass"):
        """_latent_forward for one block per request (A = 1) through the target's MLA ops
        (docs/dspark-algorithm.md §2.3): the block's G cache rows are written into each slot's pool
        past its length (rows a commit later overwrites or no one reads), and the block's G x H
        queries attend as G x H heads of one token over the slot's first length + G rows, which
        is every context row before the anchor and the whole block: the mask of a drafting pass.
        None where the attention op on this device would read lengths on the host (its
        reference, on CUDA), which a draft graph cannot capture: the caller then gathers."""
        B, A, G = x.shape[:3]
        H, r, M = self.num_heads, self.kv_lora_rank, x.shape[0] * x.shape[2]
        w_uk_t, w_uv = self._absorbed_weights()
        # RoPE in the ops' launches: q_pe as absorb_q copies it out, k_pe as cache_rows stores it
        rope = None
        if self.rotary is not None:
            cos, sin = shared.rope  # [B, A, G, 1, rope / 2]: one row per block token
            rope = (cos.reshape(M, -1), sin.reshape(M, -1), self.rotary.interleaved)
        paired = _one_weight(self.q_a_proj, self.kv_a_proj_with_mqa)  # both read x: one GEMM where laid out so
        widths = [self.q_a_proj.out_features, self.row_width]
        reduced = None  # the GEMM's dtype where its split-K partials go to the cache rows' launch unreduced
        if paired is not None and shared.input_partials and x.dtype == paired.dtype == context.cache.dtype:
            c_q, rows = ops.linear_partials(x.reshape(M, -1), paired).split(widths, dim=-1)  # [S, M, *] each
            reduced = x.dtype
        elif paired is not None:
            c_q, rows = F.linear(x, paired).reshape(M, -1).split(widths, dim=-1)
        else:
            c_q, rows = self.q_a_proj(x).reshape(M, -1), self.kv_a_proj_with_mqa(x).reshape(M, -1)
        block_rows, ends, ones = shared.cache_counts(context.lengths, G)
        if reduced is None:
            rows = rows.to(context.cache.dtype)  # [c_kv | k_pe], rows may be strided
        # The q_a norm in the cache rows' launch, with K3's rounding (the normalised row rounded, then scaled)
        # as the kv latent's there, where RMSNorm rounds once (docs/kernels.md §10.11). The block's rows go in
        # past each length, where a fallback below leaves them unread.
        c_q = ops.mla_cache_rows(rows, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps, context.cache,
                                 context.index, context.lengths, block_rows, rope,
                                 q=(c_q, self.q_a_layernorm.weight), dtype=reduced)
        q = self.q_b_proj(c_q).reshape(M, H, self.nope + self.rope_dim)
        q_latent, q_pe = ops.mla_absorb_q(q, w_uk_t.to(q.dtype), rope)  # [M, H, r], [M, H, rope]
        queries = (q_latent.view(B, 1, G * H, r), q_pe.view(B, 1, G * H, self.rope_dim))
        if x.is_cuda and registry.select("mla_verify_attention", *queries, context.cache, context.index, ends,
                                         ones).reads_device_values:
            return None
        o_latent = ops.mla_verify_attention(*queries, context.cache, context.index, ends, ones, self.scale)
        out = ops.linear_heads(o_latent.view(M, H, r), w_uv.to(o_latent.dtype))  # [M, H, v]
        return _project_out(self.o_proj, out.reshape(B, A, G, H * self.v_dim).to(x.dtype), shared.output_partials)

    def _latent_forward(self, x, positions, context_rows, context_visible, shared=None):
        """BlockAttention.forward with W_UK folded into the queries and W_UV applied after the
        weighted sum (docs/dspark-algorithm.md §2.3): the cache rows serve as the one key/value
        head shared by every query head, so the heads are folded into the query rows."""
        B, A, G = x.shape[:3]
        H, r = self.num_heads, self.kv_lora_rank
        shared = shared or BlockPass(self.rotary, positions, context_visible, G)
        q_nope, q_pe = self.queries(x, positions, shared.rope).split([self.nope, self.rope_dim], dim=-1)  # [B, A, G, H, *]
        w_k, w_v = self.kv_b_proj.weight.unflatten(0, (H, self.nope + self.v_dim)).split([self.nope, self.v_dim], dim=1)
        q_latent = torch.einsum("baghn,hnr->baghr", q_nope, w_k.to(q_nope.dtype))
        queries = torch.cat([q_latent, q_pe.to(q_latent.dtype)], dim=-1).reshape(B, A * G * H, self.row_width)
        block_rows = self.kv_rows(x, positions, shared.rope).flatten(1, 2)  # [B, A * G, W]
        rows = torch.cat([context_rows.to(queries.dtype), block_rows.to(queries.dtype)], dim=1)  # [B, S + A * G, W]
        scores = _product_float32(queries, rows.transpose(1, 2)) * self.scale  # [B, A * G * H, S + A * G]
        probs = scores.masked_fill(shared.hidden_per_head(H), float("-inf")).softmax(dim=-1)
        latent_out = _product_float32(probs.to(rows.dtype), rows[..., :r])  # [B, A * G * H, r]
        out = torch.einsum("baghr,hvr->baghv", latent_out.to(queries.dtype).view(B, A, G, H, r), w_v.to(queries.dtype))
        return self.o_proj(out.flatten(-2).to(x.dtype))


class GQAAttention(BlockAttention):
    """Grouped-query attention with per-head q/k RMSNorm (Qwen3-style DeepSpec drafter).

    Cache row = [RoPE(k_norm(k)) | v], 2 * num_kv_heads * head_dim wide.
    """

    def __init__(self, c: DSparkConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.row_width = 2 * c.num_kv_heads * c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.rotary = Rotary(c.head_dim, c.rope_theta, c.rope_interleaved, c.rope_scaling) if c.use_rope else None
        self.scale = c.head_dim**-0.5 * (self.rotary.attention_scale if self.rotary else 1.0)

    def kv_rows(self, x, positions, rope=None):
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim)))
        if self.rotary is not None:
            k = self.rotary(k, positions, rope)
        return torch.cat([k.flatten(-2), self.v_proj(x)], dim=-1)

    def keys_values(self, rows):
        k, v = rows.unflatten(-1, (2, self.num_kv_heads, self.head_dim)).unbind(dim=-3)
        group = self.num_heads // self.num_kv_heads
        return k.repeat_interleave(group, dim=-2), v.repeat_interleave(group, dim=-2)

    def queries(self, x, positions, rope=None):
        q = self.q_norm(self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim)))
        return self.rotary(q, positions, rope) if self.rotary is not None else q


ATTENTION_TYPES: dict[str, type[BlockAttention]] = {"mla": MLAAttention, "gqa": GQAAttention}


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def drafting(self, x, partials: bool = False, input_partials: bool = False):
        """forward for a drafting pass (no gradients): gate and up as one GEMM where their weights are
        laid out one after the other (DSparkModel.pair_projections), silu and the product in one launch
        where the two share a dtype (autocast's mixed ones keep the torch ops); partials: down's
        split-K partials for the norm after it (_project_out); input_partials: the paired gate | up GEMM's
        own, which the activation adds (INPUTS_AS_PARTIALS_ON)."""
        paired = _one_weight(self.gate_proj, self.up_proj)
        if paired is not None and input_partials and x.dtype == paired.dtype:
            parts = ops.linear_partials(x.reshape(-1, x.shape[-1]), paired)  # [S, M, 2I]
            gate, up = parts.view(parts.shape[0], *x.shape[:-1], parts.shape[-1]).chunk(2, dim=-1)
            act = ops.silu_mul(gate, up, x.dtype)
        else:
            if paired is not None:
                gate, up = F.linear(x, paired).chunk(2, dim=-1)
            else:
                gate, up = self.gate_proj(x), self.up_proj(x)
            act = ops.silu_mul(gate, up) if gate.dtype == up.dtype else F.silu(gate) * up
        return _project_out(self.down_proj, act, partials)


def _add_then_norm(residual: torch.Tensor, delta: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + delta), residual + delta) with the add in the norm's launch (ops.add_rms_norm, the
    same function as RMSNorm after a torch add) where the three share a dtype; autocast's mixed
    dtypes keep the two steps. delta may be a GEMM's split-K partials (_project_out), which the op adds."""
    if residual.dtype == norm.weight.dtype and (delta.dtype == residual.dtype or is_partials_of(delta, residual)):
        return ops.add_rms_norm(residual, delta, norm.weight, norm.eps)
    total = residual + delta
    return norm(total), total


class DecoderLayer(nn.Module):
    """Pre-norm layer (docs/dspark-algorithm.md §2.4). Context rows bypass input_layernorm: they were normed once
    by context_norm (docs/dspark-algorithm.md §2.3)."""

    def __init__(self, c: DSparkConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = ATTENTION_TYPES[c.attention_type](c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)

    def forward(self, x, positions, context_rows, context_visible, inference: bool = False, shared=None):
        x = x + self.self_attn(self.input_layernorm(x), positions, context_rows, context_visible, inference, shared)
        return x + self.mlp(self.post_attention_layernorm(x))


# Parameters of a drafter layer that DSparkModel.load_decoder_layers leaves at their start: the
# per-head q/k norms, which a Llama target layer has no counterpart for.
KEPT_AT_LOAD = frozenset({"self_attn.q_norm.weight", "self_attn.k_norm.weight"})


class DSparkModel(nn.Module):
    """The trainable drafter plus the target's frozen embedding and lm_head.

    embed_tokens [V, d] and lm_head [V, d] are the target's own tensors (not copied); they are
    buffers, so they are neither trained nor saved in the drafter checkpoint.
    """

    def __init__(self, config: DSparkConfig, embed_tokens: torch.Tensor, lm_head: torch.Tensor):
        super().__init__()
        c = self.config = config.validate()
        for name, t in (("embed_tokens", embed_tokens), ("lm_head", lm_head)):
            if tuple(t.shape) != (c.vocab_size, c.hidden_size):
                raise ValueError(f"DSparkModel.{name}: shape {tuple(t.shape)} != (vocab_size, hidden_size) = "
                                 f"({c.vocab_size}, {c.hidden_size})")
        self.register_buffer("embed_tokens", embed_tokens.detach(), persistent=False)
        self.register_buffer("lm_head", lm_head.detach(), persistent=False)
        # A dedicated mask id (= vocab_size) extends the embedding by one frozen row, the mean of
        # the target's rows (how Hugging Face initialises an added token): no lm_head row exists
        # for it, so it is never drafted, and being derived from the target it is never saved.
        mask_row = embed_tokens.detach().double().mean(dim=0).to(embed_tokens.dtype) \
            if c.mask_token_id == c.vocab_size else None
        self.register_buffer("mask_embedding", mask_row, persistent=False)
        # Mixed precision for training: the backbone runs under autocast to this dtype; the
        # logits, the heads and the loss stay float32 (set by the trainer, not saved).
        self.autocast_dtype: torch.dtype | None = None
        self._temperatures: tuple | None = None  # (key, tensor): confidence_probs' calibration temperatures
        self.context_proj = nn.Linear(c.num_taps * c.target_hidden_size, c.hidden_size, bias=False)
        self.context_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_layers))
        self.final_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.markov_head = MarkovHead(c.vocab_size, c.hidden_size, c.markov_rank, c.markov_head_type)
        self.confidence_head = ConfidenceHead(c.hidden_size, c.markov_rank, c.confidence_head_with_markov, c.confidence_bias)

    def load_decoder_layers(self, layers: list[dict[str, torch.Tensor]]) -> None:
        """Start the backbone from target layers (docs/dspark-algorithm.md §6.5): layers[j] holds
        drafter layer j's tensors under DecoderLayer's names, every parameter but the per-head
        q/k norms, which keep their unit start. Only the GQA drafter takes them."""
        c = self.config
        if c.attention_type != "gqa":
            raise ValueError(f"attention_type={c.attention_type!r}: target layers load only into a 'gqa' drafter")
        if len(layers) != len(self.layers):
            raise ValueError(f"layers: {len(layers)} given for a drafter of {len(self.layers)} layers")
        for j, (layer, tensors) in enumerate(zip(self.layers, layers)):
            own = dict(layer.named_parameters())
            missing = sorted(set(own) - KEPT_AT_LOAD - set(tensors))
            if missing:
                raise ValueError(f"layers[{j}]: missing {missing[0]!r}")
            for name, tensor in tensors.items():
                if name not in own or name in KEPT_AT_LOAD:
                    raise ValueError(f"layers[{j}]: {name!r} is not a loadable parameter of a drafter layer")
                if tuple(tensor.shape) != tuple(own[name].shape):
                    raise ValueError(f"layers[{j}].{name}: shape {tuple(tensor.shape)} != {tuple(own[name].shape)}")
            with torch.no_grad():
                for name, tensor in tensors.items():
                    own[name].copy_(tensor)

    def pair_projections(self) -> None:
        """Lay each layer's projection pairs that read one input (SwiGLU's gate and up, MLA's q_a and
        kv_a) out one after the other in one storage, so that a drafting pass multiplies each pair as one
        GEMM: two launches fewer a layer (docs/kernels.md §10.11). The parameters keep their names, values
        and shapes, so checkpoints and exports do not change; a later .to() that moves them undoes the
        layout and the pass falls back to two GEMMs. For a drafter that owns its model (load_drafter): a
        model in training keeps its own layout."""
        with torch.no_grad():
            for layer in self.layers:
                pairs = [(layer.mlp.gate_proj, layer.mlp.up_proj)]
                if isinstance(layer.self_attn, MLAAttention):
                    pairs.append((layer.self_attn.q_a_proj, layer.self_attn.kv_a_proj_with_mqa))
                for first, second in pairs:
                    if _one_weight(first, second) is None:
                        both, rows = torch.cat([first.weight, second.weight]), first.weight.shape[0]
                        first.weight.data, second.weight.data = both[:rows], both[rows:]

    def init_heads_like_deepspec(self) -> None:
        """The Markov and confidence heads at DeepSpec's start, N(0, 0.02) weights and zero biases
        (heads.init_like_deepspec, docs/dspark-algorithm.md §6.6), in place of torch's defaults."""
        init_like_deepspec(self.markov_head)
        init_like_deepspec(self.confidence_head)

    # ---- context -----------------------------------------------------------------------------
    def fuse_taps(self, taps: dict[int, torch.Tensor]) -> torch.Tensor:
        """H_ctx = RMSNorm(fc(concat of the tapped layers)) (docs/dspark-algorithm.md §2.1, paper eq. 2): {layer: [..., d_t]} -> [..., d]."""
        missing = [layer for layer in self.config.target_layer_ids if layer not in taps]
        if missing:
            raise ValueError(f"taps: missing target layers {missing}; the drafter needs {list(self.config.target_layer_ids)}")
        return self.fuse_features(torch.cat([taps[layer] for layer in self.config.target_layer_ids], dim=-1))

    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        """fuse_taps of the tapped layers already concatenated in target_layer_ids order [..., taps * d_t]."""
        return self.context_norm(self.context_proj(features.to(self.context_proj.weight.dtype)))

    def _rotary(self) -> "Rotary | None":
        """The layers' RoPE (every layer's is built from one config, so one serves a whole pass)."""
        return self.layers[0].self_attn.rotary if len(self.layers) else None

    def context_rows(self, fused: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        """Per-layer cache rows of fused context [..., d] at positions [...] -> [..., W] each."""
        rotary = self._rotary()
        rope = rotary.tables(positions) if rotary is not None else None  # one set for every layer
        return [layer.self_attn.kv_rows(fused, positions, rope) for layer in self.layers]

    # ---- block -------------------------------------------------------------------------------
    def block_inputs(self, anchors: torch.Tensor) -> torch.Tensor:
        """[...] anchor ids -> [..., G] input ids [x0, MASK, ..., MASK] (docs/dspark-algorithm.md §2.2)."""
        block = anchors.new_full((*anchors.shape, self.config.block_size), self.config.mask_token_id)
        block[..., 0] = anchors
        return block

    def embed_block(self, block_tokens: torch.Tensor) -> torch.Tensor:
        """Embeddings of block input ids [...] -> [..., d], the dedicated mask id included."""
        if self.mask_embedding is None:
            return F.embedding(block_tokens, self.embed_tokens)
        is_mask = block_tokens == self.config.mask_token_id
        x = F.embedding(block_tokens.masked_fill(is_mask, 0), self.embed_tokens)
        return torch.where(is_mask.unsqueeze(-1), self.mask_embedding.to(x.dtype), x)

    def embed_anchored_blocks(self, anchors: torch.Tensor, anchor_slot: torch.Tensor) -> torch.Tensor:
        """embed_block(block_inputs(anchors)) [B, G, d] in two launches (the anchors' rows, then one
        select against the mask's row) where it is five; anchor_slot: [G, 1] bool, True at slot 0."""
        mask_row = self.mask_embedding if self.mask_embedding is not None else self.embed_tokens[self.config.mask_token_id]
        x0 = F.embedding(anchors, self.embed_tokens)
        return torch.where(anchor_slot, x0.unsqueeze(-2), mask_row.to(x0.dtype))

    def backbone(
        self,
        block_tokens: torch.Tensor,  # [B, A, G]
        positions: torch.Tensor,  # [B, A, G]: anchor position + (k - 1)
        context_rows: list[torch.Tensor],  # per layer [B, S, W]
        context_visible: torch.Tensor | None,  # [B, A, S]; None with flex_mask
        inference: bool = False,
        flex_mask=None,
    ) -> torch.Tensor:
        """One parallel pass over every block; returns the final-normed hidden [B, A, G, d].
        inference: a drafting pass (no gradients needed), which an attention layout may compute in
        a cheaper but equal way (MLA's latent attention, docs/dspark-algorithm.md §2.3).
        flex_mask: the block mask as a FlexAttention BlockMask (flex.block_mask), for a training
        pass that attends block-sparse instead of through the dense mask of context_visible."""
        if (context_visible is None) == (flex_mask is None):
            raise ValueError("backbone: give exactly one of context_visible and flex_mask")
        if flex_mask is not None and inference:
            raise ValueError("backbone: flex_mask is for training passes (inference=False)")
        x = self.embed_block(block_tokens).to(self.context_proj.weight.dtype)
        shared = BlockPass(self._rotary(), positions, context_visible, block_tokens.shape[-1], flex_mask)
        with torch.autocast(x.device.type, dtype=self.autocast_dtype or torch.bfloat16,
                            enabled=self.autocast_dtype is not None):
            if inference:
                return self._drafting_layers(x, positions, context_rows, context_visible, shared)
            for layer, rows in zip(self.layers, context_rows):
                x = layer(x, positions, rows, context_visible, inference, shared)
        return self.final_norm(x)

    def draft_backbone(self, anchors: torch.Tensor, context_rows: list, constants: DraftConstants,
                       lengths: torch.Tensor, context: int) -> torch.Tensor:
        """backbone(block_inputs(anchors)[:, None], ...) of a drafting pass, one block per request after
        `lengths` [B] committed rows (at most `context`), [B, G, d]: the same function, its setup read
        from the drafter's DraftConstants (docs/kernels.md §10.11)."""
        x = self.embed_anchored_blocks(anchors, constants.anchor_slot).to(self.context_proj.weight.dtype).unsqueeze(1)
        positions, shared = constants.block_pass(self, lengths, context)
        with torch.autocast(x.device.type, dtype=self.autocast_dtype or torch.bfloat16,
                            enabled=self.autocast_dtype is not None):
            return self._drafting_layers(x, positions, context_rows, None, shared)[:, 0]

    def _drafting_layers(self, x, positions, context_rows, context_visible, shared: BlockPass) -> torch.Tensor:
        """The layers and the final norm of a drafting pass, DecoderLayer.forward's function with each
        residual add done in the norm after it (the post-attention norm, the next layer's input norm, the
        final norm) and SwiGLU's product in its activation's launch: three launches fewer a layer, which at
        a rank's share of the K3 drafter are what its propose costs, not bytes (docs/kernels.md §10.11)."""
        norms = [self.final_norm] + [n for layer in self.layers for n in (layer.input_layernorm,
                                                                             layer.post_attention_layernorm)]
        same_dtype = self.autocast_dtype is None and all(n.weight.dtype == x.dtype for n in norms)
        shared.output_partials = x.device.type in OUTPUTS_AS_PARTIALS_ON and same_dtype
        shared.input_partials = x.device.type in INPUTS_AS_PARTIALS_ON and same_dtype
        h = self.layers[0].input_layernorm(x)
        for i, (layer, rows) in enumerate(zip(self.layers, context_rows)):
            delta = layer.self_attn(h, positions, rows, context_visible, True, shared)
            h, x = _add_then_norm(x, delta, layer.post_attention_layernorm)
            after = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.final_norm
            h, x = _add_then_norm(x, layer.mlp.drafting(h, shared.output_partials, shared.input_partials), after)
        return h

    def base_logits(self, hidden: torch.Tensor, widen: bool = True) -> torch.Tensor:
        """U_k = lm_head(h_k), in float32 or wider (docs/dspark-algorithm.md §2.4); widen=False: a
        lower-precision head's product left in its dtype, for a consumer that widens it as it reads it
        (ops.markov_greedy_draft; the same values, one [B, G, V] copy fewer)."""
        dtype = _at_least_float32(hidden.dtype)
        if self.lm_head.dtype == dtype:
            return hidden.to(dtype) @ self.lm_head.t()
        # A lower-precision shared head is used as it is (a float32 copy of K3's 163840 x 7168
        # head would be 4.7 GB per call); only the product is widened.
        product = hidden.to(self.lm_head.dtype) @ self.lm_head.t()
        return product.to(dtype) if widen else product

    def head_outputs(
        self, hidden: torch.Tensor, prev_tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Markov-corrected logits Z [..., V] (float32) and confidence logits [...] given the
        previous token of every slot (the anchor for slot 1)."""
        prev_embedding = self.markov_head.embed_previous(prev_tokens)
        dtype = _at_least_float32(hidden.dtype)
        logits = self.base_logits(hidden) + self.markov_head.bias(prev_embedding, hidden).to(dtype)
        confidence = self.confidence_head(hidden, prev_embedding).to(dtype)
        return logits, confidence

    def confidence_temperatures(self, width: int, device: torch.device,
                                dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        """The calibrated per-position temperatures [width] (None before calibration), as a device tensor
        made once: a graphed draft may not upload them per call."""
        temps = self.config.confidence_temperatures
        if temps is None:
            return None
        key = (tuple(temps), width, dtype, torch.device(device))
        if self._temperatures is None or self._temperatures[0] != key:
            self._temperatures = (key, temperature_tensor(temps, *key[1:]))
        return self._temperatures[1]

    def confidence_probs(self, confidence_logits: torch.Tensor) -> torch.Tensor:
        """sigmoid(logit_k / T_k) with the calibrated per-position temperatures (docs/dspark-algorithm.md §5.2)."""
        temps = self.confidence_temperatures(confidence_logits.shape[-1], confidence_logits.device,
                                             confidence_logits.dtype)
        return calibrated_confidence(confidence_logits, temps)
