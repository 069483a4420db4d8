"""The Kimi K3 decoder in plain torch over the dspark op registry.

Per layer i (docs/kimi-k3.md §7, Block AttnRes): attention is KDA or gated MLA by
cfg.layer_type(i) (§2, §3), the FFN is the dense SiTU-GLU MLP for i < first_k_dense, else the
latent MoE (§1.2); after the last layer one more AttnRes mix, the final norm and lm_head.
Projections go through `ops.linear`, KDA through `ops.kda_verify`, MLA attention through
`ops.mla_verify_attention` (its cache rows through `ops.mla_cache_rows`), the MoE through
moe.py; the elementwise parts are per row (kernels/numerics.py), so on the CPU a token's logits
do not depend on its batch, bit for bit.

`forward` runs B requests of T tokens from their committed decode state without changing it,
except that MLA rows of the new tokens are written past each slot's committed length (they are
never read before being written again, so rejected rows leave no trace); it returns the KDA
records of every KDA layer, stacked, which one `ops.kda_commit_layers` replays to keep accepted tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.kernels import ops
from dspark.kernels.kda.reference import KDARecords, allocate_records, layer_records

from . import weights as layout
from .config import K3Config
from .moe import LatentMoEWeights, latent_moe, rank_latent_moe
from .parallel import RankParallel
from .sharding import Shard

# docs/kimi-k3.md §7 caution: the transcription has the FFN's AttnRes mix include this layer's attention
# output (one JAX re-implementation feeds attention and FFN from the same value set instead).
# This flag is the one place that choice is made.
FFN_MIX_INCLUDES_LAYER_ATTENTION = True

# GEMMs whose next kernel can add their split-K partials as it reads them (ops.linear_partials) hand
# it the partials, bit for bit what the GEMM's reduction kernel would have written, and that kernel is
# not launched (docs/kimi-k3.md §8.5): the output projections whose result a mix norm adds next
# (attention's inside a block, every FFN's), the MoE's shared gate|up GEMM (into moe_tail_inputs), and an
# MLA layer's input GEMM (q_a and kv into mla_cache_rows, the gate into mla_absorb_output).
# On a rank that is ~3 launches a layer fewer for the same step time or a little less (H100,
# experiments/notes/rank.md "Sixth round"); experiments/step_bench.py --setting split_k_into_consumers=0
# times the reductions again.
SPLIT_K_INTO_CONSUMERS = True


# Projections that read the same input, fused into one GEMM each (K3Model._fuse_rows).
MLA_INPUT_PROJECTIONS = ("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight", "self_attn.g_proj.weight")
KDA_INPUT_PROJECTIONS = tuple(f"self_attn.{p}_proj.weight" for p in ("q", "k", "v", "g", "f_a", "b"))
DENSE_FFN_INPUT_PROJECTIONS = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
MOE_INPUT_PROJECTIONS = ("block_sparse_moe.gate.weight", "block_sparse_moe.routed_expert_down_proj.weight",
                         "block_sparse_moe.shared_experts.gate_proj.weight",
                         "block_sparse_moe.shared_experts.up_proj.weight")  # LatentMoEWeights.moe_inputs
# Projections whose outputs are summed, fused along K (K3Model._fuse_columns): LatentMoEWeights.output_proj
MOE_OUTPUT_PROJECTIONS = ("block_sparse_moe.routed_expert_up_proj.weight",
                          "block_sparse_moe.shared_experts.down_proj.weight")


def _stack_of_views(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[len(tensors), ...]: the stack the tensors are consecutive views of, as it is, when they are
    (weights.expert_stack_views: random and loaded checkpoints); else a stacked copy."""
    base = tensors[0]._base
    if (base is not None and base.is_contiguous() and tuple(base.shape) == (len(tensors), *tensors[0].shape)
            and all(t._base is base and t.data_ptr() == base[j].data_ptr() for j, t in enumerate(tensors))):
        return base
    return torch.stack(tensors)


