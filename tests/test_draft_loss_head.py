"""draft_head_loss (kernels/draft_loss/head_*.py): the Triton kernels under the interpreter against
float64 (values and gradients, within bounds derived from their float32/bf16 arithmetic: see
tests/triton_interpret_checks.py, check_draft_head_loss), the reference against the op it
composes (draft_loss_terms on explicit logits), and the argument checks both implementations
share. The GPU test at the SmolLM2 recipe's sizes is tests/gpu/test_draft_loss_gpu.py."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dspark.kernels import ops, registry
from dspark.kernels.draft_loss import head_reference, head_triton
from dspark.kernels.draft_loss import reference as terms_reference


def _inputs(gen, N=9, V=70, d=12, r=5, M=4, dtype=torch.float32):
    hidden = torch.randn(N, d, generator=gen, dtype=dtype)
    prev = torch.randn(N, r, generator=gen, dtype=dtype)
    lm_head = torch.randn(V, d, generator=gen, dtype=dtype) / d**0.5
    w2 = torch.randn(V, r, generator=gen, dtype=dtype) / r**0.5
    target = torch.softmax(torch.randn(M, V, generator=gen) * 2, dim=-1)
    rows = torch.randint(0, M, (N,), generator=gen)
    labels = torch.randint(0, V, (N,), generator=gen)
    return hidden, prev, lm_head, w2, target, rows, labels


def test_triton_kernels_match_float64_under_the_interpreter():
    pytest.importorskip("triton")
    seed = int(torch.randint(0, 2**31 - 1, ()))
    script = Path(__file__).with_name("triton_interpret_checks.py")
    done = subprocess.run([sys.executable, str(script), str(seed), "draft_head_loss"],
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"seed {seed}: {done.stderr[-2000:]}"
    assert "all checks passed" in done.stdout


def test_reference_is_draft_loss_terms_of_the_head_logits():
    """Same float32 operations in the same order as the logits' GEMMs followed by draft_loss_terms'
    reference: equal to float32 rounding (1e-6 on O(1-10) values); gradients likewise."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    hidden, prev, lm_head, w2, target, rows, labels = _inputs(gen)
    up_ce, up_l1 = torch.randn(2, hidden.shape[0], generator=gen)
    leaves = [t.clone().requires_grad_(True) for t in (hidden, prev, w2)]
    ce, l1 = ops.draft_head_loss(leaves[0], leaves[1], lm_head, leaves[2], target, rows, labels)
    got = (ce, l1, *torch.autograd.grad((up_ce * ce).sum() + (up_l1 * l1).sum(), leaves))
    leaves = [t.clone().requires_grad_(True) for t in (hidden, prev, w2)]
    logits = leaves[0] @ lm_head.t() + leaves[1] @ leaves[2].t()
    ce, l1 = terms_reference.draft_loss_terms(logits, target, rows, labels)
    want = (ce, l1, *torch.autograd.grad((up_ce * ce).sum() + (up_l1 * l1).sum(), leaves))
    for name, g, w in zip(("ce", "l1", "d hidden", "d prev_embedding", "d markov_w2"), got, want):
        assert g.dtype == torch.float32 and torch.allclose(g, w, rtol=1e-6, atol=1e-6), name


def test_reference_runs_in_float64_when_given_float64():
    gen = torch.Generator().manual_seed(0)
    hidden, prev, lm_head, w2, target, rows, labels = _inputs(gen, dtype=torch.float64)
    ce, l1 = head_reference.draft_head_loss(hidden, prev, lm_head, w2, target.double(), rows, labels)
    assert ce.dtype == l1.dtype == torch.float64
    logits = hidden @ lm_head.t() + prev @ w2.t()
    assert torch.allclose(ce, logits.logsumexp(-1) - logits.gather(-1, labels[:, None])[:, 0], rtol=1e-12, atol=1e-12)


