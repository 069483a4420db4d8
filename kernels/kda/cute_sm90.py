"""KDA verify + commit for Hopper (sm_90a): the CuTe DSL kernels of kda/cute_kernel.py built for sm_90a.

Registered as "cute_sm90" for ops kda_verify, kda_commit and kda_commit_layers (kda/__init__.py; priority 10, CUDA
capability 9.0). The kernels use clusters and distributed shared memory (sm_90+) and no
Hopper-only instructions.
"""
from . import cute_host

ARCH = "sm_90a"


def kda_verify(q_in, k_in, v_in, f, beta_in, gate_in, conv_weight, conv_state, A_log, dt_bias, o_norm_weight,
               state, lengths, *, lower_bound, eps, slots=None, records=None):
    return cute_host.verify(q_in, k_in, v_in, f, beta_in, gate_in, conv_weight, conv_state, A_log, dt_bias,
                            o_norm_weight, state, lengths, lower_bound=lower_bound, eps=eps, arch=ARCH, slots=slots,
                            records=records)


def kda_commit(state, conv_state, records, num_tokens, slots=None):
    cute_host.commit(state, conv_state, records, num_tokens, arch=ARCH, slots=slots)


def kda_commit_layers(states, conv_states, records, num_tokens, slots=None):
    cute_host.commit_layers(states, conv_states, records, num_tokens, arch=ARCH, slots=slots)
