"""Reference KDA (Kimi Delta Attention) verify and commit, the contract of the `kda_verify` and
`kda_commit` ops.

Math: docs/kimi-k3.md §2.1 (FLA fla/ops/kda naive/fused_recurrent), per request b, head h,
token t, with the short conv window of the last 3 pre-conv inputs per channel:
    q, k, v = SiLU(causal_conv4([window ; inputs]))          (depthwise, fp32 taps)
    q = q / sqrt(sum q^2 + l2_eps) * D^-0.5 ;  k = k / sqrt(sum k^2 + l2_eps)
    g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias))  per channel, in (lower_bound, 0)
    beta = sigmoid(beta_in)
    S = exp(g)[:, None] * S ;  u = beta * (v - S^T k) ;  S = S + k u^T ;  o = S^T q
    out = RMSNorm_head(o; o_norm_weight, eps) * sigmoid(gate_in)

Verify is output-only and records, per position, the normalised key k, the update u and the
decay exp(g) (docs/kernels.md §3.3, design C), plus the pre-conv inputs. Commit replays the
first n records with the same two float operations per step, in the same order, as the step
inside verify, so the committed state is bitwise the sequentially decoded one.

Token invariance: every request and token is computed with the shapes of one-token decoding
([3, W] conv, [H, D] vectors, [H, D, D] state), so a token's bits do not depend on T or B.

Slot pools (docs/kernels.md §10.3): with `slots` [B] int64, state [S, H, D, D] and conv_state
[S, 3, W, 3] are one layer's pools (any slot stride, e.g. a view of a target's 5-D pool), and
request b reads (verify) or advances in place (commit) row slots[b]; rows not in `slots` are
never touched. Without it, row b belongs to request b (S = B). The arithmetic on a row is the
same either way, so pool and gathered states give the same bits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..registry import register

CONV_TAPS = 4


@dataclass
class KDARecords:
    """What `kda_commit` needs to replay accepted positions of one verify."""

    keys: torch.Tensor  # [B, T, H, D] fp32 (float64 for float64 inputs), L2-normalised k
    updates: torch.Tensor  # [B, T, H, D] u = beta * (v - S^T k)
    decays: torch.Tensor  # [B, T, H, D] exp(g)
    conv_inputs: torch.Tensor  # [B, 3, W, T] pre-conv q/k/v inputs, in the conv window's dtype
    lengths: torch.Tensor  # [B] valid positions per request


def allocate_records(batch: int, tokens: int, heads: int, head_dim: int, conv_dtype: torch.dtype, device,
                     lengths: torch.Tensor, leading: tuple[int, ...] = (), dtype: torch.dtype = torch.float32
                     ) -> KDARecords:
    """Uninitialised record buffers for verify; `leading` = (L,) stacks L layers, so that one
    kda_commit_layers replays them all (each layer's verify fills its [l] views). dtype: the keys',
    updates' and decays' (float32; float64 for a float64 oracle)."""
    per_position = (*leading, batch, tokens, heads, head_dim)
    return KDARecords(
        keys=torch.empty(per_position, device=device, dtype=dtype),
        updates=torch.empty(per_position, device=device, dtype=dtype),
        decays=torch.empty(per_position, device=device, dtype=dtype),
        conv_inputs=torch.empty((*leading, batch, 3, heads * head_dim, tokens), device=device, dtype=conv_dtype),
        lengths=lengths,
    )


def layer_records(stacked: KDARecords, layer: int) -> KDARecords:
    """Layer `layer`'s views of records stacked by allocate_records(leading=(L,))."""
    return KDARecords(stacked.keys[layer], stacked.updates[layer], stacked.decays[layer], stacked.conv_inputs[layer],
                      stacked.lengths)


def _check(name: str, tensor: torch.Tensor, shape: tuple) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(tensor.shape)}")


def check_slots(slots: torch.Tensor, batch: int, device: torch.device) -> None:
    """The checks every implementation makes of `slots` (values are the caller's contract: the
    kernels run inside CUDA graphs and read no device value on the host)."""
    if not isinstance(slots, torch.Tensor):
        raise ValueError(f"slots: expected a [{batch}] int64 tensor, got {type(slots).__name__}")
    if tuple(slots.shape) != (batch,) or slots.dtype != torch.int64 or slots.device != device:
        raise ValueError(f"slots: expected a [{batch}] int64 tensor on {device}, got {tuple(slots.shape)} "
                         f"{slots.dtype} on {slots.device}")


