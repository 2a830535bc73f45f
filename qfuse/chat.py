"""`qfuse generate` and `qfuse chat`: check the request, load a checkpoint, stream tokens.

Whatever can be checked without the weights (flag values, the model folder, the
prompt's length against the context) is checked before the model loads, so a
mistake costs no loading time. Ctrl-C while tokens stream ends the stream, not
the program: `generate` prints the stats line of what it generated and exits
130, `chat` ends the reply and asks for the next message. The stats line goes to
stderr; stdout carries only the text.
"""

from __future__ import annotations

import signal
import sys
import threading

from .errors import RequestError, UserError, utf8_problem
from .from_flags import check_args, check_room, load_model_from_flags, prompt_kept, sampling_params
from .loading import (
    PLAIN_STOP,
    check_checkpoint,
    load_chat_template,
    load_tokenizer,
    render_chat,
    render_plain,
    special_tokens,
)
from .runtime.cache import check_cache_flags
from .runtime.generation import Summary, generate
from .runtime.prompts import encode_prompts, fit_prompt


def _prepare(args):
    """(config, tokenizer) of args.model, both checked; nothing heavy is loaded."""
    config = check_checkpoint(args.model)
    check_cache_flags(config, args.kv_bits, args.kv_group_size, args.max_kv_size)
    return config, load_tokenizer(args.model)


class _CtrlC:
    """While a reply streams, the first Ctrl-C only raises a flag that generate()
    polls once per token, so the reply ends cleanly with its stats; a second one
    raises KeyboardInterrupt as usual. Called, it says whether Ctrl-C was pressed."""

    def __enter__(self):
        self.pressed = False
        self.previous = None
        # Python lets only the main thread set signal handlers (not so in-process callers).
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        self.pressed = True
        signal.signal(signal.SIGINT, self.previous)

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)

    def __call__(self) -> bool:
        return self.pressed


def _stream(model, tokenizer, prompt: str, args, add_special_tokens: bool = True) -> Summary:
    with _CtrlC() as ctrl_c:
        return print_stream(generate(
            model, tokenizer, [prompt], args.max_tokens, sampling_params(args), args.stop,
            args.kv_bits, args.kv_group_size, cuda_graph=args.cuda_graph,
            add_special_tokens=add_special_tokens, max_kv_size=args.max_kv_size,
            should_stop=ctrl_c))


def print_stream(events) -> Summary | None:
    """Write one sequence's text to stdout as `generate` yields it, end the line, and
    return the Summary."""
    summary = None
    for event in events:
        if isinstance(event, Summary):
            summary = event
        else:
            sys.stdout.write(event.texts[0])
            sys.stdout.flush()
    print()
    return summary


def report(s: Summary, label: str = "", where: str = "") -> None:
    """The stats line, on stderr: ``label`` leads it (e.g. "tp 2 | "), ``where``
    qualifies the memory (e.g. " (rank 0)")."""
    memory = "GPU" if s.peak_memory_kind == "gpu" else "host RSS"
    # The model's one-time warm-up is never in the prompt's rate; compiling is, once.
    compiled = " incl. compiling kernels" if s.prompt_compiled else ""
    # One token came out of prefill alone: no decode step to time ("-", not 6000 tok/s).
    rate = "-" if s.generation_tps is None else f"{s.generation_tps:.1f}"
    print(f"[{label}prompt {s.prompt_tokens} tok, {s.prompt_tps:.1f} tok/s{compiled} | "
          f"generated {s.generation_tokens} tok, {rate} tok/s | peak "
          f"{s.peak_memory_gb:.2f} GB {memory}{where} | finish: {s.finish_reasons[0]}]",
          file=sys.stderr)


def run_generate(args) -> int:
    """0, or 130 when Ctrl-C cut the generation short (after its stats line)."""
    check_args(args)
    config, tokenizer = _prepare(args)
    prompt_kept(config, encode_prompts(tokenizer, [args.prompt])[0], args)
    model = load_model_from_flags(args)
    sys.stdout.write(args.prompt)
    summary = _stream(model, tokenizer, args.prompt, args)
    report(summary)
    return 130 if summary.finish_reasons[0] == "interrupted" else 0


