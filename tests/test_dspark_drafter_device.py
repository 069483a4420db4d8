"""The DSpark drafter's device-side draft and commit (what its CUDA graphs capture,
drafters/dspark/graphs.py), run eagerly on the CPU against the host-driven paths."""
import copy
import dataclasses

import pytest
import torch

from dspark.config import SamplingParams
from dspark.drafters.dspark.drafter import DSparkDrafter
from dspark.drafters.dspark.graphs import context_bucket
from dspark.drafters.dspark.model import DSparkModel
from dspark_fixtures import SyntheticTarget, one_thread, small_config  # noqa: F401 (autouse fixture)

GREEDY = SamplingParams(temperature=0.0)


def drafter_with_requests(seed: int, lengths: list[int], max_seq_len: int = 96):
    target = SyntheticTarget(seed=seed)
    torch.manual_seed(seed)
    model = DSparkModel(small_config(target, "gqa"), *target.embedding_weights())
    drafter = DSparkDrafter(model, max_slots=6, max_seq_len=max_seq_len)
    d = target.hidden_size
    for slot, n in enumerate(lengths):
        drafter.start(slot, torch.randint(0, target.vocab_size, (n,)),
                      {layer: torch.randn(n, d) for layer in drafter.tap_layers})
    return target, drafter


def test_a_draft_over_more_cache_rows_than_the_longest_context_drafts_the_same_block():
    target, drafter = drafter_with_requests(1, [9, 23, 14])
    slots, anchors = [2, 0, 1], torch.randint(0, target.vocab_size, (3,))
    # Rows past every length hold values (a crop leaves them): they must stay masked.
    drafter.crop(1, 20)
    eager = drafter.draft(slots, anchors, [GREEDY] * 3, [torch.Generator()] * 3)
    wide = drafter._draft_rows(torch.tensor(slots), anchors, 64)
    assert torch.equal(wide.tokens, eager.tokens)
    torch.testing.assert_close(wide.confidence_logits, eager.confidence_logits, rtol=1e-5, atol=1e-5)
    assert not torch.equal(wide.tokens, drafter._draft_rows(torch.tensor([0, 2, 1]), anchors, 64).tokens)


@pytest.mark.parametrize("kept", [[3, 0, 8], [1, 5, 2]])
def test_a_commit_writes_each_requests_kept_rows_after_its_context(kept):
    """commit (the device-side _commit_rows under it) against the rows written one request at a
    time: the same rows of the same batched pass, each request's first kept[i] at its length."""
    target, drafter = drafter_with_requests(2, [11, 30, 7, 5])
    slots, T = [2, 0, 1], 8
    taps = {layer: torch.randn(3, T, target.hidden_size) for layer in drafter.tap_layers}
    tokens = torch.randint(0, target.vocab_size, (3, T))
    reference = [c.clone() for c in drafter._cache]
    model, starts = drafter.model, torch.tensor([drafter._lengths[s] for s in slots])
    rows = model.context_rows(model.fuse_taps(taps), starts[:, None] + torch.arange(T))
    for i, slot in enumerate(slots):
        for cache, r in zip(reference, rows):
            cache[slot, int(starts[i]) : int(starts[i]) + kept[i]] = r[i, : kept[i]].detach()
    drafter.commit(slots, tokens, torch.tensor(kept), taps)
    expected = [11 + kept[1], 30 + kept[2], 7 + kept[0], 5, 0, 0]  # slots 2, 0, 1 keep kept[0], kept[1], kept[2]
    assert drafter._lengths_device.tolist() == drafter._lengths == expected
    for a, b in zip(drafter._cache, reference):
        # Every row a request holds is equal (a slot outside the batch included); only the
        # scratch row (max_seq_len) may differ.
        assert torch.equal(a[:, : drafter.max_seq_len], b[:, : drafter.max_seq_len])
    with pytest.raises(ValueError, match=r"slots=\[1, 1\]: a slot appears twice"):
        drafter.commit([1, 1], tokens[:2], torch.tensor([1, 1]), {layer: t[:2] for layer, t in taps.items()})


def test_device_lengths_follow_start_commit_crop_and_release():
    target, drafter = drafter_with_requests(3, [6, 9])
    T = 4
    taps = {layer: torch.randn(1, T, target.hidden_size) for layer in drafter.tap_layers}
    drafter.commit([1], torch.zeros(1, T, dtype=torch.long), torch.tensor([3]), taps)
    drafter.crop(0, 2)
    drafter.release([1])
    assert drafter._lengths_device.tolist() == drafter._lengths == [2, 0, 0, 0, 0, 0]


def test_graphs_need_a_cuda_model_and_greedy_drafting():
    target = SyntheticTarget(seed=4)
    model = DSparkModel(small_config(target, "gqa"), *target.embedding_weights())
    with pytest.raises(ValueError, match="cuda_graphs=True: the model is on cpu"):
        DSparkDrafter(model, max_slots=2, max_seq_len=32, cuda_graphs=True)


def test_context_buckets_are_powers_of_two_within_the_cache():
    assert [context_bucket(n, 300) for n in (0, 1, 64, 65, 200, 256, 257, 300)] == [64, 64, 64, 128, 256, 256, 300, 300]
    assert context_bucket(20, 32) == 32


