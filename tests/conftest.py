"""Test setup: without CUDA, Triton kernels run under the CPU interpreter, and tests
marked `gpu` (`@pytest.mark.gpu`, or a `pytest.param(..., marks=pytest.mark.gpu)`)
are skipped; `pytest -m gpu` runs those alone. `start_server` starts live
`qfuse serve` processes on loopback for the serving and chat-page tests; `qfuse_here`
runs a `qfuse` command line in the test's own process. `tiny_loaded` is the small trained
test model (`TINY_MODEL`, tests/assets/tiny: the bundled model's tokenizer, 2 layers) for
tests of the engine's and server's logic, which decode many tokens and need not the
bundled model's quality.

TRITON_INTERPRET is read when a kernel is decorated, so it must be set before
any qfuse.kernels module is imported: here, at collection start.
"""

import http.client
import io
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")



def _interpreter_patches_triton_language_once_per_launch():
    """Triton's interpreter patches `triton.language` for the interpreter at each kernel
    launch and again at every call of a jitted helper inside it (each helper call of each
    program: about half the time of an interpreted attention kernel), though the launch's
    patches are already in place until it ends. A helper whose language modules are
    already patched runs as it is; the first patch of a launch, and its restore, stay."""
    import inspect

    from triton.language import core
    from triton.runtime import interpreter

    original_call = interpreter.InterpretedFunction.__call__
    langs_of: dict = {}

    def patched(lang) -> bool:
        return not core.is_builtin(getattr(lang, "load", None))

    def call(self, *args, **kwargs):
        langs = langs_of.get(self.fn)
        if langs is None:
            langs = langs_of[self.fn] = [v for v in self.fn.__globals__.values()
                                         if inspect.ismodule(v) and v in (interpreter.tl, core)]
        if not langs or not all(patched(lang) for lang in langs):
            return original_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter.InterpretedFunction.__call__ = call


def _interpreter_skips_overflow_checks_it_cannot_report():
    """Triton's interpreter checks every integer add, sub and mul for overflow (a cast of
    both sides to int64, the op again, two comparisons, an and: ~10 interpreted ops) and
    hands the verdict to `device_assert`, which drops it unless the builder's `debug`
    option is on, and it is off. The check is skipped where it can report nothing: the
    same results, a quarter less interpreted work in the product kernels' tests."""
    import dataclasses

    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    # only where this Triton has both options as described (other releases: as they are)
    if getattr(options, "sanitize_overflow", False) and getattr(options, "debug", True) is False:
        builder.options = dataclasses.replace(options, sanitize_overflow=False)


if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        _interpreter_patches_triton_language_once_per_launch()
        _interpreter_skips_overflow_checks_it_cannot_report()
    except ImportError:  # no Triton: its kernels' tests skip
        pass

# Under pytest-xdist each worker gets its share of the cores for torch's threads (and
# so do the processes its tests start): two workers with two OpenMP threads each on two
# cores spin against each other, and the same tests took three times as long.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _WORKERS > 1:
    _THREADS = str(max(1, (os.cpu_count() or 1) // _WORKERS))
    os.environ.setdefault("OMP_NUM_THREADS", _THREADS)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_levers(monkeypatch):
    """Each test starts with clean counters and no tier/kernel variables set; a test that
    sets one after its model has run a step calls `levers.reload()` so the model's plans
    are made anew."""
    from qfuse import levers

    for name in list(os.environ):
        if name.startswith("QFUSE_"):
            monkeypatch.delenv(name)
    levers.reset_counters()
    levers.reload()  # plans made in an earlier test do not carry its variables over
    yield
    levers.reload()


@pytest.fixture
def qfuse_here(capfd, monkeypatch):
    """qfuse_here(*args, stdin=None) -> CompletedProcess: `qfuse ARGS` (paths become
    strings) as `qfuse` runs it, but through `qfuse.commands.cli.main` in this process.
    Standard input is ``stdin`` (empty when None, as a test worker's /dev/null); stdout
    and stderr are captured at the file descriptors; what a process of its own would
    also print on stderr is added to it: warnings under Python's default filters and
    qfuse's logged warnings (pytest would otherwise collect both out of sight)."""
    from qfuse.commands.cli import main

    def run(*args, stdin: str | None = None) -> subprocess.CompletedProcess:
        argv = [str(a) for a in args]  # paths too
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(
            io.BytesIO((stdin or "").encode()), encoding="utf-8"))
        capfd.readouterr()
        log = logging.getLogger("qfuse")
        handler = logging.StreamHandler(sys.stderr)  # what logging's last resort does
        handler.setLevel(logging.WARNING)
        log.addHandler(handler)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.resetwarnings()
                warnings.simplefilter("default")
                for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning,
                                 ResourceWarning):  # hidden outside __main__ by default
                    warnings.simplefilter("ignore", category)
                try:
                    code = main(argv)
                except SystemExit as e:  # argparse's --help and --version
                    code = e.code if isinstance(e.code, int) else int(e.code is not None)
        finally:
            log.removeHandler(handler)
        out = capfd.readouterr()
        err = out.err + "".join(warnings.formatwarning(w.message, w.category, w.filename,
                                                       w.lineno, w.line) for w in caught)
        return subprocess.CompletedProcess(["qfuse", *argv], code, out.out, err)

    return run


