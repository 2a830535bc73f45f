"""qfuse without Triton, as on a CPU machine after `pip install .`: every command runs.

Triton is optional (the `dev` extra brings it; CPU installs of torch do not), so
nothing on the way to a command may import it at module level. These tests run the
CLI and the Python API in a Python where Triton truly is not installed: `python -S`
over a copy of site-packages made of symbolic links to everything in it but Triton
(no import hook, so `import triton` and `importlib.util.find_spec("triton")` behave
exactly as without it), with this checkout first on the path.

That Python starts once per module and imports torch (most of a start's seconds, and
Triton-free: torch itself only looks for Triton); each run is a fork of it that becomes
`python ARGS` on its own standard streams, and exits as that process would.
"""

import importlib.util
import json
import os
import pkgutil
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 600  # far above the few seconds each takes on an idle 2-core machine
NOT_TESTED = 3  # `qfuse gate` where no fused kernel ran (README: as on a CPU)

# What may import Triton at module level: the kernels themselves, and the benchmarks
# that time them (`qfuse bench` refuses those without a GPU before importing them).
NEEDS_TRITON = ("qfuse.kernels.", "qfuse.bench.act", "qfuse.bench.attention",
                "qfuse.bench.products")


def _site_without_triton(site: Path, farm: Path) -> None:
    """``farm``: a link to each entry of ``site`` except Triton's and the .pth files
    (which -S does not read; this checkout is put on the path instead)."""
    farm.mkdir()
    for entry in site.iterdir():
        name = entry.name
        if name == "triton" or name.startswith("triton-") or name.endswith(".pth"):
            continue
        (farm / name).symlink_to(entry)


