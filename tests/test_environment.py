"""QFUSE_* variables are checked once at start-up (`levers.check_environment`): a name
qfuse does not read, a tier it does not know, a kernel switch that is not 0/1 is one
line, exit 2, before anything loads; `qfuse serve` refuses to start and `qfuse.load`
raises UserError. The table of known variables follows what the package reads."""

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import qfuse
from qfuse import levers

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("env, fragment", [
    ({"QFUSE_TIER": "bogus"}, "QFUSE_TIER must be one of compat, exact, fast, got 'bogus'"),
    ({"QFUSE_RMS_NORM": "banana"}, "QFUSE_RMS_NORM must be 0 or 1 (off or on), got 'banana'"),
    ({"QFUSE_PDL": "false"}, "QFUSE_PDL must be 0 or 1, got 'false'"),  # pdl.py reads only "0"
    ({"QFUSE_TEIR": "fast"}, ("QFUSE_TEIR is not a variable qfuse reads (did you mean "
                              "QFUSE_TIER?)")),
    ({"QFUSE_RMSNORM": "0"}, "did you mean QFUSE_RMS_NORM?"),
    ({"QFUSE_NOTHING_LIKE_IT": "1"}, ("QFUSE_NOTHING_LIKE_IT is not a variable qfuse reads (it "
                                      "reads QFUSE_TIER")),
])
def test_a_bad_variable_is_named(env, fragment):
    with pytest.raises(qfuse.UserError) as caught:
        levers.check_environment(env)
    assert fragment in str(caught.value)
    assert "\n" not in str(caught.value)


def test_every_problem_is_in_the_one_line():
    with pytest.raises(qfuse.UserError) as caught:
        levers.check_environment({"QFUSE_TIER": "x", "QFUSE_ROPE": "y", "PATH": "/bin"})
    message = str(caught.value)
    assert "QFUSE_TIER" in message and "QFUSE_ROPE" in message and "\n" not in message


def test_what_the_readers_accept_passes():
    env = {"QFUSE_TIER": " Fast ", "QFUSE_PDL": "0", "OTHER": "x"}
    for i, kernel in enumerate(levers.KERNELS.values()):
        env[kernel.env_var] = ["0", "1", "off", "ON", "false", "true", "no", "yes"][i % 8]
    levers.check_environment(env)
    levers.check_environment({"QFUSE_TIER": "", "QFUSE_ROPE": ""})  # empty: as unset
    levers.check_environment({})


def test_the_table_holds_every_variable_the_package_reads():
    """A QFUSE_* name read anywhere in the package (os.environ.get("QFUSE_X"), or a
    kernel's switch) is in the table, and the table holds nothing else: a new lever
    cannot be refused at start-up, nor a removed one accepted."""
    read = set()
    for path in (REPO / "qfuse").rglob("*.py"):
        read |= set(re.findall(r"""environ(?:\.get\(|\[)\s*["'](QFUSE_\w+)["']""",
                               path.read_text()))
    read |= {k.env_var for k in levers.KERNELS.values()}
    assert read == set(levers.ENVIRONMENT)


def test_each_kernel_switch_agrees_with_its_reader(monkeypatch):
    """Every value the check lets through means to kernel_enabled what it says."""
    name = next(iter(levers.KERNELS))
    var = levers.KERNELS[name].env_var
    for value in levers.ENVIRONMENT[var]:
        monkeypatch.setenv(var, value)
        levers.check_environment()
        assert levers.kernel_enabled(name) == (value in ("1", "true", "on", "yes"))


@pytest.mark.parametrize("argv", [["generate", "def f():"], ["info"],
                                  ["chat", "--max-tokens", "2"], ["gate"]])
def test_the_cli_refuses_before_anything_loads(argv, monkeypatch, capsys):
    import qfuse.from_flags
    from qfuse.commands.cli import main

    def load_model(*args, **kwargs):
        raise AssertionError("the model loaded before the mistake was reported")

    monkeypatch.setattr(qfuse.from_flags, "load_model", load_model)
    monkeypatch.setenv("QFUSE_TIER", "bogus")
    assert main(argv) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.splitlines() == [("qfuse: error: QFUSE_TIER must be one of compat, exact, "
                                     "fast, got 'bogus'")]


def test_generate_in_a_process_of_its_own_prints_one_line():
    """What the user met: a traceback after the prompt. Now nothing on stdout."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", QFUSE_TIER="bogus",
               QFUSE_RMS_NORM="banana")
    r = subprocess.run([sys.executable, "-m", "qfuse", "generate", "hi"], capture_output=True,
                       text=True, env=env, timeout=300, check=False)
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qfuse: error: QFUSE_RMS_NORM must be 0 "
                                                   "or 1"), r.stderr
    assert "QFUSE_TIER must be one of compat, exact, fast" in lines[0]


def test_serve_refuses_to_start(monkeypatch, capsys):
    """Through the CLI and through the command's own entry: the server never starts."""
    import qfuse.serving.server
    from qfuse.commands.cli import main
    from qfuse.commands import serve

    def run_serve(args):
        raise AssertionError("the server started with a bad QFUSE_* variable")

    monkeypatch.setattr(qfuse.serving.server, "run_serve", run_serve)
    monkeypatch.setenv("QFUSE_ROPE", "maybe")
    assert main(["serve", "--port", "0"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "qfuse: error: QFUSE_ROPE must be 0 or 1 (off or on), got 'maybe'"]
    with pytest.raises(qfuse.UserError, match="QFUSE_ROPE must be 0 or 1"):
        serve.run(SimpleNamespace(model=None, tp=None))


def test_load_refuses_before_reading_the_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("QFUSE_TIER", "bogus")
    with pytest.raises(qfuse.UserError, match="QFUSE_TIER must be one of"):
        qfuse.load(tmp_path / "missing")  # the variable first: it is named, not the folder
