"""`qfuse serve [MODEL]`: an OpenAI-compatible HTTP server with continuous batching
(tensor parallel under torchrun or with --tp)."""

from __future__ import annotations

import argparse

from .. import levers
from ..serving import sizing
from . import flags


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (continuous batching)",
        description="Serve MODEL over HTTP, OpenAI-style: POST /v1/chat/completions and "
                    "/v1/completions (streamed as server-sent events with \"stream\": true), "
                    "GET /v1/models[/ID], GET /health (slots, queue, steps per batch size) and a "
                    "chat page at /. Concurrent requests share decode steps over --max-batch "
                    "KV cache slots; beyond them up to --max-queue wait, and the next get "
                    "503 with Retry-After. Errors are OpenAI error objects (400, 401, 404, "
                    "413, 503). At start it says how many slots it took (by default, as "
                    "many as the free memory holds), the KV cache's memory and whether CUDA "
                    "graphs are on, and why; --max-batch and --cuda-graph/--no-cuda-graph "
                    "change them. Ctrl-C (or SIGTERM) stops taking requests (503) and lets "
                    "those in flight finish, /health and /metrics still answering; a second "
                    "Ctrl-C stops at once. Tensor parallel: `torchrun "
                    "--nproc-per-node N -m qfuse serve ...` (rank 0 serves; the others "
                    "follow its model calls).")
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint folder (default: the bundled model)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind; another than loopback exposes the server to the network")
    p.add_argument("--port", type=int, default=8000,
                   help="TCP port (0: a free one, named in the start line)")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on every /v1 request")
    p.add_argument("--allowed-origins", default=None, metavar="ORIGINS",
                   help="answer cross-origin (CORS) requests from the web pages of these "
                        "origins: a comma-separated list (http://localhost:3000,"
                        "https://app.example.com) or * for any. Default: none, so that a "
                        "page of another site cannot call the API in a visitor's browser "
                        "(the chat page at / is the server's own and needs none)")
    p.add_argument("--max-batch", type=int, default=None, metavar="N",
                   help="sequences decoded together (KV cache slots, each of --max-kv-size "
                        "tokens, all allocated at start). Default: as many as fit in "
                        f"{sizing.MEMORY_FRACTION:.0%}% of the memory free once the model is "
                        f"loaded, at most {sizing.AUTO_MAX_BATCH} with CUDA, "
                        f"{sizing.CPU_MAX_BATCH} on a CPU; with --kv-page-size those most, "
                        "the pages deciding admission. The start line says how many and why")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for a slot; beyond them, 503 with Retry-After")
    p.add_argument("--max-kv-size", type=int, default=None, metavar="N",
                   help="tokens per slot, prompt + max_tokens (default: the model's context)")
    p.add_argument("--max-prefill-tokens", type=int, default=2048, metavar="N",
                   help="prompt tokens (padding included) prefilled together between two decode "
                        "steps; a longer prompt is prefilled alone")
    p.add_argument("--prefill-chunk", type=int, default=512, metavar="N",
                   help="a prompt longer than N tokens is prefilled N tokens at a time, one "
                        "chunk per decode step of the other requests, so that it does not "
                        "stall their streams; the chunks depend on the prompt alone "
                        "(--deterministic holds). 0: prefill every prompt whole")
    p.add_argument("--kv-page-size", type=int, default=None, metavar="N",
                   help="keep the KV cache in pages of N tokens (a power of two), so that its "
                        "memory follows the tokens in use: a request waits in the queue until "
                        "its prompt and a page of decode room fit the free pages, and a "
                        "sequence that runs out mid-decode is preempted and later resumes "
                        "where it stopped (CUDA graphs and --deterministic work on pages "
                        "too). Default: the slotted cache")
    p.add_argument("--kv-pages", type=int, default=None, metavar="N",
                   help="with --kv-page-size: pages per full-attention layer, at least one "
                        "sequence of --max-kv-size tokens. Default: as many as fit in "
                        f"{sizing.MEMORY_FRACTION:.0%}% of the memory free once the model and "
                        "the activations of --max-batch rows are counted (on a CPU at most "
                        "every slot at --max-kv-size). The start line says how many")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="with --kv-page-size: keep the full pages of every prompt's KV cache "
                        "and share them with later requests whose prompt starts with the same "
                        "tokens (a system prompt, a few-shot preamble), which then prefill "
                        "only the rest; cached pages no request holds are evicted, least "
                        "recently used first, when pages run short (with --prefill-chunk 0 "
                        "the sliding-window layers' pages are sized for a whole prompt "
                        "after a cached prefix). Default: on with --kv-page-size")
    p.add_argument("--served-model-name", default=None,
                   help="the model's name in the API (default: the folder's name)")
    flags.add_kv_cache_args(p)
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=False,
                   help="batch invariance: a request's greedy tokens do not depend on the "
                        "requests beside it. Each step decodes a batch size whose rows are "
                        "computed as at --max-batch: on a GPU with 4-bit weights, the busy "
                        "slots rounded up as by default to a size whose products take the "
                        "kernels they take at --max-batch (the start-up line lists the "
                        "sizes); elsewhere all --max-batch slots (slower at low load). "
                        "Default: decode only the busy slots, rounded up to a power of two")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=False,
                   help="launch each decode step before reading the last one's tokens, so that "
                        "detokenizing, stop strings and the responses overlap the GPU's work "
                        "(slotted KV cache; a request with penalties or logprobs reads its "
                        "tokens first). Default: off")
    p.add_argument("--mixed-steps", action=argparse.BooleanOptionalAction, default=False,
                   help="with --kv-page-size: while prompts are being prefilled, each step is "
                        "one forward over every decoding request's next token and as many "
                        "prompt tokens as --step-tokens leaves, so that a long prompt never "
                        "holds up the streams in flight (not with --deterministic: the pieces "
                        "depend on the load). Default: off (prompts go in between decode steps)")
    p.add_argument("--step-tokens", type=int, default=None, metavar="N",
                   help="with --mixed-steps: the tokens one step runs, decode rows included "
                        "(prompts under way get 16 a step at least). Default: 64, about 1.5x "
                        "a decode step of one stream on an H200")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="replay the decode step from CUDA graphs, one per batch size, captured "
                        "at start (needs CUDA). Default: on with CUDA (paged or not), off on a "
                        "CPU; --no-cuda-graph decodes eagerly")
    flags.add_device_args(p)
    flags.add_check_weights_arg(p)
    p.add_argument("--log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (info logs every request)")
    flags.add_tp_args(p, "serve")


def run(args) -> int:
    levers.check_environment()  # the server refuses to start rather than fail each request
    args.model = str(flags.model_dir(args.model))
    if args.tp is not None or flags.world_size() > 1:
        from ..parallel.runtime import check_tp_flag
        from ..parallel.serve import run_serve_tp

        if check_tp_flag(args.tp, "serve") > 1:
            return run_serve_tp(args)  # its check_tp_args refuses --kv-page-size
    from ..serving.server import run_serve

    return run_serve(args)
