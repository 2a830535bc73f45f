"""CPU, no GPU needed: compat against compat with its one-row quantized products changed,
on the default model quantized to 4 bits, with a dense and a 4-bit KV cache: what the
projection numerics alone do to the gate's mean KL and agreement.

    python bench/ab/cpu1_gate_emulation.py fp32w   # unrounded float32 weights (a GEMV
                                                  # that factors the scale out)
    python bench/ab/cpu1_gate_emulation.py order   # compat's bf16 weights, float32 sums
                                                  # in another (sequential) order

Measured 2026-11-30 (mean KL and agreement per prompt, 4-bit KV): fp32w 2.5e-3 (63),
4.0e-4 (64), 2.3e-3 (63), 1.7e-3 (61); order 5.1e-4 (62), 1.8e-4, 7.7e-5, 4.2e-4 (64).
Dense KV: fp32w ≤ 2.0e-4, order ≤ 9.6e-5. About 5 minutes per mode on 2 cores."""
import sys, torch, torch.nn.functional as F
from qfuse import reference, gates
from qfuse.convert import quantize_model
from qfuse.loading import DEFAULT_MODEL, load_model
from qfuse.quant import QuantizedTensor
torch.manual_seed(0)
model = load_model(DEFAULT_MODEL, dtype=torch.bfloat16, device="cpu")
golden = gates.load_golden(DEFAULT_MODEL / "golden.json")
q = quantize_model(model, 4, 64)
orig = reference.linear
mode = sys.argv[1]
def patched(x, w, bias=None):
    if isinstance(w, QuantizedTensor) and x.numel() // x.shape[-1] == 1:
        if mode == "fp32w":  # GEMV numerics: fp32 dequantized weights, fp32 sums
            y = F.linear(x.float(), w.dequantize(torch.float32), None if bias is None else bias.float())
            return y.to(x.dtype)
        if mode == "order":  # bf16 weights as compat, fp32 sums in another order
            wd = w.dequantize(x.dtype).float()
            y = (x.float()[..., None, :] * wd).flip(-1).cumsum(-1)[..., -1]
            return y.to(x.dtype)
    return orig(x, w, bias)
reference.linear = patched
for kv in (0, 4):
    rows = []
    for t in golden["trajectories"]:
        reference.linear = orig
        with gates.tier("compat"):
            a, _ = gates.teacher_forced(q, t["prompt_ids"], t["continuation"], kv)
        reference.linear = patched
        with gates.tier("compat"):
            b, _ = gates.teacher_forced(q, t["prompt_ids"], t["continuation"], kv)
        kl = gates.kl_divergence(a, b)
        rows.append((round(kl.mean().item(), 6), int((a.argmax(-1) == b.argmax(-1)).sum())))
    print(mode, "kv", kv, rows, flush=True)
