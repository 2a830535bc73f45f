"""4-bit weights repacked once into mma fragment order, and back to MLX words bit for bit.

`qmatmul_mma` multiplies with `mma.sync.m16n8k16` (bf16), the weight as the
A operand. In this layout every thread of a warp loads, with one 16-byte
load, exactly the A registers of four consecutive mmas, and one LOP3 (after
a shift) turns a pair of codes into an mma-ready bf16 pair 128 + c: no shared
memory, no shuffles, no layout conversion between the load and the mma.

Words: int32 [T, KB, 32, 4] for T = ⌈N/16⌉ row tiles of 16 and KB = K/64
blocks of 64 columns: lane L = 4g + q (g = L // 4, q = L % 4) of block
(t, kb) holds in word j the A fragment of mma j, whose 16 k-slots s map to

    k = 64·kb + 16·q(s) + 4·j + 2·(s // 8) + s % 2,     q(s) = (s mod 8) // 2,

a bijection of (j, s) onto the block's 64 columns chosen so that a thread's
x operand is 16 consecutive values of x. Nibble p = 4e + 2h + r of the word
is the code of row 16t + g + 8r at that k with h = s // 8 and e = s % 2:
bits [4p, 4p+4) for p < 4 are the low halves of the four A registers and
p ≥ 4 the high halves, so register r' = ((w >> 4r') & 0x000F000F) | 0x43004300.

Scales and biases: int32 [T, n_groups, 8], bf16 bits of row 16t + g in the
low half and of row 16t + g + 8 in the high half (what lane 4g + q reads).
Rows past N are zero codes with zero scales and biases. Groups must be 64 or
128 columns (one scale per 64-column block); scales/biases bf16.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...quant import QuantizedTensor, dequantize, derived_form, pack, unpack

BLOCK_K = 64  # columns per fragment block (four mma k16 steps)
TILE_N = 16  # rows per fragment tile (the mma's M)


@dataclass(frozen=True)
class FragmentWeight:
    """A 4-bit weight [N, K] in mma fragment order (module docstring)."""

    words: torch.Tensor  # int32 [T, K/64, 32, 4]
    scales: torch.Tensor  # int32 [T, K/group, 8]: bf16 pairs (row g, row g + 8)
    biases: torch.Tensor  # int32 [T, K/group, 8]
    n: int
    k: int
    group_size: int

    # Where this weight's rows start in a stacked weight it is a view of (Q/K/V, gate+up
    # held as one tensor), so a product over all the parts can run as one launch.
    parent: FragmentWeight | None = None
    row0: int = 0
    # What a kernel derives from the weight once (a stacked bias), as QuantizedTensor keeps.
    _derived: dict = field(default_factory=dict, repr=False, compare=False)

    bits = 4

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the weight dequantizes to (its scales')."""
        return torch.bfloat16

    @property
    def device(self) -> torch.device:
        return self.words.device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.words, self.scales, self.biases))

    def derived(self, key: str, make, supersedes: str | None = None):
        """As `QuantizedTensor.derived`: ``make(self)``, kept for this weight's lifetime."""
        return derived_form(self, self._derived, key, make, supersedes)

    def rows(self, start: int, n: int) -> FragmentWeight:
        """Rows [start, start + n) as a view (no copy); ``start`` on a tile boundary, and
        n whole tiles unless the view ends where this weight ends."""
        if start % TILE_N or start < 0 or start + n > self.n or (
                n % TILE_N and start + n != self.n):
            raise ValueError(f"rows [{start}, {start + n}) of a {self.n}-row fragment weight "
                             f"are not whole tiles of {TILE_N}")
        t0, t1 = start // TILE_N, -(-(start + n) // TILE_N)
        return FragmentWeight(self.words[t0:t1], self.scales[t0:t1], self.biases[t0:t1], n,
                              self.k, self.group_size, self, start)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense weight [N, K]: bit for bit ``to_mlx(self).dequantize(dtype)``."""
        mlx = to_mlx(self)
        return dequantize(mlx.packed, mlx.scales, mlx.biases, self.group_size, 4, dtype)


def unsupported_reason(w: QuantizedTensor) -> str | None:
    """None when `repack` takes w, else why not."""
    if w.bits != 4:
        return f"{w.bits}-bit weights (fragments: 4-bit)"
    if w.packed.dim() != 2:
        return f"weight of {w.packed.dim()} dims (fragments: [N, K])"
    if w.group_size % BLOCK_K:
        return f"group size {w.group_size} (fragments: 64, 128)"
    if w.scales.dtype != torch.bfloat16 or w.biases.dtype != torch.bfloat16:
        return f"scales/biases {w.scales.dtype} (fragments: bf16)"
    return None


def _bf16_pairs(t: torch.Tensor, T: int) -> torch.Tensor:
    """[N, G] bf16 → int32 [T, G, 8]: rows 16t + g (low half) and 16t + g + 8 (high)."""
    N, G = t.shape
    bits = torch.zeros(T * TILE_N, G, dtype=torch.int32, device=t.device)
    bits[:N] = t.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    bits = bits.view(T, 2, 8, G).permute(0, 3, 1, 2)  # [T, G, half, g]
    return (bits[:, :, 0] | (bits[:, :, 1] << 16)).contiguous()


def _split_pairs(pairs: torch.Tensor, N: int) -> torch.Tensor:
    """Inverse of _bf16_pairs: int32 [T, G, 8] → bf16 [N, G]."""
    T, G, _ = pairs.shape
    halves = torch.stack([pairs & 0xFFFF, (pairs >> 16) & 0xFFFF], dim=2)  # [T, G, 2, 8]
    rows = halves.permute(0, 2, 3, 1).reshape(T * TILE_N, G)
    return rows[:N].to(torch.int16).view(torch.bfloat16).contiguous()


def repack(w: QuantizedTensor, tiles_per_chunk: int = 1024) -> FragmentWeight:
    """The MLX-layout weight in fragment order (a one-time cost at load), ``tiles_per_chunk``
    row tiles at a time: the int64 intermediates of a whole 262144-row head would take
    ~12 GB of a GPU that holds a 6 GB model."""
    reason = unsupported_reason(w)
    if reason is not None:
        raise ValueError(f"cannot repack into mma fragments: {reason}")
    N, K = w.shape
    T = -(-N // TILE_N)
    KB = K // BLOCK_K
    words = torch.empty(T, KB, 32, 4, dtype=torch.int32, device=w.device)
    shifts = 4 * torch.arange(8, dtype=torch.int64, device=w.device)
    for t0 in range(0, T, tiles_per_chunk):
        t1 = min(T, t0 + tiles_per_chunk)
        r0, r1 = t0 * TILE_N, min(N, t1 * TILE_N)
        codes = torch.zeros((t1 - t0) * TILE_N, K, dtype=torch.int64, device=w.device)
        codes[:r1 - r0] = unpack(w.packed[r0:r1], 4)
        # dims of a code: (t, r, g, kb, q, j, h, e): row 16t + 8r + g, k = 64kb + 16q + 4j + 2h + e
        c = codes.view(t1 - t0, 2, 8, KB, 4, 4, 2, 2)
        c = c.permute(0, 3, 2, 4, 5, 7, 6, 1)  # (t, kb, g, q, j, e, h, r): nibble p = 4e + 2h + r
        packed = (c.reshape(t1 - t0, KB, 32, 4, 8) << shifts).sum(-1)
        words[t0:t1] = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return FragmentWeight(words, _bf16_pairs(w.scales, T), _bf16_pairs(w.biases, T), N, K,
                          w.group_size)


def to_mlx(f: FragmentWeight) -> QuantizedTensor:
    """The weight back in the MLX layout (bit for bit what `repack` was given): one
    integer kernel on a GPU (`fragment_words`), the permutation in torch elsewhere."""
    if f.words.is_cuda:
        from .fragment_words import mlx_words

        words = mlx_words(f)
    else:
        words = pack(_codes(f.words)[:f.n], 4)
    return QuantizedTensor(words, _split_pairs(f.scales, f.n), _split_pairs(f.biases, f.n),
                           f.group_size, 4)


def dequantize_rows(f: FragmentWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` (int, any shape [...]) of the dense weight, [..., K] in ``dtype``, bit for
    bit those of ``f.dequantize(dtype)``: the embedding lookup of a weight held in fragment
    order. Only the row tiles the ids touch are decoded, ROWS_AT_ONCE ids at a time (a
    prompt's 16 codes per id per column would not fit at once); no host reads, so a decode
    step's lookup can be captured in a CUDA graph."""
    flat = ids.reshape(-1)
    out = torch.empty(flat.numel(), f.k, dtype=dtype, device=f.words.device)
    for i0 in range(0, flat.numel(), ROWS_AT_ONCE):
        part = flat[i0:i0 + ROWS_AT_ONCE]
        tiles, within = part // TILE_N, part % TILE_N
        pick = torch.arange(part.numel(), device=part.device)
        codes = _codes(f.words[tiles]).view(part.numel(), TILE_N, f.k)[pick, within]
        scales, biases = (_split_pairs(t[tiles], part.numel() * TILE_N)
                          .view(part.numel(), TILE_N, -1)[pick, within] for t in (f.scales, f.biases))
        groups = codes.to(torch.float32).view(part.numel(), -1, f.group_size)
        dense = groups * scales.to(torch.float32)[..., None] + biases.to(torch.float32)[..., None]
        out[i0:i0 + ROWS_AT_ONCE] = dense.view(part.numel(), f.k).to(dtype)
    return out.view(*ids.shape, f.k)


