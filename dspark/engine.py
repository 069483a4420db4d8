"""The draft-and-verify loop (docs/architecture.md):

    drafter.propose -> policy.verify_lengths -> target.verify -> sampler -> target/drafter.commit

Plain decoding is the same loop with k = 0 (no drafts, one verified token per step), so the
baseline and the speculative path share every line that touches the model and a greedy
comparison between them is meaningful.

Token flow of one request: prefill(prompt) gives the first output token x0, which the target has
not yet seen (the "anchor"). Each step verifies [x0, d1..dl]; with a drafts accepted the step
emits d1..da plus one token from the target (the correction at the first rejection or the bonus
after the last draft), keeps a + 1 tokens (x0, d1..da) in the target's state, and the emitted
last token becomes the next anchor. A step emits a + 1 tokens: vLLM's acceptance length.

This is the one decoding loop: calibration and self-distillation (drafters/dspark) run on it and
read what each step did through observers (`add_observer`, `StepRecord`).
"""
from __future__ import annotations

import dataclasses
import numbers
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from .config import SamplingParams, SpecConfig
from .kernels import ops, registry
from .metrics import SpecMetrics
from .protocols import Drafter, Proposal, Target
from .graph_step import GraphedStep, GraphStepResult, PendingStep
from .sampling import DrawPool, SamplingTensors, conditional_rates, nonfinite_rows
from .transfer import LongStaging, long_tensor_on


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
class StepRecord:
    """What one engine step did, handed to observers. Row i of every field is request
    request_ids[i] (the requests that were running at the step).

    proposal:     the drafts as verified: tokens [B, k] (columns >= num_drafts[i] are padding),
                  num_drafts [B] = drafts verified after the per-request cap and the verification
                  policy, probs [B, k, V] or None, confidence (calibrated) and confidence_logits
                  (raw) [B, k] when the drafter reports them.
    num_accepted: drafts accepted per request.
    emitted:      tokens appended to each request's output (accepted drafts, then the target's
                  token; cut at a stop condition or max_tokens).
    taps:         {layer: [B, 1 + k, d]} the target's hidden states over [anchor, drafts] for the
                  layers observers asked for in add_observer (empty when none asked).

    Records cover verify steps only: a request's first token, sampled from its prefill, is in its
    RequestOutput but in no record.
    """

    request_ids: list[int]
    proposal: Proposal
    num_accepted: list[int]
    emitted: list[list[int]]
    taps: dict[int, torch.Tensor]


StepObserver = Callable[[StepRecord], None]


@dataclass
class _Request:
    out: RequestOutput
    prompt: torch.Tensor
    params: SamplingParams
    generator: torch.Generator
    uniforms: DrawPool | None = None  # the acceptance's uniforms, drawn from `generator` (made at the first draw)
    slot: int = -1
    anchor: int = -1
    num_computed: int = 0  # tokens the target has committed (prompt + kept tokens)


def _prompt_tensor(prompt) -> torch.Tensor:
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


def _check_finite(reqs, nonfinite: list[bool]) -> None:
    """The NaN guard: tokens drawn from NaN or infinite logits are garbage (argmax of NaN is
    token 0), so the step stops with the requests named instead of emitting them. nonfinite
    comes from dspark.sampling.nonfinite_rows, read with the step's other results (no extra
    synchronisation)."""
    if any(nonfinite):
        ids = [r.out.request_id for r, b in zip(reqs, nonfinite) if b]
        raise FloatingPointError(f"request(s) {ids}: the target returned non-finite logits; refusing to sample from them")


@dataclass
class _Launched:
    """A step on its way: what completing it needs. A graphed step's results come from `pending`
    (read when it is completed); an eager one's were read when it ran (`eager`)."""

    reqs: list[_Request]
    slots: list[int]
    proposal: Proposal
    kmax: int
    t_start: float
    pending: PendingStep | None = None
    eager: GraphStepResult | None = None

    @property
    def graphed(self) -> bool:
        return self.pending is not None


