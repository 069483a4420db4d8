"""Host side of the CuTe DSL KDA verify + commit kernels (kda/cute_kernel.py): the kernel options
and their defaults, argument checks, the compile cache and the torch-facing wrappers (contract:
kernels/kda/reference.py). Imports no cutlass: the kernel module is imported on the first compile.
"""
import functools

import torch

from ..cute_common import CompileCache, torch_to_cutlass_dtype
from .reference import KDARecords, allocate_records, check_slots

ROW_CHUNKS = 4  # default row_chunks: the warps a column's rows are split over; partial dots meet in smem
MAX_TOKENS = 16  # verify width supported: T = 1..16 (k <= 15 drafts)
# Whether verify takes its [B, T, width] inputs with their own row strides (the kernel is compiled
# for any), so the column slices of the model's fused input GEMM go in without a copy; False
# copies them (5 launches per KDA layer whenever the slices are not contiguous: T > 1 or B > 1).
# The k3-slice step was faster with strided inputs at every batch measured on the H200
# (experiments/step_bench.py --setting kda_strided_inputs=0 times the copies; experiments/notes/step.md),
# and the outputs are bitwise equal (tests/gpu/test_kda_gpu.py).
STRIDED_INPUTS = True

_cache = CompileCache()


def default_variant(head_dim: int, op: str) -> dict:
    """Kernel options per op: the H200 bench's fastest at K3 dims, B=1, T=8, among the variants
    that pass every GPU test, the bitwise one-token-decode check included (experiments/notes/kda.md).

    Verify: one CTA per head (no cluster exchange, the q/k conv not repeated per V-split), fast
    math, the state copied by the TMA unit, per-block barriers and PDL. Commit: 4 CTAs per head
    with the TMA-unit state copy and PDL."""
    if op == "verify":
        return dict(block_v=head_dim, cols=1, row_chunks=ROW_CHUNKS, fast_math=True, bulk_state=True,
                    group_sync=True, pdl=True)
    return dict(block_v=32, cols=1, row_chunks=ROW_CHUNKS, bulk_state=True, pdl=True)


def check_verified_variant(head_dim: int, variant: dict) -> None:
    """Verify variants whose outputs have not matched one-token decode bit for bit on the GPU are
    benchmark-only: V-split verify (block_v < head_dim) and register state loads (bulk_state
    False). ValueError naming the option unless the caller asked for experimental variants."""
    if variant["block_v"] != head_dim:
        raise ValueError(f"block_v={variant['block_v']}: verify split over V-split CTAs is not verified bitwise "
                         f"(only block_v={head_dim}); pass experimental_variant=True to benchmark it")
    if not variant["bulk_state"]:
        raise ValueError("bulk_state=False: verify with register state loads is not verified bitwise; "
                         "pass experimental_variant=True to benchmark it")


def resolve_variant(head_dim: int, op: str, **given) -> dict:
    """The default variant of `op` with the options the caller gave (None = default)."""
    variant = default_variant(head_dim, op)
    variant.update({name: value for name, value in given.items() if value is not None})
    return variant


def _check_head_dim(head_dim: int, block_v: int) -> None:
    if head_dim % 32 != 0 or head_dim > 128:
        raise ValueError(f"head_dim={head_dim}: the CuTe KDA kernels need a multiple of 32, at most 128")
    if block_v % 32 != 0 or head_dim % block_v != 0:
        raise ValueError(f"block_v={block_v}: must be a multiple of 32 that divides head_dim={head_dim}")
    if head_dim // block_v > 8:
        raise ValueError(f"block_v={block_v}: more than 8 V-splits per head (cluster limit)")


# ----------------------------------------------------------------------------------------------
# verify


