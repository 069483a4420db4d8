"""Every shell line of README.md runs, in a fresh copy of the repository's tracked files, with its
output checked where the README states it, so the README cannot go stale unnoticed.

The lines run as written, in one environment (this one; `scripts/run` and `scripts/test` get it as
DSPARK_VENV), at their smallest sizes: a line that measures or trains gets flags appended that
shrink it (SMALLER). Lines that need a GPU run too and must stop with their clear message. A line
without an entry in CHECKS fails the test: a new README line needs its check here. Skipped: the
generated Performance section (between the markers experiments/performance_tables.py writes).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
from performance_tables import BEGIN, END  # noqa: E402  (the generated section's markers)

PERFORMANCE = (BEGIN, END)
# How the first word of an indented line shows it is a command (to catch one that renders as prose).
COMMAND_WORDS = ("dspark", "scripts/", "python", "pytest", "spec=", "vllm", "DSPARK_")

# Flags appended to lines that measure or train, for their smallest useful size.
TINY_SWEEP = ["--context", "4", "--phase-steps", "1", "--warmup-steps", "0", "--repeats", "1"]


@dataclass
class Check:
    """What a line must do: its exit status, text its stdout / stderr contain, files it writes
    (relative to the copy)."""

    status: int = 0
    stdout: tuple[str, ...] = ()
    stderr: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    smaller: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    after: str | None = None  # the line whose files this one reads or extends (they run in README order)


GENERATE = "dspark generate --target k3-tiny -k {k} --prompt-ids 1,5,9,5,9,5 --max-tokens 32"
TRAIN = ("dspark train-drafter --target k3-tiny --drafter k3-tiny_dspark --out runs/drafter --steps 20 --batch-size 4 "
         "--num-anchors 128 --num-prompts 16 --gen-len 48")
PRODUCTION = ("dspark vllm-config --drafter dspark --drafter-path Inferact/Kimi-K3-DSpark --block-size 7 -k 7 "
              "--draft-sample-method probabilistic")
CHECKS = {
    "scripts/run": Check(stdout=("wrote runs/sweep-k3-tiny/sweep.json",), files=("runs/sweep-k3-tiny/sweep.png",),
                         smaller=["--k", "1", "--batch", "1", "--al", "1,2", *TINY_SWEEP]),
    "scripts/test": Check(stdout=("No broken requirements found", "passed", "vLLM interop tests not run"),
                          smaller=["tests/test_layering.py"], env={"DSPARK_TEST_VLLM": "0", "DSPARK_TEST_WORKERS": "0"}),
    GENERATE.format(k=7): Check(stdout=("acceptance length 1.00", "(k=7, drafter=ngram)")),
    GENERATE.format(k=0) + "    # plain decoding, same loop": Check(stdout=("acceptance length 1.00", "(k=0")),
    "dspark sweep --k 3 --batch 1 --al 1,2,3,4 --context 16 --out runs/sweep-small": Check(
        stdout=("measuring 5 points",), files=("runs/sweep-small/sweep.json", "runs/sweep-small/sweep.csv",
                                               "runs/sweep-small/sweep.png"),
        smaller=["--phase-steps", "1", "--warmup-steps", "0", "--repeats", "1"]),
    "dspark sweep --k 7 --batch 1,4 --al 1,2,3,4,5,6,7,8": Check(
        stdout=("wrote runs/sweep-k3-tiny/sweep.json",), smaller=["--al", "1,8", *TINY_SWEEP], after="scripts/run"),
    "dspark roofline": Check(stdout=("bytes per step (GB)", "floors:")),
    "dspark sweep --context 0": Check(status=2, stderr=("dspark sweep: error: --context 0: must be >= 1",)),
    PRODUCTION: Check(stdout=('"method": "dspark"', '"model": "Inferact/Kimi-K3-DSpark"',
                              '"draft_sample_method": "probabilistic"')),
    # GPU-only: vLLM is not installed here, and the && keeps the shell from trying without a config.
    "spec=$(dspark vllm-config --drafter dspark --drafter-path Inferact/Kimi-K3-DSpark --block-size 7 -k 7) && "
    "vllm serve moonshotai/Kimi-K3 --speculative-config \"$spec\"": Check(status=127,
                                                                         stderr=("vllm: command not found",)),
    "dspark vllm-config --drafter dspark --drafter-path Inferact/Kimi-K3-DSpark --block-size 7 -k 7 --extra "
    "'{\"draft_tensor_parallel_size\": 1, \"max_model_len\": 32768}'": Check(
        stdout=('"draft_tensor_parallel_size": 1', '"max_model_len": 32768')),
    "dspark generate --target k3-tiny --speculative-config '{\"method\": \"ngram\", \"num_speculative_tokens\": 3, "
    "\"prompt_lookup_min\": 1, \"prompt_lookup_max\": 4}'": Check(stdout=("(k=3, drafter=ngram)",)),
    f"spec=$({PRODUCTION}) && dspark sweep --speculative-config \"$spec\" --al 1,4,8 --out runs/sweep-production": Check(
        stderr=("a forced-AL sweep ignores method=\"dspark\", model=\"Inferact/Kimi-K3-DSpark\"",),
        files=("runs/sweep-production/sweep.png",), smaller=TINY_SWEEP),
    "dspark vllm-config -k 7 --rejection-sample-method synthetic --synthetic-acceptance-length 3.84": Check(
        stdout=('"synthetic_acceptance_length": 3.84',)),
    # GPU-only: stops before loading anything.
    "dspark sweep --backend vllm --target moonshotai/Kimi-K3 --drafter-path Inferact/Kimi-K3-DSpark -k 7 --al "
    "1,2,3,4,5,6,7,8 --engine-args=\"--tensor-parallel-size 8 --trust-remote-code\"": Check(
        status=2, stderr=("dspark sweep: error: dspark sweep --backend vllm needs a CUDA GPU",)),
    TRAIN: Check(
        stdout=('"out": "runs/drafter"',), files=("runs/drafter/model.safetensors", "runs/drafter/trainer_state.pt"),
        smaller=["--steps", "2", "--batch-size", "2", "--num-anchors", "8", "--num-prompts", "2", "--gen-len", "8"]),
    "dspark calibrate --target k3-tiny --drafter runs/drafter --num-prompts 8 --max-new-tokens 32": Check(
        stdout=('"temperatures"',), smaller=["--num-prompts", "2", "--max-new-tokens", "16"], after=TRAIN),
    "dspark export-drafter runs/drafter runs/k3-dspark-export --layout k3": Check(
        stdout=("wrote runs/k3-dspark-export (k3 layout)",), files=("runs/k3-dspark-export/config.json",),
        after="dspark calibrate --target k3-tiny --drafter runs/drafter --num-prompts 8 --max-new-tokens 32"),
    "dspark vllm-config --drafter dspark --drafter-path runs/k3-dspark-export -k 7": Check(
        stdout=('"model": "runs/k3-dspark-export"',), after="dspark export-drafter runs/drafter runs/k3-dspark-export "
                                                            "--layout k3"),
    # GPU-only: every test skips without CUDA, and the benchmarks stop at once.
    "pytest tests/gpu -q": Check(stdout=(" skipped in ",)),
    "python experiments/step_bench.py --batch 1,4 --context 2048,8192,32768 --tokens 1,8": Check(
        status=2, stderr=("step_bench.py: error: needs a CUDA device",)),
    "python experiments/kernels_bench.py --out experiments/results/h200/kernels_bench.json": Check(
        status=1, stderr=("needs a CUDA device",)),
}


def readme_blocks(text: str) -> tuple[list[tuple[int, str]], list[str], list[str]]:
    """(line number, command) of every shell line in the README's code blocks (indented or fenced
    other than python/text; backslash continuations joined), the python blocks, and the indented
    command-like lines that markdown renders as prose (no blank line before them)."""
    commands, python, prose = [], [], []
    fence, body, skipping = None, [], False
    previous, in_indented = "", False
    pending: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip() in PERFORMANCE:
            skipping = line.strip() == PERFORMANCE[0]
        if skipping:
            previous = line
            continue
        if fence is not None:
            if line.startswith("```"):
                if fence == "python":
                    python.append("\n".join(body))
                fence, body = None, []
            elif fence in ("", "bash", "sh", "shell", "console"):
                commands.append((number, line.strip()))
            else:
                body.append(line)
            previous = line
            continue
        if line.startswith("```"):
            fence = line[3:].strip()
            previous = line
            continue
        indented = line.startswith("    ") and line.strip()
        if indented and (in_indented or not previous.strip()):
            in_indented = True
            pending.append(line.strip())
            if not line.rstrip().endswith("\\"):
                commands.append((number, " ".join(part.rstrip("\\").strip() for part in pending)))
                pending = []
        else:
            if indented and line.strip().startswith(COMMAND_WORDS):
                prose.append(f"README.md:{number}: {line.strip()}")
            in_indented = bool(indented) and in_indented
            if not line.strip():
                in_indented = False
        previous = line
    return commands, python, prose


def fresh_copy(destination: Path) -> Path:
    """The tracked files of the repository (as in the working tree), nothing else: no runs/, no
    .venv, no staged GPU bundle."""
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        source = ROOT / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)
    return destination


def environment() -> dict[str, str]:
    """This interpreter's environment for the lines: its bin/ first on PATH (dspark, pytest), the
    hub offline as in CI, and the same environment for scripts/run and scripts/test."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "DSPARK_VENV": sys.prefix}
    env.pop("PYTHONPATH", None)
    return env


