"""`qfuse serve`: check the flags, load the model, start the engine, run uvicorn.

Flag mistakes and a broken model folder are one-line errors before anything
loads. The server binds to 127.0.0.1 unless --host says otherwise.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import UserError


def check_args(args) -> None:
    if args.max_batch < 1:
        raise UserError(f"--max-batch must be at least 1, got {args.max_batch}")
    if args.max_queue < 0:
        raise UserError(f"--max-queue must be at least 0, got {args.max_queue}")
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must lie in [0, 65535], got {args.port}")
    if args.max_kv_size is not None and args.max_kv_size < 2:
        raise UserError(f"--max-kv-size must be at least 2, got {args.max_kv_size}")


def run_serve(args) -> int:
    try:
        import uvicorn

        from .app import make_app
    except ImportError as e:
        raise UserError(f"qfuse serve needs the serve extra: pip install 'qfuse[serve]' "
                        f"({e.name} is missing)") from e
    from ..cache import check_cache_flags
    from ..chat import _device, _load_model  # --device and --dtype as generate and chat
    from ..loading import check_checkpoint, load_chat_template, load_tokenizer, special_tokens
    from .engine import Engine
    from .protocol import ModelInfo

    check_args(args)
    path = Path(args.model)
    config = check_checkpoint(path)
    check_cache_flags(config, args.kv_bits, args.kv_group_size, args.max_kv_size)
    tokenizer = load_tokenizer(path)
    template = load_chat_template(path)
    device = _device(args)
    model = _load_model(args)
    engine = Engine(model, tokenizer, max_batch=args.max_batch, max_queue=args.max_queue,
                    context=args.max_kv_size, kv_bits=args.kv_bits,
                    kv_group_size=args.kv_group_size, cuda_graph=args.cuda_graph)
    info = ModelInfo(args.served_model_name or path.name, tokenizer, engine.context,
                     config.bos_token_id, template, special_tokens(path),
                     vocab_size=config.vocab_size)
    app = make_app(engine, info, api_key=args.api_key)
    engine.start()
    print(f"qfuse serve: {info.name} at http://{args.host}:{args.port}/v1 "
          f"({args.max_batch} slots of {engine.context} tokens, {device})",
          file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