def _pool_rows(slots, batch: int, state: torch.Tensor, conv_state: torch.Tensor, *, distinct: bool) -> list[int]:
    """The state row of each request: slots[b], read on the host as the reference reads lengths
    (so it is never captured in a CUDA graph), or b without slots. `distinct`: commit writes the
    rows, so two requests may not share one."""
    pool = state.shape[0]
    if conv_state.shape[0] != pool:
        raise ValueError(f"conv_state: {conv_state.shape[0]} rows, the state has {pool}")
    if slots is None:
        if pool != batch:
            raise ValueError(f"state: {pool} rows for {batch} requests (without slots, row b is request b's)")
        return list(range(batch))
    check_slots(slots, batch, state.device)
    rows = [int(s) for s in slots.tolist()]
    for row in rows:
        if not 0 <= row < pool:
            raise ValueError(f"slots: {row} outside the pool's rows [0, {pool})")
    if distinct and len(set(rows)) != len(rows):
        raise ValueError(f"slots: {rows} repeats a row; commit advances each row once")
    return rows


def _l2_normalise(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


@register("kda_verify", "reference", priority=0, reads_device_values=True)
def kda_verify(
    q_in, k_in, v_in, f, beta_in, gate_in, conv_weight, conv_state, A_log, dt_bias, o_norm_weight,
    state, lengths, *, lower_bound: float, eps: float, l2_eps: float = 1e-6, slots=None, records=None,
):
    B, T, W = q_in.shape
    H = beta_in.shape[-1]
    if H == 0 or W % H:
        raise ValueError(f"beta_in: {H} heads do not divide width {W}")
    D = W // H
    for name, tensor, shape in (
        ("k_in", k_in, (B, T, W)), ("v_in", v_in, (B, T, W)), ("f", f, (B, T, W)),
        ("beta_in", beta_in, (B, T, H)), ("gate_in", gate_in, (B, T, W)),
        ("conv_weight", conv_weight, (3, W, CONV_TAPS)),
        ("conv_state", conv_state, (conv_state.shape[0], 3, W, CONV_TAPS - 1)),
        ("A_log", A_log, (H,)), ("dt_bias", dt_bias, (W,)), ("o_norm_weight", o_norm_weight, (D,)),
        ("state", state, (state.shape[0], H, D, D)), ("lengths", lengths, (B,)),
    ):
        _check(name, tensor, shape)
    rows = _pool_rows(slots, B, state, conv_state, distinct=False)
    if state.dtype != torch.float32:
        raise ValueError(f"state: dtype must be float32, got {state.dtype}")
    lengths_list = [int(n) for n in lengths]
    for n in lengths_list:
        if not 0 <= n <= T:
            raise ValueError(f"lengths: {n} outside [0, {T}]")

    device = q_in.device
    # fp32 arithmetic (float64 when the inputs are float64, so tests can use this as a float64
    # oracle); the state itself is always stored fp32.
    compute = torch.float64 if q_in.dtype == torch.float64 else torch.float32
    out = torch.zeros(B, T, W, dtype=q_in.dtype, device=device)
    keys = torch.zeros(B, T, H, D, dtype=compute, device=device)
    updates = torch.zeros_like(keys)
    decays = torch.zeros_like(keys)
    # Inputs are rounded to the window's dtype first, so a position reads the same value whether
    # it comes from this block or, later, from the committed window.
    conv_inputs = torch.stack([q_in, k_in, v_in], dim=1).to(conv_state.dtype).transpose(2, 3)  # [B,3,W,T]
    taps = conv_weight.to(compute)
    decay_rate = torch.exp(A_log.to(compute)).unsqueeze(-1)  # [H, 1]
    dt = dt_bias.to(compute).view(H, D)
    norm_weight = o_norm_weight.to(compute)
    scale = D ** -0.5

    for b in range(B):
        window = torch.cat([conv_state[rows[b]], conv_inputs[b]], dim=-1).to(compute)  # [3, W, 3 + T]
        S = state[rows[b]].to(compute)
        for t in range(lengths_list[b]):
            x = window[..., t : t + CONV_TAPS]  # oldest first; tap 3 is the current input
            conv = taps[..., 0] * x[..., 0]
            for j in range(1, CONV_TAPS):
                conv = conv + taps[..., j] * x[..., j]
            q, k, v = torch.nn.functional.silu(conv).view(3, H, D)
            q = _l2_normalise(q, l2_eps) * scale
            k = _l2_normalise(k, l2_eps)
            g = lower_bound * torch.sigmoid(decay_rate * (f[b, t].to(compute).view(H, D) + dt))
            decay = torch.exp(g)
            beta = torch.sigmoid(beta_in[b, t].to(compute)).unsqueeze(-1)  # [H, 1]
            S = decay.unsqueeze(-1) * S
            u = beta * (v - (S * k.unsqueeze(-1)).sum(-2))
            S = S + k.unsqueeze(-1) * u.unsqueeze(-2)
            o = (S * q.unsqueeze(-1)).sum(-2)  # S^T q: [H, D_v]
            o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * norm_weight
            o = o * torch.sigmoid(gate_in[b, t].to(compute).view(H, D))
            out[b, t] = o.reshape(W).to(out.dtype)
            keys[b, t], updates[b, t], decays[b, t] = k, u, decay
    if records is None:
        return out, KDARecords(keys, updates, decays, conv_inputs, lengths.detach().clone())
    for name, value in (("keys", keys), ("updates", updates), ("decays", decays), ("conv_inputs", conv_inputs)):
        buffer = getattr(records, name)
        _check(f"records.{name}", buffer, value.shape)
        buffer.copy_(value)
    return out, records


@register("kda_commit", "reference", priority=0, reads_device_values=True)
def kda_commit(state: torch.Tensor, conv_state: torch.Tensor, records: KDARecords, num_tokens, slots=None) -> None:
    B = records.keys.shape[0]
    _check("num_tokens", torch.as_tensor(num_tokens), (B,))
    _check("conv_state", conv_state, (conv_state.shape[0],) + tuple(records.conv_inputs.shape[1:3]) + (CONV_TAPS - 1,))
    _check("state", state, (state.shape[0],) + tuple(records.keys.shape[2:]) + (records.keys.shape[-1],))
    rows = _pool_rows(slots, B, state, conv_state, distinct=True)
    for b in range(B):
        n = int(num_tokens[b])
        if not 0 <= n <= int(records.lengths[b]):
            raise ValueError(f"num_tokens: {n} for request {b} outside [0, {int(records.lengths[b])}]")
        if n == 0:
            continue
        row = rows[b]
        S = state[row].to(records.keys.dtype)
        for t in range(n):  # the same two operations, in the same order, as in kda_verify
            S = records.decays[b, t].unsqueeze(-1) * S
            S = S + records.keys[b, t].unsqueeze(-1) * records.updates[b, t].unsqueeze(-2)
        state[row].copy_(S)
        window = torch.cat([conv_state[row], records.conv_inputs[b, :, :, :n]], dim=-1)
        conv_state[row].copy_(window[..., -(CONV_TAPS - 1) :])


@register("kda_commit_layers", "reference", priority=0, reads_device_values=True)
def kda_commit_layers(states: torch.Tensor, conv_states: torch.Tensor, records: KDARecords, num_tokens,
                      slots=None) -> None:
    """kda_commit of L stacked layers: states [L, S, H, D, D], conv_states [L, S, 3, W, 3] and records
    with a leading L (allocate_records(leading=(L,))), num_tokens [B] shared by the layers."""
    if states.dim() != 5 or conv_states.dim() != 5 or conv_states.shape[0] != states.shape[0]:
        raise ValueError(f"states / conv_states: expected [L, S, H, D, D] and [L, S, 3, W, 3], got "
                         f"{tuple(states.shape)} and {tuple(conv_states.shape)}")
    if records.keys.dim() != 5 or records.keys.shape[0] != states.shape[0]:
        raise ValueError(f"records.keys: expected [{states.shape[0]}, B, T, H, D], got {tuple(records.keys.shape)}")
    for layer in range(states.shape[0]):
        kda_commit(states[layer], conv_states[layer], layer_records(records, layer), num_tokens, slots=slots)