class Engine:
    def __init__(
        self,
        target: Target,
        drafter: Drafter | None = None,
        spec: SpecConfig | None = None,
        eos_token_ids: tuple[int, ...] = (),
        policy=None,
        sampler: Callable | None = None,
        sync_timing: bool | None = None,
        cuda_graphs: bool | None = None,
        launch_ahead: bool = True,
    ):
        """cuda_graphs: replay each step of up to 8 requests as a CUDA graph. None: wherever the
        target can be captured (a CUDA target with `supports_cuda_graphs`) unless
        SpecConfig.batch1_profile.cuda_graphs is False; True: required (an error otherwise); False:
        eager steps. A substituted `sampler` runs eagerly. sync_timing: synchronise
        the device between phases so that metrics.phase_seconds splits GPU time by phase (default:
        on for eager CUDA steps, off with graphs, whose only synchronisation is the readback).
        launch_ahead: with graphs, launch a step before the previous one is read back wherever
        nothing it needs comes from that one's host results (_may_launch_ahead), so the host's
        work on a step overlaps the device's on the next; False: every step is read back before
        the next is launched (the same tokens, as a comparison)."""
        self.target = target
        self.spec = (spec or SpecConfig(num_speculative_tokens=0)).validate()
        if self.spec.max_k > 0 and drafter is None:
            raise ValueError(f"SpecConfig.num_speculative_tokens={self.spec.max_k}: speculation needs a drafter")
        self.drafter = drafter
        self.tap_layers = tuple(drafter.tap_layers) if drafter is not None else ()
        self._observers: list[StepObserver] = []
        self._observer_taps: tuple[int, ...] = ()
        self._verify_taps = self.tap_layers  # the drafter's taps plus any an observer asked for
        self.eos_token_ids = frozenset(eos_token_ids)
        self.device = torch.device(target.device)
        # Verification-length policies: the configured one, and the batch-1 profile's own.
        # "fixed" needs no policy object: the per-request cap already verifies every draft.
        self._policy = policy if policy is not None else self._make_policy(
            self.spec.verify_policy, self.spec.confidence_threshold)
        profile = self.spec.batch1_profile
        self._batch1_kernels = self._check_profile(profile)
        self._policy_batch1 = self._policy if profile is None or policy is not None else self._make_policy(
            profile.verify_policy, profile.confidence_threshold)
        # The lossless sampler unless the config asks for synthetic acceptance; `sampler` lets a
        # test substitute a deliberately broken one to show the distribution test can fail.
        self._cond_rates: dict[int, torch.Tensor] = {}  # synthetic conditional rates by k
        self.sampler = sampler
        capturable = self.device.type == "cuda" and getattr(target, "supports_cuda_graphs", False)
        if cuda_graphs and not capturable:
            raise ValueError(f"cuda_graphs=True: the target ({type(target).__name__} on {self.device}) cannot be "
                             "captured; CUDA graphs need a CUDA target with supports_cuda_graphs")
        if cuda_graphs is None:
            cuda_graphs = capturable and (profile is None or profile.cuda_graphs)
        # A substituted sampler (a test's broken one) runs eagerly: graphs capture the registry's.
        self._graphs = GraphedStep(target, self._verify_taps) if cuda_graphs and sampler is None else None
        if sync_timing is None:
            sync_timing = self.device.type == "cuda" and self._graphs is None
        self.sync_timing = sync_timing
        self.metrics = SpecMetrics()
        self._sampling_cache: tuple[tuple[int, ...], SamplingTensors] | None = None
        self._anchor_staging = LongStaging(target.max_slots, self.device)
        self._no_uniforms = torch.zeros(1, 1, device=self.device)
        self._no_noise = torch.ones(1, 1, device=self.device)
        # The proposal of a step without drafts, as views (read-only everywhere downstream): no
        # allocation and no kernel launch per plain-decoding step; made once per batch size, as
        # a slice is a torch call of a few microseconds of host time (engine_host_profile_1c6ffd9.json).
        self._no_drafts = torch.zeros(target.max_slots, 0, dtype=torch.long, device=self.device)
        self._zero_drafts = torch.zeros(target.max_slots, dtype=torch.long, device=self.device)
        self._plain_proposals: dict[int, Proposal] = {}
        # The batch's slots on the device, for the anchors of a step launched ahead (the batch of
        # the step before it): uploaded when the batch changes, not every step.
        self._slots_on_device: tuple[tuple[int, ...], torch.Tensor] | None = None
        self._last_mark = 0.0
        self._last_step_end = 0.0
        self.launch_ahead = launch_ahead
        self._inflight: _Launched | None = None  # a step launched before the previous one was read back
        # A drafter that keeps no state and proposes from its generators alone (the UniformDrafter)
        # has nothing to commit, and lets the next step launch before this one is read.
        self._drafter_stateless = bool(getattr(drafter, "stateless", False))
        self._drafter_commits_on_device = bool(getattr(drafter, "commits_on_device", False))
        self._drafter_reads_anchors = bool(getattr(drafter, "reads_anchors", True))
        self._uniform_width = max(self.spec.max_k, 1)  # of each request's uniforms pool
        self._next_id = 0
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._free_slots = list(range(target.max_slots - 1, -1, -1))
        if self._graphs is not None:
            self._capture_graphs()

    def _capture_graphs(self) -> None:
        """The common graphs ahead of the first step: every batch bucket at T = 1 and T = k + 1,
        with all-greedy sampling (other shapes and sampling flavours are captured when first
        needed; a capture changes no state, docs/architecture.md)."""
        drafter_pool_shape = getattr(self.drafter, "draft_pool_shape", None)
        for batch in self._graphs.buckets:
            for tokens in sorted({1, self.spec.k_for_batch(batch) + 1}):
                drafts = tokens > 1
                self._graphs.capture(
                    batch, tokens, synthetic=self._synthetic and drafts,
                    draft_pools=drafter_pool_shape(tokens - 1) if drafter_pool_shape is not None and drafts else None,
                    # synthetic acceptance reads each request's uniforms, from its pool (_uniforms_row)
                    uniform_pools=(DrawPool.STEPS, self._uniform_width) if self._synthetic and drafts else None)

    @staticmethod
    def _check_profile(profile) -> tuple[tuple[str, str], ...]:
        """The batch-1 profile's kernel overrides, checked against the registry."""
        if profile is None:
            return ()
        for op, impl in profile.kernels:
            known = registry.implementations(op)
            if impl not in known:
                raise ValueError(f"SpecConfig.batch1_profile.kernels: {op}={impl!r} is not an implementation; have {sorted(known)}")
        return tuple(profile.kernels)

    @property
    def _synthetic(self) -> bool:
        return self.spec.rejection_sample_method == "synthetic"

    def _synthetic_cond_rates(self, k: int) -> torch.Tensor:
        """Conditional acceptance rates [k] for a step whose drafts are k wide."""
        if k not in self._cond_rates:
            rates = conditional_rates(list(self.spec.synthetic_rates(k)))
            self._cond_rates[k] = torch.tensor(rates, dtype=torch.float32, device=self.device)
        return self._cond_rates[k]

    def set_acceptance(self, spec: SpecConfig) -> None:
        """Switch k and the acceptance mode between steps, keeping the live requests (a phased
        sweep measures every forced AL on one prefilled context). The drafter stays the same.
        A step already launched ahead keeps the settings it was launched with: drain() first to
        switch at a step boundary."""
        spec = spec.validate()
        if spec.max_k > 0 and self.drafter is None:
            raise ValueError(f"SpecConfig.num_speculative_tokens={spec.max_k}: speculation needs a drafter")
        self.spec, self._cond_rates = spec, {}

    def add_observer(self, observer: StepObserver, tap_layers: tuple[int, ...] = ()) -> None:
        """Call `observer(StepRecord)` after every step from now on. tap_layers: target layers
        whose hidden states over the verified tokens the record should carry (verify then
        computes them too). Without observers a step builds no record."""
        self._observers.append(observer)
        self._observer_taps = tuple(sorted({*self._observer_taps, *tap_layers}))
        self._verify_taps = tuple(sorted({*self.tap_layers, *self._observer_taps}))
        if self._graphs is not None:  # the graphs' verify must compute the new taps too
            graphs = GraphedStep(self.target, self._verify_taps)
            graphs.anchors.copy_(self._graphs.anchors)  # the live requests' anchors
            self._graphs = graphs

    def _make_policy(self, name: str, threshold: float):
        from .policy import ConfidenceScheduler, make_policy

        if name == "fixed":
            return None
        if name == "scheduler" and self.spec.sps_table_path is None:
            return ConfidenceScheduler(self.profile_sps())
        return make_policy(name, confidence_threshold=threshold, sps_table_path=self.spec.sps_table_path)

    def profile_sps(self):
        """Steps/s of target.verify against the tokens it feeds, measured now on this device
        (the confidence scheduler's cost curve; docs/dspark-algorithm.md §5.3). Runs
        on the last slot before any request holds it and commits nothing."""
        from .policy import SPSTable

        slot = self.target.max_slots - 1
        most = min(self.target.max_slots * (self.spec.max_k + 1), self.target.max_seq_len)
        counts = sorted({1, *range(2, most + 1, max(1, most // 8)), most})
        gen = torch.Generator().manual_seed(self.spec.seed)

        def verify(n: int):
            tokens = torch.randint(0, self.target.vocab_size, (1, n), generator=gen).to(self.device)
            self.target.verify([slot], tokens, torch.tensor([n], device=self.device))

        return SPSTable.profile(verify, counts, warmup=1, repeats=3)

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, prompt: list[int] | torch.Tensor, params: SamplingParams | None = None) -> int:
        """Queue a request; raises ValueError naming the bad field. Returns its id."""
        if params is not None and not isinstance(params, SamplingParams):
            raise ValueError(f"params={params!r}: must be a SamplingParams")
        params = (params or SamplingParams()).validate(self.target.vocab_size)
        prompt_t = _prompt_tensor(prompt)
        if prompt_t.numel() == 0:
            raise ValueError("prompt=[]: a prompt needs at least one token")
        bad = (prompt_t < 0) | (prompt_t >= self.target.vocab_size)
        if bad.any():
            tok = int(prompt_t[bad][0])
            raise ValueError(f"prompt token id {tok} is outside the vocabulary [0, {self.target.vocab_size})")
        if prompt_t.numel() > self.target.max_seq_len:
            raise ValueError(
                f"prompt length {prompt_t.numel()} exceeds the model context max_seq_len={self.target.max_seq_len}"
            )
        rid = self._next_id
        self._next_id += 1
        gen = torch.Generator(device=self.device)
        gen.manual_seed(params.seed if params.seed is not None else self.spec.seed * 1_000_003 + rid)
        self._waiting.append(_Request(RequestOutput(rid, prompt_t.tolist()), prompt_t, params, gen))
        return rid

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def generate(
        self, prompts: list, params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Run prompts to completion. A request with bad input comes back with `error` set and
        finish_reason "error"; it does not stop the others."""
        outputs = {}
        for rid, out in self._submit(prompts, params):
            outputs[rid] = out
        for _ in self.stream_steps():
            pass
        return [outputs[rid] for rid in sorted(outputs)]

    def stream(self, prompts: list, params=None) -> Iterator[StepOutput]:
        """Like generate, but yields each request's new tokens as steps produce them."""
        for rid, out in self._submit(prompts, params):
            if out.error is not None:
                yield StepOutput(rid, [], True, "error")
        yield from self.stream_steps()

    def stream_steps(self) -> Iterator[StepOutput]:
        while self.has_unfinished():
            yield from self.step()

    def _submit(self, prompts, params):
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts={prompts!r:.80}: must be a list of prompts (each a list of token ids)")
        if not isinstance(params, list):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params has {len(params)} entries for {len(prompts)} prompts")
        submitted = []
        for prompt, p in zip(prompts, params):
            try:
                rid = self.add_request(prompt, p)
                submitted.append((rid, self._waiting[-1].out))
            except ValueError as e:
                rid = self._next_id
                self._next_id += 1
                # The rejected prompt is echoed only when it is a plain sequence of token ids.
                ok = isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt)
                out = RequestOutput(rid, list(prompt) if ok else [])
                out.finish_reason, out.error = "error", str(e)
                submitted.append((rid, out))
        return submitted

    # ---- one step -------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        # The batch this step runs: the running requests plus those admission will prefill into it.
        batch_size = len(self._running) + min(len(self._waiting), len(self._free_slots))
        if self._batch1_kernels and batch_size == 1:
            # The latency path's own kernel choice, for this engine's step (prefill included) only:
            # registry.scoped sets a context-local table, so other engines and the process-wide
            # overrides keep theirs.
            with registry.scoped(self._batch1_kernels):
                return self._step()
        return self._step()

    def _step(self) -> list[StepOutput]:
        launched = self._take_inflight()
        events = []
        if launched is None:
            events = self._admit()
            if not self._running:
                return events
            launched = self._launch(self._running)
        # The next step goes to the device before this one is read back, where nothing it needs
        # comes from this step's host results (docs/architecture.md, "The step on the GPU").
        if launched.graphed and self._may_launch_ahead(launched):
            self._inflight = self._launch(launched.reqs, ahead=True)
            self.metrics.num_launched_ahead += 1
        return events + self._complete(launched)

    def drain(self) -> list[StepOutput]:
        """Read back the step launched ahead, if any, and launch nothing after it: what it emits
        (the events the next step() would have returned first). After it, every step launched
        so far is counted in `metrics` and the next step starts from the host's state."""
        launched = self._take_inflight()
        return self._complete(launched) if launched is not None else []

    def _take_inflight(self) -> "_Launched | None":
        """The step launched ahead, taken; None when there is none, or when every row of it ended
        a step earlier (it is waited for, so that its buffers are free, and nothing is read)."""
        launched, self._inflight = self._inflight, None
        if launched is not None and all(r.out.finished for r in launched.reqs):
            launched.pending.result()
            return None
        return launched

    def _may_launch_ahead(self, launched: "_Launched") -> bool:
        """Whether the step after `launched` may be launched before `launched` is read back: a
        graph replay of the same batch whose drafts, sampling and verify lengths do not depend
        on what `launched` emits. Stop conditions are then seen one step late, so no request
        that `launched` may finish by max_tokens or by the context may be in it (an EOS only
        wastes the next step's row, which is discarded)."""
        policy = self._policy_batch1 if len(launched.reqs) == 1 else self._policy
        if not self.launch_ahead or self._observers or policy is not None:
            return False
        if self.drafter is not None and not (self._drafter_stateless or self._drafter_commits_on_device):
            return False
        if self._waiting and self._free_slots:
            return False  # admission first
        k_now, k_then = self.step_k(len(launched.reqs)), launched.kmax
        max_spec = self.spec.max_speculative_seq_len
        for r in launched.reqs:
            most_after = r.num_computed + k_then + 1  # committed tokens once `launched` is read
            if r.out.finished or len(r.out.token_ids) + k_then + 1 >= r.params.max_tokens:
                return False
            if most_after + k_now + 1 > self.target.max_seq_len:
                return False
            if max_spec is not None and r.num_computed + 1 <= max_spec < most_after + 1:
                return False  # the draft gate may close during `launched`
        return True

    def _launch(self, reqs: list[_Request], ahead: bool = False) -> "_Launched":
        """Draft and put one step for `reqs` on the device. Graphed: the replay is queued and
        read in _complete. Eager: the step runs and its results are read here. ahead: the step
        before is not read back yet (_may_launch_ahead), so the anchors come from the device."""
        t_start = time.perf_counter()
        if not ahead:
            self._last_mark = t_start
        B = len(reqs)
        slots = [r.slot for r in reqs]
        sampling = self._sampling_tensors(reqs)
        graphed = self._graphs is not None and self._graphs.bucket(B) is not None

        # 1-2. draft and decide how many drafts each request verifies
        k_req = self._drafts_allowed(reqs)
        kmax = max(k_req)
        # A graphed step reads each slot's anchor on the device; the drafter gets them as a device
        # tensor: from the host's lists, or after a step not yet read back, from the device copy
        # (a drafter that never reads them gets None); an eager step verifies them.
        drafter_anchors = kmax > 0 and self._drafter_reads_anchors
        anchors = None
        if drafter_anchors and ahead:
            anchors = self._graphs.anchors.index_select(0, self._slots_tensor(slots))
        elif drafter_anchors or not graphed:
            anchors = self._anchor_staging.upload([r.anchor for r in reqs])
        proposal = self._propose(reqs, k_req, kmax, anchors)
        num_drafts = proposal.num_drafts
        self._mark("draft")

        # 3-4. verify and accept (with graphs: the target's commit too, in the same replay)
        uniforms, noise = self._draw_noise(reqs, sampling, max(kmax, 1), graphed)
        rates = self._synthetic_cond_rates(kmax) if self._synthetic else None
        launched = _Launched(reqs, slots, proposal, kmax, t_start)
        if graphed:
            # rates is kmax long; passed as it is (not as a slice, a new tensor each step) so that
            # the graph sees the same tensor and copies the rates in only when they change.
            # The draws' pools go with them: the graph reads their rows on the device (DrawMirror).
            launched.pending = self._graphs.launch(
                slots, self._free_slots, proposal.tokens, num_drafts, proposal.probs, sampling, uniforms, noise, rates,
                draft_pools=proposal.token_pools,
                uniform_pools=None if uniforms is None else tuple(r.uniforms for r in reqs))
            if self._drafter_commits_on_device:  # queued behind the step: a step launched ahead drafts on it
                num_accepted, tokens, taps = launched.pending.device_outputs
                self.drafter.commit_on_device(slots, tokens, num_accepted + 1, taps)
            return launched
        tokens = torch.cat([anchors[:, None], proposal.tokens], dim=1)
        out = self.target.verify(slots, tokens, 1 + num_drafts, self._verify_taps)
        self._mark("verify")
        nonfinite = nonfinite_rows(out.logits, 1 + num_drafts).tolist()
        if rates is not None:
            num_acc, next_tok = ops.synthetic_sample(
                out.logits, proposal.tokens, num_drafts, rates, sampling, uniforms[:, :kmax], noise)
        else:
            sample = self.sampler or ops.rejection_sample  # on the GPU: kernels/acceptance
            num_acc, next_tok = sample(
                out.logits, proposal.tokens, num_drafts, proposal.probs, sampling, uniforms[:, :kmax], noise)
        if self._graphs is not None:  # a later graphed step of these requests reads their anchors there
            self._graphs.set_anchors(long_tensor_on(slots, self.device), next_tok)
        launched.eager = GraphStepResult(
            num_accepted=num_acc.tolist(), next_token=next_tok.tolist(), num_drafts=num_drafts.tolist(),
            nonfinite=nonfinite, drafts=proposal.tokens.tolist(), num_accepted_device=num_acc,
            tokens_device=tokens, taps=out.taps)
        return launched

    def _complete(self, launched: "_Launched") -> list[StepOutput]:
        """Read a launched step's results, emit its tokens, stop what stops and commit."""
        reqs, slots, graphed = launched.reqs, launched.slots, launched.graphed
        result = launched.pending.result() if graphed else launched.eager
        # Rows of requests that ended at the step before (this one was launched before that one
        # was read back) are not looked at: their slots were released after this step ran.
        live = [i for i, r in enumerate(reqs) if not r.out.finished]
        _check_finite([reqs[i] for i in live], [result.nonfinite[i] for i in live])
        self._mark("verify" if graphed else "accept")

        # 5. emit, stop, commit
        events, keep, finished, emitted = [], [], [], []
        for i in live:
            r, a = reqs[i], result.num_accepted[i]
            new = self._emit(r, result.drafts[i][:a] + [result.next_token[i]])
            emitted.append(new)
            r.out.num_steps += 1
            r.out.num_accepted_drafts += a
            r.num_computed += a + 1
            r.anchor = result.next_token[i]
            if not r.out.finished and r.num_computed >= self.target.max_seq_len:
                r.out.finish_reason = "length"  # no position left for the next anchor
            events.append(StepOutput(r.out.request_id, new, r.out.finished, r.out.finish_reason))
            (finished if r.out.finished else keep).append(i)
        self.metrics.observe([result.num_drafts[i] for i in live], [result.num_accepted[i] for i in live])
        self.metrics.num_steps += 1
        if self._observers:
            record = StepRecord([reqs[i].out.request_id for i in live], launched.proposal,
                                [result.num_accepted[i] for i in live], emitted,
                                {layer: result.taps[layer] for layer in self._observer_taps})
            for observer in self._observers:
                observer(record)
        # With graphs the replay committed the target's rows (finished ones are released below);
        # a stateless drafter has nothing to commit.
        drafter_commits = self.drafter is not None and not self._drafter_stateless
        keep_slots = [slots[i] for i in keep]
        if keep and graphed and self._drafter_commits_on_device:  # committed at launch; the counts now
            self.drafter.settle(keep_slots, [result.num_accepted[i] + 1 for i in keep], launched.kmax + 1)
        elif keep and (drafter_commits or not graphed):
            kept, keep_tokens = result.num_accepted_device + 1, result.tokens_device
            taps = {layer: result.taps[layer] for layer in self.tap_layers}
            if len(keep) < len(reqs):
                idx = torch.tensor(keep, device=self.device)
                kept, keep_tokens = kept.index_select(0, idx), keep_tokens.index_select(0, idx)
                taps = {layer: t.index_select(0, idx) for layer, t in taps.items()}
            if not graphed:
                self.target.commit(keep_slots, kept)
            if drafter_commits:
                self.drafter.commit(keep_slots, keep_tokens, kept, taps)
        self._release([reqs[i] for i in finished])
        self._running = [reqs[i] for i in keep]
        self._mark("commit")
        # A step's wall time runs from its launch, or from the previous step's end when it was
        # launched before that one ended (then the two overlap on the host, not on the device).
        now = time.perf_counter()
        self.metrics.step_seconds.append(now - max(launched.t_start, self._last_step_end))
        self._last_step_end = now
        self.metrics.step_tokens.append(sum(len(e) for e in emitted))
        return events

    def _drafts_allowed(self, reqs: list[_Request]) -> list[int]:
        """Drafts each request may verify this step: the profile's k for the live batch size,
        0 for requests that opted out or are past the sequence-length gate, and never past the
        context (positions num_computed .. num_computed + k must exist)."""
        k = self.step_k(len(reqs))
        allowed = []
        for r in reqs:
            kr = k if r.params.speculate else 0
            if self.spec.max_speculative_seq_len is not None and r.num_computed + 1 > self.spec.max_speculative_seq_len:
                kr = 0
            allowed.append(max(0, min(kr, self.target.max_seq_len - r.num_computed - 1)))
        return allowed

    def step_k(self, batch_size: int) -> int:
        """k for a step of this many requests (SpecConfig.k_for_batch)."""
        return self.spec.k_for_batch(batch_size)

    def _slots_tensor(self, slots: list[int]) -> torch.Tensor:
        """`slots` as a device tensor, uploaded only when they differ from the last call's (nothing
        writes the tensor: it is an index)."""
        key = tuple(slots)
        if self._slots_on_device is None or self._slots_on_device[0] != key:
            self._slots_on_device = (key, self._anchor_staging.upload(slots))
        return self._slots_on_device[1]

    def _propose(self, reqs, k_req: list[int], kmax: int, anchors: torch.Tensor | None) -> Proposal:
        B = len(reqs)
        dev = self.device
        if kmax == 0:
            if B not in self._plain_proposals:
                self._plain_proposals[B] = Proposal(self._no_drafts[:B], self._zero_drafts[:B])
            return self._plain_proposals[B]
        rows = [i for i in range(B) if k_req[i] > 0]
        sub = rows if len(rows) < B else None
        pick = (lambda xs: [xs[i] for i in rows]) if sub else (lambda xs: xs)
        prop = self.drafter.propose(
            pick([r.slot for r in reqs]),
            anchors[torch.tensor(rows, device=dev)] if sub and anchors is not None else anchors,
            kmax,
            pick([r.params for r in reqs]),
            pick([r.generator for r in reqs]),
        )
        num = prop.num_drafts.to(dev)
        if any(k_req[i] < kmax for i in rows):
            num = torch.minimum(num, long_tensor_on([k_req[i] for i in rows], self.device))
        policy = self._policy_batch1 if B == 1 else self._policy
        if policy is not None:
            num = torch.minimum(num, policy.verify_lengths(dataclasses.replace(prop, num_drafts=num)))
        if sub is None:  # the drafter's own where nothing capped it: a replace cost ~10 us in cProfile
            return prop if num is prop.num_drafts else dataclasses.replace(prop, num_drafts=num)
        # Scatter the proposing rows back into the full batch; the others verify no drafts.
        idx = torch.tensor(rows, device=dev)

        def scatter(proposed: torch.Tensor | None, fill: torch.Tensor | float) -> torch.Tensor | None:
            if proposed is None:
                return None
            full = torch.empty(B, *proposed.shape[1:], dtype=proposed.dtype, device=dev)
            full[:] = fill
            full[idx] = proposed
            return full

        # Rows without drafts verify none: their draft tokens are never read.
        return Proposal(scatter(prop.tokens, 0), scatter(num, 0), scatter(prop.probs, 1.0),
                        scatter(prop.confidence, 0.0), scatter(prop.confidence_logits, 0.0))

    def _sampling_tensors(self, reqs: list[_Request]) -> SamplingTensors:
        """The batch's sampling parameters as tensors, rebuilt only when the batch changes."""
        ids = tuple(r.out.request_id for r in reqs)
        if self._sampling_cache is None or self._sampling_cache[0] != ids:
            self._sampling_cache = (ids, SamplingTensors.from_params([r.params for r in reqs], self.device))
        return self._sampling_cache[1]

    def _draw_noise(self, reqs, sampling: SamplingTensors, k: int, graphed: bool = False):
        """Per-request randomness from each request's own generator, so a seeded request gives
        the same output whatever else is in the batch: uniforms [B, >= k] and race noise [B, V].
        All-greedy standard acceptance uses neither. A graphed step gets None for what it does not
        read: greedy rows read no race noise, so an all-greedy batch's graph keeps the ones its
        noise buffer was made with (its key has all_greedy), and with standard acceptance it reads
        no uniforms either."""
        V = self.target.vocab_size
        if sampling.all_greedy and not self._synthetic:
            if graphed:
                return None, None
            return self._no_uniforms.expand(len(reqs), k), self._no_noise.expand(len(reqs), V)
        # Each request's uniforms come max_k wide from its pool (64 steps per draw); k <= max_k
        # columns are read (the graph's input copy and the samplers slice).
        draws = [self._uniforms_row(r) for r in reqs]
        # A cat is a launch and ~30 us of host time on the H200 for what is a view at batch 1.
        uniforms = draws[0] if len(draws) == 1 else torch.cat(draws)
        if sampling.all_greedy and graphed:
            return uniforms, None
        noise = torch.ones(len(reqs), V, device=self.device)
        for i, r in enumerate(reqs):
            if not r.params.greedy:
                noise[i].exponential_(generator=r.generator)
        return uniforms, noise

    def _uniforms_row(self, r: _Request) -> torch.Tensor:
        if r.uniforms is None:
            r.uniforms = DrawPool.uniform(r.generator, self._uniform_width)
        return r.uniforms.next()

    def _emit(self, r: _Request, tokens: list[int]) -> list[int]:
        """Append tokens to the output up to a stop condition; returns what was appended."""
        out, p = r.out, r.params
        emitted = []
        for t in tokens:
            out.token_ids.append(t)
            emitted.append(t)
            self.metrics.num_output_tokens += 1
            if (t in self.eos_token_ids and not p.ignore_eos) or t in p.stop_token_ids:
                out.finish_reason = "stop"
                break
            if len(out.token_ids) >= p.max_tokens:
                out.finish_reason = "length"
                break
        return emitted

    # ---- admission and release ------------------------------------------------------------

    def _admit(self) -> list[StepOutput]:
        new = []
        while self._waiting and self._free_slots:
            r = self._waiting.popleft()
            r.slot = self._free_slots.pop()
            new.append(r)
        if not new:
            return []
        t0 = time.perf_counter()
        slots = [r.slot for r in new]
        out = self.target.prefill(slots, [r.prompt.to(self.device) for r in new], self.tap_layers)
        logits = out.logits  # [B, 1, V]: after each prompt's last token
        _check_finite(new, nonfinite_rows(logits).tolist())
        sampling = SamplingTensors.from_params([r.params for r in new], self.device)
        _, noise = self._draw_noise(new, sampling, 1)
        none = torch.zeros(len(new), 0, dtype=torch.long, device=self.device)
        zero = torch.zeros(len(new), dtype=torch.long, device=self.device)
        _, first = ops.rejection_sample(logits, none, zero, None, sampling, none.float(), noise)
        if self._graphs is not None:  # graphed steps read each slot's anchor on the device
            self._graphs.set_anchors(long_tensor_on(slots, self.device), first)
        events, finished = [], []
        for i, (r, tok) in enumerate(zip(new, first.tolist())):
            r.num_computed = len(r.prompt)
            r.anchor = tok
            emitted = self._emit(r, [tok])
            if not r.out.finished and r.num_computed >= self.target.max_seq_len:
                r.out.finish_reason = "length"
            events.append(StepOutput(r.out.request_id, emitted, r.out.finished, r.out.finish_reason))
            if r.out.finished:
                finished.append(r)
                continue
            if self.drafter is not None:
                taps = {layer: t[i, : len(r.prompt)] for layer, t in out.taps.items()}
                self.drafter.start(r.slot, r.prompt, taps)
            self._running.append(r)
        self._release(finished)
        self.metrics.phase_seconds.setdefault("prefill", 0.0)
        self.metrics.phase_seconds["prefill"] += time.perf_counter() - t0
        return events

    def _release(self, reqs: list[_Request]) -> None:
        if not reqs:
            return
        slots = [r.slot for r in reqs]
        self.target.release(slots)
        if self.drafter is not None:
            self.drafter.release(slots)
        self._free_slots.extend(slots)

    # ---- timing ---------------------------------------------------------------------------

    def _mark(self, phase: str) -> None:
        """Attribute the time since the previous mark to `phase` (synchronising the device first
        when sync_timing, so asynchronous GPU work lands in the phase that launched it)."""
        if self.sync_timing and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.metrics.phase_seconds[phase] += now - self._last_mark
        self._last_mark = now