def _check_layout(head_dim: int, block_v: int, cols: int, row_chunks: int) -> None:
    """The thread layout of a [head_dim x block_v] state slice (see the module docstring)."""
    if cols not in (1, 2, 4) or block_v % (32 * cols) != 0:
        raise ValueError(f"cols={cols}: must be 1, 2 or 4 with 32*cols dividing block_v={block_v}")
    if row_chunks not in (2, 4, 8) or head_dim % row_chunks != 0:
        raise ValueError(f"row_chunks={row_chunks}: must be 2, 4 or 8 and divide head_dim={head_dim}")
    threads = row_chunks * block_v // cols
    if not head_dim <= threads <= 1024:
        raise ValueError(f"row_chunks={row_chunks}, block_v={block_v}, cols={cols}: {threads} threads per CTA, "
                         f"need head_dim={head_dim}..1024")


def compile_verify(arch: str, head_dim: int, block_v: int, max_tokens: int, in_dtype: torch.dtype,
                   conv_dtype: torch.dtype, extra_options: tuple[str, ...] = (), *, cols: int = 1,
                   row_chunks: int = ROW_CHUNKS, fast_math: bool = False, bulk_state: bool = False,
                   group_sync: bool = False, pdl: bool = False, probe: bool = False, slot_indexed: bool = False):
    """The compiled verify kernel for one variant (cached; CPU-only compile works with any arch).

    cols / row_chunks: the thread layout (state columns per thread, warps a column's rows are
    split over); fast_math: approximate reciprocals in the sigmoids and L2 norms; bulk_state: the
    state slice is copied into shared memory by the TMA unit (cp.async.bulk) instead of register
    loads; group_sync: each step's barrier spans only the warps of one column block (named
    barriers), so blocks do not wait for each other; pdl: programmatic dependent launch (the
    kernel waits for its predecessor before any memory access and lets its successor launch
    after the prologue); probe: thread 0
    of each CTA writes clock64 and %globaltimer at 5 phase boundaries into probe_out (diagnostic);
    slot_indexed: request b reads row slots[b] of the state and conv pools (else row b; the slots
    argument is then never read).
    extra_options: more cute.compile flags, e.g. ("--keep-ptx",) to inspect the PTX (written to
    the current directory).
    """
    _check_head_dim(head_dim, block_v)
    _check_layout(head_dim, block_v, cols, row_chunks)
    if not 1 <= max_tokens <= MAX_TOKENS:
        raise ValueError(f"max_tokens={max_tokens}: must be in 1..{MAX_TOKENS}")
    key = ("kda_verify", arch, head_dim, block_v, max_tokens, in_dtype, conv_dtype, cols, row_chunks, fast_math,
           bulk_state, group_sync, pdl, probe, slot_indexed, extra_options)

    def build():
        from . import cute_kernel

        return cute_kernel.build_verify(
            arch, head_dim, block_v, max_tokens, torch_to_cutlass_dtype(in_dtype), torch_to_cutlass_dtype(conv_dtype),
            cols, row_chunks, fast_math, bulk_state, group_sync, pdl, probe, slot_indexed, extra_options)

    return _cache.get(key, build)


def compile_commit(arch: str, head_dim: int, block_v: int, conv_dtype: torch.dtype,
                   extra_options: tuple[str, ...] = (), *, cols: int = 1, row_chunks: int = ROW_CHUNKS,
                   bulk_state: bool = False, pdl: bool = False, slot_indexed: bool = False):
    """The compiled commit kernel for one variant (cached), see compile_verify."""
    _check_head_dim(head_dim, block_v)
    _check_layout(head_dim, block_v, cols, row_chunks)
    key = ("kda_commit", arch, head_dim, block_v, conv_dtype, cols, row_chunks, bulk_state, pdl, slot_indexed,
           extra_options)

    def build():
        from . import cute_kernel

        return cute_kernel.build_commit(arch, head_dim, block_v, MAX_TOKENS, torch_to_cutlass_dtype(conv_dtype), cols,
                                        row_chunks, bulk_state, pdl, slot_indexed, extra_options)

    return _cache.get(key, build)


# ----------------------------------------------------------------------------------------------
# which calls the kernels take (the registry sends the others to the reference)

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _head_dim_ok(state: torch.Tensor) -> bool:
    D = state.shape[-1]
    return D % 32 == 0 and D <= 128 and state.dtype == torch.float32


