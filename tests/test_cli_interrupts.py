"""Ctrl-C and Ctrl-D at the command line: clean exits, stats kept, no traceback.

`python -m qfuse` runs in the background with the bundled default model on the
CPU; SIGINT is sent once its output shows it is streaming. Nothing waits a fixed
time: every step polls the collected output until what it waits for appears
(or a generous deadline fails the test with the output so far). The chosen
prompts run greedily to --max-tokens, so a stream is still going when the
signal arrives.
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEADLINE_S = 300  # far above the ~5 s each wait takes on an idle 2-core machine

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


class Qfuse:
    """`python -m qfuse ARGS` running, with threads collecting its stdout and stderr."""

    def __init__(self, *args: str):
        env = dict(os.environ, PYTHONPATH=str(REPO),
                   OMP_NUM_THREADS="1")  # see test_cli_errors: contended cores
        self.proc = subprocess.Popen([sys.executable, "-m", "qfuse", *args], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)
        self._out, self._err = bytearray(), bytearray()
        self._readers = [threading.Thread(target=self._collect, args=(pipe, buf), daemon=True)
                         for pipe, buf in ((self.proc.stdout, self._out),
                                           (self.proc.stderr, self._err))]
        for t in self._readers:
            t.start()

    @staticmethod
    def _collect(pipe, buf: bytearray) -> None:
        while chunk := os.read(pipe.fileno(), 4096):
            buf.extend(chunk)

    @property
    def out(self) -> str:
        return bytes(self._out).decode(errors="replace")

    @property
    def err(self) -> str:
        return bytes(self._err).decode(errors="replace")

    def wait_for(self, what: str, condition) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while not condition():
            if self.proc.poll() is not None and not condition():
                time.sleep(0.2)  # let the readers drain the pipes, then look once more
                if condition():
                    return
                pytest.fail(f"qfuse exited ({self.proc.returncode}) before {what}:\n"
                            f"stdout: {self.out[-2000:]!r}\nstderr: {self.err[-2000:]!r}")
            if time.monotonic() > deadline:
                self.proc.kill()
                pytest.fail(f"no {what} after {DEADLINE_S} s:\nstdout: {self.out[-2000:]!r}\n"
                            f"stderr: {self.err[-2000:]!r}")
            time.sleep(0.02)

    def send(self, line: str) -> None:
        self.proc.stdin.write(line.encode())
        self.proc.stdin.flush()

    def interrupt(self) -> None:
        self.proc.send_signal(signal.SIGINT)

    def finish(self) -> int:
        """Close stdin (Ctrl-D) and return the exit code once the output is collected."""
        if not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:  # it had exited already
                pass
        code = self.proc.wait(timeout=DEADLINE_S)
        for t in self._readers:
            t.join(timeout=DEADLINE_S)
        return code


def _stats(err: str) -> list[tuple[int, str]]:
    """(generated tokens, finish reason) of each stats line."""
    return [(int(n), reason) for n, reason in
            re.findall(r"generated (\d+) tok, .* \| finish: (\w+)\]", err)]


def test_ctrl_c_during_generate_exits_130_after_the_stats_line():
    prompt = "def fibonacci(n):"
    q = Qfuse("generate", prompt, "--max-tokens", "1000")
    q.wait_for("generated text", lambda: len(q.out) > len(prompt) + 10)
    q.interrupt()
    assert q.finish() == 130
    assert "Traceback" not in q.err, q.err
    [(generated, reason)] = _stats(q.err)
    assert reason == "interrupted" and 1 <= generated < 1000, q.err
    assert q.out.startswith(prompt) and q.out.endswith("\n")


def test_ctrl_c_in_chat_ends_the_reply_and_the_chat_goes_on():
    q = Qfuse("chat", "--max-tokens", "900")
    q.wait_for("the first prompt", lambda: q.out.endswith("> "))
    q.send("def fibonacci(n):\n")
    q.wait_for("a streaming reply", lambda: len(q.out) > len("> ") + 10)
    q.interrupt()
    q.wait_for("the reply's stats and a new prompt",
               lambda: len(_stats(q.err)) == 1 and q.out.endswith("\n> "))
    [(generated, reason)] = _stats(q.err)
    assert reason == "interrupted" and generated < 900, q.err
    # The chat goes on: a second message gets a reply (stopped too, unless it ends first).
    shown = len(q.out)
    q.send("class Stack:\n")
    q.wait_for("a second reply", lambda: len(q.out) > shown + 10 or len(_stats(q.err)) == 2)
    q.interrupt()
    q.wait_for("the second reply's stats", lambda: len(_stats(q.err)) == 2)
    assert q.finish() == 0
    assert "Traceback" not in q.err, q.err


def test_ctrl_d_in_chat_exits_0_and_leaves_a_newline():
    q = Qfuse("chat")
    q.wait_for("the prompt", lambda: q.out.endswith("> "))
    assert q.finish() == 0
    assert q.out.endswith("> \n")
    assert "Traceback" not in q.err, q.err


def test_ctrl_c_at_the_chat_prompt_exits_cleanly():
    q = Qfuse("chat")
    q.wait_for("the prompt", lambda: q.out.endswith("> "))
    q.interrupt()
    assert q.finish() == 0
    assert q.out.endswith("> \n")
    assert "Traceback" not in q.err, q.err
