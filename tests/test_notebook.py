"""The tokens/s-vs-AL notebook executes end to end on a small sweep result this test produces,
titles each run by target, device, commit and day, and writes its figures where DSPARK_FIGURES
says; the figures committed beside it are there, small, and shown by notebooks/README.md."""
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from dspark.sweep import measure_point, run_meta, write_results
from dspark.targets.toy import MarkovTarget

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ("tokens_vs_al", "speedup", "per_position_acceptance", "step_split")


def test_notebook_executes_on_a_fresh_sweep(tmp_path, monkeypatch):
    target = MarkovTarget(16, seed=0, max_slots=2, max_seq_len=256)
    points = [measure_point(target, batch=b, k=3, al=al, policy="fixed", context=8, max_tokens=12, warmup_steps=2, seed=0,
                            repeats=2)
              for b in (1, 2) for al in (None, 1.0, 2.5, 4.0)]
    meta = run_meta("cpu", target="toy", context=8, max_tokens=12, warmup_steps=2)
    write_results(tmp_path, meta, points)
    nb = nbformat.read(ROOT / "notebooks" / "tokens_vs_al.ipynb", as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit the notebook without outputs"
    monkeypatch.setenv("DSPARK_SWEEP_FILES", str(tmp_path / "sweep.json"))
    monkeypatch.setenv("DSPARK_FIGURES", str(tmp_path / "figures"))
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend: figures come back as PNGs
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    title = f"toy on {meta['device_name']}, {meta['git_commit'][:7]}, {meta['created'][:10]}"
    assert title in text and "points" in text
    assert "no measured GPU sweep among these files" in text  # its absence is said, not an error
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) == 4
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    assert sorted(p.stem for p in (tmp_path / "figures").glob("*.png")) == sorted(FIGURES)


def test_the_committed_figures_are_there_small_and_shown():
    """Readable without running the notebook, and small: the tree travels to the GPU machine
    under a 10 MB allowance, so each PNG stays under 150 KB."""
    readme = (ROOT / "notebooks" / "README.md").read_text()
    for name in FIGURES:
        png = ROOT / "notebooks" / "figures" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
        assert png.stat().st_size <= 150_000, (png, png.stat().st_size)
        assert f"](figures/{name}.png)" in readme, name
