"""What every Triton implementation shares: whether triton is installed (checked without
importing it: importing triton takes seconds, and CPU-only machines may not have it), and the
import of an op's kernel module on its first launch."""
import functools
import importlib
import importlib.util


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def kernel_module(package: str):
    """`<package>.triton_kernels`, imported (with triton) on first use."""
    return importlib.import_module(f"{package}.triton_kernels")
