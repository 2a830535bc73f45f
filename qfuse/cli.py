"""The `qfuse` command line: generate, chat, serve, quantize, train, gate, info,
bench.

Each subcommand is a thin wrapper; the work lives in the modules it names. A
mistake the user can fix is one line on stderr, `qfuse: error: ...`, never a
traceback (`qfuse --debug ...` shows it); Ctrl-C exits 130 without one.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import os
import platform
import sys
import threading
import traceback
from pathlib import Path

import torch

from . import __version__, levers
from .errors import UserError


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def info_lines() -> list[str]:
    """What `qfuse info` prints: versions, device, and each kernel's status per device."""
    lines = [f"qfuse {__version__}", f"python {platform.python_version()}"]
    for dist in ("torch", "triton", "safetensors", "tokenizers", "numpy"):
        lines.append(f"{dist} {_version(dist)}")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    name = torch.cuda.get_device_name() if cuda else "none (CPU only)"
    lines += [f"GPU: {name}", f"device used by default: {device}"]
    lines.append(f"tier on {device}: {levers.tier(device).name.lower()}"
                 f" (QFUSE_TIER={os.environ.get('QFUSE_TIER', 'unset')})")
    lines.append("")
    header = f"{'kernel':<18}{'min tier':<10}{'switch':<28}{'on ' + device.type:<10}summary"
    lines.append(header)
    lines.append("-" * len(header))
    for k in levers.KERNELS.values():
        lines.append(
            f"{k.name:<18}{k.min_tier.name.lower():<10}"
            f"{k.env_var + ('=1' if levers.kernel_enabled(k.name) else '=0'):<28}"
            f"{_would_run(k.name, device):<10}{k.summary}"
        )
    return lines


def _would_run(name: str, device: torch.device) -> str:
    """'kernel' or 'reference': what a supported call on ``device`` would use now."""
    from .ops import use_kernel

    return "kernel" if use_kernel(name, device) else "reference"


class _Parser(argparse.ArgumentParser):
    """argparse whose complaints are UserErrors, so they print as the one-line
    `qfuse: error: ...` that every other mistake prints (still exit 2)."""

    def error(self, message: str):
        raise UserError(f"{message} (see `{self.prog} --help`)")


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default in its help, unless the help already says it or there is
    none to say (an unset value, an off switch)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False \
                or action.default == []:
            return text
        return super()._get_help_string(action)


def main(argv: list[str] | None = None) -> int:
    """Run `qfuse ARGV`; return the exit code.

    0 on success; 2 for a mistake in the request (argparse's code for a bad
    command line), 1 for an environment error (a file system or out-of-memory
    error), each printed as one line; 130 (128 + SIGINT) after Ctrl-C."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # Read before parsing, so that even an error while parsing can be traced.
    debug = "--debug" in (argv[: argv.index("--")] if "--" in argv else argv)
    try:
        return _main(argv)
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        print(file=sys.stderr)  # the terminal's ^C left the cursor mid-line
        return 130
    except BrokenPipeError:
        # `qfuse generate ... | head`: the reader left; that is not an error.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the exit-time flush does not fail again
        return 0
    except (UserError, OSError, torch.OutOfMemoryError) as e:
        if debug:
            traceback.print_exc()
        rank = _follower_rank()
        if rank is None:
            print(f"qfuse: error: {_message(e)}", file=sys.stderr)
        elif _own_error(e):
            print(f"qfuse: error: rank {rank}: {_message(e)}", file=sys.stderr)
        return 2 if isinstance(e, UserError) else 1


def _follower_rank() -> str | None:
    """RANK in a torchrun job's ranks other than 0, else None."""
    if os.environ.get("WORLD_SIZE", "1") not in ("", "1") and \
            os.environ.get("RANK", "0") not in ("", "0"):
        return os.environ["RANK"]
    return None


def _own_error(e: BaseException) -> bool:
    """Whether a rank other than 0 must print ``e`` itself: under torchrun rank 0 speaks
    for all (qfuse.parallel) about the checks every rank makes alike before the process
    group starts, and about a ParallelError (agreed on, or rank 0's own collective
    failing); anything else after the start may be this rank's alone."""
    from .parallel import comm

    return comm.started() and not isinstance(e, comm.ParallelError)


