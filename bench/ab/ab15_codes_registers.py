"""A/B: the codes kernel's register cap against its occupancy. At its defaults it uses
219 registers (kv4 D=256, 128 tokens per tile: 2 programs of 4 warps per SM); capped
at 168 (3 programs, 116 bytes of spills) or with 64-token tiles capped at 128 (4
programs, no spills, +15% instructions per token). B=1, Gemma 3 12B and Llama 3 8B
shapes, SDPA flash over a bf16 cache in the same run."""
from bench.ab.attention_ab import GEMMA, LLAMA, run

VARIANTS = [{}, {"_maxnreg": 168}, {"_block_n": 64, "_maxnreg": 128}]
run([(GEMMA, "kv4", 131072), (LLAMA, "kv4", 131072)],
    lambda shape, kind, N: [{"_path": "codes", **v} for v in VARIANTS], "ab15")
