"""Weights that cannot be right do not load: a tensor stored as integers where the model
keeps floats (an I32 projection in a bf16 model) is refused, and a floating tensor holding
NaN or inf is refused unless the check is skipped (`--no-check-weights`,
`check_weights=False`); each one line naming the tensor, exit 2, a qfuse.UserError."""

import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

import qfuse
from qfuse.loading import DEFAULT_MODEL, all_finite

NAME = "model.layers.0.mlp.down_proj.weight"


@pytest.fixture
def with_tensor(tmp_path):
    """with_tensor(fn) -> a copy of the bundled model whose NAME is fn(NAME's tensor)."""
    def make(change):
        out = tmp_path / "m"
        shutil.copytree(DEFAULT_MODEL, out)
        for shard in out.glob("*.safetensors"):
            tensors = load_file(shard)
            if NAME in tensors:
                tensors[NAME] = change(tensors[NAME])
                save_file(tensors, shard, metadata={"format": "pt"})
                return out
        raise AssertionError(f"{NAME} is in no shard")
    return make


def as_int32(t):
    return (t.float() * 1000).to(torch.int32)


def with_nan(t):
    t = t.clone()
    t.view(-1)[t.numel() // 2] = float("nan")
    return t


def test_an_integer_projection_is_refused(with_tensor, qfuse_here):
    m = with_tensor(as_int32)
    for extra in ([], ["--no-check-weights"]):  # the dtype check costs nothing: always on
        r = qfuse_here("generate", str(m), "def f():", "--max-tokens", "2", *extra)
        assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, r.stderr
        lines = r.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("qfuse: error: "), r.stderr
        assert f"tensor {NAME!r}" in lines[0] and "is int32" in lines[0], lines[0]
    with pytest.raises(qfuse.UserError, match="is int32; the model keeps it as floats"):
        qfuse.load(m, check_weights=False)


def test_a_nan_weight_is_refused_unless_the_check_is_skipped(with_tensor, qfuse_here):
    m = with_tensor(with_nan)
    r = qfuse_here("generate", str(m), "def f():", "--max-tokens", "2")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and f"tensor {NAME!r}" in lines[0] and "holds NaN or inf" in \
        lines[0], r.stderr
    r = qfuse_here("generate", str(m), "def f():", "--max-tokens", "2", "--no-check-weights")
    assert r.returncode == 0, r.stderr  # the user's call: the weights load as they are
    with pytest.raises(qfuse.UserError, match=f"tensor '{NAME}'.*holds NaN or inf"):
        qfuse.load(m)
    model, _ = qfuse.load(m, check_weights=False)
    assert model.model.layers[0].mlp.down_proj.weight.isnan().any()


def test_an_inf_weight_is_refused(with_tensor):
    def with_inf(t):
        t = t.clone()
        t.view(-1)[0] = -float("inf")
        return t

    with pytest.raises(qfuse.UserError, match="holds NaN or inf"):
        qfuse.load(with_tensor(with_inf))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_finite_finds_a_single_bad_value_anywhere(dtype):
    t = torch.randn(37, 53).to(dtype)
    assert all_finite(t) and all_finite(t[:0])
    for bad in (float("nan"), float("inf"), -float("inf")):
        for index in (0, 1000, t.numel() - 1):
            u = t.clone()
            u.view(-1)[index] = bad
            assert not all_finite(u), (bad, index)


def test_the_flag_reaches_the_loader(monkeypatch):
    """generate, chat and serve parse --no-check-weights; load_model gets it."""
    import argparse

    import qfuse.from_flags
    from qfuse.commands import chat, generate, serve

    for module in (generate, chat, serve):
        sub = argparse.ArgumentParser().add_subparsers()
        module.add_parser(sub)
        (parser,) = sub.choices.values()
        assert parser.parse_args(["--no-check-weights"]).check_weights is False
        assert parser.parse_args([]).check_weights is True
    seen = {}
    monkeypatch.setattr(qfuse.from_flags, "load_model",
                        lambda *a, **kw: seen.update(kw))
    qfuse.from_flags.load_model_from_flags(SimpleNamespace(
        device="cpu", dtype=None, model="m", check_weights=False))
    assert seen["check_weights"] is False
