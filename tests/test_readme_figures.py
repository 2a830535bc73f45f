"""The README's measured figures are exactly what `python -m qfuse.bench.readme` makes of
bench/results/*.json (so a stale README fails CI), and the generator survives results
whose keys change (the benchmarks get re-measured with other figures)."""

import json
import shutil
from pathlib import Path

import pytest

from qfuse.bench import readme

ROOT = Path(__file__).resolve().parents[1]


def test_readme_figures_match_bench_results():
    text = (ROOT / "README.md").read_text()
    assert text == readme.render(text, ROOT / "bench" / "results"), (
        "README.md is stale: run `python -m qfuse.bench.readme` and commit it")
    assert readme.main(["--check"]) == 0


def test_figures_come_from_the_files():
    section = readme.measured(ROOT / "bench" / "results")
    gate = json.loads((ROOT / "bench" / "results" / "gate.json").read_text())
    rows = gate["gates"][-1]["rows"]
    # Against the oracle: the README shows the prompt nearest its KL limit.
    worst = max(rows, key=lambda r: r["fast_mean_kl"] / r["kl_limit"])["fast_mean_kl"]
    assert readme.fmt(worst) in section
    record = json.loads((ROOT / "bench" / "results" / "train_record.json").read_text())
    assert f"{record['best_val_loss']:.3f}" in readme.default_model(ROOT / "bench" / "results")


def test_generator_reads_whatever_keys_are_there(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(ROOT / "bench" / "results", results)
    (results / "e2e.json").unlink()
    # A re-measured file with new figure names and rows of another form.
    (results / "mlp.json").write_text(json.dumps({
        "meta": {"gpu": "Some GPU", "date": "2027-01-02T00:00:00"},
        "figures": {"new_figure (>= 1)": 1.5, "plain figure": 0.25},
        "rows": [{"kernel": "x", "time": 3.0}]}))
    out = readme.measured(results)
    assert "`bench/results/e2e.json`: not measured yet" in out
    assert "| new figure | >= 1 | 1.5 |" in out and "| plain figure |  | 0.25 |" in out
    assert "Some GPU, 2027-01-02" in out
    page = "intro\n<!-- figures:default-model -->\nSTALE\n<!-- /figures:default-model -->\n" \
           "<!-- figures:measured -->\nSTALE\n<!-- /figures:measured -->\nend\n"
    new = readme.render(page, results)
    assert new.startswith("intro\n") and new.endswith("end\n") and "STALE" not in new
    assert readme.render(new, results) == new  # regenerating is a fixed point
    with pytest.raises(ValueError, match="exactly one <!-- figures:"):
        readme.render("no markers", results)
