"""Suite-wide settings.

One intra-op thread: the CPU tests run many tiny ops (k3-tiny, per-token reference kernels), for
which OpenMP's thread hand-off costs more than the work, and on a 2-core machine that is also
running pytest's own process a second thread mostly waits (measured: k3-tiny verify of 4 x 8
tokens 2.4 s with 2 threads on a busy machine, 0.25 s with 1).

Fresh random inputs every run, reproducibly: the run draws one seed (or takes DSPARK_TEST_SEED),
prints it in the header, at the end and beside every failure, and seeds torch's, numpy's and
Python's global generators from it before collection (draws at import time) and again before each
test, from the seed and the test's id, so a test's draws do not depend on which tests its worker
ran before it."""
import os
import random
import zlib

import numpy as np
import pytest
import torch

torch.set_num_threads(1)

SEED_VARIABLE = "DSPARK_TEST_SEED"


def run_seed() -> int:
    return int(os.environ[SEED_VARIABLE])


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def pytest_configure(config):
    given = os.environ.get(SEED_VARIABLE, "")
    if given and not given.isdigit():
        raise pytest.UsageError(f"{SEED_VARIABLE}={given!r}: must be a non-negative integer")
    # Set in the environment, so pytest-xdist's workers (started after this) take the same seed.
    os.environ[SEED_VARIABLE] = given or str(int.from_bytes(os.urandom(4), "little"))
    seed_everything(run_seed())


def pytest_report_header(config):
    return f"{SEED_VARIABLE}={run_seed()} (set it to repeat this run's random inputs)"


def pytest_terminal_summary(terminalreporter):
    # Also at the end: -q (scripts/test) leaves the header out.
    terminalreporter.write_line(pytest_report_header(terminalreporter.config))


@pytest.fixture(autouse=True)
def _seeded_per_test(request):
    seed_everything(zlib.crc32(f"{run_seed()}:{request.node.nodeid}".encode()))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        report.sections.append(("random inputs", f"{SEED_VARIABLE}={run_seed()} repeats them"))
    return report


def pytest_collection_modifyitems(items):
    """Tests marked `long` run first: on scripts/test's two workers a minute-long test started last
    keeps one core busy after the other has run out of work (the suite's tail)."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)
