"""A/B: the codes kernel (tensor cores over raw codes, scales factored out of the sums)
against the dequantizing tensor-core kernel and the CUDA-core kernel, with its launch
shape swept (tokens per tile, warps, pipeline stages, split size); B=1, the Gemma 3 12B
(16 q / 8 kv x 256) and Llama 3 8B (32 q / 8 kv x 128) shapes; SDPA flash over a bf16
cache of the same shape in the same run. Max difference against the float32 reference
on the dequantized cache is reported next to the old kernel's."""
from bench.ab.attention_ab import GEMMA, LLAMA, run

# "codes" here is the first layout of the codes kernel, since replaced (see ab14).
SWEEP = [{"_path": "tensor_cores"}, {"_path": "cuda_cores"}]
SWEEP += [{"_path": "codes", "_block_n": bn, "_num_warps": nw, "_num_stages": ns}
          for bn in (32, 64, 128) for nw in (4, 8) for ns in (2, 3)]
SWEEP += [{"_path": "codes", "_split": sp} for sp in (512, 2048)]
SHORT = SWEEP[:2] + [{"_path": "codes"}, {"_path": "codes", "_block_n": 32},
                     {"_path": "codes", "_num_warps": 8}]


def variants(shape, kind, N):
    return SWEEP if (shape, kind, N) == ("gemma", "kv4", 131072) else SHORT


run([(GEMMA, "kv4", 131072), (GEMMA, "kv4", 8192), (GEMMA, "kv8", 131072),
     (LLAMA, "kv4", 131072), (LLAMA, "kv4", 8192)], variants, "ab13")