def run_chat(args) -> int:
    """The checkpoint's chat template when it has one, else plain User:/Assistant: turns.

    Ctrl-C during a reply ends the reply (kept in the conversation as far as it
    got); at the prompt, Ctrl-C, Ctrl-D or an empty line ends the chat (exit 0)."""
    check_args(args)
    problem = utf8_problem(args.system_prompt or "")
    if problem is not None:
        raise UserError(f"--system-prompt {problem}")
    config, tokenizer = _prepare(args)
    template = load_chat_template(args.model)
    special = special_tokens(args.model)
    messages: list[dict] = []
    if args.system_prompt:
        messages.append({"role": "system", "content": args.system_prompt})
    if not template:
        args.stop = list(dict.fromkeys([*args.stop, PLAIN_STOP]))
    # The shortest first turn: a template that refuses a system message says so now, and
    # a --max-tokens that leaves no room for it in the context, not after loading.
    first = [*messages, {"role": "user", "content": "?"}]
    prompt = render_chat(template, first, special) if template else render_plain(first)
    check_room(config, encode_prompts(tokenizer, [prompt], add_special_tokens=not template)[0],
               args, "a message" + (" after the system prompt" if args.system_prompt else ""))
    model = load_model_from_flags(args)
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401 -- line editing and history for input()
        except ImportError:  # Windows
            pass
    print("qfuse chat: Ctrl-C stops a reply; Ctrl-D or an empty line quits", file=sys.stderr)
    _read_undecodable_bytes_as_surrogates()
    # Outside a streaming reply Ctrl-C ends the chat, wherever it lands (at the
    # prompt, or just as a reply ended): the same exit every time.
    try:
        while True:
            try:
                line = input("> ")
            except EOFError:
                print()  # Ctrl-D: leave the shell's prompt on a line of its own
                return 0
            except UnicodeDecodeError as e:  # a stream read before the chat: still strict
                raise UserError(f"standard input is not valid UTF-8 ({e.reason})") from None
            if not line.strip():
                return 0
            problem = utf8_problem(line)
            if problem is not None:
                print(f"qfuse: error: the message {problem}; it was not sent, type it again",
                      file=sys.stderr)
                continue
            messages.append({"role": "user", "content": line})
            prompt = _render(template, messages, special, tokenizer, config, args)
            if prompt is None:
                messages.pop()
                continue
            # A rendered template carries its own BOS: don't let the tokenizer add another.
            summary = _stream(model, tokenizer, prompt, args, add_special_tokens=not template)
            messages.append({"role": "assistant", "content": summary.outputs[0].strip()})
            report(summary)
    except KeyboardInterrupt:
        print()
        return 0


def _read_undecodable_bytes_as_surrogates() -> None:
    """Make standard input hand bytes that are not UTF-8 over as lone surrogates (as
    argv does), so such a line is refused alone instead of ending the chat with a
    decoding error. Python allows this only before the stream's first read, so it is
    done once, before any, and never undone: a pipe read ahead past the empty line
    that ends the chat could not be set back. A stream read before keeps its errors."""
    if getattr(sys.stdin, "errors", None) in (None, "surrogateescape") or \
            not hasattr(sys.stdin, "reconfigure"):
        return
    try:
        sys.stdin.reconfigure(errors="surrogateescape")
    except ValueError:  # already read from: see the UnicodeDecodeError in run_chat
        pass


def _render(template, messages: list[dict], special: dict, tokenizer, config, args) -> str | None:
    """The conversation as one prompt that fits the context, or None (after a one-line
    error) when it cannot. With --max-kv-size the oldest turns go first (the system
    message stays), then the oldest tokens; a note on stderr says what was dropped, as
    `qfuse generate` says what it cut."""
    dropped = 0
    limits = f"--max-kv-size {args.max_kv_size} with --max-tokens {args.max_tokens}"
    while True:
        if template:
            prompt = render_chat(template, messages, special)
        else:
            prompt = render_plain(messages)
        ids = encode_prompts(tokenizer, [prompt], add_special_tokens=not template)[0]
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        try:
            fit_prompt(ids, args.max_tokens, args.max_kv_size or config.max_position_embeddings)
            break
        except RequestError as e:
            if args.max_kv_size is None:
                print(f"qfuse: error: the conversation no longer fits: {e}; start a new chat, "
                      "lower --max-tokens, or pass --max-kv-size N to drop the oldest turns",
                      file=sys.stderr)
                return None
            if len(users) <= 1:
                # generate() keeps the last tokens of this one message.
                kept = len(fit_prompt(ids, args.max_tokens, config.max_position_embeddings,
                                      args.max_kv_size, config.bos_token_id))
                print(f"qfuse: note: the message makes a prompt of {len(ids)} tokens; the model "
                      f"sees its last {kept} ({limits})", file=sys.stderr)
                break
            del messages[users[0]: users[1]]  # the oldest question and its answer
            dropped += 1
    if dropped:
        turns = "turn" if dropped == 1 else f"{dropped} turns"
        print(f"qfuse: note: dropped the oldest {turns} of the conversation to fit "
              f"{limits}; the model no longer sees {'it' if dropped == 1 else 'them'}",
              file=sys.stderr)
    return prompt
