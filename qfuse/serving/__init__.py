"""`qfuse serve`: an OpenAI-compatible HTTP server over a continuous-batching engine.

`engine` batches concurrent requests into shared decode steps; `protocol` turns
OpenAI request bodies into engine requests (or one-line errors); `app` is the
Starlette application; `sizing` picks the KV cache slots and CUDA graphs the server
starts with; `server` is the `qfuse serve` command.
"""
