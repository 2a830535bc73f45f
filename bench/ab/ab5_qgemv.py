"""A/B: quantized GEMV launch shapes (columns per program, groups per iteration,
programs per SM, warps) and the fused gate/up kernel's rows per program, on the
Gemma 3 12B up projection [15360 x 3840] at g=64, against tinygemm, with the
copy bandwidth of the same run. First GPU run of issue 5's kernels showed 23% of
copy at one row (BLOCK_N 256, one group per iteration, 2 programs per SM)."""
import itertools
import json
import os
import time

import torch

from qfuse.bench import common
from qfuse.bench.mlp import _tinygemm
from qfuse.kernels.fused_mlp import fused_mlp
from qfuse.kernels.qmatmul import qgemv

t_start = time.time()
copy = common.copy_bandwidth_gbs()
print(f"copy {copy:.0f} GB/s", flush=True)
H, I, G = 3840, 15360, 64
rows = []


def record(**r):
    r["share"] = r["GBps"] / copy
    rows.append(r)
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)


for bits in (4, 8):
    ws = [common.random_quantized((I, H), bits, G, 0.005, 0.015)]
    n = common.n_rotations(ws[0].nbytes, cap=8)
    ws += [common.random_quantized((I, H), bits, G, 0.005, 0.015) for _ in range(n - 1)]
    nbytes = ws[0].nbytes
    for M in ((1, 4) if bits == 4 else (1,)):
        x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ ws[0].dequantize(torch.float32).T
        if bits == 4:
            fns = [_tinygemm(x, w) for w in ws]
            us = common.time_graph_us(lambda i: fns[i](), [(i,) for i in range(n)], min_calls=2 * n)
            record(bits=bits, M=M, v="tinygemm", us=us, GBps=nbytes / us / 1e3)
        grid = [(bn, gpi, ps, 4) for bn, gpi, ps in itertools.product((64, 128, 256), (1, 4), (4, 16))]
        grid += [(64, 8, 8, 4), (128, 8, 8, 4), (128, 4, 8, 8), (256, 4, 8, 8)]
        if M > 1:
            grid = [g for g in grid if g[0] <= 128]
        for bn, gpi, ps, nw in grid:
            kw = dict(block_n=bn, _groups_per_iter=gpi, _programs_per_sm=ps, _num_warps=nw)
            try:
                out = qgemv(x, ws[0], **kw)
                err = (out.float() - ref).abs().max().item()
                us = common.time_graph_us(lambda w: qgemv(x, w, **kw), [(w,) for w in ws],
                                          min_calls=2 * n)
                record(bits=bits, M=M, v=f"qgemv bn{bn} gpi{gpi} ps{ps} w{nw}", us=us,
                       GBps=nbytes / us / 1e3, err=err)
            except Exception as e:  # noqa: BLE001
                rows.append(dict(bits=bits, M=M, v=f"qgemv bn{bn} gpi{gpi} ps{ps} w{nw}",
                                 error=str(e)[:200]))
                print(rows[-1], flush=True)
    del ws
    torch.cuda.empty_cache()

# Fused MLP (deterministic) on the Gemma shape, 4-bit, one row: gate/up kernel shapes.
sets = []
for _ in range(2):
    sets.append(tuple(common.random_quantized(s, 4, G, 0.005, 0.015)
                      for s in ((I, H), (I, H), (H, I))))
nbytes = sum(w.nbytes for w in sets[0])
x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
for bi, gpi, nw in itertools.product((16, 32, 64), (1, 4), (4,)):
    try:
        us = common.time_graph_us(
            lambda g, u, d: fused_mlp(x, g, u, d, "gelu_tanh", block_i=bi, _groups_per_iter=gpi,
                                      _num_warps=nw), sets, min_calls=4)
        record(bits=4, M=1, v=f"fused_mlp bi{bi} gpi{gpi} w{nw}", us=us, GBps=nbytes / us / 1e3)
    except Exception as e:  # noqa: BLE001
        rows.append(dict(v=f"fused_mlp bi{bi} gpi{gpi}", error=str(e)[:200]))
        print(rows[-1], flush=True)
common.print_table(rows, ["bits", "M", "v", "us", "GBps", "share", "err", "error"])
json.dump({"copy_GBps": copy, "rows": rows}, open(os.environ.get("OUT", "/tmp") + "/ab5_qgemv.json", "w"),
          indent=1)
print(f"sweep took {time.time() - t_start:.0f} s")
