"""Decode attention's merge in one launch: the Triton split kernels' MERGE epilogue (the
last split program of a sequence and kv head merges its query heads) against the
two-launch form (the separate merge kernel), bit for bit, over slotted and paged caches,
4-bit, 8-bit and dense, GQA, windows, length 0 and split programs with nothing to attend;
the unit counters left zero; which form runs; the fallback; and, compiled for sm_90
without a GPU, the register layouts that make the two forms sum in one order. CPU cases
run under the Triton interpreter; `gpu` cases take bf16, long contexts and CUDA graphs.

Run as a script (``python tests/test_decode_attention_merge.py --layouts``), it prints
the layout comparison as JSON: the compiled kernels need Triton without its interpreter,
which the test session has on.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from qfuse.testing import compile_attention_for_sm90, kernel_device, make_case, paged_copy

DEVICE = kernel_device()
gpu = pytest.mark.gpu
if __name__ != "__main__":
    kernels = pytest.importorskip("qfuse.kernels.attention.decode_attention")
    units = pytest.importorskip("qfuse.kernels.common.units")


def attend(q, k, v, lengths, scale, window=None, softcap=None, path=None, table=None,
           merge=None, **launch):
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    kernels.decode_attention_quantized_kv(
        q, k, v, lengths, scale, window, softcap, out=out, block_table=table,
        launch=kernels.AttentionLaunch(path=path, merge=merge, **launch))
    return out


def counters_are_zero(device) -> bool:
    return not units.unit_counters(torch.device(device)).any()


def both_forms(q, k, v, lengths, scale, window=None, softcap=None, path=None, table=None,
               **launch):
    """(one launch, one launch again, two launches), the counters checked after each."""
    outs = []
    for merge in ("fused", "fused", "separate"):
        outs.append(attend(q, k, v, lengths, scale, window, softcap, path, table, merge,
                           **launch))
        assert counters_are_zero(q.device), f"counters left non-zero by merge={merge}"
    return outs


# Nmax 640: splits of 256 tokens, 3 of them in 16 split slots, so most programs of every
# (sequence, kv head) have nothing to attend; sequence 2 has length 0, and with a window
# of 50, sequence 3 (600 tokens) attends its last split only.
LENGTHS = [1, 97, 0, 600]


@pytest.mark.parametrize("bits,path,D,Hq,window,softcap", [
    (0, "tensor_cores", 64, 4, None, None),
    (0, "tensor_cores", 64, 2, 50, None),  # G = 1
    (4, "tensor_cores", 64, 4, 50, None),
    (8, "tensor_cores", 64, 8, None, 20.0),  # G = 4
    (4, "codes", 128, 8, 50, None),
    (8, "codes", 64, 4, None, None),
])
@pytest.mark.parametrize("layout", ["slotted", "paged"])
def test_one_launch_is_bitwise_the_two_launch_form(bits, path, D, Hq, window, softcap, layout):
    q, k, v, lengths = make_case(4, Hq, 2, D, 640, LENGTHS, bits, torch.float16, DEVICE)
    table = None
    if layout == "paged":
        k, table = paged_copy(k, lengths, 32, seed=1, window=window)
        v, _ = paged_copy(v, lengths, 32, seed=1, window=window)
    fused, again, separate = both_forms(q, k, v, lengths, 0.125, window, softcap, path, table)
    assert torch.equal(fused, separate)
    assert torch.equal(fused, again)
    assert torch.equal(fused[2], torch.zeros_like(fused[2]))  # length 0: defined zeros
    assert not fused.isnan().any()


def test_smaller_splits_and_more_arrivals():
    """64-token splits: ten splits of a 600-token sequence arrive on one counter."""
    q, k, v, lengths = make_case(2, 4, 2, 64, 640, [600, 130], 4, torch.float16, DEVICE)
    fused, again, separate = both_forms(q, k, v, lengths, 0.125, 200, path="tensor_cores",
                                        split=64, block_n=32)
    assert torch.equal(fused, separate) and torch.equal(fused, again)


def _counted_merges(monkeypatch, fused_on_cuda: bool) -> list:
    """The GPU default set to ``fused_on_cuda``; the list gets an entry per launch of the
    separate merge kernel."""
    monkeypatch.setattr(kernels, "FUSED_MERGE_ON_CUDA", fused_on_cuda)
    calls = []
    merge_splits = kernels.merge_splits
    monkeypatch.setattr(kernels, "merge_splits", lambda *a, **kw: calls.append(1)
                        or merge_splits(*a, **kw))
    return calls


def test_the_default_launch_merges_in_the_split_kernel(monkeypatch):
    """Under the interpreter, and on a GPU once the fused merge is its default there."""
    calls = _counted_merges(monkeypatch, fused_on_cuda=True)
    q, k, v, lengths = make_case(2, 4, 2, 64, 64, [33, 64], 8, torch.float16, DEVICE)
    default = attend(q, k, v, lengths, 0.1)
    assert calls == []  # one launch
    separate = attend(q, k, v, lengths, 0.1, merge="separate")
    assert calls == [1]
    assert torch.equal(default, separate)


@gpu
def test_gpu_default_merges_separately_until_measured(monkeypatch):
    calls = _counted_merges(monkeypatch, fused_on_cuda=False)
    q, k, v, lengths = make_case(2, 4, 2, 64, 64, [33, 64], 8, torch.bfloat16, DEVICE)
    attend(q, k, v, lengths, 0.1)
    assert calls == [1]


def test_too_many_units_merge_separately(monkeypatch):
    """B·Hkv past the counters: the default takes two launches, "fused" is refused."""
    monkeypatch.setattr(kernels, "FUSED_MERGE_ON_CUDA", True)
    q, k, v, lengths = make_case(2, 4, 2, 64, 64, [33, 64], 0, torch.float16, DEVICE)
    expected = attend(q, k, v, lengths, 0.1, merge="separate")
    monkeypatch.setattr(kernels, "UNIT_SLOTS", 3)  # 4 (sequence, kv head) pairs
    assert kernels.merge_counters(4, torch.device(DEVICE)) is None
    assert kernels.merge_counters(3, torch.device(DEVICE)) is not None
    calls = []
    merge_splits = kernels.merge_splits
    monkeypatch.setattr(kernels, "merge_splits", lambda *a, **kw: calls.append(1)
                        or merge_splits(*a, **kw))
    assert torch.equal(attend(q, k, v, lengths, 0.1), expected)
    assert calls == [1]
    with pytest.raises(ValueError, match=r"fused merge.*4 \(sequence, kv head\) pairs"):
        attend(q, k, v, lengths, 0.1, merge="fused")


@pytest.mark.parametrize("options,match", [
    ({"merge": "atomic"}, "merge must be one of fused, separate"),
    ({"path": "ws", "merge": "fused"}, "ws path keeps its separate merge")])
def test_merge_options_are_checked(options, match):
    with pytest.raises(ValueError, match=match):
        kernels.AttentionLaunch(**options)


# ---- the layouts behind "the same bits", compiled for sm_90 without a GPU ----

# (path, bits, head dim, G, tokens per tile): the tensor-core kernel's q tile is [16, D]
# bf16, the shape a [16, D] merge tile would have had.
LAYOUT_CASES = [("tensor_cores", 4, 128, 2, 64), ("codes", 4, 256, 2, 128)]


def _tensors(line):
    """The tensor<...> types of one line of TTGIR (angle brackets balanced)."""
    out, i = [], 0
    while (i := line.find("tensor<", i)) >= 0:
        depth, j = 0, i + len("tensor")
        while True:
            depth += {"<": 1, ">": -1}.get(line[j], 0)
            j += 1
            if depth == 0:
                break
        out.append(line[i:j])
        i = j
    return out


def _layout_ops(ttgir):
    """(op, its tensor types with each layout alias spelled out) for each load, store,
    dot, layout conversion and reduction of a kernel's TTGIR."""
    import re

    aliases = dict(re.findall(r"^(#\w+) = (#ttg[^\n]*)$", ttgir, re.MULTILINE))

    def spell(t):
        return re.sub(r"#(?:blocked|mma|shared|linear)\d*\b",
                      lambda m: aliases.get(m.group(0), m.group(0)), t)

    ops = []
    for line in ttgir.splitlines():
        m = re.search(r"\b(tt\.load|tt\.store|tt\.dot|ttg\.convert_layout)\b", line)
        op = m.group(1) if m else ("reduce" if re.match(r"\s*\}\) : \(tensor", line) else None)
        if op:
            cg = op == "tt.load" and "cache_modifier = cg" in line
            ops.append((op + (".cg" if cg else ""), tuple(spell(t) for t in _tensors(line))))
    return ops


