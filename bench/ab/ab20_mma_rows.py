"""A/B: the fragment kernel at 9-64 rows (column tiles of 8, A registers made once per
block) against bf16 F.linear and qmatmul (what ops.linear dispatched to before: the
tensor-core kernel up to 16 rows, dequantize + cuBLAS above), Gemma 3 12B up proj
(4-bit g64); CUDA graphs over weights rotated past the L2. Writes $OUT/ab20.json."""
import json
import os

import torch
import torch.nn.functional as F

from qfuse.bench import common
from qfuse.kernels import fragments
from qfuse.kernels.qmatmul import qmatmul
from qfuse.kernels.qmatmul_mma import qmatmul_mma


def main():
    out = os.environ.get("OUT", "/tmp")
    copy = common.copy_bandwidth_gbs()
    rows = []
    N, K = 15360, 3840
    ws, dense = common.rotating_weights(N, K)
    one, n = ws[0], len(ws)
    fs = [fragments.repack(w) for w in ws]
    for M in (9, 16, 32, 64):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ one.dequantize(torch.float32).T
        for name, fn, args, nbytes in (
                ("bf16 F.linear", lambda w, x=x: F.linear(x, w), [(w,) for w in dense], N * K * 2),
                ("qmatmul (dispatch before)", lambda w, x=x: qmatmul(x, w), [(w,) for w in ws],
                 one.nbytes),
                ("fragment kernel", lambda f, x=x: qmatmul_mma(x, f), [(f,) for f in fs],
                 one.nbytes)):
            row = {"N": N, "K": K, "M": M, "method": name}
            try:
                us = common.time_graph_us(fn, args)
                row.update(us=us, share_of_copy=nbytes / us / 1e3 / copy)
                if name != "bf16 F.linear":
                    row["max_err"] = (fn(args[0][0]).float() - ref).abs().max().item()
            except Exception as exc:  # noqa: BLE001 -- reported
                row["error"] = str(exc)[:300]
            rows.append(row)
            print(json.dumps(row), flush=True)
        with open(os.path.join(out, "ab20.json"), "w") as f:
            json.dump({"meta": common.metadata(), "copy_gbs": copy, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
