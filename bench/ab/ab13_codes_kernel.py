"""A/B: the codes kernel (tensor cores over raw codes, scales factored out of the sums)
against the dequantizing tensor-core kernel and the CUDA-core kernel, with its launch
shape swept (tokens per tile, warps, pipeline stages, split size); B=1, the Gemma 3 12B
(16 q / 8 kv x 256) and Llama 3 8B (32 q / 8 kv x 128) shapes; SDPA flash over a bf16
cache of the same shape in the same run. Max difference against the float32 reference
on the dequantized cache is reported next to the old kernel's."""
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
VARIANTS = [("tensor_cores", {}), ("cuda_cores", {})]
VARIANTS += [("codes", dict(_block_n=bn, _num_warps=nw, _num_stages=ns))
             for bn in (32, 64, 128) for nw in (4, 8) for ns in (2, 3)]
VARIANTS += [("codes", dict(_split=sp)) for sp in (512, 2048)]
CASES = [("gemma", 16, 8, 256, "kv4", 131072), ("gemma", 16, 8, 256, "kv4", 8192),
         ("gemma", 16, 8, 256, "kv8", 131072), ("llama", 32, 8, 128, "kv4", 131072),
         ("llama", 32, 8, 128, "kv4", 8192)]
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
    flash = common.time_graph_us(lambda k, v: sd(q, k, v, L), dsets)
    del dsets, dense
    rows.append(dict(shape=shape, kind=kind, N=N, path="sdpa-flash bf16", us=flash))
    print(rows[-1], flush=True)
    variants = VARIANTS if (shape, kind, N) == ("gemma", "kv4", 131072) else (
        VARIANTS[:2] + [("codes", {}), ("codes", dict(_block_n=32)), ("codes", dict(_num_warps=8))])
    for path, kw in variants:
        kw = dict(kw, _path=path)
        if kind == "kv8" and path == "codes" and kw.get("_block_n") == 128:
            continue
        try:
            err = (attn(q, *kv, L, 0.1, **kw).float() - ref).abs().max().item()
            us = common.time_graph_us(lambda k, v, kw=kw: attn(q, k, v, L, 0.1, **kw), sets)
            rows.append(dict(shape=shape, kind=kind, N=N, path=path, **{k[1:]: v for k, v in kw.items() if k != "_path"},
                             us=us, share=nb / us / 1e3 / copy, vs_flash=flash / us, max_err=err))
        except Exception as e:
            rows.append(dict(shape=shape, kind=kind, N=N, path=path, cfg=str(kw),
                             error=f"{type(e).__name__}: {str(e)[:200]}"))
        print(rows[-1], flush=True)
    del sets, kv
    torch.cuda.empty_cache()
json.dump({"copy_GBps": copy, "rows": rows},
          open(os.environ.get("OUT", "/tmp") + "/ab13.json", "w"), indent=1)
