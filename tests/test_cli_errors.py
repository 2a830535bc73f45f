"""The command line as a user meets it: each mistake is one `qfuse: error:` line, no traceback.

Most cases run `qfuse.commands.cli.main(argv)` in this process (conftest's `qfuse_here`:
torch's seconds of start-up paid once per worker, not once per case), with the bundled
default model (or a broken copy of it) on the CPU, and check the exit code and the
whole of stderr: the checks run before the model loads, so nothing else may appear
there. A few run `python -m qfuse` as a process of its own (`qfuse`), for what only a
process shows: the exit code through the console script and a fresh interpreter's
stderr, bytes in argv, a peak RSS that is the run's alone. Also the conventions users
bring from mlx-lm and llama.cpp: --model/--prompt, `--prompt -`, --version, defaults
in --help.
"""

import errno
import io
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
    """`python -m qfuse ARGS` in a process of its own."""
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


def test_folder_without_config(tmp_path, qfuse_here):
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert_one_line_error(qfuse_here("generate", str(tmp_path), "def f():"), "no config.json")


def test_broken_config_json_names_the_file(model_copy, qfuse_here):
    m = model_copy()
    (m / "config.json").write_text('{"model_type": "gemma3_text", ')
    assert_one_line_error(qfuse_here("generate", str(m), "def f():"),
                          str(m / "config.json"), "not valid JSON")


def test_config_field_of_the_wrong_kind_names_the_file(model_copy, qfuse_here):
    m = model_copy()
    cfg = json.loads((m / "config.json").read_text())
    (m / "config.json").write_text(json.dumps({**cfg, "num_attention_heads": "six"}))
    assert_one_line_error(qfuse_here("generate", str(m), "def f():"), str(m / "config.json"))


