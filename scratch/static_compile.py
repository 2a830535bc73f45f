"""Compile a Triton kernel for sm_90 on this CPU-only machine and report ptxas resources."""
import os, re, subprocess, sys, tempfile
os.environ.pop("TRITON_INTERPRET", None)
import triton, triton.language as tl
from triton.compiler import ASTSource, compile as tcompile
from triton.backends.compiler import GPUTarget
from qfuse.kernels.decode_attention import _decode_split_kernel
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")

def report(fn, sig, consts, num_warps=4, num_stages=2, tag=""):
    src = ASTSource(fn, sig, consts)
    k = tcompile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})
    ptx = k.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    out = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", "/tmp/k.cubin"], capture_output=True, text=True)
    info = " ".join(l.strip() for l in out.stderr.splitlines() if "registers" in l or "spill" in l or "stack" in l)
    counts = {op: len(re.findall(rf"^\s*{op}", ptx, re.M)) for op in ("ld.global", "ld.shared", "st.shared", "mma", "wgmma", "shf", "lop3", "and.b32", "or.b32", "cvt", "fma", "mul.f32", "add.f32", "sub.f32", "bar.sync", "shfl")}
    print(tag, info, counts)
    return k

def attn(bits, D, G, bn, nw=4, ns=2, group=64, hkv=8, split=1024):
    sig = {n: t for n, t in zip(_decode_split_kernel.arg_names, [
        "*bf16", "*u32" if bits else "*bf16", "*bf16", "*bf16", "*u32" if bits else "*bf16", "*bf16", "*bf16",
        "*i32", "*fp32", "*fp32"] + ["i32"] * 18 + ["i32", "fp32", "fp32", "i32"])}
    consts = dict(HKV=hkv, G=G, GP=max(16, G), D=D, BITS=bits, GROUP=group, SPLIT_N=split, BLOCK_N=bn,
                  WINDOW=False, SOFTCAP=False, LIBDEVICE=True)
    for c in consts: sig[c] = "constexpr"
    return report(_decode_split_kernel, sig, consts, nw, ns, tag=f"bits{bits} D{D} bn{bn} w{nw} s{ns}")

if __name__ == "__main__":
    for args in [(0, 256, 2, 32), (4, 256, 2, 64), (4, 256, 2, 32), (8, 256, 2, 64), (4, 128, 4, 64)]:
        k = attn(*args)
    open("/tmp/last.ptx", "w").write(k.asm["ptx"])
