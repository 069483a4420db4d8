"""CUDA-graph capture of a whole step, with a clear error when the step cannot be captured, and
the batch buckets every graphed step is captured for.

A step that is captured must not synchronise with the host (no `.item()`, `.tolist()`, `int()`
of a device tensor, no pageable host copy): capture would fail with CUDA's bare "operation not
permitted when stream is capturing", which names nothing. So before capturing, the step runs
once eagerly under torch's sync-debug mode "error", and a synchronising call is reported with
the frame of dspark's own code that made it (docs/architecture.md §6).
"""
from __future__ import annotations

import gc
import os
import traceback
from typing import Callable

import torch

_OWN_FOLDERS = tuple(os.sep + name + os.sep for name in ("dspark", "kernels", "drafters"))

# The batch sizes a step is captured for: a batch runs in the smallest bucket that holds it, its
# padding rows changing nothing (dspark/graph_step.py); a larger batch runs eagerly.
BUCKETS = (1, 2, 4, 8)


def checked_buckets(name: str, buckets) -> tuple[int, ...]:
    """buckets as a sorted tuple of distinct positive ints (None: BUCKETS); ValueError naming `name` and
    the value."""
    if buckets is None:
        return BUCKETS
    values = tuple(buckets) if isinstance(buckets, (tuple, list)) else None
    if not values or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in values):
        raise ValueError(f"{name}={buckets!r}: must be a non-empty tuple of batch sizes >= 1")
    return tuple(sorted(set(values)))


def buckets_up_to(batch: int) -> tuple[int, ...]:
    """BUCKETS, every power of two up to `batch` and `batch` itself: every batch size a step of up to
    `batch` requests may have runs in a bucket at most twice its size (a run of many requests at once,
    whose batch shrinks as they finish, e.g. an evaluation)."""
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch={batch!r}: must be an integer >= 1")
    powers = [1 << i for i in range(batch.bit_length()) if 1 << i <= batch]
    return tuple(sorted(set(BUCKETS) | set(powers) | {batch}))


def bucket_table(buckets, max_slots: int) -> tuple[tuple[int, ...], dict[int, int]]:
    """The buckets that fit max_slots, sorted, and the smallest of them that holds each batch size
    ({batch: bucket}; a batch past the largest has none): a lookup, as graphs ask every step."""
    fitting = tuple(b for b in sorted(buckets) if b <= max_slots)
    return fitting, {batch: next(b for b in fitting if b >= batch) for batch in range(1, max(fitting, default=0) + 1)}


_streams: dict[tuple[int, int, int], torch.cuda.Stream] = {}


def current_stream(device_index: int) -> torch.cuda.Stream:
    """torch.cuda.current_stream(device_index), for code that records an event on it every step.
    torch's own resolves the device through torch.cuda.is_available() (an environment lookup) and
    builds a new Stream object per call, which costs a plain step's host more than the replay
    call does (experiments/engine_host_profile.py shows it). This reads the stream from the same C
    function torch's does and keeps one Stream object per stream."""
    data = torch._C._cuda_getCurrentStream(device_index)
    stream = _streams.get(data)
    if stream is None:
        stream = _streams[data] = torch.cuda.Stream(stream_id=data[0], device_index=data[1], device_type=data[2])
    return stream


class CaptureError(RuntimeError):
    """The step cannot be captured into a CUDA graph; the message names the call that synchronised."""


def _own_frame(tb) -> str:
    """The innermost frame of the traceback in dspark's own source (else the innermost one)."""
    frames = traceback.extract_tb(tb)
    own = [f for f in frames if any(folder in f.filename for folder in _OWN_FOLDERS)
           and not f.filename.endswith("cuda_graphs.py")]
    f = (own or frames)[-1]
    return f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}"


def run_without_sync(fn: Callable[[], object], what: str):
    """fn() with any host synchronisation turned into a CaptureError naming where it happened."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn()
    except RuntimeError as e:
        if "synchronizing" not in str(e):
            raise
        raise CaptureError(f"{what}: the step synchronises with the host at {_own_frame(e.__traceback__)}; "
                           f"it cannot be captured into a CUDA graph") from e
    finally:
        torch.cuda.set_sync_debug_mode(previous)


class StepGraph:
    """One captured step: `replay()` reruns every kernel of fn() on the same static buffers.

    fn reads its inputs from tensors the caller refills before each replay and writes its
    outputs to the tensors it returns (`outputs`), which every replay overwrites in place.
    Two eager warm-up runs on a side stream come first, as capture requires: one that may
    compile and allocate, then one under the no-sync check. fn's side effects (a commit) happen
    in them too: the caller captures on scratch state or resets it afterwards.
    """

    def __init__(self, fn: Callable[[], object], what: str, *, pool=None):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # compiles kernels and allocates workspaces, which may synchronise once
            torch.cuda.synchronize()
            run_without_sync(fn, what)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        # No garbage collection during the capture: a collection there may destroy an unreachable
        # CUDA event, graph or pinned buffer (an earlier engine's), which CUDA refuses while a
        # stream captures, and the process aborts. torch's capture
        # no longer collects on entry by default, so collect here, then pause the collector.
        gc.collect()
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(self.graph, pool=pool):
                self.outputs = fn()
        except RuntimeError as e:
            raise CaptureError(f"{what}: CUDA-graph capture failed at {_own_frame(e.__traceback__)}: {e}") from e
        finally:
            if collecting:
                gc.enable()
        self.what = what

    def replay(self):
        self.graph.replay()
        return self.outputs

    @property
    def pool(self):
        return self.graph.pool()
