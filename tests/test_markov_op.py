"""markov_greedy_draft, the greedy Markov stage of a DSpark draft as an op (kernels/markov/): the
reference against the float64 argmax chain, the drafter's use of it against the per-slot loop it
replaced, and the errors. Beside it draft_confidence, the confidence head of the same block: the
reference bit for bit the model's torch ops (bf16 and float32), against float64, and its errors.
The Triton kernels: tests/test_triton_interpreter.py on the CPU, tests/gpu/test_triton_kernels_gpu.py
on the GPU, tests/test_draft_confidence_compile.py compiled for sm_90."""
import dataclasses
import itertools

import pytest
import torch

from dspark.config import SamplingParams
from dspark.drafters.dspark.config import K3_TINY_DSPARK
from dspark.drafters.dspark.drafter import DSparkDrafter
from dspark.drafters.dspark.model import DSparkModel
from dspark.kernels import ops, registry
from dspark.kernels.markov import reference
from dspark.kernels.markov import triton as markov_triton
from dspark.policy import temperature_tensor
from triton_interpret_checks import check_draft_confidence, check_markov


def reference_into(base, anchors, w1, w2, out):
    out.copy_(reference.markov_greedy_draft(base, anchors, w1, w2))
    return out


def test_the_reference_takes_the_float64_argmax_chain_and_the_lower_id_of_a_tie():
    check_markov(torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()))), draft=reference_into)


def test_the_check_fails_on_a_draft_that_ignores_the_previous_token():
    def anchors_only(base, anchors, w1, w2, out):  # every slot biased by the anchor
        for k in range(base.shape[1]):
            out[:, k] = (base[:, k] + torch.nn.functional.embedding(anchors, w1) @ w2.T).argmax(-1)
        return out

    with pytest.raises(SystemExit, match="not argmaxes"):
        check_markov(torch.Generator().manual_seed(5), draft=anchors_only)


def test_the_drafters_greedy_block_equals_the_per_slot_loop():
    config = dataclasses.replace(K3_TINY_DSPARK, markov_rank=24).validate()
    torch.manual_seed(0)
    table = torch.randn(config.vocab_size, config.hidden_size)
    model = DSparkModel(config, table, table.clone() * 0.1)
    with torch.no_grad():  # a head that matters: W1 rows far from torch's N(0, 1) default
        model.markov_head.markov_w1.weight.mul_(3.0)
    drafter = DSparkDrafter(model, 2, max_seq_len=64)
    g = torch.Generator().manual_seed(2)
    for slot, length in ((0, 17), (1, 30)):
        drafter.start(slot, torch.randint(0, config.vocab_size, (length,), generator=g),
                      {layer: torch.randn(length, config.target_hidden_size, generator=g)
                       for layer in config.target_layer_ids})
    anchors = torch.tensor([5, 200])
    greedy = [SamplingParams(temperature=0.0)] * 2
    got = drafter.draft([0, 1], anchors, greedy, [None, None])
    # the loop the op replaced, over the same hidden states
    index = torch.tensor([0, 1])
    lengths = drafter._lengths_device.index_select(0, index)
    context = 30
    rows = [cache[:, :context].index_select(0, index) for cache in drafter._cache]
    visible = (torch.arange(context) < lengths[:, None]).unsqueeze(1)
    positions = (lengths[:, None] + torch.arange(config.block_size)).unsqueeze(1)
    with torch.no_grad():
        hidden = model.backbone(model.block_inputs(anchors).unsqueeze(1), positions, rows, visible, inference=True)[:, 0]
        base, prev, tokens, conf = model.base_logits(hidden), anchors, [], []
        for k in range(config.block_size):
            e = model.markov_head.embed_previous(prev)
            tokens.append((base[:, k] + model.markov_head.bias(e, hidden[:, k]).float()).argmax(-1))
            conf.append(model.confidence_head(hidden[:, k], e).float())
            prev = tokens[-1]
    assert torch.equal(got.tokens, torch.stack(tokens, 1))
    torch.testing.assert_close(got.confidence_logits, torch.stack(conf, 1), rtol=1e-5, atol=1e-6)
    assert got.probs is None


@pytest.mark.parametrize("args, message", [
    (((2, 7), (2,), (50, 8), (40, 8)), r"base must be \[B, G, V\] floating"),
    (((2, 7, 40), (3,), (50, 8), (40, 8)), r"anchors must be \[2\] integer ids"),
    (((2, 7, 40), (2,), (50, 8), (40, 6)), r"w1 \[V1, r\] and w2 \[V, r\] must share r"),
    (((2, 7, 40), (2,), (50, 8), (41, 8)), "w2 has 41 rows for base's 40 logits per slot"),
    (((2, 7, 40), (2,), (30, 8), (40, 8)), "w1 has 30 rows, fewer than the 40 ids a draft can emit"),
])
def test_bad_arguments_are_named(args, message):
    base, anchors, w1, w2 = args
    with pytest.raises(ValueError, match=message):
        ops.markov_greedy_draft(torch.randn(base), torch.zeros(anchors, dtype=torch.long), torch.randn(w1),
                                torch.randn(w2))


