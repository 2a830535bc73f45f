"""A/B (frozen record: `codes_t` here became the `codes` kernel, the first layout was removed):
the two layouts of the codes kernel. `codes` puts (head, group) pairs on the mma
rows (scores [R, tokens]); `codes_t` puts tokens on the rows for the scores (wgmma, one
scale load per token and group, per-token sums kept in threads until the split ends,
lazy softmax rescale). Launch shapes swept; B=1, Gemma 3 12B and Llama 3 8B shapes,
SDPA flash over a bf16 cache in the same run; max error against the float32 reference."""
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
         ("gemma", 16, 8, 256, "kv8", 131072), ("gemma", 16, 8, 256, "kv8", 8192),
         ("llama", 32, 8, 128, "kv4", 131072), ("llama", 32, 8, 128, "kv4", 8192),
         ("llama", 32, 8, 128, "kv8", 131072)]
SWEEP = [("codes", {}), ("codes_t", {})] + [
    ("codes_t", {"_block_n": bn, "_num_warps": nw, "_num_stages": ns})
    for bn, nw, ns in ((64, 4, 2), (128, 4, 3), (128, 8, 2), (256, 8, 2), (64, 4, 3))]
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
    sweep = SWEEP if (shape, kind) == ("gemma", "kv4") else SWEEP[:2] + [SWEEP[3]]
    for path, kw in ([("tensor_cores", {})] if shape == "llama" else []) + sweep:
        kw = dict(kw, _path=path)
        cfg = {k[1:]: v for k, v in kw.items() if k != "_path"}
        try:
            err = (attn(q, *kv, L, 0.1, **kw).float() - ref).abs().max().item()
            us = common.time_graph_us(lambda k, v, kw=kw, q=q, L=L: attn(q, k, v, L, 0.1, **kw), sets)
            rows.append({"shape": shape, "kind": kind, "N": N, "path": path, **cfg, "us": us,
                         "share": nb / us / 1e3 / copy, "vs_flash": flash / us, "max_err": err})
        except Exception as e:  # noqa: BLE001 -- a launch shape that cannot compile is reported
            rows.append({"shape": shape, "kind": kind, "N": N, "path": path, **cfg,
                         "error": f"{type(e).__name__}: {str(e)[:200]}"})
        print(rows[-1], flush=True)
    del sets, kv
    torch.cuda.empty_cache()
with open(os.environ.get("OUT", "/tmp") + "/ab14.json", "w") as f:
    json.dump({"copy_GBps": copy, "rows": rows}, f, indent=1)
