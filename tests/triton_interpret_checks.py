"""Run by tests/test_triton_interpreter.py in a fresh process with TRITON_INTERPRET=1 (the
interpreter must be chosen before triton is first imported): the fused glue kernels on the CPU
in float32 against their references in float64. Exits non-zero with the failing check's name.

Tolerance: float32 arithmetic on O(1) values, max abs error 1e-4 against float64 (the router's
selection: 1e-5, see check_route)."""
import sys

import torch

from dspark.kernels.activation import reference as act_ref
from dspark.kernels.activation import triton as act_triton
from dspark.kernels.draft_loss import reference as loss_ref
from dspark.kernels.draft_loss import triton as loss_triton
from dspark.kernels.moe import expert_layout
from dspark.kernels.moe import triton as moe_triton
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
    M, d = 4, 96
    for num_checkpoints in (0, 1, 3):
        current = torch.randn(M, d, generator=gen) * 3
        ckpts = torch.randn(num_checkpoints, M, d, generator=gen) * 2
        mix_norm, mix_proj, out_norm = (torch.rand(d, generator=gen) + 0.5 for _ in range(3))
        want = norm_ref.attn_res_mix_norm(current.double(), ckpts.double(), mix_norm.double(), mix_proj.double(),
                                          out_norm.double(), 1e-6)
        got = norm_triton.attn_res_mix_norm(current, ckpts, mix_norm, mix_proj, out_norm, 1e-6,
                                            out=torch.full((M, d), float("nan")))
        close(got, want, f"attn_res_mix_norm with {num_checkpoints} checkpoints")
        residual, delta = current[:, :d], torch.randn(M, d + 8, generator=gen)[:, 4 : 4 + d]  # strided delta rows
        want_out, want_total = norm_ref.add_attn_res_mix_norm(
            residual.double(), delta.double(), ckpts.double(), mix_norm.double(), mix_proj.double(), out_norm.double(), 1e-6)
        got_out, got_total = norm_triton.add_attn_res_mix_norm(
            residual, delta, ckpts, mix_norm, mix_proj, out_norm, 1e-6, out=torch.full((M, d), float("nan")),
            total=torch.full((M, d), float("nan")))
        close(got_total, want_total, f"add_attn_res_mix_norm's sum with {num_checkpoints} checkpoints")
        close(got_out, want_out, f"add_attn_res_mix_norm with {num_checkpoints} checkpoints")
    rows, n = 3, 1500  # two column blocks, the second partial
    gate, up = (torch.randn(rows, n, generator=gen) * 4 for _ in range(2))
    gate[0, :4] = torch.tensor([80.0, -80.0, 0.0, 1e-3])  # tanh's saturated ends and its centre
    close(act_triton.situ_glu(gate, up, 3.0, 5.0, out=torch.full((rows, n), float("nan"))),
          act_ref.situ_glu(gate.double(), up.double(), 3.0, 5.0), "situ_glu")
    x = torch.randn(rows, n, generator=gen)
    close(act_triton.sigmoid_gate(x, gate, out=torch.full((rows, n), float("nan"))),
          act_ref.sigmoid_gate(x.double(), gate.double()), "sigmoid_gate")
    check_route(gen)
    check_combine(gen)
    check_gather_tokens(gen)
    check_draft_loss(gen)
    print("triton kernels: all checks passed")


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


def check_combine(gen: torch.Generator, device: str = "cpu", tokens: int = 3, top_k: int = 16,
                  width: int = 1500) -> None:
    """weighted_combine against the float64 weighted sum: pairs scattered over the rows in a
    random order (as the expert lists place them), spare rows poisoned with NaN (never read), a
    width that leaves the last column block partial. Inputs are drawn on the CPU."""
    pairs = tokens * top_k
    rows = torch.randn(pairs + 5, width, generator=gen)
    position = torch.randperm(pairs + 5, generator=gen)[:pairs].view(tokens, top_k)
    spare = torch.ones(pairs + 5, dtype=torch.bool)
    spare[position.flatten()] = False
    rows[spare] = float("nan")
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    want = (weights.double().unsqueeze(-1) * rows.double()[position]).sum(dim=1)
    out = torch.full((tokens, width), float("nan"), device=device)
    got = moe_triton.weighted_combine(rows.to(device), position.to(device), weights.to(device), out=out)
    close(got.cpu(), want, f"weighted_combine T={tokens} k={top_k} width={width}")


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


if __name__ == "__main__":
    main(int(sys.argv[1]))

