"""Batch-1 speed of K3 on 8 and 16 GB300, PROJECTED from one rank's measured step
(docs/kimi-k3.md §8.4). Not a measurement: no multi-GPU machine has run it.

`dspark roofline --measured FILE`, FILE an experiments/step_bench.py result of a rank target
(k3-rank). Per step:
- compute: the rank's graph-replay step (batch 1, the context, T = 1 plain and T = 8 verify) times
  the measuring GPU's datasheet bandwidth over the GB300's (8 TB/s), so the step keeps its
  measured fraction of the floor; a build of the first N layers is scaled by 93 / N (its
  embedding, lm_head and sampling with it: an overestimate of their share). On 8 GPUs each
  rank holds twice the share: the 16-way step times the bytes of an 8-way rank's step over a
  16-way rank's (dspark.roofline.step_cost, the busiest rank's experts for both);
- the draft pass (DSpark, block 7: verify T = 8): with `--measured-draft FILE` (an
  experiments/drafter_bench.py result, graphed propose at the context, of a --world W share)
  its measured time, scaled as the step's is (datasheet bandwidth over the GB300's) and by the
  bytes of the projected GPUs' share over the measured share's (roofline.draft_pass_bytes);
  without it, a model: its bytes (drafter weights, the target's lm_head again, its cache) over
  the GPUs at the verify's measured fraction of the floor;
- communication, from cited public figures (CITED): two all-reduces per layer (attention output,
  FFN output) and one for the embedding at the step's message size; per MoE layer the exchange
  the rank runs (docs/kimi-k3.md §8.2): the dispatch's all-gather of router logits and latent and
  the combine's all-reduce of the experts' latent sums (MOE_EXCHANGES["gather"]); the logits'
  all-gather; the drafter's all-reduces (two per layer and the embedding's) and its logits'
  all-gather. All in series: at batch 1 each waits for its layer. A second exchange,
  MOE_EXCHANGES["all_to_all"], prices an EP all-to-all dispatch + combine in its place (the
  published batch-1 figures of one), for comparison.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from dspark import roofline
from dspark.drafters.dspark.config import rank_share
from dspark.targets.kimi_k3.config import K3, RANK_PRESETS, K3Config
from dspark.targets.kimi_k3.sharding import Shard

GB300_BYTES_PER_S = roofline.GPUS["gb300"].bandwidth
# Datasheet HBM bandwidth of the GPUs a rank step is measured on, by a word of the device name.
DATASHEET_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12}
# NVLink 5: 1.8 TB/s per GPU both directions, 900 GB/s each way (datasheet); assumed for the
# part of an all-reduce message beyond the size its latency was published at.
NVLINK5_BYTES_PER_S = 900e9
PROJECTED_GPUS = (8, 16)
VERIFY_T = 8  # DSpark block 7: 7 drafts + the anchor


@dataclass(frozen=True)
class Cited:
    us: float
    source: str


CITED = {
    "all_reduce": Cited(7.0, "vLLM PR 37756: custom one-shot all-reduce, 16 KiB, B300/GB300"),
    "all_reduce_floor": Cited(3.0, "NVIDIA/nccl issue 1940: NCCL 2.27 symmetric-memory all-reduce, 8 B, 8x B200"),
    "dispatch_ep8": Cited(18.9, "TensorRT-LLM tech blog 18 (NVLinkOneSided), batch 1, GB200 NVL72 EP8"),
    "combine_ep8": Cited(31.0, "TensorRT-LLM tech blog 18, batch 1, GB200 NVL72 EP8"),
    "dispatch_ep64": Cited(27.8, "TensorRT-LLM tech blog 18, batch 1, GB200 NVL72 EP64"),
    "combine_ep64": Cited(32.6, "TensorRT-LLM tech blog 18, batch 1, GB200 NVL72 EP64"),
    "logits_all_gather": Cited(10.8, "vLLM PR 55021: K3 logits all-gather, one-shot MNNVL, 8x B300"),
}
ALL_REDUCE_SIZE = 16 * 1024  # bytes the all-reduce latency was published at
# How a MoE layer's tokens reach the experts of other ranks and come back.
MOE_EXCHANGES = {
    "gather": ("the rank's own (docs/kimi-k3.md §8.2): the router logits and latent all-gathered ([rows, E] fp32 + "
               "[rows, latent] bf16), priced as a one-shot all-reduce of the gathered tensor (assumed: both read "
               "every peer, the all-gather 1/G of what the all-reduce reads); the experts' latent sums all-reduced "
               "([rows, latent] fp32)"),
    "all_to_all": "an EP all-to-all dispatch + combine in place of the gather and the latent all-reduce",
}
PUBLISHED = (
    "SGLang K3 cookbook (sgl-project/sglang PR 37878), 8x B300 TP8, MXFP4, 8k/1k, c=1: no speculation TPOT "
    "8.51 ms (118 tok/s); DSpark 2.84 ms/token (352 tok/s)",
    "LMSYS day-0 blog, GB300 TP8 (2x4, MNNVL), batch 1: 112.5 tok/s without speculation, ~423 tok/s with DSpark",
    "vLLM day-0 blog, GB300 NVL72, batch 1: 111 tok/s (TP8) / 118 (TP16) without speculation; 331 / 370 with DSpark",
    "K3 DSpark acceptance at block 7: golden AL 3.84 (SemiAnalysis, SPEED-Bench coding); AL 6 is optimistic",
)


@dataclass(frozen=True)
class RankMeasurement:
    """A rank's measured batch-1 steps: graph (else eager) ms at T = 1 and T = 8, with the layers
    built, the world it is a rank of, the floor bytes of its counted experts and the device."""

    plain_ms: float
    verify_ms: float
    verify_floor_bytes: float
    layers: int
    world: int
    context: int
    device: str
    source: str


@dataclass(frozen=True)
class DraftMeasurement:
    """A drafter's measured batch-1 propose (graph replay) at a context, of one `world`-way share."""

    propose_ms: float
    world: int
    context: int
    device: str
    source: str


