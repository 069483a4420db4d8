"""Kernel overrides belong to the engine that sets them: an engine's batch-1 profile kernels are a
context-local registry table around its own step, over the process-wide `use()` overrides, and
never change what another engine (or code outside any step) resolves."""
import pytest

from dspark.config import Profile, SamplingParams, SpecConfig
from dspark.drafters.ngram import NgramDrafter
from dspark.engine import Engine
from dspark.kernels import registry
from dspark.targets.toy import MarkovTarget

OP = "test_probe_engine_scope"
if OP not in registry._IMPLS:  # three toy implementations; by priority "c" is the default
    for _priority, _name in enumerate("abc"):
        registry.register(OP, _name, priority=_priority)(lambda x: x)


class ProbeTarget(MarkovTarget):
    """Records, for every verify, the batch size and the implementation of OP the registry picks there."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.picked: list[tuple[int, str]] = []

    def verify(self, slots, tokens, lengths, tap_layers=()):
        self.picked.append((len(slots), registry.select(OP, tokens).name))
        return super().verify(slots, tokens, lengths, tap_layers)


def probe_engine(batch1_impl: str) -> Engine:
    spec = SpecConfig(num_speculative_tokens=2, batch1_profile=Profile(num_speculative_tokens=2, kernels=((OP, batch1_impl),)))
    return Engine(ProbeTarget(8, seed=1, max_slots=2, max_seq_len=64), NgramDrafter(), spec)


def greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("process_wide", [None, "b"])
def test_two_engines_interleaved_each_get_their_own_kernels(process_wide):
    default = process_wide or "c"
    registry.use(OP, process_wide)
    try:
        first, second = probe_engine("a"), probe_engine("b" if process_wide is None else "c")
        first.add_request([1, 2, 3], greedy(10))
        second.add_request([4, 5], greedy(3))  # finishes early: the second engine drops to batch 1
        second.add_request([6], greedy(12))
        while first.has_unfinished() or second.has_unfinished():
            for engine in (first, second):
                if engine.has_unfinished():
                    engine.step()
                # Between steps nothing is scoped: the process-wide layer is what it was.
                assert registry.overrides == ({} if process_wide is None else {OP: process_wide})
                assert registry.resolve(OP, "cpu").name == default
        own = {id(first): "a", id(second): "b" if process_wide is None else "c"}
        for engine in (first, second):
            picked = engine.target.picked
            assert {name for b, name in picked if b == 1} == {own[id(engine)]}, picked
            assert {name for b, name in picked if b == 2} <= {default}
        assert any(b == 2 for b, _ in second.target.picked) and any(b == 1 for b, _ in second.target.picked)
    finally:
        registry.use(OP, None)


def test_scopes_nest_and_restore():
    with registry.scoped(((OP, "a"),)):
        assert registry.resolve(OP, "cpu").name == "a"
        with registry.scoped(((OP, "b"),)):
            assert registry.resolve(OP, "cpu").name == "b" and registry.active_overrides()[OP] == "b"
        assert registry.resolve(OP, "cpu").name == "a"
    assert registry.resolve(OP, "cpu").name == "c" and OP not in registry.overrides
    with pytest.raises(KeyError, match="no_such_op"):
        with registry.scoped((("no_such_op", "a"),)):
            pass


class OverlappingTarget(ProbeTarget):
    """Each verify waits until the other engine's thread is inside its verify too, so the two
    engines' steps overlap when the registry is asked."""

    def __init__(self, barrier, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.barrier = barrier
        self.process_wide: list[dict] = []

    def verify(self, slots, tokens, lengths, tap_layers=()):
        self.barrier.wait()
        self.process_wide.append(dict(registry.overrides))
        return super().verify(slots, tokens, lengths, tap_layers)


def test_engines_stepping_at_the_same_time_in_two_threads_keep_their_own_kernels():
    import threading

    barrier = threading.Barrier(2, timeout=60)
    engines = {}
    for impl in "ab":
        spec = SpecConfig(num_speculative_tokens=2, batch1_profile=Profile(num_speculative_tokens=2, kernels=((OP, impl),)))
        engines[impl] = Engine(OverlappingTarget(barrier, 8, seed=1, max_slots=1, max_seq_len=64), NgramDrafter(), spec)
    errors = []

    def run(engine):  # the same work in both, so both make the same number of verify calls
        try:
            engine.generate([[1, 2, 3]], greedy(12))
        except Exception as e:  # noqa: BLE001 (reported below; a broken barrier shows up here)
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(e,)) for e in engines.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for impl, engine in engines.items():
        assert [name for _, name in engine.target.picked] == [impl] * len(engine.target.picked), engine.target.picked
        assert all(seen == {} for seen in engine.target.process_wide)  # a step never touches the process-wide table
    assert registry.overrides == {}