def test_unsupported_model_type_lists_the_supported(model_copy, qfuse_here):
    m = model_copy()
    cfg = json.loads((m / "config.json").read_text())
    (m / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    assert_one_line_error(qfuse_here("generate", str(m), "def f():"),
                          "'gpt2' is not supported", "llama", "qwen3", "gemma3_text")


def test_truncated_shard_names_the_file(model_copy, qfuse_here):
    m = model_copy()
    shard = max(m.glob("*.safetensors"))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    assert_one_line_error(qfuse_here("generate", str(m), "def f():"), str(shard), "truncated")


def test_missing_shard_names_the_file(model_copy, qfuse_here):
    m = model_copy()
    shard = min(m.glob("*.safetensors"))
    shard.unlink()
    assert_one_line_error(qfuse_here("generate", str(m), "def f():"), shard.name, "missing")


def test_missing_tokenizer(model_copy, qfuse_here):
    m = model_copy()
    (m / "tokenizer.json").unlink()
    assert_one_line_error(qfuse_here("generate", str(m), "def f():"), "no tokenizer.json")


def test_chat_refuses_a_broken_folder_too(tmp_path, qfuse_here):
    assert_one_line_error(qfuse_here("chat", str(tmp_path / "nope"), stdin=""), "does not exist")


def test_gate_names_a_missing_folder_not_its_golden_file(tmp_path, qfuse_here):
    msg = assert_one_line_error(qfuse_here("gate", str(tmp_path / "nope")), "does not exist",
                                str(tmp_path / "nope"))
    assert "golden" not in msg
    assert_one_line_error(qfuse_here("gate", str(tmp_path / "nope"), "--make-golden"),
                          "does not exist")
    # --model is the positional's twin, as in generate and chat
    assert_one_line_error(qfuse_here("gate", "--model", str(tmp_path / "nope")), "does not exist",
                          str(tmp_path / "nope"))
    assert_one_line_error(qfuse_here("gate", str(tmp_path), "--model", str(tmp_path / "nope")),
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
def test_bad_flag_values(flags, fragment, qfuse_here):
    assert_one_line_error(qfuse_here("generate", "def f():", *flags), fragment)


def test_prompt_longer_than_the_context(qfuse_here):
    """The default model's context is 1024 tokens; refused before the model loads."""
    prompt = "def f(x):\n    return x\n" * 200
    msg = assert_one_line_error(qfuse_here("generate", prompt), "exceeds the model's context",
                                "--max-kv-size")
    assert re.search(r"prompt \(\d+ tokens\)", msg)


def test_max_kv_size_keeps_the_prompts_end(qfuse_here):
    prompt = "def f(x):\n    return x\n" * 200
    r = qfuse_here("generate", prompt, "--max-kv-size", "256", "--max-tokens", "4")
    assert r.returncode == 0, r.stderr
    assert "the model sees its last 252" in r.stderr
    assert "generated 4 tok" in r.stderr


def test_debug_shows_the_traceback(tmp_path, qfuse_here):
    for args in (["--debug", "generate", str(tmp_path / "nope"), "x"],
                 ["generate", str(tmp_path / "nope"), "x", "--debug"]):
        r = qfuse_here(*args)
        assert r.returncode == 2
        assert "Traceback" in r.stderr and "CheckpointError" in r.stderr
        assert r.stderr.strip().splitlines()[-1].startswith("qfuse: error: ")


def test_lone_existing_path_is_a_missing_prompt(tmp_path, qfuse_here):
    assert_one_line_error(qfuse_here("generate", str(tmp_path)), "no prompt", str(tmp_path))
    assert_one_line_error(qfuse_here("generate"), "no prompt")


def test_model_and_prompt_options(qfuse_here):
    r = qfuse_here("generate", "--model", str(DEFAULT_MODEL), "--prompt", "def add(a, b):",
              "--max-tokens", "3")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("def add(a, b):")
    assert "generated 3 tok" in r.stderr
    assert_one_line_error(qfuse_here("generate", str(DEFAULT_MODEL), "x", "--model",
                                str(DEFAULT_MODEL)), "two models")


def test_prompt_from_standard_input(qfuse_here):
    r = qfuse_here("generate", "--prompt", "-", "--max-tokens", "2", stdin="class Stack:\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("class Stack:\n")


def test_chat_with_model_option_and_system_prompt(qfuse_here):
    r = qfuse_here("chat", "--model", str(DEFAULT_MODEL), "--system-prompt", "Answer in Python.",
              "--max-tokens", "2", stdin="def add(a, b):\n")
    assert r.returncode == 0, r.stderr
    assert "generated 2 tok" in r.stderr and "Traceback" not in r.stderr


def test_version():
    r = qfuse("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"qfuse {__version__}"


def test_help_shows_defaults(qfuse_here):
    out = qfuse_here("generate", "--help").stdout
    assert "(default: 128)" in out and "(default: 64)" in out and "--max-kv-size" in out
    assert "--system-prompt" in qfuse_here("chat", "--help").stdout


@pytest.mark.parametrize("command", ["generate", "chat", "quantize", "train", "gate", "bench"])
def test_every_option_has_help(command, capsys):
    from qfuse.commands.cli import main

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
    """In a process of its own: the peak is that process's, the generate run's alone."""
    r = qfuse("generate", "def f():", "--max-tokens", "2", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    peak = re.search(r"peak (\d+\.\d+) GB host RSS", r.stderr)
    assert peak and float(peak.group(1)) > 0, r.stderr


def test_sweep_belongs_to_the_attention_bench(qfuse_here):
    assert_one_line_error(qfuse_here("bench", "mlp", "--sweep", "s.json"), "--sweep",
                          "bench attention")


# In-process cases: `qfuse.commands.cli.main(argv)` in this interpreter (no start-up per case).
# Where the check must come before the model loads, loading fails the test.


@pytest.fixture
def no_loading(monkeypatch):
    """Loading the weights fails the test: the mistake had to be caught before it."""
    import qfuse.from_flags

    def load_model(*args, **kwargs):
        raise AssertionError("the model loaded before the mistake was reported")

    monkeypatch.setattr(qfuse.from_flags, "load_model", load_model)


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `qfuse ARGV` run in this process."""
    from qfuse.commands.cli import main

    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line_error(err: str, *fragments: str) -> str:
    """``err`` is one `qfuse: error:` line holding each fragment; returns it."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qfuse: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("flags, fragment", [
    (["--temperature", "nan"], "--temperature must be a finite number, got nan"),
    (["--temperature", "inf"], "--temperature must be a finite number, got inf"),
    (["--temperature=-inf"], "--temperature must be a finite number"),
    (["--repetition-penalty", "nan"], "--repetition-penalty must be a finite number"),
    (["--top-p", "nan"], "--top-p must be a finite number"),
    (["--min-p", "inf"], "--min-p must be a finite number"),
    (["--seed", str(2**63)], "--seed must be an integer in [-2**63, 2**63)"),
    (["--seed", str(-2**63 - 1)], "--seed must be an integer in [-2**63, 2**63)"),
])
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_non_finite_sampling_values_and_seeds_past_int64(command, flags, fragment, capsys,
                                                          no_loading, monkeypatch):
    """Today's garbage (NaN or inf sampling: a multinomial traceback or random text) and
    int64 overflow tracebacks are one line, before the model loads."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("def f():\n"))
    argv = [command, *(["def f():"] if command == "generate" else []), *flags]
    code, out, err = cli(capsys, *argv)
    assert code == 2 and out == ""
    one_line_error(err, fragment)


def test_prompt_bytes_that_are_not_utf8_in_argv():
    """Raw bytes in argv (Python hands them over as lone surrogates): one line naming the
    byte, before anything loads."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "qfuse", "generate", b"caf\xe9 = 1"],
                       capture_output=True, env=env, timeout=300, check=False)
    err = r.stderr.decode()
    assert r.returncode == 2 and "Traceback" not in err, err
    one_line_error(err, "the prompt is not valid UTF-8", "byte 0xe9 at character 3")


def test_prompt_on_stdin_that_is_not_utf8(capsys, no_loading, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"x = 1\ncaf\xe9\n")))
    code, _, err = cli(capsys, "generate", "--prompt", "-")
    assert code == 2
    one_line_error(err, "standard input is not valid UTF-8", "byte 0xe9 at offset 9")


