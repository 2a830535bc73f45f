"""A/B: the fragment-order product (qmatmul_mma, mma.sync over repacked 4-bit codes) over
launch shapes, beside tinygemm, bf16 F.linear and today's qmatmul, on the Gemma 3 12B MLP
projections (4-bit g64), 1/4/8 rows; CUDA graphs over weights rotated past the L2; max
error against float32 on the dequantized weight. Writes $OUT/ab18.json."""
import itertools
import json
import os
import time

import torch
import torch.nn.functional as F

from qfuse.bench import common
from qfuse.bench.mlp import _tinygemm
from qfuse.kernels import fragments
from qfuse.kernels.qmatmul import qmatmul
from qfuse.kernels.qmatmul_mma import qmatmul_mma


def variants(M, N, K):
    wide = M == 1 and N > K
    for tiles, iters, nw in itertools.product([1, 2] if wide else [1], [2, 4, 8] if wide
                                              else [4, 8], [4, 8] if wide else [4]):
        yield dict(tiles=tiles, iters=iters, num_warps=nw, pdl=False)
    yield dict(pdl=True)
    yield dict(pdl=False)


def main():
    out = os.environ.get("OUT", "/tmp")
    copy = common.copy_bandwidth_gbs()
    print("copy GB/s", round(copy), flush=True)
    rows = []
    for (N, K), M in [((15360, 3840), 1), ((3840, 15360), 1), ((15360, 3840), 4),
                      ((15360, 3840), 8), ((4096, 3840), 1)]:
        ws, dense = common.rotating_weights(N, K)
        one, n = ws[0], len(ws)
        fs = [fragments.repack(w) for w in ws]
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ one.dequantize(torch.float32).T
        base = {"N": N, "K": K, "bits": 4, "M": M}

        def record(name, us, nbytes, err=None, **extra):
            common.record_row(rows, base, copy, name, us, nbytes, err, **extra)

        record("bf16 F.linear", common.time_graph_us(lambda w: F.linear(x, w), [(w,) for w in dense]),
               N * K * 2)
        record("qmatmul (dispatch today)",
               common.time_graph_us(lambda w: qmatmul(x, w), [(w,) for w in ws]), one.nbytes,
               (qmatmul(x, one).float() - ref).abs().max().item())
        tg = [_tinygemm(x, w) for w in ws]
        record("tinygemm", common.time_graph_us(lambda i: tg[i](), [(i,) for i in range(n)]),
               one.nbytes)
        for v in variants(M, N, K):
            t0 = time.time()
            try:
                err = (qmatmul_mma(x, fs[0], **v).float() - ref).abs().max().item()
                us = common.time_graph_us(lambda f: qmatmul_mma(x, f, **v), [(f,) for f in fs])
                record("mma", us, one.nbytes, err, **v, compile_s=round(time.time() - t0, 1))
            except Exception as exc:  # noqa: BLE001 -- reported
                rows.append({**base, "method": "mma", **v, "error": str(exc)[:300]})
                print("ERROR", v, str(exc)[:300], flush=True)
        del ws, fs, dense
        torch.cuda.empty_cache()
        with open(os.path.join(out, "ab18.json"), "w") as f:
            json.dump({"meta": common.metadata(), "copy_gbs": copy, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