def _message(e: BaseException) -> str:
    """The error as one line; OSErrors name their file."""
    if isinstance(e, torch.OutOfMemoryError):
        return ("out of memory on the device (a smaller --max-kv-size, --max-tokens or "
                "--kv-bits 4 needs less)")
    if isinstance(e, OSError) and e.strerror and e.filename is not None:
        return f"{e.filename}: {e.strerror}"
    return " ".join(str(e).split("\n")).strip() or type(e).__name__


def _main(argv: list[str]) -> int:
    parser = _Parser(prog="qfuse", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"qfuse {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error, not just its one line")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, device, kernels and the tier each op would use")
    bench = sub.add_parser("bench", help="GPU benchmarks (JSON + PNG in bench/results/)")
    bench.add_argument("name", choices=["act", "attention", "mlp", "train", "e2e", "gate",
                                        "serve", "e2e_tp"],
                       help="which benchmark (e2e_tp: under torchrun, tensor parallel)")
    bench.add_argument("--out", default="bench/results", help="folder for <name>.json/.png")
    bench.add_argument("--quick", action="store_true", help="fewer shapes (smoke test)")
    bench.add_argument("--sweep", metavar="FILE", default=None,
                       help="attention only: time the launch variants of a JSON sweep file "
                            "side by side (format: qfuse/bench/attention.py)")
    for name, help_text in (("generate", "stream a continuation of a prompt"),
                            ("chat", "an interactive loop")):
        p = sub.add_parser(name, help=help_text)
        if name == "generate":
            p.add_argument("model_or_prompt", nargs="*", metavar="[MODEL] PROMPT",
                           help="checkpoint folder (config.json, *.safetensors, tokenizer.json), "
                                "then the prompt; without a folder, the bundled default model")
            p.add_argument("--prompt", default=None,
                           help="the prompt, instead of the positional; - reads standard input")
            _add_tp_args(p)
        else:
            p.add_argument("model", nargs="?", default=None,
                           help="checkpoint folder (default: the bundled model)")
            p.add_argument("--system-prompt", default=None,
                           help="a system message opening the conversation")
        p.add_argument("--model", dest="model_option", default=None, metavar="MODEL",
                       help="checkpoint folder, instead of the positional (default: the "
                            "bundled model)")
        _add_generation_args(p)
    quant = sub.add_parser("quantize", help="write an MLX-layout quantized checkpoint")
    quant.add_argument("src", help="dense HF checkpoint folder (only read)")
    quant.add_argument("dst", help="new folder to write; refused if it is SRC, inside SRC, or "
                                   "not empty (unless --force)")
    quant.add_argument("--bits", type=int, default=4, choices=[2, 3, 4, 5, 6, 8],
                       help="bits per weight")
    quant.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128],
                       help="weights sharing one scale and bias")
    quant.add_argument("--force", action="store_true",
                       help="replace a non-empty DST that holds a model: the new model is "
                            "written beside it first, then DST is moved aside and deleted only "
                            "once the new one is in place; never when DST is or holds SRC")
    quant.add_argument("--override", action="append", default=[], metavar="MODULE=BITS[:GROUP]|dense",
                       help="per-module setting, e.g. model.layers.0.mlp.down_proj=8:64")
    tr = sub.add_parser("train", help="train a small Gemma 3 text model on the stdlib corpus")
    tr.add_argument("--out", required=True,
                    help="new checkpoint folder; checked before training starts: refused if "
                         "not empty (unless --force)")
    tr.add_argument("--force", action="store_true",
                    help="replace a non-empty --out that holds a model: the new model is "
                         "written beside it first, then the old one is moved aside and deleted "
                         "only once the new one is in place")
    tr.add_argument("--record", default=None, help="write losses and timings (JSON) here")
    tr.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    from .train import TrainSettings

    for field, default in TrainSettings().__dict__.items():
        kind = int if isinstance(default, int) else float if isinstance(default, float) else int
        tr.add_argument(f"--{field.replace('_', '-')}", type=kind, default=default,
                        help=_TRAIN_HELP.get(field, f"the model's {field} (config.json)"))
    serve = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (continuous batching)",
        description="Serve MODEL over HTTP, OpenAI-style: POST /v1/chat/completions and "
                    "/v1/completions (streamed as server-sent events with \"stream\": true), "
                    "GET /v1/models, GET /health (slots, queue, steps per batch size) and a "
                    "chat page at /. Concurrent requests share decode steps over --max-batch "
                    "KV cache slots; beyond them up to --max-queue wait, and the next get "
                    "503 with Retry-After. Errors are OpenAI error objects (400, 401, 404, "
                    "413, 503). Ctrl-C stops the server. Tensor parallel: `torchrun "
                    "--nproc-per-node N -m qfuse serve ...` (rank 0 serves; the others "
                    "follow its model calls).")
    _add_serve_args(serve)
    _add_tp_args(serve, "serve")
    gate = sub.add_parser("gate", help="compare a tier with compat on frozen trajectories")
    gate.add_argument("model", nargs="?", default=None,
                      help="checkpoint folder (default: the bundled model)")
    gate.add_argument("--golden", default=None, help="golden file (default: MODEL/golden.json)")
    gate.add_argument("--make-golden", action="store_true",
                      help="write the golden file from compat on this device (never implicit)")
    gate.add_argument("--tier", default="fast", choices=["exact", "fast"],
                      help="the tier compared with compat")
    gate.add_argument("--tokens", type=int, default=64,
                      help="continuation tokens per prompt when writing a golden file")
    _add_kv_cache_args(gate)
    gate.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    gate.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                      help="default: bfloat16 on cuda, float32 on cpu")
    gate.add_argument("--json", default=None, help="also write the report as JSON here")
    gate.add_argument("--quantization-cost", action="store_true",
                      help="also report what 4-bit weights and 4/8-bit KV cost (KL, top-1)")
    for p in [parser, *sub.choices.values()]:
        p.formatter_class = _Help
        if p is not parser:  # also after the subcommand; SUPPRESS keeps the top-level value
            p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                           help="show the full traceback of an error")
    args = parser.parse_args(argv)

    if _world_size() > 1 and args.command not in ("generate", "gate", "serve") and not (
            args.command == "bench" and args.name == "e2e_tp"):
        raise UserError(f"`qfuse {args.command}` does not run tensor parallel; under torchrun "
                        "run `generate`, `serve`, `gate` or `bench e2e_tp`")
    if args.command == "info":
        print("\n".join(info_lines()))
        return 0
    if args.command == "generate":
        args.model, args.prompt = _model_and_prompt(args)
    if args.command == "chat" and args.model_option is not None:
        if args.model is not None:
            raise UserError(f"two models: {args.model} and --model {args.model_option}")
        args.model = args.model_option
    if args.command in ("generate", "chat", "gate", "serve"):
        args.model = str(_model_dir(args.model))
    if args.command == "gate" and _world_size() > 1:
        from .parallel.gate import run_gate_tp

        return run_gate_tp(args)
    if args.command in ("generate", "chat"):
        with levers.use_tier(args.tier) if args.tier else contextlib.nullcontext():
            return _run_generation(args)
    if args.command == "gate":
        return _run_gate(args)
    if args.command == "serve" and (args.tp is not None or _world_size() > 1):
        from .parallel.runtime import check_tp_flag
        from .parallel.serve import run_serve_tp

        if check_tp_flag(args.tp, "serve") > 1:
            return run_serve_tp(args)
    if args.command == "serve":
        from .serving.server import run_serve

        return run_serve(args)
    if args.command == "train":
        import json

        from .saving import check_destination
        from .train import TrainSettings, train

        settings = TrainSettings(**{k: getattr(args, k) for k in TrainSettings().__dict__})
        settings.check()  # these two before the progress line starts
        check_destination(args.out, force=args.force)
        record_path = Path(args.record) if args.record else None
        # Like --out, a record that cannot be written must fail before training, not after.
        if record_path and (record_path.is_dir() or not record_path.parent.is_dir()):
            raise UserError(f"--record {record_path}: not a file in an existing folder")
        # train() logs its first line once the corpus is read and the tokenizer trained.
        setup = _Elapsed("reading the corpus, training the tokenizer")

        def log(line: str) -> None:
            setup.close()
            print(line)

        with setup:
            record = train(args.out, settings, args.device, log=log, force=args.force)
        if record_path:
            with open(record_path, "w") as f:
                json.dump(record, f, indent=1)
        print(f"wrote {args.out}; validation loss {record['best_val_loss']:.3f} "
              f"(best, at step {record['best_step'] + 1} of {settings.steps})")
        return 0
    if args.command == "quantize":
        from .convert import parse_overrides, quantize_checkpoint

        out = quantize_checkpoint(args.src, args.dst, args.bits, args.group_size,
                                  parse_overrides(args.override), force=args.force)
        print(f"wrote {out}")
        return 0
    if args.command == "bench":
        if args.sweep is not None and args.name != "attention":
            raise UserError(f"--sweep is an option of `qfuse bench attention`, not of {args.name}")
        if args.name == "e2e_tp":  # --quick also runs on CPU (gloo), on the bundled model
            from .parallel import bench as tp_bench

            return tp_bench.main(out_dir=args.out, quick=args.quick)
        if not torch.cuda.is_available() and args.name != "serve":  # serve --quick: CPU too
            raise UserError("qfuse bench needs a CUDA GPU; none is visible")
        module = importlib.import_module(f"qfuse.bench.{args.name}")
        if args.name == "attention":
            return module.main(out_dir=args.out, quick=args.quick, sweep=args.sweep)
        return module.main(out_dir=args.out, quick=args.quick)
    return 2