def _compile(kernel, consts, pointers, num_warps=4):
    """TTGIR of ``kernel`` for sm_90 (no GPU needed)."""
    return compile_attention_for_sm90(kernel, consts, pointers, num_warps).asm["ttgir"]


def _merge_side(ops, loads: str, tile: str) -> list[str]:
    """The merge's anchors among ``ops``: its float32 loads (op ``loads``) and the
    reduction of its tile (``tile``, the type's start)."""
    return sorted({str(types) for op, types in ops if types and (
        (op == loads and "f32" in types[0]) or (op == "reduce" and types[0].startswith(tile)))})


def layout_report() -> dict:
    """Per case: the merge's layouts in the split kernel (its .cg loads and the reduction
    of its [S_CHUNK, 1, D] tile) against the merge kernel's, and whether the split
    kernel's own ops kept their layouts beside the epilogue."""
    from qfuse.kernels.attention import decode_attention as attn

    n_splits, report = 64, {}
    for path, bits, D, G, block_n in LAYOUT_CASES:
        cache = "*u32" if bits else "*bf16"
        pointers = {"k_ptr": cache, "v_ptr": cache, "lengths_ptr": "*i32",
                    "table_ptr": "*i32", "part_o_ptr": "*fp32", "part_ml_ptr": "*fp32",
                    "cnt_ptr": "*i32"}
        consts = {"HKV": 8, "G": G, "D": D, "BITS": bits, "GROUP": 64, "SPLIT_N": 256,
                  "BLOCK_N": block_n, "WINDOW": True, "SOFTCAP": False, "LIBDEVICE": True,
                  "GDC": False, "PAGE": 1, "PAGED": False, "S_CHUNK": attn.MERGE_CHUNK,
                  "R": attn.codes_rows(G, D, 64), "GP": max(16, 1 << (G - 1).bit_length())}
        kernel = attn.split_kernel(path)
        plain = _layout_ops(_compile(kernel, {**consts, "MERGE": False, "N_SPLITS": 0},
                                     pointers))
        fused = _layout_ops(_compile(kernel, {**consts, "MERGE": True, "N_SPLITS": n_splits},
                                     pointers))
        merge = _layout_ops(_compile(
            attn.merge_kernel(), {"N_SPLITS": n_splits, "S_CHUNK": attn.MERGE_CHUNK, "HQ": 8 * G,
                                  "D": D, "SPLIT_N": 256, "WINDOW": True, "GDC": False},
            {"part_o_ptr": "*fp32", "part_ml_ptr": "*fp32", "lengths_ptr": "*i32"}))
        tile = f"tensor<{attn.MERGE_CHUNK}x1x{D}xf32"
        fused_merge = _merge_side(fused, "tt.load.cg", tile)
        separate_merge = _merge_side(merge, "tt.load", tile)
        kept = all(fused.count(op) >= plain.count(op) for op in set(plain))
        report[f"{path} kv{bits} D{D} G{G}"] = {
            "merge_ops": len(fused_merge), "merge_same": fused_merge == separate_merge,
            "split_kept": kept}
    return report


