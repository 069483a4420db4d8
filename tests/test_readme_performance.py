"""experiments/performance_tables.py: the README's Performance section is the script's output on the
current result files (a stale README fails here), and the script reads result files by their fields:
the newest file of each kind wins (for the step, the newest file of each measured point), a new target or device gets its own rows, a missing file leaves
its table out, a file without a needed field is named and skipped, and every ratio is the one its
column names. Numbers are drawn fresh on each run."""
import json
import random
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "experiments"))
import performance_tables as tables  # noqa: E402

RNG = random.Random()


def provenance(commit: str, created: str, command: str, device: str = "NVIDIA H200") -> dict:
    return {"device": "cuda", "device_name": device, "torch": "2.11.0+cu130", "cuda": "13.0", "git_commit": commit,
            "command": command, "created": created, "cutlass_dsl": "4.8.1", "triton": "3.6.0"}


def write(root: Path, relative: str, data: dict) -> Path:
    path = root / "experiments" / "results" / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def step_bench(target="k3-slice", created="2026-12-04T13:12:00+00:00", commit="a7cdf4d", device="NVIDIA H200"):
    rows = []
    for T in (1, 8):
        graph, eager = RNG.uniform(1, 5), RNG.uniform(6, 15)
        floor = graph * RNG.uniform(0.5, 0.95)
        rows.append({"target": target, "batch": 1, "context": 8192, "T": T, "launches": RNG.randint(100, 200),
                     "eager_ms": eager, "graph_ms": graph, "floor_ms": floor, "mode": "graph", "ms": graph,
                     "floor_fraction": floor / graph})
    rows.append({**rows[-1], "setting": "moe_combine=torch", "ms": 99.0, "graph_ms": 99.0})  # an A/B row: not shown
    command = "python3 /work/main/experiments/step_bench.py --batch 1 --out /tmp/round_out/x/step_bench.json"
    return {**provenance(commit, created, command, device), "target": target, "rows": rows}


def sweep(created="2026-12-04T21:32:20+00:00", slow=1.0):
    points = []
    for al in (None, 2.0, 6.0):
        tps = RNG.uniform(100, 2000) / slow
        points.append({"key": f"b1-al{al}", "batch": 1, "k": 0 if al is None else 7, "al_target": al,
                       "tokens_per_s": tps, "step_ms_p50": RNG.uniform(2, 5), "roofline_fraction": RNG.uniform(0.5, 0.9)})
    meta = {**provenance("3a29e22", created, "python3 /tmp/dspark_pkg/dspark/cli.py sweep --target k3-slice "
                                              "--out /tmp/round_out/30_sweep/sweep-k3-slice-gpu"),
            "target": "k3-slice", "context": 8192}
    return {"schema": "dspark.sweep/1", "meta": meta, "points": points}


def kernels_bench(shape="kda_qkvg", created="2026-12-03T00:00:00+00:00"):
    ours, cublas, frac = RNG.uniform(5, 200), RNG.uniform(5, 200), RNG.uniform(0.3, 1.0)
    row = {"shape": shape, "N": 49152, "K": 7168, "M": 8, "cublas": {"graph_us": cublas},
           "cute_sm90": {"graph_us": ours, "graph_frac_of_ceiling": frac}}
    return {**provenance("d522655", created, "experiments/kernels_bench.py --out /root/out/kernels_bench.json"),
            "rows": [row, {**row, "M": 1}]}


def smollm2(created="2026-12-03T23:15:30+00:00"):
    def entry(value, key="acceptance_length"):
        return {key: value, "ci95": [value - 0.05, value + 0.05]}

    result = {"prompts": 164,
              "bootstrap": {"dspark": entry(1.78), "dflash_ablation": entry(1.64), "ngram": entry(2.0),
                            "dspark_over_dflash_ablation": entry(1.09, "ratio"), "dspark_over_ngram": entry(0.89, "ratio")},
              "per_drafter": {"dspark": {"conditional_accept_per_position": [0.5] * 7}},
              "greedy_equals_plain": {"dspark": {"identical": 164}, "ngram": {"identical": 163}}}
    return {**provenance("2e5b37f", created, "python3 experiments/smollm2_dspark.py run --out /root/out/s.json"),
            "eval": {"humaneval": {"greedy": result}}, "settings": {"layers": 5, "steps": 1000},
            "target": {"name": "SmolLM2-135M-Instruct"}, "training_data": {"sequences": 10732},
            "tokens_per_s_batch1": {"plain": 44.0, "dspark": 42.0}}


