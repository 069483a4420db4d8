"""On-device acceptance with Triton: rejection_sample and synthetic_sample of reference.py,
decision for decision, with no host synchronisation (no .item(), no data-dependent Python
branches: num_accepted and the next token stay on the GPU).

Why Triton and not CuTe DSL: the work is a split-row reduction (max / sum-exp / argmax /
race-argmax partials, then a tiny combine), SIMT only, where neither TMA nor WGMMA helps; Triton
expresses it in a few hundred lines, its CPU interpreter (TRITON_INTERPRET=1) ran the kernels
against reference.py before they met the GPU, and it compiles them for sm_90 without a GPU
(tests/test_acceptance_op.py, where triton is installed). The cost: CI has no triton, so the
kernels run in GPU tests only (tests/gpu/test_acceptance_gpu.py); experiments/notes/acceptance.md
has the H200 numbers.

Top-k / top-p: the filtered set comes from the sampler's own sort (reference.top_k_top_p
on the GPU, no host sync), reduced to a per-row threshold (value, last kept index among ties) that
the kernels apply while they stream the row. That sort dominates the filtered case's time; the
no-filter path (greedy, temperature) never sorts. A sort-free threshold search is the next step.
"""

import torch

from ..registry import register
from ..triton_common import kernel_module, triton_available
from . import reference

BLOCK = 1024  # vocabulary entries per program per loop step (num_warps=4: 8 per thread)
TARGET_PROGRAMS = 1024  # row_partials programs to aim for: ~8 per SM of an H200 (132 SMs)
MAX_POSITIONS = 16  # positions the combine holds as one vector (k <= 15 drafts)
MAX_BATCH = 65_535  # requests run on the grid's z dimension
NUM_WARPS = 4


def _kernels():
    return kernel_module(__package__)


