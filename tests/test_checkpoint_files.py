"""Tensors read from safetensors files start on a 64-byte boundary, so a loaded weight multiplies
bit for bit like the same values allocated in memory (CPU GEMMs choose their kernel by alignment;
dspark.checkpoint_files._aligned)."""
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dspark.checkpoint_files import iter_safetensors


def test_loaded_tensors_are_aligned_and_multiply_like_the_originals(tmp_path):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    # Odd element counts put most tensors' data off a 64-byte boundary inside the file.
    tensors = {f"w{i}": torch.randn(3 + 2 * i, 16, generator=gen) for i in range(6)}
    tensors["odd"] = torch.randn(3, generator=gen)
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    with safe_open(str(path), framework="pt", device="cpu") as f:
        raw = {name: f.get_tensor(name) for name in f.keys()}
        assert any(t.data_ptr() % 64 for t in raw.values()), "the file gave no misaligned tensor to test"
    loaded = dict(iter_safetensors(path))
    assert loaded.keys() == tensors.keys()
    x = torch.randn(6, 16, generator=gen)
    for name, tensor in loaded.items():
        assert tensor.data_ptr() % 64 == 0, name
        assert torch.equal(tensor, tensors[name]), name
        if tensor.dim() == 2:
            assert torch.equal(x @ tensor.T, x @ tensors[name].T), name
