"""Case builders and references for the tests (benches may use them too).

Decode attention: caches whose unused slots hold NaN (so a kernel that reads past a
sequence's length shows it), the same tokens scattered into a paged pool
(`paged_copy`), and the kernel-vs-compat error pair of the gate rule.

Quantized products: a weight and its input (`linear_case`), and the same error pair for
a linear or an MLP against a float32 or float64 reference on the dequantized weights
(`linear_errors`, `mlp_errors`). Bit patterns: `assert_bitwise_equal`.

Planted fast tiers for the model-level gate on a CPU (`planted_ops`): the reference with
a fault injected (or an honest fast product), counted as a kernel dispatch so the gate
sees one run.

Offline compiles: a decode-attention kernel for sm_90 without a GPU
(`compile_attention_for_sm90`), for the layout tests and `bench/sass_report.py`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from qfuse import levers, ops, reference
from qfuse.quant import QuantizedTensor, pack, quantize, unpack


def kernel_device() -> str:
    """Where kernel tests run: the GPU if there is one, else the CPU, where the tests'
    conftest has Triton's interpreter on."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def make_case(B, Hq, Hkv, D, n_max, lengths, bits, dtype, device, group_size=64, seed=0):
    """q, k, v, lengths, where k/v slots at or past each length are NaN (scales,
    biases and dense values) and their packed words are all ones."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, Hq, D, generator=g).to(dtype).to(device)
    kf = torch.randn(B, Hkv, n_max, D, generator=g).to(dtype).to(device)
    vf = torch.randn(B, Hkv, n_max, D, generator=g).to(dtype).to(device)
    lengths = torch.tensor(lengths, dtype=torch.int32, device=device)
    unused = torch.arange(n_max, device=device)[None, :] >= lengths[:, None].long()  # [B, N]
    if bits == 0:
        k, v = kf.clone(), vf.clone()
        for t in (k, v):
            t[unused[:, None, :, None].expand_as(t)] = float("nan")
    else:
        k = QuantizedTensor.from_float(kf, group_size, bits)
        v = QuantizedTensor.from_float(vf, group_size, bits)
        for t in (k, v):
            mask = unused[:, None, :].expand(t.scales.shape[:-1])
            t.scales[mask] = float("nan")
            t.biases[mask] = float("nan")
            t.packed.view(torch.int32)[mask] = -1
    return q, k, v, lengths


def paged_copy(t, lengths: torch.Tensor, page: int, seed: int = 0, window: int | None = None,
               spare_pages: int = 3):
    """The slotted cache ``t`` [B, Hkv, N, D] (dense or quantized, N a multiple of ``page``)
    as a pool of pages in shuffled order, and its int32 block table [B, N / page]: (pool,
    table). Pages holding no token a sequence attends (past its length, or wholly before
    its window) get entry -1 and no page; the pool's ``spare_pages`` extra pages, like
    every page no entry names, hold NaN (all-ones words), as `make_case`'s unused slots
    do. Call it for k and v with one seed: the same table."""
    B, Hkv, N, _ = t.shape
    if N % page:
        raise ValueError(f"N = {N} is not a multiple of the page size {page}")
    P = N // page
    g = torch.Generator(device="cpu").manual_seed(seed)
    order = torch.randperm(B * P + spare_pages, generator=g)[:B * P].reshape(B, P)
    start = torch.arange(P) * page
    L = lengths.cpu().to(torch.int64)[:, None]
    first = (L - window).clamp(min=0) if window is not None else torch.zeros_like(L)
    held = (start[None, :] < L) & (start[None, :] + page > first)
    table = torch.where(held, order, -1).to(torch.int32)

    def scatter(x, fill):
        pool = torch.full((B * P + spare_pages, Hkv, page, *x.shape[3:]), fill, dtype=x.dtype,
                          device=x.device)
        pages = x.reshape(B, Hkv, P, page, *x.shape[3:]).transpose(1, 2)  # [B, P, Hkv, page, ..]
        pool[order[held].to(x.device)] = pages[held.to(x.device)]
        return pool

    if isinstance(t, QuantizedTensor):
        words = scatter(t.packed.view(torch.int32), -1).view(torch.uint32)
        pool = QuantizedTensor(words, scatter(t.scales, float("nan")),
                               scatter(t.biases, float("nan")), t.group_size, t.bits)
    else:
        pool = scatter(t, float("nan"))
    return pool, table.to(lengths.device)


def float32_reference(q, k, v, lengths, scale, window=None, softcap=None):
    kd = k.dequantize(torch.float32) if isinstance(k, QuantizedTensor) else k.float()
    vd = v.dequantize(torch.float32) if isinstance(v, QuantizedTensor) else v.float()
    return reference.decode_attention(q.float(), kd, vd, lengths, scale, window, softcap)


def errors(out, q, k, v, lengths, scale, window=None, softcap=None):
    """(kernel error, compat error) in max-abs against the float32 reference."""
    ref32 = float32_reference(q, k, v, lengths, scale, window, softcap)
    compat = reference.decode_attention(q, k, v, lengths, scale, window, softcap)
    return ((out.float() - ref32).abs().max().item(),
            (compat.float() - ref32).abs().max().item())


def linear_case(M, N, K, bits, group, seed, dtype=torch.bfloat16, device="cpu"):
    """x [M, K] in ``dtype`` and a ``bits``-bit weight [N, K] quantized from bf16 values of
    scale K**-0.5 (outputs of about unit size), drawn from one generator on ``device``."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = QuantizedTensor.from_float(
        (torch.randn(N, K, generator=g, device=device) * K**-0.5).bfloat16(), group, bits)
    return torch.randn(M, K, generator=g, device=device).to(dtype), w


