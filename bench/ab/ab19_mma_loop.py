"""A/B: the fragment-order product with a K loop (register double buffering, K split for
a target number of programs per SM) against the first fragment kernel (a frozen copy in
bench/ab/_old_mma.py, not committed), tinygemm and bf16 F.linear, on the Gemma 3 12B
projections (4-bit g64) and the concatenated QKV and gate+up weights; CUDA graphs over
weights rotated past the L2. Writes $OUT/ab19.json."""
import itertools
import json
import os
import time

import torch
import torch.nn.functional as F

from qfuse.bench import common
from qfuse.bench.mlp import _tinygemm
from qfuse.kernels import fragments
from qfuse.kernels.qmatmul_mma import qmatmul_mma


def _load_old():
    """The first fragment kernel, frozen beside this script (absent: skipped)."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_old_mma.py")
    if not os.path.exists(path):
        return None
    spec = importlib.util.spec_from_file_location("_old_mma", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_old_mma = _load_old()

SHAPES = [((15360, 3840), 1), ((3840, 15360), 1), ((15360, 3840), 4), ((15360, 3840), 8),
          ((4096, 3840), 1), ((2048, 3840), 1), ((8192, 3840), 1), ((30720, 3840), 1)]


def variants(M, N, K):
    main = (N, K, M) == (15360, 3840, 1)
    for chunk, x_ahead, per_sm in itertools.product(
            [4, 8], [True, False], [3, 4, 6, 8] if main else [4, 6]):
        yield dict(chunk=chunk, x_ahead=x_ahead, per_sm=per_sm)
    if main:
        yield dict(chunk=8, x_ahead=False, per_sm=2, num_warps=8)
        yield dict(chunk=4, x_ahead=False, per_sm=4, tiles=2)


def main():
    out = os.environ.get("OUT", "/tmp")
    copy = common.copy_bandwidth_gbs()
    print("copy GB/s", round(copy), flush=True)
    rows = []
    for (N, K), M in SHAPES:
        ws, dense = common.rotating_weights(N, K)
        one, n = ws[0], len(ws)
        fs = [fragments.repack(w) for w in ws]
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ one.dequantize(torch.float32).T
        base = {"N": N, "K": K, "bits": 4, "M": M}

        def record(name, us, nbytes, err=None, **extra):
            common.record_row(rows, base, copy, name, us, nbytes, err, **extra)

        def attempt(name, fn, **v):
            t0 = time.time()
            try:
                err = (fn(x, fs[0], **v).float() - ref).abs().max().item()
                us = common.time_graph_us(lambda f: fn(x, f, **v), [(f,) for f in fs])
                record(name, us, one.nbytes, err, **v, compile_s=round(time.time() - t0, 1))
            except Exception as exc:  # noqa: BLE001 -- reported
                rows.append({**base, "method": name, **v, "error": str(exc)[:300]})
                print("ERROR", name, v, str(exc)[:300], flush=True)

        record("bf16 F.linear",
               common.time_graph_us(lambda w: F.linear(x, w), [(w,) for w in dense]), N * K * 2)
        tg = [_tinygemm(x, w) for w in ws]
        record("tinygemm", common.time_graph_us(lambda i: tg[i](), [(i,) for i in range(n)]),
               one.nbytes)
        if _old_mma is not None:
            attempt("first fragment kernel", _old_mma.qmatmul_mma)
        for v in variants(M, N, K):
            attempt("loop", qmatmul_mma, **v)
        attempt("loop default", qmatmul_mma)
        del ws, fs, dense
        torch.cuda.empty_cache()
        with open(os.path.join(out, "ab19.json"), "w") as f:
            json.dump({"meta": common.metadata(), "copy_gbs": copy, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