def load_draft_measurement(path: str, context: int = 8192) -> DraftMeasurement:
    """The graphed propose row at `context` of an experiments/drafter_bench.py result, the default
    kernels (no `setting`); ValueError naming the file and what is missing."""
    data, rows = roofline._read_result_rows(path, "--measured-draft", "drafter_bench.py")
    match = [r for r in rows if isinstance(r, dict) and r.get("context") == context and r.get("cuda_graphs") is True
             and not r.get("setting")]
    if not match:
        raise ValueError(f"--measured-draft {path!r}: no graphed (cuda_graphs true) row of the default setting at "
                         f"context {context}")
    try:
        measurement = DraftMeasurement(propose_ms=float(match[0]["propose_ms"]), world=int(data["settings"]["world"]),
                                       context=context, device=str(data["device_name"]), source=path)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"--measured-draft {path!r}: the row or the file lacks or mistypes propose_ms / "
                         f"settings.world / device_name ({e!r})") from None
    if not measurement.propose_ms > 0:
        raise ValueError(f"--measured-draft {path!r}: propose_ms={measurement.propose_ms}: must be > 0")
    datasheet_bandwidth(measurement.device, path)
    return measurement


def load_rank_measurement(path: str, context: int = 8192) -> RankMeasurement:
    """The batch-1 rows of a rank target at `context`, T = 1 and T = 8, default kernels (no
    `setting`), graph rows preferred; ValueError naming the file and what is missing."""
    data, rows = roofline._read_result_rows(path, "--measured", "step_bench.py")
    picked = {}
    for T in (1, VERIFY_T):
        for mode in ("graph", "eager"):
            match = [r for r in rows if isinstance(r, dict) and r.get("target") in RANK_PRESETS and r.get("batch") == 1
                     and r.get("context") == context and r.get("T") == T and r.get("mode") == mode
                     and not r.get("setting")]
            if match:
                picked[T] = match[0]
                break
        else:
            raise ValueError(f"--measured {path!r}: no row of a rank target ({sorted(RANK_PRESETS)}) for batch 1, "
                             f"context {context}, T={T}")
    shard = data.get("shard") or {}
    try:
        measurement = RankMeasurement(
            plain_ms=float(picked[1]["ms"]), verify_ms=float(picked[VERIFY_T]["ms"]),
            verify_floor_bytes=float(picked[VERIFY_T]["floor_bytes"]), layers=int(picked[1]["layers"]),
            world=int(shard["world"]), context=context, device=str(data["device_name"]), source=path)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"--measured {path!r}: a rank row or the file lacks or mistypes ms / floor_bytes / layers / "
                         f"shard.world / device_name ({e!r})") from None
    if not measurement.plain_ms > 0 or not measurement.verify_ms > 0:
        raise ValueError(f"--measured {path!r}: ms must be > 0 (plain {measurement.plain_ms}, verify {measurement.verify_ms})")
    datasheet_bandwidth(measurement.device, path)
    return measurement


