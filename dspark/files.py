"""Result files written atomically: a temporary file in the same folder, then os.replace, so a
run killed mid-write leaves the previous version (or nothing), never a torn file."""
from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(path: str | os.PathLike):
    """Yields a temporary path beside `path`; when the block ends without an exception the file
    written there replaces `path` in one rename. On an exception the temporary file is removed
    and `path` is untouched."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    # mkstemp creates the file 0600; a result file gets what open() would give it, 0666 less the umask.
    os.fchmod(fd, file_mode())
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, newline="")  # as given: a CSV's own line ends stay


def file_mode() -> int:
    """The permissions open() gives a new file: 0666 less the process's umask."""
    mask = os.umask(0o022)  # reading the umask means setting it: put it straight back
    os.umask(mask)
    return 0o666 & ~mask