# The tiny checkpoint's vocabulary and the text its tokenizer is trained on.
VOCAB = 300
TEXT = ["def add(a, b):\n    return a + b\n", "import os\nprint(os.getcwd())\n"] * 20


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """A tiny random Llama (float32) with a BPE tokenizer trained on two snippets."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=32,
                                   max_position_embeddings=96, eos_token_id=0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    path = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(path, safe_serialization=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path / "tokenizer.json"))
    return path


def _tiny_model_folder() -> Path:
    """A model folder of the tiny test model: its weights and config (tests/assets/tiny)
    beside the bundled model's tokenizer, which it was trained with, linked into a
    folder of this process's own (removed at exit) rather than kept twice in the tree."""
    import atexit
    import shutil

    from qfuse.loading import DEFAULT_MODEL

    folder = Path(tempfile.mkdtemp(prefix="qfuse-tiny-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    stored = Path(__file__).parent / "assets" / "tiny"
    for source in (stored / "config.json", stored / "model.safetensors",
                   DEFAULT_MODEL / "tokenizer.json"):
        (folder / source.name).symlink_to(source.resolve())
    return folder


# Trained by `qfuse train` with the bundled model's tokenizer (tests/assets/tiny/README.md):
# sensible enough text for stop strings, penalties and sampling, ~4x faster to decode.
TINY_MODEL = _tiny_model_folder()


@pytest.fixture(scope="session")
def tiny_loaded():
    """(model, tokenizer) of TINY_MODEL, loaded once for the session."""
    import qfuse

    return qfuse.load(TINY_MODEL, progress=False)


@pytest.fixture(scope="session")
def gemma_checkpoint(tmp_path_factory):
    """A tiny random Gemma 3 text model (float32, seed 0, sliding window 16) saved as
    safetensors, for the GPU cases."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64,
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        sliding_window=16, max_position_embeddings=256)
    path = tmp_path_factory.mktemp("gemma")
    transformers.AutoModelForCausalLM.from_config(cfg).float().save_pretrained(
        path, safe_serialization=True)
    return path


def _answers_health(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    finally:
        conn.close()


# A hang guard only: a server starts in seconds, but on a loaded 2-core machine (parallel
# workers, each starting servers) the import of torch and the model's load can take long.
START_S = 300


@pytest.fixture(scope="module")
def start_server():
    """start(*flags) -> port: `qfuse serve` with the bundled model and these flags on a
    free loopback port, answering /health; every one started is stopped after the module."""
    procs = []

    def start(*flags: str) -> int:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # A file, not a pipe: a pipe nobody reads fills at ~64 KB and blocks the server.
        log = tempfile.TemporaryFile()  # noqa: SIM115 -- closed at teardown, with the server
        # --port 0: the server binds a free port and names it in its start line. A port
        # picked here and freed before the server binds it could be taken meanwhile (by a
        # parallel worker's server, or as some connection's ephemeral port).
        proc = subprocess.Popen([sys.executable, "-m", "qfuse", "serve", "--port", "0",
                                 *flags], stdout=log, stderr=subprocess.STDOUT, env=env)
        procs.append((proc, log))
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            exited = proc.poll() is not None
            # pread: the server writes through the same file offset, which a read would move
            text = os.pread(log.fileno(), 1 << 20, 0).decode(errors="replace")
            if exited:
                pytest.fail(f"qfuse serve exited: {text}")
            started = re.search(r"qfuse serve: .* at http://127\.0\.0\.1:(\d+)/v1", text)
            try:
                if started and _answers_health(int(started[1])):
                    return int(started[1])
            except OSError:
                pass
            time.sleep(0.1)
        pytest.fail(f"qfuse serve did not answer /health within {START_S} s")

    yield start
    for proc, log in procs:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