def cuda_4bit_case(M, N, K, group, seed):
    """`linear_case` at 4 bits on the GPU: the inputs of the fragment-weight kernels' tests."""
    return linear_case(M, N, K, 4, group, seed, device="cuda")


def on_hopper() -> bool:
    """Whether a Hopper GPU (sm_90) is here: the Gluon kernels' GPU tests need one."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def check_bf16_product(out, x, w, bias=None, residual=None):
    """Assert a bf16 product kernel's output: x's rows by w's rows, bf16, no NaN, and within
    twice compat's max-abs error against float64 (the products' shared rule)."""
    err, err_compat = linear_errors(out, x, w, bias, residual, torch.float64)
    assert out.shape == (*x.shape[:-1], w.shape[0]) and out.dtype == torch.bfloat16
    assert not out.isnan().any()
    assert err <= 2 * err_compat, (err, err_compat)


def linear_errors(out, x, w, bias=None, residual=None, precision=torch.float32):
    """(kernel error, compat error) in max-abs against residual + x·dequant(w)ᵀ + bias in
    ``precision`` (float32 or float64), compat being `reference.linear` then the residual."""
    ref = x.to(precision) @ w.dequantize(torch.float32).to(precision).T
    if bias is not None:
        ref = ref + bias.to(precision)
    if residual is not None:
        ref = ref + residual.to(precision)
    compat = reference.linear(x, w, bias)
    if residual is not None:
        compat = residual + compat
    return ((out.to(precision) - ref).abs().max().item(),
            (compat.to(precision) - ref).abs().max().item())


def mlp_errors(out, x, gate, up, down, act, residual=None, precision=torch.float32):
    """(kernel error, compat error) in max-abs against `reference.mlp` in ``precision`` on
    the dequantized weights, compat being `reference.mlp` on the quantized ones."""
    deq = [w.dequantize(torch.float32).to(precision) for w in (gate, up, down)]
    ref = reference.mlp(x.to(precision), *deq, act,
                        None if residual is None else residual.to(precision))
    compat = reference.mlp(x, gate, up, down, act, residual)
    return ((out.to(precision) - ref).abs().max().item(),
            (compat.to(precision) - ref).abs().max().item())


_INT_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


def assert_bitwise_equal(out: torch.Tensor, ref: torch.Tensor) -> None:
    """NaN exactly where ``ref`` has NaN, and ``ref``'s bit pattern everywhere else (the
    sign of a zero included)."""
    nan = ref.isnan()
    assert torch.equal(out.isnan(), nan), "NaN positions differ"
    iv = _INT_VIEW[ref.dtype]
    mismatches = (out.view(iv) != ref.view(iv)) & ~nan
    assert int(mismatches.sum()) == 0, f"{int(mismatches.sum())} of {ref.numel()} elements differ"


def refill_(t: QuantizedTensor, seed: int = 0) -> None:
    """Overwrite every slot of a quantized cache with fresh random data, in place (for
    graph tests: the slots `make_case` filled with NaN become real once lengths grow)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    fresh = QuantizedTensor.from_float(torch.randn(t.shape, generator=g).to(t.scales.dtype)
                                       .to(t.packed.device), t.group_size, t.bits)
    t.packed.copy_(fresh.packed)
    t.scales.copy_(fresh.scales)
    t.biases.copy_(fresh.biases)