def supports_verify(q_in, k_in, v_in, f, beta_in, gate_in, conv_weight, conv_state, A_log, dt_bias,
                    o_norm_weight, state, lengths) -> bool:
    return (_head_dim_ok(state) and q_in.dim() == 3 and 1 <= q_in.shape[1] <= MAX_TOKENS
            and q_in.dtype in _DTYPES and conv_state.dtype in _DTYPES)


def supports_commit(state, conv_state) -> bool:
    return _head_dim_ok(state) and conv_state.dtype in _DTYPES


def supports_commit_layers(states, conv_states) -> bool:
    return states.dim() == 5 and supports_commit(states, conv_states)


# ----------------------------------------------------------------------------------------------
# torch-facing wrappers (contract: kernels/kda/reference.py; records are its KDARecords)


def _require(cond: bool, field: str, value, what: str) -> None:
    if not cond:
        raise ValueError(f"kda: {field}={value} {what}")


def _rows_contiguous(x: torch.Tensor, leading: int) -> bool:
    """Whether x's rows (its dims after the first `leading`) are contiguous, whatever the strides
    of the leading dims: the kernels take pools with any slot (and layer) stride."""
    expected = 1
    for size, stride in zip(reversed(x.shape[leading:]), reversed(x.stride()[leading:])):
        if stride != expected:
            return False
        expected *= size
    return True


def _check_pools(state: torch.Tensor, conv_state: torch.Tensor, leading: int, batch: int, slots, bulk_state: bool,
                 names: tuple[str, str]) -> None:
    """The state and conv pools of a call: the same number of rows (dim `leading`), batch rows
    without slots, contiguous rows, and for the TMA-unit copy (bulk_state) 16-byte aligned rows.
    Slot values are the caller's contract (read on the device only)."""
    rows = state.shape[leading]
    _require(conv_state.shape[leading] == rows, f"{names[1]}.shape", tuple(conv_state.shape),
             f"must have the state's {rows} rows in dim {leading}")
    if slots is None:
        _require(rows == batch, f"{names[0]}.shape", tuple(state.shape),
                 f"must have {batch} rows in dim {leading} (one per request without slots)")
    else:
        check_slots(slots, batch, state.device)
    for name, x in zip(names, (state, conv_state)):
        _require(_rows_contiguous(x, leading + 1), f"{name}.stride", x.stride(),
                 f"must have contiguous rows after dim {leading} (any stride before)")
    if bulk_state:
        aligned = state.data_ptr() % 16 == 0 and all(state.stride(d) % 4 == 0 for d in range(leading + 1))
        _require(aligned, f"{names[0]}.stride", state.stride(),
                 "must keep every row 16-byte aligned for the TMA-unit copy (bulk_state)")


