"""Run by tests/test_triton_interpreter.py in a fresh process with TRITON_INTERPRET=1 (the
interpreter must be chosen before triton is first imported): the fused glue kernels on the CPU
in float32 against their references in float64. Exits non-zero with the failing check's name.

Tolerance: float32 arithmetic on O(1) values, max abs error 1e-4 against float64 (the router's
selection: 1e-5, see check_route)."""
import itertools
import sys

import torch

from dspark.kernels.activation import reference as act_ref
from dspark.kernels.activation import triton as act_triton
from dspark.kernels.draft_loss import head_reference as loss_head_ref
from dspark.kernels.draft_loss import head_triton as loss_head_triton
from dspark.kernels.draft_loss import reference as loss_ref
from dspark.kernels.draft_loss import triton as loss_triton
from dspark.kernels.moe import expert_layout
from dspark.kernels.moe import triton as moe_triton
from dspark.kernels.numerics import sum_partials
from dspark.kernels.rmsnorm import reference as norm_ref
from dspark.kernels.rmsnorm import triton as norm_triton

ATOL = 1e-4
ROUTE_TOL = 1e-5  # float32 sigmoid and sums on O(1) values, against float64


def close(got, want, what):
    if got.shape != want.shape or not torch.isfinite(got).all():
        sys.exit(f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)} or non-finite output")
    err = (got.double() - want).abs().max().item()
    if not err < ATOL:
        sys.exit(f"{what}: max abs error {err:.2e} >= {ATOL}")


