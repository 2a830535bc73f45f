"""Quick GPU check of the held-weight pieces (fragment words back to MLX, the row lookup)."""
import torch

from qfuse.kernels import fragments
from qfuse.kernels.fragment_words import mlx_words
from qfuse.quant import QuantizedTensor

for N, K, g in [(48, 128, 64), (200, 128, 64), (8192, 3840, 64)]:
    w = QuantizedTensor.from_float(torch.randn(N, K, device="cuda").to(torch.bfloat16), g, 4)
    f = fragments.repack(w)
    ok_words = torch.equal(mlx_words(f).view(torch.int32), w.packed.view(torch.int32))
    ids = torch.tensor([0, N - 1, 17], device="cuda")
    ok_rows = torch.equal(fragments.dequantize_rows(f, ids, torch.bfloat16),
                          w.dequantize(torch.bfloat16)[ids])
    print("held check", N, K, g, "words", ok_words, "rows", ok_rows, flush=True)
