"""Models being verified (Target, dspark/protocols.py): kimi_k3/, llama.py, toy.py."""
from __future__ import annotations


def eos_ids(target) -> tuple[int, ...]:
    """The token ids a target's generation stops at: its config's `eos_token_id` (or its own,
    for a target without a config), one id or several; () when it names none."""
    cfg = getattr(target, "config", None)
    eos = getattr(cfg, "eos_token_id", None) if cfg is not None else getattr(target, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