def ensure_environment_set_up() -> None:
    """scripts/run and scripts/test set their environment up first; this one is set up (from the
    repository, so its editable install keeps pointing here) unless it is up to date, which it is
    under scripts/test."""
    done = subprocess.run(["bash", str(ROOT / "scripts" / "setup_env.sh")], capture_output=True, text=True,
                          env=environment(), timeout=1800)
    assert done.returncode == 0, done.stderr


def test_readme_states_the_committed_small_sweep():
    """The small sweep's figures in the README are those of experiments/results/cpu/sweep-k3-tiny/."""
    text = " ".join((ROOT / "README.md").read_text().split())
    found = re.search(r"plain decoding at ([\d.]+) tokens/s and k = 3 at ([\d.]+) / ([\d.]+) / ([\d.]+) / ([\d.]+) "
                      r"tokens/s for AL 1 / 2 / 3 / 4, faster than plain decoding from AL 3 on, ([\d.]+)x at AL 4", text)
    assert found, "the README's small-sweep sentence changed: update this test"
    data = json.loads((ROOT / "experiments/results/cpu/sweep-k3-tiny/sweep.json").read_text())
    assert data["meta"]["command"] == "dspark sweep --k 3 --batch 1 --al 1,2,3,4 --context 16 --out " \
                                      "experiments/results/cpu/sweep-k3-tiny"
    speed = {p["al_target"]: p["tokens_per_s"] for p in data["points"]}
    stated = [float(x) for x in found.groups()]
    assert stated[:5] == [round(speed[al], 1) for al in (None, 1.0, 2.0, 3.0, 4.0)]
    assert stated[5] == round(speed[4.0] / speed[None], 1)
    assert speed[3.0] > speed[None] > speed[2.0]


