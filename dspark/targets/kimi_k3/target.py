"""K3Target: the Kimi K3 model behind dspark.protocols.Target, with preallocated per-slot state.

State per slot (spec kimi-k3.md §2.1, §3): KDA recurrent state fp32 [slots, n_kda, H, D, D],
KDA conv window [slots, n_kda, 3, W, 3] (the last 3 pre-conv q/k/v inputs, model dtype), MLA
latent cache [slots, n_mla, max_seq_len, R + P] (model dtype) and the committed length.

verify is output-only: KDA layers record (k, u, exp g) per position and commit replays the
accepted ones bitwise (kernels/kda/reference.py); MLA rows of the verified tokens are written
past the committed length and commit only moves the length.
"""
from __future__ import annotations

from pathlib import Path

import torch

from dspark.kernels import ops
from dspark.protocols import TargetOutput
from dspark.threads import one_cpu_thread

from . import weights as layout
from .config import PRESETS, get_preset
from .model import DecodeState, K3Model


class K3Target:
    def __init__(self, model: K3Model, max_slots: int, max_seq_len: int):
        cfg = model.cfg
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
        H, D, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_width
        dev = self.device
        self.kda_state = torch.zeros(max_slots, n_kda, H, D, D, dtype=torch.float32, device=dev)
        self.conv_state = torch.zeros(max_slots, n_kda, 3, W, cfg.kda_conv_size - 1, dtype=model.dtype, device=dev)
        self.mla_cache = torch.zeros(max_slots, n_mla, max_seq_len, cfg.kv_cache_width, dtype=model.dtype, device=dev)
        self.lengths = torch.zeros(max_slots, dtype=torch.long, device=dev)
        self._pending = None  # (slots, KDA records per layer, lengths) of the last verify

    def embedding_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(embed_tokens [V, d], lm_head [V, d]) that a DSpark drafter shares with the target."""
        return self.model.tensors[layout.EMBED], self.model.tensors[layout.LM_HEAD]

    # ------------------------------------------------------------------------ validation
    def _slot_index(self, slots) -> torch.Tensor:
        slots = [int(s) for s in slots]
        if not slots:
            raise ValueError("slots: empty")
        for s in slots:
            if not 0 <= s < self.max_slots:
                raise ValueError(f"slots: {s} outside [0, {self.max_slots})")
        if len(set(slots)) != len(slots):
            raise ValueError(f"slots: duplicate slot in {slots}")
        return torch.tensor(slots, dtype=torch.long, device=self.device)

    def _check_tokens(self, tokens: torch.Tensor, lengths: list[int]) -> None:
        for r, n in enumerate(lengths):
            row = tokens[r, :n]
            bad = (row < 0) | (row >= self.vocab_size)
            if bool(bad.any()):
                j = int(bad.nonzero()[0, 0])
                raise ValueError(f"tokens: id {int(row[j])} at [{r}, {j}] outside [0, {self.vocab_size})")

    # ------------------------------------------------------------------------ protocol
    def verify(self, slots, tokens: torch.Tensor, lengths: torch.Tensor, tap_layers=()) -> TargetOutput:
        index = self._slot_index(slots)
        if tokens.dim() != 2 or tokens.shape[0] != len(index):
            raise ValueError(f"tokens: expected [{len(index)}, T], got {tuple(tokens.shape)}")
        T = tokens.shape[1]
        lengths_list = [int(n) for n in torch.as_tensor(lengths).tolist()]
        if len(lengths_list) != len(index):
            raise ValueError(f"lengths: expected {len(index)} entries, got {len(lengths_list)}")
        for n in lengths_list:
            if not 0 <= n <= T:
                raise ValueError(f"lengths: {n} outside [0, {T}]")
        for layer in tap_layers:
            if not -1 <= layer < self.num_layers:
                raise ValueError(f"tap_layers: {layer} outside [-1, {self.num_layers})")
        tokens = tokens.to(self.device, torch.long)
        self._check_tokens(tokens, lengths_list)
        cache_lens = self.lengths[index]
        for r, n in enumerate(lengths_list):
            if int(cache_lens[r]) + n > self.max_seq_len:
                raise ValueError(f"verify past max_seq_len={self.max_seq_len}: slot {int(index[r])} has "
                                 f"{int(cache_lens[r])} tokens and {n} more were fed")
        lengths_t = torch.tensor(lengths_list, dtype=torch.long, device=self.device)
        state = DecodeState(
            kda=[(self.kda_state[index, k], self.conv_state[index, k]) for k in range(self.kda_state.shape[1])],
            mla=[self.mla_cache[:, k] for k in range(self.mla_cache.shape[1])],
            slots=index,
            cache_lens=cache_lens,
        )
        with one_cpu_thread(self.device):  # per-token ops (numerics.py): see dspark.threads
            logits, taps, records = self.model.forward(tokens, lengths_t, state, tuple(tap_layers))
        self._pending = (index.tolist(), records, lengths_list)
        return TargetOutput(logits=logits, taps=taps)

    def commit(self, slots, num_tokens: torch.Tensor) -> None:
        """Keep num_tokens[r] tokens of slots[r]; slots must be among the last verify's (the
        engine commits only the requests that go on; the others keep nothing)."""
        index = self._slot_index(slots)
        if self._pending is None:
            raise ValueError("slots: commit without a preceding verify")
        verified, records, lengths = self._pending
        counts = [int(n) for n in torch.as_tensor(num_tokens).tolist()]
        if len(counts) != len(index):
            raise ValueError(f"num_tokens: expected {len(index)} entries, got {len(counts)}")
        # Counts over the whole verified batch, 0 (unchanged) for slots not committed now.
        batch_counts = [0] * len(verified)
        for slot, n in zip(index.tolist(), counts):
            if slot not in verified:
                raise ValueError(f"slots: {slot} was not in the last verify (slots {verified})")
            r = verified.index(slot)
            if not 0 <= n <= lengths[r]:
                raise ValueError(f"num_tokens: {n} for slot {slot} outside [0, {lengths[r]}]")
            batch_counts[r] = n
        batch_index = torch.tensor(verified, dtype=torch.long, device=self.device)
        counts_t = torch.tensor(batch_counts, dtype=torch.long, device=self.device)
        for k, rec in enumerate(records):
            state, conv = self.kda_state[batch_index, k], self.conv_state[batch_index, k]
            ops.kda_commit(state, conv, rec, counts_t)
            self.kda_state[batch_index, k] = state
            self.conv_state[batch_index, k] = conv
        self.lengths[batch_index] += counts_t
        self._pending = None

    def prefill(self, slots, prompts: list[torch.Tensor], tap_layers=()) -> TargetOutput:
        index = self._slot_index(slots)
        if len(prompts) != len(index):
            raise ValueError(f"prompts: expected {len(index)}, got {len(prompts)}")
        for r, p in enumerate(prompts):
            if p.dim() != 1 or len(p) == 0:
                raise ValueError(f"prompts: prompt {r} must be a non-empty 1-D tensor, got shape {tuple(p.shape)}")
            if len(p) > self.max_seq_len:
                raise ValueError(f"prompts: prompt {r} has {len(p)} tokens, more than max_seq_len={self.max_seq_len}")
        self.release(index.tolist())
        longest = max(len(p) for p in prompts)
        tokens = torch.zeros(len(prompts), longest, dtype=torch.long, device=self.device)
        for r, p in enumerate(prompts):
            tokens[r, : len(p)] = p.to(self.device)
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        out = self.verify(index.tolist(), tokens, lengths, tap_layers)
        self.commit(index.tolist(), lengths)
        return out

    def release(self, slots) -> None:
        index = self._slot_index(slots)
        self.kda_state[index] = 0
        self.conv_state[index] = 0
        self.mla_cache[index] = 0
        self.lengths[index] = 0
        if self._pending is not None and set(self._pending[0]) & set(index.tolist()):
            self._pending = None


def load_target(preset_or_path, *, max_slots: int, max_seq_len: int, dtype: torch.dtype = torch.bfloat16,
                device="cpu", seed: int = 0) -> K3Target:
    """A K3Target from a preset name (random weights from `seed`) or a checkpoint directory
    (config.json + safetensors in the released layout)."""
    path = Path(str(preset_or_path))
    if path.is_dir():
        model = K3Model.from_checkpoint(path, dtype=dtype, device=device)
    elif str(preset_or_path) in PRESETS:
        model = K3Model.random(get_preset(str(preset_or_path)), seed=seed, dtype=dtype, device=device)
    else:
        raise ValueError(f"unknown target preset or checkpoint directory {str(preset_or_path)!r}; "
                         f"known presets: {sorted(PRESETS)}")
    return K3Target(model, max_slots=max_slots, max_seq_len=max_seq_len)
