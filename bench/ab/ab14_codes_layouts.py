"""A/B (frozen record: `codes_t` here became the `codes` kernel, the first layout was removed):
the two layouts of the codes kernel. `codes` puts (head, group) pairs on the mma
rows (scores [R, tokens]); `codes_t` puts tokens on the rows for the scores (wgmma, one
scale load per token and group, per-token sums kept in threads until the split ends,
lazy softmax rescale). Launch shapes swept; B=1, Gemma 3 12B and Llama 3 8B shapes,
SDPA flash over a bf16 cache in the same run; max error against the float32 reference."""
from bench.ab.attention_ab import GEMMA, LLAMA, run

SWEEP = [{"_path": "codes"}, {"_path": "codes_t"}] + [
    {"_path": "codes_t", "_block_n": bn, "_num_warps": nw, "_num_stages": ns}
    for bn, nw, ns in ((64, 4, 2), (128, 4, 3), (128, 8, 2), (256, 8, 2), (64, 4, 3))]


def variants(shape, kind, N):
    old = [{"_path": "tensor_cores"}] if shape == "llama" else []
    return old + (SWEEP if (shape, kind) == ("gemma", "kv4") else SWEEP[:2] + [SWEEP[3]])


run([(GEMMA, "kv4", 131072), (GEMMA, "kv4", 8192), (GEMMA, "kv8", 131072),
     (GEMMA, "kv8", 8192), (LLAMA, "kv4", 131072), (LLAMA, "kv4", 8192),
     (LLAMA, "kv8", 131072)], variants, "ab14")