def main(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for width in (64, 100, 7168):
        fused = torch.randn(5, width + 24, generator=gen) * 2 + 0.5
        x = fused[:, 8 : 8 + width]  # a column slice of a wider GEMM output: strided rows
        weight = torch.rand(width, generator=gen) + 0.5
        out = torch.full((5, width), float("nan"))
        got = norm_triton.rms_norm(x, weight, 1e-6, out=out)
        close(got, norm_ref.rms_norm(x.double(), weight.double(), 1e-6), f"rms_norm width {width}")
        out = torch.full((5, width), float("nan"), dtype=torch.float64)
        got = norm_triton.rms_norm(x, weight, 1e-6, out_dtype=torch.float64, out=out)
        if got.dtype != torch.float64:
            sys.exit(f"rms_norm out_dtype: got {got.dtype}")
        close(got, norm_ref.rms_norm(x.double(), weight.double(), 1e-6), f"rms_norm width {width} into float64")
        got = norm_triton.rms_norm_scaled_in_fp32(x, weight, 1e-6, out=torch.full((5, width), float("nan")))
        close(got, norm_ref.rms_norm_scaled_in_fp32(x.double(), weight.double(), 1e-6),
              f"rms_norm_scaled_in_fp32 width {width}")
    M, d = 4, 96
    # the loop (tiles off) and the 2-D tiles: 3 checkpoints are one tile of four with a padding row, 5 are
    # tiles of two, the last with one (kernels/rmsnorm/triton.py score_tile)
    default_tiles = norm_triton.MIX_SCORE_TILES
    for tiles, num_checkpoints in [(False, 0), (False, 1), (False, 3), (True, 1), (True, 3), (True, 5)]:
        norm_triton.MIX_SCORE_TILES = tiles
        current = torch.randn(M, d, generator=gen) * 3
        ckpts = torch.randn(num_checkpoints, M, d, generator=gen) * 2
        mix_norm, mix_proj, out_norm = (torch.rand(d, generator=gen) + 0.5 for _ in range(3))
        mix_proj /= d**0.5  # scores of order 1: every candidate weighs in (of order sqrt(d), one takes all)
        want = norm_ref.attn_res_mix_norm(current.double(), ckpts.double(), mix_norm.double(), mix_proj.double(),
                                          out_norm.double(), 1e-6)
        got = norm_triton.attn_res_mix_norm(current, ckpts, mix_norm, mix_proj, out_norm, 1e-6,
                                            out=torch.full((M, d), float("nan")))
        close(got, want, f"attn_res_mix_norm with {num_checkpoints} checkpoints, tiles {tiles}")
        residual, delta = current[:, :d], torch.randn(M, d + 8, generator=gen)[:, 4 : 4 + d]  # strided delta rows
        want_out, want_total = norm_ref.add_attn_res_mix_norm(
            residual.double(), delta.double(), ckpts.double(), mix_norm.double(), mix_proj.double(), out_norm.double(), 1e-6)
        got_out, got_total = norm_triton.add_attn_res_mix_norm(
            residual, delta, ckpts, mix_norm, mix_proj, out_norm, 1e-6, out=torch.full((M, d), float("nan")),
            total=torch.full((M, d), float("nan")))
        close(got_total, want_total, f"add_attn_res_mix_norm's sum with {num_checkpoints} checkpoints")
        close(got_out, want_out, f"add_attn_res_mix_norm with {num_checkpoints} checkpoints, tiles {tiles}")
        check_mix_norm_of_partials(gen, residual, ckpts, mix_norm, mix_proj, out_norm)
    norm_triton.MIX_SCORE_TILES = default_tiles
    rows, n = 3, 1500  # two column blocks, the second partial
    gate, up = (torch.randn(rows, n, generator=gen) * 4 for _ in range(2))
    gate[0, :4] = torch.tensor([80.0, -80.0, 0.0, 1e-3])  # tanh's saturated ends and its centre
    close(act_triton.situ_glu(gate, up, 3.0, 5.0, out=torch.full((rows, n), float("nan"))),
          act_ref.situ_glu(gate.double(), up.double(), 3.0, 5.0), "situ_glu")
    x = torch.randn(rows, n, generator=gen)
    close(act_triton.sigmoid_gate(x, gate, out=torch.full((rows, n), float("nan"))),
          act_ref.sigmoid_gate(x.double(), gate.double()), "sigmoid_gate")
    close(act_triton.silu_mul(gate, up, out=torch.full((rows, n), float("nan"))),
          act_ref.silu_mul(gate.double(), up.double()), "silu_mul")
    check_silu_mul_of_partials(gen)
    check_add_rms_norm(gen)
    check_route(gen)
    check_router_logits_gemv(gen)
    check_combine(gen)
    check_gather_tokens(gen)
    check_lists_and_tokens(gen)
    check_dispatch_inputs(gen)
    default_block = moe_triton.TAIL_BLOCK
    for block in (default_block, 256):  # 1024 (the default) and 256: the shared columns in 2 or 5 programs
        moe_triton.TAIL_BLOCK = block
        check_tail_inputs(gen)
    moe_triton.TAIL_BLOCK = default_block
    check_inputs_gemm_windows(gen)
    check_cache_rows(gen)
    check_absorb(gen)
    check_draft_loss(gen)
    check_markov(gen)
    check_draft_confidence(gen)
    check_rotary(gen)
    print("triton kernels: all checks passed")


def check_silu_mul_of_partials(gen: torch.Generator) -> None:
    """silu_mul of a gate | up GEMM's split-K partials [S, M, 2n] (its two column halves, strided rows)
    against float64; a sum without the last part is shown to miss the tolerance first."""
    for parts, rows, n in ((3, 2, 1500), (14, 7, 96)):
        partials = torch.randn(parts, rows, 2 * n, generator=gen)
        gate, up = partials.chunk(2, dim=-1)
        want = act_ref.silu_mul(gate.double().sum(0), up.double().sum(0))
        short = act_ref.silu_mul(gate[:-1].double().sum(0), up[:-1].double().sum(0))
        if not (short - want).abs().max().item() > ATOL:
            sys.exit("silu_mul of partials: the check cannot tell a missing part")
        got = act_triton.silu_mul(gate, up, torch.float32, out=torch.full((rows, n), float("nan")))
        close(got, want, f"silu_mul of {parts} partials")


def check_mix_norm_of_partials(gen, residual, ckpts, mix_norm, mix_proj, out_norm) -> None:
    """delta as a GEMM's split-K partials [S, M, d] (ops.linear_partials): the norm adds all S of them
    (a sum without the last part is shown to miss the tolerance first)."""
    M, d = residual.shape
    partials = torch.randn(3, M, d + 8, generator=gen)[:, :, :d]  # strided rows, as a view may have them
    args = (ckpts.double(), mix_norm.double(), mix_proj.double(), out_norm.double(), 1e-6)
    want_out, want_total = norm_ref.add_attn_res_mix_norm(residual.double(), partials.double(), *args)
    _, short_total = norm_ref.add_attn_res_mix_norm(residual.double(), partials[:2].double(), *args)
    if not (short_total - want_total).abs().max().item() > ATOL:
        sys.exit("mix norm of partials: the check cannot tell a missing partial")
    got_out, got_total = norm_triton.add_attn_res_mix_norm(
        residual, partials, ckpts, mix_norm, mix_proj, out_norm, 1e-6, out=torch.full((M, d), float("nan")),
        total=torch.full((M, d), float("nan")))
    close(got_total, want_total, f"add_attn_res_mix_norm's sum of 3 partials, {ckpts.shape[0]} checkpoints")
    close(got_out, want_out, f"add_attn_res_mix_norm of 3 partials, {ckpts.shape[0]} checkpoints")


def check_add_rms_norm(gen: torch.Generator, device: str = "cpu", dtype=torch.float32, atol: float = ATOL) -> None:
    """The drafter's residual add + RMSNorm (ops.add_rms_norm) against float64, on 4-D rows as the drafter's
    blocks have them and on strided 2-D rows, delta as one tensor and as a GEMM's split-K partials [S, *shape]
    in fp32 (ops.linear_partials, its rows viewed in the residual's shape: all S added, where a sum without
    the last part is shown to miss the tolerance first); out and total poisoned first."""
    for shape, width in (((1, 1, 7, 448), 448), ((3, 100), 100), ((2, 7168), 7168)):
        residual = (torch.randn(*shape, generator=gen) * 2 + 0.5).to(device, dtype)
        wide = torch.randn(*shape[:-1], width + 16, generator=gen)
        delta = (wide[..., 8 : 8 + width] if len(shape) == 2 else torch.randn(*shape, generator=gen)).to(device, dtype)
        weight = (torch.rand(width, generator=gen) + 0.5).to(device, dtype)
        partials = torch.randn(3, *shape, generator=gen).to(device)
        _, short_total = norm_ref.add_rms_norm(residual.double(), partials[:2].double(), weight.double(), 1e-6)
        _, full_total = norm_ref.add_rms_norm(residual.double(), partials.double(), weight.double(), 1e-6)
        if not (short_total - full_total).abs().max().item() > atol:
            sys.exit("add_rms_norm of partials: the check cannot tell a missing partial")
        for given, kind in ((delta, "delta"), (partials, "3 partials")):
            want_out, want_total = norm_ref.add_rms_norm(residual.double(), given.double(), weight.double(), 1e-6)
            poison = dict(dtype=dtype, device=device)
            got_out, got_total = norm_triton.add_rms_norm(residual, given, weight, 1e-6,
                                                          out=torch.full(shape, float("nan"), **poison),
                                                          total=torch.full(shape, float("nan"), **poison))
            for got, want, what in ((got_total, want_total, "sum"), (got_out, want_out, "norm")):
                err = (got.double() - want).abs().max().item()
                if got.shape != want.shape or not err < atol:
                    sys.exit(f"add_rms_norm {what} of a {kind} {shape} {dtype}: max abs error {err:.2e} >= {atol}")


def check_route(gen: torch.Generator, device: str = "cpu") -> None:
    """moe_route's selection against float64 (see check_selection). Inputs are drawn on the CPU,
    the kernel runs on `device` (tests/gpu/test_triton_kernels_gpu.py)."""
    for experts, top_k, repeated in ((896, 16, False), (896, 16, True), (100, 3, False)):
        logits = torch.randn(7, experts + 5, generator=gen)[:, :experts] * 2  # strided rows
        bias = torch.randn(experts, generator=gen) * 0.1
        if repeated:  # a few experts win every token (the bias chooses, never weighs)
            bias[torch.randperm(experts, generator=gen)[:top_k]] += 10.0
        ids = torch.full((7, top_k), -1, dtype=torch.long, device=device)
        weights = torch.full((7, top_k), float("nan"), device=device)
        moe_triton.route_logits(logits.to(device), bias.to(device), top_k, 2.5, ids=ids, weights=weights)
        check_selection(ids.cpu(), weights.cpu(), logits.double(), bias, top_k,
                        f"moe_route E={experts} k={top_k}{' repeated' if repeated else ''}")


def check_rotary(gen: torch.Generator, device: str = "cpu", dtype=torch.float32, rotate=None) -> None:
    """rotary against float64, both pair layouts: a query's rope part (a column slice of its heads:
    strided rows, heads not a power of two) and a single key head; the output poisoned with NaN.
    bf16 inputs: within one bf16 rounding of the float64 value (2^-8 relative, on O(1) values).
    rotate: the implementation (default: the Triton one), called as rotate(x, cos, sin, interleaved, out=...)."""
    from dspark.kernels.rotary import triton as rotary_triton

    rotate = rotate or rotary_triton.rotary

    tol = ATOL if dtype == torch.float32 else 2.0**-7
    for heads, nope, dim in ((6, 16, 64), (1, 0, 8)):
        for interleaved in (True, False):
            q = torch.randn(2, 3, 7, heads, nope + dim, generator=gen)
            x = q[..., nope:].to(dtype)
            angles = torch.rand(2, 3, 7, 1, dim // 2, generator=gen, dtype=torch.float64) * 100
            cos, sin = angles.cos() * 1.3, angles.sin() * 1.3  # a YaRN mscale
            xd = x.double()
            a, b = (xd[..., 0::2], xd[..., 1::2]) if interleaved else (xd[..., : dim // 2], xd[..., dim // 2 :])
            ra, rb = a * cos - b * sin, a * sin + b * cos
            want = torch.stack([ra, rb], -1).flatten(-2) if interleaved else torch.cat([ra, rb], -1)
            out = torch.full(x.shape, float("nan"), dtype=dtype, device=device)
            got = rotate(x.to(device), cos.float().to(device), sin.float().to(device), interleaved, out=out).cpu()
            err = ((got.double() - want).abs() / want.abs().clamp(min=1.0)).max().item()
            if not err < tol or not torch.isfinite(got).all():
                sys.exit(f"rotary heads {heads} dim {dim} interleaved={interleaved} {dtype}: error {err:.2e} >= {tol}")


MARKOV_TOL = 1e-4  # float32 sums of r <= 256 products of O(1) values and a float32 add, against float64


def check_markov(gen: torch.Generator, device: str = "cpu", dtype=torch.float32, cases=((3, 7, 1000, 48), (2, 4, 300, 256)),
                 draft=None, base_dtype=torch.float32) -> None:
    """markov_greedy_draft against float64 (cases: B, G, V, r; a partial last vocabulary block and
    r not a multiple of the kernel's rank step). Ties aside, the tokens must equal float64's
    argmax chain, so each slot is checked given the kernel's own previous token: its token's
    float64 logit is within MARKOV_TOL of the slot's maximum, and it is the float64 argmax itself
    wherever the top two are further apart than that. The Markov bias (std ~sqrt(r)) outweighs the
    base logits (std 1), so a wrong previous token moves the argmax. Then an exact tie across two
    vocabulary blocks, which must go to the lower index. Inputs are drawn on the CPU, the output
    poisoned with -1; bf16 weights round the bias to bf16 (the tolerance then allows that).
    draft: the implementation (default: the Triton one), called as draft(base, anchors, w1, w2, out=...).
    base_dtype: the base logits' (bf16: the LM head's product as the drafter passes it, widened on load;
    float64 reads the rounded values)."""
    from dspark.kernels.markov import triton as markov_triton

    draft = draft or markov_triton.markov_greedy_draft

    # bf16: the bias is rounded to bf16, half a unit of up to ~64 (4 std at r = 256) is 0.125 a logit
    tol = MARKOV_TOL if dtype == torch.float32 else 0.3
    for B, G, V, r in cases:
        base = torch.randn(B, G, V + 3, generator=gen).to(base_dtype)[..., :V]  # strided rows, as a slice of wider logits
        w1, w2 = torch.randn(V + 5, r, generator=gen), torch.randn(V, r, generator=gen)
        w1, w2 = w1.to(dtype), w2.to(dtype)
        anchors = torch.randint(0, V, (B,), generator=gen)
        out = torch.full((B, G), -1, dtype=torch.long, device=device)
        got = draft(base.to(device), anchors.to(device), w1.to(device), w2.to(device), out=out).cpu()
        prev = anchors
        for k in range(G):
            logits = base[:, k].double() + w1.double()[prev] @ w2.double().T
            top2 = logits.topk(2, dim=-1).values
            chosen = logits.gather(1, got[:, k : k + 1]).squeeze(1)
            if not ((got[:, k] >= 0) & (got[:, k] < V)).all() or not (top2[:, 0] - chosen <= tol).all():
                sys.exit(f"markov_greedy_draft B={B} V={V} r={r} slot {k}: tokens {got[:, k].tolist()} are not "
                         f"argmaxes (shortfall {(top2[:, 0] - chosen).max().item():.2e})")
            clear = top2[:, 0] - top2[:, 1] > tol
            if not (got[clear, k] == logits.argmax(dim=-1)[clear]).all():
                sys.exit(f"markov_greedy_draft B={B} V={V} r={r} slot {k}: differs from the float64 argmax")
            prev = got[:, k]
    V, r = 300, 16
    base = torch.randn(1, 2, V, generator=gen)
    w1, w2 = torch.randn(V, r, generator=gen).to(dtype), torch.randn(V, r, generator=gen).to(dtype)
    low, high = 40, 250  # different 32-wide blocks
    w2[high] = w2[low]
    base[0, :, high] = base[0, :, low] = 1e4
    got = draft(base.to(device), torch.tensor([7], device=device), w1.to(device), w2.to(device),
                out=torch.full((1, 2), -1, dtype=torch.long, device=device)).cpu()
    if got.tolist() != [[low, low]]:
        sys.exit(f"markov_greedy_draft: a tie between ids {low} and {high} drafted {got.tolist()}, not the lower id")


CONF_TOL = 1e-4  # float32 sums of up to d + r = 9256 products, logits of order 1, against float64
CONF_PROB_TOL = 1e-6  # a float32 division and sigmoid of the kernel's own logit, against float64


def check_draft_confidence(gen: torch.Generator, device: str = "cpu", dtype=torch.float32, confidence=None,
                           cases=((1, 64, 48), (3, 64, 48), (1, 100, 24), (3, 100, 24), (1, 7168, 256),
                                  (3, 7168, 256), (1, 9000, 40))) -> None:
    """draft_confidence against float64 (cases: B, d, r at G = 7; d = 100 not a power of two, 7168 K3's
    drafter, 9000 past the kernel's widest step, so two), each with and without w1, bias and
    temperatures. hidden's and w1's rows are strided, tokens a transposed view; the outputs are
    poisoned (NaN) first. Weights are scaled so that both the hidden and the Markov terms of a logit
    are of order 1 (the sigmoid unsaturated, and a lookup of the wrong previous token moves the logit by
    far more than the tolerance: checked). Logits: within CONF_TOL of float64's for float32 inputs;
    bf16 / fp16 inputs round the logit to their dtype, so within half a unit in its last place more.
    Probs: within CONF_PROB_TOL of float64's sigmoid(logit / T_k) of the logit returned. main runs
    float32 only: Triton's interpreter truncates a float32 -> bf16 cast where the GPU rounds to
    nearest, so bf16 is checked on the GPU (tests/gpu/test_triton_kernels_gpu.py).
    confidence: the implementation (default: the Triton one), called with out=(logits, probs)."""
    from dspark.kernels.markov import triton as markov_triton

    confidence = confidence or markov_triton.draft_confidence
    G, V = 7, 500
    for B, d, r in cases:
        hidden = torch.randn(B, G, d + 8, generator=gen).to(dtype)[..., 4 : 4 + d]  # strided rows
        anchors = torch.randint(0, V, (B,), generator=gen)
        tokens = torch.randint(0, V, (G, B), generator=gen).T  # strides (1, B)
        w1 = (torch.randn(V, r + 8, generator=gen) * 2).to(dtype)[:, :r]
        weight = torch.cat([torch.randn(d, generator=gen) / d**0.5, torch.randn(r, generator=gen) / r**0.5]).to(dtype)
        bias = torch.randn(1, generator=gen).to(dtype)
        temps = torch.rand(G, generator=gen) * 2 + 0.5
        prev = torch.cat([anchors[:, None], tokens[:, :-1]], dim=1)
        markov = (w1.double()[prev] * weight[d:].double()).sum(-1)
        if not (markov - (w1.double()[tokens] * weight[d:].double()).sum(-1)).abs().max().item() > 100 * CONF_TOL:
            sys.exit("draft_confidence: the check cannot tell the previous token from the slot's own")
        for with_w1, with_bias, with_temps in itertools.product((True, False), repeat=3):
            what = (f"draft_confidence B={B} d={d} r={r} w1={with_w1} bias={with_bias} temperatures={with_temps} "
                    f"{dtype}")
            want = (hidden.double() * weight[:d].double()).sum(-1)
            want = want + (markov if with_w1 else 0) + (bias.double() if with_bias else 0)
            out = tuple(torch.full((B, G), float("nan"), device=device) for _ in range(2))
            args = (hidden, anchors, tokens, w1 if with_w1 else None, weight if with_w1 else weight[:d],
                    bias if with_bias else None, temps if with_temps else None)
            logits, probs = confidence(*(None if t is None else same_strides(t, device) for t in args), out=out)
            logits, probs = logits.cpu().double(), probs.cpu().double()
            finite = torch.isfinite(logits).all() and torch.isfinite(probs).all()
            if logits.shape != (B, G) or probs.shape != (B, G) or not finite:
                sys.exit(f"{what}: shapes {tuple(logits.shape)}, {tuple(probs.shape)} or non-finite (unwritten) "
                         "output")
            bound = torch.full_like(want, CONF_TOL)
            if dtype != torch.float32:
                bound += 0.5 * torch.maximum(ulp(want, dtype), ulp(logits, dtype))
            err = (logits - want).abs()
            if not (err <= bound).all():
                sys.exit(f"{what}: logits off float64's by {err.max().item():.2e} ({(err / bound).max().item():.2f}x "
                         f"the bound)")
            want_probs = torch.sigmoid(logits / temps.double() if with_temps else logits)
            err = (probs - want_probs).abs().max().item()
            if not err <= CONF_PROB_TOL:
                sys.exit(f"{what}: probs off float64's sigmoid by {err:.2e} >= {CONF_PROB_TOL}")


def same_strides(t: torch.Tensor, device: str) -> torch.Tensor:
    """t on `device` with its strides (a copy by .to() is made contiguous where t is not dense)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device).copy_(t)


def ulp(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` (bf16 or fp16, normal numbers) at each |v|."""
    mantissa = {torch.bfloat16: 7, torch.float16: 10}[dtype]
    return torch.exp2(torch.floor(torch.log2(v.double().abs().clamp(min=2.0**-14))) - mantissa)


def check_combine(gen: torch.Generator, device: str = "cpu", tokens: int = 3, top_k: int = 16,
                  width: int = 1500) -> None:
    """weighted_combine against the float64 weighted sum: pairs scattered over the rows in a
    random order (as the expert lists place them), spare rows poisoned with NaN (never read), a
    width that leaves the last column block partial; as one output per row and as the partial
    sums of a K split in 3 parts (pass 2's [splits, P, latent]). Inputs are drawn on the CPU."""
    pairs = tokens * top_k
    position = torch.randperm(pairs + 5, generator=gen)[:pairs].view(tokens, top_k)
    spare = torch.ones(pairs + 5, dtype=torch.bool)
    spare[position.flatten()] = False
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    for splits in (None, 3):
        rows = torch.randn(*(() if splits is None else (splits,)), pairs + 5, width, generator=gen)
        rows[..., spare, :] = float("nan")
        whole = rows.double() if splits is None else rows.double().sum(dim=0)
        want = (weights.double().unsqueeze(-1) * whole[position]).sum(dim=1)
        out = torch.full((tokens, width), float("nan"), device=device)
        got = moe_triton.weighted_combine(rows.to(device), position.to(device), weights.to(device), out=out)
        close(got.cpu(), want, f"weighted_combine T={tokens} k={top_k} width={width} splits={splits}")


def check_tail_inputs(gen: torch.Generator, device: str = "cpu", dtype=torch.float32) -> None:
    """moe_tail_inputs against its reference in float64: the norm over all of a latent row of
    non-power-of-two width with a window that is not the whole row (a rank's) or is (the whole
    model's), and a shared activation of two column blocks, the second partial (strided rows, as
    a column slice of a wider GEMM output); the output poisoned with NaN. Inputs are drawn on the CPU."""
    from dspark.kernels.moe import reference as moe_ref

    for latent, start, width, shared in ((3584, 448, 224, 1100), (96, 0, 96, 40)):
        routed = torch.randn(5, latent, generator=gen) * 3
        norm = torch.rand(latent, generator=gen) + 0.5
        gate_up = (torch.randn(5, 2 * shared + 8, generator=gen) * 4)[:, 4 : 4 + 2 * shared]
        gate_up[0, :3] = torch.tensor([80.0, -80.0, 1e-3])  # tanh's saturated ends and its centre
        want = moe_ref.moe_tail_inputs(routed.double(), norm.double(), gate_up.double(), start, width, 1e-6, 3.0,
                                       5.0)
        out = torch.full((5, width + shared), float("nan"), dtype=dtype, device=device)
        got = moe_triton.moe_tail_inputs(routed.to(device), norm.to(device), gate_up.to(device, dtype), start, width,
                                         1e-6, 3.0, 5.0, out=out)
        close(got.cpu(), want, f"moe_tail_inputs latent {latent} [{start}, +{width}) shared {shared}")
    # gate|up as split-K partials [3, M, 2S] (ops.linear_partials): every part added before the activation
    partials = torch.randn(3, 5, 2 * shared, generator=gen) * 2
    want = moe_ref.moe_tail_inputs(routed.double(), norm.double(), partials.double(), start, width, 1e-6, 3.0, 5.0)
    short = moe_ref.moe_tail_inputs(routed.double(), norm.double(), partials[:2].double(), start, width, 1e-6, 3.0,
                                    5.0)
    if not (short - want).abs().max().item() > ATOL:
        sys.exit("moe_tail_inputs of partials: the check cannot tell a missing partial")
    out = torch.full((5, width + shared), float("nan"), dtype=dtype, device=device)
    got = moe_triton.moe_tail_inputs(routed.to(device), norm.to(device, dtype), partials.to(device), start, width,
                                     1e-6, 3.0, 5.0, out=out)
    close(got.cpu(), want, f"moe_tail_inputs of 3 partials, shared {shared}")


def check_cache_rows(gen: torch.Generator, device: str = "cpu", dtype=torch.float32) -> None:
    """mla_cache_rows against its reference: a ragged batch (padding tokens on the spare rows) over
    a pool of slots with strided kv rows; the norm to ATOL, k_pe and every untouched row exactly.
    Inputs are drawn on the CPU; the cache poisoned with NaN except the rows already committed."""
    from dspark.kernels.mla import reference as mla_ref
    from dspark.kernels.mla import triton as mla_triton

    B, T, R, P, L = 3, 4, 512, 64, 40
    kv = (torch.randn(B * T, R + P + 16, generator=gen) * 2)[:, 8 : 8 + R + P]
    weight = torch.rand(R, generator=gen) + 0.5
    cache = torch.full((5, L + 1, R + P), float("nan"))
    slots, cache_lens, lengths = torch.tensor([4, 0, 2]), torch.tensor([0, 7, L - 2]), torch.tensor([4, 1, 2])
    want = cache.clone()
    mla_ref.mla_cache_rows(kv, weight, 1e-6, want, slots, cache_lens, lengths)
    got = cache.to(device=device, dtype=dtype)
    mla_triton.mla_cache_rows(kv.to(device, dtype), weight.to(device), 1e-6, got, slots.to(device), cache_lens.to(device),
                              lengths.to(device))
    got = got.cpu()
    if not torch.equal(got.isnan(), want.isnan()):
        sys.exit("mla_cache_rows: wrote other rows than the reference")
    written = ~want.isnan().all(-1)
    written[:, L] = False  # a spare row holds one of its slot's padding rows, which one is unspecified
    close(got[written][:, :R], want[written][:, :R].double(), "mla_cache_rows' normalised c_kv")
    if not torch.equal(got[written][:, R:], want[written][:, R:]):
        sys.exit("mla_cache_rows: k_pe differs from the reference")
    for interleaved in (False, True):  # the drafter's RoPE in the same launch: k_pe rotated before it is stored
        angles = torch.rand(B * T, P // 2, generator=gen) * 6.3
        rope = (angles.cos() * 1.1, angles.sin() * 1.1, interleaved)  # a YaRN-like scale on both tables
        want = cache.clone()
        mla_ref.mla_cache_rows(kv, weight, 1e-6, want, slots, cache_lens, lengths, rope)
        got = cache.to(device=device, dtype=dtype)
        mla_triton.mla_cache_rows(kv.to(device, dtype), weight.to(device), 1e-6, got, slots.to(device),
                                  cache_lens.to(device), lengths.to(device), tuple(r.to(device) for r in rope[:2]) + rope[2:])
        got = got.cpu()
        if not torch.equal(got.isnan(), want.isnan()):
            sys.exit(f"mla_cache_rows with rope (interleaved={interleaved}): wrote other rows than the reference")
        close(got[written][:, R:], want[written][:, R:].double(), f"mla_cache_rows' rotated k_pe (interleaved={interleaved})")
    check_cache_rows_with_q(gen, device, dtype)
    if dtype == torch.float32:
        check_cache_rows_of_partials(gen, device)


def check_cache_rows_of_partials(gen: torch.Generator, device: str = "cpu", parts: int = 5, Q: int = 1536) -> None:
    """mla_cache_rows(dtype=float32) of one q_a | kv_a GEMM's split-K partials [S, M, Q + R + P] (c_q and kv
    column slices of each partial): the cache rows and the normalised c_q against float64 of the summed
    partials, with and without rope; a sum without the last part is shown to miss the tolerance first."""
    from dspark.kernels.mla import reference as mla_ref
    from dspark.kernels.mla import triton as mla_triton

    B, T, R, P, L = 2, 3, 512, 64, 30
    fused = torch.randn(parts, B * T, Q + R + P + 8, generator=gen) * 0.7
    c_q, kv = fused[..., 8 : 8 + Q], fused[..., 8 + Q :]
    weight, q_weight = torch.rand(R, generator=gen) + 0.5, torch.rand(Q, generator=gen) + 0.5
    slots, cache_lens, lengths = torch.tensor([3, 1]), torch.tensor([4, L - 3]), torch.tensor([3, 2])
    index = (slots.to(device), cache_lens.to(device), lengths.to(device))
    want_q = norm_ref.rms_norm(c_q.double().sum(0), q_weight.double(), 1e-6)
    short_q = norm_ref.rms_norm(c_q[:-1].double().sum(0), q_weight.double(), 1e-6)
    if not (short_q - want_q).abs().max().item() > ATOL:
        sys.exit("mla_cache_rows of partials: the check cannot tell a missing part")
    angles = torch.rand(B * T, P // 2, generator=gen) * 6.3
    for rope in (None, (angles.cos().to(device), angles.sin().to(device), False)):
        start = torch.randn(4, L + 1, R + P, generator=gen)
        want = start.double().clone()
        mla_ref.mla_cache_rows(kv.double().sum(0), weight.double(), 1e-6, want, slots, cache_lens, lengths,
                               None if rope is None else (rope[0].cpu(), rope[1].cpu(), False))
        cache = start.to(device)
        got_q = mla_triton.mla_cache_rows(kv.to(device), weight.to(device), 1e-6, cache, *index, rope,
                                          q=(c_q.to(device), q_weight.to(device)), dtype=torch.float32,
                                          q_out=torch.full((B * T, Q), float("nan"), device=device))
        close(got_q.cpu(), want_q, f"mla_cache_rows' normalised c_q of {parts} partials (rope {rope is not None})")
        close(cache.cpu(), want, f"mla_cache_rows' rows of {parts} partials (rope {rope is not None})")


def check_cache_rows_with_q(gen: torch.Generator, device: str = "cpu", dtype=torch.float32, Q: int = 1536) -> None:
    """mla_cache_rows with q = (c_q, q_norm_weight): c_q and kv column slices of one q_a | kv_a GEMM
    output (strided rows), K3's widths; the returned c_q (poisoned first) against float64 of K3's
    rms_norm, every row (the padding tokens' too), and the cache rows bit for bit those of the launch
    without q; without and with the rope tables (both constexpr branches beside Q_NORM)."""
    from dspark.kernels.mla import reference as mla_ref
    from dspark.kernels.mla import triton as mla_triton

    B, T, R, P, L = 3, 4, 512, 64, 40
    fused = torch.randn(B * T, Q + R + P + 24, generator=gen) * 2 + 0.3
    c_q, kv = fused[:, 8 : 8 + Q], fused[:, 8 + Q : 8 + Q + R + P]
    weight, q_weight = torch.rand(R, generator=gen) + 0.5, torch.rand(Q, generator=gen) + 0.5
    slots, cache_lens, lengths = torch.tensor([4, 0, 2]), torch.tensor([0, 7, L - 2]), torch.tensor([4, 1, 2])
    want_q = norm_ref.rms_norm(c_q.double(), q_weight.double(), 1e-6)
    unweighted = norm_ref.rms_norm(c_q.double(), torch.ones(Q, dtype=torch.float64), 1e-6)
    if not (unweighted - want_q).abs().max().item() > ATOL:
        sys.exit("mla_cache_rows with q: the check cannot tell a missing q_norm_weight")
    angles = torch.rand(B * T, P // 2, generator=gen) * 6.3
    index = (slots.to(device), cache_lens.to(device), lengths.to(device))
    for rope in (None, (angles.cos().to(device), angles.sin().to(device), True)):
        cache = torch.randn(5, L + 1, R + P, generator=gen).to(device, dtype)
        plain = cache.clone()
        if mla_triton.mla_cache_rows(kv.to(device, dtype), weight.to(device), 1e-6, plain, *index, rope) is not None:
            sys.exit("mla_cache_rows without q: returned something")
        q_out = torch.full((B * T, Q), float("nan"), dtype=dtype, device=device)
        got = mla_triton.mla_cache_rows(kv.to(device, dtype), weight.to(device), 1e-6, cache, *index, rope,
                                        q=(c_q.to(device, dtype), q_weight.to(device)), q_out=q_out)
        if got is not q_out:
            sys.exit("mla_cache_rows with q: did not return its q_out buffer")
        close(got.cpu(), want_q, f"mla_cache_rows' normalised c_q (rope {rope is not None})")
        if not torch.equal(cache, plain):
            sys.exit(f"mla_cache_rows with q (rope {rope is not None}): the cache differs from the launch without q")


def check_absorb(gen: torch.Generator, device: str = "cpu", dtype=torch.float32) -> None:
    """mla_absorb_q / mla_absorb_output against float64: a row count that is not a tile's (the
    rows and columns masked), several column blocks per head, q_pe copied exactly, the gate's
    strided rows; outputs poisoned with NaN. Inputs are drawn on the CPU."""
    from dspark.kernels.mla import triton as mla_triton

    M, H, R, nope, P, V = 5, 3, 192, 64, 32, 96
    q = torch.randn(M, H, nope + P, generator=gen)
    w_uk_t = torch.randn(H, R, nope, generator=gen) * nope**-0.5
    out, pe = (torch.full(shape, float("nan"), dtype=dtype, device=device) for shape in ((M, H, R), (M, H, P)))
    mla_triton.mla_absorb_q(q.to(device, dtype), w_uk_t.to(device, dtype), out=out, pe=pe)
    close(out.cpu(), torch.einsum("mhk,hrk->mhr", q[:, :, :nope].double(), w_uk_t.double()), "mla_absorb_q")
    if not torch.equal(pe.cpu(), q[:, :, nope:].to(dtype)):
        sys.exit("mla_absorb_q: q_pe is not the rope columns")
    from dspark.kernels.mla import reference as mla_ref

    for interleaved in (False, True):  # the drafter's RoPE in absorb_q's copy of q_pe
        angles = torch.rand(M, P // 2, generator=gen) * 6.3
        rope = (angles.cos(), angles.sin(), interleaved)
        pe = torch.full((M, H, P), float("nan"), dtype=dtype, device=device)
        mla_triton.mla_absorb_q(q.to(device, dtype), w_uk_t.to(device, dtype), tuple(r.to(device) for r in rope[:2])
                                + rope[2:], pe=pe)
        _, want = mla_ref.mla_absorb_q(q.double(), w_uk_t.double(), rope)
        close(pe.cpu(), want, f"mla_absorb_q's rotated q_pe (interleaved={interleaved})")
    o_latent = torch.randn(M, H, R, generator=gen)
    w_uv = torch.randn(H, V, R, generator=gen) * R**-0.5
    gate = (torch.randn(M, H * V + 8, generator=gen) * 2)[:, 4 : 4 + H * V]
    out = torch.full((M, H * V), float("nan"), dtype=dtype, device=device)
    mla_triton.mla_absorb_output(o_latent.to(device, dtype), w_uv.to(device, dtype), gate.to(device, dtype), out=out)
    product = torch.einsum("mhr,hvr->mhv", o_latent.double(), w_uv.double()).reshape(M, H * V)
    close(out.cpu(), product * torch.sigmoid(gate.double()), "mla_absorb_output")
    if dtype == torch.float32:  # the gate as its GEMM's split-K partials (column slices of each), summed first
        parts = torch.randn(4, M, H * V + 8, generator=gen)[..., 4 : 4 + H * V]
        want = product * torch.sigmoid(parts.double().sum(0))
        if not (product * torch.sigmoid(parts[:-1].double().sum(0)) - want).abs().max().item() > ATOL:
            sys.exit("mla_absorb_output of partials: the check cannot tell a missing part")
        out = torch.full((M, H * V), float("nan"), dtype=dtype, device=device)
        mla_triton.mla_absorb_output(o_latent.to(device), w_uv.to(device), parts.to(device), out=out)
        close(out.cpu(), want, "mla_absorb_output with the gate's 4 split-K partials")
    out = torch.full((M, H, V), float("nan"), dtype=dtype, device=device)  # ungated: linear_heads
    strided = torch.randn(M, H, R + 8, generator=gen)[:, :, :R]  # the attention output's rows may be strided
    w_view = torch.randn(H, 2 * V, R, generator=gen)[:, V:] * R**-0.5  # W_UV as a view of kv_b_proj's weight
    mla_triton.linear_heads(strided.to(device, dtype), w_view.to(device, dtype), out=out)
    close(out.cpu(), torch.einsum("mhr,hvr->mhv", strided.double(), w_view.double()), "linear_heads")


def check_gather_tokens(gen: torch.Generator, device: str = "cpu", dtype=torch.float32, width: int = 640) -> None:
    """gather_tokens against expert_layout's torch composition (permute_k, the scale, the row
    gather), for both kernels' K orders: equal, as both only move values and scale them by a
    power of two. Strided x rows; the slots' token rows drawn at random, repeats included; the
    output poisoned with NaN. width: a multiple of 128 that leaves the last column block partial."""
    for order in ("sm90", "sm100"):
        x = (torch.randn(6, width + 16, generator=gen) * 3)[:, 8 : 8 + width].to(device=device, dtype=dtype)
        slot_tokens = torch.randint(0, 6, (5, 8), generator=gen).to(device)
        lists = expert_layout.ExpertLists(None, slot_tokens, None)
        want = (expert_layout.permute_k(x, order) * 2.0**expert_layout.B_SCALE_LOG2)[slot_tokens]
        out = torch.full((5, 8, width), float("nan"), dtype=dtype, device=device)
        got = moe_triton.gather_tokens(x, lists.slot_tokens, expert_layout.permutation(order, x.device),
                                       expert_layout.B_SCALE_LOG2, out=out)
        if not torch.equal(got, want):
            sys.exit(f"gather_tokens ({order} order): differs from permute_k + scale + gather")


LISTS_CASES = ((1, 3, 56, 8), (8, 2, 56, 8), (5, 16, 20, 8))  # under the interpreter: a program at a time
LISTS_CASES_GPU = LISTS_CASES + ((8, 16, 40, 8), (16, 16, 896, 16))  # 256 pairs: the most the lists take


def check_lists_and_tokens(gen: torch.Generator, device: str = "cpu", dtype=torch.float32, width: int = 256,
                           cases=LISTS_CASES) -> None:
    """lists_and_tokens (the expert lists in the token gather's launch) against build_expert_lists and the
    torch operand (permute_k, the scale, the row gather): equal, lists and operand, with every output
    poisoned by the allocator's garbage replaced first. Each row's experts are distinct; few experts
    (20, 40) make tokens share them, so ranks above 0 and pairs spread over several chunks of 16
    occur. cases: (tokens, k, experts, tile)."""
    perm = expert_layout.permutation("sm90", torch.device(device))
    for tokens, k, experts, tile in cases:
        ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)]).to(device)
        x = (torch.randn(tokens, width + 16, generator=gen) * 3)[:, 8 : 8 + width].to(device=device, dtype=dtype)
        want = expert_layout.build_expert_lists(ids, experts, tile)
        want_xb = (expert_layout.permute_k(x, "sm90") * 2.0**expert_layout.B_SCALE_LOG2)[want.slot_tokens]
        lists, xb = moe_triton.lists_and_tokens(x, ids, experts, tile, perm, expert_layout.B_SCALE_LOG2)
        what = f"lists_and_tokens {tokens}x{k} of {experts} experts, tile {tile}"
        for name in ("slot_expert", "slot_tokens", "pair_position"):
            if not torch.equal(getattr(lists, name), getattr(want, name)):
                sys.exit(f"{what}: {name} differs from build_expert_lists")
        if not torch.equal(xb, want_xb):
            sys.exit(f"{what}: the operand differs from permute_k + scale + gather")


def check_inputs_gemm_windows(gen: torch.Generator) -> None:
    """A rank's MoE inputs GEMM (INPUTS_IN_ONE_GEMM): one partials tensor [S, M, R + L + 2S'] whose first
    R + L columns feed moe_dispatch_inputs and the rest moe_tail_inputs, as column windows with the wide
    tensor's strides; each against float64 of its window."""
    from dspark.kernels.moe import reference as moe_ref

    R, L, shared, latent = 8, 40, 48, 96
    partials = torch.randn(3, 4, R + L + 2 * shared, generator=gen) * 2
    dispatch, gate_up = partials.split([R + L, 2 * shared], dim=-1)
    logits, latent_rows = moe_triton.moe_dispatch_inputs(dispatch, R, torch.float32, 2)
    total = dispatch.double().sum(0)
    close(logits, total[:, :R].repeat(1, 2), "moe_dispatch_inputs of a column window: logits")
    close(latent_rows, total[:, R:].repeat(1, 2), "moe_dispatch_inputs of a column window: latent")
    routed, norm = torch.randn(4, latent, generator=gen) * 3, torch.rand(latent, generator=gen) + 0.5
    want = moe_ref.moe_tail_inputs(routed.double(), norm.double(), gate_up.double(), 24, 24, 1e-6, 3.0, 5.0)
    got = moe_triton.moe_tail_inputs(routed, norm, gate_up, 24, 24, 1e-6, 3.0, 5.0,
                                     out=torch.full((4, 24 + shared), float("nan")))
    close(got, want, "moe_tail_inputs of a column window of partials")


def check_dispatch_inputs(gen: torch.Generator, device: str = "cpu", dtype=torch.float32,
                          cases=((1, 3, 56, 224, 16), (4, 23, 40, 600, 3), (2, 1, 8, 24, 1))) -> None:
    """moe_dispatch_inputs against float64: the partials added (every split counts: dropping the last one
    fails), router columns in fp32, latent columns in `dtype` (a half-precision one on the GPU only: equal
    to sum_partials' rounding), each written `copies` times; the outputs poisoned first. cases: (rows, splits, router columns, latent columns, copies); the second
    leaves the last column block partial."""
    for rows, splits, R, L, copies in cases:
        partials = (torch.randn(splits, rows, R + L, generator=gen) * 3).to(device)
        logits = torch.full((rows, copies * R), float("nan"), device=device)
        latent = torch.full((rows, copies * L), float("nan"), dtype=dtype, device=device)
        got_logits, got_latent = moe_triton.moe_dispatch_inputs(partials, R, dtype, copies, logits=logits,
                                                                 latent=latent)
        if got_logits.data_ptr() != logits.data_ptr() or got_latent.dtype != dtype:
            sys.exit("moe_dispatch_inputs: did not write the given outputs")
        total = partials.cpu().double().sum(0)
        what = f"moe_dispatch_inputs {rows}x{splits}x{R}+{L}x{copies} {dtype}"
        close(got_logits.cpu(), total[:, :R].repeat(1, copies), f"{what} logits")
        if dtype == torch.float32:
            close(got_latent.cpu(), total[:, R:].repeat(1, copies), f"{what} latent")
        elif not torch.equal(got_latent.cpu(), sum_partials(partials.cpu(), dtype)[:, R:].repeat(1, copies)):
            # on the GPU (the interpreter rounds half-precision toward zero): the fp32 sum in split
            # order rounded once, bit for bit
            sys.exit(f"{what} latent: not the fp32 sum rounded to {dtype}")
        if splits > 1:
            short = partials[:-1].cpu().double().sum(0)
            if (got_logits.cpu().double() - short[:, :R].repeat(1, copies)).abs().max() < ATOL:
                sys.exit(f"{what}: the last split was not added")


def check_router_logits_gemv(gen: torch.Generator, device: str = "cpu",
                             cases=((1, 56, 7168), (2, 56, 1000), (3, 40, 7168), (4, 9, 4095))) -> None:
    """router_logits_gemv (moe_router_logits at decode's few rows) against float64, for each row count
    it is built for: strided x and weight rows, a K that leaves the last chunk partial, float32 and bf16
    operands (their products exact in float32), the output poisoned first. cases: (rows, experts, K)."""
    for dtype in (torch.float32, torch.bfloat16):
        for rows, experts, k in cases:
            # strided rows on the device: slice after the copy (a copy of a slice is dense)
            x = torch.randn(rows, k + 8, generator=gen).to(device, dtype)[:, 4 : 4 + k]
            w = (torch.randn(experts, k + 16, generator=gen) * k**-0.5).to(device, dtype)[:, 8 : 8 + k]
            if x.stride(0) != k + 8 or w.stride(0) != k + 16:
                sys.exit("router_logits_gemv check: its rows are not strided")
            out = torch.full((rows, experts), float("nan"), device=device)
            got = moe_triton.router_logits_gemv(x, w, out=out)
            if got.data_ptr() != out.data_ptr():
                sys.exit("router_logits_gemv: did not write the given output")
            close(got.cpu(), x.cpu().double() @ w.cpu().double().T, f"router_logits_gemv {rows}x{experts}x{k} {dtype}")


def check_selection(ids, weights, logits: torch.Tensor, bias: torch.Tensor, top_k: int, what: str) -> None:
    """The chosen experts of every token are distinct, a top-k set of sigmoid(logit) + bias in
    descending order (up to ROUTE_TOL: the float32 sigmoid may reorder a near tie), and the
    weights are their float64 scores over the sum times 2.5. logits: float64 [M, E]."""
    experts = logits.shape[1]
    scores = torch.sigmoid(logits)
    keys = scores + bias.double()
    for t in range(logits.shape[0]):
        chosen = ids[t]
        if chosen.unique().numel() != top_k or chosen.min() < 0 or chosen.max() >= experts:
            sys.exit(f"{what}: token {t} chose {chosen.tolist()}")
        others = torch.ones(experts, dtype=torch.bool)
        others[chosen] = False
        if keys[t, chosen].min() < keys[t, others].max() - ROUTE_TOL or \
                (keys[t, chosen].diff() > ROUTE_TOL).any():
            sys.exit(f"{what}: token {t}: not the top-{top_k} in order")
        want = scores[t, chosen] / scores[t, chosen].sum() * 2.5
        err = ((weights[t].double() - want).abs() / want).max().item()
        if not err < ROUTE_TOL:
            sys.exit(f"{what}: token {t}: weights relative error {err:.2e} >= {ROUTE_TOL}")


def check_draft_loss(gen: torch.Generator, device: str = "cpu", positions: int = 9, rows: int = 5,
                     vocab: int = 3000) -> None:
    """draft_loss_terms' values and its backward's gradient against the float64 reference under
    autograd, for random upstream gradients of both terms. The vocabulary spans two blocks of the
    kernel, the second partial; several positions read the same target row. (Where a draft
    probability equals its target's the L1 has no derivative: random rows keep clear of that.)"""
    logits = (torch.randn(positions, vocab, generator=gen) * 3).to(device)
    probs = torch.softmax(torch.randn(rows, vocab, generator=gen) * 2, dim=-1).to(device)
    which = torch.randint(0, rows, (positions,), generator=gen).to(device)
    labels = torch.randint(0, vocab, (positions,), generator=gen).to(device)
    up_ce, up_l1 = (torch.randn(positions, generator=gen, dtype=torch.float64).to(device) for _ in range(2))
    for picked in (which, None):
        target = probs if picked is not None else probs[which]
        got = draft_loss_with_gradient(loss_triton.draft_loss_terms, logits, target, picked, labels, up_ce, up_l1)
        want = draft_loss_with_gradient(loss_ref.draft_loss_terms, logits.double(), target.double(), picked, labels,
                                        up_ce, up_l1)
        what = f"draft_loss_terms ({'rows' if picked is not None else 'no rows'})"
        for name, g, w in zip(("ce", "l1", "gradient"), got, want):
            close(g, w, f"{what}: {name}")


def draft_loss_with_gradient(fn, logits, target_probs, rows, labels, up_ce, up_l1):
    """(ce, l1, gradient): fn's terms on a leaf copy of logits, and the gradient there of
    sum(up_ce * ce + up_l1 * l1) (random upstream gradients, so both terms' backward is checked)."""
    leaf = logits.clone().requires_grad_(True)
    ce, l1 = fn(leaf, target_probs, rows, labels)
    ((ce.double() * up_ce).sum() + (l1.double() * up_l1).sum()).backward()
    return ce.detach(), l1.detach(), leaf.grad


F32_U, BF16_U = 2.0**-24, 2.0**-8  # unit roundoffs (round to nearest)
# The interpreter converts float32 to bf16 by truncation (triton/runtime/interpreter.py, _convert_float
# without a rounding mode): twice the error of the GPU's rounding to nearest.
INTERPRETER_BF16_U = 2.0**-7
# Unit roundoff of float32 accumulation in matrix products: tensor cores truncate rather than round,
# and align the terms of their multi-term adds to the largest with few extra bits (Fasi, Higham,
# Mikaitis and Pranesh, "Numerical behavior of NVIDIA tensor cores", PeerJ CS 2021): 4u covers both.
ACC_U = 4 * F32_U


class _PoisonedTorch:
    """torch, except that `empty` fills what it returns with NaN (floats) or -1 (integers): set
    as a kernel wrapper's `torch`, every buffer it allocates reads as poison where nothing wrote."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        out = torch.empty(*args, **kwargs)
        return out.fill_(float("nan") if out.is_floating_point() else -1)


def head_loss_with_gradients(fn, operands, target_probs, rows, labels, up_ce, up_l1, wanted=(True, True, True),
                             **options):
    """(ce, l1, d hidden, d prev_embedding, d markov_w2): fn's terms on leaf copies of the operands
    (hidden, prev_embedding, lm_head, markov_w2; lm_head stays frozen) and the gradients of
    sum(up_ce * ce + up_l1 * l1) (random upstream gradients reach both terms' backward) for the
    leaves `wanted` says require grad (None for the others). Without a teacher l1 is None and
    the sum has the ce term alone."""
    hidden, prev, lm_head, w2 = (t.detach().clone() for t in operands)
    leaves = [t.requires_grad_(True) for t, want in zip((hidden, prev, w2), wanted) if want]
    ce, l1 = fn(hidden, prev, lm_head, w2, target_probs, rows, labels, **options)
    total = (ce.double() * up_ce).sum() + (0.0 if l1 is None else (l1.double() * up_l1).sum())
    grads = iter(torch.autograd.grad(total, leaves))
    return (ce.detach(), None if l1 is None else l1.detach(), *(next(grads) if want else None for want in wanted))


def head_loss_expected(operands, target_probs, rows, labels, up_ce, up_l1, vocab_steps: int,
                       dz_rounding: float = BF16_U):
    """The float64 reference (head_reference under autograd) on the bf16-rounded operands, as
    (ce, l1, d hidden, d prev_embedding, d markov_w2), and a bound on each for the bf16 kernel,
    derived from its arithmetic (u = 2^-24, float32's unit roundoff; ACC_U for matrix products):
      z: a float32 dot over K terms, |dz| <= 1.01 K ACC_U (|x| |w|^T);
      sums over the vocabulary: float32, in at most vocab_steps sequential or tree steps, so
        relative error <= vocab_steps u; exp: 2^-20 relative, and u |argument|;
      lse, then ce = lse - z[label]; p = exp(z - lse) to relative error dz + dlse + rounding;
      l1 and S = sum sign(p - t) p: the sum of |dp| plus the sums' rounding, and for S 2 p where
        |p - t| <= |dp| (sign(p - t) may flip there: the kink of |.|);
      dL/dz: the same errors through g_ce (p - onehot) + g_l1 p (sign - S), then one bf16
        rounding (dz_rounding relative: 2^-8 rounding to nearest on the GPU; INTERPRETER_BF16_U
        under the interpreter);
      d[hidden ; prev] = dz w and d markov_w2 = dz^T prev: the dz error times |w| (|prev|) plus
        float32 accumulation over V (over the rows), 1.01 V ACC_U |dz| |w|; and one more bf16
        rounding where the gradient's dtype is bf16 (check_head_close).
    Every operand in `operands` is float64 already holding bf16 values."""
    hidden, prev, lm_head, w2 = operands
    want = head_loss_with_gradients(loss_head_ref.draft_head_loss, operands, target_probs.double(), rows, labels,
                                    up_ce, up_l1)
    d = hidden.shape[1]
    x, w = torch.cat([hidden, prev], dim=1), torch.cat([lm_head, w2], dim=1)
    target = (target_probs if rows is None else target_probs[rows]).double()
    z = x @ w.t()
    lse = z.logsumexp(dim=-1, keepdim=True)
    p = torch.exp(z - lse)
    onehot = torch.nn.functional.one_hot(labels, w.shape[0]).double()
    zerr = 1.01 * x.shape[1] * ACC_U * (x.abs() @ w.abs().t())
    rounding = (vocab_steps + 8) * F32_U + 2.0**-20 + 4 * F32_U * (z.abs().amax(-1, keepdim=True) + lse.abs())
    lse_err = zerr.amax(-1, keepdim=True) + rounding
    ce_err = lse_err[:, 0] + (zerr * onehot).sum(-1) + F32_U * want[0].abs()
    p_err = 1.01 * p * (zerr + lse_err + rounding)
    diff = p - target
    kink = diff.abs() <= p_err + F32_U * p
    mass = (torch.sign(diff) * p).sum(-1, keepdim=True)
    l1_err = p_err.sum(-1) * (1 + vocab_steps * F32_U) + (vocab_steps + 1) * F32_U * want[1]
    mass_err = p_err.sum(-1, keepdim=True) + (vocab_steps + 1) * F32_U + (2 * p * kink).sum(-1, keepdim=True)
    g_ce, g_l1 = up_ce.abs()[:, None], up_l1.abs()[:, None]
    dz = up_ce[:, None] * (p - onehot) + up_l1[:, None] * p * (torch.sign(diff) - mass)
    dz_f32_err = (g_ce * p_err + g_l1 * (p_err * (1 + mass.abs()) + p * mass_err + 2 * p * kink)
                  + 4 * F32_U * (g_ce * (p + onehot) + g_l1 * p * (1 + mass.abs())))
    dz_err = dz_rounding * dz.abs() + (1 + dz_rounding) * dz_f32_err
    dz_abs = dz.abs() + dz_err
    x_err = dz_err @ w.abs() + 1.01 * w.shape[0] * ACC_U * (dz_abs @ w.abs())
    w2_err = dz_err.t() @ prev.abs() + 1.01 * x.shape[0] * ACC_U * (dz_abs.t() @ prev.abs())
    bounds = [ce_err, l1_err, x_err[:, :d], x_err[:, d:], w2_err]
    return want, bounds


def check_head_close(got, want, bounds, grad_dtypes, what: str) -> None:
    """Each of (ce, l1, d hidden, d prev_embedding, d markov_w2) finite (no poison left) and within
    its bound, plus one rounding to the gradient's dtype where that is bf16 (2^-8 relative)."""
    names = ("ce", "l1", "d hidden", "d prev_embedding", "d markov_w2")
    for name, g, w, bound, dtype in zip(names, got, want, bounds, (torch.float32,) * 2 + tuple(grad_dtypes)):
        if g is None:  # a gradient not asked for
            continue
        if g.shape != w.shape or not torch.isfinite(g).all():
            sys.exit(f"{what}: {name}: shape {tuple(g.shape)} vs {tuple(w.shape)} or non-finite (unwritten) values")
        if dtype == torch.bfloat16:
            bound = bound * (1 + BF16_U) + BF16_U * w.abs()
        excess = (g.double() - w).abs() - bound
        if (excess > 0).any():
            worst = int(excess.argmax())
            sys.exit(f"{what}: {name}: {int((excess > 0).sum())} of {excess.numel()} values out of bound; worst "
                     f"at flat index {worst}: got {g.flatten()[worst].item():.6e}, want {w.flatten()[worst].item():.6e}, "
                     f"bound {bound.flatten()[worst].item():.3e}")


def head_loss_inputs(gen, positions, target_rows, vocab, d, r, operand_dtype, target_dtype):
    """Random operands at the scales of a trained head (logits of a few units), target rows of a
    peaked softmax, labels and target rows drawn with repeats; on gen's device."""
    def normal(*shape):
        return torch.randn(*shape, generator=gen, device=gen.device)

    hidden, prev = normal(positions, d) * 2, normal(positions, r)
    lm_head, w2 = normal(vocab, d) * (1.5 / d**0.5), normal(vocab, r) * (1.0 / max(r, 1) ** 0.5)
    operands = tuple(t.to(operand_dtype) for t in (hidden, prev, lm_head, w2))
    target = torch.softmax(normal(target_rows, vocab) * 2.5, dim=-1).to(target_dtype)
    rows = torch.randint(0, target_rows, (positions,), generator=gen, device=gen.device)
    labels = torch.randint(0, vocab, (positions,), generator=gen, device=gen.device)
    return operands, target, rows, labels


def check_draft_head_loss(gen: torch.Generator) -> None:
    """draft_head_loss's Triton kernels (head_triton) against the float64 reference under autograd,
    values and gradients, within head_loss_expected's bounds. Awkward sizes: 37 positions (row
    blocks of 16: the last partial), V = 300 (tiles of 64: the last partial; 2 vocabulary
    splits of 192 and 108 columns), K = 56 + 24 = 80 (two K steps, the second zero-padded),
    backward chunks of 16 rows (the last partial); bf16 and float32 operands, rows given and
    None, bf16 and float32 targets, and every subset of the gradients the backward computes
    apart (all; prev_embedding's alone; hidden's and markov_w2's; markov_w2's alone). Then the
    cross-entropy alone (no teacher: l1 None), with the Markov part and without it (r = 0, the
    DFlash ablation's head; K = 56, one K step), against the reference's ce and gradients with
    the L1 term's upstream gradient zero. Every buffer the wrapper allocates starts as NaN."""
    positions, target_rows, vocab, d, r = 37, 11, 300, 56, 24
    cases = ((torch.bfloat16, torch.bfloat16, True, (True, True, True)),
             (torch.bfloat16, torch.float32, False, (False, True, False)),
             (torch.float32, torch.bfloat16, False, (True, False, True)),
             (torch.float32, torch.float32, True, (False, False, True)))
    def poisoned_run(operands, target, rows, labels, up_ce, up_l1, wanted):
        """head_triton's terms and gradients with every buffer it allocates starting as NaN."""
        real_torch = loss_head_triton.torch
        loss_head_triton.torch = _PoisonedTorch()
        try:
            return head_loss_with_gradients(loss_head_triton.draft_head_loss, operands, target, rows, labels,
                                            up_ce, up_l1, wanted, splits=2, chunk_rows=16)
        finally:
            loss_head_triton.torch = real_torch

    for operand_dtype, target_dtype, given_rows, wanted in cases:
        operands, target, rows, labels = head_loss_inputs(gen, positions, target_rows, vocab, d, r, operand_dtype,
                                                          target_dtype)
        if not given_rows:
            target, rows = target[rows], None
        up_ce, up_l1 = (torch.randn(positions, generator=gen, dtype=torch.float64) for _ in range(2))
        got = poisoned_run(operands, target, rows, labels, up_ce, up_l1, wanted)
        rounded = tuple(t.to(torch.bfloat16).double() for t in operands)
        want, bounds = head_loss_expected(rounded, target, rows, labels, up_ce, up_l1, vocab_steps=vocab // 64 + 64,
                                          dz_rounding=INTERPRETER_BF16_U)
        grad_dtypes = (operands[0].dtype, operands[1].dtype, operands[3].dtype)
        check_head_close(got, want, bounds, grad_dtypes,
                         f"draft_head_loss ({operand_dtype} operands, {target_dtype} target, "
                         f"{'rows' if given_rows else 'no rows'}, gradients of {wanted})")
    for markov_rank, wanted in ((r, (True, True, True)), (0, (True, False, False))):
        operands, target, rows, labels = head_loss_inputs(gen, positions, target_rows, vocab, d, markov_rank,
                                                          torch.bfloat16, torch.float32)
        up_ce = torch.randn(positions, generator=gen, dtype=torch.float64)
        got = poisoned_run(operands, None, None, labels, up_ce, None, wanted)
        if got[1] is not None:
            sys.exit(f"draft_head_loss (no teacher, r = {markov_rank}): l1 should be None, got a tensor")
        rounded = tuple(t.to(torch.bfloat16).double() for t in operands)
        # The teacher only enters through the L1 term, whose upstream gradient is zero here.
        want, bounds = head_loss_expected(rounded, target, rows, labels, up_ce, torch.zeros_like(up_ce),
                                          vocab_steps=vocab // 64 + 64, dz_rounding=INTERPRETER_BF16_U)
        check_head_close(got, want, bounds, (torch.bfloat16,) * 3,
                         f"draft_head_loss (no teacher, r = {markov_rank}, gradients of {wanted})")


if __name__ == "__main__":
    if sys.argv[2:] == ["draft_head_loss"]:  # only this op's check (tests/test_draft_loss_head.py)
        check_draft_head_loss(torch.Generator().manual_seed(int(sys.argv[1])))
        print("draft_head_loss: all checks passed")
    else:
        main(int(sys.argv[1]))