# -- planted fast tiers for the gates --------------------------------------------------

_dense_weights: dict = {}


def _dense_weight(w: QuantizedTensor, dtype, fault=None) -> torch.Tensor:
    """w (with ``fault`` applied) dequantized to ``dtype`` as the reference does, made once
    per weight (the key holds w, so its id is not reused while cached)."""
    key = (id(w), dtype, fault)
    if key not in _dense_weights:
        made = (w if fault is None else fault(w)).dequantize(torch.float32).to(dtype)
        _dense_weights[key] = (w, made)
    return _dense_weights[key][1]


def cached_reference_linear(x, w, bias=None):
    """`reference.linear` with each quantized weight dequantized once, not at every call:
    the same values, without the dequantization that is most of a CPU gate's time."""
    if isinstance(w, QuantizedTensor):
        return F.linear(x, _dense_weight(w, x.dtype), bias)
    return reference.linear(x, w, bias)


def _fast(device) -> bool:
    return levers.tier(device) == levers.Tier.FAST


def _planted_linear(fault=None, honest: bool = False):
    """ops.linear whose fast tier multiplies by the quantized weight with ``fault``
    applied, in the reference's arithmetic (its bf16 weight), or honestly: s·q + b exact
    in float32, summed in float32, one rounding at the end (what the fast kernels do)."""
    def linear(x, w, bias=None):
        if not isinstance(w, QuantizedTensor) or not _fast(x.device):
            return cached_reference_linear(x, w, bias)
        levers.count("planted_product")
        if honest:
            b = None if bias is None else bias.float()
            return F.linear(x.float(), _dense_weight(w, torch.float32), b).to(x.dtype)
        return F.linear(x, _dense_weight(w, x.dtype, fault), bias)
    return linear


def _drop_group(w: QuantizedTensor) -> QuantizedTensor:
    """Every row's first group reads as zeros."""
    s, b = w.scales.clone(), w.biases.clone()
    s[:, 0] = 0
    b[:, 0] = 0
    return QuantizedTensor(w.packed, s, b, w.group_size, w.bits)


def _bias_one_ulp(w: QuantizedTensor) -> QuantizedTensor:
    """Every bias one bf16 ulp high."""
    b = w.biases.to(torch.bfloat16)
    up = torch.nextafter(b, torch.full_like(b, float("inf")))
    return QuantizedTensor(w.packed, w.scales, up.to(w.biases.dtype), w.group_size, w.bits)