@dataclass
class DecodeState:
    """The committed state a forward reads, for the B requests of a call.

    kda: per KDA layer the pools (state [slots, H, D, D] fp32, conv window [slots, 3, W, 3]),
         request b's at row slots[b]; read only.
    mla: per MLA layer the latent cache [slots, max_len + 1, R + P] (the last row of each slot is
         a spare that padding positions write); rows of the new tokens are written at
         cache_lens[b] + j of slot slots[b].
    """

    kda: list[tuple[torch.Tensor, torch.Tensor]]
    mla: list[torch.Tensor]
    slots: torch.Tensor  # [B] long
    cache_lens: torch.Tensor  # [B] long, committed length per request


class K3Model:
    def __init__(self, cfg: K3Config, tensors: dict[str, torch.Tensor], shard: Shard | None = None,
                 collectives=None, routing: str = "exact"):
        """Build from checkpoint-layout tensors. Takes ownership of `tensors`: the per-expert
        entries are removed as each layer's experts are stacked; when they are views of one
        stack per layer (weights.expert_stack_views) the stack is taken as it is, so the routed
        experts (most of the bytes) are never held twice.

        With `shard` of world > 1 the model is that rank (docs/kimi-k3.md §8): `tensors` are its
        parts (weights.tensor_specs(cfg, shard)), `collectives` join it to the other ranks
        (default: omitted, parallel.OmittedCollectives) and `routing` picks which pairs its
        experts take (parallel.py: "exact" or "busiest")."""
        self.shard = (shard or Shard()).validate(cfg)
        layout.check_tensors(cfg, tensors, self.shard)
        self.parallel = (RankParallel(cfg, self.shard, collectives, routing) if self.shard.world > 1 else None)
        self.kda_heads = cfg.kda_num_heads // self.shard.world  # heads this model computes
        self.mla_heads = cfg.mla_num_heads // self.shard.world
        self.routing_log: list | None = None  # a list: each MoE layer's expert ids are appended to it
        self.cfg = cfg
        self.dtype = tensors[layout.EMBED].dtype
        self.device = tensors[layout.EMBED].device
        # Routed experts are stacked per layer [E, ...] for the MoE op; the rest stay by name.
        # Moved out of `tensors` (the caller's dict keeps only the experts, popped as they are
        # stacked): a projection fused below is then held by its fused weight alone, not also by
        # the caller's dict until the model is built.
        self.tensors = {n: tensors.pop(n) for n in list(tensors) if ".block_sparse_moe.experts." not in n}
        self.moe: dict[int, LatentMoEWeights] = {}
        self.conv_weights: dict[int, torch.Tensor] = {}
        self.mla_absorbed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.fused_inputs: dict[int, tuple[torch.Tensor, list[int]]] = {}  # attention's fused input GEMM
        self.ffn_inputs: dict[int, tuple[torch.Tensor, list[int]]] = {}  # the dense FFN's gate|up GEMM
        # (a MoE layer's shared gate|up GEMM is its LatentMoEWeights.shared_gate_up)
        self.kda_index = {i: k for k, i in enumerate(cfg.kda_layers)}
        self.mla_index = {i: k for k, i in enumerate(cfg.mla_layers)}
        for i in range(cfg.num_layers):
            a = f"{layout.layer_prefix(i)}.self_attn"
            if cfg.layer_type(i) == "kda":
                # q, k, v depthwise taps [W, 1, 4] -> [3, W, 4]
                self.conv_weights[i] = torch.stack(
                    [self.tensors[f"{a}.{p}_conv1d.weight"][:, 0] for p in ("q", "k", "v")]
                ).float()
                # A rank's 6-row b projection leaves the fused rows off the multiple of 8 the CuTe
                # GEMM tiles (kernels/linear/cute_host.py shape_supported): pad, else cuBLAS runs it.
                self.fused_inputs[i] = self._fuse_rows(i, KDA_INPUT_PROJECTIONS, 8 if self.shard.world > 1 else 1)
            else:
                # kv_b [H*(nope+v), R] splits per head into W_UK [nope, R] and W_UV [v, R]
                # (docs/kimi-k3.md §3); absorbed: q_latent_h = W_UK_h^T q_nope_h, o_h = W_UV_h o_latent_h.
                kv_b = self.tensors[f"{a}.kv_b_proj.weight"].view(self.mla_heads, -1, cfg.kv_lora_rank)
                w_uk_t = kv_b[:, : cfg.qk_nope_head_dim].transpose(1, 2).contiguous()  # [H, R, nope]
                w_uv = kv_b[:, cfg.qk_nope_head_dim :].contiguous()  # [H, v, R]
                self.mla_absorbed[i] = (w_uk_t, w_uv)
                self.fused_inputs[i] = self._fuse_rows(i, MLA_INPUT_PROJECTIONS)
            if cfg.ffn_type(i) == "moe":
                self.moe[i] = self._stack_moe(i, tensors)
            else:
                self.ffn_inputs[i] = self._fuse_rows(i, DENSE_FFN_INPUT_PROJECTIONS)
        # Block AttnRes seals a checkpoint every attn_res_block_size layers (docs/kimi-k3.md §7).
        self.max_checkpoints = len(range(0, cfg.num_layers, cfg.attn_res_block_size))

    @classmethod
    def random(cls, cfg: K3Config, seed: int = 0, dtype: torch.dtype = torch.bfloat16, device="cpu",
               shard: Shard | None = None, routing: str = "exact") -> "K3Model":
        return cls(cfg, layout.random_tensors(cfg, seed, dtype, device, shard), shard=shard, routing=routing)

    @classmethod
    def from_checkpoint(cls, path, dtype: torch.dtype = torch.bfloat16, device="cpu") -> "K3Model":
        cfg, tensors = layout.load_checkpoint(path, dtype, device)
        return cls(cfg, tensors)

    def _stack_moe(self, i: int, tensors) -> LatentMoEWeights:
        m = f"{layout.layer_prefix(i)}.block_sparse_moe"
        experts = [layout.expert_prefix(i, e) for e in self.shard.experts(self.cfg)]

        def stacked(w, part):
            experts_of_kind = [tensors.pop(f"{x}.{w}.{part}") for x in experts]
            return _stack_of_views(experts_of_kind)

        moe_inputs, rows = self._fuse_rows(i, MOE_INPUT_PROJECTIONS)
        return LatentMoEWeights(
            moe_inputs=moe_inputs,
            gate=self.tensors[f"{m}.gate.weight"],
            score_bias=self.tensors[f"{m}.gate.e_score_correction_bias"],
            latent_down=self.tensors[f"{m}.routed_expert_down_proj.weight"],
            latent_norm=self.tensors[f"{m}.routed_expert_norm.weight"],
            shared_gate_up=moe_inputs[rows[0] + rows[1]:],  # the shared experts' gate | up rows
            output_proj=self._fuse_columns(i, MOE_OUTPUT_PROJECTIONS),
            w1_packed=stacked("w1", "weight_packed"), w1_scale=stacked("w1", "weight_scale"),
            w3_packed=stacked("w3", "weight_packed"), w3_scale=stacked("w3", "weight_scale"),
            w2_packed=stacked("w2", "weight_packed"), w2_scale=stacked("w2", "weight_scale"),
        )

    def _fuse_rows(self, i: int, suffixes: tuple[str, ...], rows_multiple: int = 1) -> tuple[torch.Tensor, list[int]]:
        """One weight [sum N, K] for projections that read the same input, so they run as one
        GEMM: the small ones alone are launch- and ramp-bound (MLA kv_a 576 x 7168 reached 35% of
        the read rate on the H200, q_a 55%; experiments/notes/skinny_gemm.md) and vanish inside
        the large one. The checkpoint names stay as row views of it: nothing is held twice.
        Zero rows pad it to a multiple of `rows_multiple` (not in `sizes`: callers drop them)."""
        names = [f"{layout.layer_prefix(i)}.{suffix}" for suffix in suffixes]
        parts = [self.tensors[n] for n in names]
        padding = -sum(p.shape[0] for p in parts) % rows_multiple
        fused = torch.cat(parts + [parts[0].new_zeros(padding, parts[0].shape[1])] if padding else parts)
        sizes, start = [], 0
        for n in names:
            rows = self.tensors[n].shape[0]
            self.tensors[n] = fused[start : start + rows]
            sizes.append(rows)
            start += rows
        return fused, sizes

    def _fuse_columns(self, i: int, suffixes: tuple[str, ...]) -> torch.Tensor:
        """One weight [N, sum K] for projections whose outputs are added: x_1 W_1^T + x_2 W_2^T
        is then one GEMM of [x_1 | x_2]. The checkpoint names stay as column views of it."""
        names = [f"{layout.layer_prefix(i)}.{suffix}" for suffix in suffixes]
        fused = torch.cat([self.tensors[n] for n in names], dim=1)
        start = 0
        for n in names:
            columns = self.tensors[n].shape[1]
            self.tensors[n] = fused[:, start : start + columns]
            start += columns
        return fused

    def named_tensors(self):
        """(name, tensor) in the checkpoint layout; experts are views of the stacked tensors."""
        yield from self.tensors.items()
        for i, moe in self.moe.items():
            for j, e in enumerate(self.shard.experts(self.cfg)):
                x = layout.expert_prefix(i, e)
                for w in ("w1", "w3", "w2"):
                    yield f"{x}.{w}.weight_packed", getattr(moe, f"{w}_packed")[j]
                    yield f"{x}.{w}.weight_scale", getattr(moe, f"{w}_scale")[j]

    # ------------------------------------------------------------------------ pieces
    def _w(self, i: int, suffix: str) -> torch.Tensor:
        return self.tensors[f"{layout.layer_prefix(i)}.{suffix}"]

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's output summed over the ranks (itself for the whole model)."""
        return partial if self.parallel is None else self.parallel.all_reduce(partial)

    def _output_projection(self, x: torch.Tensor, weight: torch.Tensor, partials: bool) -> torch.Tensor:
        """A row-parallel output projection, summed over the ranks; `partials`: left as its split-K
        partials [S, M, N] for the mix norm that adds it (SPLIT_K_INTO_CONSUMERS)."""
        return self._reduce(ops.linear_partials(x, weight) if partials else ops.linear(x, weight))

    def _kda(self, i, h, B, T, lengths, state, conv_state, slots, records: KDARecords, partials: bool = False):
        """Layer i's KDA attention output; its verify fills `records`, this layer's views of the forward's."""
        cfg, a = self.cfg, "self_attn"
        H = self.kda_heads
        W = H * cfg.kda_head_dim
        fused, sizes = self.fused_inputs[i]
        projected = ops.linear(h, fused)[:, : sum(sizes)]  # without a rank's padding rows
        q, k, v, g, f_a, beta = projected.split(sizes, dim=-1)  # KDA_INPUT_PROJECTIONS order
        f = ops.linear(f_a, self._w(i, f"{a}.f_b_proj.weight"))
        o, _ = ops.kda_verify(
            q.reshape(B, T, W), k.reshape(B, T, W), v.reshape(B, T, W), f.view(B, T, W),
            beta.reshape(B, T, H), g.reshape(B, T, W),
            self.conv_weights[i], conv_state, self._w(i, f"{a}.A_log")[:H],
            self._w(i, f"{a}.dt_bias"), self._w(i, f"{a}.o_norm.weight"), state, lengths,
            lower_bound=cfg.kda_gate_lower_bound, eps=cfg.rms_norm_eps, slots=slots, records=records,
        )
        return self._output_projection(o.reshape(B * T, W), self._w(i, f"{a}.o_proj.weight"), partials)

    def _mla(self, i, h, B, T, lengths, cache, slots, cache_lens, partials: bool = False):
        cfg, a = self.cfg, "self_attn"
        H, R, P = self.mla_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        eps = cfg.rms_norm_eps
        fused, sizes = self.fused_inputs[i]
        # With SPLIT_K_INTO_CONSUMERS the input GEMM's split-K partials go unreduced to the cache rows' launch
        # (q_a and kv) and the output gate's (gate), which add them: no reduction launch.
        reduced = h.dtype if SPLIT_K_INTO_CONSUMERS else None
        inputs = ops.linear_partials(h, fused) if SPLIT_K_INTO_CONSUMERS else ops.linear(h, fused)
        q_a, kv, gate = inputs.split(sizes, dim=-1)  # MLA_INPUT_PROJECTIONS order; [S, B*T, *] as partials
        # the cache rows' launch also normalises c_q (q_a_layernorm), in place of an rms_norm launch; the
        # rows are in the cache before the attention reads them
        c_q = ops.mla_cache_rows(kv, self._w(i, f"{a}.kv_a_layernorm.weight"), eps, cache, slots, cache_lens, lengths,
                                 q=(q_a, self._w(i, f"{a}.q_a_layernorm.weight")), dtype=reduced)
        q = ops.linear(c_q, self._w(i, f"{a}.q_b_proj.weight")).view(B * T, H, cfg.qk_head_dim)
        w_uk_t, w_uv = self.mla_absorbed[i]
        q_latent, q_pe = ops.mla_absorb_q(q, w_uk_t)  # [B*T, H, R], [B*T, H, P]
        o_latent = ops.mla_verify_attention(
            q_latent.view(B, T, H, R), q_pe.view(B, T, H, P), cache, slots, cache_lens, lengths,
            cfg.qk_head_dim**-0.5,
        ).view(B * T, H, R)
        o = ops.mla_absorb_output(o_latent, w_uv, gate)  # [B*T, H * v], gated
        return self._output_projection(o, self._w(i, f"{a}.o_proj.weight"), partials)

    def _ffn(self, i, y, partials: bool = False):
        cfg = self.cfg
        if cfg.ffn_type(i) == "dense":
            fused, sizes = self.ffn_inputs[i]
            gate, up = ops.linear(y, fused).split(sizes, dim=-1)  # DENSE_FFN_INPUT_PROJECTIONS order
            act = ops.situ_glu(gate, up, cfg.situ_beta, cfg.situ_linear_beta)
            return self._output_projection(act, self._w(i, "mlp.down_proj.weight"), partials)
        if self.parallel is not None:
            return rank_latent_moe(y, self.moe[i], cfg, self.parallel, self.routing_log, partials,
                                   SPLIT_K_INTO_CONSUMERS)
        return latent_moe(y, self.moe[i], cfg, self.routing_log, partials, SPLIT_K_INTO_CONSUMERS)

    # ------------------------------------------------------------------------ forward
    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor, state: DecodeState, tap_layers=()):
        """tokens [B, T] (row b uses its first lengths[b]) -> (logits [B, T, V] fp32,
        taps {layer: [B, T, d]}, the KDA layers' records stacked [n_kda, ...] in KDA layer order)."""
        cfg = self.cfg
        B, T = tokens.shape
        positions = torch.arange(T, device=tokens.device)
        valid = positions[None, :] < lengths.to(tokens.device)[:, None]
        ids = torch.where(valid, tokens, torch.zeros_like(tokens)).reshape(-1)  # padding: any valid id
        embed = self.tensors[layout.EMBED]
        hidden = embed[ids] if self.parallel is None else self.parallel.embed(embed, ids)
        taps = {}
        if -1 in tap_layers:
            taps[-1] = hidden.view(B, T, -1)
        # Every KDA layer's records in one set of buffers, each layer's verify filling its views, so that
        # the commit replays them all in one launch instead of one per layer.
        records = allocate_records(B, T, self.kda_heads, cfg.kda_head_dim,
                                   state.kda[0][1].dtype if state.kda else hidden.dtype, hidden.device, lengths,
                                   leading=(len(state.kda),),
                                   dtype=torch.float64 if hidden.dtype == torch.float64 else torch.float32)
        # Sealed checkpoints stacked [n, B*T, d] (filled as blocks seal), so a mix reads them as one tensor.
        checkpoints = hidden.new_empty(self.max_checkpoints, B * T, hidden.shape[-1])
        sealed = 0
        prefix = hidden  # running sum of the current block (docs/kimi-k3.md §7)
        eps = cfg.rms_norm_eps

        def mix_norm(current, num_checkpoints, mix_norm_weight, mix_proj_weight, norm_weight, delta=None):
            """(RMSNorm of the AttnRes mix of {checkpoints, current + delta} (of current alone before any
            seal), current + delta): a residual add still to be done is done in the norm's pass."""
            if delta is not None:
                return ops.add_attn_res_mix_norm(current, delta, checkpoints[:num_checkpoints], mix_norm_weight,
                                                 mix_proj_weight, norm_weight, eps)
            if num_checkpoints == 0:
                return ops.rms_norm(current, norm_weight, eps), current
            return ops.attn_res_mix_norm(current, checkpoints[:num_checkpoints], mix_norm_weight, mix_proj_weight,
                                         norm_weight, eps), current

        ffn_out = None  # the last FFN's output, not yet added to prefix: the next norm adds it
        for i in range(cfg.num_layers):
            h, prefix = mix_norm(prefix, sealed, self._w(i, "self_attention_res_norm.weight"),
                                 self._w(i, "self_attention_res_proj.weight"), self._w(i, "input_layernorm.weight"),
                                 delta=ffn_out)
            before_prefix, before_sealed = prefix, sealed
            block_prefix = prefix
            if i % cfg.attn_res_block_size == 0:  # seal: the block so far becomes a checkpoint
                checkpoints[sealed] = prefix
                sealed += 1
                block_prefix = None
            # Partials only where a mix norm adds the output next: attention after a seal is the new
            # block's first value, and a tapped FFN output is added here.
            attn_partials = SPLIT_K_INTO_CONSUMERS and FFN_MIX_INCLUDES_LAYER_ATTENTION and block_prefix is not None
            if cfg.layer_type(i) == "kda":
                k = self.kda_index[i]
                attn = self._kda(i, h, B, T, lengths, *state.kda[k], state.slots, layer_records(records, k),
                                 attn_partials)
            else:
                attn = self._mla(i, h, B, T, lengths, state.mla[self.mla_index[i]], state.slots, state.cache_lens,
                                 attn_partials)
            # The block's sum with this attention: attn alone after a seal, else block_prefix + attn.
            base, delta = (attn, None) if block_prefix is None else (block_prefix, attn)
            ffn_mix = (self._w(i, "mlp_res_norm.weight"), self._w(i, "mlp_res_proj.weight"),
                       self._w(i, "post_attention_layernorm.weight"))
            if FFN_MIX_INCLUDES_LAYER_ATTENTION:
                y, prefix = mix_norm(base, sealed, *ffn_mix, delta=delta)
            else:
                prefix = base if delta is None else base + delta
                y, _ = mix_norm(before_prefix, before_sealed, *ffn_mix)
            ffn_out = self._ffn(i, y, SPLIT_K_INTO_CONSUMERS and i not in tap_layers)
            if i in tap_layers:  # a tap reads the sum now
                prefix, ffn_out = prefix + ffn_out, None
                taps[i] = prefix.view(B, T, -1)
        final, _ = mix_norm(prefix, sealed, self.tensors[layout.OUTPUT_RES_NORM], self.tensors[layout.OUTPUT_RES_PROJ],
                            self.tensors[layout.FINAL_NORM], delta=ffn_out)
        if cfg.num_layers in tap_layers:  # the LM head's input (dspark.protocols.TargetOutput)
            taps[cfg.num_layers] = final.view(B, T, -1)
        logits = ops.linear(final, self.tensors[layout.LM_HEAD])
        if self.parallel is not None:  # vocabulary-parallel lm_head
            logits = self.parallel.all_gather(logits)
        return logits.float().view(B, T, -1), taps, records
