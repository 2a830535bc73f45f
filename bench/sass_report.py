"""Compile qfuse's decode-attention split kernels for sm_90a on a machine without a GPU
and report registers, spills and the SASS instruction mix (no device time needed).

    python bench/sass_report.py --path codes --bits 4 --head-dim 128 --block-n 64
    PYTHONPATH=/tmp/t36lib python bench/sass_report.py --path ws --bits 4 --head-dim 256 --gqa 2

``--path ws`` is the warp-specialized Gluon kernel (kernels/attention/decode_attention_ws.py); it
needs Triton 3.6's Gluon API (the GPU machine's version: ``pip install --target
/tmp/t36lib --no-deps triton==3.6.0`` and put it first on PYTHONPATH). Its report names
each consumer loop (a loop with mma.sync and an mbarrier wait), whether it holds a
cross-warp barrier (BAR.SYNC) or a shared-memory store (STS), and its instructions per
iteration: static, and on the common path (without the blocks a forward branch inside
the loop skips, i.e. the lazy softmax rescale). Uses the ptxas and cuobjdump that ship
inside the Triton wheel.
"""

import argparse
import collections
import os
import re
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, not the interpreter

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import compile as triton_compile

from qfuse.kernels.attention import decode_attention, decode_attention_ws
from qfuse.testing import compile_attention_for_sm90

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
TARGET = GPUTarget("cuda", 90, 32)


def compile_split_kernel(bits, D, G, block_n, num_warps=4, num_stages=2, group=64, split=1024,
                         path="tensor_cores", merge=False, paged=False):
    """One of decode_attention.py's split kernels ("codes" or "tensor_cores"); ``merge``:
    with its MERGE epilogue (the default launch's one-launch form), over 64 split slots."""
    kernel = decode_attention.split_kernel(path)
    cache = "*u32" if bits else "*bf16"
    # pointers by name (the caches' words or values, everything else bf16 but these),
    # every other runtime argument a stride or count but the two float scalars
    pointers = {"k_ptr": cache, "v_ptr": cache, "lengths_ptr": "*i32", "table_ptr": "*i32",
                "part_o_ptr": "*fp32", "part_ml_ptr": "*fp32", "cnt_ptr": "*i32"}
    consts = {"HKV": 8, "G": G, "D": D, "BITS": bits, "GROUP": group, "SPLIT_N": split,
              "BLOCK_N": block_n, "WINDOW": False, "SOFTCAP": False, "LIBDEVICE": True,
              "GDC": False, "PAGE": 16 if paged else 1, "PAGED": paged, "MERGE": merge,
              "N_SPLITS": 64 if merge else 0, "S_CHUNK": decode_attention.MERGE_CHUNK}
    if path == "codes":
        consts["R"] = decode_attention.codes_rows(G, D, group)
    else:
        consts["GP"] = max(16, triton.next_power_of_2(G))
    return compile_attention_for_sm90(kernel, consts, pointers, num_warps,
                                      num_stages=num_stages)


def _compile_split_gluon(kernel, dt, bn, words_per_token, ng, consts, words_layout=None,
                         **options):
    """A Gluon split kernel of decode attention (the ws kernel), its
    descriptors typed as the launchers make them: words int32 [1, 1, bn, W] boxes,
    scales and biases as rows of 8 (unswizzled), pointers and q strides 16-aligned."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    w_layout = words_layout or gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32,
                                                    rank=4)
    s_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=4)
    words = f"tensordesc<i32[1, 1, {bn}, {words_per_token}],{w_layout!r}>"
    scales = f"tensordesc<{dt}[1, 1, {bn * ng // 8}, 8],{s_layout!r}>"
    types = [f"*{dt}", words, words] + [scales] * 4 + [
        "*i32", "*fp32", "*fp32", "i32", "i32", "i32", "fp32", "fp32", "i32"]
    sig = dict(zip(kernel.arg_names, types))
    sig.update({name: "constexpr" for name in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 7, 8, 9, 10, 11)}
    return triton_compile(GluonASTSource(kernel, sig, consts, attrs), target=TARGET,
                          options={"num_warps": 4, **options})


def compile_ws_kernel(bits, D, G, group=64, dtype=torch.bfloat16, stages=None, tpw=None,
                      split=1024, window=False, softcap=False, gdc=True):
    """The warp-specialized kernel, specialized as launch_split_ws would launch it."""
    from triton.experimental.gluon import language as gl

    ws = decode_attention_ws
    d_stages, d_tpw = ws.default_launch(D, bits)
    stages, tpw = stages or d_stages, tpw or d_tpw
    consts = ws.kernel_constants(G, D, bits, group, dtype, stages, tpw, split, 8, window, softcap,
                                 gdc)
    bn = ws.CONSUMERS * tpw
    w_layout = gl.NVMMASharedLayout.get_default_for([1, 1, bn, consts["WC"]], gl.int32)
    return _compile_split_gluon(ws.kernel(), "bf16" if dtype == torch.bfloat16 else "fp16", bn,
                                consts["WC"], consts["NG"], consts, w_layout,
                                maxnreg=ws.MAXNREG)


def sass_of(kernel) -> tuple[str, str]:
    """(ptxas -v summary, SASS) of a compiled kernel, assembled for sm_90a."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        res = subprocess.run([os.path.join(BIN, "ptxas"), "-arch=sm_90a", "-v", ptx, "-o", cubin],
                             capture_output=True, text=True, check=True)
        info = "\n".join(line.strip() for line in res.stderr.splitlines()
                         if "Used" in line or "spill" in line)
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", cubin],
                              capture_output=True, text=True, check=True).stdout
    return info, sass