def datasheet_bandwidth(device: str, where: str = "device") -> float:
    for word, bandwidth in DATASHEET_BYTES_PER_S.items():
        if word in device:
            return bandwidth
    raise ValueError(f"{where}: device_name={device!r}: no datasheet bandwidth for it (known: {sorted(DATASHEET_BYTES_PER_S)})")


def all_reduce_us(nbytes: float, gpus: int, base: Cited) -> float:
    """The cited small-message latency, plus the bytes past ALL_REDUCE_SIZE that a one-shot
    all-reduce reads from each of the other GPUs over NVLink 5."""
    return base.us + max(0.0, nbytes - ALL_REDUCE_SIZE) * (gpus - 1) / NVLINK5_BYTES_PER_S * 1e6


def dispatch_combine_us(gpus: int) -> float:
    """EP dispatch + combine at batch 1 (flat up to batch 32 in the source): the EP8 figures, and
    for more GPUs interpolated in log2(EP) towards the EP64 ones."""
    ep8 = CITED["dispatch_ep8"].us + CITED["combine_ep8"].us
    ep64 = CITED["dispatch_ep64"].us + CITED["combine_ep64"].us
    return ep8 + (ep64 - ep8) * min(max(math.log2(gpus / 8) / 3, 0.0), 1.0)


def step_communication(cfg: K3Config, rows: int, gpus: int, base: Cited, exchange: str = "gather",
                       draft_rows: int = 0, draft_layers: int = 0) -> dict[str, float]:
    """Microseconds per kind of collective in one step of `rows` tokens (plus a draft pass of
    `draft_rows` positions through `draft_layers` layers), the MoE layers' tokens exchanged as
    MOE_EXCHANGES[exchange] says."""
    if exchange not in MOE_EXCHANGES:
        raise ValueError(f"exchange={exchange!r}: must be one of {list(MOE_EXCHANGES)}")
    hidden = rows * cfg.hidden_size * roofline.BF16
    draft_hidden = draft_rows * cfg.hidden_size * roofline.BF16
    moe_layers = cfg.num_layers - cfg.first_k_dense
    comm = {"all_reduce": (2 * cfg.num_layers + 1) * all_reduce_us(hidden, gpus, base)}
    if exchange == "gather":
        gathered = rows * (cfg.num_experts * roofline.FP32 + cfg.latent_size * roofline.BF16)
        comm["moe_dispatch_all_gather"] = moe_layers * all_reduce_us(gathered, gpus, base)
        comm["moe_combine_all_reduce"] = moe_layers * all_reduce_us(rows * cfg.latent_size * roofline.FP32, gpus, base)
    else:
        comm["ep_dispatch_combine"] = moe_layers * dispatch_combine_us(gpus)
    comm["logits_all_gather"] = CITED["logits_all_gather"].us
    if draft_rows:
        comm["draft_all_reduce"] = (2 * draft_layers + 1) * all_reduce_us(draft_hidden, gpus, base)
        comm["draft_logits_all_gather"] = CITED["logits_all_gather"].us
    return comm


