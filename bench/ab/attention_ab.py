"""Shared loop of the decode-attention A/B scripts (ab13-ab16): for each case, SDPA
flash over a bf16 cache of the same shape, then each launch variant of qfuse's kernel
over a quantized cache, timed side by side with CUDA graphs over rotated inputs, with
its max error against the float32 reference on the dequantized cache. B=1."""
import json
import os

import torch

from qfuse.bench import common
from qfuse.bench.attention import _make_kv, _sdpa
from qfuse.kernels.decode_attention import decode_attention_quantized_kv as attn
from tests.attention_cases import float32_reference

GEMMA = ("gemma", 16, 8, 256)  # name, q heads, kv heads, head dim
LLAMA = ("llama", 32, 8, 128)


def _rotated(kind, Hkv, N, D):
    one = _make_kv(kind, 1, Hkv, N, D)
    n = common.n_rotations(sum(t.nbytes for t in one), cap=64)
    return [one] + [_make_kv(kind, 1, Hkv, N, D) for _ in range(n - 1)]


def run(cases, variants, name):
    """cases: (shape, kind, N) with shape GEMMA or LLAMA; variants(shape name, kind, N)
    gives the launches to time, each a dict of decode_attention_quantized_kv keyword
    arguments (`_path`, `_block_n`, ...). Writes $OUT/<name>.json."""
    copy = common.copy_bandwidth_gbs()
    print("copy", copy, flush=True)
    rows = []
    for (shape, Hq, Hkv, D), kind, N in cases:
        q = torch.randn(1, Hq, D, device="cuda", dtype=torch.bfloat16)
        L = torch.full((1,), N, dtype=torch.int32, device="cuda")
        sets = _rotated(kind, Hkv, N, D)
        nb = sum(t.nbytes for t in sets[0])
        ref = float32_reference(q, *sets[0], L, 0.1)
        dense, sd = _rotated("bf16", Hkv, N, D), _sdpa("flash")
        flash = common.time_graph_us(lambda k, v, q=q, L=L, sd=sd: sd(q, k, v, L), dense)
        del dense
        head = {"shape": shape, "kind": kind, "N": N}
        rows.append({**head, "path": "sdpa-flash bf16", "us": flash})
        print(rows[-1], flush=True)
        for kw in variants(shape, kind, N):
            cfg = {k[1:]: v for k, v in kw.items()}  # path, block_n, ...
            try:
                err = (attn(q, *sets[0], L, 0.1, **kw).float() - ref).abs().max().item()
                us = common.time_graph_us(lambda k, v, kw=kw, q=q, L=L: attn(q, k, v, L, 0.1, **kw),
                                          sets)
                rows.append({**head, **cfg, "us": us, "share": nb / us / 1e3 / copy,
                             "vs_flash": flash / us, "max_err": err})
            except Exception as e:  # noqa: BLE001 -- a launch that cannot compile is reported
                rows.append({**head, **cfg, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            print(rows[-1], flush=True)
        del sets
        torch.cuda.empty_cache()
    with open(os.environ.get("OUT", "/tmp") + f"/{name}.json", "w") as f:
        json.dump({"copy_GBps": copy, "rows": rows}, f, indent=1)
