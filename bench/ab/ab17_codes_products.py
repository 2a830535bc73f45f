"""A/B: the codes product (qmatmul_codes) over launch shapes, beside tinygemm, bf16
F.linear and today's qmatmul dispatch, on the Gemma 3 12B MLP projections (4-bit and
8-bit g64), 1/4/16/64 rows; CUDA graphs over weights rotated past the L2; each
variant's max error against float32 on the dequantized weight. Writes $OUT/ab17.json."""
import itertools
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

from qfuse.bench import common
from qfuse.bench.mlp import _tinygemm
from qfuse.kernels.qmatmul import qmatmul
from qfuse.kernels.qmatmul_codes import qmatmul_codes

QUICK = "--quick" in sys.argv


def variants(M, N, K, bits):
    """Launch shapes to time: unrolled tiles (stages 0) and pipelined loops."""
    big = M == 1 and N > K and bits == 4 and not QUICK
    for bn, it, nw in itertools.product([64, 128] if big else [128], [1, 2], [4]):
        yield dict(block_n=bn, tile_words=32, iters=it, num_warps=nw, stages=0, pdl=False)
    for bn, kt, it, st, nw in itertools.product(
            [64, 128] if big else [128], [32, 64] if big else [32], [4, 8, 15],
            [3], [4, 8]):
        yield dict(block_n=bn, tile_words=kt, iters=it, num_warps=nw, stages=st, pdl=False)
    yield dict(pdl=True)  # the defaults, with PDL
    yield dict(pdl=False)


def main():
    out = os.environ.get("OUT", "/tmp")
    copy = common.copy_bandwidth_gbs()
    print("copy GB/s", round(copy), flush=True)
    rows = []
    cases = [((15360, 3840), 4, M) for M in (1, 4, 16, 64)] + [((3840, 15360), 4, 1),
                                                                ((3840, 15360), 4, 16),
                                                                ((15360, 3840), 8, 1)]
    for (N, K), bits, M in cases:
        one = common.random_quantized((N, K), bits, 64, 0.005, 0.015)
        n = common.n_rotations(one.nbytes, cap=8)
        ws = [one] + [common.random_quantized((N, K), bits, 64, 0.005, 0.015)
                      for _ in range(n - 1)]
        dense = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5
                 for _ in range(common.n_rotations(N * K * 2, cap=8))]
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ one.dequantize(torch.float32).T
        base = {"N": N, "K": K, "bits": bits, "M": M}

        def record(name, us, nbytes, err=None, **extra):
            row = {**base, "method": name, "us": us, "share_of_copy": nbytes / us / 1e3 / copy,
                   **extra}
            if err is not None:
                row["max_err"] = err
            rows.append(row)
            print(json.dumps(row), flush=True)

        record("bf16 F.linear", common.time_graph_us(lambda w: F.linear(x, w), [(w,) for w in dense]),
               N * K * 2)
        record("qmatmul (dispatch today)",
               common.time_graph_us(lambda w: qmatmul(x, w), [(w,) for w in ws]), one.nbytes,
               (qmatmul(x, one).float() - ref).abs().max().item())
        if bits == 4:
            fns = [_tinygemm(x, w) for w in ws]
            record("tinygemm", common.time_graph_us(lambda i: fns[i](), [(i,) for i in range(n)]),
                   one.nbytes)
        for v in variants(M, N, K, bits):
            t0 = time.time()
            try:
                err = (qmatmul_codes(x, one, **v).float() - ref).abs().max().item()
                us = common.time_graph_us(lambda w: qmatmul_codes(x, w, **v), [(w,) for w in ws])
                record("codes", us, one.nbytes, err, **v, compile_s=round(time.time() - t0, 1))
            except Exception as exc:  # noqa: BLE001 -- reported
                rows.append({**base, "method": "codes", **v, "error": str(exc)[:200]})
                print("ERROR", v, str(exc)[:300], flush=True)
        del ws, dense
        torch.cuda.empty_cache()
        best = min((r for r in rows if r.get("method") == "codes" and r["M"] == M
                    and r["N"] == N and r["bits"] == bits and "us" in r), key=lambda r: r["us"],
                   default=None)
        print("BEST", json.dumps(best), flush=True)
        with open(os.path.join(out, "ab17.json"), "w") as f:
            json.dump({"meta": common.metadata(), "copy_gbs": copy, "rows": rows}, f, indent=1)
    with open(os.path.join(out, "ab17.json"), "w") as f:
        json.dump({"meta": common.metadata(), "copy_gbs": copy, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