def test_system_prompt_that_is_not_utf8(capsys, no_loading, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
    code, _, err = cli(capsys, "chat", "--system-prompt", "caf\udce9")
    assert code == 2
    one_line_error(err, "--system-prompt is not valid UTF-8 (byte 0xe9 at character 3)")


def test_empty_prompt_says_it_is_empty(capsys, no_loading, monkeypatch):
    """`qfuse generate ""` was taken for the folder "." ("no prompt:  is a path")."""
    code, _, err = cli(capsys, "generate", "")
    assert code == 2
    msg = one_line_error(err, "the prompt is empty")
    assert "path" not in msg
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"")))
    code, _, err = cli(capsys, "generate", "--prompt", "-")
    assert code == 2
    one_line_error(err, "standard input is empty")


def test_chat_goes_on_after_a_line_that_is_not_utf8(capsys, monkeypatch):
    """The bad line gets one error line and is not sent; the next one is answered."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(
        b"caf\xe9\ndef add(a, b):\n")))
    code, out, err = cli(capsys, "chat", "--max-tokens", "2")
    assert code == 0, err
    lines = err.strip().splitlines()
    errors = [line for line in lines if line.startswith("qfuse: error:")]
    assert errors == [("qfuse: error: the message is not valid UTF-8 (byte 0xe9 at character "
                       "3); it was not sent, type it again")], err
    assert len([line for line in lines if "generated 2 tok" in line]) == 1, err
    assert out.count("> ") == 3  # the bad line, the answered one, then end of input


def test_chat_max_tokens_over_the_context_is_refused_before_loading(capsys, no_loading,
                                                                    monkeypatch):
    """The default model has 1024 positions: every turn would fail; refused up front,
    with the most that fits."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
    code, out, err = cli(capsys, "chat", "--max-tokens", "2000")
    assert code == 2 and out == ""
    msg = one_line_error(err, "--max-tokens 2000 leaves no room for a message",
                         "context of 1024 tokens")
    most = int(re.search(r"--max-tokens (\d+) at most", msg).group(1))
    # ...and that figure is right: it passes the check (then loads: stop it there).
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    code, _, err = cli(capsys, "chat", "--max-tokens", str(most + 1))
    assert code == 2 and "leaves no room" in err
    with pytest.raises(AssertionError, match="the model loaded"):
        cli(capsys, "chat", "--max-tokens", str(most))


