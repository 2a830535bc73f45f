"""Gates: the mechanics of `qfuse gate` (golden files, the report, the CLI, a device where
no kernel runs) and the quantization cost. The fast tier's rule against the oracle, and
the planted faults it must fail, are tests/test_gate_oracle.py's."""

import json
import shutil

import pytest

from qfuse import levers
from qfuse.gates import compat_gate, golden_io, quant_cost
from qfuse.loading import load_model, load_tokenizer


def test_gate_mechanics(checkpoint, tmp_path):
    model, tok = load_model(checkpoint), load_tokenizer(checkpoint)
    golden = golden_io.make_golden(model, tok, prompts=["def add(a, b):"], n_tokens=12)
    path = tmp_path / "golden.json"
    golden_io.save_golden(golden, path)
    golden = golden_io.load_golden(path)
    same = compat_gate.run_gate(model, golden, "compat")
    assert same[0].bitwise_equal and same[0].agreement == 12 and same[0].max_kl == 0.0
    assert same[0].compat_matches_golden == 12  # the golden is compat's own trajectory
    assert compat_gate.passes(same, "exact") and compat_gate.passes(same, "fast")
    # ...but compat against compat ran no fused kernel, so it proves nothing.
    assert same[0].kernels == {} and compat_gate.verdict(same, "fast") == "NOT TESTED"
    assert "NOT TESTED" in compat_gate.verdict_line(same, "fast", "cpu")
    # compat reproduces all golden tokens
    assert "12/12" in compat_gate.report(same).splitlines()[2]
    # The exact tier under the CPU interpreter uses portable math, so it is close
    # but not bitwise; the gate must say so rather than pass it.
    exact = compat_gate.run_gate(model, golden, "exact")
    assert exact[0].kernels and exact[0].mean_kl < 1e-6 and not exact[0].bitwise_equal
    assert not compat_gate.passes(exact, "exact") and compat_gate.verdict(exact, "exact") == "FAIL"
    assert compat_gate.verdict_line(exact, "exact", "cpu").startswith("exact tier: FAIL")
    assert compat_gate.report(exact).splitlines()[2].split()[-2] == "False"  # the bitwise column


def test_quantization_cost_figures(checkpoint):
    model, tok = load_model(checkpoint), load_tokenizer(checkpoint)
    golden = golden_io.make_golden(model, tok, prompts=["def add(a, b):"], n_tokens=8)
    rows = quant_cost.quantization_cost(model, golden, bits=4, group_size=32, kv_bits=(8, 4),
                                        kv_group_size=32)
    by = {r["config"]: r for r in rows}
    assert set(by) == {"4-bit weights, dense KV", "dense weights, 8-bit KV",
                       "dense weights, 4-bit KV", "4-bit weights, 8-bit KV",
                       "4-bit weights, 4-bit KV"}
    # 8-bit KV loses less than 4-bit KV; everything is finite and nonnegative
    # (KL is computed in float64, whose rounding stays far below 1e-12 here.)
    assert -1e-12 <= by["dense weights, 8-bit KV"]["mean_kl"] <= by["dense weights, 4-bit KV"]["mean_kl"]
    assert all(0 <= r["top1_agreement"] <= 1 for r in rows)


def test_cli_gate(checkpoint, tmp_path, capsys):
    import shutil

    from qfuse.commands.cli import main

    model_dir = tmp_path / "m"
    shutil.copytree(checkpoint, model_dir)
    # No golden file and no --make-golden: an error, and nothing written behind the user's back.
    assert main(["gate", str(model_dir), "--tier", "exact"]) == 2
    assert "--make-golden" in capsys.readouterr().err
    assert not (model_dir / "golden.json").exists()
    code = main(["gate", str(model_dir), "--tier", "exact", "--tokens", "6", "--make-golden",
                 "--quantization-cost", "--json", str(tmp_path / "gate.json")])
    out = capsys.readouterr().out
    assert (model_dir / "golden.json").exists() and "quantization cost" in out
    report = json.loads((tmp_path / "gate.json").read_text())
    # Under the Triton interpreter the exact tier's kernels do run on the CPU, with
    # portable math: close to compat but not bitwise, so the exact gate fails (exit 1).
    assert report["kernels_run"] and report["verdict"] == "FAIL"
    assert code == 1 and report["pass"] is False and len(report["quantization_cost"]) == 5
    assert not report["rows"][0]["bitwise_equal"]
    assert report["rows"][0]["compat_matches_golden"] == 6
    # The golden file now exists: a second run reads it and rewrites nothing.
    mtime = (model_dir / "golden.json").stat().st_mtime_ns
    main(["gate", str(model_dir), "--tier", "exact"])
    assert (model_dir / "golden.json").stat().st_mtime_ns == mtime
    assert "wrote golden" not in capsys.readouterr().out


def test_cli_gate_where_no_kernel_runs_says_so(checkpoint, tmp_path, capsys, monkeypatch):
    import shutil

    from qfuse.commands.cli import main

    # Without the interpreter a CPU runs no Triton kernel: the fast tier is all reference.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    levers.reload()  # the plans read it once per generation
    model_dir = tmp_path / "m"
    shutil.copytree(checkpoint, model_dir)
    code = main(["gate", str(model_dir), "--tokens", "6", "--make-golden",
                 "--json", str(tmp_path / "gate.json")])
    out = capsys.readouterr().out
    assert code == 3
    assert "fast tier: NOT TESTED" in out and "no fused kernel ran on cpu" in out
    assert "PASS" not in out
    report = json.loads((tmp_path / "gate.json").read_text())
    assert report["verdict"] == "NOT TESTED" and not report["pass"] and report["kernels_run"] == {}