def _instructions(sass):
    return [(int(a, 16), op) for a, op in
            re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)]


def _branches(sass):
    return [(int(m.group(1), 16), int(m.group(2), 16)) for m in
            re.finditer(r"/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?BRA\s+(?:\S+\s+)?0x([0-9a-f]+)", sass)]


def report(kernel) -> None:
    info, sass = sass_of(kernel)
    print(info)
    ops = _instructions(sass)
    for end, start in _branches(sass):
        if start < end:
            body = [op for addr, op in ops if start <= addr <= end]
            print(f"loop 0x{start:x}..0x{end:x}: {len(body)} instructions")
            print("  ", collections.Counter(body).most_common(14))


def consumer_loops(sass):
    """The innermost loops with mma.sync and an mbarrier wait: [(start, end, static
    count, common-path count, Counter of the common path)]."""
    ops = _instructions(sass)
    branches = _branches(sass)
    cands = []
    for end, start in branches:
        if start >= end:
            continue
        body = [op for addr, op in ops if start <= addr <= end]
        kinds = collections.Counter(op.split(".")[0] for op in body)
        # out-of-line blocks after a partition's EXIT branch back into loops: not loops
        if kinds["HMMA"] and kinds["SYNCS"] and not kinds["EXIT"] and not kinds["RET"]:
            cands.append((start, end))
    loops = []
    for start, end in cands:
        if any(s >= start and e <= end and (s, e) != (start, end) for s, e in cands):
            continue  # holds another candidate: an outer or out-of-line span
        skipped = set()
        for src, dst in branches:
            if start <= src < dst <= end:  # a block skipped on the common path
                skipped.update(a for a, _ in ops if src < a < dst)
        body = [(a, op) for a, op in ops if start <= a <= end]
        common = collections.Counter(op for a, op in body if a not in skipped)
        loops.append((start, end, len(body), sum(common.values()), common))
    return loops


def report_ws(kernel, tokens_per_iter: int) -> dict:
    """Registers, spills, setmaxnreg and the consumer loops of the ws kernel."""
    info, sass = sass_of(kernel)
    ptx = kernel.asm["ptx"]
    regs = sorted(set(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)))
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    print(info)
    print("setmaxnreg:", ", ".join(f"{kind} {n}" for kind, n in regs))
    print(f"shared memory: {kernel.metadata.shared} bytes")
    loops = consumer_loops(sass)
    for start, end, static, common, kinds in loops:
        bars = sum(n for op, n in kinds.items() if op.startswith("BAR"))
        sts = sum(n for op, n in kinds.items() if op.startswith("STS"))
        print(f"consumer loop 0x{start:x}..0x{end:x}: {static} instructions static, {common} on "
              f"the common path = {common / tokens_per_iter:.1f} per token (one warp, "
              f"{tokens_per_iter} tokens); BAR {bars}, STS {sts}")
        print("  ", kinds.most_common(16))
    return {"info": info, "loops": loops, "spills": spills}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--path", default="tensor_cores",
                   choices=("tensor_cores", "codes", "ws"))
    p.add_argument("--bits", type=int, default=4, help="0 for a dense bf16 cache")
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--gqa", type=int, default=2, help="query heads per kv head")
    p.add_argument("--group", type=int, default=64)
    p.add_argument("--block-n", type=int, default=64)
    p.add_argument("--num-warps", type=int, default=4)
    p.add_argument("--num-stages", type=int, default=None,
                   help="pipeline stages (default: 2; ws: ring stages, default per shape)")
    p.add_argument("--tokens-per-warp", type=int, default=None, help="ws only")
    p.add_argument("--fp16", action="store_true", help="ws only: fp16 q and scales")
    p.add_argument("--softcap", action="store_true", help="ws only")
    p.add_argument("--window", action="store_true", help="ws only")
    p.add_argument("--merge", action="store_true",
                   help="not ws: with the split kernel's own merge (the default launch's)")
    a = p.parse_args()
    if a.path == "ws":
        ws = decode_attention_ws
        kernel = compile_ws_kernel(a.bits, a.head_dim, a.gqa, a.group,
                                   torch.float16 if a.fp16 else torch.bfloat16, a.num_stages,
                                   a.tokens_per_warp, window=a.window, softcap=a.softcap)
        report_ws(kernel, a.tokens_per_warp or ws.default_launch(a.head_dim, a.bits)[1])
    else:
        report(compile_split_kernel(a.bits, a.head_dim, a.gqa, a.block_n, a.num_warps,
                                    a.num_stages or 2, group=a.group, path=a.path,
                                    merge=a.merge))


if __name__ == "__main__":
    main()