def confidence_into(hidden, anchors, tokens, w1, weight, bias, temperatures, out):
    for o, t in zip(out, reference.draft_confidence(hidden, anchors, tokens, w1, weight, bias, temperatures)):
        o.copy_(t)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_markov, with_bias, with_temperatures", list(itertools.product((True, False), repeat=3)))
def test_the_confidence_reference_is_the_models_torch_path_bit_for_bit(dtype, with_markov, with_bias,
                                                                          with_temperatures):
    """The ops the drafter's greedy block runs (drafters/dspark/drafter.py _draft_rows): the previous
    tokens' cat, the Markov head's embedding, ConfidenceHead's Linear, the float cast and the model's
    calibrated sigmoid, against the op's reference on the same tensors: equal, bit for bit."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    temps = tuple((torch.rand(K3_TINY_DSPARK.block_size, generator=gen) * 2 + 0.5).tolist())
    config = dataclasses.replace(K3_TINY_DSPARK, confidence_head_with_markov=with_markov, confidence_bias=with_bias,
                                 confidence_temperatures=temps if with_temperatures else None).validate()
    table = torch.randn(config.vocab_size, config.hidden_size, generator=gen)
    model = DSparkModel(config, table, table * 0.1).to(dtype)
    B, G, V = 3, config.block_size, config.vocab_size
    hidden = torch.randn(B, G, config.hidden_size, generator=gen, dtype=dtype)
    anchors = torch.randint(0, V, (B,), generator=gen)
    tokens = torch.randint(0, V, (B, G), generator=gen)
    with torch.no_grad():
        prev = torch.cat([anchors[:, None], tokens[:, :-1]], dim=1)
        want_logits = model.confidence_head(hidden, model.markov_head.embed_previous(prev)).float()
        want_probs = model.confidence_probs(want_logits)
        proj = model.confidence_head.proj
        got_logits, got_probs = ops.draft_confidence(
            hidden, anchors, tokens, model.markov_head.markov_w1.weight if with_markov else None, proj.weight[0],
            proj.bias, temperature_tensor(temps, G, torch.float32, "cpu") if with_temperatures else None)
    assert got_logits.dtype == got_probs.dtype == torch.float32
    assert torch.equal(got_logits, want_logits)
    assert torch.equal(got_probs, want_probs)
    assert want_logits.std() > 0.05 and ((want_probs > 0.01) & (want_probs < 0.99)).any()  # not a trivial head


def test_the_confidence_reference_is_float64s_and_the_check_catches_a_wrong_previous_token_or_temperature():
    """tests/triton_interpret_checks.py:check_draft_confidence (the Triton kernel's check) passes the
    reference and fails an implementation that looks up W1 at the slot's own token (not the previous
    one) or applies the temperatures in the wrong order."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    check_draft_confidence(gen, confidence=confidence_into)

    def own_token(hidden, anchors, tokens, w1, weight, bias, temperatures, out):  # W1[x_k], not W1[x_{k-1}]
        return confidence_into(hidden, tokens[:, 0], torch.cat([tokens[:, 1:], tokens[:, :1]], 1), w1, weight, bias,
                               temperatures, out)

    with pytest.raises(SystemExit, match="logits off float64's"):
        check_draft_confidence(gen, confidence=own_token)

    def reversed_temperatures(hidden, anchors, tokens, w1, weight, bias, temperatures, out):
        flipped = None if temperatures is None else temperatures.flip(0).contiguous()
        return confidence_into(hidden, anchors, tokens, w1, weight, bias, flipped, out)

    with pytest.raises(SystemExit, match="probs off float64's sigmoid"):
        check_draft_confidence(gen, confidence=reversed_temperatures)


