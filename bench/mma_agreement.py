"""Probe (Hopper): do `mma.sync` and `wgmma` give the same float32 bits for the same
bf16 products? Usage: python bench/mma_agreement.py OUT_DIR (writes
mma_agreement.json there).

Why: batch invariance across 32 and 33 rows (issue 30, item 5) needs the wgmma product
(33-256 rows) to compute each row as the fragment kernel (1-32 rows, mma.sync m16n8k16)
does. Both can be given the same operands in the same k order and the same fold of the
scales; what no document says is whether the two instructions add a k16 chunk's
sixteen products and the accumulator in the same way (the tensor cores' internal sum is
not IEEE round-to-nearest at each add). This measures it: C = C0 + A·B over K = 64 (four
k16 chunks, in order, as both kernels chain them), A [64, 64] and B [64, 8] bf16, once
by mma.sync (Gluon's `mma_v2`, four warps of m16n8k16) and once by wgmma (one
warpgroup, m64n8k16, A from registers as the product kernels take it), on operands
shaped like the kernels' (the codes 128 + c against x; the all-ones A of Σx) and on
adversarial ones (exponents spread over ±20, cancellation), with C0 zero and random.
If every case agrees bit for bit, the wgmma kernel can take the fragment kernel's
arithmetic and rows 1-256 can be one row-invariant product; if not, the first
differing case says how (bench/NOTES.md, "Batched rows").
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from qfuse.kernels.common.gluon_hopper import (
    fence_async_shared,
    gl,
    gluon,
    mma_v2,
    warpgroup_mma,
    warpgroup_mma_wait,
)

M, N, K = 64, 8, 64

if gluon is not None:
    @gluon.jit
    def _mma_sync_kernel(a_ptr, b_ptr, c_ptr):
        """C [64, 8] = C0 + A [64, 64]·B [64, 8] by mma.sync, k16 chunks in order."""
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, 8])
        A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        rm = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
        cn = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
        acc = gl.load(c_ptr + gl.expand_dims(rm, 1) * 8 + gl.expand_dims(cn, 0))
        ar = gl.arange(0, 64, layout=gl.SliceLayout(1, A))
        ak = gl.arange(0, 16, layout=gl.SliceLayout(0, A))
        bk = gl.arange(0, 16, layout=gl.SliceLayout(1, B))
        bn = gl.arange(0, 8, layout=gl.SliceLayout(0, B))
        for k0 in gl.static_range(0, 64, 16):
            a = gl.load(a_ptr + gl.expand_dims(ar, 1) * 64 + k0 + gl.expand_dims(ak, 0))
            b = gl.load(b_ptr + (k0 + gl.expand_dims(bk, 1)) * 8 + gl.expand_dims(bn, 0))
            acc = mma_v2(a, b, acc)
        gl.store(c_ptr + gl.expand_dims(rm, 1) * 8 + gl.expand_dims(cn, 0), acc)

    @gluon.jit
    def _wgmma_kernel(a_ptr, bt_ptr, c_ptr):
        """The same by wgmma: A from registers, Bᵀ [8, 64] K-major in shared memory (as
        the kernels hold x and q), four k16 HGMMA chained on the accumulator."""
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, 8, 16])
        A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
        BL: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [1, 4], [1, 0])
        B_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128,
                                                    element_bitwidth=16, rank=2)
        rm = gl.arange(0, 64, layout=gl.SliceLayout(1, ACC))
        cn = gl.arange(0, 8, layout=gl.SliceLayout(0, ACC))
        acc = gl.load(c_ptr + gl.expand_dims(rm, 1) * 8 + gl.expand_dims(cn, 0))
        ar = gl.arange(0, 64, layout=gl.SliceLayout(1, A))
        ak = gl.arange(0, 64, layout=gl.SliceLayout(0, A))
        a = gl.load(a_ptr + gl.expand_dims(ar, 1) * 64 + gl.expand_dims(ak, 0))
        bn = gl.arange(0, 8, layout=gl.SliceLayout(1, BL))
        bk = gl.arange(0, 64, layout=gl.SliceLayout(0, BL))
        b_s = gl.allocate_shared_memory(gl.bfloat16, [8, 64], B_SMEM)
        b_s.store(gl.load(bt_ptr + gl.expand_dims(bn, 1) * 64 + gl.expand_dims(bk, 0)))
        fence_async_shared()
        gl.thread_barrier()
        acc = warpgroup_mma(a, b_s.permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc, a])[0]
        gl.store(c_ptr + gl.expand_dims(rm, 1) * 8 + gl.expand_dims(cn, 0), acc)


def operands(case: str, gen: torch.Generator):
    """(A [64, 64] bf16, B [64, 8] bf16) of a named case, on the CPU."""
    def spread(shape):  # bf16 values whose exponents span ±20
        x = torch.randn(shape, generator=gen) * 2.0 ** torch.randint(-20, 21, shape, generator=gen)
        return x.bfloat16()

    x = (torch.randn(K, N, generator=gen) * 0.5).bfloat16()
    if case == "codes":  # the product kernels' A: 128 + c, c a 4-bit code, exact in bf16
        return (128 + torch.randint(0, 16, (M, K), generator=gen)).bfloat16(), x
    if case == "ones":  # the all-ones A of the fragment kernel's Σx
        return torch.ones(M, K).bfloat16(), x
    if case == "spread":
        return spread((M, K)), spread((K, N))
    if case == "cancel":  # large terms of both signs beside small ones
        big = torch.randn(K, N, generator=gen) * 2.0 ** 12
        small = torch.randn(K, N, generator=gen) * 2.0 ** -6
        b = torch.where(torch.rand(K, N, generator=gen) < 0.5, big, small)
        return (128 + torch.randint(0, 16, (M, K), generator=gen)).bfloat16(), b.bfloat16()
    raise ValueError(case)


def compare(a: torch.Tensor, b: torch.Tensor, c0: torch.Tensor) -> dict:
    """Run both kernels on the GPU; how their float32 results differ."""
    dev = torch.device("cuda")
    a, b = a.to(dev).contiguous(), b.to(dev).contiguous()
    out = []
    for kernel, b_arg in ((_mma_sync_kernel, b), (_wgmma_kernel, b.t().contiguous())):
        c = c0.to(dev).clone()
        kernel[(1,)](a, b_arg, c, num_warps=4)
        out.append(c)
    sync, wg = out
    exact = a.double() @ b.double() + c0.to(dev).double()
    differ = (sync.view(torch.int32) != wg.view(torch.int32))
    return {"equal": bool(not differ.any()), "differing": int(differ.sum()),
            "max_abs_diff": float((sync - wg).abs().max()),
            "max_err_mma_sync": float((sync.double() - exact).abs().max()),
            "max_err_wgmma": float((wg.double() - exact).abs().max())}


def main(out_dir: str) -> int:
    if gluon is None or not torch.cuda.is_available() or \
            torch.cuda.get_device_capability()[0] != 9:
        print("mma_agreement: needs Gluon and a Hopper GPU", file=sys.stderr)
        return 2
    from qfuse.bench import common

    gen = torch.Generator().manual_seed(0)
    results = {}
    for case in ("codes", "ones", "spread", "cancel"):
        for c0_name in ("zero", "random"):
            trials = []
            for _ in range(20):
                a, b = operands(case, gen)
                c0 = (torch.zeros(M, N) if c0_name == "zero"
                      else torch.randn(M, N, generator=gen) * 100.0)
                trials.append(compare(a, b, c0))
            results[f"{case}, C0 {c0_name}"] = {
                "trials": len(trials), "all_equal": all(t["equal"] for t in trials),
                "differing_elements": sum(t["differing"] for t in trials),
                "max_abs_diff": max(t["max_abs_diff"] for t in trials),
                "max_err_mma_sync": max(t["max_err_mma_sync"] for t in trials),
                "max_err_wgmma": max(t["max_err_wgmma"] for t in trials)}
            print(f"{case}, C0 {c0_name}: {results[f'{case}, C0 {c0_name}']}")
    path = Path(out_dir) / "mma_agreement.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": common.metadata(), "M": M, "N": N, "K": K,
                                "cases": results}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "bench/results"))