def chunk_size(batch: int, positions: int, vocab: int, block: int = BLOCK, target_programs: int = TARGET_PROGRAMS) -> int:
    """Vocabulary entries per row_partials program: a multiple of `block`, so that the grid has
    about `target_programs` programs (one row of V = 163,840 is split 80 ways at B = 1, T = 8)."""
    splits_wanted = max(1, target_programs // max(1, batch * positions))
    steps = max(1, -(-vocab // (block * splits_wanted)))
    return steps * block


def _require(cond: bool, field: str, value, what: str) -> None:
    if not cond:
        raise ValueError(f"acceptance: {field}={value} {what}")


def _check(target_logits, draft_tokens, num_drafts, uniforms, race_noise, sampling):
    _require(target_logits.dim() == 3 and target_logits.stride(-1) == 1, "target_logits.shape",
             tuple(target_logits.shape), "must be [B, T, V] with a contiguous last dimension")
    B, T, V = target_logits.shape
    _require(B <= MAX_BATCH, "B", B, f"must be at most {MAX_BATCH} (the grid's third dimension)")
    _require(draft_tokens.dim() == 2 and draft_tokens.shape[0] == B and not draft_tokens.is_floating_point(),
             "draft_tokens.shape", (tuple(draft_tokens.shape), draft_tokens.dtype), f"must be [B={B}, k] integer")
    k = draft_tokens.shape[1]
    _require(k + 1 <= T, "draft_tokens.shape", tuple(draft_tokens.shape), f"needs T={T} >= k + 1")
    _require(k + 1 <= MAX_POSITIONS, "k", k, f"must be at most {MAX_POSITIONS - 1}")
    _require(tuple(num_drafts.shape) == (B,) and not num_drafts.is_floating_point(), "num_drafts.shape",
             (tuple(num_drafts.shape), num_drafts.dtype), f"must be [{B}] integer")
    _require(uniforms.dim() == 2 and uniforms.shape[0] == B and uniforms.shape[1] >= k, "uniforms.shape",
             tuple(uniforms.shape), f"must be [{B}, >= {k}]")
    _require(tuple(race_noise.shape) == (B, V) and race_noise.dtype == torch.float32, "race_noise.shape",
             (tuple(race_noise.shape), race_noise.dtype), f"must be [{B}, {V}] float32")
    for name in ("temperature", "top_k", "top_p"):
        x = getattr(sampling, name)
        _require(tuple(x.shape) == (B,) and x.device == target_logits.device, f"sampling.{name}.shape",
                 (tuple(x.shape), x.device), f"must be [{B}] on {target_logits.device}")


def filter_threshold(target_logits: torch.Tensor, positions: int, sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (request, position) the top-k / top-p filter as (value, index) thresholds [B, positions]:
    a token survives iff s > value or (s == value and its index <= index), s = logits / temperature.

    The surviving set is the sampler's own (reference.top_k_top_p, sort-based, no host
    sync), reduced to value = the smallest surviving s. Tokens tied at that value are the one
    place where the sampler's set depends on its sort's unspecified order of equal keys (CPU and
    GPU sorts differ there): the threshold keeps as many of them as the sampler does, lowest
    indices first. Without ties (fp32 logits, in practice) the set is exactly the sampler's.
    A kept token whose probability underflows to 0 counts as filtered: its p is 0 either way.
    """
    B, _, V = target_logits.shape
    temperature = torch.where(sampling.temperature == 0, torch.ones_like(sampling.temperature), sampling.temperature)
    scaled = target_logits[:, :positions].float() / temperature[:, None, None]
    rows = reference.SamplingTensors(sampling.temperature, sampling.top_k, sampling.top_p).expand(positions)
    kept = reference.top_k_top_p(scaled.reshape(B * positions, V), rows).view(B, positions, V) > 0
    value = torch.where(kept, scaled, torch.inf).amin(dim=-1)
    tied = scaled == value[..., None]
    kept_tied = (kept & tied).sum(dim=-1, keepdim=True)
    # the index of the kept_tied-th tied token: keeping indices <= it keeps that many, in order
    last = tied & (tied.cumsum(dim=-1) == kept_tied)
    index = torch.where(last, torch.arange(V, device=scaled.device, dtype=torch.int32), -1).amax(dim=-1)
    return value.contiguous(), index.to(torch.int32).contiguous()


def _launch(target_logits, draft_tokens, num_drafts, draft_probs, rates, sampling, uniforms, race_noise,
            *, synthetic: bool, out=None, block: int = BLOCK, target_programs: int = TARGET_PROGRAMS,
            pdl: bool = False, combine_warps: int = NUM_WARPS):
    kernels = _kernels()
    B, _, V = target_logits.shape
    k = draft_tokens.shape[1]
    positions = k + 1  # rows that can decide anything: draft positions and the bonus
    device = target_logits.device
    chunk = chunk_size(B, positions, V, block, target_programs)
    splits = -(-V // chunk)
    splits_pow2 = max(2, 1 << (splits - 1).bit_length())
    positions_pow2 = max(2, 1 << (positions - 1).bit_length())
    # host-side flags of SamplingTensors (not device data); greedy rows ignore the filters
    filtered = bool(sampling.filters) and not sampling.all_greedy
    if filtered:
        floor_value, floor_index = filter_threshold(target_logits, positions, sampling)
    else:
        floor_value = floor_index = target_logits  # never read without FILTERED
    temperature = sampling.temperature.float().contiguous()
    greedy_only = bool(sampling.all_greedy) and not synthetic

    part_f = torch.empty(B, positions, splits, 4, device=device, dtype=torch.float32)
    part_i = torch.empty(B, positions, splits, 2, device=device, dtype=torch.int32)
    if out is None:
        out = (torch.empty(B, device=device, dtype=torch.long), torch.empty(B, device=device, dtype=torch.long))
    num_accepted, next_token = out
    _require(num_accepted.shape == (B,) and next_token.shape == (B,) and num_accepted.dtype == torch.long
             and next_token.dtype == torch.long and num_accepted.is_contiguous() and next_token.is_contiguous(),
             "out", [(tuple(t.shape), t.dtype) for t in out], f"must be two contiguous [{B}] int64 tensors")
    has_q = draft_probs is not None
    q = draft_probs if has_q else target_logits  # any tensor: never read without HAS_Q
    stop_f = torch.empty(B, 2, device=device, dtype=torch.float32)
    stop_i = torch.empty(B, 2, device=device, dtype=torch.int32)
    rates = rates if rates is not None else temperature  # never read outside synthetic mode
    if k == 0:  # no drafts (the first token after prefill): pass a live pointer, never read
        draft_tokens = uniforms = num_drafts[:, None]
    sl, sn, sd, su, sq = (target_logits.stride(), race_noise.stride(), draft_tokens.stride(), uniforms.stride(),
                          q.stride())

    kernels.row_partials[(splits, positions, B)](
        target_logits, sl[0], sl[1], race_noise, sn[0], sn[1], draft_tokens, sd[0], sd[1],
        temperature, floor_value, floor_index, part_f, part_i, positions, k, V, chunk // block,
        BLOCK=block, FILTERED=filtered, GREEDY_ONLY=greedy_only, PDL=pdl, num_warps=NUM_WARPS,
    )
    kernels.accept[(B,)](
        part_f, part_i, target_logits, sl[0], sl[1], race_noise, sn[0], sn[1], draft_tokens, sd[0], sd[1],
        num_drafts, q, sq[0], sq[1], sq[2], uniforms, su[0], su[1], rates, temperature, floor_value, floor_index,
        num_accepted, next_token, stop_f, stop_i, k, splits,
        POSITIONS=positions, POSITIONS_POW2=positions_pow2, SPLITS_POW2=splits_pow2, FILTERED=filtered, HAS_Q=has_q,
        SYNTHETIC=synthetic, PDL=pdl, num_warps=combine_warps, launch_pdl=pdl,
    )
    if has_q and not synthetic:
        res_f = torch.empty(B, splits, 2, device=device, dtype=torch.float32)
        res_i = torch.empty(B, splits, device=device, dtype=torch.int32)
        kernels.residual_partials[(splits, B)](
            target_logits, sl[0], sl[1], race_noise, sn[0], sn[1], q, sq[0], sq[1], sq[2],
            temperature, floor_value, floor_index, stop_f, stop_i, res_f, res_i, positions, V, chunk // block,
            BLOCK=block, FILTERED=filtered, PDL=pdl, num_warps=NUM_WARPS, launch_pdl=pdl,
        )
        kernels.residual_pick[(B,)](res_f, res_i, stop_i, next_token, splits, SPLITS_POW2=splits_pow2, PDL=pdl,
                                    num_warps=NUM_WARPS, launch_pdl=pdl)
    return num_accepted, next_token


def rejection_sample(target_logits, draft_tokens, num_drafts, draft_probs, sampling, uniforms, race_noise,
                     **options):
    """reference.rejection_sample on the GPU (same arguments, same outputs).

    options: out=(num_accepted, next_token) preallocated [B] int64 (CUDA graphs, tests that poison
    them); block / target_programs tune the split (chunk_size); pdl=True launches the kernels
    after the first with programmatic dependent launch (sm_90+); combine_warps = warps of the
    per-request combine (fewer: its reductions stay inside a warp)."""
    _check(target_logits, draft_tokens, num_drafts, uniforms, race_noise, sampling)
    if draft_probs is not None:
        B, _, V = target_logits.shape
        k = draft_tokens.shape[1]
        _require(draft_probs.dim() == 3 and draft_probs.shape[0] == B and draft_probs.shape[1] >= k
                 and draft_probs.shape[2] == V, "draft_probs.shape", tuple(draft_probs.shape),
                 f"must be [{B}, >= {k}, {V}]")
    return _launch(target_logits, draft_tokens, num_drafts, draft_probs, None, sampling, uniforms, race_noise,
                   synthetic=False, **options)


def synthetic_sample(target_logits, draft_tokens, num_drafts, cond_rates, sampling, uniforms, race_noise, **options):
    """reference.synthetic_sample on the GPU (LOSSY by design, speed measurement only)."""
    _check(target_logits, draft_tokens, num_drafts, uniforms, race_noise, sampling)
    k = draft_tokens.shape[1]
    _require(cond_rates.dim() == 1 and cond_rates.shape[0] >= k, "cond_rates.shape", tuple(cond_rates.shape),
             f"must be [>= {k}]")
    return _launch(target_logits, draft_tokens, num_drafts, None, cond_rates.contiguous(), sampling, uniforms,
                   race_noise, synthetic=True, **options)


# ---- registry ---------------------------------------------------------------------------------

_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _supported(target_logits, draft_tokens, uniforms, race_noise) -> bool:
    return (target_logits.dim() == 3 and target_logits.dtype in _LOGIT_DTYPES and target_logits.stride(-1) == 1
            and draft_tokens.dim() == 2 and draft_tokens.shape[1] + 1 <= min(MAX_POSITIONS, target_logits.shape[1])
            and uniforms.dtype == torch.float32 and race_noise.dtype == torch.float32)


def supports_rejection_sample(target_logits, draft_tokens, num_drafts, uniforms, race_noise, draft_probs=None) -> bool:
    """The tensors ops.rejection_sample dispatches on; draft_probs only when there are some."""
    return _supported(target_logits, draft_tokens, uniforms, race_noise) and (
        draft_probs is None or draft_probs.dtype in _LOGIT_DTYPES)


def supports_synthetic_sample(target_logits, draft_tokens, num_drafts, uniforms, race_noise, cond_rates) -> bool:
    return _supported(target_logits, draft_tokens, uniforms, race_noise)


register("rejection_sample", "triton", devices=("cuda",), priority=10, available=triton_available,
         supports=supports_rejection_sample)(rejection_sample)
register("synthetic_sample", "triton", devices=("cuda",), priority=10, available=triton_available,
         supports=supports_synthetic_sample)(synthetic_sample)
