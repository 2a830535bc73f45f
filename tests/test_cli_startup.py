"""The `qfuse` command's start: `--help` and `--version` import no torch, and Ctrl-C
while the package is still importing exits 130 quietly.

torch takes seconds to import on a small machine, so the CLI imports it (and every
command module) inside `main`, only for the command that runs; these tests hold it
to that, and to its promise that a Ctrl-C during those seconds prints no traceback.
"""

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qfuse.commands import cli

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300  # far above the few seconds each run takes on an idle 2-core machine
HEAVY = ("torch", "numpy", "tokenizers", "safetensors", "triton")


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")


@pytest.mark.parametrize("flag", ["--version", "--help"])
def test_help_and_version_import_nothing_heavy(flag):
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "qfuse", flag], env=_env(),
                       capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    # -X importtime writes one line per module imported: "import time: self | total | name"
    imported = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines()
                if line.startswith("import time:")}
    assert "qfuse.commands.cli" in imported  # the listing is real
    heavy = sorted(m for m in imported if m.split(".")[0] in HEAVY)
    assert not heavy, heavy
    expected = "qfuse 0.1.0" if flag == "--version" else "usage: qfuse"
    assert expected in r.stdout
    if flag == "--help":
        assert all(name in r.stdout for name in cli.COMMANDS)


def test_help_lines_are_the_commands_own():
    """`qfuse --help` lists each command with the help its own parser gives."""
    class Recorder:
        """Stands in for argparse's subparsers: keeps each command's help."""

        def __init__(self):
            self.help = {}

        def add_parser(self, name, **kwargs):
            self.help[name] = kwargs.get("help")
            return argparse.ArgumentParser(prog=f"qfuse {name}")

    sub = Recorder()
    for name in cli.COMMANDS:
        cli.command_module(name).add_parser(sub)
    assert sub.help == cli.COMMANDS


def _torch_loading(pid: int) -> bool:
    """Whether process ``pid`` has begun loading torch's libraries (inside `main`: the
    CLI imports torch nowhere before it)."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except FileNotFoundError:  # it exited
        return True


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc (Linux)")
def test_ctrl_c_while_importing_exits_130_without_a_traceback():
    """SIGINT at several moments of `qfuse info`'s start (torch and numpy importing),
    once and twice in a row: exit 130, at most one line on stderr, never a traceback.
    On a slow machine the later signals may find it done: exit 0, or, in the
    interpreter's last moments (which restore the default handler), death by SIGINT."""
    codes = []
    for delay_s, signals in ((0.0, 1), (0.3, 1), (0.8, 1), (1.5, 1), (0.3, 2)):
        proc = subprocess.Popen([sys.executable, "-m", "qfuse", "info"], env=_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + TIMEOUT_S
        while not _torch_loading(proc.pid):
            assert time.monotonic() < deadline, "torch never started loading"
            time.sleep(0.01)
        time.sleep(delay_s)  # where in the start it lands; every moment must be clean
        for _ in range(signals):
            proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=TIMEOUT_S)
        assert "Traceback" not in err, (delay_s, err)
        assert len(err.strip().splitlines()) <= 1, (delay_s, err)
        assert proc.returncode in (130, 0, -signal.SIGINT), (delay_s, proc.returncode, err)
        codes.append(proc.returncode)
    assert 130 in codes  # at least one signal came while it was still starting


def test_ctrl_c_while_the_script_imports_the_command_line_is_quiet():
    """The `qfuse` script's own first imports (the command line module, before `cli.main`
    runs): a SIGINT delivered exactly there, by an import hook, exits 130 with no
    traceback. Before `qfuse.commands.console` the script imported `qfuse.commands.cli` unprotected."""
    code = (
        "import builtins, os, signal, sys\n"
        "real = builtins.__import__\n"
        "def hook(name, *a, **k):\n"
        "    if name == 'cli':\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = hook\n"
        "sys.argv = ['qfuse', 'info']\n"
        "from qfuse.commands.console import main\n"
        "sys.exit(main())\n")
    proc = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True,
                          text=True, timeout=TIMEOUT_S, check=False)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 130, (proc.returncode, proc.stderr)
    assert proc.stdout == ""  # it stopped there: `info` never ran
