"""DrawPool (a request's draws made many steps at a time) and the UniformDrafter drawing from it."""
import pytest
import torch

from dspark.drafters.uniform import UniformDrafter
from dspark.sampling import DrawPool


def test_rows_are_one_draw_cut_into_steps_and_a_refill_draws_the_next():
    seed = int(torch.randint(0, 2**31, ()).item())
    pool = DrawPool.uniform(torch.Generator().manual_seed(seed), width=3, steps=4)
    rows = [pool.next() for _ in range(6)]
    replay = torch.Generator().manual_seed(seed)
    first, second = torch.rand(12, generator=replay), torch.rand(12, generator=replay)
    assert all(r.shape == (1, 3) for r in rows)
    torch.testing.assert_close(torch.cat(rows[:4]).flatten(), first, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat(rows[4:]).flatten(), second[:6], rtol=0, atol=0)
    assert len({tuple(r.flatten().tolist()) for r in rows}) == 6  # no row handed out twice


def test_token_pool_stays_in_the_vocabulary():
    pool = DrawPool.tokens(torch.Generator().manual_seed(1), width=7, vocab_size=5, steps=50)
    draws = torch.cat([pool.next() for _ in range(50)])
    assert draws.dtype == torch.long and draws.min() >= 0 and draws.max() < 5
    assert set(draws.flatten().tolist()) == set(range(5))


@pytest.mark.parametrize("width,steps", [(0, 4), (3, 0)])
def test_a_pool_without_draws_is_refused(width, steps):
    with pytest.raises(ValueError, match=f"width={width} and steps={steps}"):
        DrawPool.uniform(torch.Generator(), width, steps)


def _proposals(drafter, slots, seeds, k, steps):
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    return [drafter.propose(slots, None, k, None, generators).tokens for _ in range(steps)]


def test_uniform_drafter_reads_no_anchors_and_a_request_drafts_the_same_alone_or_batched():
    k, vocab = 5, 1000
    batched = _proposals(UniformDrafter(vocab), [0, 1], [11, 12], k, steps=70)  # past one pool refill
    alone = _proposals(UniformDrafter(vocab), [1], [12], k, steps=70)
    assert UniformDrafter.reads_anchors is False
    for both, one in zip(batched, alone):
        assert both.shape == (2, k)
        torch.testing.assert_close(both[1:], one, rtol=0, atol=0)
    assert not torch.equal(batched[0][0], batched[0][1])  # two generators, two streams


def test_uniform_drafter_starts_a_new_pool_for_a_new_request_in_a_slot():
    drafter = UniformDrafter(1000)
    first = _proposals(drafter, [0], [3], 4, steps=2)
    drafter.release([0])
    again = _proposals(drafter, [0], [3], 4, steps=2)  # same seed, fresh generator: same draws
    for a, b in zip(first, again):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    other = _proposals(drafter, [0], [4], 4, steps=1)[0]  # a new generator in the slot, unreleased
    fresh = _proposals(UniformDrafter(1000), [0], [4], 4, steps=1)[0]
    torch.testing.assert_close(other, fresh, rtol=0, atol=0)


def test_uniform_drafter_narrower_step_reads_the_first_columns():
    drafter = UniformDrafter(1000)
    generator = torch.Generator().manual_seed(9)
    wide = drafter.propose([0], None, 6, None, [generator]).tokens
    narrow = drafter.propose([0], None, 3, None, [generator]).tokens
    replay = DrawPool.tokens(torch.Generator().manual_seed(9), 6, 1000)
    torch.testing.assert_close(wide, replay.next(), rtol=0, atol=0)
    torch.testing.assert_close(narrow, replay.next()[:, :3], rtol=0, atol=0)


def test_uniform_drafter_drafts_every_k_and_full_counts_are_shared_and_never_rewritten():
    """A drafter that drafts k for every request says so with num_drafts=None; the step's counts
    are then one shared tensor per (batch, k, device), which a graphed step copies in only when
    another comes (is_full_draft_counts)."""
    from dspark.step import full_draft_counts, is_full_draft_counts

    drafter = UniformDrafter(50)
    generators = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    assert drafter.propose([0, 1, 2], None, 4, None, generators).num_drafts is None
    first = full_draft_counts(3, 4, "cpu")
    assert first is full_draft_counts(3, 4, torch.device("cpu")) and is_full_draft_counts(first)
    assert first.tolist() == [4, 4, 4] and full_draft_counts(2, 4, "cpu").tolist() == [4, 4]
    assert not is_full_draft_counts(first.clone()) and not is_full_draft_counts(torch.full((3,), 4))


