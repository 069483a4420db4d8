"""KDA verify + commit for Hopper (sm_90a): the CuTe DSL kernels of kda/cute_common.py built for sm_90a.

Registered as "cute_sm90" for ops kda_verify and kda_commit (priority 10, CUDA capability 9.0).
The kernels use clusters and distributed shared memory (sm_90+) and no Hopper-only instructions.
"""
from ..cute_common import register_cute
from . import cute_common

ARCH = "sm_90a"


@register_cute("kda_verify", "cute_sm90", cute_common.supports_verify)
def kda_verify(q_in, k_in, v_in, f, beta_in, gate_in, conv_weight, conv_state, A_log, dt_bias, o_norm_weight,
               state, lengths, *, lower_bound, eps):
    return cute_common.verify(q_in, k_in, v_in, f, beta_in, gate_in, conv_weight, conv_state, A_log, dt_bias,
                              o_norm_weight, state, lengths, lower_bound=lower_bound, eps=eps, arch=ARCH)


@register_cute("kda_commit", "cute_sm90", cute_common.supports_commit)
def kda_commit(state, conv_state, records, num_tokens):
    cute_common.commit(state, conv_state, records, num_tokens, arch=ARCH)
