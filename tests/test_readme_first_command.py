"""The README's first command shows the bundled model as it should be seen: its
continuation does not repeat one line over and over (which a newcomer takes for a bug).
The command is the one between the README's quick-start markers, run as written after
`pip install . &&` (through `qfuse.commands.cli.main` in this process). The same prompt decoded
greedily does loop, which is why the README samples with a light repetition penalty;
that run shows the measure can fail."""

import collections
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_first_command() -> list[str]:
    """The quick-start block's `qfuse ...` arguments, its line continuations joined."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- quick-start -->\s*```\n(.*?)```\s*<!-- /quick-start -->", text,
                      re.S)
    assert block, "README.md has no quick-start block"
    command = block.group(1).replace("\\\n", " ")
    assert command.startswith("pip install . && qfuse "), command
    return shlex.split(command.removeprefix("pip install . && qfuse "))


def most_repeated_line(text: str) -> int:
    """How often the most frequent non-blank line occurs."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return max(collections.Counter(lines).values(), default=0)


def test_the_readme_first_command_does_not_loop(qfuse_here):
    args = readme_first_command()
    assert args[0] == "generate" and "--repetition-penalty" in args
    run = qfuse_here(*args)
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    assert "finish: length" in run.stderr  # it said its whole say: 128 tokens
    assert most_repeated_line(run.stdout) <= 2, run.stdout


def test_greedy_decoding_of_the_same_prompt_loops(qfuse_here):
    prompt = readme_first_command()[1]
    run = qfuse_here("generate", prompt, "--max-tokens", "96")
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    assert most_repeated_line(run.stdout) >= 3, run.stdout
