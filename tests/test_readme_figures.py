"""The figures of the README and docs/ are exactly what `python -m qfuse.bench.readme`
makes of bench/results/*.json (so a stale page fails CI), and the generator survives
results whose keys change (the benchmarks get re-measured with other figures)."""

import json
import shutil
from pathlib import Path

import pytest

from qfuse.bench import readme

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


@pytest.mark.parametrize("page", sorted(readme.PAGES))
def test_page_figures_match_bench_results(page):
    text = (ROOT / page).read_text()
    assert text == readme.render(text, RESULTS, readme.PAGES[page]), (
        f"{page} is stale: run `python -m qfuse.bench.readme` and commit it")


def test_check_passes_on_the_checkout_and_fails_on_a_stale_page(tmp_path, capsys):
    assert readme.main(["--check"]) == 0
    for page in readme.PAGES:
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / page, tmp_path / page)
    readme_md = tmp_path / "README.md"
    readme_md.write_text(readme_md.read_text().replace(" tokens/s |", " tokens/s (stale) |", 1))
    assert readme.main(["--check", "--root", str(tmp_path), "--results", str(RESULTS)]) == 1
    assert "stale: README.md" in capsys.readouterr().err
    assert readme.main(["--root", str(tmp_path), "--results", str(RESULTS)]) == 0
    assert readme_md.read_text() == (ROOT / "README.md").read_text()


def test_figures_come_from_the_files():
    section = readme.measured(RESULTS)
    gate = json.loads((RESULTS / "gate.json").read_text())
    rows = gate["gates"][-1]["rows"]
    # Against the oracle: the page shows the prompt nearest its KL limit.
    worst = max(rows, key=lambda r: r["fast_mean_kl"] / r["kl_limit"])["fast_mean_kl"]
    assert readme.fmt(worst) in section
    record = json.loads((RESULTS / "train_record.json").read_text())
    assert f"{record['best_val_loss']:.3f}" in readme.default_model(RESULTS)
    assert f"{record['parameters'] / 1e6:.1f} M parameters" in readme.bundled_model(RESULTS)
    # The README's headline: the 4-bit Gemma decode at one sequence, with its GPU and date.
    e2e = json.loads((RESULTS / "e2e.json").read_text())
    (run,) = [r for r in e2e["rows"] if r["model"] == "gemma3-12b" and r["weights"] == "4-bit"
              and r["kv"] == "4-bit" and r["batch"] == 1 and r["context"] == 8192
              and r["tier"] == "fast"]
    headline = readme.headline(RESULTS)
    assert (f"| {readme.fmt(run['tokens_per_s'])} tokens/s | {e2e['meta']['gpu']}, "
            f"{e2e['meta']['date'][:10]}, `e2e.json` |") in headline
    passed = sum(g["verdict"] == "PASS" for g in gate["gates"])
    assert f"{passed} of {len(gate['gates'])} configurations pass" in headline


def test_generator_reads_whatever_keys_are_there(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    (results / "e2e.json").unlink()
    # A re-measured file with new figure names and rows of another form.
    (results / "mlp.json").write_text(json.dumps({
        "meta": {"gpu": "Some GPU", "date": "2027-01-02T00:00:00"},
        "figures": {"new_figure (>= 1)": 1.5, "plain figure": 0.25, "f() (<= 2)": 3.0,
                    "not run this time": None},
        "rows": [{"kernel": "x", "time": 3.0}]}))
    out = readme.measured(results)
    assert "`bench/results/e2e.json`: not measured yet" in out
    assert "| new figure | >= 1 | 1.5 |" in out and "| plain figure |  | 0.25 |" in out
    assert "| f() | <= 2 | 3 |" in out and "not run this time" not in out
    assert "Some GPU, 2027-01-02" in out
    # The headline leaves out the rows whose file is gone, and keeps the others.
    headline = readme.headline(results)
    assert "e2e.json" not in headline and "`gate.json`" in headline
    for name in ("attention", "gate"):
        (results / f"{name}.json").unlink()
    assert readme.headline(results) == "*No benchmark results yet (`bench/results/`).*"
    page = "intro\n<!-- figures:default-model -->\nSTALE\n<!-- /figures:default-model -->\n" \
           "<!-- figures:measured -->\nSTALE\n<!-- /figures:measured -->\nend\n"
    new = readme.render(page, results, ("default-model", "measured"))
    assert new.startswith("intro\n") and new.endswith("end\n") and "STALE" not in new
    assert readme.render(new, results, ("default-model", "measured")) == new  # a fixed point
    with pytest.raises(ValueError, match="exactly one <!-- figures:headline"):
        readme.render(page, results, ("headline",))