class _Elapsed:
    """A progress line (tqdm, stderr) for a wait with nothing to count: its elapsed
    time, refreshed by a thread twice a second until closed."""

    def __init__(self, desc: str):
        from tqdm import tqdm

        self._bar = tqdm(desc=desc, total=None, bar_format="{desc}: {elapsed}", leave=False,
                         file=sys.stderr)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._tick, daemon=True)
        self._thread.start()

    def _tick(self) -> None:
        while not self._done.wait(0.5):
            self._bar.refresh()

    def close(self) -> None:
        if not self._done.is_set():
            self._done.set()
            self._thread.join()
            self._bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _model_and_prompt(args) -> tuple[str | None, str]:
    """(model folder or None, prompt) of `qfuse generate`, from the positionals
    [MODEL] PROMPT or --model/--prompt (`--prompt -` reads standard input)."""
    pos, model, prompt = list(args.model_or_prompt), args.model_option, args.prompt
    if prompt is not None and len(pos) > 1 or prompt is None and len(pos) > 2:
        raise UserError("generate takes [MODEL] PROMPT, or --model/--prompt (quote a prompt "
                        "with spaces)")
    if prompt is None and len(pos) == 1 and model is None and _is_path(pos[0]):
        # `qfuse generate some/folder` would otherwise prompt the bundled model with a path.
        raise UserError(f"no prompt: {pos[0]} is a path, taken as the model; give the prompt "
                        "after it (or --prompt TEXT, --prompt - for standard input)")
    if prompt is None and pos:
        prompt = pos.pop()
    if pos:
        if model is not None:
            raise UserError(f"two models: {pos[0]} and --model {model}")
        model = pos[0]
    if prompt is None:
        raise UserError("no prompt: give it after the model (or --prompt TEXT, --prompt - for "
                        "standard input)")
    if prompt == "-":
        prompt = sys.stdin.read()
    return model, prompt


