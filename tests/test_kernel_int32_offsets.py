"""Caches whose per-sequence offsets exceed 32 bits fall back to the reference (no int32 overflow).

Each case runs in a subprocess because the bad address makes the interpreter
(or the GPU) fault. The views need ~4-6 GiB of *virtual* memory; only a few
MB are touched.
"""

import os
import subprocess
import sys
import textwrap

import pytest

COMMON = """
import os, sys, torch
sys.path.insert(0, {root!r})
os.environ["QFUSE_TIER"] = "fast"
from qfuse import ops, reference
torch.manual_seed(0)
dev = "cuda" if torch.cuda.is_available() else "cpu"
"""

# Token-major cache ([Nmax, B*Hkv*D] storage seen as [B, Hkv, Nmax, D]): token
# stride 2**16, so tok * stride_kn passes 2**31 for tokens >= 2**15.
TOKEN_STRIDE = """
D, S, N = 64, 2**16, 2**15 + 128
def view():
    st = torch.empty((N - 1) * S + D, dtype=torch.float16, device=dev)
    return st.as_strided((1, 1, N, D), (0, 0, S, 1))
k, v = view(), view()
kc = torch.randn(1, 1, 256, D, dtype=torch.float16, device=dev)
vc = torch.randn(1, 1, 256, D, dtype=torch.float16, device=dev)
k[:, :, N - 256:] = kc; v[:, :, N - 256:] = vc
q = torch.randn(1, 1, D, dtype=torch.float16, device=dev)
o = ops.decode_attention(q, k, v, torch.tensor([N], dtype=torch.int32, device=dev), 0.125, window=200)
r = reference.decode_attention(q, kc, vc, torch.tensor([256], dtype=torch.int32, device=dev), 0.125, window=200)
print("DIFF", (o.float() - r.float()).abs().max().item())
"""

# Head stride 2**30 (fits int32) with 3 kv heads: h_kv * stride_kh = 2**31 for head 2.
HEAD_STRIDE = """
D, N, H, SH = 64, 64, 3, 2**30
def view():
    st = torch.empty(2 * SH + N * D, dtype=torch.float16, device=dev)
    return st.as_strided((1, H, N, D), (0, SH, D, 1))
k, v = view(), view()
kc = torch.randn(1, H, N, D, dtype=torch.float16, device=dev)
vc = torch.randn(1, H, N, D, dtype=torch.float16, device=dev)
k.copy_(kc); v.copy_(vc)
q = torch.randn(1, H, D, dtype=torch.float16, device=dev)
L = torch.tensor([N], dtype=torch.int32, device=dev)
o = ops.decode_attention(q, k, v, L, 0.125)
r = reference.decode_attention(q, kc, vc, L, 0.125)
print("DIFF", (o.float() - r.float()).abs().max().item())
"""


@pytest.mark.parametrize("body", [TOKEN_STRIDE, HEAD_STRIDE], ids=["token_stride", "head_stride"])
def test_decode_attention_int64_offsets(body):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = textwrap.dedent(COMMON.format(root=root)) + textwrap.dedent(body)
    env = dict(os.environ)
    if "TRITON_INTERPRET" not in env:
        import torch
        if not torch.cuda.is_available():
            env["TRITON_INTERPRET"] = "1"
    p = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, env=env,
                       timeout=600, check=False)
    if "out of memory" in p.stderr.lower() or "DefaultCPUAllocator" in p.stderr:
        pytest.skip("not enough virtual memory for the strided views")
    assert p.returncode == 0, f"subprocess died (rc={p.returncode}): {p.stderr[-800:]}"
    diff = float(p.stdout.split("DIFF")[-1])
    assert diff < 1e-2
