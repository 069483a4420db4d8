"""The K3 decoder (k3-tiny, float32) against an independent float64 forward over the checkpoint
tensors: un-absorbed MLA with a causal mask, KDA recurrence from a zero conv window, a dense
expert loop, and the Block AttnRes flow of docs/kimi-k3.md §7."""
import math

import pytest
import torch

from dspark.targets.kimi_k3 import K3_TINY, K3Model, K3Target
from dspark.kernels import numerics
from dspark.kernels.mxfp4 import dequantise


@pytest.fixture(scope="module")
def model():
    return K3Model.random(K3_TINY, seed=int(torch.randint(0, 2**31 - 1, ())), dtype=torch.float32)


def reference_logits(model, tokens):
    cfg = model.cfg
    t = {n: v.double() for n, v in model.named_tensors() if v.dtype != torch.uint8}
    eps = cfg.rms_norm_eps
    P = len(tokens)

    def rms(x, w):
        return x / torch.sqrt((x**2).mean(-1, keepdim=True) + eps) * w

    def situ(g, u):
        b1, b2 = cfg.situ_beta, cfg.situ_linear_beta
        return b1 * torch.tanh(g / b1) * torch.sigmoid(g) * b2 * torch.tanh(u / b2)

    def mix(current, checkpoints, p):
        candidates = checkpoints + [current]
        scores = torch.stack([rms(c, t[f"{p}_norm.weight"]) @ t[f"{p}_proj.weight"][0] for c in candidates], -1)
        w = torch.softmax(scores, -1)
        return sum(w[:, j : j + 1] * c for j, c in enumerate(candidates))

    def kda(p, x):
        H, D, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_width
        pre = [x @ t[f"{p}.{n}_proj.weight"].T for n in ("q", "k", "v")]
        acts = []
        for n, seq in zip(("q", "k", "v"), pre):
            padded = torch.cat([torch.zeros(3, W, dtype=torch.float64), seq])
            taps = t[f"{p}.{n}_conv1d.weight"][:, 0]
            acts.append(torch.nn.functional.silu(torch.stack([(padded[i : i + 4].T * taps).sum(-1) for i in range(P)])))
        q, k, v = (a.view(P, H, D) for a in acts)
        q = q / torch.sqrt((q**2).sum(-1, keepdim=True) + cfg.l2_norm_eps) / math.sqrt(D)
        k = k / torch.sqrt((k**2).sum(-1, keepdim=True) + cfg.l2_norm_eps)
        f = (x @ t[f"{p}.f_a_proj.weight"].T) @ t[f"{p}.f_b_proj.weight"].T
        g = cfg.kda_gate_lower_bound * torch.sigmoid(
            torch.exp(t[f"{p}.A_log"][:H])[:, None] * (f.view(P, H, D) + t[f"{p}.dt_bias"].view(H, D)))
        beta = torch.sigmoid(x @ t[f"{p}.b_proj.weight"].T)
        S = torch.zeros(H, D, D, dtype=torch.float64)
        out = torch.zeros(P, H, D, dtype=torch.float64)
        for i in range(P):
            for h in range(H):
                S[h] = torch.exp(g[i, h])[:, None] * S[h]
                S[h] = S[h] + torch.outer(k[i, h], beta[i, h] * (v[i, h] - S[h].T @ k[i, h]))
                out[i, h] = S[h].T @ q[i, h]
        o = rms(out, t[f"{p}.o_norm.weight"]).reshape(P, W) * torch.sigmoid(x @ t[f"{p}.g_proj.weight"].T)
        return o @ t[f"{p}.o_proj.weight"].T

    def mla(p, x):
        H, R, nope, vd = cfg.mla_num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
        q = (rms(x @ t[f"{p}.q_a_proj.weight"].T, t[f"{p}.q_a_layernorm.weight"]) @ t[f"{p}.q_b_proj.weight"].T).view(P, H, -1)
        kv = x @ t[f"{p}.kv_a_proj_with_mqa.weight"].T
        c_kv, k_pe = rms(kv[:, :R], t[f"{p}.kv_a_layernorm.weight"]), kv[:, R:]
        kv_up = (c_kv @ t[f"{p}.kv_b_proj.weight"].T).view(P, H, nope + vd)
        k_nope, v = kv_up[..., :nope], kv_up[..., nope:]
        scores = (torch.einsum("ihn,jhn->hij", q[..., :nope], k_nope) + torch.einsum("ihr,jr->hij", q[..., nope:], k_pe))
        scores = scores / math.sqrt(cfg.qk_head_dim) + torch.triu(torch.full((P, P), -math.inf), 1)
        o = torch.einsum("hij,jhv->ihv", torch.softmax(scores, -1), v).reshape(P, H * vd)
        return (o * torch.sigmoid(x @ t[f"{p}.g_proj.weight"].T)) @ t[f"{p}.o_proj.weight"].T

    def moe(i, p, x):
        w = model.moe[i]
        scores = torch.sigmoid(x @ t[f"{p}.gate.weight"].T)
        chosen = torch.topk(scores + t[f"{p}.gate.e_score_correction_bias"], cfg.num_experts_per_token, -1).indices
        latent = x @ t[f"{p}.routed_expert_down_proj.weight"].T
        routed = torch.zeros_like(latent)
        for m in range(P):
            s = scores[m, chosen[m]]
            for e, we in zip(chosen[m].tolist(), s / s.sum() * cfg.routed_scaling_factor):
                w1, w3, w2 = (dequantise(getattr(w, f"{n}_packed")[e], getattr(w, f"{n}_scale")[e], torch.float64)
                              for n in ("w1", "w3", "w2"))
                routed[m] += we * (w2 @ situ(w1 @ latent[m], w3 @ latent[m]))
        shared = situ(x @ t[f"{p}.shared_experts.gate_proj.weight"].T, x @ t[f"{p}.shared_experts.up_proj.weight"].T)
        return (rms(routed, t[f"{p}.routed_expert_norm.weight"]) @ t[f"{p}.routed_expert_up_proj.weight"].T
                + shared @ t[f"{p}.shared_experts.down_proj.weight"].T)

    pre = "language_model.model"
    hidden = t[f"{pre}.embed_tokens.weight"][tokens]
    checkpoints, prefix = [], hidden
    for i in range(cfg.num_layers):
        L = f"{pre}.layers.{i}"
        x = mix(prefix, checkpoints, f"{L}.self_attention_res") if checkpoints else prefix
        if i % cfg.attn_res_block_size == 0:
            checkpoints, prefix = checkpoints + [prefix], None
        h = rms(x, t[f"{L}.input_layernorm.weight"])
        a = kda(f"{L}.self_attn", h) if cfg.layer_type(i) == "kda" else mla(f"{L}.self_attn", h)
        prefix = a if prefix is None else prefix + a
        y = rms(mix(prefix, checkpoints, f"{L}.mlp_res"), t[f"{L}.post_attention_layernorm.weight"])
        if cfg.ffn_type(i) == "dense":
            f = situ(y @ t[f"{L}.mlp.gate_proj.weight"].T, y @ t[f"{L}.mlp.up_proj.weight"].T) @ t[f"{L}.mlp.down_proj.weight"].T
        else:
            f = moe(i, f"{L}.block_sparse_moe", y)
        prefix = prefix + f
    final = rms(mix(prefix, checkpoints, f"{pre}.output_attn_res"), t[f"{pre}.norm.weight"])
    return final @ t["language_model.lm_head.weight"].T


