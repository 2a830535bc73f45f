"""`qfuse serve`: an OpenAI-compatible HTTP server over a continuous-batching engine.

`engine` batches concurrent requests into shared decode steps (its parts, one a file:
`scheduler`, `prefill`, `slotted_steps`, `paged_steps`, `sampler`, `emission`,
`buckets`, `requests`; docs/serving.md); `protocol` turns
OpenAI request bodies into engine requests (or one-line errors); `app` is the
Starlette application; `sizing` picks the KV cache slots and CUDA graphs the server
starts with; `server` is the `qfuse serve` command.
"""
