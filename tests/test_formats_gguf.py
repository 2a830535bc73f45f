"""GGUF's Q4_0, Q4_1, Q8_0, Q4_K and Q5_K tensors convert to MLX groups that read back
bit for bit what the `gguf` package's own dequantization gives (float32): Q4_0/Q4_1/Q8_0
blocks from its quantizer, K-quant super-blocks as random bytes (any bytes are a valid
block once d and dmin are finite; the package has no K-quant quantizer). Types without an
exact MLX form, and rows of the wrong length, get one line naming the tensor.

Gemma 3 files as llama.cpp's converter writes them (`formats.gguf_writer`: the bundled
model as Q8_0 and Q4_0; tiny Llama, Qwen 2 and Gemma 3 models): every tensor as the `gguf`
package dequantizes it, the metadata llama.cpp's gemma3 loader reads, and the logits of
the dense model whose matrices went through the package's quantizer and dequantizer
(transformers' GGUF loader is no reference here: it needs accelerate, and it maps no
query_pre_attn_scalar, so it scales Gemma 3's attention by 1/16 where llama.cpp scales
the bundled model's heads of 64 by 1/8). A missing norm, or a stored 1 + w with no
float32 w, gets one line."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T
from gguf import quants

from qfuse.formats import gguf as qgguf
from qfuse.formats.groups import FormatError
from qfuse.quant import dequantize

from .format_checkpoints import CONFIG, IDS, LLAMA, write_gguf

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


def test_q6_k_is_held_dense_as_the_gguf_package_dequantizes_it():
    """Q6_K's groups of 16 have no MLX form: its float32 dequantization, bit for bit."""
    rng = np.random.default_rng(4)
    raw = rng.integers(0, 256, (ROWS, COLS // 256, 210), dtype=np.uint8)
    d = (rng.random((ROWS, COLS // 256, 1)) * 0.01).astype(np.float16)
    raw[..., 208:210] = d.view(np.uint8)
    raw = raw.reshape(ROWS, -1)
    ours = qgguf.dense(torch.from_numpy(raw), "Q6_K", COLS, "output.weight").numpy()
    assert np.array_equal(ours, quants.dequantize(raw, T.Q6_K))


def test_unsupported_type_and_short_rows_name_the_tensor():
    raw = torch.zeros(2, 84, dtype=torch.uint8)
    with pytest.raises(FormatError, match=r"output\.weight: GGUF type Q2_K is not supported"):
        qgguf.to_mlx(raw, "Q2_K", 256, "output.weight")
    with pytest.raises(FormatError, match=r"blk\.1\.attn_q\.weight: 17 bytes a row"):
        qgguf.to_mlx(torch.zeros(2, 17, dtype=torch.uint8), "Q4_0", 32, "blk.1.attn_q.weight")


# --- whole files ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return path, write_gguf(path)


def test_gguf_file_loads_as_the_model_it_dequantizes_to(llama_gguf):
    from qfuse.loading import load_model

    path, dense = llama_gguf
    loaded = load_model(path)
    assert loaded.config.model_type == "llama" and not loaded.config.tie_word_embeddings
    assert loaded.lm_head.bits == 0  # Q6_K: held dense
    ids = torch.tensor([[2, 17, 99, 5, 120, 41, 8, 77]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), dense(ids), rtol=0, atol=1e-5)
    q = loaded.model.layers[1].self_attn.q_proj.quantized().dequantize(torch.float32)
    assert torch.equal(q, dense.model.layers[1].self_attn.q_proj.weight)


def test_truncated_gguf_gets_one_line(llama_gguf, tmp_path):
    from qfuse.loading import CheckpointError, load_model

    data = llama_gguf[0].read_bytes()
    for cut in (100, len(data) - 1000):
        short = tmp_path / f"short{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match=r"truncated") as info:
            load_model(short)
        assert "\n" not in str(info.value)


def test_cli_generates_from_a_gguf_file_with_a_tokenizer_beside_it(llama_gguf, tmp_path,
                                                                   qfuse_here):
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tmp_path / "tiny.gguf"
    shutil.copyfile(llama_gguf[0], path)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    r = qfuse_here("generate", "--model", path, "--max-tokens", "4", "w5 w6 w7")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and r.stdout.startswith("w5 w6 w7")


@pytest.mark.parametrize("arch,kind,message", [
    ("mamba", "F32", r"GGUF architecture 'mamba' is not supported"),
    ("llama", "Q2_K", r"tensor token_embd\.weight is Q2_K, which qfuse does not read"),
])
def test_unknown_architecture_or_type_gets_one_line(tmp_path, arch, kind, message):
    from qfuse.loading import CheckpointError, load_model

    path = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (("block_count", 1), ("embedding_length", 256),
                       ("feed_forward_length", 256), ("attention.head_count", 4)):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    if kind == "F32":
        w.add_tensor("token_embd.weight", np.zeros((8, 256), np.float32))
    else:
        w.add_tensor("token_embd.weight", np.zeros((8, 84), np.uint8), raw_dtype=T[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match=message) as info:
        load_model(path)
    assert "\n" not in str(info.value)


def test_container_reads_what_the_gguf_package_reads(llama_gguf, tmp_path):
    """`GGUFFile` (struct over a memmap) gives the metadata and tensor bytes GGUFReader
    gives, arrays of every value type included."""
    from qfuse.formats.gguf_file import GGUFFile

    path = tmp_path / "meta.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("test.strings", ["a", "", "ünï ▁x"])
    w.add_array("test.floats", [0.5, -1.25])
    w.add_array("test.ints", [1, -2, 3])
    w.add_array("test.bools", [True, False])
    w.add_bool("test.flag", True)
    w.add_float64("test.double", 0.1)
    w.add_int64("test.big", -(2**40))
    w.add_string("test.text", "ok")
    w.add_tensor("a", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("b", np.arange(5, dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for file in (path, llama_gguf[0]):
        ours, theirs = GGUFFile(file), gguf.GGUFReader(str(file))
        assert ours.metadata == {k: f.contents() for k, f in theirs.fields.items()
                                 if not k.startswith("GGUF.")}
        assert [(t.name, t.type, t.shape) for t in ours.tensors] == \
            [(t.name, t.tensor_type.name, tuple(int(n) for n in t.shape))
             for t in theirs.tensors]
        for a, b in zip(ours.tensors, theirs.tensors):
            assert a.data.tobytes() == b.data.tobytes()


# --- Llama 3.1's RoPE scaling as a tensor ----------------------------------------------------

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def llama3_rope_freqs(theta: float, head_dim: int, p: dict) -> np.ndarray:
    """The factors llama.cpp's converter writes as rope_freqs for a llama3 rope_scaling
    ``p``: per frequency, 1 where its wavelength is under original/high_freq_factor, the
    factor where over original/low_freq_factor, and between them the reciprocal of the
    smoothed divisor, 1 / ((1 − s)/factor + s), s = (original/wavelength − low)/(high − low)
    (in float64, stored float32)."""
    old, low, high = p["original_max_position_embeddings"], p["low_freq_factor"], \
        p["high_freq_factor"]
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(p["factor"])
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / p["factor"] + smooth))
    return np.array(out, dtype=np.float32)


def test_gguf_rope_freqs_give_the_llama3_scaled_models_logits(tmp_path):
    """A file as llama.cpp writes Llama 3.1 (rope_freqs from the llama3 parameters, no
    scaling metadata) gives the logits of the model built from the HF config with that
    rope_scaling (float32), over positions past the scaled wavelengths; the factors take
    the default frequencies apart where llama3 scales them (and hold them where not).
    Dividing by the stored factor rounds where HF multiplies by the smoothed divisor: the
    frequencies agree to one float32 rounding (2 of 16 differ by 1 ulp), so the file's
    K-quants are centered ones: the default's large random weights turn an ulp of a
    frequency into 1e-3 of a logit."""
    from qfuse.loading import load_model
    from qfuse.reference import rope_inv_freq

    factors = llama3_rope_freqs(10000.0, 32, LLAMA3)
    assert (factors == 1).any() and (factors == 8).any() and ((factors > 1) & (factors < 8)).any()
    path = tmp_path / "llama31.gguf"
    dense = write_gguf(path, config={"rope_scaling": LLAMA3}, centered=True,
                       rope=lambda w: w.add_tensor("rope_freqs.weight", factors))
    loaded = load_model(path)
    assert loaded.config.rope["full_attention"].freq_factors == tuple(factors.tolist())
    plain = rope_inv_freq(32, 10000.0)
    inv = loaded.model.layers[0].self_attn.inv_freq(torch.device("cpu"))
    assert torch.equal(inv[factors == 1], plain[factors == 1])
    assert bool((inv[factors > 1] < plain[factors > 1]).all())
    want = dense.model.layers[0].self_attn.inv_freq(torch.device("cpu"))  # HF's llama3
    torch.testing.assert_close(inv, want, rtol=2**-23, atol=0)
    ids = torch.arange(3, 51).remainder(120).unsqueeze(0) + 2  # 48 positions
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), dense(ids), rtol=0, atol=1e-5)


def test_gguf_rope_freqs_of_the_wrong_length_get_one_line(tmp_path):
    from qfuse.loading import CheckpointError, load_model

    path = tmp_path / "bad.gguf"
    write_gguf(path, rope=lambda w: w.add_tensor("rope_freqs.weight", np.ones(8, np.float32)))
    with pytest.raises(CheckpointError, match=r"tensor rope_freqs\.weight is F32 of shape "
                                              r"\(8,\), not 16 float factors") as info:
        load_model(path)
    assert "\n" not in str(info.value)


# --- a lone .gguf file: its own tokenizer and chat template, `qfuse info` ------------------

@pytest.fixture(scope="module")
def lone_gguf(tmp_path_factory):
    """A tiny Llama .gguf (the bundled model's vocabulary of 4096) whose metadata carries
    the bundled tokenizer and a chat template, alone in its folder."""
    from .test_gguf_tokenizer import add_bundled_tokenizer

    path = tmp_path_factory.mktemp("lone") / "tiny.gguf"
    write_gguf(path, vocab_size=4096, metadata=add_bundled_tokenizer)
    return path


def test_cli_generates_and_chats_from_a_lone_gguf_file(lone_gguf, qfuse_here):
    assert list(lone_gguf.parent.iterdir()) == [lone_gguf]
    r = qfuse_here("generate", "--model", lone_gguf, "--max-tokens", "4", "def main():")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and r.stdout.startswith("def main():")
    r = qfuse_here("chat", lone_gguf, "--max-tokens", "4", stdin="Hello there\n")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and r.stdout.strip()


def test_cli_info_on_a_lone_gguf_file_names_each_tensors_type(lone_gguf, qfuse_here):
    r = qfuse_here("info", str(lone_gguf), "--dtype", "float16")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    out = r.stdout[r.stdout.index(f"weights of {lone_gguf}"):].splitlines()
    assert out == [
        f"weights of {lone_gguf} as stored, held in float16:",
        "embed_tokens: gguf Q8_0",
        ("layers 0-1 input_layernorm,post_attention_layernorm: gguf F32; in float16: "
         "float32 weights ≤ 2^-11 relative"),
        ("layers 0-1 q_proj,down_proj: gguf Q4_K; in float16: scales d·sc, biases −dmin·m "
         "≤ 2^-11 relative"),
        ("layers 0-1 k_proj,gate_proj: gguf Q5_K; in float16: scales d·sc, biases −dmin·m "
         "≤ 2^-11 relative"),
        "layers 0-1 v_proj: gguf Q8_0",
        "layers 0-1 o_proj: gguf Q4_1",
        "layers 0-1 up_proj: gguf Q4_0",
        "norm: gguf F32; in float16: float32 weights ≤ 2^-11 relative",
        "lm_head: gguf Q6_K, held dense; in float16: weights ≤ 2^-11 relative"]


def test_cli_refuses_a_gguf_tokenizer_it_cannot_build_in_one_line(tmp_path, qfuse_here):
    def bert(w):
        w.add_tokenizer_model("bert")
        w.add_token_list([f"t{i}" for i in range(128)])

    path = tmp_path / "bert.gguf"
    write_gguf(path, metadata=bert)
    r = qfuse_here("generate", "--model", path, "hi")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        (f"qfuse: error: {path}: tokenizer.ggml.model is 'bert', a tokenizer qfuse does not "
         "build (gpt2, llama); put the model's tokenizer.json beside the file")]


# --- Gemma 3, as llama.cpp's converter writes it: `formats.gguf_writer` ----------------------

@pytest.fixture(scope="module")
def bundled_gguf(tmp_path_factory):
    """The bundled Gemma 3 written as each GGUF kind: kind → the .gguf file."""
    from qfuse.formats import gguf_writer
    from qfuse.loading import DEFAULT_MODEL

    root = tmp_path_factory.mktemp("gemma3")
    return {kind: gguf_writer.write_gguf(DEFAULT_MODEL, root / kind, kind)
            for kind in gguf_writer.KINDS}


def _source_state(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state = {}
    for file in sorted(folder.glob("*.safetensors")):
        state |= load_file(str(file))
    return state


def dequantized_reference(folder, kind: str, dtype=torch.float32):
    """The dense model of ``folder`` (float32) as a ``kind`` GGUF file stands for it,
    computed without reading that file: each matrix through the `gguf` package's own
    quantizer and dequantizer (the kind's type: Q8_0 or Q4_0, the embedding and head the
    kind's embedding type), each Gemma norm w as the float32 1 + w the converter stores,
    less 1 (what multiplies by 1 + w)."""
    from qfuse.formats import gguf_writer
    from qfuse.loading import load_model

    projection, embedding = (T[t] for t in gguf_writer.KINDS[kind])
    model = load_model(folder, dtype=torch.float32)
    gemma = model.config.model_type == "gemma3_text"
    with torch.no_grad():
        for name, p in model.named_parameters():
            w = p.detach().numpy()
            if p.dim() == 2:
                qtype = embedding if name in ("model.embed_tokens.weight", "lm_head.weight") \
                    else projection
                p.copy_(torch.from_numpy(quants.dequantize(quants.quantize(w, qtype), qtype)))
            elif gemma and name.endswith("norm.weight"):
                p.copy_(torch.from_numpy((w + np.float32(1)) - np.float32(1)))
    return model.to(dtype)


def test_written_gemma3_gguf_reads_back_as_the_gguf_package_dequantizes(bundled_gguf):
    """Every tensor of the written files, as qfuse reads it, against GGUFReader's bytes
    through `gguf.quants.dequantize`: matrices bit for bit (Q8_0, Q4_0 as MLX groups of
    32), norms as the stored 1 + w less 1: the bundled (bfloat16) w wherever 1 + w holds
    all its bits (|w| ≥ 2^-16; two of its norm weights are smaller, and the file cannot
    hold them)."""
    from qfuse.formats import gguf_writer
    from qfuse.loading import DEFAULT_MODEL

    source = _source_state(DEFAULT_MODEL)
    for kind, path in bundled_gguf.items():
        theirs = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
        ckpt = qgguf.GGUFCheckpoint(path)
        assert ckpt.config["model_type"] == "gemma3_text"
        ours = dict(ckpt.tensors())
        types = set()
        for gname, t in theirs.items():
            hf = qgguf.hf_name(gname, "gemma3")
            module = hf.removesuffix(".weight")
            want = torch.from_numpy(quants.dequantize(t.data, t.tensor_type).copy())
            want = want.reshape(source[hf].shape)
            types.add((gname.split(".")[-2], t.tensor_type.name))
            if gname.endswith("norm.weight"):
                assert t.tensor_type.name == "F32"
                assert torch.equal(want, source[hf].float() + 1)  # the converter's 1 + w
                w = source[hf].float()
                assert torch.equal(ours[hf], want - 1)
                held = w.abs() >= 2**-16
                assert torch.equal(ours[hf][held], w[held])
                torch.testing.assert_close(ours[hf], w, rtol=0, atol=2**-24)
                continue
            spec = ckpt.spec(module)
            got = dequantize(ours[f"{module}.weight"], ours[f"{module}.scales"],
                             ours[f"{module}.biases"], *spec, torch.float32)
            assert torch.equal(got, want), gname
        assert "output.weight" not in theirs  # tied, as the bundled model is
        projection, embedding = gguf_writer.KINDS[kind]
        assert ("attn_q", projection) in types and ("ffn_down", projection) in types
        assert ("token_embd", embedding) in types


def test_gemma3_gguf_metadata_is_llama_cpps(bundled_gguf):
    """The keys llama.cpp's gemma3 loader reads, with the bundled config's values (its
    layers: every sixth global, so no sliding_window_pattern key), and the config qfuse
    reads back from them: the bundled model's own."""
    from qfuse.loading import DEFAULT_MODEL
    from qfuse.models import ModelConfig

    meta = reader_fields(bundled_gguf["gguf-q4_0"])
    assert meta["general.architecture"] == "gemma3"
    assert {k: meta[f"gemma3.{k}"] for k in (
        "context_length", "embedding_length", "block_count", "feed_forward_length",
        "attention.head_count", "attention.head_count_kv", "attention.key_length",
        "attention.value_length", "attention.sliding_window", "rope.freq_base",
        "rope.freq_base_swa")} == {
        "context_length": 1024, "embedding_length": 384, "block_count": 6,
        "feed_forward_length": 1024, "attention.head_count": 6, "attention.head_count_kv": 2,
        "attention.key_length": 64, "attention.value_length": 64,
        "attention.sliding_window": 128, "rope.freq_base": 1e6, "rope.freq_base_swa": 1e4}
    assert meta["gemma3.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6, rel=1e-7)
    assert "gemma3.attention.sliding_window_pattern" not in meta
    assert (meta["tokenizer.ggml.eos_token_id"], meta["tokenizer.ggml.bos_token_id"]) == (1, 2)
    want = ModelConfig.from_file(DEFAULT_MODEL)
    got = ModelConfig.from_dict(qgguf.GGUFCheckpoint(bundled_gguf["gguf-q4_0"]).config)
    for field in ("layer_types", "sliding_window", "rope", "attn_scale", "norm_unit_offset",
                  "sandwich_norms", "embed_scale", "qk_norm", "hidden_act",
                  "tie_word_embeddings", "eos_token_ids", "bos_token_id", "vocab_size",
                  "max_position_embeddings", "final_logit_softcapping"):
        assert getattr(got, field) == getattr(want, field), field
    # rms_norm_eps went through float32
    assert got.rms_norm_eps == float(np.float32(want.rms_norm_eps))


def reader_fields(path) -> dict:
    """A file's metadata as the `gguf` package reads it."""
    return {k: f.contents() for k, f in gguf.GGUFReader(str(path)).fields.items()
            if not k.startswith("GGUF.")}


@pytest.mark.parametrize("kind", ["gguf-q8_0", "gguf-q4_0"])
def test_gemma3_gguf_gives_the_logits_of_the_dense_model_dequantized_alike(bundled_gguf, kind):
    """The loaded file (float32) against the bundled dense model whose matrices went
    through the `gguf` package's quantizer and dequantizer (`dequantized_reference`),
    over 160 positions: past the local layers' window of 128."""
    from qfuse.loading import DEFAULT_MODEL, load_model

    loaded = load_model(bundled_gguf[kind], dtype=torch.float32)
    dense = dequantized_reference(DEFAULT_MODEL, kind)
    ids = torch.arange(160).mul(97).remainder(4000).unsqueeze(0) + 3
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), dense(ids), rtol=0, atol=1e-5)


# Tiny dense models of each architecture the writer writes (bfloat16, as checkpoints are).
TINY = {
    "llama": LLAMA,
    "qwen2": {**LLAMA, "model_type": "qwen2"},  # q/k/v biases
    # two layers, local then global: not llama.cpp's every-sixth, so the file lists them
    "gemma3": {**CONFIG, "query_pre_attn_scalar": 64, "rms_norm_eps": 1e-6,
               "rope_theta": 1e6, "rope_local_base_freq": 1e4,
               "max_position_embeddings": 64},
}


def tiny_folder(root, arch: str, drop: str | None = None):
    """A dense model folder of `TINY`[arch] (seed 0; Gemma norm weights about 0, others
    about 1), less tensor ``drop``."""
    import json

    from safetensors.torch import save_file

    from qfuse.models import Decoder, ModelConfig

    torch.manual_seed(0)
    model = Decoder(ModelConfig.from_dict(TINY[arch]))
    offset = model.config.norm_unit_offset
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0 if offset or not name.endswith("norm.weight") else 1,
                      0.1 if name.endswith("norm.weight") else 0.05)
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
             if k != drop}
    folder = root / arch
    folder.mkdir()
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(TINY[arch]))
    return folder


@pytest.mark.parametrize("arch", list(TINY))
def test_written_gguf_of_each_architecture_gives_its_dequantized_dense_logits(tmp_path, arch):
    """The writer's other architectures (Llama's q/k rows interleaved, Qwen 2's biases)
    and a Gemma 3 whose layer types are not llama.cpp's (written as
    sliding_window_pattern, read back): the loaded Q4_0 file against the dense model
    dequantized alike, over a prompt longer than the Gemma's window of 8."""
    from qfuse.formats import gguf_writer
    from qfuse.loading import load_model

    folder = tiny_folder(tmp_path, arch)
    path = gguf_writer.write_gguf(folder, tmp_path / "out", "gguf-q4_0")
    loaded = load_model(path, dtype=torch.float32)
    dense = dequantized_reference(folder, "gguf-q4_0")
    assert loaded.config.layer_types == dense.config.layer_types
    if arch == "gemma3":
        assert reader_fields(path)["gemma3.attention.sliding_window_pattern"] == \
            [True, False]
    ids = IDS % TINY[arch]["vocab_size"]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), dense(ids), rtol=0, atol=1e-5)


