"""KDA verify + commit for Blackwell (sm_100a B200/GB200, sm_103a B300/GB300).

The same kernel body as Hopper (kda/cute_kernel.py): the recurrence is SIMT work (fp32 FMAs,
shuffles, shared-memory broadcasts, a cluster exchange through distributed shared memory) that
needs no tcgen05/TMEM, so this build differs from cute_sm90 only in its target. That is an
honest port, not a Blackwell-tuned kernel: it is compile-checked in CI for sm_103a and has never
run on a Blackwell GPU here.
"""
import torch

from ..cute_common import arch_of_capability
from . import cute_host


def _arch(device: torch.device) -> str:
    arch = arch_of_capability(torch.cuda.get_device_capability(device))
    if arch not in ("sm_100a", "sm_103a"):
        raise ValueError(f"device={device}: compute capability has no Blackwell KDA build (got {arch})")
    return arch


def kda_verify(q_in, k_in, v_in, f, beta_in, gate_in, conv_weight, conv_state, A_log, dt_bias, o_norm_weight,
               state, lengths, *, lower_bound, eps, slots=None, records=None):
    return cute_host.verify(q_in, k_in, v_in, f, beta_in, gate_in, conv_weight, conv_state, A_log, dt_bias,
                            o_norm_weight, state, lengths, lower_bound=lower_bound, eps=eps,
                            arch=_arch(state.device), slots=slots, records=records)


def kda_commit(state, conv_state, records, num_tokens, slots=None):
    cute_host.commit(state, conv_state, records, num_tokens, arch=_arch(state.device), slots=slots)


def kda_commit_layers(states, conv_states, records, num_tokens, slots=None):
    cute_host.commit_layers(states, conv_states, records, num_tokens, arch=_arch(states.device), slots=slots)