def verify(q_in, k_in, v_in, f, beta_in, gate_in, conv_weight, conv_state, A_log, dt_bias,
           o_norm_weight, state, lengths, *, lower_bound: float, eps: float, arch: str,
           block_v: int | None = None, cols: int | None = None, row_chunks: int | None = None,
           fast_math: bool | None = None, bulk_state: bool | None = None, group_sync: bool | None = None,
           pdl: bool | None = None, records: KDARecords | None = None, out: torch.Tensor | None = None,
           probe: torch.Tensor | None = None, experimental_variant: bool = False, slots: torch.Tensor | None = None):
    """Output-only KDA verify, the reference kda_verify's contract. Returns (out, records).

    slots [B] int64 on the state's device: state [S, H, D, D] and conv_state [S, 3, W, 3] are
    pools with contiguous rows and any slot stride (a per-layer view of a target's pool), and
    request b reads row slots[b]; the kernel looks the row up, so nothing is gathered.

    block_v, cols, row_chunks, fast_math, bulk_state, group_sync, pdl: kernel options (None = default_variant's);
    experimental_variant (benchmarks only): allow the options check_verified_variant refuses; probe: an
    int64 [B, H, head_dim // block_v, 10] tensor selects the probe build, which writes each CTA's
    clock64 (0..4) and %globaltimer (5..9) at kernel start, after the conv, before the
    recurrence, after it, and at the end (diagnostic; see experiments/kda_bench.py).

    `records` and `out`, if given, are filled in place (records e.g. as views of stacked per-layer
    buffers from allocate_records(leading=(L,)), so that one commit launch replays every layer).
    records.lengths is the `lengths` tensor itself, not a copy; commit does not read it.
    """
    _require(state.dim() == 4 and state.dtype == torch.float32, "state.shape", (tuple(state.shape), state.dtype),
             "must be [S, H, D, D] fp32")
    _, H, D, D2 = state.shape
    _require(D == D2, "state.shape", tuple(state.shape), "must be [S, H, D, D]")
    variant = resolve_variant(D, "verify", block_v=block_v, cols=cols, row_chunks=row_chunks, fast_math=fast_math,
                              bulk_state=bulk_state, group_sync=group_sync, pdl=pdl)
    _check_head_dim(D, variant["block_v"])
    _check_layout(D, variant["block_v"], variant["cols"], variant["row_chunks"])
    if not experimental_variant:
        check_verified_variant(D, variant)
    W = H * D
    _require(q_in.dim() == 3 and q_in.shape[2] == W, "q_in.shape", tuple(q_in.shape), f"must be [B, T, W={W}]")
    B, T = q_in.shape[:2]
    _require(1 <= T <= MAX_TOKENS, "T", T, f"must be in 1..{MAX_TOKENS}")
    dtype = q_in.dtype
    for name, x in (("k_in", k_in), ("v_in", v_in), ("f", f), ("gate_in", gate_in)):
        _require(x.shape == q_in.shape and x.dtype == dtype, f"{name}.shape/dtype", (tuple(x.shape), x.dtype),
                 f"must match q_in {tuple(q_in.shape)} {dtype}")
    _require(tuple(beta_in.shape) == (B, T, H) and beta_in.dtype == dtype, "beta_in.shape/dtype",
             (tuple(beta_in.shape), beta_in.dtype), f"must be [{B}, {T}, {H}] {dtype}")
    _require(tuple(conv_weight.shape) == (3, W, 4) and conv_weight.dtype == torch.float32, "conv_weight.shape",
             (tuple(conv_weight.shape), conv_weight.dtype), f"must be [3, {W}, 4] fp32")
    _require(conv_state.dim() == 4 and tuple(conv_state.shape[1:]) == (3, W, 3), "conv_state.shape",
             tuple(conv_state.shape), f"must be [S, 3, {W}, 3]")
    if slots is None and not (_rows_contiguous(state, 1) and _rows_contiguous(conv_state, 1)):
        # read only: a copy of a batch's own states loses nothing (a pool's must not be copied)
        state, conv_state = state.contiguous(), conv_state.contiguous()
    _check_pools(state, conv_state, 0, B, slots, variant["bulk_state"], ("state", "conv_state"))
    _require(A_log.dim() == 1 and A_log.shape[0] >= H and A_log.dtype == torch.float32, "A_log.shape",
             (tuple(A_log.shape), A_log.dtype), f"must be fp32 with at least {H} entries")
    _require(tuple(dt_bias.shape) == (W,) and dt_bias.dtype == torch.float32, "dt_bias.shape",
             (tuple(dt_bias.shape), dt_bias.dtype), f"must be [{W}] fp32")
    _require(tuple(o_norm_weight.shape) == (D,) and o_norm_weight.dtype == torch.float32, "o_norm_weight.shape",
             (tuple(o_norm_weight.shape), o_norm_weight.dtype), f"must be [{D}] fp32")
    _require(tuple(lengths.shape) == (B,) and not lengths.is_floating_point(), "lengths.shape",
             (tuple(lengths.shape), lengths.dtype), f"must be [{B}] integer")
    lengths = lengths.to(device=state.device, dtype=torch.int64)

    if out is None:
        out = torch.empty_like(q_in)
    _require(out.shape == q_in.shape and out.dtype == dtype and out.is_contiguous(), "out.shape",
             (tuple(out.shape), out.dtype), f"must be contiguous {tuple(q_in.shape)} {dtype}")
    if records is None:
        records = allocate_records(B, T, H, D, conv_state.dtype, state.device, lengths)
    else:
        for name in ("keys", "updates", "decays"):
            x = getattr(records, name)
            _require(tuple(x.shape) == (B, T, H, D) and x.dtype == torch.float32 and x.is_contiguous(),
                     f"records.{name}.shape", tuple(x.shape), f"must be contiguous [{B}, {T}, {H}, {D}] fp32")
        x = records.conv_inputs
        _require(tuple(x.shape) == (B, 3, W, T) and x.dtype == conv_state.dtype and x.is_contiguous(),
                 "records.conv_inputs.shape", (tuple(x.shape), x.dtype),
                 f"must be contiguous [{B}, 3, {W}, {T}] {conv_state.dtype}")
        records.lengths = lengths
    if probe is not None:
        shape = (B, H, D // variant["block_v"], 10)
        _require(tuple(probe.shape) == shape and probe.dtype == torch.int64 and probe.is_contiguous(), "probe.shape",
                 (tuple(probe.shape), probe.dtype), f"must be contiguous {list(shape)} int64")
    kernel = compile_verify(arch, D, variant["block_v"], MAX_TOKENS, dtype, conv_state.dtype, cols=variant["cols"],
                            row_chunks=variant["row_chunks"], fast_math=variant["fast_math"],
                            bulk_state=variant["bulk_state"], group_sync=variant["group_sync"], pdl=variant["pdl"],
                            probe=probe is not None, slot_indexed=slots is not None)
    c = torch.Tensor.contiguous
    row = _rows if STRIDED_INPUTS else c
    # without slots the build never reads its slots argument: lengths stands in (an int64 [B])
    kernel(row(q_in), row(k_in), row(v_in), row(f), row(beta_in), row(gate_in), c(conv_weight), conv_state, c(A_log),
           c(dt_bias), c(o_norm_weight), state, lengths, lengths if slots is None else slots, out, records.keys,
           records.updates, records.decays, records.conv_inputs,
           probe if probe is not None else _no_probe(state.device), float(lower_bound), float(eps))
    return out, records


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel reads it: any batch and token strides, contiguous columns."""
    return x if x.stride(-1) == 1 else x.contiguous()


@functools.cache
def _no_probe(device: torch.device) -> torch.Tensor:
    """The probe argument of the builds without the probe (never read or written)."""
    return torch.zeros((1, 1, 1, 1), device=device, dtype=torch.int64)


def _num_tokens_tensor(num_tokens, batch: int, device) -> torch.Tensor:
    num_tokens = torch.as_tensor(num_tokens, device=device)
    _require(tuple(num_tokens.shape) == (batch,) and not num_tokens.is_floating_point(), "num_tokens.shape",
             (tuple(num_tokens.shape), num_tokens.dtype), f"must be [{batch}] integer")
    return num_tokens.to(dtype=torch.int64).contiguous()


def commit_layers(states, conv_states, records: KDARecords, num_tokens, *, arch: str,
                  block_v: int | None = None, cols: int | None = None, row_chunks: int | None = None,
                  bulk_state: bool | None = None, pdl: bool | None = None, slots: torch.Tensor | None = None) -> None:
    """Commit the first num_tokens[b] verified positions of L stacked layers in one launch.

    states [L, B, H, D, D] fp32 and conv_states [L, B, 3, W, 3], updated in place; records with
    a leading L (keys/updates/decays [L, B, T, H, D], conv_inputs [L, B, 3, W, T]); num_tokens
    [B] in 0..T, shared by the layers. Counts above T are clamped to T on the device; the caller
    keeps them <= lengths (no host sync to check it here). slots [B] int64: states
    [L, S, H, D, D] and conv_states [L, S, 3, W, 3] are pools and request b advances row
    slots[b] of each layer (rows not in slots are untouched). Rows are contiguous; the layer and
    slot strides are free. block_v, cols, row_chunks, bulk_state, pdl: kernel options
    (None = default_variant's).
    """
    _require(states.dim() == 5 and states.dtype == torch.float32, "states.shape",
             (tuple(states.shape), states.dtype), "must be [L, S, H, D, D] fp32")
    L, _, H, D, _ = states.shape
    variant = resolve_variant(D, "commit", block_v=block_v, cols=cols, row_chunks=row_chunks, bulk_state=bulk_state,
                              pdl=pdl)
    _check_head_dim(D, variant["block_v"])
    _check_layout(D, variant["block_v"], variant["cols"], variant["row_chunks"])
    W = H * D
    _require(conv_states.dim() == 5 and conv_states.shape[0] == L and tuple(conv_states.shape[2:]) == (3, W, 3),
             "conv_states.shape", tuple(conv_states.shape), f"must be [{L}, S, 3, {W}, 3]")
    B = records.keys.shape[1] if records.keys.dim() == 5 else -1
    T = records.keys.shape[2] if records.keys.dim() == 5 else -1
    for name in ("keys", "updates", "decays"):
        x = getattr(records, name)
        _require(tuple(x.shape) == (L, B, T, H, D) and x.dtype == torch.float32, f"records.{name}.shape",
                 tuple(x.shape), f"must be [{L}, {B}, T, {H}, {D}] fp32")
    x = records.conv_inputs
    _require(tuple(x.shape) == (L, B, 3, W, T) and x.dtype == conv_states.dtype, "records.conv_inputs.shape",
             (tuple(x.shape), x.dtype), f"must be [{L}, {B}, 3, {W}, {T}] {conv_states.dtype}")
    num_tokens = _num_tokens_tensor(num_tokens, B, states.device)
    _check_pools(states, conv_states, 1, B, slots, variant["bulk_state"], ("states", "conv_states"))
    kernel = compile_commit(arch, D, variant["block_v"], conv_states.dtype, cols=variant["cols"],
                            row_chunks=variant["row_chunks"], bulk_state=variant["bulk_state"], pdl=variant["pdl"],
                            slot_indexed=slots is not None)
    c = torch.Tensor.contiguous
    # without slots the build never reads its slots argument: num_tokens stands in (an int64 [B])
    kernel(states, conv_states, c(records.keys), c(records.updates), c(records.decays), c(records.conv_inputs),
           num_tokens, num_tokens if slots is None else slots)


def commit(state, conv_state, records: KDARecords, num_tokens, *, arch: str, block_v: int | None = None,
           cols: int | None = None, row_chunks: int | None = None, bulk_state: bool | None = None,
           pdl: bool | None = None, slots: torch.Tensor | None = None) -> None:
    """One layer (the reference kda_commit's contract): bring state [B, H, D, D] and conv_state
    [B, 3, W, 3] in place to the first num_tokens[b] verified positions; 0 leaves both untouched.
    With slots, rows slots[b] of the pools [S, H, D, D] and [S, 3, W, 3] (see commit_layers)."""
    _require(state.dim() == 4, "state.shape", tuple(state.shape), "must be [S, H, D, D]")
    _require(conv_state.dim() == 4, "conv_state.shape", tuple(conv_state.shape), "must be [S, 3, W, 3]")
    stacked = KDARecords(records.keys.unsqueeze(0), records.updates.unsqueeze(0), records.decays.unsqueeze(0),
                         records.conv_inputs.unsqueeze(0), records.lengths)
    commit_layers(state.unsqueeze(0), conv_state.unsqueeze(0), stacked, num_tokens, arch=arch, block_v=block_v,
                  cols=cols, row_chunks=row_chunks, bulk_state=bulk_state, pdl=pdl, slots=slots)
