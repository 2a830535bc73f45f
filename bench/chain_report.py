"""Compile the ring chain (`qfuse/kernels/products/ring_chain.py`) for sm_90a on a machine
without a GPU and report what bench/NOTES.md "The ring chain (Gluon)" records: registers,
spills and shared memory (ptxas -v), the PTX's TMA loads, acquire polls, release counts and
PDL instructions, and the highest register each partition's SASS uses after its
`setmaxnreg`; then the same for the timed form (``RingChain(..., timed=True)``).

    PYTHONPATH=. /tmp/t36/bin/python bench/chain_report.py [--sass DIR]

``--sass DIR`` also writes each compile's SASS there (``P3_g64_cb4.sass``, ``..._timed.sass``),
to compare the untimed kernel's instructions before and after a change.

Needs Triton 3.6 (the GPU machine's version: ``python -m venv /tmp/t36 &&
/tmp/t36/bin/pip install triton==3.6.0 torch==2.13.0``); uses the ptxas and cuobjdump that
ship inside the Triton wheel, no driver.
"""

import argparse
import os
import re
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, not the interpreter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import compile as triton_compile

from qfuse.kernels.products import qmatmul_ring as ring
from qfuse.kernels.products import ring_chain as rc

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
# (products, group, stage size in blocks): the layer chains (CB 4), g128, one product, and
# a chain with a K of an odd number of blocks (CB 1, 64 stages)
CASES = [(3, 64, 4), (3, 128, 4), (1, 64, 4), (4, 64, 1)]
PTX_COUNTS = {"TMA": r"cp\.async\.bulk\.tensor", "mma.sync": r"mma\.sync",
              "ld.acquire.gpu": r"ld\.acquire\.gpu", "red.release.gpu": r"red\.release\.gpu",
              "exit atom.acq_rel": r"atom\.acq_rel\.gpu", "nanosleep": r"nanosleep",
              "griddepcontrol.wait": r"griddepcontrol\.wait",
              "launch_dependents": r"griddepcontrol\.launch_dependents",
              "%clock": r"%clock(?!64)", "%clock64": r"%clock64", "%globaltimer": r"%globaltimer"}


def compile_chain(P, group, cb, nt=1, gdc=True, timed=False):
    """The chain kernel specialized as `RingChain` launches it (pointers 16-aligned; the
    timing buffer a constexpr None when untimed, as the launcher passes it)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    kernel = rc.kernel()
    flat = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)
    words = f"tensordesc<i32[{rc.TT}, 1, 128],{flat!r}>"
    scales = f"tensordesc<i32[{rc.TT}, {cb * 64 // group}, 8],{flat!r}>"
    pointers = ["*i32", "*i32", "*bf16", "*fp32", "*i32", "*i32", "*i32", "*i32", "*i32"]
    types = (pointers + [words, scales, scales] * rc.MAX_PRODUCTS + ["i32"] * 3
             + ["*i64" if timed else "constexpr"])
    consts = {"P": P, "MAXP": rc.MAX_PRODUCTS, "GROUP": group, "CB": cb,
              "STAGES": rc.chain_stages(cb, group), "NT": nt, "GDC": gdc,
              "CONSUMER_REGS": ring.MAXNREG_ONE_TILE + 32, "TIMED": timed}
    if not timed:
        consts["tim_ptr"] = None
    sig = dict(zip(kernel.arg_names, types))
    sig.update({name: "constexpr" for name in consts})
    aligned = list(range(len(pointers))) + ([kernel.arg_names.index("tim_ptr")] if timed else [])
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    return triton_compile(GluonASTSource(kernel, sig, consts, attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "maxnreg": ring.MAXNREG_ONE_TILE})


def partitions(sass):
    """(registers after setmaxnreg, highest register used) of each SASS region that
    begins at a USETMAXREG."""
    lines = sass.splitlines()
    marks = [(i, int(m.group(1), 16)) for i, line in enumerate(lines)
             if (m := re.search(r"USETMAXREG\.\w+\.CTAPOOL (?:UP\d, )?0x([0-9a-f]+)", line))]
    out = []
    for (i, regs), (j, _) in zip(marks, marks[1:] + [(len(lines), 0)]):
        used = [int(r) for r in re.findall(r"\bR(\d+)\b", "\n".join(lines[i:j]))]
        out.append((regs, max(used, default=-1)))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sass", metavar="DIR", help="write each compile's SASS here")
    args = parser.parse_args()
    if args.sass:
        os.makedirs(args.sass, exist_ok=True)
    for (P, group, cb), timed in [(case, t) for t in (False, True) for case in CASES]:
        kernel = compile_chain(P, group, cb, timed=timed)
        ptx = kernel.asm["ptx"]
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "k")
            with open(path + ".ptx", "w") as f:
                f.write(ptx)
            res = subprocess.run([os.path.join(BIN, "ptxas"), "-arch=sm_90a", "-v",
                                  path + ".ptx", "-o", path + ".cubin"],
                                 capture_output=True, text=True, check=True)
            sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", path + ".cubin"],
                                  capture_output=True, text=True, check=True).stdout
        if args.sass:
            name = f"P{P}_g{group}_cb{cb}{'_timed' if timed else ''}.sass"
            with open(os.path.join(args.sass, name), "w") as f:
                f.write(sass)
        info = "; ".join(line.split(":", 1)[-1].strip() for line in res.stderr.splitlines()
                         if "Used" in line or "spill" in line)
        counts = {name: len(re.findall(pat, ptx)) for name, pat in PTX_COUNTS.items()}
        print(f"{'timed ' if timed else ''}P={P} group={group} CB={cb} stages={rc.chain_stages(cb, group)} "
              f"shared={kernel.metadata.shared} B: {info}")
        print("  PTX:", counts)
        print("  SASS regions (setmaxnreg, highest register used):",
              sorted(set(partitions(sass))))


if __name__ == "__main__":
    main()
