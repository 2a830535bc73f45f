"""GGUF's Q4_0, Q4_1, Q8_0, Q4_K and Q5_K tensors convert to MLX groups that read back
bit for bit what the `gguf` package's own dequantization gives (float32): Q4_0/Q4_1/Q8_0
blocks from its quantizer, K-quant super-blocks as random bytes (any bytes are a valid
block once d and dmin are finite; the package has no K-quant quantizer). Types without an
exact MLX form, and rows of the wrong length, get one line naming the tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T
from gguf import quants

from qfuse.formats import gguf as qgguf
from qfuse.formats.groups import FormatError
from qfuse.quant import dequantize

ROWS, COLS = 6, 512


def _blocks(name: str, rng) -> np.ndarray:
    """Bytes [ROWS, row bytes] of a ``name`` tensor."""
    per, nbytes = qgguf.BLOCKS[name]
    if not name.endswith("_K"):
        return quants.quantize(rng.standard_normal((ROWS, COLS)).astype(np.float32), T[name])
    raw = rng.integers(0, 256, (ROWS, COLS // per, nbytes), dtype=np.uint8)
    d_dmin = (rng.random((ROWS, COLS // per, 2)) * 0.01).astype(np.float16)  # finite d, dmin
    raw[..., 0:4] = d_dmin.view(np.uint8).reshape(ROWS, COLS // per, 4)
    return raw.reshape(ROWS, -1)


@pytest.mark.parametrize("name,bits", [("Q4_0", 4), ("Q4_1", 4), ("Q8_0", 8), ("Q4_K", 4),
                                       ("Q5_K", 5)])
def test_gguf_blocks_read_back_as_the_gguf_package_dequantizes(name, bits):
    raw = _blocks(name, np.random.default_rng(0))
    packed, scales, biases, group, got_bits = qgguf.to_mlx(torch.from_numpy(raw), name, COLS,
                                                           "blk.0.ffn_up.weight")
    assert (group, got_bits) == (32, bits)
    ours = dequantize(packed, scales, biases, group, bits, torch.float32).numpy()
    assert np.array_equal(ours, quants.dequantize(raw, T[name]))


def test_q4_0_hand_worked_block():
    """d = 0.5, byte j = 0x(j)(15 − j): value j is 15 − j and value j + 16 is j."""
    block = np.zeros((1, 18), np.uint8)
    block[0, :2] = np.array([0.5], np.float16).view(np.uint8)
    block[0, 2:] = [(j << 4) | (15 - j) for j in range(16)]
    packed, scales, biases, g, bits = qgguf.to_mlx(torch.from_numpy(block), "Q4_0", 32, "t")
    w = dequantize(packed, scales, biases, g, bits, torch.float32)[0].tolist()
    assert w == [0.5 * (15 - j - 8) for j in range(16)] + [0.5 * (j - 8) for j in range(16)]


def test_unsupported_type_and_short_rows_name_the_tensor():
    raw = torch.zeros(2, 210, dtype=torch.uint8)
    with pytest.raises(FormatError, match=r"output\.weight: GGUF type Q6_K is not supported"):
        qgguf.to_mlx(raw, "Q6_K", 256, "output.weight")
    with pytest.raises(FormatError, match=r"blk\.1\.attn_q\.weight: 17 bytes a row"):
        qgguf.to_mlx(torch.zeros(2, 17, dtype=torch.uint8), "Q4_0", 32, "blk.1.attn_q.weight")
