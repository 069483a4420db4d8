"""The engine's request state (docs/architecture.md §5): requests as they enter (validated once,
here), wait for a slot, run, and finish at a stop condition; what each step streams out.
Nothing here touches a model: the step loop (dspark/loop.py) asks this state which requests to
admit and run, and tells it what each step emitted."""
from __future__ import annotations

import numbers
from collections import deque
from dataclasses import dataclass, field

import torch

from .config import SamplingParams
from .sampling import DrawPool


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (EOS or a stop token), "length", or "error"
    error: str | None = None
    num_steps: int = 0
    num_accepted_drafts: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StepOutput:
    """What one engine step produced for one request (for streaming)."""

    request_id: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None


@dataclass
class Request:
    out: RequestOutput
    prompt: torch.Tensor
    params: SamplingParams
    generator: torch.Generator
    uniforms: DrawPool | None = None  # the acceptance's uniforms, drawn from `generator` (made at the first draw)
    slot: int = -1
    num_computed: int = 0  # tokens the target has committed (prompt + kept tokens)


def prompt_tensor(prompt) -> torch.Tensor:
    """A prompt as a 1-D long tensor on the CPU: a list or tuple of ints, or a 1-D integer tensor.
    Anything else (None, text, floats, nested lists) is refused rather than converted."""
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.dtype == torch.bool:
            raise ValueError(f"prompt: a tensor prompt must be 1-D integer token ids, got shape "
                             f"{tuple(prompt.shape)} dtype {prompt.dtype}")
        return prompt.to(device="cpu", dtype=torch.long)
    if not isinstance(prompt, (list, tuple)):
        raise ValueError(f"prompt={prompt!r}: must be a list of integer token ids")
    for i, t in enumerate(prompt):
        if not isinstance(t, numbers.Integral) or isinstance(t, bool):
            raise ValueError(f"prompt[{i}]={t!r}: token ids must be integers (prompt {prompt!r:.80})")
    return torch.tensor(list(prompt), dtype=torch.long)


class Requests:
    """Waiting and running requests, the free slots, and the stop conditions, for a target of
    `max_slots` slots, `max_seq_len` positions and `vocab_size` tokens."""

    def __init__(self, target, eos_token_ids: tuple[int, ...] = ()):
        self.vocab_size, self.max_seq_len = target.vocab_size, target.max_seq_len
        self.device = torch.device(target.device)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots = list(range(target.max_slots - 1, -1, -1))
        self._next_id = 0

    def add(self, prompt, params: SamplingParams | None, seed: int) -> int:
        """Queue a request; raises ValueError naming the bad field. Its generator is seeded with
        params.seed, else with `seed` and the request's id. Returns its id."""
        if params is not None and not isinstance(params, SamplingParams):
            raise ValueError(f"params={params!r}: must be a SamplingParams")
        params = (params or SamplingParams()).validate(self.vocab_size)
        prompt_t = prompt_tensor(prompt)
        if prompt_t.numel() == 0:
            raise ValueError("prompt=[]: a prompt needs at least one token")
        bad = (prompt_t < 0) | (prompt_t >= self.vocab_size)
        if bad.any():
            tok = int(prompt_t[bad][0])
            raise ValueError(f"prompt token id {tok} is outside the vocabulary [0, {self.vocab_size})")
        if prompt_t.numel() > self.max_seq_len:
            raise ValueError(f"prompt length {prompt_t.numel()} exceeds the model context max_seq_len={self.max_seq_len}")
        rid = self._next_id
        self._next_id += 1
        gen = torch.Generator(device=self.device)
        gen.manual_seed(params.seed if params.seed is not None else seed * 1_000_003 + rid)
        self.waiting.append(Request(RequestOutput(rid, prompt_t.tolist()), prompt_t, params, gen))
        return rid

    def submit(self, prompts, params, seed: int) -> list[tuple[int, RequestOutput]]:
        """Queue each prompt (params: one SamplingParams for all, or a list of one per prompt);
        a bad one comes back finished with `error` set instead of raising."""
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts={prompts!r:.80}: must be a list of prompts (each a list of token ids)")
        if not isinstance(params, list):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params has {len(params)} entries for {len(prompts)} prompts")
        submitted = []
        for prompt, p in zip(prompts, params):
            try:
                rid = self.add(prompt, p, seed)
                submitted.append((rid, self.waiting[-1].out))
            except ValueError as e:
                rid = self._next_id
                self._next_id += 1
                # The rejected prompt is echoed only when it is a plain sequence of token ids.
                ok = isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt)
                out = RequestOutput(rid, list(prompt) if ok else [])
                out.finish_reason, out.error = "error", str(e)
                submitted.append((rid, out))
        return submitted

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def next_batch_size(self) -> int:
        """The batch the next step runs: the running requests and those admission will add."""
        return len(self.running) + min(len(self.waiting), len(self.free_slots))

    def admit(self) -> list[Request]:
        """Waiting requests, each given a free slot, for as long as slots are free."""
        new = []
        while self.waiting and self.free_slots:
            r = self.waiting.popleft()
            r.slot = self.free_slots.pop()
            new.append(r)
        return new

    def start(self, r: Request, first: int) -> StepOutput:
        """A prefilled request with its first token (sampled from the prefill)."""
        r.num_computed = len(r.prompt)
        return self._advance(r, [first])

    def record_step(self, r: Request, num_accepted: int, drafts: list[int], next_token: int) -> StepOutput:
        """A verify step of `r` kept its anchor and num_accepted drafts; it emits those drafts and
        the target's next token (up to a stop condition)."""
        r.out.num_steps += 1
        r.out.num_accepted_drafts += num_accepted
        r.num_computed += num_accepted + 1
        return self._advance(r, drafts[:num_accepted] + [next_token])

    def _advance(self, r: Request, tokens: list[int]) -> StepOutput:
        new = self._emit(r, tokens)
        if not r.out.finished and r.num_computed >= self.max_seq_len:
            r.out.finish_reason = "length"  # no position left for the next anchor
        return StepOutput(r.out.request_id, new, r.out.finished, r.out.finish_reason)

    def _emit(self, r: Request, tokens: list[int]) -> list[int]:
        """Append tokens to the output up to a stop condition; returns what was appended."""
        out, p = r.out, r.params
        emitted = []
        for t in tokens:
            out.token_ids.append(t)
            emitted.append(t)
            if (t in self.eos_token_ids and not p.ignore_eos) or t in p.stop_token_ids:
                out.finish_reason = "stop"
                break
            if len(out.token_ids) >= p.max_tokens:
                out.finish_reason = "length"
                break
        return emitted

    def free(self, reqs: list[Request]) -> list[int]:
        """The finished requests' slots, free again; returns them (for the models to release)."""
        slots = [r.slot for r in reqs]
        self.free_slots.extend(slots)
        return slots

    def drafts_allowed(self, reqs: list[Request], k: int, max_speculative_seq_len: int | None) -> list[int]:
        """Drafts each request may verify in a step of k: 0 for requests that opted out or are past
        the sequence-length gate, and never past the context (positions num_computed ..
        num_computed + k must exist)."""
        allowed = []
        for r in reqs:
            kr = k if r.params.speculate else 0
            if max_speculative_seq_len is not None and r.num_computed + 1 > max_speculative_seq_len:
                kr = 0
            allowed.append(max(0, min(kr, self.max_seq_len - r.num_computed - 1)))
        return allowed
