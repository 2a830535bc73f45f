"""A/B: split size (tokens per program) of the quantized decode attention, both kernels,
Gemma 3 12B shape (16 q / 8 kv heads, D 256), B=1, 128k and 8k. The quantized matmul's
lesson (ab9): many short programs beat few long loops, since one program's loop waits
a memory latency per tile. Today 128k uses splits of 1024 (16 tiles of 64 per program)."""
import json
import os

import torch

from qfuse.bench import common
from qfuse.bench.attention import _make_kv
from qfuse.kernels.decode_attention import decode_attention_quantized_kv as attn

copy = common.copy_bandwidth_gbs()
print("copy", copy, flush=True)
rows = []
Hq, Hkv, D, B = 16, 8, 256, 1
for kind, N in (("kv4", 131072), ("kv4", 8192), ("kv8", 131072)):
    q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16)
    L = torch.full((B,), N, dtype=torch.int32, device="cuda")
    kv = _make_kv(kind, B, Hkv, N, D)
    nb = sum(t.nbytes for t in kv)
    sets = [kv] + [_make_kv(kind, B, Hkv, N, D) for _ in range(common.n_rotations(nb, cap=64) - 1)]
    ref = attn(q, *kv, L, 0.1).float()
    for path in ("tensor_cores", "cuda_cores"):
        for split in (128, 256, 512, 1024):
            kw = dict(_path=path, _split=split)
            try:
                diff = (attn(q, *kv, L, 0.1, **kw).float() - ref).abs().max().item()
                us = common.time_graph_us(lambda k, v, kw=kw: attn(q, k, v, L, 0.1, **kw), sets)
                rows.append(dict(kind=kind, N=N, path=path, split=split, us=us,
                                 share=nb / us / 1e3 / copy, max_diff_vs_default=diff))
            except Exception as e:  # noqa: BLE001
                rows.append(dict(kind=kind, N=N, path=path, split=split,
                                 error=f"{type(e).__name__}: {str(e)[:160]}"))
            print(rows[-1], flush=True)
    del sets, kv
    torch.cuda.empty_cache()
json.dump({"copy_GBps": copy, "rows": rows},
          open(os.environ.get("OUT", "/tmp") + "/ab12.json", "w"), indent=1)
