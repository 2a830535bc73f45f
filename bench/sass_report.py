"""Compile qfuse's decode-attention split kernel for sm_90a on a machine without a GPU
and report registers, spills and the SASS instruction mix (no device time needed).

    python bench/sass_report.py --bits 4 --head-dim 128 --block-n 64

Uses the ptxas and cuobjdump that ship inside the Triton wheel.
"""

import argparse
import collections
import os
import re
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, not the interpreter

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler import compile as triton_compile  # noqa: E402

from qfuse.kernels.decode_attention import (  # noqa: E402
    _decode_split_cc_kernel,
    _decode_split_kernel,
)

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_split_kernel(bits, D, G, block_n, num_warps=4, num_stages=2, group=64, split=1024,
                         cuda_cores=False, prefetch=False):
    kernel = _decode_split_cc_kernel if cuda_cores else _decode_split_kernel
    ptr = "*u32" if bits else "*bf16"
    types = ["*bf16", ptr, "*bf16", "*bf16", ptr, "*bf16", "*bf16", "*i32", "*fp32", "*fp32"]
    types += ["i32"] * 18 + ["i32", "fp32", "fp32", "i32"]
    sig = dict(zip(kernel.arg_names, types))
    consts = dict(HKV=8, G=G, **({} if cuda_cores else {"GP": max(16, G)}), D=D, BITS=bits, GROUP=group, SPLIT_N=split,
                  BLOCK_N=block_n, WINDOW=False, SOFTCAP=False, LIBDEVICE=True,
                  **({} if cuda_cores else {"PREFETCH": prefetch}))
    sig.update({name: "constexpr" for name in consts})
    # As a real launch specializes them: pointers and strides divisible by 16,
    # except the per-token stride of scales/biases (D/g groups, e.g. 4).
    aligned = [i for i in range(25) if i not in (17, 23)]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    return triton_compile(ASTSource(kernel, sig, consts, attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def report(kernel) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        res = subprocess.run([os.path.join(BIN, "ptxas"), "-arch=sm_90a", "-v", ptx, "-o", cubin],
                             capture_output=True, text=True, check=True)
        print("\n".join(line for line in res.stderr.splitlines() if "Used" in line or "spill" in line))
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", cubin],
                              capture_output=True, text=True, check=True).stdout
    ops = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass)
    loops = [(int(m.group(2), 16), int(m.group(1), 16)) for m in
             re.finditer(r"/\*([0-9a-f]+)\*/\s+@!?P\d\s+BRA\s+0x([0-9a-f]+)", sass)]
    for start, end in loops:
        if start < end:
            body = [op for addr, op in ops if start <= int(addr, 16) <= end]
            print(f"loop 0x{start:x}..0x{end:x}: {len(body)} instructions")
            print("  ", collections.Counter(body).most_common(14))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bits", type=int, default=4, help="0 for a dense bf16 cache")
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--gqa", type=int, default=2, help="query heads per kv head")
    p.add_argument("--block-n", type=int, default=64)
    p.add_argument("--num-warps", type=int, default=4)
    p.add_argument("--num-stages", type=int, default=2)
    p.add_argument("--cuda-cores", action="store_true", help="the CUDA-core quantized kernel")
    p.add_argument("--prefetch", action="store_true", help="scales/biases one tile ahead")
    a = p.parse_args()
    report(compile_split_kernel(a.bits, a.head_dim, a.gqa, a.block_n, a.num_warps, a.num_stages,
                                cuda_cores=a.cuda_cores, prefetch=a.prefetch))


if __name__ == "__main__":
    main()
