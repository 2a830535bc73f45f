"""A/B: the streaming CUDA-core GEMV (qgemv: no K loop, an unrolled share of K per
program, many programs) against the tensor-core kernel (qmatmul_tc) and tinygemm at one
row, over launch shapes; the fused MLP on each; the tensor-core kernel compiled to
Ampere-style mma.sync (DISABLE_MMA_V3=1, in a subprocess). Gemma 3 12B projections,
g=64; copy bandwidth of the same run."""
import json
import os
import subprocess
import sys

import torch

from qfuse.bench import common
from qfuse.bench.mlp import _tinygemm
from qfuse.kernels import fused_mlp as fm
from qfuse.kernels import qmatmul as qm
from qfuse.kernels.qmatmul_tc import qmatmul_tc

G = 64
OUT = os.environ.get("OUT", "/tmp")
rows = []
SUB = os.environ.get("AB9_SUB") == "1"


def record(**r):
    if "us" in r:
        r["share"] = r["nbytes"] / r["us"] / 1e3 / copy
    rows.append(r)
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)


def timed(label, fn, inputs, nbytes, check=None, **info):
    try:
        extra = {}
        if check is not None:
            extra["err_over_compat"] = check()
        us = common.time_graph_us(fn, inputs, min_calls=2 * len(inputs))
        record(v=label, us=us, nbytes=nbytes, **extra, **info)
    except Exception as e:  # noqa: BLE001
        record(v=label, error=f"{type(e).__name__}: {str(e)[:200]}", **info)


def weights(N, K, bits):
    first = common.random_quantized((N, K), bits, G, 0.005, 0.015)
    n = common.n_rotations(first.nbytes, cap=8)
    return [first] + [common.random_quantized((N, K), bits, G, 0.005, 0.015) for _ in range(n - 1)]


def err_ratio(out, x, w):
    deq = w.dequantize(torch.float32)
    ref = x.float() @ deq.T
    compat = torch.nn.functional.linear(x, w.dequantize(torch.bfloat16)).float()
    return ((out.float() - ref).abs().max() / (compat - ref).abs().max()).item()


copy = common.copy_bandwidth_gbs()
print(f"copy {copy:.0f} GB/s", flush=True)
SHAPES = [((15360, 3840), 4), ((15360, 3840), 8), ((3840, 15360), 4), ((4096, 3840), 4),
          ((2048, 3840), 4)]
# (block_n, groups per step, steps, warps); sm_90a SASS per 4-bit weight: 256/1/2/4 5.6
# instructions (80 registers), 512/1/2/4 4.8 (156), 256/1/4/2 4.5 (232).
GEMV = [(256, 1, 2, 4), (256, 1, 4, 4), (512, 1, 2, 4), (512, 1, 2, 8), (256, 1, 2, 2),
        (256, 2, 2, 8), (128, 1, 2, 4), (128, 2, 4, 4), (512, 1, 4, 8), (256, 1, 8, 4),
        (128, 2, 2, 4), (64, 4, 2, 4)]
# Tensor-core kernel with many short programs (K split 8-60 ways): (split, block_n, warps).
TC = [(8, 128, 4), (15, 128, 4), (30, 128, 4), (60, 128, 4), (15, 256, 4), (30, 256, 4),
      (15, 256, 8), (30, 256, 8), (60, 256, 8), (120, 128, 4)]
for (N, K), bits in (SHAPES[:1] if SUB else SHAPES):
    ws = weights(N, K, bits)
    nb = ws[0].nbytes
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    info = dict(N=N, K=K, bits=bits, M=1)
    timed("tc default", lambda w: qmatmul_tc(x, w), [(w,) for w in ws], nb,
          check=lambda: err_ratio(qmatmul_tc(x, ws[0]), x, ws[0]), **info)
    if SUB:
        timed("tc block_n 64", lambda w: qmatmul_tc(x, w, block_n=64), [(w,) for w in ws], nb,
              **info)
        continue
    if bits == 4:
        fns = [_tinygemm(x, w) for w in ws]
        timed("tinygemm", lambda i: fns[i](), [(i,) for i in range(len(ws))], nb, **info)
    big = (N, bits) in ((15360, 4), (3840, 4))
    for split, bn, nw in TC if big else []:
        kw = dict(split=split, block_n=bn, num_warps=nw)
        timed(f"tc split{split} bn{bn} w{nw}", lambda w, kw=kw: qmatmul_tc(x, w, **kw),
              [(w,) for w in ws], nb,
              check=lambda kw=kw: err_ratio(qmatmul_tc(x, ws[0], **kw), x, ws[0]), **info)
    for bn, gpi, it, nw in GEMV if big else GEMV[:6]:
        kw = dict(block_n=bn, groups_per_iter=gpi, iters=it, num_warps=nw)
        timed(f"gemv bn{bn} gpi{gpi} it{it} w{nw}", lambda w, kw=kw: qm.qgemv(x, w, **kw),
              [(w,) for w in ws], nb,
              check=lambda kw=kw: err_ratio(qm.qgemv(x, ws[0], **kw), x, ws[0]), **info)
    del ws
if not SUB:
    H, I = 3840, 15360
    sets = [tuple(common.random_quantized(s, 4, G, 0.005, 0.015) for s in ((I, H), (I, H), (H, I)))
            for _ in range(2)]
    nb = sum(w.nbytes for w in sets[0])
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    info = dict(N=I, K=H, bits=4, M=1)
    for limit in (0, 1):
        fm.BF16_GEMV_ROWS = limit
        timed(f"fused_mlp {'gemv' if limit else 'tc'}",
              lambda g, u, d: fm.fused_mlp(x, g, u, d, "gelu_tanh"), sets, nb, **info)
    for bn, gpi, it, nw in [(256, 1, 2, 4), (128, 2, 2, 4), (128, 1, 4, 4), (256, 1, 4, 4)]:
        timed(f"fused_mlp gemv bn{bn} gpi{gpi} it{it} w{nw}",
              lambda g, u, d, kw=dict(block_n=bn, groups_per_iter=gpi, iters=it, num_warps=nw):
              fm.fused_mlp(x, g, u, d, "gelu_tanh", **kw), sets, nb, **info)
    json.dump({"copy_GBps": copy, "rows": rows}, open(OUT + "/ab9.json", "w"), indent=1)
    env = dict(os.environ, AB9_SUB="1", DISABLE_MMA_V3="1",
               TRITON_CACHE_DIR=os.path.expanduser("~/.triton/cache_mma2"))
    sub = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True)
    print("--- DISABLE_MMA_V3=1 ---\n" + sub.stdout[-3000:] + sub.stderr[-2000:], flush=True)