BAD_ARGUMENTS = {
    "lm_head requires grad": (lambda a: {**a, "lm_head": a["lm_head"].clone().requires_grad_(True)}, "lm_head"),
    "prev_embedding rows": (lambda a: {**a, "prev_embedding": a["prev_embedding"][:-1]}, "prev_embedding"),
    "markov_w2 width": (lambda a: {**a, "markov_w2": a["markov_w2"][:, :-1]}, "markov_w2"),
    "lm_head width": (lambda a: {**a, "lm_head": a["lm_head"][:, :-1]}, "lm_head"),
    "target vocabulary": (lambda a: {**a, "target_probs": a["target_probs"][:, :-1]}, "target_probs"),
    "integer target": (lambda a: {**a, "target_probs": a["target_probs"].long()}, "target_probs"),
    "label past V": (lambda a: {**a, "labels": a["labels"].clone().fill_(70)}, "labels must lie in [0, 70), got values in [70, 70]"),
    "negative row": (lambda a: {**a, "rows": a["rows"].clone().fill_(-1)}, "rows must lie in [0, 4)"),
    "int32 labels": (lambda a: {**a, "labels": a["labels"].int()}, "labels"),
    "no rows, too few target rows": (lambda a: {**a, "rows": None}, "rows is None"),
    "1-D hidden": (lambda a: {**a, "hidden": a["hidden"][0]}, "hidden"),
}


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("case", sorted(BAD_ARGUMENTS))
def test_bad_arguments_are_value_errors_naming_the_argument(impl, case):
    """Both implementations check before any work (the Triton wrapper before importing triton)."""
    gen = torch.Generator().manual_seed(0)
    names = ("hidden", "prev_embedding", "lm_head", "markov_w2", "target_probs", "rows", "labels")
    change, named = BAD_ARGUMENTS[case]
    args = change(dict(zip(names, _inputs(gen))))
    fn = registry.implementations("draft_head_loss")[impl].fn
    with pytest.raises(ValueError, match="draft_head_loss: .*" + named.replace("[", r"\[").replace("(", r"\(")
                       .replace(")", r"\)")):
        fn(*(args[name] for name in names))


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_indices_checked_skips_only_the_device_read_of_the_ranges(impl, monkeypatch):
    """indices_checked=True: the index ranges (the op's one read back from the device) are the caller's;
    every other check stays."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    names = ("hidden", "prev_embedding", "lm_head", "markov_w2", "target_probs", "rows", "labels")
    fn = registry.implementations("draft_head_loss")[impl].fn
    reads = []
    monkeypatch.setattr(head_reference, "_check_ranges", lambda *a: reads.append(a))
    args = dict(zip(names, _inputs(gen)))
    with pytest.raises(ValueError, match="draft_head_loss: lm_head requires grad"):
        fn(*(args[n] for n in names[:2]), args["lm_head"].clone().requires_grad_(True),
           *(args[n] for n in names[3:]), indices_checked=True)
    if impl == "reference":  # the Triton one would run its kernels past the checks: CUDA only
        fn(*(args[n] for n in names), indices_checked=True)
        assert reads == []
        fn(*(args[n] for n in names))
        assert len(reads) == 1


def test_triton_partition_options_are_checked():
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="chunk_rows must be >= 1, got 0"):
        head_triton.draft_head_loss(*_inputs(gen), chunk_rows=0)


def test_no_positions_give_empty_terms_and_zero_gradients():
    """N = 0 launches nothing (so it runs here without triton): empty terms, a zero markov_w2 gradient."""
    gen = torch.Generator().manual_seed(0)
    hidden, prev, lm_head, w2, target, rows, labels = _inputs(gen, N=0)
    w2 = w2.requires_grad_(True)
    ce, l1 = head_triton.draft_head_loss(hidden, prev, lm_head, w2, target, rows, labels)
    assert ce.shape == l1.shape == (0,)
    (grad,) = torch.autograd.grad(ce.sum() + l1.sum(), [w2])
    assert torch.equal(grad, torch.zeros_like(w2))


def test_dispatch():
    """The Triton implementation runs on CUDA only and leaves float64 to the reference."""
    impls = registry.implementations("draft_head_loss")
    assert impls["triton"].devices == ("cuda",) and impls["triton"].priority > impls["reference"].priority
    gen = torch.Generator().manual_seed(0)
    args = _inputs(gen)
    assert head_triton.supports(*args)
    assert head_triton.supports(*(t.bfloat16() if i < 5 else t for i, t in enumerate(args)))
    assert not head_triton.supports(*(t.double() if i < 4 else t for i, t in enumerate(args)))
    assert registry.select("draft_head_loss", *args).name == "reference"  # on the CPU
