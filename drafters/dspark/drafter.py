"""`DSparkDrafter`: the DSpark model behind the dspark.protocols.Drafter seam.

Per request slot it keeps a draft context cache holding only context rows: per draft layer the
K/V cache row (`BlockAttention.kv_rows`) of every committed token. Block rows are computed in
`propose` and thrown away, so rejected drafts never enter the cache (spec §11 items 1-2); `commit`
appends the rows of the kept tokens only, and `crop` rolls a slot back to a shorter prefix.

One round (spec §3): block [x0, MASK...] at positions p(x0) + 0..G-1 -> one parallel backbone
pass over the cached context -> U = lm_head(h) -> sequential Markov loop that samples x_k from
the processed softmax of Z_k = U_k + W2^T W1[x_{k-1}] and reads the confidence of slot k from
[h_k ; W1[x_{k-1}]].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.config import SamplingParams
from dspark.protocols import Proposal
from dspark.sampling import SamplingTensors, processed_probs

from .model import DSparkModel


@dataclass
class Draft:
    """Everything one `draft` call produced (Proposal plus the raw confidence logits)."""

    tokens: torch.Tensor  # [B, G]
    probs: torch.Tensor | None  # [B, G, V] processed draft distributions, None for greedy drafting
    confidence_logits: torch.Tensor  # [B, G], before calibration
    confidence: torch.Tensor  # [B, G], calibrated probabilities


class DSparkDrafter:
    """Implements dspark.protocols.Drafter.

    draft_sample_method: "greedy" drafts the argmax of the Markov-corrected logits and returns
    probs=None (one-hot proposals); "probabilistic" samples every request with temperature > 0
    from its processed distribution with the request's generator and returns those
    distributions as q (requests with temperature 0 get argmax drafts and one-hot q).
    """

    def __init__(self, model: DSparkModel, max_slots: int, draft_sample_method: str = "greedy"):
        if draft_sample_method not in ("greedy", "probabilistic"):
            raise ValueError(f"DSparkDrafter.draft_sample_method={draft_sample_method!r}: must be 'greedy' or 'probabilistic'")
        if not isinstance(max_slots, int) or max_slots < 1:
            raise ValueError(f"DSparkDrafter.max_slots={max_slots!r}: must be an integer >= 1")
        self.model = model.eval()
        self.tap_layers: tuple[int, ...] = tuple(self.config.target_layer_ids)
        self.max_slots = max_slots
        self.draft_sample_method = draft_sample_method
        # slot -> per-layer context rows [S, W]; absent = slot not in use
        self._context: dict[int, list[torch.Tensor]] = {}

    @property
    def config(self):
        return self.model.config

    @property
    def device(self) -> torch.device:
        return self.model.context_proj.weight.device

    def _check_slot(self, slot: int, live: bool) -> None:
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot={slot}: outside [0, max_slots={self.max_slots})")
        if live and slot not in self._context:
            raise ValueError(f"slot={slot}: no request in this slot (call start first)")

    def context_length(self, slot: int) -> int:
        self._check_slot(slot, live=True)
        return self._context[slot][0].shape[0]

    # ---- Drafter protocol --------------------------------------------------------------------
    @torch.no_grad()
    def start(self, slot: int, prompt: torch.Tensor, taps: dict[int, torch.Tensor]) -> None:
        self._check_slot(slot, live=False)
        if slot in self._context:
            raise ValueError(f"slot={slot}: already holds a request (release it first)")
        length = prompt.shape[0]
        for layer in self._need(taps):
            if taps[layer].shape[0] != length:
                raise ValueError(f"taps[{layer}]: {taps[layer].shape[0]} rows for a prompt of {length} tokens")
        # The whole prompt is context: the first anchor is the token sampled after it.
        self._context[slot] = self._rows({layer: taps[layer].to(self.device) for layer in self.tap_layers}, 0, length)

    def _rows(self, taps: dict[int, torch.Tensor], start: int, count: int) -> list[torch.Tensor]:
        fused = self.model.fuse_taps(taps)  # [count, d]
        positions = torch.arange(start, start + count, device=self.device)
        return self.model.context_rows(fused, positions)

    @torch.no_grad()
    def propose(
        self,
        slots: list[int],
        anchors: torch.Tensor,
        k: int,
        sampling: list,
        generators: list[torch.Generator],
    ) -> Proposal:
        if not isinstance(k, int) or not 0 <= k <= self.config.block_size:
            # Drafting fewer slots than trained changes the non-causal block (spec §11 item 10):
            # the full block is always drafted and truncated to k.
            raise ValueError(f"k={k!r}: must be an integer in [0, block_size={self.config.block_size}]")
        draft = self.draft(slots, anchors, sampling, generators)
        return Proposal(
            tokens=draft.tokens[:, :k],
            num_drafts=torch.full((len(slots),), k, dtype=torch.long, device=draft.tokens.device),
            probs=draft.probs[:, :k] if draft.probs is not None else None,
            confidence=draft.confidence[:, :k],
        )

    @torch.no_grad()
    def commit(
        self,
        slots: list[int],
        tokens: torch.Tensor,
        num_tokens: torch.Tensor,
        taps: dict[int, torch.Tensor],
    ) -> None:
        """Append the context rows of the kept tokens (anchor + accepted drafts) of each slot."""
        if len(num_tokens) != len(slots):
            raise ValueError(f"num_tokens: {len(num_tokens)} entries for {len(slots)} slots")
        width = tokens.shape[1]
        for i, slot in enumerate(slots):
            self._check_slot(slot, live=True)
            kept = int(num_tokens[i])
            if not 0 <= kept <= width:
                raise ValueError(f"num_tokens[{i}]={kept}: outside [0, {width}]")
            if kept == 0:
                continue
            start = self.context_length(slot)
            new_rows = self._rows({layer: taps[layer][i, :kept].to(self.device) for layer in self._need(taps)}, start, kept)
            self._context[slot] = [torch.cat([old, new]) for old, new in zip(self._context[slot], new_rows)]

    def release(self, slots: list[int]) -> None:
        for slot in slots:
            self._check_slot(slot, live=False)
            self._context.pop(slot, None)

    def crop(self, slot: int, length: int) -> None:
        """Roll a slot's context back to its first `length` tokens."""
        current = self.context_length(slot)
        if not 0 <= length <= current:
            raise ValueError(f"length={length}: outside [0, context length {current}] of slot {slot}")
        self._context[slot] = [rows[:length] for rows in self._context[slot]]

    def _need(self, taps: dict[int, torch.Tensor]) -> tuple[int, ...]:
        missing = [layer for layer in self.tap_layers if layer not in taps]
        if missing:
            raise ValueError(f"taps: missing target layers {missing}; the drafter needs {list(self.tap_layers)}")
        return self.tap_layers

    # ---- drafting ----------------------------------------------------------------------------
    @torch.no_grad()
    def draft(
        self,
        slots: list[int],
        anchors: torch.Tensor,
        sampling: list[SamplingParams],
        generators: list[torch.Generator],
    ) -> Draft:
        """Draft a full block for every slot (spec §3)."""
        if len(anchors) != len(slots) or len(sampling) != len(slots):
            raise ValueError(f"anchors ({len(anchors)}) and sampling ({len(sampling)}) need one entry per slot ({len(slots)})")
        model, device, gamma = self.model, self.device, self.config.block_size
        batch = len(slots)
        lengths = torch.tensor([self.context_length(s) for s in slots], device=device)
        longest = int(lengths.max()) if batch else 0
        # Pad every slot's context to the longest; padding is masked out.
        context_rows = []
        for layer in range(self.config.num_layers):
            rows = [self._context[s][layer] for s in slots]
            padded = rows[0].new_zeros(batch, longest, rows[0].shape[-1])
            for i, r in enumerate(rows):
                padded[i, : r.shape[0]] = r
            context_rows.append(padded)
        visible = (torch.arange(longest, device=device) < lengths[:, None]).unsqueeze(1)  # [B, 1, S]
        anchors = anchors.to(device).long()
        block = model.block_inputs(anchors).unsqueeze(1)  # [B, 1, G]
        positions = (lengths[:, None] + torch.arange(gamma, device=device)).unsqueeze(1)
        hidden = model.backbone(block, positions, context_rows, visible)[:, 0]  # [B, G, d]
        base = model.base_logits(hidden)  # [B, G, V]

        probabilistic = self.draft_sample_method == "probabilistic"
        sampled_rows = [i for i, p in enumerate(sampling) if probabilistic and not p.greedy]
        if probabilistic:
            # The same temperature/top-k/top-p processing the target side uses (dspark.sampling);
            # greedy rows come back one-hot.
            params = SamplingTensors.from_params(sampling, device)

        tokens = torch.empty(batch, gamma, dtype=torch.long, device=device)
        conf_logits = torch.empty(batch, gamma, device=device)
        probs = torch.empty(batch, gamma, base.shape[-1], device=device) if probabilistic else None
        prev = anchors
        for k in range(gamma):  # the sequential stage: one gather + one [r] x [r, V] product per slot
            prev_embedding = model.markov_head.embed_previous(prev)
            logits = base[:, k] + model.markov_head.bias(prev_embedding, hidden[:, k]).float()
            conf_logits[:, k] = model.confidence_head(hidden[:, k], prev_embedding).float()
            tokens[:, k] = logits.argmax(dim=-1)
            if probabilistic:
                probs[:, k] = processed_probs(logits, params)
                for i in sampled_rows:
                    tokens[i, k] = torch.multinomial(probs[i, k], 1, generator=generators[i]).item()
            prev = tokens[:, k]
        return Draft(tokens, probs, conf_logits, model.confidence_probs(conf_logits))


