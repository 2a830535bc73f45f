"""A/B: launch shapes of the tensor-core quantized matmul (qmatmul_tc) and the fused MLP
on it, at one row (decode) and 2048 rows (prefill), against tinygemm, the CUDA-core GEMV,
bf16 F.linear and the copy bandwidth of the same run. Shapes: the Gemma 3 12B up
projection [15360 x 3840] and down projection [3840 x 15360], g=64."""
import itertools
import json
import os
import time

import torch
import torch.nn.functional as F

from qfuse.bench import common
from qfuse.bench.mlp import _tinygemm
from qfuse.kernels.fused_mlp import fused_mlp
from qfuse.kernels.qmatmul import qgemv
from qfuse.kernels.qmatmul_tc import qmatmul_tc

t0 = time.time()
copy = common.copy_bandwidth_gbs()
print(f"copy {copy:.0f} GB/s", flush=True)
G = 64
rows = []


def record(**r):
    if "us" in r:
        r["GBps"] = r["nbytes"] / r["us"] / 1e3
        r["share"] = r["GBps"] / copy
    rows.append(r)
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)


def timed(label, fn, inputs, nbytes, **info):
    try:
        us = common.time_graph_us(fn, inputs, min_calls=2 * len(inputs))
        record(v=label, us=us, nbytes=nbytes, **info)
    except Exception as e:  # noqa: BLE001
        record(v=label, error=f"{type(e).__name__}: {str(e)[:160]}", **info)


def weights(N, K, bits):
    first = common.random_quantized((N, K), bits, G, 0.005, 0.015)
    n = common.n_rotations(first.nbytes, cap=8)
    return [first] + [common.random_quantized((N, K), bits, G, 0.005, 0.015) for _ in range(n - 1)]


for (N, K), bits in [((15360, 3840), 4), ((15360, 3840), 8), ((3840, 15360), 4)]:
    ws = weights(N, K, bits)
    nb = ws[0].nbytes
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    info = dict(N=N, K=K, bits=bits, M=1)
    ref = x.float() @ ws[0].dequantize(torch.float32).T
    if bits == 4:
        fns = [_tinygemm(x, w) for w in ws]
        timed("tinygemm", lambda i: fns[i](), [(i,) for i in range(len(ws))], nb, **info)
        timed("cuda-core gemv bn64 gpi4 ps16", lambda w: qgemv(x, w, block_n=64, _groups_per_iter=4,
              _programs_per_sm=16), [(w,) for w in ws], nb, **info)
    grid = list(itertools.product((128, 256), (4, 8), (2, 4, 8), (3,)))
    grid += [(128, 4, 4, 2), (128, 4, 4, 4), (256, 8, 4, 2), (256, 8, 4, 4), (64, 4, 8, 3)]
    for bn, nw, ps, st in grid:
        kw = dict(block_n=bn, num_warps=nw, programs_per_sm=ps, stages=st)
        try:
            out = qmatmul_tc(x, ws[0], **kw)
            err = (out.float() - ref).abs().max().item()
        except Exception as e:  # noqa: BLE001
            record(v=f"tc bn{bn} w{nw} ps{ps} st{st}", error=str(e)[:200], **info)
            continue
        timed(f"tc bn{bn} w{nw} ps{ps} st{st}", lambda w: qmatmul_tc(x, w, **kw),
              [(w,) for w in ws], nb, err=err, **info)
    if (N, K) == (15360, 3840) and bits == 4:
        xp = torch.randn(2048, K, device="cuda", dtype=torch.bfloat16)
        dense = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        pinfo = dict(N=N, K=K, bits=bits, M=2048)
        timed("bf16 F.linear", lambda: F.linear(xp, dense), [()], N * K * 2, **pinfo)
        for bn, bm, nw, st in [(128, 128, 8, 3), (128, 64, 4, 3), (256, 128, 8, 3), (128, 128, 8, 2),
                               (128, 256, 8, 3)]:
            timed(f"tc prefill bn{bn} bm{bm} w{nw} st{st}",
                  lambda w: qmatmul_tc(xp, w, block_n=bn, block_m=bm, num_warps=nw, stages=st),
                  [(w,) for w in ws[:2]], nb, **pinfo)
    del ws
    torch.cuda.empty_cache()

H, I = 3840, 15360
sets = [tuple(common.random_quantized(s, 4, G, 0.005, 0.015) for s in ((I, H), (I, H), (H, I)))
        for _ in range(2)]
nb = sum(w.nbytes for w in sets[0])
for M in (1, 16):
    x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
    for bn, nw, ps in [(128, 4, 4), (256, 8, 4), (128, 4, 8), (128, 8, 2)]:
        timed(f"fused_mlp bn{bn} w{nw} ps{ps}",
              lambda g, u, d: fused_mlp(x, g, u, d, "gelu_tanh", block_n=bn, num_warps=nw,
                                        programs_per_sm=ps), sets, nb, bits=4, M=M, N=I, K=H)
common.print_table(rows, ["N", "K", "bits", "M", "v", "us", "GBps", "share", "err", "error"])
json.dump({"copy_GBps": copy, "rows": rows},
          open(os.environ.get("OUT", "/tmp") + "/ab6_qmatmul_tc.json", "w"), indent=1)
print(f"sweep took {time.time() - t0:.0f} s")