def _golden(n_tokens: int = 2, token: int = 5) -> dict:
    return {"n_tokens": n_tokens,
            "trajectories": [{"prompt": "x", "prompt_ids": [1, 2], "continuation": [token] * n_tokens}]}


@pytest.fixture
def loading_fails(monkeypatch):
    """While set, loading the weights fails the test (the mistake had to come first)."""
    import qfuse.from_flags

    real = qfuse.from_flags.load_model
    state = {"on": True}

    def load_model(*args, **kwargs):
        if state["on"]:
            raise AssertionError("the model loaded before the mistake was reported")
        return real(*args, **kwargs)

    monkeypatch.setattr(qfuse.from_flags, "load_model", load_model)
    return state


def _one_line(err: str, *fragments: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qfuse: error: "), err
    for f in fragments:
        assert f in lines[0], lines[0]


def test_gate_refuses_what_is_not_a_golden_file_before_loading(checkpoint, tmp_path, capsys,
                                                               loading_fails):
    from qfuse.commands.cli import main

    cases = {
        "notes.md": ("# my notes\n", "is not JSON"),
        "other.json": ('{"a": 1}', 'no list of "trajectories"'),
        "ids.json": (json.dumps({**_golden(), "trajectories": [{"prompt_ids": [1]}]}),
                     'trajectory 0 has no "continuation" token ids'),
        # token ids past the tiny model's vocabulary of 300: another model's file
        "far.json": (json.dumps(_golden(token=300)), "outside this model's vocabulary of 300"),
    }
    for name, (text, fragment) in cases.items():
        f = tmp_path / name
        f.write_text(text)
        assert main(["gate", str(checkpoint), "--golden", str(f)]) == 2
        _one_line(capsys.readouterr().err, f"{f} is not a golden file", fragment)
    assert main(["gate", str(checkpoint), "--golden", str(tmp_path)]) == 2
    _one_line(capsys.readouterr().err, "is a folder, not a golden file")


def test_gate_refuses_a_report_path_that_is_a_folder_before_running(checkpoint, tmp_path,
                                                                    capsys, loading_fails):
    from qfuse.commands.cli import main

    golden = tmp_path / "golden.json"
    golden_io.save_golden(_golden(), golden)
    for path, fragment in [(tmp_path, "is a folder; name a file in it"),
                           (tmp_path / "no" / "gate.json", "does not exist")]:
        assert main(["gate", str(checkpoint), "--golden", str(golden), "--json",
                     str(path)]) == 2
        _one_line(capsys.readouterr().err, "--json", fragment)


def test_make_golden_writes_only_a_new_file_or_over_a_golden_one(checkpoint, tmp_path, capsys,
                                                                 monkeypatch, loading_fails):
    """`--make-golden --golden FILE` overwrote FILE whatever it held; now a file that is
    not a golden file stays as it was, refused before loading."""
    from qfuse.commands.cli import main

    model_dir = tmp_path / "m"
    shutil.copytree(checkpoint, model_dir)
    notes = model_dir / "NOTES.md"
    notes.write_text("my notes\n")
    for mine in (notes, model_dir / "config.json"):
        before = mine.read_bytes()
        assert main(["gate", str(model_dir), "--make-golden", "--golden", str(mine)]) == 2
        _one_line(capsys.readouterr().err, f"{mine} is not a golden file",
                  "leaves this file alone")
        assert mine.read_bytes() == before
    assert main(["gate", str(model_dir), "--make-golden", "--golden",
                 str(tmp_path / "none" / "g.json")]) == 2
    _one_line(capsys.readouterr().err, "folder", "does not exist")

    # A new file, then over that golden file: written (the gate then runs, no kernels).
    loading_fails["on"] = False
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    levers.reload()  # the plans read it once per generation
    golden = model_dir / "golden.json"
    assert main(["gate", str(model_dir), "--make-golden", "--tokens", "2"]) == 3
    assert golden_io.load_golden(golden)["n_tokens"] == 2
    golden.chmod(0o640)
    assert main(["gate", str(model_dir), "--make-golden", "--tokens", "3"]) == 3
    assert "wrote golden trajectories (3 tokens" in capsys.readouterr().out
    assert golden_io.load_golden(golden)["n_tokens"] == 3
    assert golden.stat().st_mode & 0o777 == 0o640  # the file's mode, kept
    assert sorted(p.name for p in model_dir.iterdir() if p.name.startswith(".")) == []


def test_save_golden_is_atomic_and_writes_through_a_link(tmp_path):
    golden = tmp_path / "golden.json"
    golden_io.save_golden(_golden(2), golden)
    before = golden.read_bytes()
    with pytest.raises(TypeError):  # fails while writing: the old file stays whole
        golden_io.save_golden({**_golden(2), "bad": object()}, golden)
    assert golden.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["golden.json"]  # no temporary left
    link = tmp_path / "link.json"
    link.symlink_to(golden)
    golden_io.save_golden(_golden(4), link)
    assert link.is_symlink() and golden_io.load_golden(golden)["n_tokens"] == 4
