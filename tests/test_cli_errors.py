"""The command line as a user meets it: each mistake is one `qfuse: error:` line, no traceback.

Every case runs `python -m qfuse` as a subprocess with the bundled default
model (or a broken copy of it) on the CPU, and checks the exit code and the
whole of stderr: the checks run before the model loads, so nothing else may
appear there. Also the conventions users bring from mlx-lm and llama.cpp:
--model/--prompt, `--prompt -`, --version, defaults in --help.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qfuse import __version__
from qfuse.loading import DEFAULT_MODEL

REPO = Path(__file__).resolve().parents[1]


def qfuse(*args: str, stdin: str | None = None, cwd=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO),
               # One thread: two cores shared by parallel test runs slow OpenMP's
               # spinning threads down by ~25x (measured: 75 against 3 tok/s).
               OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "qfuse", *args], input=stdin, text=True,
                          capture_output=True, env=env, cwd=cwd, timeout=300, check=False)


def assert_one_line_error(r: subprocess.CompletedProcess, *fragments: str) -> str:
    """The process failed with exactly one stderr line, `qfuse: error: ...` holding
    each fragment; returns the message."""
    assert r.returncode != 0, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qfuse: error: "), r.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def model_copy(tmp_path_factory):
    """A function making a fresh copy of the default model to break."""
    root = tmp_path_factory.mktemp("models")
    count = iter(range(1000))

    def make() -> Path:
        out = root / f"m{next(count)}"
        shutil.copytree(DEFAULT_MODEL, out)
        return out

    return make


def test_missing_folder(tmp_path):
    r = qfuse("generate", str(tmp_path / "nope"), "def f():")
    assert_one_line_error(r, "does not exist", str(tmp_path / "nope"))
    assert r.returncode == 2


def test_folder_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert_one_line_error(qfuse("generate", str(tmp_path), "def f():"), "no config.json")


def test_broken_config_json_names_the_file(model_copy):
    m = model_copy()
    (m / "config.json").write_text('{"model_type": "gemma3_text", ')
    assert_one_line_error(qfuse("generate", str(m), "def f():"),
                          str(m / "config.json"), "not valid JSON")


def test_config_field_of_the_wrong_kind_names_the_file(model_copy):
    m = model_copy()
    cfg = json.loads((m / "config.json").read_text())
    (m / "config.json").write_text(json.dumps({**cfg, "num_attention_heads": "six"}))
    assert_one_line_error(qfuse("generate", str(m), "def f():"), str(m / "config.json"))


def test_unsupported_model_type_lists_the_supported(model_copy):
    m = model_copy()
    cfg = json.loads((m / "config.json").read_text())
    (m / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    assert_one_line_error(qfuse("generate", str(m), "def f():"),
                          "'gpt2' is not supported", "llama", "qwen3", "gemma3_text")


def test_truncated_shard_names_the_file(model_copy):
    m = model_copy()
    shard = max(m.glob("*.safetensors"))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    assert_one_line_error(qfuse("generate", str(m), "def f():"), str(shard), "truncated")


def test_missing_shard_names_the_file(model_copy):
    m = model_copy()
    shard = min(m.glob("*.safetensors"))
    shard.unlink()
    assert_one_line_error(qfuse("generate", str(m), "def f():"), shard.name, "missing")


def test_missing_tokenizer(model_copy):
    m = model_copy()
    (m / "tokenizer.json").unlink()
    assert_one_line_error(qfuse("generate", str(m), "def f():"), "no tokenizer.json")


def test_chat_refuses_a_broken_folder_too(tmp_path):
    assert_one_line_error(qfuse("chat", str(tmp_path / "nope"), stdin=""), "does not exist")


def test_gate_names_a_missing_folder_not_its_golden_file(tmp_path):
    msg = assert_one_line_error(qfuse("gate", str(tmp_path / "nope")), "does not exist",
                                str(tmp_path / "nope"))
    assert "golden" not in msg
    assert_one_line_error(qfuse("gate", str(tmp_path / "nope"), "--make-golden"),
                          "does not exist")
    # --model is the positional's twin, as in generate and chat
    assert_one_line_error(qfuse("gate", "--model", str(tmp_path / "nope")), "does not exist",
                          str(tmp_path / "nope"))
    assert_one_line_error(qfuse("gate", str(tmp_path), "--model", str(tmp_path / "nope")),
                          "two models")


@pytest.mark.parametrize("flags, fragment", [
    (["--max-tokens", "-5"], "--max-tokens"),
    (["--max-tokens", "many"], "--max-tokens"),
    (["--temperature", "-0.5"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--top-p", "1.5"], "--top-p"),
    (["--top-k", "-1"], "--top-k"),
    (["--min-p", "1"], "--min-p"),
    (["--repetition-penalty", "0"], "--repetition-penalty"),
    (["--kv-bits", "3"], "--kv-bits"),
    (["--kv-group-size", "48"], "--kv-group-size"),
    (["--kv-bits", "4", "--kv-group-size", "128"], "does not divide the model's head_dim"),
    (["--max-kv-size", "0"], "--max-kv-size"),
    (["--max-kv-size", "4096"], "exceeds the model's context"),
    (["--max-kv-size", "100", "--max-tokens", "100"], "leaves no room"),
    (["--device", "tpu"], "--device"),
    (["--tier", "turbo"], "--tier"),
    (["--no-such-flag"], "--no-such-flag"),
])
def test_bad_flag_values(flags, fragment):
    assert_one_line_error(qfuse("generate", "def f():", *flags), fragment)


def test_prompt_longer_than_the_context():
    """The default model's context is 1024 tokens; refused before the model loads."""
    prompt = "def f(x):\n    return x\n" * 200
    msg = assert_one_line_error(qfuse("generate", prompt), "exceeds the model's context",
                                "--max-kv-size")
    assert re.search(r"prompt \(\d+ tokens\)", msg)