def test_gemma3_gguf_missing_a_norm_gets_one_line(tmp_path, qfuse_here):
    from qfuse.formats import gguf_writer

    folder = tiny_folder(tmp_path, "gemma3",
                         drop="model.layers.1.post_feedforward_layernorm.weight")
    path = gguf_writer.write_gguf(folder, tmp_path / "out", "gguf-q8_0")
    r = qfuse_here("info", path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [(
        f"qfuse: error: {path}: tensor blk.1.post_ffw_norm.weight is missing (a gemma3 "
        "model has it: its norms are attn_norm, post_attention_norm, ffn_norm, "
        "post_ffw_norm, attn_q_norm, attn_k_norm in every layer, and output_norm)")]


def test_gemma3_norm_with_no_float32_w_gets_one_line(tmp_path):
    """A stored 1 + w of 0.25 + 2^-25: w = −0.75 + 2^-25 needs a bit float32 lacks near
    0.75, so qfuse's 1 + w would not be what llama.cpp multiplies by."""
    from qfuse.formats import gguf_writer
    from qfuse.loading import CheckpointError, load_model

    path = gguf_writer.write_gguf(tiny_folder(tmp_path, "gemma3"), tmp_path / "out",
                                  "gguf-q8_0")
    (norm,) = [t for t in gguf.GGUFReader(str(path)).tensors
               if t.name == "blk.0.attn_norm.weight"]
    with open(path, "r+b") as f:
        f.seek(int(norm.data_offset) + 4 * 3)
        f.write(np.array([0.25 + 2**-25], np.float32).tobytes())
    with pytest.raises(CheckpointError, match=r"tensor blk\.0\.attn_norm\.weight holds "
                                              r"0\.25000002980232\d* \(at 3\), which as 1 "
                                              r"\+ w has no float32 w") as info:
        load_model(path)
    assert "\n" not in str(info.value)


def test_writer_refuses_an_attention_scale_llama_cpp_does_not_use(tmp_path):
    """llama.cpp's gemma3 scales by 1/sqrt(head_dim): a query_pre_attn_scalar of 256 on
    heads of 64 has no GGUF form."""
    from qfuse.errors import UserError
    from qfuse.formats import gguf_writer

    folder = tiny_folder(tmp_path, "gemma3")
    (folder / "config.json").write_text(json.dumps({**TINY["gemma3"],
                                                    "query_pre_attn_scalar": 256}))
    with pytest.raises(UserError, match="query_pre_attn_scalar gives an attention scale"):
        gguf_writer.write_gguf(folder, tmp_path / "out", "gguf-q8_0")
    assert not (tmp_path / "out").exists()
