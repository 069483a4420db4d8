"""`DSparkDrafter`: the DSpark model behind the dspark.protocols.Drafter seam.

Per request slot it keeps a draft context cache holding only context rows: per draft layer the
K/V cache row (`BlockAttention.kv_rows`) of every committed token. Block rows are computed in
`propose` and thrown away, so rejected drafts never enter the cache (docs/dspark-algorithm.md §11 items 1-2); `commit`
writes the rows of the kept tokens only, and `crop` rolls a slot back to a shorter prefix.

One round (docs/dspark-algorithm.md §3): block [x0, MASK...] at positions p(x0) + 0..G-1 -> one parallel backbone
pass over the cached context -> U = lm_head(h) -> sequential Markov loop that samples x_k from
the processed softmax of Z_k = U_k + W2^T W1[x_{k-1}] and reads the confidence of slot k from
[h_k ; W1[x_{k-1}]].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.config import SamplingParams
from dspark.cuda_graphs import checked_buckets
from dspark.kernels import ops
from dspark.protocols import Drafter, Proposal
from dspark.sampling import SamplingTensors, processed_probs
from dspark.transfer import LongStaging

from .graphs import DraftGraphs
from .model import CachedContext, DraftConstants, DSparkModel


@dataclass
class Draft:
    """Everything one `draft` call produced (Proposal plus the raw confidence logits)."""

    tokens: torch.Tensor  # [B, G]
    probs: torch.Tensor | None  # [B, G, V] processed draft distributions, None for greedy drafting
    confidence_logits: torch.Tensor  # [B, G], before calibration
    confidence: torch.Tensor  # [B, G], calibrated probabilities


class DSparkDrafter(Drafter):
    """The DSpark drafter behind dspark.protocols.Drafter. With CUDA graphs it commits on the
    device (commits_on_device: reserve, commit_on_device inside the engine's step, settle).

    draft_sample_method: "greedy" drafts the argmax of the Markov-corrected logits and returns
    probs=None (one-hot proposals); "probabilistic" samples every request with temperature > 0
    from its processed distribution with the request's generator and returns those
    distributions as q (requests with temperature 0 get argmax drafts and one-hot q).
    The context cache is preallocated: per layer [max_slots, max_seq_len, W] in the model's
    dtype (W = 576 for the K3 drafter), like the target's MLA cache. graph_buckets: the batch sizes
    draft and commit graphs are captured for (default dspark.cuda_graphs.BUCKETS), as the engine's.
    """

    def __init__(self, model: DSparkModel, max_slots: int, *, max_seq_len: int, draft_sample_method: str = "greedy",
                 cuda_graphs: bool = False, graph_buckets: tuple[int, ...] | None = None):
        if draft_sample_method not in ("greedy", "probabilistic"):
            raise ValueError(f"DSparkDrafter.draft_sample_method={draft_sample_method!r}: must be 'greedy' or 'probabilistic'")
        if not isinstance(max_slots, int) or max_slots < 1:
            raise ValueError(f"DSparkDrafter.max_slots={max_slots!r}: must be an integer >= 1")
        if not isinstance(max_seq_len, int) or max_seq_len < 1:
            raise ValueError(f"DSparkDrafter.max_seq_len={max_seq_len!r}: must be an integer >= 1")
        self.model = model.eval()
        self.tap_layers: tuple[int, ...] = tuple(self.config.target_layer_ids)
        self.max_slots, self.max_seq_len = max_slots, max_seq_len
        self.draft_sample_method = draft_sample_method
        if cuda_graphs:
            if self.device.type != "cuda":
                raise ValueError(f"DSparkDrafter.cuda_graphs=True: the model is on {self.device}; CUDA graphs need a CUDA device")
            if draft_sample_method != "greedy":
                raise ValueError(f"DSparkDrafter.cuda_graphs=True with draft_sample_method={draft_sample_method!r}: "
                                 "only greedy drafting is graphed (probabilistic drafting samples with each request's "
                                 "own generator)")
        dtype = model.context_proj.weight.dtype
        # Every cache has one scratch row past max_seq_len: the device-side commit (_commit_rows)
        # writes all T verified rows of a request and sends the ones it does not keep there; and
        # G - 1 more, where a draft of a full context writes its block's rows (CachedContext).
        self._cache = [torch.zeros(max_slots, max_seq_len + self.config.block_size, layer.self_attn.row_width,
                                   dtype=dtype, device=self.device)
                       for layer in model.layers]
        # The lengths on the host (checks, context buckets) and on the device (what a draft reads
        # and a device-side commit advances), kept equal.
        self._lengths = [0] * max_slots
        self._lengths_device = torch.zeros(max_slots, dtype=torch.long, device=self.device)
        self._live: set[int] = set()
        # The slot indices of a draft or a commit go up through one pinned buffer, not a new
        # pinned tensor per call (dspark/transfer.py).
        self._staging = LongStaging(max_slots, self.device)
        # what every draft reads and none writes, made here: a draft graph never captures its making
        self._constants = DraftConstants(model, max_seq_len + self.config.block_size, max_slots, self.device)
        buckets = checked_buckets("DSparkDrafter.graph_buckets", graph_buckets)
        self._graphs = DraftGraphs(self, buckets) if cuda_graphs else None

    @property
    def config(self):
        return self.model.config

    @property
    def device(self) -> torch.device:
        return self.model.context_proj.weight.device

    def _check_slot(self, slot: int, live: bool) -> None:
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot={slot}: outside [0, max_slots={self.max_slots})")
        if live and slot not in self._live:
            raise ValueError(f"slot={slot}: no request in this slot (call start first)")

    def context_length(self, slot: int) -> int:
        self._check_slot(slot, live=True)
        return self._lengths[slot]

    def context_rows(self, slot: int) -> list[torch.Tensor]:
        """The cached context rows of a slot, per layer [S, W]."""
        length = self.context_length(slot)
        return [cache[slot, :length] for cache in self._cache]

    def _need(self, taps: dict[int, torch.Tensor]) -> tuple[int, ...]:
        missing = [layer for layer in self.tap_layers if layer not in taps]
        if missing:
            raise ValueError(f"taps: missing target layers {missing}; the drafter needs {list(self.tap_layers)}")
        return self.tap_layers

    def _set_length(self, slot: int, length: int) -> None:
        self._lengths[slot] = length
        self._lengths_device[slot] = length  # a fill kernel: no synchronisation

    def _check_room(self, slot: int, length: int) -> None:
        if length > self.max_seq_len:
            raise ValueError(f"slot={slot}: context of {length} tokens exceeds max_seq_len={self.max_seq_len}")

    # ---- Drafter protocol --------------------------------------------------------------------
    @torch.no_grad()
    def start(self, slot: int, prompt: torch.Tensor, taps: dict[int, torch.Tensor]) -> None:
        self._check_slot(slot, live=False)
        if slot in self._live:
            raise ValueError(f"slot={slot}: already holds a request (release it first)")
        length = prompt.shape[0]
        self._check_room(slot, length)
        for layer in self._need(taps):
            if taps[layer].shape[0] != length:
                raise ValueError(f"taps[{layer}]: {taps[layer].shape[0]} rows for a prompt of {length} tokens")
        # The whole prompt is context: the first anchor is the token sampled after it.
        fused = self.model.fuse_taps({layer: taps[layer].to(self.device) for layer in self.tap_layers})
        rows = self.model.context_rows(fused, torch.arange(length, device=self.device))
        for cache, r in zip(self._cache, rows):
            cache[slot, :length] = r
        self._set_length(slot, length)
        self._live.add(slot)

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
            # Drafting fewer slots than trained changes the non-causal block (docs/dspark-algorithm.md §11 item 10):
            # the full block is always drafted and truncated to k.
            raise ValueError(f"k={k!r}: must be an integer in [0, block_size={self.config.block_size}]")
        draft = self.draft(slots, anchors, sampling, generators)
        return Proposal(
            tokens=draft.tokens[:, :k],
            num_drafts=None,  # every request drafts k
            probs=draft.probs[:, :k] if draft.probs is not None else None,
            confidence=draft.confidence[:, :k],
            confidence_logits=draft.confidence_logits[:, :k],
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
        kept = [int(n) for n in num_tokens.tolist()]
        for i, slot in enumerate(slots):
            self._check_slot(slot, live=True)
            if not 0 <= kept[i] <= width:
                raise ValueError(f"num_tokens[{i}]={kept[i]}: outside [0, {width}]")
            self._check_room(slot, self._lengths[slot] + kept[i])
        if not any(kept):
            return
        self._write_rows(slots, num_tokens, taps)
        for slot, n in zip(slots, kept):
            self._lengths[slot] += n

    @property
    def commits_on_device(self) -> bool:
        """With graphs the engine's step commits this drafter on the device (dspark.protocols.Drafter):
        nothing the next draft needs then waits for the host, so steps are launched ahead."""
        return self._graphs is not None

    def reserve(self, slots: list[int], width: int) -> None:
        """Before a step that commits up to `width` tokens of each slot on the device: each slot's
        host length grows by width, an upper bound (what context buckets and room checks read)
        until settle() gives the kept count."""
        for slot in slots:
            self._check_slot(slot, live=True)
            self._check_room(slot, self._lengths[slot] + width)
        for slot in slots:
            self._lengths[slot] += width

    @torch.no_grad()
    def commit_on_device(self, index: torch.Tensor, tokens: torch.Tensor, num_tokens: torch.Tensor,
                         taps: dict[int, torch.Tensor]) -> None:
        """commit as device work alone, inside the engine's step (and its CUDA graph): the rows of
        every verified token are written, those past a slot's kept count to the scratch row, and
        the device lengths advance by the kept counts (0: nothing changes)."""
        self._commit_rows(index, num_tokens, {layer: taps[layer].to(self.device) for layer in self._need(taps)})

    def settle(self, slots: list[int], kept: list[int], width: int) -> None:
        """The kept counts of a device commit of this width, read back by the host."""
        for slot, n in zip(slots, kept):
            if not 0 <= n <= width:
                raise ValueError(f"kept={n} for slot {slot}: outside [0, {width}]")
            self._lengths[slot] += n - width

    def _write_rows(self, slots: list[int], num_tokens: torch.Tensor, taps: dict[int, torch.Tensor]) -> None:
        """Queue a commit's rows and device lengths (the host's lengths are the caller's): a
        commit graph where a bucket holds the batch, else _commit_rows launched eagerly."""
        if len(set(slots)) != len(slots):
            raise ValueError(f"slots={slots}: a slot appears twice; a commit advances each once")
        taps = {layer: taps[layer].to(self.device) for layer in self._need(taps)}
        if self._graphs is None or not self._graphs.commit(slots, num_tokens, taps):
            self._commit_rows(self._staging.upload(slots), num_tokens.to(self.device), taps)

    def _commit_rows(self, index: torch.Tensor, kept: torch.Tensor, taps: dict[int, torch.Tensor]) -> None:
        """commit on the device alone (what a commit graph captures, and the engine's step through
        commit_on_device): slots index [B], kept counts [B], taps {layer: [B, T, d]}. Every
        verified row is computed, as in commit; the rows past a request's kept count go to the
        scratch row (max_seq_len), and its device length advances by its count. Distinct slots
        among rows that keep tokens (rows of one slot would race; rows kept 0 times write only the
        scratch row and their length unchanged). The host's lengths are the caller's to advance."""
        model, T = self.model, next(iter(taps.values())).shape[1]
        steps = torch.arange(T, device=self.device)
        starts = self._lengths_device.index_select(0, index)
        positions = starts[:, None] + steps
        rows = model.context_rows(model.fuse_taps(taps), positions)
        where = torch.where(steps < kept[:, None], positions, self.max_seq_len)
        slots = index[:, None].expand(-1, T)
        for cache, r in zip(self._cache, rows):
            cache.index_put_((slots, where), r.to(cache.dtype))
        self._lengths_device.index_copy_(0, index, starts + kept)

    def release(self, slots: list[int]) -> None:
        for slot in slots:
            self._check_slot(slot, live=False)
            self._live.discard(slot)
            self._set_length(slot, 0)

    def crop(self, slot: int, length: int) -> None:
        """Roll a slot's context back to its first `length` tokens."""
        current = self.context_length(slot)
        if not 0 <= length <= current:
            raise ValueError(f"length={length}: outside [0, context length {current}] of slot {slot}")
        self._set_length(slot, length)

    # ---- drafting ----------------------------------------------------------------------------
    @torch.no_grad()
    def draft(
        self,
        slots: list[int],
        anchors: torch.Tensor,
        sampling: list[SamplingParams],
        generators: list[torch.Generator],
    ) -> Draft:
        """Draft a full block for every slot (docs/dspark-algorithm.md §3)."""
        if len(anchors) != len(slots) or len(sampling) != len(slots):
            raise ValueError(f"anchors ({len(anchors)}) and sampling ({len(sampling)}) need one entry per slot ({len(slots)})")
        for s in slots:
            self._check_slot(s, live=True)
        if self._graphs is not None:
            graphed = self._graphs.draft(slots, anchors)
            if graphed is not None:
                return graphed
        device = self.device
        # The longest context from the host's lengths: reading it off the device would synchronise.
        longest = max((self._lengths[s] for s in slots), default=0)
        index = self._staging.upload(slots)
        probabilistic = self.draft_sample_method == "probabilistic"
        return self._draft_rows(index, anchors.to(device).long(), longest, sampling if probabilistic else None,
                                generators)

    def _draft_rows(self, index: torch.Tensor, anchors: torch.Tensor, context: int,
                    sampling: list[SamplingParams] | None = None, generators: list[torch.Generator] = ()) -> Draft:
        """The block of every row: slots index [B], anchors [B], reading the first `context`
        cache rows (>= every row's length); sampling given: probabilistic drafting, else greedy.
        With greedy drafting every op stays on the device (what a draft graph captures)."""
        model, device, gamma = self.model, self.device, self.config.block_size
        batch = index.shape[0]
        lengths = self._lengths_device.index_select(0, index)
        # Each layer's pool as it is: an MLA layer attends over it in place, others gather the
        # first `context` rows (rows past a length are masked out).
        context_rows = [CachedContext(cache, index, lengths, context) for cache in self._cache]
        hidden = model.draft_backbone(anchors, context_rows, self._constants, lengths, context)  # [B, G, d]
        probabilistic = sampling is not None
        greedy_op = not probabilistic and model.markov_head.kind == "vanilla"
        base = model.base_logits(hidden, widen=not greedy_op)  # [B, G, V]; the op widens as it reads

        sampled_rows = [i for i, p in enumerate(sampling) if not p.greedy] if probabilistic else []
        if probabilistic:
            # The same temperature/top-k/top-p processing the target side uses (dspark.sampling);
            # greedy rows come back one-hot.
            params = SamplingTensors.from_params(sampling, device)

        if greedy_op:
            # The sequential stage as one op (G + 1 launches on CUDA where the loop below is ~6 per
            # slot); the confidence of every slot then in one more, over [h_k ; W1[x_{k-1}]] (six torch
            # launches on CUDA: docs/kernels.md §10.12).
            w1 = model.markov_head.markov_w1.weight
            tokens = ops.markov_greedy_draft(base, anchors, w1, model.markov_head.markov_w2.weight)
            head = model.confidence_head
            conf_logits, confidence = ops.draft_confidence(
                hidden, anchors, tokens, w1 if head.with_markov else None, head.proj.weight[0], head.proj.bias,
                model.confidence_temperatures(gamma, device))
            return Draft(tokens, None, conf_logits, confidence)
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
                    tokens[i, k] = torch.multinomial(probs[i, k], 1, generator=generators[i])[0]
            prev = tokens[:, k]
        return Draft(tokens, probs, conf_logits, model.confidence_probs(conf_logits))


def shared_embeddings(target) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's (embed_tokens [V, d], lm_head [V, d]) through its `embedding_weights()`
    accessor (K3Target and LlamaTarget have one; dspark.protocols.Target does not list it yet)."""
    accessor = getattr(target, "embedding_weights", None)
    if accessor is None:
        raise ValueError(f"target {type(target).__name__}: has no embedding_weights() accessor; the DSpark drafter "
                         "shares the target's embedding and lm_head")
    return accessor()


def load_drafter(path, target, *, draft_sample_method: str = "greedy", cuda_graphs: bool = False) -> DSparkDrafter:
    """A DSparkDrafter from a checkpoint directory, sharing the target's embedding and lm_head
    (cuda_graphs: its greedy drafts and commits replay CUDA graphs, drafters/dspark/graphs.py). On a
    GPU the model's projection pairs are laid out as one weight each (DSparkModel.pair_projections)."""
    from .checkpoint import load_checkpoint

    embed, lm_head = shared_embeddings(target)
    model = load_checkpoint(path, embed, lm_head, device=target.device, dtype=embed.dtype)
    c = model.config
    for field, mine, theirs in (("vocab_size", c.vocab_size, target.vocab_size),
                                ("target_hidden_size", c.target_hidden_size, target.hidden_size),
                                ("target_num_layers", c.target_num_layers, target.num_layers)):
        if mine != theirs:
            raise ValueError(f"drafter {path}: DSparkConfig.{field}={mine} does not match the target's {theirs}")
    if model.context_proj.weight.is_cuda:  # where launches cost: each projection pair as one GEMM
        model.pair_projections()
    return DSparkDrafter(model, target.max_slots, max_seq_len=target.max_seq_len, draft_sample_method=draft_sample_method,
                         cuda_graphs=cuda_graphs)
