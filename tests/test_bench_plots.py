"""Without matplotlib (the `bench` extra) a benchmark's plot is one line on stderr saying
so, after its JSON is written, never a ModuleNotFoundError traceback: every plotting
bench gets pyplot through one helper, `bench.common.pyplot`."""

import importlib
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# (module, plot function) of every bench that plots.
PLOTS = [("qfuse.bench.act", "plot"), ("qfuse.bench.attention", "plot"),
         ("qfuse.bench.e2e", "plot"), ("qfuse.bench.gate", "plot"), ("qfuse.bench.mlp", "plot"),
         ("qfuse.bench.serve", "plot"), ("qfuse.bench.steps", "plot"),
         ("qfuse.bench.train", "plot_record"),
         ("qfuse.parallel.bench", "plot")]


def test_only_the_helper_imports_matplotlib():
    """So the list above is every plot: a new one importing matplotlib itself fails here."""
    importers = sorted(str(p.relative_to(REPO)) for p in (REPO / "qfuse").rglob("*.py")
                       if re.search(r"^\s*(import|from) matplotlib", p.read_text(), re.MULTILINE))
    assert importers == ["qfuse/bench/common.py"]
    calls = {str(p.relative_to(REPO)).removesuffix(".py").replace("/", ".")
             for p in (REPO / "qfuse").rglob("*.py") if "common.pyplot(" in p.read_text()}
    assert calls == {module for module, _ in PLOTS}


@pytest.mark.parametrize("module, function", PLOTS)
def test_a_plot_without_matplotlib_is_one_line(module, function, monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    plot = getattr(importlib.import_module(module), function)
    path = tmp_path / "out.png"
    args = {"plot_record": ({}, str(path))}.get(function)
    if args is None:
        n = plot.__code__.co_argcount
        args = (*([{"rows": []}] * (n - 1)), str(path))
    assert plot(*args) is None
    out = capsys.readouterr()
    assert out.err.splitlines() == [
        (f"qfuse: note: no plot {path}: it needs matplotlib, the `bench` extra "
         "(pip install 'qfuse[bench]'); the results are in the JSON beside it")]
    assert not path.exists()


def test_the_helper_gives_pyplot_where_matplotlib_is():
    pytest.importorskip("matplotlib")
    from qfuse.bench import common

    plt = common.pyplot("x.png")
    assert plt is sys.modules["matplotlib.pyplot"]
