"""Where do the GEMV's one-row outputs differ from compat's (cuBLAS on the bf16
dequantized weight)? On the default model's own 4-bit projections: the share of bf16
outputs that differ, for the GEMV, the tensor-core kernel and cuBLAS, each against
the exactly rounded product (float64 sum of the same bf16 weights, rounded once); and
with one-hot x, whether the GEMV's weights are compat's bit for bit."""
import json
import os

import torch
import torch.nn.functional as F

from qfuse.convert import quantize_model
from qfuse.kernels.qmatmul import qgemv
from qfuse.kernels.qmatmul_tc import qmatmul_tc
from qfuse.loading import DEFAULT_MODEL, load_model
from qfuse.quant import QuantizedTensor

model = quantize_model(load_model(DEFAULT_MODEL, dtype=torch.bfloat16, device="cuda"), 4, 64)
layer = model.model.layers[0]
out = []
for name, mod in layer.named_modules():
    w = mod.quantized() if hasattr(mod, "quantized") else None
    if not isinstance(w, QuantizedTensor):
        continue
    wd = w.dequantize(torch.bfloat16)
    N, K = wd.shape
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 1, K, generator=g, device="cuda").bfloat16()
    exact = torch.stack([(xi.double() @ wd.double().T).to(torch.bfloat16) for xi in x])
    res = {"proj": name, "N": N, "K": K}
    for label, fn in (("cublas", lambda xi: F.linear(xi, wd)), ("gemv", lambda xi: qgemv(xi, w)),
                      ("tc", lambda xi: qmatmul_tc(xi, w))):
        y = torch.stack([fn(xi) for xi in x])
        res[f"{label}_differs_from_exact"] = (y != exact).float().mean().item()
    cub = torch.stack([F.linear(xi, wd) for xi in x])
    gem = torch.stack([qgemv(xi, w) for xi in x])
    res["gemv_differs_from_cublas"] = (gem != cub).float().mean().item()
    eye = torch.eye(K, device="cuda", dtype=torch.bfloat16)[:: max(1, K // 64)]
    cols = torch.stack([qgemv(e[None], w)[0] for e in eye])
    res["onehot_weight_mismatch"] = (cols != wd.T[:: max(1, K // 64)]).float().mean().item()
    out.append(res)
    print(res, flush=True)
json.dump(out, open(os.environ.get("OUT", "/tmp") + "/ab11.json", "w"), indent=1)