def test_commits_on_the_device_settled_later_equal_host_commits():
    """Two device commits queued before the host knows either count (a step launched ahead:
    reserve, then commit_on_device on device tensors alone), then settled: the same caches,
    lengths and next draft as two host commits. Until settled, the host's lengths are upper
    bounds (+T per reserve). A row kept 0 times (a padding row, a capture) changes nothing."""
    target, host = drafter_with_requests(6, [12, 20, 9])
    device = copy.deepcopy(host)
    slots, T = [1, 2], 8
    rounds = [(torch.tensor([5, 1]), {layer: torch.randn(2, T, target.hidden_size) for layer in host.tap_layers}),
              (torch.tensor([8, 3]), {layer: torch.randn(2, T, target.hidden_size) for layer in host.tap_layers})]
    tokens = torch.randint(0, target.vocab_size, (2, T))
    for kept, taps in rounds:
        host.commit(slots, tokens, kept, taps)
        device.reserve(slots, T)
        device.commit_on_device(torch.tensor(slots), tokens, kept, taps)
    assert device._lengths == [12, 20 + 2 * T, 9 + 2 * T, 0, 0, 0]
    assert device._lengths_device.tolist() == host._lengths == [12, 33, 13, 0, 0, 0]
    before = [c.clone() for c in device._cache]
    padding = {layer: torch.randn(1, T, target.hidden_size) for layer in host.tap_layers}
    device.commit_on_device(torch.tensor([0]), tokens[:1], torch.tensor([0]), padding)
    assert device._lengths_device.tolist() == host._lengths
    for a, b in zip(device._cache, before):
        assert torch.equal(a[:, : host.max_seq_len], b[:, : host.max_seq_len])
    for kept, _ in rounds:
        device.settle(slots, kept.tolist(), T)
    assert device._lengths == host._lengths
    for a, b in zip(device._cache, host._cache):
        assert torch.equal(a[:, : host.max_seq_len], b[:, : host.max_seq_len])
    anchors = torch.randint(0, target.vocab_size, (3,))
    assert torch.equal(device.draft([0, 1, 2], anchors, [GREEDY] * 3, [torch.Generator()] * 3).tokens,
                       host.draft([0, 1, 2], anchors, [GREEDY] * 3, [torch.Generator()] * 3).tokens)
    with pytest.raises(ValueError, match="kept=9 for slot 1"):
        device.settle([1], [9], T)
    with pytest.raises(ValueError, match="context of 97 tokens exceeds max_seq_len=96"):
        device.reserve([0], 85)
    assert not host.commits_on_device  # without graphs the engine commits after the readback


def test_calibrated_confidences_use_temperatures_uploaded_once():
    """A graphed draft cannot upload the calibration temperatures per call: the model keeps them
    as a device tensor, made again only when they change, and scales as calibrated_confidence does."""
    from dspark.policy import calibrated_confidence

    target = SyntheticTarget(seed=7)
    temps = (0.9, 1.1, 1.3, 1.0, 0.8, 1.5, 2.0)
    model = DSparkModel(small_config(target, "gqa", confidence_temperatures=temps), *target.embedding_weights())
    logits = torch.randn(3, 7)
    torch.testing.assert_close(model.confidence_probs(logits), calibrated_confidence(logits, list(temps)), rtol=0, atol=0)
    kept = model._temperatures[1]
    model.confidence_probs(torch.randn(2, 7))
    assert model._temperatures[1] is kept
    model.config = dataclasses.replace(model.config, confidence_temperatures=(1.0,) * 7)
    torch.testing.assert_close(model.confidence_probs(logits), torch.sigmoid(logits), rtol=0, atol=0)


def test_a_graphs_slot_index_is_uploaded_only_when_the_slots_change():
    """DraftGraphs copies a batch's slots into a graph's index only when the index holds others:
    an upload per step made the host wait for the step in flight (drafters/dspark/graphs.py)."""
    from types import SimpleNamespace

    from dspark.drafters.dspark.graphs import DraftGraphs

    _, drafter = drafter_with_requests(3, [5, 7, 9])
    graphs = DraftGraphs(drafter)
    uploads = []
    upload = drafter._staging.upload
    drafter._staging.upload = lambda values: uploads.append(list(values)) or upload(values)
    graph = SimpleNamespace(index=torch.full((4,), -1, dtype=torch.long), slots=None)
    for slots in ([2, 0], [2, 0], [2, 0, 1], [2, 0, 1], [1, 0, 2]):
        graphs._copy_slots(graph, slots)
        assert graph.index[:len(slots)].tolist() == slots
    assert uploads == [[2, 0], [2, 0, 1], [1, 0, 2]]
    assert graph.index[3].item() == -1  # rows past the batch are left alone


def test_the_preset_for_a_target_taps_its_layers_spread_and_never_the_last():
    from dspark.drafters.dspark.config import K3_DSPARK, K3_TINY_DSPARK, preset_for_target

    slice_config = preset_for_target(K3_DSPARK.target_hidden_size, K3_DSPARK.vocab_size, 4, drafter_layers=1)
    assert slice_config.target_layer_ids == (0, 1, 2) and slice_config.num_layers == 1
    assert slice_config.hidden_size == K3_DSPARK.hidden_size and slice_config.target_num_layers == 4
    tiny = preset_for_target(K3_TINY_DSPARK.target_hidden_size, K3_TINY_DSPARK.vocab_size, 9)
    assert tiny.target_layer_ids == (0, 4, 7)  # 9 layers: spread over 0..7, the last (8) untapped
    assert tiny.num_layers == K3_TINY_DSPARK.num_layers
    with pytest.raises(ValueError, match="hidden size 100 and vocabulary 64"):
        preset_for_target(100, 64, 4)
    with pytest.raises(ValueError, match="num_layers=1"):
        preset_for_target(K3_DSPARK.target_hidden_size, K3_DSPARK.vocab_size, 1)