def table_rows(text: str, title: str) -> list[list[str]]:
    """The cells of each data row of the table under the heading that starts with `title`."""
    block = text.split(f"### {title}", 1)[1].split("\n### ", 1)[0]
    lines = [line for line in block.splitlines() if line.startswith("| ") and not line.startswith("|---")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines[1:]]


def render(root: Path) -> str:
    return tables.render(tables.load_results(root / "experiments" / "results", root))


# ---- the repository's README ---------------------------------------------------------------------
def test_the_readme_performance_section_is_the_scripts_output():
    readme = (REPO / "README.md").read_text()
    expected = tables.with_section(readme, tables.render(tables.load_results(tables.RESULTS)))
    assert expected == readme, ("README.md's Performance section is stale against experiments/results/: "
                                "run python experiments/performance_tables.py --write")


# ---- reading result files by their fields ---------------------------------------------------------
def test_the_step_table_shows_default_rows_with_their_ratios(tmp_path):
    data = step_bench()
    write(tmp_path, "h200/step_bench.json", data)
    rows = table_rows(render(tmp_path), "The step against its floor")
    assert len(rows) == 2, rows  # the --setting row is an A/B, not the step's figure
    for row, source in zip(rows, data["rows"]):
        assert row[3] == str(source["T"])
        assert row[4] == f"{source['graph_ms']:.2f}" and row[5] == f"{source['floor_ms']:.2f}"
        assert row[6] == f"{100 * source['floor_ms'] / source['graph_ms']:.0f}%"
        assert row[8] == f"{source['eager_ms'] / source['graph_ms']:.2f}x", (row, source)


def test_the_drafter_propose_rows_are_the_default_settings(tmp_path):
    propose, eager, floor = RNG.uniform(0.5, 1.0), RNG.uniform(3.0, 6.0), RNG.uniform(0.1, 0.3)
    rows = [{"context": 8192, "cuda_graphs": graphs, "propose_ms": ms, "propose_floor_ms": floor,
             "propose_floor_fraction": floor / ms, "propose_kernels": 107, **extra}
            for graphs, ms, extra in ((False, eager, {}), (True, propose, {}),
                                      (False, 99.0, {"setting": "draft_output_partials=0"}),
                                      (True, 9.0, {"setting": "draft_output_partials=0"}))]
    command = "python3 experiments/drafter_bench.py --world 16 --out /tmp/x/drafter_bench_tp16.json"
    write(tmp_path, "h200/drafter_bench_tp16.json", {**provenance("3333333", "2026-12-05T00:00:00+00:00", command),
                                                      "drafter": "k3_dspark_tp16", "settings": {"tokens": 8},
                                                      "rows": rows})
    (row,) = table_rows(render(tmp_path), "The step against its floor")  # the --setting rows are an A/B
    assert row[4] == f"{propose:.2f}" and row[7] == f"{eager:.2f}" and row[8] == f"{eager / propose:.2f}x", row


def test_the_newest_file_of_a_kind_wins_and_a_new_target_gets_its_own_rows(tmp_path):
    old, new = step_bench(created="2026-12-01T00:00:00+00:00", commit="1111111"), step_bench(commit="2222222")
    write(tmp_path, "h200/step_bench.json", new)
    write(tmp_path, "h200/some_older_name.json", old)  # the name says nothing: the provenance time does
    write(tmp_path, "h200/step_bench_rank.json", step_bench(target="k3-rank"))
    text = render(tmp_path)
    rows = table_rows(text, "The step against its floor")
    assert sorted(r[0] for r in rows) == ["`k3-rank` step"] * 2 + ["`k3-slice` step"] * 2, rows
    shown = {r[4] for r in rows}
    assert f"{new['rows'][0]['graph_ms']:.2f}" in shown and f"{old['rows'][0]['graph_ms']:.2f}" not in shown
    assert "commit 2222222" in text and "commit 1111111" not in text


