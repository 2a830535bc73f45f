"""The tier set in code (levers.use_tier, qfuse.use_tier, `--tier`) over QFUSE_TIER."""

import io
import os
import threading

import pytest
import torch

import qfuse
from qfuse import levers, ops
from qfuse.commands.cli import main
from qfuse.levers import KERNELS, Tier
from qfuse.testing import kernel_device

DEV = kernel_device()
needs_kernels = pytest.mark.skipif(
    not torch.cuda.is_available() and not (levers.interpreter_active()
                                           and levers.triton_available()),
    reason="no kernel can run: neither CUDA nor TRITON_INTERPRET=1 with triton")


def test_use_tier_overrides_the_variable_and_restores_it(monkeypatch):
    assert levers.tier("cpu") == Tier.COMPAT  # nothing set: by device
    monkeypatch.setenv("QFUSE_TIER", "compat")
    with levers.use_tier("fast") as chosen:
        assert chosen == Tier.FAST
        assert levers.tier("cpu") == levers.tier("cuda") == levers.tier() == Tier.FAST
        assert os.environ["QFUSE_TIER"] == "compat"  # the variable is left alone
    assert levers.tier("cpu") == Tier.COMPAT
    monkeypatch.setenv("QFUSE_TIER", "exact")  # read again at every call
    assert levers.tier("cpu") == Tier.EXACT


def test_use_tier_restores_after_an_exception(monkeypatch):
    monkeypatch.setenv("QFUSE_TIER", "exact")
    with pytest.raises(RuntimeError, match="inside"), levers.use_tier("compat"):
        raise RuntimeError("inside")
    assert levers.tier() == Tier.EXACT
    monkeypatch.delenv("QFUSE_TIER")
    with pytest.raises(RuntimeError), levers.use_tier(Tier.FAST):
        raise RuntimeError
    assert levers.tier("cuda") == Tier.FAST and levers.tier("cpu") == Tier.COMPAT


def test_nested_blocks_innermost_wins():
    with levers.use_tier("exact"):
        with levers.use_tier("fast"):
            with levers.use_tier("compat"):
                assert levers.tier() == Tier.COMPAT
            assert levers.tier() == Tier.FAST
        assert levers.tier() == Tier.EXACT
    assert levers.tier("cpu") == Tier.COMPAT


def test_a_bad_name_fails_at_once():
    with pytest.raises(ValueError, match="compat, exact, fast; got 'turbo'"):
        levers.use_tier("turbo")  # before the block, not on entering it
    with pytest.raises(qfuse.UserError, match="got 'turbo'"):
        qfuse.use_tier("turbo")
    with levers.use_tier(" FAST "):  # as QFUSE_TIER is read
        assert levers.tier() == Tier.FAST


def test_the_package_api_sets_the_same_tier(monkeypatch):
    monkeypatch.setenv("QFUSE_TIER", "fast")
    with qfuse.use_tier("exact"):
        assert levers.tier("cuda") == Tier.EXACT
    assert levers.tier("cpu") == Tier.FAST


def test_threads_keep_their_own_tier(monkeypatch):
    """Two threads in blocks of different tiers at the same time, a third outside any
    block and the main thread each see their own tier."""
    monkeypatch.setenv("QFUSE_TIER", "compat")
    inside, leave = threading.Barrier(4), threading.Barrier(4)
    seen: dict[str, list] = {}

    def run(key: str, name: str | None) -> None:
        try:
            if name is None:
                inside.wait()
                seen[key] = [levers.tier("cpu")]
                leave.wait()
                return
            with levers.use_tier(name):
                inside.wait()  # every thread is in its block now
                seen[key] = [levers.tier("cpu")]
                leave.wait()  # and stays there until all have read
                seen[key].append(levers.tier("cpu"))
            seen[key].append(levers.tier("cpu"))
        except threading.BrokenBarrierError:
            pass

    threads = [threading.Thread(target=run, args=(k, n))
               for k, n in (("fast", "fast"), ("exact", "exact"), ("none", None))]
    for t in threads:
        t.start()
    try:
        inside.wait(timeout=30)
        main_thread = levers.tier("cpu")
        leave.wait(timeout=30)
    finally:
        for t in threads:
            t.join(timeout=30)
    assert main_thread == Tier.COMPAT
    assert seen == {"fast": [Tier.FAST, Tier.FAST, Tier.COMPAT],
                    "exact": [Tier.EXACT, Tier.EXACT, Tier.COMPAT],
                    "none": [Tier.COMPAT]}


def _kernels() -> set[str]:
    return {k for k in levers.counters() if not k.startswith("ref:")}


@needs_kernels
@torch.no_grad()
def test_a_lower_tier_admits_fewer_kernels(monkeypatch):
    """rope is bit-exact (exact tier), rms_norm is not (fast tier only)."""
    monkeypatch.setenv("QFUSE_TIER", "compat")
    x = torch.randn(1, 2, 3, 64, device=DEV)
    cos, sin = torch.randn(1, 3, 64, device=DEV), torch.randn(1, 3, 64, device=DEV)
    w = torch.randn(64, device=DEV)
    expected = {"compat": set(), "exact": {"rope"}, "fast": {"rope", "rms_norm"}}
    for name, kernels in expected.items():
        levers.reset_counters()
        with levers.use_tier(name):
            ops.apply_rotary(x, cos, sin)
            ops.rms_norm(x, w, 1e-6)
        assert _kernels() == kernels, name


def _generate(*flags: str) -> dict[str, int]:
    levers.reset_counters()
    assert main(["generate", "def f():", "--max-tokens", "2", *flags]) == 0
    return levers.counters()


@needs_kernels
def test_generate_tier_flag_reaches_the_ops(monkeypatch, capsys):
    """The bundled model: --tier picks the kernels over QFUSE_TIER (set to the others),
    each tier's kernels within the ones a higher tier runs."""
    runs = {}
    for name in ("compat", "exact", "fast"):
        monkeypatch.setenv("QFUSE_TIER", "fast" if name == "compat" else "compat")
        runs[name] = _generate("--tier", name, "--device", DEV)
        assert levers.tier(DEV) == Tier[os.environ["QFUSE_TIER"].upper()]  # restored
    kernels = {name: {k for k in run if not k.startswith("ref:")} for name, run in runs.items()}
    assert kernels["compat"] == set()
    assert kernels["exact"] and all(KERNELS[k].min_tier == Tier.EXACT for k in kernels["exact"])
    assert kernels["exact"] < kernels["fast"]
    assert any(KERNELS[k].min_tier == Tier.FAST for k in kernels["fast"])
    # Without the flag QFUSE_TIER still decides.
    monkeypatch.setenv("QFUSE_TIER", "exact")
    assert {k for k in _generate("--device", DEV) if not k.startswith("ref:")} == \
        kernels["exact"]
    assert "def f():" in capsys.readouterr().out


def test_chat_tier_flag_reaches_the_ops(monkeypatch, capsys):
    monkeypatch.setenv("QFUSE_TIER", "fast")
    monkeypatch.setattr("sys.stdin", io.StringIO("def add(a, b):\n"))
    assert main(["chat", "--tier", "compat", "--max-tokens", "2", "--device", DEV]) == 0
    assert levers.counters() and _kernels() == set()
    assert "generated 2 tok" in capsys.readouterr().err


def test_bad_tier_flag_is_one_line(capsys):
    for command in (["generate", "x"], ["chat"]):
        assert main([*command, "--tier", "turbo"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("qfuse: error: argument --tier: "), err
        assert "'turbo'" in err[0] and "compat" in err[0]
