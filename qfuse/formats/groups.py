"""Affine groups from other formats' codes, zero points and scales, in the MLX layout.

Every format here stores w = (q − z)·s per group (GGUF's Q4_1 and K-quants: w = s·q + m),
so one conversion serves them: `to_mlx(codes, scale, zero, ...)` returns the MLX
(packed uint32, scales, biases) with bias = −z·s. Precision: the scale is copied and
−z·s is computed in float32, where it is exact (z < 2^9 and s a float16/bfloat16: at most
20 significant bits), so s·q + bias reads back exactly (q − z)·s in float32. A model in
float16 or bfloat16 then rounds the bias once, to nearest (the scale too where its dtype
is wider than the model's): a dequantized weight is then within half a unit in the last
place of z·s, plus its own final rounding (one ulp of w), of the format's dequantization in
that dtype (tests/test_formats.py checks this bound and the float32 equality).

A source group G may be any multiple of an MLX group size (32, 64 or 128; per channel
G = the row): the largest that divides G is used and each source scale repeats G/g
times, exactly. Act-order groups (GPTQ's `g_idx`): `group_columns` finds the MLX group
over which the assignment is constant in the stored column order; otherwise the columns
must be permuted (`act_order_permutation`): a sibling's rows absorb it (down_proj), or
the module gathers its input (`formats.Converted.input_perm`).
"""

from __future__ import annotations

import torch

from ..errors import UserError
from ..quant import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES, pack

# Largest first: fewer scales per row.
_MLX_GROUPS = tuple(sorted(SUPPORTED_GROUP_SIZES, reverse=True))


class FormatError(UserError, ValueError):
    """A quantized checkpoint's tensors qfuse cannot read; the message names the tensor."""


def mlx_group(source_group: int, n_in: int, what: str) -> int:
    """The MLX group size that serves source groups of ``source_group`` columns exactly
    (the largest supported one that divides it); FormatError naming ``what`` otherwise."""
    if source_group <= 0 or n_in % source_group:
        raise FormatError(f"{what}: group size {source_group} does not divide the row of "
                          f"{n_in} input features")
    for g in _MLX_GROUPS:
        if source_group % g == 0:
            return g
    raise FormatError(f"{what}: group size {source_group} is not a multiple of 32 "
                      f"(qfuse's groups are {', '.join(map(str, SUPPORTED_GROUP_SIZES))})")


def unpack_words(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Codes [.., n·32/bits, ..] (int64) from int32 words packed along ``dim``, element j of
    a word in bits [j·bits, (j+1)·bits): GPTQ's and compressed-tensors' order for
    2/4/8 bits (no code straddles a word)."""
    per = 32 // bits
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per, dtype=torch.int64) * bits
    w = w.movedim(dim, -1)
    codes = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    codes = codes.reshape(*w.shape[:-1], w.shape[-1] * per)
    return codes.movedim(-1, dim)


def group_columns(g_idx: torch.Tensor, n_in: int, n_groups: int, what: str) -> int | None:
    """The MLX group size g over which ``g_idx`` (the source group of each input column)
    is constant on every aligned run of g columns, or None (true act-order). FormatError
    naming ``what`` for a malformed g_idx."""
    if g_idx.dim() != 1 or g_idx.numel() != n_in:
        raise FormatError(f"{what}: g_idx has shape {tuple(g_idx.shape)}, expected "
                          f"({n_in},), one source group per input column")
    if g_idx.dtype.is_floating_point or g_idx.dtype == torch.bool:
        raise FormatError(f"{what}: g_idx must hold integers, got {g_idx.dtype}")
    g = g_idx.to(torch.int64)
    if n_in and (int(g.min()) < 0 or int(g.max()) >= n_groups):
        raise FormatError(f"{what}: g_idx holds groups outside [0, {n_groups}) "
                          f"({n_groups} groups of scales)")
    for size in _MLX_GROUPS:
        if n_in % size == 0:
            runs = g.view(-1, size)
            if bool((runs == runs[:, :1]).all()):
                return size
    return None


def act_order_permutation(g_idx: torch.Tensor, n_groups: int, what: str) -> torch.Tensor:
    """The input permutation (int64 [in]) that puts act-order columns group by group,
    columns of one group in their stored order; FormatError naming ``what`` unless every
    group holds as many columns as the others and spans a whole number of MLX groups.
    Call `group_columns` first (it checks the shape and range)."""
    perm = torch.sort(g_idx.to(torch.int64), stable=True).indices
    # GPTQ's act-order groups are runs of group_size columns of its permuted order: a
    # group of another size is a malformed g_idx, not a layout to serve.
    counts = torch.bincount(g_idx.to(torch.int64), minlength=n_groups)
    if n_groups and bool((counts != counts[0]).any()):
        sizes = sorted(set(counts.tolist()))
        raise FormatError(f"{what}: act-order groups of unequal sizes ({', '.join(map(str, sizes))} "
                          f"columns; {n_groups} groups of one size each expected)")
    if group_columns(g_idx[perm], g_idx.numel(), n_groups, what) is None:
        raise FormatError(f"{what}: g_idx's groups are not runs of 32, 64 or 128 columns "
                          "once sorted (malformed act-order)")
    return perm


def to_mlx(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, column_group,
           bits: int, what: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint32 [out, in·bits/32], scales, biases float32 [out, in/g]) with
    w = (codes − zero)·scale read back as scales·codes + biases.

    codes: integers [out, in] in [0, 2^bits), or the MLX words (uint32 [out, in·bits/32])
    where the format stores them so already; scale: float [out, S]; zero: [out, S]
    (integers or floats, the code of w = 0); column_group: the source group of each
    input column, an int64 tensor [in] (act-order) or an int G (column k in group k // G)."""
    n_out, n_in = codes.shape
    if codes.dtype == torch.uint32:
        n_in = n_in * 32 // bits
    if bits not in SUPPORTED_BITS:
        raise FormatError(f"{what}: {bits}-bit codes are not supported (qfuse reads "
                          f"{', '.join(map(str, SUPPORTED_BITS))} bits)")
    if isinstance(column_group, int):
        g = mlx_group(column_group, n_in, what)
        source = torch.arange(n_in // g, dtype=torch.int64) * g // column_group
    else:
        g = group_columns(column_group, n_in, scale.shape[-1], what)
        if g is None:
            raise FormatError(f"{what}: act-order g_idx (groups not in column order) "
                              "reached the packer unpermuted")
        source = column_group.to(torch.int64)[::g]
    if scale.dim() != 2 or scale.shape[0] != n_out or zero.shape != scale.shape:
        raise FormatError(f"{what}: scales {tuple(scale.shape)} and zero points "
                          f"{tuple(zero.shape)} do not give one per group of {n_out} rows")
    if source.numel() and scale.shape[-1] <= int(source.max()):
        raise FormatError(f"{what}: {scale.shape[-1]} groups of scales, the row needs "
                          f"{int(source.max()) + 1}")
    s = scale.to(torch.float32)[:, source]
    z = zero.to(torch.float32)[:, source]
    packed = codes if codes.dtype == torch.uint32 else pack(codes, bits)
    return packed, s.contiguous(), (-z * s).contiguous()