def _is_path(text: str) -> bool:
    try:
        return Path(text).exists()
    except (OSError, ValueError):  # a prompt too long for a file name, or holding NUL
        return False


# Help for `qfuse train`'s TrainSettings flags; the others are config.json fields.
_TRAIN_HELP = {
    "seq_len": "tokens per training sequence",
    "batch_size": "sequences per step",
    "steps": "optimizer steps",
    "lr": "peak learning rate (AdamW, warmup then cosine decay)",
    "warmup": "linear warmup steps",
    "weight_decay": "AdamW weight decay of the matrices",
    "eval_every": "steps between validation losses",
    "eval_batches": "batches per validation loss",
    "max_chars": "cap the corpus at this many characters (tests)",
    "seed": "initialization and batch order",
}


def _add_kv_cache_args(p: argparse.ArgumentParser) -> None:
    from .cache import KV_BITS
    from .quant import SUPPORTED_GROUP_SIZES

    p.add_argument("--kv-bits", type=int, default=0, choices=KV_BITS, help="0: dense KV cache")
    p.add_argument("--kv-group-size", type=int, default=64, choices=SUPPORTED_GROUP_SIZES,
                   help="KV cache quantization group (with --kv-bits 4|8)")


def _add_generation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest; 0: off")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample within the smallest set of this mass, in (0, 1]")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens under this fraction of the likeliest's probability, in [0, 1)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 1 discourages tokens already seen; 1: off")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: a fresh one)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--max-kv-size", type=int, default=None, metavar="N",
                   help="KV cache size in tokens (default: the model's context). A prompt that "
                        "does not fit with --max-tokens is an error without it; with it, the "
                        "prompt's start is dropped to keep its last N - max-tokens tokens (chat "
                        "drops the oldest turns first). Unlike mlx-lm's rotating cache, "
                        "generation never runs past N tokens")
    _add_kv_cache_args(p)
    p.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false", default=None,
                   help="decode eagerly on CUDA (default: replay the step as a CUDA graph)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--tier", default=None, choices=[t.name.lower() for t in levers.Tier],
                   help="the ops' tier, as QFUSE_TIER (which it overrides): compat, the "
                        "PyTorch reference; exact, only kernels bit-identical to it; fast, "
                        "every kernel (default: QFUSE_TIER, else fast on cuda, compat on cpu)")