def project(measurement: RankMeasurement, cfg: K3Config = K3, acceptance_lengths=(3.84, 6.0),
            draft_measurement: DraftMeasurement | None = None) -> dict:
    """The projection's inputs and, per GPU count, the plain and spec steps and tokens/s: with the
    cited one-shot all-reduce and the rank's own MoE exchange (the rows' plain keys), with the cited
    small-message all-reduce floor (floor_all_reduce_* keys), and with an EP all-to-all in place of
    the exchange (all_to_all_* keys). The draft pass is draft_measurement's, scaled, where given."""
    draft = roofline.default_draft(cfg)
    if draft is None:
        raise ValueError(f"preset {cfg.name!r}: no drafter preset drafts for it")
    if draft_measurement is not None and draft_measurement.context != measurement.context:
        raise ValueError(f"--measured-draft {draft_measurement.source!r}: context {draft_measurement.context}, "
                         f"the step's is {measurement.context}")
    device_bandwidth = datasheet_bandwidth(measurement.device)
    scale = device_bandwidth / GB300_BYTES_PER_S
    depth = cfg.num_layers / measurement.layers
    context = measurement.context
    measured = {1: measurement.plain_ms, VERIFY_T: measurement.verify_ms}
    verify_fraction = measurement.verify_floor_bytes / device_bandwidth / (measurement.verify_ms / 1e3)
    whole_verify = roofline.step_cost(cfg, tokens_per_request=VERIFY_T, context=context)
    whole_spec = roofline.step_cost(cfg, tokens_per_request=VERIFY_T, context=context, draft=draft)
    draft_bytes = whole_spec.total_bytes - whole_verify.total_bytes
    rows = []
    for gpus in PROJECTED_GPUS:
        compute = {}
        for T in (1, VERIFY_T):
            bytes_of = {g: roofline.step_cost(cfg, tokens_per_request=T, context=context, shard=Shard(0, g)).total_bytes
                        for g in (gpus, measurement.world)}
            compute[T] = measured[T] * depth * scale * bytes_of[gpus] / bytes_of[measurement.world]
        if draft_measurement is None:
            draft_ms = draft_bytes / gpus / GB300_BYTES_PER_S / verify_fraction * 1e3
        else:
            draft_ms = draft_measurement.propose_ms * measured_draft_factor(draft, draft_measurement, gpus)
        row = {"gpus": gpus, "plain_compute_ms": compute[1], "verify_compute_ms": compute[VERIFY_T], "draft_ms": draft_ms}
        for key, base, exchange in (("", CITED["all_reduce"], "gather"),
                                    ("floor_all_reduce_", CITED["all_reduce_floor"], "gather"),
                                    ("all_to_all_", CITED["all_reduce"], "all_to_all")):
            plain_comm = step_communication(cfg, 1, gpus, base, exchange)
            spec_comm = step_communication(cfg, VERIFY_T, gpus, base, exchange, draft.block_size, draft.num_layers)
            plain_ms = compute[1] + sum(plain_comm.values()) / 1e3
            spec_ms = compute[VERIFY_T] + draft_ms + sum(spec_comm.values()) / 1e3
            row.update({
                f"{key}plain_comm_us": plain_comm, f"{key}spec_comm_us": spec_comm,
                f"{key}plain_step_ms": plain_ms, f"{key}spec_step_ms": spec_ms,
                f"{key}plain_tokens_per_s": 1e3 / plain_ms,
                f"{key}spec_tokens_per_s": {format(al, "g"): al * 1e3 / spec_ms for al in acceptance_lengths},
            })
        rows.append(row)
    return {
        "label": "PROJECTION (not a measurement): no multi-GPU machine has run K3",
        "measured": {"source": measurement.source, "device": measurement.device, "plain_ms": measurement.plain_ms,
                     "verify_ms": measurement.verify_ms, "layers": measurement.layers, "world": measurement.world,
                     "context": context, "verify_floor_fraction": verify_fraction},
        "scaling": {"device_datasheet_TBps": device_bandwidth / 1e12, "gb300_TBps": GB300_BYTES_PER_S / 1e12,
                    "factor": scale, "depth_factor": depth},
        "draft": {"preset": draft.name, "bytes_whole": draft_bytes, "measured": None if draft_measurement is None else {
            "source": draft_measurement.source, "device": draft_measurement.device,
            "propose_ms": draft_measurement.propose_ms, "world": draft_measurement.world}},
        "communication": {"all_reduce": _all_reduce_text(CITED["all_reduce"]),
                          "all_reduce_floor": _all_reduce_text(CITED["all_reduce_floor"]),
                          "moe_exchange": MOE_EXCHANGES["gather"],
                          "ep_dispatch_combine": (
                              f"{CITED['dispatch_ep8'].us:g} + {CITED['combine_ep8'].us:g} us at EP8, "
                              f"{CITED['dispatch_ep64'].us:g} + {CITED['combine_ep64'].us:g} us at EP64 "
                              f"({CITED['dispatch_ep8'].source.split(',')[0]}, batch 1, GB200 NVL72); per MoE layer "
                              + ", ".join(f"{dispatch_combine_us(g):.1f} us at EP{g}" for g in PROJECTED_GPUS)
                              + " (between EP8 and EP64: interpolated in log2 EP)"),
                          "logits_all_gather": f"{CITED['logits_all_gather'].us:g} us ({CITED['logits_all_gather'].source})"},
        "published": list(PUBLISHED),
        "rows": rows,
    }


def measured_draft_factor(draft, m: DraftMeasurement, gpus: int) -> float:
    """What a measured propose is multiplied by on `gpus` GB300: the datasheet bandwidth of its GPU
    over the GB300's, times the bytes of a gpus-way share's pass over the measured share's."""
    share_bytes = {g: roofline.draft_pass_bytes(rank_share(draft, g), m.context) for g in (gpus, m.world)}
    return datasheet_bandwidth(m.device) / GB300_BYTES_PER_S * share_bytes[gpus] / share_bytes[m.world]


