"""Progress on stderr: a line every few seconds where stderr is not a terminal (a log file gets
no bar redraws), nothing at all for short work."""
import io
import time

from dspark.progress import LineProgress, poll_progress, progress


def test_lines_come_every_interval_and_a_last_one_only_after_some():
    out = io.StringIO()
    bar = LineProgress(10, desc="work", unit="step", interval=0.05, file=out)
    bar.update(3)
    assert out.getvalue() == ""  # within the first interval: quiet
    time.sleep(0.06)
    bar.set_postfix({"loss": "1.5"})
    bar.update(2)
    bar.write("a note")
    bar.update(1)  # within the interval: shown by close, the last count
    bar.close()
    bar.close()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("work: 5/10 step (50%), ") and lines[0].endswith(", loss=1.5")
    assert lines[1] == "a note" and lines[2].startswith("work: 6/10 step (60%)") and len(lines) == 3
    shown = io.StringIO()
    with LineProgress(2, desc="once", unit="it", interval=0.0, file=shown) as bar:
        bar.update(2)
    assert shown.getvalue().count("once: 2/2") == 1  # the last line is not repeated at close
    quiet = io.StringIO()
    with LineProgress(4, desc="short", unit="it", interval=60, file=quiet) as short:
        short.update(4)
    assert quiet.getvalue() == ""


def test_progress_is_a_bar_on_a_terminal_and_lines_elsewhere(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert isinstance(progress(3, desc="x", file=io.StringIO()), LineProgress)
    bar = progress(3, desc="x", file=Terminal())
    bar.update(3)
    bar.close()
    assert not isinstance(bar, LineProgress)
    monkeypatch.setenv("DSPARK_PROGRESS_SECONDS", "0")
    try:
        progress(3, desc="x", file=io.StringIO())
    except ValueError as e:
        assert "DSPARK_PROGRESS_SECONDS='0'" in str(e)
    else:
        raise AssertionError("an interval of 0 s was taken")


def test_poll_progress_follows_a_counter(monkeypatch, capsys):
    monkeypatch.setenv("DSPARK_PROGRESS_SECONDS", "0.01")
    count = [0]
    with poll_progress(lambda: count[0], 6, desc="tokens", unit="tok", every=0.01):
        for _ in range(3):
            count[0] += 2
            time.sleep(0.05)
    lines = capsys.readouterr().err.splitlines()
    assert lines and lines[-1].startswith("tokens: 6/6 tok (100%)")
