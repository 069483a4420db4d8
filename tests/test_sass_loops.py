"""tools/sass_loops.py's parsing of cuobjdump's SASS (the assembling needs a CUDA toolkit's ptxas, which
CI does not have): instructions with predicates and modifiers, and loops found from backward branches."""
import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "sass_loops.py"

SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;                                   /* 0x00000a00ff017b82 */
        /*0010*/                   LDS.128 R4, [R102+0x400] ;                               /* 0x0004000066047984 */
        /*0020*/                   LOP3.LUT R32, R32, 0x1c001c0, RZ, 0xc0, !PT ;            /* 0x01c001c020207812 */
        /*0030*/                   HGMMA.64x8x16.F32.BF16 R28, R92, gdesc[UR16], R28 ;      /* 0x000000105c1c7df0 */
        /*0040*/              @!P0 SYNCS.PHASECHK.TRANS64 P0, [R5+URZ], R4 ;                /* 0x00000004050085a7 */
        /*0050*/              @!P0 BRA 0x40 ;                                               /* 0xfffffffc00ec8947 */
        /*0060*/               @P1 BRA 0x10 ;                                               /* 0xfffffffc00ec8947 */
        /*0070*/                   BRA 0x90 ;                                               /* 0x0000000000107947 */
        /*0080*/                   EXIT ;                                                   /* 0x000000000000794d */
"""


def load():
    spec = importlib.util.spec_from_file_location("sass_loops", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_instructions_and_loops_are_read_from_the_disassembly():
    tool = load()
    found = tool.instructions(SASS)
    assert [op for _, op, _ in found] == ["LDC", "LDS", "LOP3", "HGMMA", "SYNCS", "BRA", "BRA", "BRA", "EXIT"]
    assert found[5] == (0x50, "BRA", "0x40 ")
    spans = {(start, end): dict(body) for start, end, body in tool.loops(found)}
    # the two backward branches (the forward one is no loop): a spin wait and the main loop around it
    assert spans == {(0x40, 0x50): {"SYNCS": 1, "BRA": 1},
                     (0x10, 0x60): {"LDS": 1, "LOP3": 1, "HGMMA": 1, "SYNCS": 1, "BRA": 2}}
