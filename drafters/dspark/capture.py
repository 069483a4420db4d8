"""What training reads of the target: its tapped hidden states and its distribution per position.

`capture` runs a batch through the target (online capture, one verify per step on free slots; for
a trainer that never reads the target's logits, the target's stateless causal forward where it
has one: `causal_taps`, no cache, no logits). `CaptureStore`
runs every training sequence through it once and keeps the result on the device, as DeepSpec's
offline target cache does (docs/dspark-algorithm.md §6.1): the drafter's taps and, for the
teacher, the LM head's input (TargetOutput's tap num_layers; the teacher's softmax then comes
from the frozen LM head per step, for the batch's positions only: loss.teacher_probs). Full
[S, V] logits per position would not fit (SmolLM2: 288 GB for 10.7k sequences); the hidden
states in bf16 take ~7 kB per token.

A store may hold only the sequences that fit a byte budget (the first ones in index order); the
others are captured online whenever a batch draws them, rounded to the store's dtype, so every
budget gives the same batches the same values.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from dspark.files import atomic_path, write_atomic
from dspark.transfer import long_tensor_on, tensor_on


@torch.no_grad()
def capture(target, sequences: list[torch.Tensor], tap_layers: tuple[int, ...], logits: bool = True):
    """Online capture of the target's logits [B, S, V] at every position (None with logits=False)
    and taps {layer: [B, S, d]}, in chunks of at most max_slots sequences, padded to the longest.
    Prefill returns only the last position's logits, so each chunk is a verify on free slots (an
    empty prefix, nothing committed), which returns every position's. Without logits, a target's
    causal_taps serves where it has one: a stateless forward, no cache and no logits."""
    taps_only = not logits and hasattr(type(target), "causal_taps")
    kept_logits, taps = [], {layer: [] for layer in tap_layers}
    width = max(s.shape[0] for s in sequences)
    widen = lambda t: F.pad(t, (0, 0, 0, width - t.shape[1]))  # noqa: E731
    for start in range(0, len(sequences), target.max_slots):
        chunk = sequences[start : start + target.max_slots]
        if taps_only:
            chunk_taps = target.causal_taps(chunk, tap_layers)
        else:
            slots = list(range(len(chunk)))
            lengths = [s.shape[0] for s in chunk]
            tokens = tensor_on(torch.stack([F.pad(s, (0, max(lengths) - s.shape[0])) for s in chunk]), target.device)
            target.release(slots)
            try:
                out = target.verify(slots, tokens, lengths, tap_layers)
            finally:
                target.release(slots)
            chunk_taps = out.taps
            if logits:
                kept_logits.append(widen(out.logits))
        for layer in tap_layers:
            taps[layer].append(widen(chunk_taps[layer]))
    return (torch.cat(kept_logits) if logits else None), {layer: torch.cat(t) for layer, t in taps.items()}


@dataclass
class BatchCapture:
    """A batch's view of the target [B, S, ...]: taps {layer: [B, S, d]} (the LM head's input under
    layer num_layers when kept) and the logits [B, S, V] (None when the teacher comes from the LM
    head). `stacked` = (layers, [B, S, len(layers), d]) when the taps are slices of one tensor."""

    taps: dict[int, torch.Tensor]
    logits: torch.Tensor | None
    stacked: tuple[tuple[int, ...], torch.Tensor] | None = None

    def to(self, device) -> "BatchCapture":
        """On `device` (a CPU target's capture for a drafter training on the GPU)."""
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        if all(t.device == torch.device(device) for t in self.taps.values()):
            return self
        stacked = None if self.stacked is None else (self.stacked[0], move(self.stacked[1]))
        return BatchCapture({k: move(t) for k, t in self.taps.items()}, move(self.logits), stacked)

    @classmethod
    def of(cls, captured) -> "BatchCapture":
        """A BatchCapture as it is, or one of capture()'s (logits, taps)."""
        return captured if isinstance(captured, BatchCapture) else cls(taps=captured[1], logits=captured[0])

    def features(self, layers: tuple[int, ...]) -> torch.Tensor:
        """The taps of `layers` concatenated in that order, [B, S, len(layers) * d] (a view when
        they lead the stacked tensor)."""
        if self.stacked is not None and self.stacked[0][: len(layers)] == tuple(layers):
            return self.stacked[1][:, :, : len(layers)].flatten(-2)
        missing = [layer for layer in layers if layer not in self.taps]
        if missing:
            raise ValueError(f"taps: missing target layers {missing}; the drafter needs {list(layers)}")
        return torch.cat([self.taps[layer] for layer in layers], dim=-1)


def _digest(parts) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else json.dumps(part).encode())
    return h.hexdigest()


