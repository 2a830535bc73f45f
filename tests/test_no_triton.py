"""qfuse without Triton, as on a CPU machine after `pip install .`: every command runs.

Triton is optional (the `dev` extra brings it; CPU installs of torch do not), so
nothing on the way to a command may import it at module level. These tests run the
CLI and the Python API in a Python where Triton truly is not installed: `python -S`
over a copy of site-packages made of symbolic links to everything in it but Triton
(no import hook, so `import triton` and `importlib.util.find_spec("triton")` behave
exactly as without it), with this checkout first on the path.
"""

import importlib.util
import os
import pkgutil
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


@pytest.fixture(scope="module")
def python_without_triton(tmp_path_factory):
    """run(*args, stdin=None) -> CompletedProcess of ``python ARGS`` without Triton."""
    spec = importlib.util.find_spec("triton")
    if spec is None:
        prefix, path = [sys.executable], [str(REPO)]
    else:
        site = Path(spec.submodule_search_locations[0]).parent
        farm = tmp_path_factory.mktemp("no_triton") / "site-packages"
        _site_without_triton(site, farm)
        prefix, path = [sys.executable, "-S"], [str(REPO), str(farm)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join(path), OMP_NUM_THREADS="1")

    def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([*prefix, *args], check=False, input=stdin, env=env,
                              capture_output=True, text=True, timeout=TIMEOUT_S, cwd=REPO)

    proof = run("-c", "import torch, qfuse, sys\n"
                      "try:\n    import triton\nexcept ModuleNotFoundError:\n"
                      "    sys.exit(0)\nsys.exit(1)")
    assert proof.returncode == 0, f"triton still importable or torch missing:\n{proof.stderr}"
    return run


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