def _world_size() -> int:
    from .parallel.comm import world_from_env

    return world_from_env()


def _add_tp_args(p: argparse.ArgumentParser, command: str = "generate") -> None:
    p.add_argument("--tp", type=int, default=None, metavar="N",
                   help=f"tensor parallel over N GPUs: start as `torchrun --nproc-per-node N -m "
                        f"qfuse {command} ...` (default: torchrun's process count, 1 without it)")
    p.add_argument("--tp-allreduce", default="p2p", choices=["p2p", "nccl", "symm_mem"],
                   help="the all-reduce of tensor parallel on CUDA: p2p (default): qfuse's "
                        "one-shot kernel, decode rows pushed to the peers over NVLink, NCCL "
                        "for prefill; nccl; symm_mem: PyTorch symmetric memory's one-shot")
    p.add_argument("--tp-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="how long a rank waits for the others (start, loading, each "
                        "collective) before it stops with an error")


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint folder (default: the bundled model)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind; another than loopback exposes the server to the network")
    p.add_argument("--port", type=int, default=8000,
                   help="TCP port (0: a free one, named in the start line)")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on every /v1 request")
    p.add_argument("--max-batch", type=int, default=8,
                   help="sequences decoded together (KV cache slots)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for a slot; beyond them, 503 with Retry-After")
    p.add_argument("--max-kv-size", type=int, default=None, metavar="N",
                   help="tokens per slot, prompt + max_tokens (default: the model's context)")
    p.add_argument("--max-prefill-tokens", type=int, default=2048, metavar="N",
                   help="prompt tokens (padding included) prefilled together between two decode "
                        "steps; a longer prompt is prefilled alone")
    p.add_argument("--served-model-name", default=None,
                   help="the model's name in the API (default: the folder's name)")
    _add_kv_cache_args(p)
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=False,
                   help="batch invariance: every step decodes all --max-batch slots, so a "
                        "request's greedy tokens do not depend on the requests beside it "
                        "(slower at low load: one stream pays for a full batch). Default: "
                        "decode only the busy slots, rounded up to a power of two")
    p.add_argument("--cuda-graph", action="store_true",
                   help="replay the decode step from CUDA graphs, one per batch size, captured "
                        "at start (needs CUDA; with --tp N, not yet run on GPUs)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (info logs every request)")


def _run_generation(args) -> int:
    """`qfuse generate` (tensor parallel under torchrun or with --tp) or `qfuse chat`."""
    if args.command == "generate" and (args.tp is not None or _world_size() > 1):
        from .parallel.runtime import run_generate_tp

        return run_generate_tp(args)
    from .chat import run_chat, run_generate

    return (run_generate if args.command == "generate" else run_chat)(args)


def _run_gate(args) -> int:
    from . import gates
    from .chat import load_for_gate

    return gates.gate_command(
        lambda: load_for_gate(args), args.model, golden=args.golden,
        write_golden=args.make_golden, tier_name=args.tier, n_tokens=args.tokens,
        kv_bits=args.kv_bits, kv_group_size=args.kv_group_size, json_path=args.json,
        with_quantization_cost=args.quantization_cost)


def _model_dir(model: str | None) -> Path:
    """The model folder to use: the argument, else the model bundled in the package."""
    from .loading import DEFAULT_MODEL

    if model is not None:
        return Path(model)
    if not (DEFAULT_MODEL / "config.json").exists():
        raise UserError("no model given and no default model is bundled in this build yet "
                        f"(expected {DEFAULT_MODEL}); pass a checkpoint folder")
    return DEFAULT_MODEL
