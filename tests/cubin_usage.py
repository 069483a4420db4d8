"""Whether a Triton kernel compiled on the CPU (Triton's bundled ptxas, no device) spills: cuobjdump
reads the cubin's stack frame, which is where spills go. Shared by the compile tests that check it."""
import os
import subprocess

import triton

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
MISSING = "needs Triton's NVIDIA backend tools (ptxas, cuobjdump) and no interpreter"


def unavailable() -> bool:
    """True under the interpreter or without the backend's cuobjdump: these checks then skip."""
    return os.environ.get("TRITON_INTERPRET") == "1" or not os.path.exists(os.path.join(BIN, "cuobjdump"))


def assert_no_spills(compiled, tmp_path) -> None:
    """The compiled kernel's stack frame is empty (its registers hold everything)."""
    cubin = tmp_path / "kernel.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", str(cubin)], capture_output=True,
                           text=True, check=True).stdout
    assert " STACK:0 " in usage, usage
