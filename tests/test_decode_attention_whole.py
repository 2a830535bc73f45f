"""Decode attention over whole contexts (`AttentionLaunch(whole=True)`: one program per
(sequence, kv head), no splits, no merge): bit for bit the split kernel run with one split
of the capacity and the same tiles, over slotted and paged caches, with windows, soft-caps
and empty sequences; a sequence's bits its own alone; the plan's choice by rows and
cache length, and its lever. CPU cases run under the Triton interpreter (fp16, tiny
shapes); the `gpu` cases take bf16 at the Gemma 3 12B and Llama 3 8B shapes."""

import pytest
import torch

from qfuse import choose, levers, ops
from qfuse.testing import assert_bitwise_equal, errors, kernel_device, make_case, paged_copy

DEVICE = kernel_device()
gpu = pytest.mark.gpu
kernels = pytest.importorskip("qfuse.kernels.attention.decode_attention")


def attend(q, k, v, lengths, scale, window=None, softcap=None, table=None, **launch):
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    kernels.decode_attention_quantized_kv(q, k, v, lengths, scale, window, softcap, out=out,
                                          block_table=table,
                                          launch=kernels.AttentionLaunch(**launch))
    return out


def one_split(q, k, v, lengths, scale, window=None, softcap=None, table=None, **launch):
    """The split kernel with one split of the capacity (`whole_split`)."""
    n_max = kernels.tokens_per_sequence(k, table)
    return attend(q, k, v, lengths, scale, window, softcap, table, merge="separate",
                  split=kernels.whole_split(n_max), **launch)


# Nmax 192 (one split of 256), 32-token tiles: lengths end inside tiles, on a tile's edge
# (64), at 0, and at the capacity; a window of 40 starts sequence 3 in its fifth tile,
# so the whole launch skips tiles the split walks.
LENGTHS = [37, 64, 0, 192]


@pytest.mark.parametrize("bits,path,D,Hq", [
    (0, "tensor_cores", 64, 4),
    (4, "codes", 128, 4),
    (8, "tensor_cores", 64, 2),  # G = 1
])
@pytest.mark.parametrize("window,softcap", [(None, None), (40, 20.0)])
def test_whole_is_one_split_bit_for_bit(bits, path, D, Hq, window, softcap):
    q, k, v, lengths = make_case(4, Hq, 2, D, 192, LENGTHS, bits, torch.float16, DEVICE)
    whole = attend(q, k, v, lengths, 0.125, window, softcap, path=path, whole=True,
                   block_n=32)
    assert_bitwise_equal(whole, one_split(q, k, v, lengths, 0.125, window, softcap,
                                          path=path, block_n=32))
    assert torch.equal(whole[2], torch.zeros_like(whole[2]))  # length 0: defined zeros
    err, err_compat = errors(whole, q, k, v, lengths, 0.125, window, softcap)
    assert err <= 2 * err_compat, (err, err_compat)
    # paged, pages shuffled in the pool: the same tokens in the same tiles, the same bits
    kp, table = paged_copy(k, lengths, 16, seed=1, window=window)
    vp, _ = paged_copy(v, lengths, 16, seed=1, window=window)
    assert_bitwise_equal(attend(q, kp, vp, lengths, 0.125, window, softcap, table,
                                path=path, whole=True, block_n=32), whole)


def test_default_tiles_are_the_one_splits():
    """Without launch knobs the whole launch takes the tiles the split kernel takes for
    one split of the capacity (the codes kernel's 128-token tiles here)."""
    q, k, v, lengths = make_case(2, 4, 2, 128, 256, [200, 129], 8, torch.float16, DEVICE)
    whole = attend(q, k, v, lengths, 0.1, whole=True)
    assert_bitwise_equal(whole, one_split(q, k, v, lengths, 0.1))


def test_a_sequence_is_its_own_alone():
    """Batch invariance: each row of a batch of 9 equals that sequence attended alone, and
    in a batch of 2 with another neighbour."""
    lengths = [5, 90, 0, 33, 96, 1, 64, 17, 70]
    q, k, v, L = make_case(9, 4, 2, 64, 96, lengths, 0, torch.float16, DEVICE)
    kp, table = paged_copy(k, L, 16, seed=4)
    vp, _ = paged_copy(v, L, 16, seed=4)
    together = attend(q, kp, vp, L, 0.1, table=table, whole=True)
    for b in (0, 4, 8):
        alone = attend(q[b:b + 1], kp, vp, L[b:b + 1], 0.1, table=table[b:b + 1], whole=True)
        assert torch.equal(alone[0], together[b])
    pair = [1, 4]
    two = attend(q[pair], kp, vp, L[pair], 0.1, table=table[pair], whole=True)
    assert torch.equal(two, together[pair])