def test_the_fused_merge_sums_in_the_separate_merges_order():
    """Triton gives a load the widest vector of any same-shaped access in its kernel: a
    [16, D] merge tile beside the tensor-core kernel's [16, D] bf16 q tile took 8 floats
    a thread, not 4, and summed the splits in another order. Compiled here for sm_90: the
    merge inside each split kernel has the separate merge's layouts, and the split
    kernel's own ops keep theirs."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, __file__, "--layouts"], capture_output=True,
                         text=True, env=env, timeout=600, check=False)
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    report = json.loads(res.stdout)
    assert set(report) == {f"{p} kv{b} D{d} G{g}" for p, b, d, g, _ in LAYOUT_CASES}
    for case, found in report.items():
        assert found["merge_ops"] >= 4, (case, found)  # the parse saw the merge's tiles
        assert found["merge_same"] and found["split_kept"], (case, found)


# ---- GPU: bf16, long contexts, CUDA graphs ----


@gpu
@pytest.mark.parametrize("bits,path", [(0, None), (4, "codes"), (8, "codes"),
                                       (4, "tensor_cores"), (8, "tensor_cores")])
@pytest.mark.parametrize("D,Hq,Hkv", [(64, 8, 8), (128, 32, 8), (256, 16, 8), (512, 8, 1)])
@pytest.mark.parametrize("window", [None, 1000])
def test_gpu_one_launch_is_bitwise_the_two_launch_form(bits, path, D, Hq, Hkv, window):
    q, k, v, lengths = make_case(6, Hq, Hkv, D, 5000, [1, 97, 1025, 4999, 0, 2048], bits,
                                 torch.bfloat16, "cuda")
    if path and kernels.path_reason(path, q, k, v):
        pytest.skip(f"{path}: {kernels.path_reason(path, q, k, v)}")
    fused, again, separate = both_forms(q, k, v, lengths, D**-0.5, window, path=path)
    assert torch.equal(fused, separate)
    assert torch.equal(fused, again)
    assert not fused.isnan().any()


@gpu
@pytest.mark.parametrize("bits,path", [(0, None), (4, "codes"), (4, "tensor_cores")])
def test_gpu_paged_and_long(bits, path):
    q, k, v, lengths = make_case(4, 16, 8, 256, 32768, [32768, 3, 20000, 0], bits,
                                 torch.bfloat16, "cuda")
    kp, table = paged_copy(k, lengths, 64, seed=2, window=4096)
    vp, _ = paged_copy(v, lengths, 64, seed=2, window=4096)
    fused, again, separate = both_forms(q, kp, vp, lengths, 0.0625, 4096, path=path,
                                        table=table)
    assert torch.equal(fused, separate) and torch.equal(fused, again)


@gpu
def test_gpu_other_warps():
    """num_warps 8: both forms merge on the split kernel's warps."""
    q, k, v, lengths = make_case(3, 16, 8, 128, 3000, [2999, 1, 1500], 4, torch.bfloat16,
                                 "cuda")
    fused, again, separate = both_forms(q, k, v, lengths, 0.088, path="tensor_cores",
                                        num_warps=8)
    assert torch.equal(fused, separate) and torch.equal(fused, again)


@gpu
def test_gpu_graph_replays_the_one_launch_form():
    q, k, v, lengths = make_case(2, 16, 8, 256, 2048, [100, 500], 4, torch.bfloat16, "cuda")
    static_len = lengths.clone()
    attend(q, k, v, static_len, 0.0625)  # eager first: compiles, allocates the counters
    torch.cuda.synchronize()
    out = torch.empty_like(q)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.decode_attention_quantized_kv(q, k, v, static_len, 0.0625, out=out)
    for n in ([100, 500], [101, 777], [1000, 1300]):
        static_len.copy_(torch.tensor(n, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, attend(q, k, v, static_len, 0.0625, merge="separate"))
        assert counters_are_zero("cuda")


if __name__ == "__main__" and sys.argv[1:] == ["--layouts"]:
    os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, not the interpreter
    print(json.dumps(layout_report()))
