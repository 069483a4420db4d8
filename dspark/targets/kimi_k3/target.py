"""K3Target: the Kimi K3 model behind dspark.protocols.Target, with preallocated per-slot state.

State per slot (docs/kimi-k3.md §2.1, §3): KDA recurrent state fp32 [slots, n_kda, H, D, D],
KDA conv window [slots, n_kda, 3, W, 3] (the last 3 pre-conv q/k/v inputs, model dtype), MLA
latent cache [slots, n_mla, max_seq_len, R + P] (model dtype) and the committed length.

verify is output-only: KDA layers record (k, u, exp g) per position and commit replays the
accepted ones bitwise (kernels/kda/reference.py); MLA rows of the verified tokens are written
past the committed length and commit only moves the length. The KDA ops take each layer's pools
and the batch's slot index (docs/kernels.md §10.3, §10.4): verify reads and commit advances the
slots' rows where they lie, with no gather or scatter of the state around them.

No host synchronisation on the device: verify and commit read lengths, counts and tokens only
where they already are on the host (lists, CPU tensors), so a CUDA step can be captured in a
graph. Checks that need the values (token ids in the vocabulary, capacity, accepted counts)
run on host values; device values were checked where the request entered the engine, and the
engine bounds every request's k by the context it has left.
"""
from __future__ import annotations

from pathlib import Path

import torch

from dspark.kernels import ops
from dspark.protocols import TargetOutput
from dspark.threads import one_cpu_thread
from dspark.targets.prefill import checked_chunk_tokens, prefill_in_chunks
from dspark.targets.slots import checked_slots
from dspark.transfer import long_tensor_on

from . import weights as layout
from .config import PRESETS, RANK_PRESETS, first_layers, get_preset
from .model import DecodeState, K3Model
from .sharding import Shard


def _host_ints(values) -> list[int] | None:
    """values as a list of ints when they are on the host (list, tuple, CPU tensor); None for a
    device tensor, whose values are not read (reading them would synchronise)."""
    if isinstance(values, torch.Tensor):
        return [int(v) for v in values.tolist()] if values.device.type == "cpu" else None
    return [int(v) for v in values]