def test_a_newer_run_of_some_points_replaces_only_those(tmp_path):
    old = step_bench(target="k3-rank", created="2026-12-01T00:00:00+00:00", commit="1111111")
    for row in old["rows"][:1]:  # the old run also measured T = 1 at 32k
        old["rows"].append({**row, "context": 32768, "ms": 7.5, "graph_ms": 7.5})
    new = step_bench(target="k3-rank", commit="2222222")  # 8k only
    write(tmp_path, "h200/step_bench_rank.json", new)
    write(tmp_path, "h200/step_bench_rank_older.json", old)
    text = render(tmp_path)
    rows = table_rows(text, "The step against its floor")
    assert [(r[2], r[3]) for r in rows] == [("8192", "1"), ("8192", "8"), ("32768", "1")], rows
    assert [r[4] for r in rows[:2]] == [f"{row['graph_ms']:.2f}" for row in new["rows"][:2]]
    assert rows[2][4] == "7.50"
    assert "commit 2222222" in text and "commit 1111111" in text  # both files are sources


def test_each_device_gets_its_own_table(tmp_path):
    write(tmp_path, "h200/step_bench.json", step_bench())
    write(tmp_path, "gb300/step_bench.json", step_bench(device="NVIDIA GB300"))
    text = render(tmp_path)
    assert "### The step against its floor (NVIDIA GB300)" in text and "### The step against its floor (NVIDIA H200)" in text


def test_a_missing_file_leaves_its_table_out_and_an_empty_folder_says_so(tmp_path):
    write(tmp_path, "h200/sweep-k3-slice-gpu/sweep.json", sweep())
    text = render(tmp_path)
    assert "### Tokens/s against forced acceptance length" in text
    for absent in ("The step against its floor", "Kernels against", "The DSpark drafter's acceptance"):
        assert absent not in text
    empty = tmp_path / "empty" / "experiments" / "results"
    empty.mkdir(parents=True)
    assert tables.render(tables.load_results(empty, tmp_path / "empty")).startswith("No result files")


def test_a_file_without_a_needed_field_is_named_and_skipped(tmp_path, capsys):
    broken = step_bench()
    del broken["rows"][0]["floor_ms"]
    write(tmp_path, "h200/step_bench.json", broken)
    write(tmp_path, "h200/torn.json", {})
    (tmp_path / "experiments/results/h200/torn.json").write_text('{"rows": [')  # a torn file
    write(tmp_path, "h200/odd_time.json", {**step_bench(target="k3-other"), "created": "yesterday"})
    pointless = step_bench(target="k3-rank")
    for row in pointless["rows"]:  # rows that name no point
        del row["batch"]
    write(tmp_path, "h200/step_bench_rank.json", pointless)
    write(tmp_path, "h200/sweep-k3-slice-gpu/sweep.json", sweep())
    text = render(tmp_path)
    err = capsys.readouterr().err
    assert "experiments/results/h200/step_bench.json: no field 'floor_ms'" in err and "torn.json: not readable JSON" in err
    assert "odd_time.json: provenance time unreadable" in err
    assert "experiments/results/h200/step_bench_rank.json: no field 'batch'" in err
    assert "`k3-slice` step" not in text and "`k3-other` step" in text and "Tokens/s against" in text
    assert "`k3-rank` step" not in text


def test_the_sweep_table_gives_speedups_over_plain_and_the_torch_reference(tmp_path):
    ours, torch = sweep(), sweep(created="2026-12-02T00:00:00+00:00", slow=100.0)
    write(tmp_path, "h200/sweep-k3-slice-gpu/sweep.json", ours)
    write(tmp_path, "h200/sweep-k3-slice-torch/sweep.json", torch)
    text = render(tmp_path)
    rows = table_rows(text, "Tokens/s against forced acceptance length")
    plain = ours["points"][0]["tokens_per_s"]
    assert [r[2] for r in rows] == ["plain", "2", "6"]
    for row, p, b in zip(rows, ours["points"], torch["points"]):
        assert row[4] == f"{p['tokens_per_s'] / plain:.2f}x"
        assert row[8] == f"{p['tokens_per_s'] / b['tokens_per_s']:.2f}x", (row, p, b)
    assert "`dspark sweep --target k3-slice --out experiments/results/h200/sweep-k3-slice-gpu`" in text
    assert "/tmp/" not in text


