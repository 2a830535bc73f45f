"""A/B (next session, not yet run): the tensor-core quantized decode attention with the
per-token scales/biases fetched one tile ahead (`_prefetch=True`) or not, beside the
CUDA-core kernel, at the shapes of the issue's headline figures. Why: the TTGIR shows
Triton pipelines the packed words (cp.async) but leaves the 2-byte scale/bias loads
(64 LDG per 64-token tile) waiting a memory latency every tile; the same fix took the
quantized matmul from 32.8 to 28.2 µs (ab7)."""
import json
import os

import torch

from qfuse.bench import common
from qfuse.bench.attention import _make_kv
from qfuse.kernels.decode_attention import decode_attention_quantized_kv as attn

copy = common.copy_bandwidth_gbs()
print("copy", copy, flush=True)
rows = []
for (Hq, Hkv, D), N, B in [((16, 8, 256), 131072, 1), ((16, 8, 256), 8192, 1),
                           ((32, 8, 128), 131072, 1), ((32, 8, 128), 8192, 1)]:
    q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16)
    L = torch.full((B,), N, dtype=torch.int32, device="cuda")
    for kind in ("kv4", "kv8"):
        kv = _make_kv(kind, B, Hkv, N, D)
        nb = sum(t.nbytes for t in kv)
        sets = [kv] + [_make_kv(kind, B, Hkv, N, D) for _ in range(common.n_rotations(nb, cap=64) - 1)]
        for name, kw in [("tensor_cores", {}), ("tensor_cores prefetch", {"_prefetch": True}),
                         ("cuda_cores", {"_path": "cuda_cores"})]:
            us = common.time_graph_us(lambda k, v, kw=kw: attn(q, k, v, L, 0.1, **kw), sets)
            rows.append(dict(Hq=Hq, D=D, N=N, B=B, kind=kind, cfg=name, us=us,
                             share=nb / us / 1e3 / copy))
            print(rows[-1], flush=True)
        del sets, kv
        torch.cuda.empty_cache()
json.dump(rows, open(os.environ.get("OUT", "/tmp") + "/ab8.json", "w"), indent=1)