def shared_embeddings(target) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's (embed_tokens [V, d], lm_head [V, d]), through its `embedding_weights()`
    accessor (not yet part of dspark.protocols.Target)."""
    accessor = getattr(target, "embedding_weights", None)
    if accessor is None:
        raise ValueError(f"target {type(target).__name__}: has no embedding_weights() accessor; the DSpark drafter "
                         "shares the target's embedding and lm_head")
    return accessor()


def load_drafter(path, target, *, draft_sample_method: str = "greedy") -> DSparkDrafter:
    """A DSparkDrafter from a checkpoint directory, sharing the target's embedding and lm_head."""
    from .checkpoint import load_checkpoint

    embed, lm_head = shared_embeddings(target)
    model = load_checkpoint(path, embed, lm_head, device=target.device, dtype=embed.dtype)
    c = model.config
    for field, mine, theirs in (("vocab_size", c.vocab_size, target.vocab_size),
                                ("target_hidden_size", c.target_hidden_size, target.hidden_size),
                                ("target_num_layers", c.target_num_layers, target.num_layers)):
        if mine != theirs:
            raise ValueError(f"drafter {path}: DSparkConfig.{field}={mine} does not match the target's {theirs}")
    return DSparkDrafter(model, target.max_slots, draft_sample_method)