class CaptureStore:
    """The target's `layers` (and, with logits=True, its logits) for every sequence that fits
    budget_bytes, computed once (`fill`) and kept on the target's device in `dtype`.

    Rows are stored flat, [tokens, len(layers), d], with one zero row past the end for padding;
    `batch` gathers a batch's rows in one indexing op.
    """

    def __init__(self, target, sequences: list[torch.Tensor], layers: tuple[int, ...], *, logits: bool = False,
                 dtype: torch.dtype = torch.bfloat16, budget_bytes: int | None = None, fingerprint: str = ""):
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"budget_bytes={budget_bytes!r}: must be >= 0 (None = every sequence)")
        self.target, self.sequences, self.layers, self.dtype = target, sequences, tuple(layers), dtype
        self.keeps_logits = logits
        itemsize = torch.empty(0, dtype=dtype).element_size()
        self.row_bytes = itemsize * (len(layers) * target.hidden_size + (target.vocab_size if logits else 0))
        lengths = [int(s.shape[0]) for s in sequences]
        self.total_bytes = sum(lengths) * self.row_bytes
        ends = np.cumsum(lengths) * self.row_bytes
        self.cached = len(lengths) if budget_bytes is None else int(np.searchsorted(ends, budget_bytes, side="right"))
        self.offsets = [0] + np.cumsum(lengths[: self.cached]).tolist()
        rows = self.offsets[-1]
        device = target.device
        self.taps = torch.zeros(rows + 1, len(layers), target.hidden_size, dtype=dtype, device=device)
        self.logits = torch.zeros(rows + 1, target.vocab_size, dtype=dtype, device=device) if logits else None
        self.filled = False
        self.key = _digest([list(self.layers), str(dtype), logits, fingerprint,
                            [target.vocab_size, target.hidden_size, target.num_layers]]
                           + [s.to(torch.int64).numpy().tobytes() for s in sequences[: self.cached]])

    @staticmethod
    def describe_bytes(count: int) -> str:
        return f"{count / 2**30:.1f} GiB"

    def summary(self) -> dict:
        """What the store keeps, for the log and the results (printed before any work)."""
        return {"sequences": len(self.sequences), "cached_sequences": self.cached, "layers": list(self.layers),
                "dtype": str(self.dtype).removeprefix("torch."), "bytes_all": self.total_bytes,
                "bytes_cached": self.offsets[-1] * self.row_bytes, "device": str(self.target.device)}

    @torch.no_grad()
    def fill(self, progress: bool = True) -> None:
        """Capture every cached sequence, target.max_slots at a time."""
        step = self.target.max_slots
        for start in tqdm(range(0, self.cached, step), desc="capture", disable=not progress):
            chunk = self.sequences[start : min(start + step, self.cached)]
            logits, taps = capture(self.target, chunk, self.layers, logits=self.keeps_logits)
            for i, s in enumerate(chunk):
                rows = slice(self.offsets[start + i], self.offsets[start + i + 1])
                n = s.shape[0]
                self.taps[rows] = torch.stack([taps[layer][i, :n] for layer in self.layers], dim=1).to(self.dtype)
                if self.logits is not None:
                    self.logits[rows] = logits[i, :n].to(self.dtype)
        self.filled = True

    def batch(self, pick: list[int], width: int | None = None) -> BatchCapture:
        """The capture of sequences[pick], padded with zeros to `width` (default: the longest);
        sequences past the budget are captured now."""
        if not self.filled:
            raise ValueError("CaptureStore.batch: fill() (or load()) the store first")
        lengths = [int(self.sequences[i].shape[0]) for i in pick]
        width = width or max(lengths)
        if width < max(lengths):
            raise ValueError(f"width={width}: shorter than the longest picked sequence ({max(lengths)})")
        pad_row = self.offsets[-1]
        index = torch.full((len(pick), width), pad_row, dtype=torch.long)
        for row, (i, n) in enumerate(zip(pick, lengths)):
            if i < self.cached:
                index[row, :n] = torch.arange(self.offsets[i], self.offsets[i] + n)
        index = tensor_on(index, self.taps.device)
        stacked = self.taps[index]  # [B, width, layers, d]
        logits = self.logits[index] if self.logits is not None else None
        online = [row for row, i in enumerate(pick) if i >= self.cached]
        if online:
            online_logits, online_taps = capture(self.target, [self.sequences[pick[row]] for row in online],
                                                 self.layers, logits=self.keeps_logits)
            # One copy for all online rows: past each row's length both sides are zero (the store's pad
            # row; capture's padding).
            rows = long_tensor_on(online, stacked.device)
            width_online = online_taps[self.layers[0]].shape[1]
            stacked[rows, :width_online] = torch.stack([online_taps[layer] for layer in self.layers], dim=2).to(self.dtype)
            if logits is not None:
                logits[rows, :width_online] = online_logits.to(self.dtype)
        taps = {layer: stacked[:, :, k] for k, layer in enumerate(self.layers)}
        return BatchCapture(taps=taps, logits=logits, stacked=(self.layers, stacked))

    # ---- a file beside the run, so later calls on the same machine load instead of capturing ----
    def save(self, path: str | Path, chunk_rows: int = 1 << 16) -> None:
        """The cached rows as raw bytes at `path` and their description at path + '.json' (written
        last: a file without it is incomplete and never loaded)."""
        path = Path(path)
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            for tensor in (self.taps, self.logits):
                if tensor is None:
                    continue
                for start in range(0, tensor.shape[0] - 1, chunk_rows):
                    part = tensor[start : min(start + chunk_rows, tensor.shape[0] - 1)]
                    f.write(part.contiguous().view(torch.uint8).cpu().numpy().tobytes())
        write_atomic(path.with_name(path.name + ".json"), json.dumps({"key": self.key, **self.summary()}) + "\n")

    def load(self, path: str | Path, chunk_rows: int = 1 << 16) -> bool:
        """Fill from a file `save` wrote for the same sequences, layers, dtype and target
        (fingerprint); False (nothing loaded) when there is none or it was written for others."""
        path = Path(path)
        meta_path = path.with_name(path.name + ".json")
        if not (path.is_file() and meta_path.is_file()) or json.loads(meta_path.read_text()).get("key") != self.key:
            return False
        with open(path, "rb") as f:
            for tensor in (self.taps, self.logits):
                if tensor is None:
                    continue
                row_bytes = math.prod(tensor.shape[1:]) * tensor.element_size()
                for start in range(0, tensor.shape[0] - 1, chunk_rows):
                    stop = min(start + chunk_rows, tensor.shape[0] - 1)
                    raw = np.frombuffer(f.read((stop - start) * row_bytes), dtype=np.uint8)
                    if raw.size != (stop - start) * row_bytes:
                        return False  # truncated: capture again
                    tensor[start:stop] = torch.from_numpy(raw.copy()).view(tensor.dtype).view(stop - start, *tensor.shape[1:])
                tensor[-1] = 0  # the padding row
        self.filled = True
        return True
