"""experiments/glue_bench.py on a CPU machine: it refuses in one line (argparse's, exit 2) without CUDA
and names a bad --repeats; its cold cases rotate enough copies to pass the L2, up to its cap."""
import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "glue_bench.py"
sys.path.insert(0, str(SCRIPT.parent))  # its `benchlib` import
spec = importlib.util.spec_from_file_location("glue_bench", SCRIPT)
glue_bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(glue_bench)


@pytest.mark.parametrize("argv, message", [([], "glue_bench.py: error: needs a CUDA device"),
                                            (["--repeats", "0"], "glue_bench.py: error: --repeats 0: must be >= 1")])
def test_refusals_are_one_line(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(glue_bench.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["glue_bench.py"])
    with pytest.raises(SystemExit) as stopped:
        glue_bench.main(argv)
    assert stopped.value.code == 2 and capsys.readouterr().err.strip().endswith(message)


def test_cold_cases_rotate_four_l2s_of_inputs_up_to_the_cap():
    l2 = 50 * 2**20
    assert glue_bench.copies_for(1 << 20, l2, cold=False) == 1
    assert glue_bench.copies_for(1 << 20, l2, cold=True) * (1 << 20) >= 4 * l2
    assert glue_bench.copies_for(14336, l2, cold=True) == glue_bench.MAX_COPIES


@pytest.mark.parametrize("tiles", [False, True])
def test_a_mix_call_runs_under_its_tiles_setting_and_restores_it(tiles):
    norm_triton = glue_bench.norm_triton
    assert norm_triton.MIX_SCORE_TILES is False
    seen = []
    call = glue_bench.with_tiles(tiles, lambda: seen.append(norm_triton.MIX_SCORE_TILES) or "done")
    assert call() == "done" and seen == [tiles] and norm_triton.MIX_SCORE_TILES is False
    failing = glue_bench.with_tiles(tiles, lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing()
    assert norm_triton.MIX_SCORE_TILES is False