def test_max_kv_size_keeps_the_prompts_end():
    prompt = "def f(x):\n    return x\n" * 200
    r = qfuse("generate", prompt, "--max-kv-size", "256", "--max-tokens", "4")
    assert r.returncode == 0, r.stderr
    assert "the model sees its last 252" in r.stderr
    assert "generated 4 tok" in r.stderr


def test_debug_shows_the_traceback(tmp_path):
    for args in (["--debug", "generate", str(tmp_path / "nope"), "x"],
                 ["generate", str(tmp_path / "nope"), "x", "--debug"]):
        r = qfuse(*args)
        assert r.returncode == 2
        assert "Traceback" in r.stderr and "CheckpointError" in r.stderr
        assert r.stderr.strip().splitlines()[-1].startswith("qfuse: error: ")


def test_lone_existing_path_is_a_missing_prompt(tmp_path):
    assert_one_line_error(qfuse("generate", str(tmp_path)), "no prompt", str(tmp_path))
    assert_one_line_error(qfuse("generate"), "no prompt")


def test_model_and_prompt_options():
    r = qfuse("generate", "--model", str(DEFAULT_MODEL), "--prompt", "def add(a, b):",
              "--max-tokens", "3")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("def add(a, b):")
    assert "generated 3 tok" in r.stderr
    assert_one_line_error(qfuse("generate", str(DEFAULT_MODEL), "x", "--model",
                                str(DEFAULT_MODEL)), "two models")


def test_prompt_from_standard_input():
    r = qfuse("generate", "--prompt", "-", "--max-tokens", "2", stdin="class Stack:\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("class Stack:\n")


def test_chat_with_model_option_and_system_prompt():
    r = qfuse("chat", "--model", str(DEFAULT_MODEL), "--system-prompt", "Answer in Python.",
              "--max-tokens", "2", stdin="def add(a, b):\n")
    assert r.returncode == 0, r.stderr
    assert "generated 2 tok" in r.stderr and "Traceback" not in r.stderr


def test_version():
    r = qfuse("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"qfuse {__version__}"


def test_help_shows_defaults():
    out = qfuse("generate", "--help").stdout
    assert "(default: 128)" in out and "(default: 64)" in out and "--max-kv-size" in out
    assert "--system-prompt" in qfuse("chat", "--help").stdout


@pytest.mark.parametrize("command", ["generate", "chat", "quantize", "train", "gate", "bench"])
def test_every_option_has_help(command, capsys):
    from qfuse.cli import main

    with pytest.raises(SystemExit):
        main([command, "--help"])
    options = capsys.readouterr().out.split("options:")[1]
    # argparse prints an option without help as its name alone: no text follows it
    # on its line or on the next, indented line.
    lines = options.splitlines()
    for line, following in zip(lines, [*lines[1:], ""]):
        if line.startswith("  -") and not re.search(r"\S {2,}\S", line.strip()):
            assert following.startswith(" " * 20), f"{command}: {line.strip()} has no help"


def test_stats_line_shows_host_memory_on_cpu():
    r = qfuse("generate", "def f():", "--max-tokens", "2", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    peak = re.search(r"peak (\d+\.\d+) GB host RSS", r.stderr)
    assert peak and float(peak.group(1)) > 0, r.stderr


def test_sweep_belongs_to_the_attention_bench():
    assert_one_line_error(qfuse("bench", "mlp", "--sweep", "s.json"), "--sweep",
                          "bench attention")