def test_chat_max_kv_size_notes_the_turns_it_drops(capsys, monkeypatch):
    """As `generate` notes the prompt's start it drops, chat notes the turns it drops."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(
        "def add(a, b):\ndef sub(a, b):\ndef mul(a, b):\n"))
    code, _, err = cli(capsys, "chat", "--max-tokens", "20", "--max-kv-size", "40")
    assert code == 0, err
    notes = [line for line in err.splitlines() if line.startswith("qfuse: note:")]
    assert notes, err
    assert all("dropped the oldest turn of the conversation to fit --max-kv-size 40 with "
               "--max-tokens 20" in n for n in notes), notes
    assert len([line for line in err.splitlines() if "generated" in line]) == 3
    # One message longer than the cache: its start is cut, and the note says so.
    monkeypatch.setattr(sys, "stdin", io.StringIO("x = 1; " * 30 + "\n"))
    code, _, err = cli(capsys, "chat", "--max-tokens", "4", "--max-kv-size", "40")
    assert code == 0, err
    assert re.search(r"qfuse: note: the message makes a prompt of \d+ tokens; the model sees "
                     r"its last 36 \(--max-kv-size 40 with --max-tokens 4\)", err), err


def test_symbolic_link_loops_and_dangling_links_say_so(tmp_path, capsys, no_loading):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    (tmp_path / "gone").symlink_to(tmp_path / "nothing")
    for model, fragment in [
            (tmp_path / "a", f"model folder {tmp_path / 'a'} is a symbolic link loop"),
            (tmp_path / "a" / "m", "runs into a symbolic link loop"),
            (tmp_path / "gone", (f"is a symbolic link to {tmp_path / 'nothing'}, which "
                                 "does not exist"))]:
        code, _, err = cli(capsys, "generate", "--model", str(model), "--prompt", "x")
        assert code == 2
        one_line_error(err, fragment)


def test_an_unreadable_shard_is_permission_denied(model_copy, capsys, monkeypatch,
                                                  no_loading):
    """safetensors reports any file it cannot open as "No such file or directory" (it
    does so for a file of mode 000); the file's own error is what the user sees, with
    the code of an error of the environment. Run as root, which reads any file, the
    refusal is simulated where qfuse meets it: safetensors, then the OS."""
    import qfuse.loading

    m = model_copy()
    shard = max(m.glob("*.safetensors"))
    real_safe_open, real_open = qfuse.loading.safe_open, open

    def safe_open(file, framework):
        if Path(file) == shard:
            raise FileNotFoundError(f"No such file or directory: {file}")
        return real_safe_open(file, framework=framework)

    def refusing_open(file, *args, **kwargs):
        if Path(file) == shard:
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(qfuse.loading, "safe_open", safe_open)
    monkeypatch.setattr(qfuse.loading, "open", refusing_open, raising=False)
    code, _, err = cli(capsys, "generate", str(m), "x")
    assert code == 1
    msg = one_line_error(err, str(shard), "Permission denied")
    assert "No such file" not in msg


def test_exit_codes_one_per_kind_of_error():
    """README's table: 2 for the request's mistake (a path naming nothing included,
    whichever check meets it), 1 for the environment's."""
    from qfuse.errors import UserError, exit_code

    assert exit_code(UserError("x")) == 2
    for code in (errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ELOOP):
        assert exit_code(OSError(code, os.strerror(code), "f")) == 2
    for code in (errno.EACCES, errno.ENOSPC, errno.EIO, errno.EROFS):
        assert exit_code(OSError(code, os.strerror(code), "f")) == 1
    assert exit_code(MemoryError()) == 1


