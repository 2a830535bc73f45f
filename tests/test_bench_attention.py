"""`qfuse bench attention`'s sweep of launch variants, on the CPU: the sweep file is
checked before any GPU work, and each variant runs on each case in order."""

import json
from pathlib import Path

import pytest

pytest.importorskip("triton")

from qfuse.bench import attention


def write(tmp_path, spec):
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(spec))
    return str(path)


def spec(**changes):
    base = {"cases": [{"shape": "gemma3-12b", "kind": "kv4", "N": 8192, "B": 1},
                      {"shape": [4, 2, 64], "kind": "bf16", "N": 100, "B": 2}],
            "variants": {"default": {}, "tc": {"path": "tensor_cores", "block_n": 16}}}
    return {**base, **changes}


def test_load_resolves_shapes(tmp_path):
    cases, variants = attention.load_sweep(write(tmp_path, spec()))
    assert [c["dims"] for c in cases] == [(16, 8, 256), (4, 2, 64)]
    assert list(variants) == ["default", "tc"]


@pytest.mark.parametrize("name", sorted(p.name for p in (Path(__file__).parents[1] / "bench")
                                         .glob("attention_*.json")))
def test_the_shipped_sweeps_load(name):
    cases, variants = attention.load_sweep(str(Path(__file__).parents[1] / "bench" / name))
    assert cases and "default" in variants


@pytest.mark.parametrize("changes,match", [
    ({"variants": {"x": {"_bogus": 1}}}, "_bogus"),
    ({"variants": {"x": {"_path": "codes"}}}, "launch options"),
    ({"variants": {"x": {"path": "cuda_cores"}}}, "variant 'x': path must be one of"),
    ({"variants": {"x": {"block_n": -1}}}, "variant 'x': block_n must be a positive"),
    ({"variants": {}}, "variants"),
    ({"cases": []}, "cases"),
    ({"cases": [{"shape": "gpt2", "kind": "kv4", "N": 1, "B": 1}]}, "shape"),
    ({"cases": [{"shape": [16, 8], "kind": "kv4", "N": 1, "B": 1}]}, "shape"),
    ({"cases": [{"shape": "llama3-8b", "kind": "kv2", "N": 1, "B": 1}]}, "kind"),
    ({"cases": [{"shape": "llama3-8b", "kind": "kv4", "N": 0, "B": 1}]}, "N and B"),
    ({"cases": [{"shape": "llama3-8b", "kind": "kv4", "N": 8}]}, "exactly"),
    ({"extra": 1}, "exactly"),
    ({"cases": [{"shape": "llama3-8b", "kind": "kv4", "N": 100, "B": 1, "page": 16}]},
     "page must be a positive integer dividing N"),
])
def test_bad_files_are_refused(tmp_path, changes, match):
    with pytest.raises(ValueError, match=match):
        attention.load_sweep(write(tmp_path, spec(**changes)))


def test_every_variant_on_every_case(tmp_path, monkeypatch):
    calls = []

    def fake_bench_one(kind, method, Hq, Hkv, D, N, B, copy_gbs, launch=None):
        calls.append((kind, method, (Hq, Hkv, D), N, B, launch))
        if method == "sdpa-flash":
            return {"us": 20.0}
        if launch.get("path") == "tensor_cores" and kind == "bf16":
            return {"error": "no such kernel"}
        return {"us": 10.0 if not launch else 5.0}

    monkeypatch.setattr(attention, "bench_one", fake_bench_one)
    monkeypatch.setattr(attention.torch.cuda, "empty_cache", lambda: None)
    rows = attention.run_sweep(*attention.load_sweep(write(tmp_path, spec())), copy_gbs=1.0)
    # each case: flash over bf16 first, then every variant
    assert [(c[0], c[1], c[5]) for c in calls] == [
        ("kv4", "sdpa-flash", None), ("kv4", "qfuse", {}),
        ("kv4", "qfuse", {"path": "tensor_cores", "block_n": 16}),
        ("bf16", "sdpa-flash", None), ("bf16", "qfuse", {}),
        ("bf16", "qfuse", {"path": "tensor_cores", "block_n": 16})]
    assert [r.get("vs_first") for r in rows] == [1.0, 2.0, 1.0, None]
    assert [r.get("vs_flash") for r in rows] == [2.0, 4.0, 2.0, None]
    assert rows[1]["variant"] == "tc" and rows[1]["shape"] == "gemma3-12b"
    assert rows[3]["error"] == "no such kernel" and rows[2]["shape"] == [4, 2, 64]


def test_a_paged_case_passes_its_page(tmp_path, monkeypatch):
    calls = []

    def fake_bench_one(kind, method, Hq, Hkv, D, N, B, copy_gbs, launch=None, page=None):
        calls.append((method, page))
        return {"us": 1.0}

    monkeypatch.setattr(attention, "bench_one", fake_bench_one)
    monkeypatch.setattr(attention.torch.cuda, "empty_cache", lambda: None)
    paged = {"shape": "llama3-8b", "kind": "bf16", "N": 512, "B": 8, "page": 16}
    rows = attention.run_sweep(*attention.load_sweep(write(tmp_path, spec(
        cases=[paged], variants={"default": {}, "whole": {"whole": True}}))), copy_gbs=1.0)
    # flash reads a slotted bf16 cache; every qfuse variant the paged one
    assert calls == [("sdpa-flash", None), ("qfuse", 16), ("qfuse", 16)]
    assert [r["page"] for r in rows] == [16, 16]
