"""The SASS of a kernel's loops, from its PTX, on a machine without a GPU: how many instructions a
main-loop iteration issues and of which kinds, its registers and spills.

    python tools/sass_loops.py KERNEL.ptx [--arch sm_90a] [--ptxas PATH] [--top 25]

A CuTe DSL kernel's PTX comes from a compile-only build (CUTE_DSL_ARCH=sm_90a, `--keep-ptx`, as the
tests/test_*_cute_compile.py tests build them); a Triton kernel's from its `asm["ptx"]`. The PTX is
assembled with the CUDA toolkit's ptxas (--ptxas, else $PTXAS, else the newest /usr/local/cuda*/bin/ptxas),
its `.version` lowered to what that ptxas reads when it is older than the DSL's (the instructions a
kernel uses are older than the version line), then disassembled with cuobjdump (Triton's copy, which
ships with the package). A loop is a backward branch and its target; each is printed with its length
and opcode histogram, the one holding the most tensor-core instructions (HGMMA / UTCMMA) first.

Why: at a rank's batch 1 the MXFP4 expert kernel runs about one warp per scheduler, so its time per
K chunk follows the instructions one iteration issues, not its bytes (experiments/notes/rank.md);
this counts them without a GPU. A developer's tool, not part of dspark.
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]+)?\s*([^;]*);")
BRANCH_TARGET = re.compile(r"0x([0-9a-f]+)")
TENSOR_CORE = ("HGMMA", "UTCMMA", "UTCHMMA", "HMMA")


def find_ptxas(given: str | None) -> str:
    candidates = [given, os.environ.get("PTXAS")] + sorted(glob.glob("/usr/local/cuda*/bin/ptxas"), reverse=True)
    for path in candidates:
        if path and os.access(path, os.X_OK):
            return path
    raise SystemExit("sass_loops: no ptxas found: pass --ptxas or set PTXAS (a CUDA toolkit's bin/ptxas)")


def find_cuobjdump() -> str:
    try:
        import triton
    except ImportError:
        raise SystemExit("sass_loops: needs cuobjdump: Triton's copy (pip install triton) or a CUDA toolkit's") from None
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not path.exists():
        raise SystemExit(f"sass_loops: {path} does not exist")
    return str(path)


def assemble(ptx: str, arch: str, ptxas: str, workdir: str) -> tuple[str, str]:
    """(cubin path, ptxas -v output), lowering .version until ptxas reads it."""
    source = Path(workdir) / "kernel.ptx"
    cubin = Path(workdir) / "kernel.cubin"
    text = ptx
    for _ in range(20):
        source.write_text(text)
        done = subprocess.run([ptxas, f"-arch={arch}", "-O3", "-v", str(source), "-o", str(cubin)],
                              capture_output=True, text=True)
        if done.returncode == 0:
            return str(cubin), done.stderr
        supported = re.search(r"current version is '(\d+)\.(\d+)'", done.stderr)
        if not supported:
            raise SystemExit(f"sass_loops: ptxas failed:\n{done.stderr.strip()}")
        text = re.sub(r"^\.version \d+\.\d+", f".version {supported.group(1)}.{supported.group(2)}", text, count=1,
                      flags=re.M)
    raise SystemExit("sass_loops: ptxas kept refusing the .version line")


def instructions(sass: str) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) of every instruction, in order."""
    found = []
    for line in sass.splitlines():
        match = INSTRUCTION.match(line)
        if match:
            found.append((int(match.group(1), 16), match.group(2), match.group(4)))
    return found


def loops(found: list[tuple[int, str, str]]) -> list[tuple[int, int, collections.Counter]]:
    """(start, end, opcode histogram) of each backward branch's span (start = its target)."""
    spans = []
    for address, opcode, operands in found:
        if opcode != "BRA":
            continue
        target = BRANCH_TARGET.search(operands)
        if target and int(target.group(1), 16) < address:
            start = int(target.group(1), 16)
            body = collections.Counter(op for a, op, _ in found if start <= a <= address)
            spans.append((start, address, body))
    return spans


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ptx", help="a kernel's PTX file")
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--ptxas", default=None)
    parser.add_argument("--top", type=int, default=25, help="opcodes listed per loop")
    parser.add_argument("--min-length", type=int, default=32, help="loops shorter than this are not listed")
    args = parser.parse_args(argv)
    try:
        ptx = Path(args.ptx).read_text()
    except OSError as e:
        print(f"sass_loops: {args.ptx}: {e.strerror}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as workdir:
        cubin, report = assemble(ptx, args.arch, find_ptxas(args.ptxas), workdir)
        sass = subprocess.run([find_cuobjdump(), "-sass", cubin], capture_output=True, text=True, check=True).stdout
    for line in report.splitlines():
        if "registers" in line or "spill" in line:
            print(line.strip())
    found = instructions(sass)
    print(f"{len(found)} instructions")
    spans = [s for s in loops(found) if sum(s[2].values()) >= args.min_length]
    spans.sort(key=lambda s: (-sum(s[2][op] for op in TENSOR_CORE), s[0]))
    for start, end, body in spans:
        tensor = sum(body[op] for op in TENSOR_CORE)
        print(f"\nloop 0x{start:04x}-0x{end:04x}: {sum(body.values())} instructions, {tensor} tensor-core")
        for opcode, count in body.most_common(args.top):
            print(f"  {count:5d} {opcode}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
