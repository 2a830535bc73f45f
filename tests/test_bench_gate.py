"""`qfuse bench gate` end to end on the CPU with the tiny checkpoint (one prompt, four
tokens): every configuration judged against the oracle, its quantization cost, the JSON
it writes and the README table made from it. Every kernel is off (the interpreter's
bf16 is wrong), so each verdict is NOT TESTED: the GPU run gives the verdicts."""

import json
import shutil

import pytest

from qfuse import levers
from qfuse.bench import gate, readme
from qfuse.gates import golden_io
from qfuse.loading import load_model, load_tokenizer


def test_bench_gate_runs_every_configuration(checkpoint, tmp_path, monkeypatch):
    for k in levers.KERNELS.values():
        monkeypatch.setenv(k.env_var, "0")
    model_dir = tmp_path / "m"
    shutil.copytree(checkpoint, model_dir)
    golden = golden_io.make_golden(load_model(model_dir), load_tokenizer(model_dir),
                                   prompts=["def add(a, b):"], n_tokens=4)
    golden_io.save_golden(golden, model_dir / "golden.json")
    out = tmp_path / "results"
    assert gate.main(str(out), model_dir=model_dir, device="cpu") == 1  # nothing passed
    d = json.loads((out / "gate.json").read_text())
    assert (out / "gate.png").stat().st_size > 0
    names = [g["quantization"] for g in d["gates"]]
    assert names == [f"{w} weights, {kv} KV" for w in ("dense", "8-bit", "4-bit")
                     for kv in ("dense", "8-bit", "4-bit")]
    for g in d["gates"]:
        assert g["verdict"] == "NOT TESTED" and g["exact"]["verdict"] == "NOT TESTED"
        (row,) = g["rows"]
        # The fast tier fell back to compat: it is compat, on the same oracle trajectory.
        assert row["fast_mean_kl"] == row["compat_mean_kl"] and row["positions"] == 4
        assert row["fast_compat_mean_kl"] == 0 and all(r["bitwise_equal"] for r in g["exact"]["rows"])
        if g["quantization"] == "dense weights, dense KV":
            assert g["quantization_cost"] is None
        else:
            assert g["quantization_cost"]["config"] == g["quantization"]
    cost = {g["quantization"]: g["quantization_cost"]["mean_kl"] for g in d["gates"][1:]}
    assert cost["4-bit weights, dense KV"] > cost["8-bit weights, dense KV"]
    section = readme.measured(out)
    assert "Gates (`qfuse bench gate`, the m model, bfloat16)" in section
    for name in names:
        assert f"| {name} | NOT TESTED | NOT TESTED |" in section
    assert d["rule"] in section


def test_bench_gate_needs_a_golden_file(tmp_path, checkpoint):
    from qfuse.errors import UserError

    model_dir = tmp_path / "m"
    shutil.copytree(checkpoint, model_dir)
    with pytest.raises(UserError, match="--make-golden"):
        gate.main(str(tmp_path / "out"), model_dir=model_dir, device="cpu")


def test_bench_gate_formats_part_gates_each_written_format(checkpoint, tmp_path, monkeypatch,
                                                          capsys):
    """`--parts formats`, quick, on the CPU: the tiny checkpoint written in each format of
    `formats.writers.KINDS` (GGUF's Q8_0 and Q4_0 among them), each gated and reported
    (NOT TESTED: every kernel is off) with its quantization cost; AWQ and GPTQ hold the
    same codes and float16 scales, so they cost the same, and GGUF's Q4_0 costs more than
    its Q8_0."""
    pytest.importorskip("gguf")
    from qfuse.formats import writers

    for k in levers.KERNELS.values():
        monkeypatch.setenv(k.env_var, "0")
    model_dir = tmp_path / "m"
    shutil.copytree(checkpoint, model_dir)
    golden = golden_io.make_golden(load_model(model_dir), load_tokenizer(model_dir),
                                   prompts=["def add(a, b):", "import os"], n_tokens=4)
    golden_io.save_golden(golden, model_dir / "golden.json")
    out = tmp_path / "results"
    assert gate.main(str(out), quick=True, model_dir=model_dir, device="cpu",
                     parts=("formats",)) == 1  # nothing passed
    d = json.loads((out / "gate.json").read_text())
    assert d["gates"] == [] and d["parts"] == ["formats"] and not (out / "gate.png").exists()
    assert [f["format"] for f in d["formats"]] == list(writers.KINDS)
    assert {"gguf-q8_0", "gguf-q4_0"} <= set(writers.KINDS)
    # GGUF Q4_0: Q8_0 embedding and head beside the 4-bit projections
    weights = {"gguf-q8_0": "8-bit weights", "gguf-q4_0": "quantized weights (4/8-bit)"}
    printed = capsys.readouterr().out
    for f in d["formats"]:
        assert f["format_verdict"] == "NOT TESTED" and len(f["rows"]) == 1  # quick: 1 prompt
        assert f["rows"][0]["fast_compat_mean_kl"] == 0  # fast fell back to compat
        assert f["weight_bits"] == (8 if f["format"] == "gguf-q8_0" else 4)
        assert f["quantization_cost"]["config"] == \
            f"{f['format']} {weights.get(f['format'], '4-bit weights')}, dense KV"
        assert f"{f['format']}: NOT TESTED (fast tier NOT TESTED, exact tier NOT TESTED)" \
            in printed
    cost = {f["format"]: f["quantization_cost"]["mean_kl"] for f in d["formats"]}
    assert cost["awq"] == cost["gptq"] > 0
    assert cost["gguf-q4_0"] > cost["gguf-q8_0"] > 0


def test_bench_gate_refuses_an_unknown_part(tmp_path, qfuse_here):
    from qfuse.errors import UserError

    with pytest.raises(UserError, match=r"unknown part 'formatz'.*matrix, formats"):
        gate.main(str(tmp_path), parts=("formatz",), device="cpu")
    r = qfuse_here("bench", "act", "--parts", "formats")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--parts is an option of `qfuse bench serve`, `gate`, `steps` and `products`" in r.stderr