class K3Target:
    # verify and commit take a device tensor of slots and never read device values on the host,
    # so an engine may capture them in a CUDA graph (dspark/graph_step.py)
    supports_cuda_graphs = True

    def __init__(self, model: K3Model, max_slots: int, max_seq_len: int, prefill_chunk_tokens: int = 2048):
        """prefill_chunk_tokens: the most prompt tokens (over the batch) one prefill forward feeds
        (dspark/targets/prefill.py)."""
        cfg = model.cfg
        self.prefill_chunk_tokens = checked_chunk_tokens(prefill_chunk_tokens)
        if max_slots < 1:
            raise ValueError(f"max_slots={max_slots}: must be >= 1")
        if not 1 <= max_seq_len <= cfg.max_position_embeddings:
            raise ValueError(f"max_seq_len={max_seq_len}: must be in [1, {cfg.max_position_embeddings}]")
        self.model = model
        self.config = cfg
        self.eos_token_id = cfg.eos_token_id
        self.vocab_size = cfg.vocab_size
        self.hidden_size = cfg.hidden_size
        self.num_layers = cfg.num_layers
        self.max_seq_len = max_seq_len
        self.max_slots = max_slots
        self.device = model.device
        n_kda, n_mla = len(cfg.kda_layers), len(cfg.mla_layers)
        H, D = model.kda_heads, cfg.kda_head_dim  # a rank's heads (docs/kimi-k3.md §8); all of them otherwise
        W = H * D
        dev = self.device
        self.kda_state = torch.zeros(max_slots, n_kda, H, D, D, dtype=torch.float32, device=dev)
        self.conv_state = torch.zeros(max_slots, n_kda, 3, W, cfg.kda_conv_size - 1, dtype=model.dtype, device=dev)
        # Each KDA layer's pools, [max_slots, H, D, D] and [max_slots, 3, W, 3] views with the
        # slot stride of the 5-D tensors, made once rather than per step (host time per call).
        self._kda_pools = [(self.kda_state[:, k], self.conv_state[:, k]) for k in range(n_kda)]
        # All layers' pools seen layer-major, [n_kda, slots, ...], for the one commit launch of a step.
        self._kda_layer_major = (self.kda_state.transpose(0, 1), self.conv_state.transpose(0, 1))
        # One spare row per slot past max_seq_len: the padding positions of a ragged batch write
        # their rows there, so the rows of a whole [B, T] block go in with one scatter (no
        # per-request loop reading lengths on the host). Nothing ever reads the spare row.
        # Layer-major [n_mla, slots, L + 1, R + P]: each layer's pool is one contiguous
        # [slots, L + 1, R + P] tensor, the layout the CuTe MLA kernels' TMA descriptor takes
        # (kernels/mla/cute_host.py check_arguments); slot-major, a layer's pool is contiguous
        # only at one slot and any batch of two or more fell back to the host-reading reference.
        self._mla_rows = torch.zeros(n_mla, max_slots, max_seq_len + 1, cfg.kv_cache_width, dtype=model.dtype,
                                     device=dev)
        self._mla_pools = list(self._mla_rows.unbind(0))
        # [slots, n_mla, max_seq_len, R + P] as callers index it (slot first), a view
        self.mla_cache = self._mla_rows.transpose(0, 1)[:, :, :max_seq_len]
        self.lengths = torch.zeros(max_slots, dtype=torch.long, device=dev)
        self._index_cache: dict[tuple[int, ...], torch.Tensor] = {}
        # The last verify: (slots, KDA records, host lengths or None, T).
        self._pending = None

    def embedding_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(embed_tokens [V, d], lm_head [V, d]) that a DSpark drafter shares with the target."""
        return self.model.tensors[layout.EMBED], self.model.tensors[layout.LM_HEAD]

    # ------------------------------------------------------------------------ validation
    def _slot_index(self, slots: list[int]) -> torch.Tensor:
        """The device index of a batch's slots, built once per batch composition (the engine's
        batch changes only when a request enters or leaves)."""
        key = tuple(slots)
        if key not in self._index_cache:
            self._index_cache[key] = long_tensor_on(slots, self.device)
        return self._index_cache[key]

    def _check_tokens(self, tokens: torch.Tensor, lengths: list[int]) -> None:
        for r, n in enumerate(lengths):
            row = tokens[r, :n]
            bad = (row < 0) | (row >= self.vocab_size)
            if bool(bad.any()):
                j = int(bad.nonzero()[0, 0])
                raise ValueError(f"tokens: id {int(row[j])} at [{r}, {j}] outside [0, {self.vocab_size})")

    def _check_capacity(self, slots: list[int], lengths: list[int]) -> None:
        if self.lengths.device.type != "cpu":
            return  # the engine bounds each request's k by the context it has left
        for slot, n in zip(slots, lengths):
            have = int(self.lengths[slot])
            if have + n > self.max_seq_len:
                raise ValueError(f"verify past max_seq_len={self.max_seq_len}: slot {slot} has "
                                 f"{have} tokens and {n} more were fed")

    # ------------------------------------------------------------------------ protocol
    def _batch(self, slots) -> tuple[list[int] | torch.Tensor, torch.Tensor]:
        """(slots as given after checks, their device index). A device tensor of slots (a CUDA
        graph's static buffer) is taken as the index unread; host slots are checked."""
        if isinstance(slots, torch.Tensor) and slots.device.type != "cpu":
            if slots.dim() != 1 or slots.dtype != torch.long:
                raise ValueError(f"slots: a device tensor of slots must be 1-D long, got {tuple(slots.shape)} {slots.dtype}")
            return slots, slots
        slots = checked_slots(slots, self.max_slots)
        return slots, self._slot_index(slots)

    def verify(self, slots, tokens: torch.Tensor, lengths, tap_layers=()) -> TargetOutput:
        slots, index = self._batch(slots)
        if tokens.dim() != 2 or tokens.shape[0] != len(slots):
            raise ValueError(f"tokens: expected [{len(slots)}, T], got {tuple(tokens.shape)}")
        T = tokens.shape[1]
        host_lengths = _host_ints(lengths)
        if host_lengths is not None:
            if len(host_lengths) != len(slots):
                raise ValueError(f"lengths: expected {len(slots)} entries, got {len(host_lengths)}")
            for n in host_lengths:
                if not 0 <= n <= T:
                    raise ValueError(f"lengths: {n} outside [0, {T}]")
            self._check_capacity(slots, host_lengths)
            lengths_t = long_tensor_on(host_lengths, self.device)
        else:
            if tuple(lengths.shape) != (len(slots),):
                raise ValueError(f"lengths: expected {len(slots)} entries, got shape {tuple(lengths.shape)}")
            lengths_t = lengths.to(torch.long)
        for layer in tap_layers:
            if not -1 <= layer <= self.num_layers:
                raise ValueError(f"tap_layers: {layer} outside [-1, {self.num_layers}]")
        if tokens.device.type == "cpu" and host_lengths is not None:
            self._check_tokens(tokens, host_lengths)
        tokens = tokens.to(self.device, torch.long, non_blocking=True)
        state = DecodeState(
            kda=self._kda_pools,
            mla=self._mla_pools,
            slots=index,
            cache_lens=self.lengths.index_select(0, index),
        )
        with one_cpu_thread(self.device):  # per-token ops (numerics.py): see dspark.threads
            logits, taps, records = self.model.forward(tokens, lengths_t, state, tuple(tap_layers))
        self._pending = (slots, records, host_lengths, T)
        return TargetOutput(logits=logits, taps=taps)

    def commit(self, slots, num_tokens) -> None:
        """Keep num_tokens[r] tokens of slots[r]; slots must be among the last verify's (the
        engine commits only the requests that go on; the others keep nothing). num_tokens may
        stay on the device: then it is not read on the host."""
        if self._pending is None:
            raise ValueError("slots: commit without a preceding verify")
        verified, records, lengths, width = self._pending
        if isinstance(verified, torch.Tensor):
            if slots is not verified:
                raise ValueError("slots: after a verify of device slots, commit takes that same tensor")
            self._commit_batch(verified, records, num_tokens.to(torch.long))
            return
        slots = checked_slots(slots, self.max_slots)
        for slot in slots:
            if slot not in verified:
                raise ValueError(f"slots: {slot} was not in the last verify (slots {verified})")
        counts = _host_ints(num_tokens)
        if counts is not None:
            if len(counts) != len(slots):
                raise ValueError(f"num_tokens: expected {len(slots)} entries, got {len(counts)}")
            for slot, n in zip(slots, counts):
                most = lengths[verified.index(slot)] if lengths is not None else width
                if not 0 <= n <= most:
                    raise ValueError(f"num_tokens: {n} for slot {slot} outside [0, {most}]")
        elif tuple(num_tokens.shape) != (len(slots),):
            raise ValueError(f"num_tokens: expected {len(slots)} entries, got shape {tuple(num_tokens.shape)}")
        counts_t = long_tensor_on(counts, self.device) if counts is not None else num_tokens.to(torch.long)
        if slots != verified:  # counts over the whole verified batch: 0 (unchanged) for the others
            rows = long_tensor_on([verified.index(s) for s in slots], self.device)
            counts_t = torch.zeros(len(verified), dtype=torch.long, device=self.device).index_copy_(0, rows, counts_t)
        self._commit_batch(self._slot_index(verified), records, counts_t)

    def _commit_batch(self, index, records, counts: torch.Tensor) -> None:
        """Advance the verified batch (device index) by counts [B] on the device, in place: each
        KDA layer's pool rows index[b] and the committed lengths."""
        if self._kda_pools:  # every KDA layer in one launch
            ops.kda_commit_layers(*self._kda_layer_major, records, counts, slots=index)
        self.lengths.index_add_(0, index, counts)
        self._pending = None

    def prefill(self, slots, prompts: list[torch.Tensor], tap_layers=()) -> TargetOutput:
        slots = checked_slots(slots, self.max_slots)
        if len(prompts) != len(slots):
            raise ValueError(f"prompts: expected {len(slots)}, got {len(prompts)}")
        for r, p in enumerate(prompts):
            if p.dim() != 1 or len(p) == 0:
                raise ValueError(f"prompts: prompt {r} must be a non-empty 1-D tensor, got shape {tuple(p.shape)}")
            if len(p) > self.max_seq_len:
                raise ValueError(f"prompts: prompt {r} has {len(p)} tokens, more than max_seq_len={self.max_seq_len}")
        self.release(slots)
        return prefill_in_chunks(self, slots, prompts, tuple(tap_layers), self.prefill_chunk_tokens)

    def release(self, slots) -> None:
        """Forget the slots' state. MLA rows need no clearing: a row is read only below its
        slot's committed length, and every row there is written before it counts."""
        slots = checked_slots(slots, self.max_slots)
        index = self._slot_index(slots)
        self.kda_state.index_fill_(0, index, 0)
        self.conv_state.index_fill_(0, index, 0)
        self.lengths.index_fill_(0, index, 0)
        if self._pending is not None and (isinstance(self._pending[0], torch.Tensor)
                                          or set(self._pending[0]) & set(slots)):
            self._pending = None


def load_target(preset_or_path, *, max_slots: int, max_seq_len: int, dtype: torch.dtype = torch.bfloat16,
                device="cpu", seed: int = 0, layers: int | None = None, rank: int = 0) -> K3Target:
    """A K3Target from a preset name (random weights from `seed`) or a checkpoint directory
    (config.json + safetensors in the released layout). A rank preset (RANK_PRESETS, "k3-rank")
    builds rank `rank` of its deployment with the busiest rank's routing and the collectives
    omitted (docs/kimi-k3.md §8): a timing target, whose logits are not the model's. `layers`:
    only the first that many layers of a preset."""
    path = Path(str(preset_or_path))
    name = str(preset_or_path)
    if path.is_dir():
        if layers is not None:
            raise ValueError(f"layers={layers!r}: applies to presets, not to the checkpoint directory {name!r}")
        model = K3Model.from_checkpoint(path, dtype=dtype, device=device)
    elif name in PRESETS or name in RANK_PRESETS:
        cfg, world = RANK_PRESETS[name] if name in RANK_PRESETS else (get_preset(name), 1)
        cfg = cfg if layers is None else first_layers(cfg, layers)
        shard = Shard(rank, world)
        model = K3Model.random(cfg, seed=seed, dtype=dtype, device=device, shard=shard,
                               routing="busiest" if world > 1 else "exact")
    else:
        raise ValueError(f"unknown target preset or checkpoint directory {name!r}; "
                         f"known presets: {sorted(PRESETS) + sorted(RANK_PRESETS)}")
    return K3Target(model, max_slots=max_slots, max_seq_len=max_seq_len)