@pytest.mark.parametrize("options,match", [
    ({"whole": True, "path": "ws"}, "no splits and no merge"),
    ({"whole": True, "merge": "fused"}, "no splits and no merge"),
    ({"whole": True, "split": 256}, "no splits and no merge"),
    ({"whole": 1}, "true or false"),
])
def test_whole_options_are_checked(options, match):
    with pytest.raises(ValueError, match=match):
        kernels.AttentionLaunch(**options)


def _choice(rows, n_max, window=None, table_pages=None):
    q = torch.zeros(rows, 4, 64, dtype=torch.float16, device=DEVICE)
    if table_pages is None:
        k = torch.zeros(rows, 2, n_max, 64, dtype=torch.float16, device=DEVICE)
        table = None
    else:  # a pool of 4 pages of n_max tokens, table_pages entries a row
        k = torch.zeros(4, 2, n_max, 64, dtype=torch.float16, device=DEVICE)
        table = torch.zeros(rows, table_pages, dtype=torch.int32, device=DEVICE)
    return choose.choose_decode_attention(q, k, k, 0.125, None, table, window)


def test_the_choice_by_rows_and_cache_length():
    limit, rows = choose.WHOLE_ATTENTION_MAX_TOKENS, choose.WHOLE_ATTENTION_MIN_ROWS
    with levers.use_tier("fast"):
        assert _choice(rows, limit).kernel == "decode_attention_whole"
        assert _choice(rows - 1, limit).kernel == "decode_attention"
        assert "rows" in _choice(rows - 1, limit).reason
        long = _choice(rows, limit + 16)
        assert long.kernel == "decode_attention" and "tokens" in long.reason
        # a window no longer than the limit bounds what a sequence attends
        assert _choice(rows, 4 * limit, window=limit).kernel == "decode_attention_whole"
        # paged: the capacity is pages a row × tokens a page
        assert _choice(rows, 16, table_pages=limit // 16).kernel == "decode_attention_whole"
        assert _choice(rows, 16, table_pages=limit // 16 + 1).kernel == "decode_attention"
        with levers.setting("QFUSE_DECODE_ATTENTION_WHOLE", "0"):
            off = _choice(rows, limit)
        assert off.kernel == "decode_attention" and "QFUSE_DECODE_ATTENTION_WHOLE" in off.reason
    with levers.use_tier("compat"):
        assert _choice(rows, limit).kernel == "reference"


def test_on_a_gpu_only_where_asked(monkeypatch):
    cuda = torch.device("cuda")
    with levers.use_tier("fast"):
        monkeypatch.delenv("QFUSE_DECODE_ATTENTION_WHOLE", raising=False)
        assert "QFUSE_DECODE_ATTENTION_WHOLE=1" in choose.whole_attention_refusal(cuda, 256)
        assert choose.decode_attention_route(cuda, 256) is None  # no row count differs
        monkeypatch.setenv("QFUSE_DECODE_ATTENTION_WHOLE", "1")
        assert choose.whole_attention_refusal(cuda, 256) is None
        assert choose.decode_attention_route(cuda, 8) == "attention_whole"
        assert choose.decode_attention_route(cuda, 4) == "attention_split"


def test_ops_runs_the_whole_kernel_at_eight_rows():
    q, k, v, lengths = make_case(8, 4, 2, 64, 48, [3, 48, 0, 20, 7, 33, 48, 1], 0,
                                 torch.float16, DEVICE)
    levers.reset_counters()
    with levers.use_tier("fast"):
        out = ops.decode_attention(q, k, v, lengths, 0.1)
    counts = levers.counters()
    assert counts.get("decode_attention_whole") == 1 and counts.get("decode_attention") == 1
    assert torch.equal(out, attend(q, k, v, lengths, 0.1, whole=True))


def test_product_kernels_tell_the_attention_forms_apart(monkeypatch):
    """Serving's deterministic buckets rest on `Decoder.product_kernels`: where whole
    contexts may run, a row count below WHOLE_ATTENTION_MIN_ROWS and one at it differ."""
    from qfuse.models.config import ModelConfig
    from qfuse.models.decoder import Decoder
    from qfuse.serving.buckets import step_buckets

    model = Decoder(ModelConfig.from_dict({
        "model_type": "llama", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 64}))

    class Held:  # stands in for fragment-held weights: row-invariant by declaration
        n, k, group_size, device, parent = 1, 64, 64, torch.device(DEVICE), None

    for lin in model.modules():
        if hasattr(lin, "held"):
            monkeypatch.setattr(lin, "held", Held(), raising=False)
    monkeypatch.setattr(ops, "fragment_route", lambda x, w: "fragment")
    monkeypatch.setattr(ops, "ROW_INVARIANT_ROUTES", ("fragment",))
    # the fused steps' own row limit (8 here) off, so the attention alone tells rows apart
    with levers.use_tier("fast"), levers.setting("QFUSE_FUSED_STEPS", "0"):
        rows = choose.WHOLE_ATTENTION_MIN_ROWS
        assert model.product_kernels(rows)[-1] == "attention_whole"
        assert model.product_kernels(rows - 1)[-1] == "attention_split"
        assert model.product_kernels(rows) == model.product_kernels(4 * rows)
        assert step_buckets(model, 4 * rows, deterministic=True) == [rows, 2 * rows, 4 * rows]


# ---- GPU (bf16) ------------------------------------------------------------------------

SHAPES = [  # (bits, Hq, Hkv, D): Gemma 3 12B kv4 and kv8, Llama 3 8B bf16 and kv4
    (4, 16, 8, 256), (8, 16, 8, 256), (0, 32, 8, 128), (4, 32, 8, 128)]


@gpu
@pytest.mark.parametrize("bits,Hq,Hkv,D", SHAPES)
@pytest.mark.parametrize("window,softcap", [(None, None), (1000, None), (None, 50.0)])
def test_gpu_whole_is_one_split_bit_for_bit(bits, Hq, Hkv, D, window, softcap):
    lengths = [1, 97, 0, 2048, 1500, 640, 129, 2000]
    q, k, v, L = make_case(8, Hq, Hkv, D, 2048, lengths, bits, torch.bfloat16, "cuda")
    kp, table = paged_copy(k, L, 16, seed=2, window=window)
    vp, _ = paged_copy(v, L, 16, seed=2, window=window)
    scale = D**-0.5
    whole = attend(q, kp, vp, L, scale, window, softcap, table, whole=True)
    assert_bitwise_equal(whole, one_split(q, kp, vp, L, scale, window, softcap, table))
    assert torch.equal(whole[2], torch.zeros_like(whole[2]))
    err, err_compat = errors(whole, q, k, v, L, scale, window, softcap)
    assert err <= 2 * err_compat, (err, err_compat)


@gpu
@pytest.mark.parametrize("bits,Hq,Hkv,D", SHAPES[::2])
def test_gpu_rows_are_batch_invariant(bits, Hq, Hkv, D):
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(0, 513, (256,), generator=g).tolist()
    q, k, v, L = make_case(256, Hq, Hkv, D, 512, lengths, bits, torch.bfloat16, "cuda")
    kp, table = paged_copy(k, L, 16, seed=5)
    vp, _ = paged_copy(v, L, 16, seed=5)
    together = attend(q, kp, vp, L, D**-0.5, table=table, whole=True)
    for rows in ([0], [7, 8, 9, 10, 11, 12, 13, 14], list(range(200, 232))):
        part = attend(q[rows], kp, vp, L[rows], D**-0.5, table=table[rows], whole=True)
        assert torch.equal(part, together[rows])


@gpu
def test_gpu_graph_replays_the_whole_launch():
    q, k, v, lengths = make_case(8, 16, 8, 256, 1024, [100, 500, 1, 1024, 0, 7, 640, 999], 4,
                                 torch.bfloat16, "cuda")
    static_len = lengths.clone()
    launch = kernels.AttentionLaunch(whole=True)
    attend(q, k, v, static_len, 0.0625, whole=True)  # compiles
    torch.cuda.synchronize()
    out = torch.empty_like(q)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.decode_attention_quantized_kv(q, k, v, static_len, 0.0625, out=out,
                                              launch=launch)
    for n in ([100, 500, 1, 1024, 0, 7, 640, 999], [101, 777, 3, 1000, 1, 1024, 0, 5]):
        static_len.copy_(torch.tensor(n, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, attend(q, k, v, static_len, 0.0625, whole=True))