def test_stats_line_rates(capsys):
    """One token came out of prefill: no decode step to time, so "-" and not thousands
    of tokens/s; a prompt whose prefill compiled kernels says so."""
    from qfuse.chat import report
    from qfuse.runtime.generation import Summary

    report(Summary(prompt_tokens=3, generation_tokens=1, prompt_tps=150.0,
                   generation_tps=None, peak_memory_gb=0.5, finish_reasons=["length"],
                   peak_memory_kind="host"))
    line = capsys.readouterr().err
    assert "prompt 3 tok, 150.0 tok/s | generated 1 tok, - tok/s |" in line
    assert "compiling" not in line
    report(Summary(prompt_tokens=3, generation_tokens=9, prompt_tps=20.0,
                   generation_tps=50.0, peak_memory_gb=0.5, finish_reasons=["length"],
                   prompt_compiled=True))
    assert "prompt 3 tok, 20.0 tok/s incl. compiling kernels | generated 9 tok, 50.0 tok/s" \
        in capsys.readouterr().err


def test_one_token_generation_prints_no_rate(capsys):
    code, _, err = cli(capsys, "generate", "def f():", "--max-tokens", "1")
    assert code == 0, err
    assert re.search(r"generated 1 tok, - tok/s", err), err
    code, _, err = cli(capsys, "generate", "def f():", "--max-tokens", "3")
    assert code == 0, err
    assert re.search(r"generated 3 tok, \d+\.\d tok/s", err), err


def test_chat_ends_at_an_empty_line_of_piped_input():
    """`printf 'def add(a,b):\\n\\n' | qfuse chat`: the empty line ends the chat with exit
    0, as in a terminal (standard input used to be reconfigured after its first read,
    which Python refuses once a pipe's text is read ahead)."""
    r = qfuse("chat", "--max-tokens", "4", stdin="def add(a,b):\n\nnever read\n")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "qfuse: error" not in r.stderr, r.stderr
    assert len([line for line in r.stderr.splitlines() if "generated 4 tok" in line]) == 1
    assert r.stdout.count("> ") == 2  # the message, then the empty line that ended it


def test_chat_ends_at_an_empty_line_in_process_too(capsys, monkeypatch):
    """The same through `main`: a text stream over bytes reads ahead as a pipe does."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"def add(a,b):\n\nx\n")))
    code, out, err = cli(capsys, "chat", "--max-tokens", "2")
    assert code == 0, err
    assert out.count("> ") == 2 and "generated 2 tok" in err


def test_capital_v_is_version(qfuse_here):
    r = qfuse_here("-V")
    assert r.returncode == 0 and r.stdout.strip() == f"qfuse {__version__}", r.stderr


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_help_lists_the_tensor_parallel_flags_last(command, qfuse_here):
    """--tp, --tp-allreduce and --tp-timeout matter only on several GPUs: they come in a
    group of their own after every common flag (--model and --max-tokens first)."""
    out = qfuse_here(command, "--help").stdout
    flags = re.findall(r"^  (--[a-z-]+)", out, re.MULTILINE)
    tp = [f for f in flags if f.startswith("--tp")]
    assert tp == ["--tp", "--tp-allreduce", "--tp-timeout"]
    assert flags[-3:] == tp, flags
    assert "tensor parallel (several GPUs, under torchrun):" in out
    if command == "generate":
        assert flags.index("--model") < flags.index("--max-tokens") < flags.index("--tp")
