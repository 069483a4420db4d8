"""NgramDrafter: a miss or a short match reports only the real drafts in num_drafts, so the padding
columns never reach verification (issue 13: misses were once padded with a real token and verified)."""
import torch

from dspark.drafters.ngram import NgramDrafter


def test_misses_and_short_matches_report_only_real_drafts():
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    base = torch.randperm(50, generator=g)[:12] + 100  # distinct tokens: every suffix of length 1 is unique
    drafter = NgramDrafter(1, 3)
    drafter.start(0, base, {})
    drafter.start(1, base, {})
    # slot 0: anchor = base[8], seen once before -> the 4 tokens after it (the anchor itself last);
    # slot 1: anchor never seen -> miss.
    # slot 2: anchor = base[-2] -> only base[-1] and the anchor itself follow: 2 of k = 5.
    drafter.start(2, base, {})
    anchors = torch.tensor([int(base[8]), 7, int(base[-2])])
    prop = drafter.propose([0, 1, 2], anchors, 5, None, None)
    assert prop.num_drafts.tolist() == [4, 0, 2]
    assert prop.tokens[0, :4].tolist() == base[9:12].tolist() + [int(base[8])]
    assert prop.tokens[2, :2].tolist() == [int(base[-1]), int(base[-2])]
    assert prop.probs is None