def test_the_kernel_table_takes_each_gemm_shape_from_the_newest_file_that_measured_it(tmp_path):
    old, new = kernels_bench(), kernels_bench(created="2026-12-04T00:00:00+00:00")
    other = kernels_bench(shape="router")
    write(tmp_path, "h200/kernels_bench.json", {**old, "rows": old["rows"] + other["rows"]})
    write(tmp_path, "h200/kernels_bench_rerun.json", new)
    rows = table_rows(render(tmp_path), "Kernels against their ceiling and baseline")
    assert [r[1].split()[0] for r in rows] == ["kda_qkvg", "router"], rows
    for row, source in ((rows[0], new["rows"][0]), (rows[1], other["rows"][0])):
        ours = source["cute_sm90"]
        assert row[2] == f"{ours['graph_us']:.1f}"
        assert row[4] == tables.pct(ours["graph_frac_of_ceiling"])
        assert row[7] == f"{source['cublas']['graph_us'] / ours['graph_us']:.2f}x", (row, source)


def test_the_drafter_table_gives_acceptance_with_its_intervals(tmp_path):
    write(tmp_path, "h200/smollm2_dspark.json", smollm2())
    text = render(tmp_path)
    (row,) = table_rows(text, "The DSpark drafter's acceptance")
    assert row == ["humaneval (164)", "greedy", "1.78 [1.73, 1.83]", "1.64", "2.00", "1.09x [1.04x, 1.14x]",
                   "0.89x [0.84x, 0.94x]", "163 / 164"]
    assert "at k = 7" in text and "DSpark 42.0 (0.95x)" in text
    assert "1,000 training steps each" in text


def test_the_drafter_note_splits_tokens_per_second_where_the_run_recorded_steps(tmp_path):
    result = smollm2()
    write(tmp_path, "h200/smollm2_dspark.json", result)
    assert "do not judge the drafter" in render(tmp_path)  # no batch1_speed: the old measurement, caveated
    result["batch1_speed"] = {"plain": {"tokens_per_step": 1.0, "ms_per_step": 22.7},
                              "dspark": {"tokens_per_step": 3.41, "ms_per_step": 81.2}}
    write(tmp_path, "h200/smollm2_dspark.json", result)
    text = render(tmp_path)
    assert "DSpark 42.0 (0.95x, 3.41 tokens a step of 81.2 ms)" in text and "do not judge" not in text


def test_the_drafter_note_names_the_schedule_a_run_stopped_early_in(tmp_path):
    result = smollm2()
    result["settings"].update(steps=10000, stop_at=8909)
    write(tmp_path, "h200/smollm2_dspark.json", result)
    assert "8,909 training steps of a 10,000-step schedule each" in render(tmp_path)


# ---- the command line -----------------------------------------------------------------------------
def readme_with_markers(tmp_path: Path) -> Path:
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n## Performance\n\n{tables.BEGIN}\nold text\n{tables.END}\n\n## Next\n")
    return readme


def test_write_then_check_and_a_hand_edit_is_stale(tmp_path, capsys):
    write(tmp_path, "h200/step_bench.json", step_bench())
    readme = readme_with_markers(tmp_path)
    results = str(tmp_path / "experiments" / "results")
    assert tables.main(["--results", results, "--readme", str(readme), "--check"]) == 1
    assert tables.main(["--results", results, "--readme", str(readme), "--write"]) == 0
    text = readme.read_text()
    assert "old text" not in text and text.endswith(f"{tables.END}\n\n## Next\n") and "### The step" in text
    assert tables.main(["--results", results, "--readme", str(readme), "--check"]) == 0
    readme.write_text(text.replace("| 1 | 8192 |", "| 1 | 4096 |", 1))
    capsys.readouterr()
    assert tables.main(["--results", results, "--readme", str(readme), "--check"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "stale" in err


@pytest.mark.parametrize("args, message", [
    (["--write", "--check"], "not allowed with argument"),
    (["--results", "/nonexistent/results"], "not a folder"),
    (["--check"], "no generated performance section"),
])
def test_a_command_line_error_is_one_line_and_exit_2(tmp_path, capsys, args, message):
    readme = tmp_path / "README.md"
    readme.write_text("# no markers\n")
    results = tmp_path / "experiments" / "results"
    results.mkdir(parents=True)
    full = ["--results", str(results), "--readme", str(readme)] + args
    try:
        code = tables.main(full)
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err
