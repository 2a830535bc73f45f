"""A/B: the codes kernel's occupancy, after ab15 found 64-token tiles capped at 128
registers (4 programs per SM) faster than the default at the Gemma 3 12B shape
(kv4 128k 144 against 165 µs) but slower at the Llama 3 8B shape. Sweeps tile size,
pipeline stages and register caps per head dim and bit width; B=1; SDPA flash over a
bf16 cache in the same run."""
from bench.ab.attention_ab import GEMMA, LLAMA, run

GEMMA4 = [{}, {"_block_n": 64, "_maxnreg": 128}, {"_block_n": 64, "_num_stages": 4, "_maxnreg": 128},
          {"_block_n": 64, "_num_stages": 2, "_maxnreg": 128}, {"_block_n": 32, "_maxnreg": 128},
          {"_block_n": 64, "_maxnreg": 104}]
OTHER = [{}, {"_block_n": 64}, {"_block_n": 64, "_num_stages": 2}, {"_block_n": 64, "_maxnreg": 128}]


def variants(shape, kind, N):
    return [{"_path": "codes", **v} for v in (GEMMA4 if (shape, kind) == ("gemma", "kv4") else OTHER)]


run([(GEMMA, "kv4", 131072), (GEMMA, "kv4", 8192), (GEMMA, "kv8", 131072),
     (LLAMA, "kv4", 131072), (LLAMA, "kv4", 8192), (LLAMA, "kv8", 131072)], variants, "ab16")
