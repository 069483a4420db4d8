"""The slot-list check every target runs at its entry points (dspark.protocols.Target)."""
from __future__ import annotations

import torch


def checked_slots(slots, max_slots: int) -> list[int]:
    """slots (a sequence of ints or a 1-D tensor) as a list of distinct ints in [0, max_slots);
    a ValueError names the list and the offending slot otherwise."""
    slots = [int(s) for s in (slots.tolist() if isinstance(slots, torch.Tensor) else slots)]
    if not slots:
        raise ValueError("slots=[]: need at least one slot")
    for s in slots:
        if not 0 <= s < max_slots:
            raise ValueError(f"slots={slots}: slot {s} outside [0, max_slots={max_slots})")
    if len(set(slots)) != len(slots):
        raise ValueError(f"slots={slots}: a slot appears twice")
    return slots
