"""Progress of long work, on stderr: a tqdm bar on a terminal; anywhere else (a log file, a pipe)
one plain line every few seconds, so a log shows progress without a bar's carriage returns and a
short run writes nothing at all.

`progress(...)` returns either kind; both take `update(n)`, `set_postfix(dict)`, `write(text)` and
`close()`, and work as context managers. `poll_progress` draws one from a counter that another
piece of code advances (the engine's output-token count), read on a timer thread, for loops that
take no callback.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable, TextIO

from tqdm import tqdm

# Seconds between the lines written when stderr is not a terminal; DSPARK_PROGRESS_SECONDS overrides.
LINE_SECONDS = 10.0


def line_seconds() -> float:
    text = os.environ.get("DSPARK_PROGRESS_SECONDS")
    if text is None:
        return LINE_SECONDS
    try:
        seconds = float(text)
    except ValueError:
        raise ValueError(f"DSPARK_PROGRESS_SECONDS={text!r}: expected a number of seconds") from None
    if not seconds > 0:
        raise ValueError(f"DSPARK_PROGRESS_SECONDS={text!r}: must be > 0")
    return seconds


class LineProgress:
    """tqdm's small interface, written as one line per `interval` seconds (and a last line when
    closed, if any line was written): `desc: n/total unit (pct%), elapsed, postfix`."""

    def __init__(self, total: float | None, *, desc: str, unit: str, initial: float = 0, interval: float,
                 file: TextIO):
        self.total, self.desc, self.unit, self.n = total, desc, unit, initial
        self.interval, self.file = interval, file
        self._start = self._last = time.monotonic()
        self._postfix = ""
        self._written, self._shown = False, None

    def update(self, n: float = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            self._line()

    def set_postfix(self, values: dict | None = None, **kwargs) -> None:
        values = {**(values or {}), **kwargs}
        self._postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def write(self, text: str) -> None:
        print(text, file=self.file, flush=True)

    def close(self) -> None:
        if self._written and self.n != self._shown:  # the last count, unless the last line showed it
            self._line()
        self._written = False

    def _line(self) -> None:
        done = f"{self.n:g}" + (f"/{self.total:g}" if self.total else "")
        share = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        tail = f", {self._postfix}" if self._postfix else ""
        print(f"{self.desc}: {done} {self.unit}{share}, {time.monotonic() - self._start:.0f} s{tail}",
              file=self.file, flush=True)
        self._written, self._shown = True, self.n

    def __enter__(self) -> "LineProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress(total: float | None = None, *, desc: str, unit: str = "it", initial: float = 0, disable: bool = False,
             leave: bool = True, file: TextIO | None = None):
    """A tqdm bar when `file` (stderr) is a terminal, else a LineProgress; disable: neither
    (a tqdm that draws nothing)."""
    file = file if file is not None else sys.stderr
    if disable:
        return tqdm(total=total, disable=True)
    if file.isatty():
        return tqdm(total=total, desc=desc, unit=unit, initial=initial, leave=leave, file=file, dynamic_ncols=True)
    return LineProgress(total, desc=desc, unit=unit, initial=initial, interval=line_seconds(), file=file)


class poll_progress:
    """A progress display advanced from `read()` (a counter that only grows) every `every`
    seconds on a daemon thread, for the duration of a `with` block."""

    def __init__(self, read: Callable[[], float], total: float | None, *, desc: str, unit: str = "it",
                 every: float = 0.5, disable: bool = False):
        self._read, self._every = read, every
        self._bar = progress(total, desc=desc, unit=unit, disable=disable, leave=False)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        seen = 0.0
        while not self._stop.wait(self._every):
            now = self._read()
            if now > seen:
                self._bar.update(now - seen)
                seen = now

    def __enter__(self) -> "poll_progress":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._bar.close()