# The Python that forks each run: a request a line on its stdin ({"args", "stdin", "out",
# "err"}: the run's arguments, -m MODULE ... or -c CODE ..., and the files its streams are
# on); it answers the child's pid, then its exit status as `subprocess` gives it. The
# child leaves the loop by SystemExit or an exception, so it ends as the process would:
# a traceback on its stderr and status 1 for an exception, atexit handlers run.
_FORKS = r"""
import json, os, runpy, sys
import torch  # noqa: F401 -- what every run imports first, imported once

for line in sys.stdin:
    run = json.loads(line)
    pid = os.fork()
    if pid == 0:
        for fd, path, flags in ((0, run["stdin"], os.O_RDONLY),
                                (1, run["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                (2, run["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            os.dup2(os.open(path, flags, 0o600), fd)
        sys.stdin = sys.__stdin__ = open(0, closefd=False)
        sys.stdout = sys.__stdout__ = open(1, "w", closefd=False)
        sys.stderr = sys.__stderr__ = open(2, "w", closefd=False, errors="backslashreplace")
        option, target, *rest = run["args"]
        if option == "-m":
            sys.argv = [target, *rest]  # runpy puts the module's path first, as -m does
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *rest]
            exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})
        sys.exit(0)
    print(pid, flush=True)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


@pytest.fixture(scope="module")
def python_without_triton(tmp_path_factory):
    """run(*args, stdin=None) -> CompletedProcess of ``python ARGS`` (-m or -c) without
    Triton."""
    spec = importlib.util.find_spec("triton")
    if spec is None:
        prefix, path = [sys.executable], [str(REPO)]
    else:
        site = Path(spec.submodule_search_locations[0]).parent
        farm = tmp_path_factory.mktemp("no_triton") / "site-packages"
        _site_without_triton(site, farm)
        prefix, path = [sys.executable, "-S"], [str(REPO), str(farm)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # One thread: torch starts none at import then, and a fork copies only the caller's.
    env.update(PYTHONPATH=os.pathsep.join(path), OMP_NUM_THREADS="1")
    forks = subprocess.Popen([*prefix, "-c", _FORKS], env=env, cwd=REPO, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    streams = tmp_path_factory.mktemp("streams")
    answers = bytearray()  # read from the pipe itself: a file object's buffer hides lines

    def answer() -> int:
        while b"\n" not in answers:
            ready, _, _ = select.select([forks.stdout], [], [], TIMEOUT_S)
            chunk = os.read(forks.stdout.fileno(), 4096) if ready else b""
            assert chunk, f"the forking Python ended or hung (exit status {forks.poll()})"
            answers.extend(chunk)
        line, _, rest = bytes(answers).partition(b"\n")
        answers[:] = rest
        return int(line)

    def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
        assert args[0] in ("-m", "-c"), args
        (streams / "in").write_text(stdin or "")
        files = {"stdin": str(streams / "in"), "out": str(streams / "out"),
                 "err": str(streams / "err")}
        forks.stdin.write(json.dumps({"args": args, **files}) + "\n")
        forks.stdin.flush()
        pid = answer()
        try:
            code = answer()
        except AssertionError:
            os.kill(pid, signal.SIGKILL)
            raise subprocess.TimeoutExpired([*prefix, *args], TIMEOUT_S) from None
        return subprocess.CompletedProcess([*prefix, *args], code,
                                           (streams / "out").read_text(errors="replace"),
                                           (streams / "err").read_text(errors="replace"))

    proof = run("-c", "import torch, qfuse, sys\n"
                      "try:\n    import triton\nexcept ModuleNotFoundError:\n"
                      "    sys.exit(0)\nsys.exit(1)")
    assert proof.returncode == 0, f"triton still importable or torch missing:\n{proof.stderr}"
    yield run
    forks.stdin.close()  # its loop ends
    forks.wait(timeout=TIMEOUT_S)


def _ok(r: subprocess.CompletedProcess, code: int = 0) -> None:
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == code, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])


def test_every_module_but_the_kernels_imports(python_without_triton):
    """A module that the CLI, the API or the server imports must not need Triton."""
    import qfuse

    names = [m.name for m in pkgutil.walk_packages(qfuse.__path__, "qfuse.")
             if m.name != "qfuse.__main__" and not m.name.startswith(NEEDS_TRITON)]
    assert "qfuse.parallel.comm" in names and "qfuse.serving.server" in names
    r = python_without_triton("-c", "import importlib, sys\n"
                                    f"for name in {names!r}:\n"
                                    "    importlib.import_module(name)\n"
                                    "assert 'triton' not in sys.modules")
    _ok(r)


def test_info_says_the_kernels_need_triton(python_without_triton):
    r = python_without_triton("-m", "qfuse", "info")
    _ok(r)
    assert "triton not installed" in r.stdout
    assert "kernels: unavailable: no Triton" in r.stdout


def test_generate(python_without_triton):
    r = python_without_triton("-m", "qfuse", "generate", "def fibonacci(n):", "--max-tokens", "8")
    _ok(r)
    assert r.stdout.startswith("def fibonacci(n):") and len(r.stdout) > len("def fibonacci(n):")


def test_chat_from_a_pipe(python_without_triton):
    r = python_without_triton("-m", "qfuse", "chat", "--max-tokens", "8",
                              stdin="def add(a, b):\n")
    _ok(r)
    assert r.stdout.strip()  # the reply


def test_gate_says_not_tested(python_without_triton, tmp_path):
    golden = tmp_path / "golden.json"  # a short one of its own: 4 tokens keep it quick
    r = python_without_triton("-m", "qfuse", "gate", "--make-golden", "--golden", str(golden),
                              "--tokens", "4")
    _ok(r, NOT_TESTED)
    assert "NOT TESTED" in r.stdout


def test_every_command_answers_help(python_without_triton):
    """Each command's parser (and what it imports to define its flags) without Triton."""
    from qfuse.commands.cli import COMMANDS

    r = python_without_triton("-c", "from qfuse.commands.cli import main\n"
                                    f"for name in {list(COMMANDS)!r}:\n"
                                    "    try:\n        main([name, '--help'])\n"
                                    "    except SystemExit as e:\n"
                                    "        assert e.code == 0, (name, e.code)\n"
                                    "    else:\n        raise AssertionError(name)")
    _ok(r)
    assert r.stdout.count("usage: qfuse") == len(COMMANDS)


def test_python_api(python_without_triton):
    r = python_without_triton("-c", "import qfuse\n"
                                    "model, tokenizer = qfuse.load(progress=False)\n"
                                    "text = qfuse.generate(model, tokenizer, 'def fib(n):', "
                                    "max_tokens=8)\n"
                                    "assert isinstance(text, str) and text, text\n"
                                    "print('ok')")
    _ok(r)
    assert r.stdout.strip().endswith("ok")
