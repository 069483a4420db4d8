"""Device-side construction of the CUTLASS pipelines the CuTe DSL kernels share. Only kernel
modules import this (they import cutlass at their top); the host side is kernels/cute_common.py."""
# No `from __future__ import annotations`: CuTe DSL evaluates annotations.

import cutlass.cute as cute
import cutlass.pipeline as pipeline


def deferred_pipeline(kind, barriers, stages: int, consumers, *, producers: int = 1, tx_count=None, cta_layout=None):
    """kind.create(...) over `stages` stages on the shared-memory struct field `barriers`:
    `producers` arrivals fill a stage (1: one elected thread issues each TMA or UMMA), `consumers`
    arrivals free it (threads, or warps where each warp arrives once), tx_count bytes per stage for
    the TMA-fed kinds, across cta_layout (one CTA when None). Barrier initialisation is deferred:
    the kernel publishes it with pipeline_init_arrive or its cluster sync."""
    byte_count = {} if tx_count is None else {"tx_count": tx_count}
    return kind.create(
        barrier_storage=barriers.data_ptr(),
        num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, producers),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumers),
        cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)) if cta_layout is None else cta_layout,
        defer_sync=True,
        **byte_count,
    )