def _kv_codes_off_by_one(real_append: Callable):
    """ops.kv_append whose fast tier writes, for every new key and value (a prompt's too:
    `prompt_write` writes them through a block table), the codes of each head's first
    group one off (+1, or −1 at the top code) beside the rule's scales and biases."""
    def kv_append(x, positions, cache, positions_checked=False, block_table=None):
        if not isinstance(cache, QuantizedTensor) or not _fast(x.device):
            return real_append(x, positions, cache, positions_checked, block_table)
        levers.count("planted_kv_append")
        packed, scales, biases = quantize(x, cache.group_size, cache.bits)
        codes = unpack(packed, cache.bits)
        first = codes[..., :cache.group_size]
        codes[..., :cache.group_size] = torch.where(first < (1 << cache.bits) - 1, first + 1,
                                                    first - 1)
        b, pos = torch.arange(x.shape[0]), positions.to(torch.int64)
        if block_table is not None:  # a prompt's tokens (`prompt_write`): rows by table
            page = cache.shape[2]
            b, pos = block_table[b, pos // page].to(torch.int64), pos % page
        cache.packed.view(torch.int32)[b, :, pos] = pack(codes, cache.bits).view(torch.int32)
        cache.scales[b, :, pos] = scales
        cache.biases[b, :, pos] = biases
    return kv_append


def _skip_last_token(q, k, v, lengths, scale, window=None, softcap=None, lengths_checked=False,
                     block_table=None):
    """ops.decode_attention whose fast tier attends to every cached token but the newest
    (slotted caches only: the gates run no paged one)."""
    if block_table is not None:
        raise ValueError("the planted decode_attention takes a slotted cache only")
    if not _fast(q.device):
        return reference.decode_attention(q, k, v, lengths, scale, window, softcap)
    levers.count("planted_decode_attention")
    return reference.decode_attention(q, k, v, lengths - 1, scale, window, softcap)


PLANTED = ("honest", "product-drops-a-group", "biases-1-bf16-ulp-high", "kv-codes-off-by-one",
           "attention-skips-the-last-token")


def planted_ops(name: str) -> dict[str, Callable]:
    """Functions to set on `qfuse.ops` (op name → function; every Triton kernel should be
    off) for the fast tier ``name`` of `PLANTED`: "honest" (the honest fast product), or
    the reference with that fault injected. Every other tier, and the fast tier's other
    ops, run the reference (its products through `cached_reference_linear`)."""
    if name not in PLANTED:
        raise ValueError(f"planted fast tier must be one of {PLANTED}, got {name!r}")
    patches: dict[str, Callable] = {"linear": _planted_linear(
        _drop_group if name == "product-drops-a-group" else
        _bias_one_ulp if name == "biases-1-bf16-ulp-high" else None, honest=name == "honest")}
    if name == "kv-codes-off-by-one":
        patches["kv_append"] = _kv_codes_off_by_one(ops.kv_append)
    if name == "attention-skips-the-last-token":
        patches["decode_attention"] = _skip_last_token
    return patches


def as_choices(patches: dict[str, Callable]) -> dict[str, Callable]:
    """`qfuse.choose` functions (attribute name → function) that choose the given
    `qfuse.ops`-style functions (op name → function, as `planted_ops` gives) for every
    call, so a model's plan runs them as `qfuse.ops` would: set them on `qfuse.choose`
    (e.g. with monkeypatch.setattr), then `levers.reload()` so that plans made before are
    not used again."""
    from .choose import Choice

    out: dict[str, Callable] = {}
    for op, fn in patches.items():
        if op == "linear":
            out["choose_product"] = lambda x, w, bias=None, fn=fn: Choice(
                "substituted", "a test's product", lambda x: fn(x, w, bias))
        elif op == "kv_append":
            out["choose_kv_append"] = lambda x, cache, fn=fn: Choice(
                "substituted", "a test's KV append",
                lambda x, positions, cache, block_table=None: fn(x, positions, cache, True,
                                                                 block_table))
        elif op == "decode_attention":
            out["choose_decode_attention"] = (
                lambda q, k, v, scale, softcap=None, block_table=None, window=None, fn=fn:
                Choice("substituted", "a test's decode attention",
                       lambda q, k, v, lengths, window=None, block_table=None: fn(
                           q, k, v, lengths, scale, window, softcap, True, block_table)))
        else:
            raise ValueError(f"no choice stands for ops.{op}")
    return out



# Decode attention's runtime arguments a launch does not specialize as multiples of 16:
# the per-token stride of scales/biases (D/g groups, e.g. 4), the window, the table's.
_ATTENTION_ODD = ("stride_ksn", "stride_vsn", "window", "stride_table")


def compile_attention_for_sm90(kernel, consts: dict, pointers: dict, num_warps: int = 4,
                               **options):
    """A decode-attention kernel compiled for sm_90 on a machine without a GPU (Triton's
    compiler, no device): constexprs ``consts`` (those the kernel lacks dropped), pointers
    typed by ``pointers`` (name → "*u32" ...; bf16 otherwise), every other argument an i32
    stride or count but the two softmax scalars, specialized as a real launch would.
    ``options``: more compile options (num_stages)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    consts = {name: value for name, value in consts.items() if name in kernel.arg_names}
    sig = {}
    for name in kernel.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = pointers.get(name, "*bf16")
        else:
            sig[name] = "fp32" if name in ("qk_scale_log2", "softcap") else "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
             if name not in consts and name not in _ATTENTION_ODD and sig[name] != "fp32"}
    return compile(ASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": num_warps, **options})