def test_forward_and_prefill_match_float64_forward(model):
    """Every position's logits (a verify on an empty slot), the LM head's input tap times the head,
    and prefill's last-position logits all agree with the float64 transcription."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    tokens = torch.randint(0, K3_TINY.vocab_size, (7,), generator=gen)
    expected = reference_logits(model, tokens)
    target = K3Target(model, max_slots=1, max_seq_len=16)
    out = target.verify([0], tokens[None], [7], (K3_TINY.num_layers,))
    logits = out.logits[0]
    torch.testing.assert_close(logits.double(), expected, rtol=1e-4, atol=1e-4)
    assert logits.argmax(-1).unique().numel() > 1, "degenerate logits"
    _, lm_head = target.embedding_weights()
    from_tap = out.taps[K3_TINY.num_layers][0].double() @ lm_head.double().t()
    torch.testing.assert_close(from_tap, expected, rtol=1e-4, atol=1e-4)
    last = target.prefill([0], [tokens]).logits
    assert last.shape == (1, 1, K3_TINY.vocab_size)
    assert torch.equal(last[0, 0], logits[-1])  # the CPU's ops are token-invariant


def test_batched_elementwise_path_matches_row_by_row(model, monkeypatch):
    """The path other devices take (elementwise helpers on the whole batch at once) agrees with
    the CPU's row-by-row path to rounding."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    prompts = [torch.randint(0, K3_TINY.vocab_size, (n,), generator=gen) for n in (6, 4)]
    tokens = torch.zeros(2, 6, dtype=torch.long)
    tokens[0], tokens[1, :4] = prompts
    rows = K3Target(model, max_slots=2, max_seq_len=16).verify([0, 1], tokens, [6, 4]).logits
    monkeypatch.setattr(numerics, "splits_rows", lambda device: False)
    batched = K3Target(model, max_slots=2, max_seq_len=16).verify([0, 1], tokens, [6, 4]).logits
    torch.testing.assert_close(batched[0], rows[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(batched[1, :4], rows[1, :4], rtol=1e-4, atol=1e-4)
