"""A/B: the codes kernel's occupancy, after ab15 found 64-token tiles capped at 128
registers (4 programs per SM) faster than the default at the Gemma 3 12B shape
(kv4 128k 144 against 165 µs) but slower at the Llama 3 8B shape. Sweeps tile size,
pipeline stages and register caps per head dim and bit width; B=1; SDPA flash over a
bf16 cache in the same run."""
import json
import os

import torch

from qfuse.bench import common
from qfuse.bench.attention import _make_kv, _sdpa
from qfuse.kernels.decode_attention import decode_attention_quantized_kv as attn
from tests.attention_cases import float32_reference

copy = common.copy_bandwidth_gbs()
print("copy", copy, flush=True)
rows = []
CASES = [("gemma", 16, 8, 256, "kv4", 131072), ("gemma", 16, 8, 256, "kv4", 8192),
         ("gemma", 16, 8, 256, "kv8", 131072), ("llama", 32, 8, 128, "kv4", 131072),
         ("llama", 32, 8, 128, "kv4", 8192), ("llama", 32, 8, 128, "kv8", 131072)]
GEMMA4 = [{}, {"_block_n": 64, "_maxnreg": 128}, {"_block_n": 64, "_num_stages": 4, "_maxnreg": 128},
          {"_block_n": 64, "_num_stages": 2, "_maxnreg": 128}, {"_block_n": 32, "_maxnreg": 128},
          {"_block_n": 64, "_maxnreg": 104}]
OTHER = [{}, {"_block_n": 64}, {"_block_n": 64, "_num_stages": 2}, {"_block_n": 64, "_maxnreg": 128}]
for shape, Hq, Hkv, D, kind, N in CASES:
    q = torch.randn(1, Hq, D, device="cuda", dtype=torch.bfloat16)
    L = torch.full((1,), N, dtype=torch.int32, device="cuda")
    kv = _make_kv(kind, 1, Hkv, N, D)
    nb = sum(t.nbytes for t in kv)
    sets = [kv] + [_make_kv(kind, 1, Hkv, N, D) for _ in range(common.n_rotations(nb, cap=64) - 1)]
    ref = float32_reference(q, *kv, L, 0.1)
    dense = _make_kv("bf16", 1, Hkv, N, D)
    dsets = [dense] + [_make_kv("bf16", 1, Hkv, N, D)
                       for _ in range(common.n_rotations(sum(t.nbytes for t in dense), cap=64) - 1)]
    sd = _sdpa("flash")
    flash = common.time_graph_us(lambda k, v, q=q, L=L, sd=sd: sd(q, k, v, L), dsets)
    del dsets, dense
    rows.append({"shape": shape, "kind": kind, "N": N, "path": "sdpa-flash bf16", "us": flash})
    print(rows[-1], flush=True)
    for kw in (GEMMA4 if (shape, kind) == ("gemma", "kv4") else OTHER):
        cfg = {k[1:]: v for k, v in kw.items()}
        try:
            err = (attn(q, *kv, L, 0.1, **kw).float() - ref).abs().max().item()
            us = common.time_graph_us(lambda k, v, kw=kw, q=q, L=L: attn(q, k, v, L, 0.1, **kw), sets)
            rows.append({"shape": shape, "kind": kind, "N": N, "path": "codes", **cfg, "us": us,
                         "share": nb / us / 1e3 / copy, "vs_flash": flash / us, "max_err": err})
        except Exception as e:  # noqa: BLE001 -- a launch shape that cannot compile is reported
            rows.append({"shape": shape, "kind": kind, "N": N, "path": "codes", **cfg,
                         "error": f"{type(e).__name__}: {str(e)[:200]}"})
        print(rows[-1], flush=True)
    del sets, kv
    torch.cuda.empty_cache()
with open(os.environ.get("OUT", "/tmp") + "/ab16.json", "w") as f:
    json.dump({"copy_GBps": copy, "rows": rows}, f, indent=1)
