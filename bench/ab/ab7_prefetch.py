"""A/B: the tensor-core quantized matmul with its scales, biases and x fetched one loop
iteration ahead (prefetch=True) or in the iteration that uses them (False), one row,
Gemma 3 12B up/down projections g=64, and the fused MLP; copy bandwidth of the same run.
ab6 measured ~33 µs for every shape: the 2-byte loads were not pipelined."""
import json
import os

import torch

from qfuse.bench import common
from qfuse.kernels.fused_mlp import fused_mlp
from qfuse.kernels.qmatmul_tc import qmatmul_tc

copy = common.copy_bandwidth_gbs()
rows = []
for (N, K), bits in [((15360, 3840), 4), ((15360, 3840), 8), ((3840, 15360), 4)]:
    first = common.random_quantized((N, K), bits, 64, 0.005, 0.015)
    ws = [first] + [common.random_quantized((N, K), bits, 64, 0.005, 0.015)
                    for _ in range(common.n_rotations(first.nbytes, cap=8) - 1)]
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    for prefetch in (True, False):
        us = common.time_graph_us(lambda w, p=prefetch: qmatmul_tc(x, w, prefetch=p),
                                  [(w,) for w in ws], min_calls=2 * len(ws))
        rows.append(dict(N=N, K=K, bits=bits, v=f"qmatmul prefetch={prefetch}", us=us,
                         share=first.nbytes / us / 1e3 / copy))
        print(rows[-1], flush=True)
    del ws
H, I = 3840, 15360
sets = [tuple(common.random_quantized(s, 4, 64, 0.005, 0.015) for s in ((I, H), (I, H), (H, I)))
        for _ in range(2)]
nb = sum(w.nbytes for w in sets[0])
x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
for prefetch in (True, False):
    us = common.time_graph_us(lambda g, u, d, p=prefetch: fused_mlp(x, g, u, d, "gelu_tanh",
                                                                   prefetch=p), sets, min_calls=4)
    rows.append(dict(N=I, K=H, bits=4, v=f"fused_mlp prefetch={prefetch}", us=us,
                     share=nb / us / 1e3 / copy))
    print(rows[-1], flush=True)
json.dump({"copy_GBps": copy, "rows": rows}, open(os.environ.get("OUT", "/tmp") + "/ab7.json", "w"),
          indent=1)