def run_line(copy: Path, number: int, command: str) -> str | None:
    """Run one README line in the copy; what is wrong with it, or None."""
    check = CHECKS[command]
    line = command + "".join(" " + shlex.quote(arg) for arg in check.smaller)
    done = subprocess.run(["bash", "-c", line], cwd=copy, capture_output=True, text=True, timeout=900,
                          env={**environment(), **check.env})
    problems = [f"exit {done.returncode}, want {check.status}"] if done.returncode != check.status else []
    problems += [f"stdout lacks {s!r}" for s in check.stdout if s not in done.stdout]
    problems += [f"stderr lacks {s!r}" for s in check.stderr if s not in done.stderr]
    problems += [f"{f} not written" for f in check.files if not (copy / f).is_file()]
    if "Traceback" in done.stderr:
        problems.append("a traceback")
    if not problems:
        return None
    return (f"README.md:{number}: {line}\n  {'; '.join(problems)}\n  stdout: {done.stdout[-1500:]}\n"
            f"  stderr: {done.stderr[-1500:]}")


def chains(commands: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
    """The lines grouped so that a line runs after the one it follows (Check.after), in README
    order; independent lines are chains of one. Longest chains first."""
    found: dict[str, list] = {}
    for number, command in commands:
        first = command
        while CHECKS[first].after is not None:
            first = CHECKS[first].after
        found.setdefault(first, []).append((number, command))
    return sorted(found.values(), key=len, reverse=True)


@pytest.mark.long
def test_every_readme_line_runs_as_written(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    copy = fresh_copy(tmp_path / "dspark")
    commands, python, prose = readme_blocks((copy / "README.md").read_text())
    assert not prose, "indented commands that render as prose (a blank line must come before them):\n" + \
        "\n".join(prose)
    unknown = [f"README.md:{n}: {c}" for n, c in commands if c not in CHECKS]
    assert not unknown, "README lines without a check in tests/test_readme_lines.py:\n" + "\n".join(unknown)
    assert len(python) == 1
    ensure_environment_set_up()

    def run_chain(chain):
        return [problem for number, command in chain if (problem := run_line(copy, number, command))]

    # Two at a time: each line runs one thread (OMP_NUM_THREADS=1), CI has two cores.
    with ThreadPoolExecutor(max_workers=2) as pool:
        failures = [problem for found in pool.map(run_chain, chains(commands)) for problem in found]
    (copy / "readme_example.py").write_text(python[0])
    done = subprocess.run([sys.executable, "readme_example.py"], cwd=copy, capture_output=True, text=True,
                          timeout=600, env=environment())
    if done.returncode != 0 or not re.fullmatch(r"\[[\d, ]+\] [\d.]+\n", done.stdout):
        failures.append(f"README.md python block: exit {done.returncode}\n  {done.stdout}\n  {done.stderr[-1500:]}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("text, prose", [
    ("Some prose.\n    dspark roofline\n", ["README.md:2: dspark roofline"]),  # a lazy continuation
    ("Some prose.\n\n    dspark roofline\n", []),
])
def test_a_command_right_after_prose_is_caught(text, prose):
    commands, _, found = readme_blocks(text)
    assert found == prose
    assert commands == ([] if prose else [(3, "dspark roofline")])
