"""Routed experts are built in place: a random or loaded K3 model holds each MoE layer's experts
once, as the stacks the MoE op reads, never a per-expert copy stacked beside them (on the GPU a
copy left the per-expert blocks in the caching allocator, where they could not serve the larger
stacks: k3-slice needed twice its expert bytes). Checked on the CPU through the storages: the
model's stacks are the very storages drawn or loaded, and their bytes are the experts' bytes once."""
import pytest
import torch

from dspark.roofline import expert_bytes
from dspark.targets.kimi_k3 import K3_TINY, K3Model
from dspark.targets.kimi_k3.weights import EXPERT_NAME, load_checkpoint, random_tensors, save_checkpoint

KINDS = ("w1_packed", "w1_scale", "w3_packed", "w3_scale", "w2_packed", "w2_scale")


def expert_storages(tensors: dict[str, torch.Tensor]) -> dict[int, int]:
    """storage address -> bytes, over the per-expert tensors of a checkpoint-layout dict."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for name, t in tensors.items() if EXPERT_NAME.fullmatch(name)}


def model_storages(model: K3Model) -> dict[int, int]:
    stacks = [getattr(moe, kind) for moe in model.moe.values() for kind in KINDS]
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in stacks}


def all_expert_bytes(cfg) -> int:
    return int((cfg.num_layers - cfg.first_k_dense) * cfg.num_experts * expert_bytes(cfg))


@pytest.fixture(scope="module")
def seed():
    return int(torch.randint(0, 2**31 - 1, ()))


def test_random_model_takes_the_drawn_stacks_as_they_are(seed):
    tensors = random_tensors(K3_TINY, seed, torch.float32, "cpu")
    drawn = expert_storages(tensors)
    # one storage per MoE layer and tensor kind, holding the experts' bytes once
    assert len(drawn) == 6 * (K3_TINY.num_layers - K3_TINY.first_k_dense)
    assert sum(drawn.values()) == all_expert_bytes(K3_TINY)
    expert_3 = {kind: tensors[f"language_model.model.layers.1.block_sparse_moe.experts.3.{kind.replace('_', '.weight_')}"]
                .clone() for kind in KINDS}
    model = K3Model(K3_TINY, tensors)
    assert not tensors  # taken over: nothing of the model stays referenced by the caller's dict
    assert model_storages(model) == drawn
    for kind, value in expert_3.items():
        assert torch.equal(getattr(model.moe[1], kind)[3], value), kind


def test_loaded_checkpoint_is_read_into_its_stacks(seed, tmp_path):
    original = K3Model.random(K3_TINY, seed=seed, dtype=torch.float32)
    save_checkpoint(original, tmp_path, shard_bytes=1 << 16)  # many shards: experts of a layer span files
    cfg, tensors = load_checkpoint(tmp_path, torch.float32, "cpu")
    loaded = expert_storages(tensors)
    assert sum(loaded.values()) == all_expert_bytes(cfg)
    model = K3Model(cfg, tensors)
    assert model_storages(model) == loaded
    for i, moe in original.moe.items():
        for kind in KINDS:
            assert torch.equal(getattr(model.moe[i], kind), getattr(moe, kind)), (i, kind)


def test_separate_expert_tensors_are_still_stacked(seed):
    """A dict whose experts are independent tensors (not views of stacks) builds the same model."""
    tensors = random_tensors(K3_TINY, seed, torch.float32, "cpu")
    separate = {name: t.clone() if EXPERT_NAME.fullmatch(name) else t for name, t in tensors.items()}
    reference = K3Model(K3_TINY, dict(tensors))
    model = K3Model(K3_TINY, separate)
    for i, moe in reference.moe.items():
        for kind in KINDS:
            assert torch.equal(getattr(model.moe[i], kind), getattr(moe, kind)), (i, kind)