ROWS_AT_ONCE = 512


def _codes(words: torch.Tensor) -> torch.Tensor:
    """Fragment words int32 [T, KB, 32, 4] → codes uint8 [16·T, 64·KB], rows in order."""
    T, KB = words.shape[:2]
    # int32 shifts are arithmetic, but the mask drops the sign bits they bring in.
    shifts = 4 * torch.arange(8, dtype=torch.int32, device=words.device)
    c = ((words[..., None] >> shifts) & 0xF).to(torch.uint8).view(T, KB, 8, 4, 4, 2, 2, 2)
    c = c.permute(0, 7, 2, 1, 3, 4, 6, 5)  # back to (t, r, g, kb, q, j, h, e)
    return c.reshape(T * TILE_N, KB * BLOCK_K)


def stacked_parent(ws: list) -> FragmentWeight | None:
    """The stacked fragment weight whose consecutive row ranges (`FragmentWeight.rows`)
    the weights are, in order and covering it whole, else None."""
    if len(ws) < 2 or not all(isinstance(w, FragmentWeight) for w in ws):
        return None
    parent, row = ws[0].parent, 0
    for w in ws:
        if parent is None or w.parent is not parent or w.row0 != row:
            return None
        row += w.n
    return parent if row == parent.n else None


def concat(parts: list[FragmentWeight]) -> FragmentWeight:
    """The fragment weights of [N₀ + N₁ + …, K] stacked along N (one launch for Q/K/V or
    gate+up). Every part but the last must have whole row tiles (N a multiple of 16), so
    each part's rows start on a tile; all share K and the group size."""
    first = parts[0]
    for i, f in enumerate(parts):
        if (f.k, f.group_size) != (first.k, first.group_size):
            raise ValueError(f"part {i} is [{f.n}, {f.k}] g{f.group_size}, part 0 "
                             f"[{first.n}, {first.k}] g{first.group_size}")
        if i < len(parts) - 1 and f.n % TILE_N:
            raise ValueError(f"part {i} has {f.n} rows, not whole tiles of {TILE_N}")
    return FragmentWeight(torch.cat([f.words for f in parts]),
                          torch.cat([f.scales for f in parts]),
                          torch.cat([f.biases for f in parts]),
                          sum(f.n for f in parts), first.k, first.group_size)