def _all_reduce_text(base: Cited) -> str:
    return (f"{base.us:g} us ({base.source}) at <= 16 KiB, + the bytes beyond x (G-1) / "
            f"{NVLINK5_BYTES_PER_S / 1e9:g} GB/s (NVLink 5 per direction, assumed)")


def is_rank_result(path: str) -> bool:
    """Whether a step_bench.py result holds rows of a rank target."""
    _, rows = roofline._read_result_rows(path, "--measured", "step_bench.py")
    return any(isinstance(r, dict) and r.get("target") in RANK_PRESETS for r in rows)


def _draft_line(draft: dict, m: dict) -> str:
    measured = draft["measured"]
    if measured is None:
        return (f"  draft pass: {draft['bytes_whole'] / 1e9:.2f} GB over the GPUs at the verify's floor fraction "
                f"{m['verify_floor_fraction']:.1%} (not measured)")
    return (f"  draft pass: a {measured['world']}-way share's graphed propose measured on {measured['device']} "
            f"({measured['source']}): {measured['propose_ms']:.3f} ms; x datasheet / GB300 bandwidth, x the projected "
            f"share's bytes / the measured share's")


def format_projection(p: dict) -> str:
    m, sc = p["measured"], p["scaling"]
    als = list(p["rows"][0]["spec_tokens_per_s"])
    depth = "" if sc["depth_factor"] == 1 else f", {m['layers']} layers scaled x{sc['depth_factor']:.3f} to 93"
    lines = [
        "", "", f"{p['label']}: K3 batch 1, {m['context']} context",
        f"  compute: a {m['world']}-way rank's step measured on {m['device']} ({m['source']}): plain {m['plain_ms']:.3f} ms, "
        f"verify T={VERIFY_T} {m['verify_ms']:.3f} ms{depth}; x{sc['factor']:.3f} = datasheet {sc['device_datasheet_TBps']:g} / "
        f"GB300 {sc['gb300_TBps']:g} TB/s; 8 GPUs: x the 8-way rank's bytes / the 16-way rank's",
        _draft_line(p["draft"], m),
        f"  all-reduce: {p['communication']['all_reduce']}",
        f"  MoE exchange: {p['communication']['moe_exchange']}",
        f"  logits all-gather: {p['communication']['logits_all_gather']}",
        f"  {'GPUs':<6}{'step':<8}{'compute ms':>11}{'draft ms':>10}{'all-red. ms':>12}{'MoE x ms':>11}{'gather ms':>10}"
        f"{'step ms':>9}" + "".join(f"{'tok/s AL=' + al:>15}" for al in als),
    ]
    for r in p["rows"]:
        for kind in ("plain", "spec"):
            comm = r[f"{kind}_comm_us"]
            reduce_ms = (comm["all_reduce"] + comm.get("draft_all_reduce", 0.0)) / 1e3
            gather_ms = (comm["logits_all_gather"] + comm.get("draft_logits_all_gather", 0.0)) / 1e3
            compute = r["plain_compute_ms"] if kind == "plain" else r["verify_compute_ms"]
            draft = "" if kind == "plain" else f"{r['draft_ms']:.3f}"
            speeds = ([f"{r['plain_tokens_per_s']:.0f} (AL 1)"] + [""] * (len(als) - 1) if kind == "plain"
                      else [f"{r['spec_tokens_per_s'][al]:.0f}" for al in als])
            exchange_ms = (comm["moe_dispatch_all_gather"] + comm["moe_combine_all_reduce"]) / 1e3
            lines.append(f"  {r['gpus']:<6}{kind:<8}{compute:>11.3f}{draft:>10}{reduce_ms:>12.3f}"
                         f"{exchange_ms:>11.3f}{gather_ms:>10.3f}{r[kind + '_step_ms']:>9.3f}"
                         + "".join(f"{s:>15}" for s in speeds))
    def variant(key: str) -> str:
        return "; ".join(f"{r['gpus']} GPUs: plain {r[key + 'plain_tokens_per_s']:.0f}, spec "
                         + ", ".join(f"{r[key + 'spec_tokens_per_s'][al]:.0f} at AL {al}" for al in als)
                         for r in p["rows"])

    lines.append(f"  with the all-reduce at {p['communication']['all_reduce_floor']}: tok/s {variant('floor_all_reduce_')}")
    lines.append(f"  with {MOE_EXCHANGES['all_to_all']} ({p['communication']['ep_dispatch_combine']}): "
                 f"tok/s {variant('all_to_all_')}")
    lines.append("  published, beside it:")
    lines += [f"    {text}" for text in p["published"]]
    return "\n".join(lines)