def test_uniform_drafter_names_the_pools_its_rows_are_the_latest_draws_of():
    drafter = UniformDrafter(1000)
    generators = [torch.Generator().manual_seed(s) for s in (5, 6)]
    for _ in range(3):
        prop = drafter.propose([3, 1], None, 4, None, generators)
        pools = drafter.draft_pools([3, 1])
        assert len(pools) == 2
        for row, pool in zip(prop.tokens, pools):
            torch.testing.assert_close(row, pool.block[pool.latest_row, :4], rtol=0, atol=0)
    assert drafter.draft_pool_shape(4) == (DrawPool.STEPS, 4) == (pools[0].steps, 4)


def _mirror(steps, width, dtype=torch.float32):
    from dspark.graph_step import DrawMirror

    mirror = DrawMirror(8, steps, width, dtype, "cpu")
    mirror.blocks.fill_(-7)  # poisoned: a row the host failed to copy would show
    mirror.next_row.fill_(steps)
    return mirror


def test_mirror_takes_each_pools_rows_through_refills_padding_and_warm_up():
    steps, width = 4, 3
    seeds = torch.randint(0, 2**31, (2,)).tolist()
    pools = [DrawPool.uniform(torch.Generator().manual_seed(s), width, steps) for s in seeds]
    mirror = _mirror(steps, width)
    slots, padding = [5, 2], 7  # the bucket of 4 holds two real rows and a padding slot twice
    index = torch.tensor(slots + [padding, 0])
    live = torch.tensor([1, 1, 0, 0])
    for step in range(11):  # two refills of each pool
        rows = [p.next() for p in pools]
        mirror.prepare(slots, pools)
        if step == 3:  # a capture's warm-up reads with live 0: it takes the row again afterwards
            mirror.take(index, torch.zeros(4, dtype=torch.long))
        got = mirror.take(index, live)
        torch.testing.assert_close(got[:2], torch.cat(rows), rtol=0, atol=0)
    assert mirror.next_row[padding] == steps  # never advanced, never out of its block's rows


def test_mirror_follows_rows_read_eagerly_and_a_new_request_in_the_slot():
    steps, width = 5, 2
    pool = DrawPool.tokens(torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()))), width, 1000, steps)
    mirror = _mirror(steps, width, torch.long)
    index, live = torch.tensor([4]), torch.tensor([1])

    def graphed(p):
        row = p.next()
        mirror.prepare([4], [p])
        torch.testing.assert_close(mirror.take(index, live), row, rtol=0, atol=0)

    graphed(pool)
    for _ in range(3):  # eager steps read rows the device never took
        pool.next()
    graphed(pool)
    pool.next()  # the next eager read refills the pool: a block the device lacks
    graphed(pool)
    newcomer = DrawPool.tokens(torch.Generator().manual_seed(1), width, 1000, steps)
    graphed(newcomer)  # a fresh pool in the slot, at row 0 of its first block
    graphed(newcomer)


def test_a_graph_step_copies_rows_in_unless_one_mirror_shape_holds_every_pool():
    from dspark.graph_step import mirrored_shape

    g = torch.Generator()
    wide, narrow = DrawPool.uniform(g, 7), DrawPool.uniform(g, 3)
    assert mirrored_shape([wide, DrawPool.uniform(g, 7)], tokens=8) == (DrawPool.STEPS, 7)
    assert mirrored_shape([wide], tokens=4) == (DrawPool.STEPS, 7)  # the first 3 columns are read
    assert mirrored_shape([wide, narrow], tokens=4) is None  # two shapes: one mirror cannot hold both
    assert mirrored_shape([narrow], tokens=8) is None  # narrower than the drafts
    assert mirrored_shape([wide], tokens=1) is None and mirrored_shape(None, tokens=8) is None