def test_the_confidence_runs_the_reference_on_the_cpu_and_the_kernel_takes_only_its_layouts():
    hidden, anchors, tokens = torch.randn(2, 7, 64), torch.randint(0, 50, (2,)), torch.randint(0, 50, (2, 7))
    w1, weight, bias = torch.randn(50, 8), torch.randn(72), torch.randn(1)
    args = (hidden, anchors, tokens, w1, weight, bias, None)
    assert registry.select("draft_confidence", *args).name == "reference"
    assert markov_triton.supports_confidence(*args)
    assert markov_triton.supports_confidence(hidden[:, :, :32], anchors, tokens, None, weight[:32], None, None)
    assert markov_triton.supports_confidence(hidden.bfloat16(), anchors, tokens, w1.bfloat16(), weight.bfloat16(),
                                             None, None)
    assert not markov_triton.supports_confidence(hidden.double(), anchors, tokens, w1.double(), weight.double(),
                                                 None, None)
    wide = torch.randn(2, 7, 128)
    assert not markov_triton.supports_confidence(wide[..., ::2], anchors, tokens, w1, weight, None, None)
    assert not markov_triton.supports_confidence(hidden, anchors, tokens, torch.randn(8, 50).T, weight, None, None)
    assert not markov_triton.supports_confidence(hidden, anchors, tokens, w1, torch.randn(144)[::2], None, None)
    with pytest.raises(ValueError, match=r"out's probs must be a contiguous float32 \[2, 7\]"):
        markov_triton.draft_confidence(*args, out=(torch.empty(2, 7), torch.empty(2, 7, dtype=torch.float64)))
    with pytest.raises(ValueError, match="hidden needs a contiguous last dimension"):
        markov_triton.draft_confidence(wide[..., ::2], *args[1:])


def confidence_args(hidden=(2, 7, 64), anchors=(2,), tokens=(2, 7), w1=(50, 8), weight=(72,), bias=(1,),
                    temperatures=(7,), dtypes=None):
    """The op's arguments of those shapes (None: absent), each in dtypes[name] where given."""
    shapes = dict(hidden=hidden, anchors=anchors, tokens=tokens, w1=w1, weight=weight, bias=bias,
                  temperatures=temperatures)
    defaults = dict(anchors=torch.long, tokens=torch.long)
    args = []
    for name, shape in shapes.items():
        dtype = (dtypes or {}).get(name, defaults.get(name, torch.float32))
        if shape is None:
            args.append(None)
        elif dtype.is_floating_point:
            args.append(torch.randn(shape, dtype=dtype))
        else:
            args.append(torch.randint(0, 2 if dtype == torch.bool else 50, shape, dtype=dtype))
    return args


@pytest.mark.parametrize("kwargs, message", [
    (dict(hidden=(2, 64)), r"hidden must be \[B, G, d\] floating, got torch.float32 \(2, 64\)"),
    (dict(hidden_dtype=torch.long), r"hidden must be \[B, G, d\] floating, got torch.int64"),
    (dict(anchors=(3,)), r"anchors must be \[2\] integer ids, got torch.int64 \(3,\)"),
    (dict(anchors_dtype=torch.float32), r"anchors must be \[2\] integer ids, got torch.float32"),
    (dict(tokens=(2, 6)), r"tokens must be \[2, 7\] integer ids, got torch.int64 \(2, 6\)"),
    (dict(tokens_dtype=torch.bool), r"tokens must be \[2, 7\] integer ids, got torch.bool"),
    (dict(w1=(50,)), r"w1 must be \[V1, r\] in hidden's torch.float32, got torch.float32 \(50,\)"),
    (dict(w1_dtype=torch.bfloat16), r"w1 must be \[V1, r\] in hidden's torch.float32, got torch.bfloat16"),
    (dict(weight=(64,)), r"weight must be \[64 \+ 8\] \(d \+ w1's r\) in hidden's torch.float32, got "
                         r"torch.float32 \(64,\)"),
    (dict(w1=None), r"weight must be \[64\] \(d: no w1\) in hidden's torch.float32, got torch.float32 \(72,\)"),
    (dict(weight=(1, 72)), r"weight must be \[64 \+ 8\].*\(1, 72\)"),
    (dict(weight_dtype=torch.float64), r"weight must be .* in hidden's torch.float32, got torch.float64"),
    (dict(bias=(2,)), r"bias must be \[1\] in hidden's torch.float32, got torch.float32 \(2,\)"),
    (dict(bias_dtype=torch.float16), r"bias must be \[1\] in hidden's torch.float32, got torch.float16"),
    (dict(temperatures=(6,)), r"temperatures must be \[7\] float32, got torch.float32 \(6,\)"),
    (dict(temperatures_dtype=torch.float64), r"temperatures must be \[7\] float32, got torch.float64"),
])
def test_bad_confidence_arguments_are_named(kwargs, message):
    shapes = {k: v for k, v in kwargs.items() if not k.endswith("_dtype")}
    dtypes = {k[: -len("_dtype")]: v for k, v in kwargs.items() if k.endswith("_dtype")}
    with pytest.raises(ValueError, match=message):
        ops.draft_confidence(*confidence_args(**shapes, dtypes=dtypes))


def test_a_confidence_argument_on_another_device_is_named():
    args = confidence_args()
    args[5] = args[5].to("meta")
    with pytest.raises(ValueError, match="draft_confidence: bias is on meta, hidden on cpu"):
        ops.draft_confidence(*args)
