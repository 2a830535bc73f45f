"""The runtime around the model: its KV caches, the decode step replayed from CUDA graphs,
and the generate loop.

The caches: slotted (`cache`: a row per sequence, sliding-window rings) and paged
(`paged_cache`: pools of pages behind block tables; `prefix_cache`: prompt pages shared
between prompts that start alike), both written by one append per prefill
(`prompt_write`) from small host tensors copied without a sync (`host_copies`). The
step as a CUDA graph over either cache (`slotted_graphs`, `paged_graphs`). Generation:
`sampling` and `prompts` (what a request asks for), text decoded a few tokens at a time
(`detokenize`), and the loop that ties them together (`generation`), which the Python
API, the CLI and the benchmarks drive; the serving engine reuses the caches, graphs and
sampling under its own scheduler.
"""
