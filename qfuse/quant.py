"""Affine group quantization in the MLX layout: quantize, dequantize, pack, unpack.

The format (`docs/design.md`, "The MLX affine format") is the bit-exact target:
groups of ``group_size`` consecutive elements along the last axis share one
scale ``s`` and one bias ``e``; an element is stored as an unsigned ``bits``-bit
code ``q`` and reads back as ``s * q + e``. Codes are packed as a little-endian
bit stream into uint32 words (element j occupies bits [j*bits, (j+1)*bits) of
its row), so 3/5/6-bit codes may straddle two words.

Everything here is plain PyTorch and runs on any device; the Triton kernels
read exactly this layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# A group of 32 elements always fills a whole number of words (32 * bits bits
# = bits words), so packing works on blocks of 32 codes.
_CODES_PER_BLOCK = 32


def check_bits(bits: int, name: str = "bits") -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{name} must be one of {SUPPORTED_BITS}, got {bits!r}")


def check_group_size(group_size: int, name: str = "group_size") -> None:
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"{name} must be one of {SUPPORTED_GROUP_SIZES}, got {group_size!r}")


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes into uint32 words, little-endian bit stream per row.

    q: integer tensor [..., K] with values in [0, 2**bits); K a multiple of 32.
    Returns uint32 [..., K * bits // 32].
    """
    check_bits(bits)
    if q.dtype.is_floating_point or q.dtype == torch.bool:
        raise ValueError(f"q must be an integer tensor, got dtype {q.dtype}")
    K = q.shape[-1]
    if K % _CODES_PER_BLOCK != 0:
        raise ValueError(f"q's last dimension must be a multiple of 32, got {K}")
    codes = q.to(torch.int64)
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= (1 << bits)):
        raise ValueError(f"q holds values outside [0, {1 << bits}) for bits={bits}")
    blocks = codes.reshape(*q.shape[:-1], K // _CODES_PER_BLOCK, _CODES_PER_BLOCK)
    words = torch.zeros(*blocks.shape[:-1], bits, dtype=torch.int64, device=q.device)
    for j in range(_CODES_PER_BLOCK):
        offset = j * bits
        word, shift = divmod(offset, 32)
        words[..., word] |= (blocks[..., j] << shift) & 0xFFFFFFFF
        if shift + bits > 32:  # the code straddles into the next word
            words[..., word + 1] |= blocks[..., j] >> (32 - shift)
    return words.reshape(*q.shape[:-1], K * bits // 32).to(torch.uint32)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`. packed: uint32 [..., W] → int64 codes [..., W * 32 // bits]."""
    check_bits(bits)
    if packed.dtype not in (torch.uint32, torch.int32):
        raise ValueError(f"packed must be uint32 (or int32 bits), got dtype {packed.dtype}")
    W = packed.shape[-1]
    if W % bits != 0:
        raise ValueError(f"packed's last dimension ({W}) must be a multiple of bits={bits}")
    words = packed.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    words = words.reshape(*packed.shape[:-1], W // bits, bits)
    mask = (1 << bits) - 1
    codes = []
    for j in range(_CODES_PER_BLOCK):
        word, shift = divmod(j * bits, 32)
        code = words[..., word] >> shift
        if shift + bits > 32:
            code = code | (words[..., word + 1] << (32 - shift))
        codes.append(code & mask)
    out = torch.stack(codes, dim=-1)
    return out.reshape(*packed.shape[:-1], W * 32 // bits)


def quantize(
    w: torch.Tensor, group_size: int = 64, bits: int = 4
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``w`` [..., K] to (packed uint32 [..., K*bits/32], scales, biases [..., K/g]).

    Bit-exact with MLX's affine quantization: statistics in float32, round half
    to even, scales and biases cast to ``w.dtype`` after the codes are computed.
    """
    check_bits(bits)
    check_group_size(group_size)
    if w.dtype not in FLOAT_DTYPES:
        raise ValueError(f"w must be float32, float16 or bfloat16, got dtype {w.dtype}")
    if w.dim() == 0 or w.shape[-1] % group_size != 0:
        raise ValueError(
            f"w's last dimension must be a multiple of group_size={group_size}, "
            f"got shape {tuple(w.shape)}"
        )
    K = w.shape[-1]
    groups = w.to(torch.float32).reshape(*w.shape[:-1], K // group_size, group_size)
    # A tensor divisor, not a Python float: PyTorch's CUDA kernel turns division
    # by a CPU scalar into multiplication by its reciprocal, which differs from
    # true division in the last bit (seen as rare code mismatches on the H200).
    # Filled on the device: a copy from the host would wait for the queued work.
    n_levels = torch.full((), float((1 << bits) - 1), device=w.device)
    w_max = groups.amax(dim=-1, keepdim=True)
    w_min = groups.amin(dim=-1, keepdim=True)
    scale = torch.clamp((w_max - w_min) / n_levels, min=1e-7)
    # Anchor the grid on the edge with the larger magnitude so that it is
    # represented exactly; the scale turns negative when that edge is the max.
    min_is_edge = w_min.abs() > w_max.abs()
    edge = torch.where(min_is_edge, w_min, w_max)
    scale = torch.where(min_is_edge, scale, -scale)
    q0 = torch.round(edge / scale)
    nonzero = q0 != 0
    scale = torch.where(nonzero, edge / torch.where(nonzero, q0, 1.0), scale)
    bias = torch.where(nonzero, edge, torch.zeros_like(edge))
    q = torch.clamp(torch.round((groups - bias) / scale), 0, n_levels).to(torch.int64)
    packed = pack(q.reshape(w.shape), bits)
    return packed, scale.squeeze(-1).to(w.dtype), bias.squeeze(-1).to(w.dtype)


def dequantize(
    packed: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    group_size: int,
    bits: int,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Read back ``scales * q + biases`` [..., K], computed in float32 and cast to
    ``dtype`` (default: the scales' dtype)."""
    check_layout(packed, scales, biases, group_size, bits)
    codes = unpack(packed, bits).to(torch.float32)
    K = codes.shape[-1]
    codes = codes.reshape(*codes.shape[:-1], K // group_size, group_size)
    out = codes * scales.to(torch.float32).unsqueeze(-1) + biases.to(torch.float32).unsqueeze(-1)
    return out.reshape(*packed.shape[:-1], K).to(dtype or scales.dtype)


def check_layout(
    packed: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    group_size: int,
    bits: int,
    name: str = "packed",
) -> None:
    """Raise ValueError unless (packed, scales, biases) form one consistent MLX tensor."""
    check_bits(bits)
    check_group_size(group_size)
    if packed.dtype not in (torch.uint32, torch.int32):
        raise ValueError(f"{name} must be uint32, got dtype {packed.dtype}")
    if scales.shape != biases.shape:
        raise ValueError(
            f"{name}: scales {tuple(scales.shape)} and biases {tuple(biases.shape)} differ in shape"
        )
    if scales.dtype != biases.dtype or scales.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"{name}: scales and biases must share one float dtype, got {scales.dtype} and "
            f"{biases.dtype}"
        )
    if packed.shape[:-1] != scales.shape[:-1]:
        raise ValueError(
            f"{name}: leading shape {tuple(packed.shape[:-1])} does not match scales' "
            f"{tuple(scales.shape[:-1])}"
        )
    K = scales.shape[-1] * group_size
    if packed.shape[-1] * 32 != K * bits:
        raise ValueError(
            f"{name}: packed width {packed.shape[-1]} words does not hold {K} elements of "
            f"{bits} bits (expected {K * bits // 32} words for group_size={group_size})"
        )


def derived_form(owner, forms: dict, key: str, make, supersedes: str | None = None):
    """``forms[key]``, made as ``make(owner)`` on first use; making it drops the forms whose
    keys start with ``supersedes``. The cache behind `QuantizedTensor.derived` and its
    kernel-order twins (`kernels.products.fragments.FragmentWeight`)."""
    value = forms.get(key)
    if value is None:
        if supersedes is not None:
            for old in [k for k in forms if k.startswith(supersedes)]:
                del forms[old]
        value = forms[key] = make(owner)
    return value


@dataclass(frozen=True)
class QuantizedTensor:
    """One tensor in the MLX layout: logical shape [..., K] stored as
    packed uint32 [..., K*bits/32] + scales/biases [..., K/group_size]."""

    packed: torch.Tensor
    scales: torch.Tensor
    biases: torch.Tensor
    group_size: int
    bits: int
    # Other layouts of the same weight that a kernel builds once and keeps for the
    # tensor's lifetime (e.g. mma fragment order); see `derived`.
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    # Counts `write_` calls, so that a form derived from several tensors can tell when
    # one of them changed.
    generation: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_layout(self.packed, self.scales, self.biases, self.group_size, self.bits)

    @classmethod
    def from_float(cls, w: torch.Tensor, group_size: int = 64, bits: int = 4) -> QuantizedTensor:
        return cls(*quantize(w, group_size, bits), group_size, bits)

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.scales.shape[:-1], self.scales.shape[-1] * self.group_size)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the tensor dequantizes to (that of its scales)."""
        return self.scales.dtype

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.biases))

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(
            self.packed, self.scales, self.biases, self.group_size, self.bits, dtype
        )

    def derived(self, key: str, make, supersedes: str | None = None):
        """``make(self)``, built on the first call for ``key`` and kept with this tensor
        (a kernel's own layout of the weight; the MLX words stay the format). `write_`
        drops every derived form; building one drops the forms whose keys start with
        ``supersedes`` (older versions of a form that also depends on other tensors)."""
        return derived_form(self, self._derived, key, make, supersedes)

    def write_(self, index: tuple, x: torch.Tensor) -> None:
        """Quantize ``x`` and store it at ``index`` (an indexing tuple over the leading
        dims, the last dim left whole) of packed, scales and biases, in place."""
        packed, scales, biases = quantize(x, self.group_size, self.bits)
        self._derived.clear()
        object.__setattr__(self, "generation", self.generation + 1)  # frozen dataclass
        self.packed.view(torch.int32)[index] = packed.view(torch.int32)  # uint32 has no index_put
        self.scales[index] = scales.to(self.scales.dtype)
        self.biases[index] = biases.to(self.biases.dtype)


def batch_rows(t, start: int, stop: int | None = None):
    """Rows [start, stop) of a tensor [B, ...], dense or quantized, as views (a KV cache's
    sequences)."""
    if isinstance(t, QuantizedTensor):
        return QuantizedTensor(t.packed[start:stop], t.scales[start:stop],
                               t.biases[start:stop], t.group_size, t.bits)
    return t[start:stop]
