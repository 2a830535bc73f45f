"""AWQ, GPTQ and compressed-tensors checkpoints load as MLX affine groups (`qfuse.formats`).

Small checkpoints of a tiny random Gemma 3 (`format_checkpoints.write_random`) are written
by packers following each format's documented layout (`qfuse.formats.writers`: AutoAWQ's
GEMM interleave, AutoGPTQ's row packing and its z − 1 zeros; compressed-tensors' own
`pack_to_int32` where the package imports), with hand-worked words checking the packers
themselves. The converted weights must read back exactly the format's
dequantization (q − z)·s in float32 and within one unit in the last place in float16; the
loaded model's logits must be those of the same model holding the dequantized weights
densely. Bad files get one line (CheckpointError)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from qfuse.formats import awq, gptq, writers
from qfuse.formats.groups import to_mlx
from qfuse.loading import CheckpointError, load_model
from qfuse.quant import dequantize

from .format_checkpoints import (
    ALL_PROJECTIONS,
    IDS,
    linears,
    random_groups,
    reference,
    write_random,
)

# --- hand-worked words --------------------------------------------------------------------

def test_awq_word_holds_columns_in_its_interleaved_order():
    """0x76543210: nibble i holds i, which AWQ's order puts in column ORDER[i]."""
    word = torch.tensor([[0x76543210]], dtype=torch.int32)
    assert awq.unpack_columns(word).tolist() == [[0, 4, 1, 5, 2, 6, 3, 7]]
    assert torch.equal(writers.pack_awq(awq.unpack_columns(word)), word)


def test_gptq_word_holds_rows_in_order_and_v1_zeros_add_one():
    """qweight 0x76543210 holds rows 0..7 of its column; an original-format zero stored as 7
    is 8 (AutoGPTQ writes z − 1), and stored 15 wraps to 0."""
    qweight = torch.zeros(4, 8, dtype=torch.int32)  # 32 input rows, 8 output columns
    qweight[0, 0] = 0x76543210
    qzeros = torch.tensor([[0x000000F7]], dtype=torch.int32)  # columns 0..7: 7, 15, 0, ...
    scales = torch.tensor([[0.5, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.float16)
    tensors = {"m.qweight": qweight, "m.qzeros": qzeros, "m.scales": scales}
    codes, s, z = gptq.read(tensors.get, "m", {"bits": 4}, 8, 32)
    assert codes[0, :8].tolist() == list(range(8)) and codes[0, 8:].tolist() == [0] * 24
    assert z[:2, 0].tolist() == [8, 0]
    packed, sc, bias = to_mlx(codes, s, z, 32, 4, "m")
    w = dequantize(packed, sc, bias, 32, 4)
    assert w[0, :8].tolist() == [(q - 8) * 0.5 for q in range(8)]
    _, _, z2 = gptq.read(tensors.get, "m", {"bits": 4, "checkpoint_format": "gptq_v2"}, 8, 32)
    assert z2[:2, 0].tolist() == [7, 15]


# --- tiny checkpoints ---------------------------------------------------------------------

def _assert_same_model(folder, dense):
    loaded = load_model(folder)
    for name, lin in linears(loaded).items():
        assert lin.bits, name
        got = lin.quantized().dequantize(torch.float32)
        assert torch.equal(got, linears(dense)[name].weight.detach()), name
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDS), dense(IDS), rtol=0, atol=1e-5)


@pytest.mark.parametrize("group", [64, 128, -1])
def test_awq_loads_exactly(tmp_path, group):
    _assert_same_model(*write_random(tmp_path, "awq", group))


@pytest.mark.parametrize("bits,group", [(4, 64), (4, -1), (8, 32), (2, 128)])
def test_gptq_loads_exactly(tmp_path, bits, group):
    _assert_same_model(*write_random(tmp_path, "gptq", group, bits))


def test_gptq_act_order_on_down_proj_is_served_by_permuting_gate_and_up(tmp_path):
    folder, dense = write_random(tmp_path, "gptq", 64, act_order=("mlp.down_proj",))
    loaded = load_model(folder)
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDS), dense(IDS), rtol=0, atol=1e-5)


def test_compressed_tensors_act_order_on_down_proj_is_served_too(tmp_path):
    folder, dense = write_random(tmp_path, "ct", 64, act_order=("mlp.down_proj",))
    loaded = load_model(folder)
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDS), dense(IDS), rtol=0, atol=1e-5)


def _prefill_and_step(model):
    """Logits of a prefill of IDS and of one decode step after it (the plans' sites)."""
    from qfuse.runtime.cache import KVCache

    cache = KVCache(model.config, 1, 16, model.dtype, torch.device("cpu"))
    with torch.no_grad():
        prompt = model(IDS, cache=cache)
        return prompt, model.decode(torch.tensor([5]), cache)


@pytest.mark.parametrize("shared", [True, False], ids=["orders-shared", "orders-apart"])
def test_gptq_act_order_on_every_projection_is_served(tmp_path, shared):
    """desc_act on q/k/v/o/gate/up/down: columns sorted by group at load, down's order
    folded into gate/up's rows, the others' inputs gathered; prefill and decode logits
    are the dense model's. Orders apart (q, k, v each their own): each its own product."""
    folder, dense = write_random(tmp_path, "gptq", 64, act_order=ALL_PROJECTIONS, shared=shared)
    loaded = load_model(folder)
    attn, mlp = loaded.model.layers[0].self_attn, loaded.model.layers[0].mlp
    for lin in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj):
        assert lin.input_perm is not None
    assert mlp.down_proj.input_perm is None  # folded into gate/up's rows
    for got, want in zip(_prefill_and_step(loaded), _prefill_and_step(dense)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    with torch.no_grad():  # the per-call path (Linear.forward, MLP.forward) too
        h = torch.randn(1, 3, 128)
        torch.testing.assert_close(attn.q_proj(h), dense.model.layers[0].self_attn.q_proj(h),
                                   rtol=0, atol=1e-5)
        torch.testing.assert_close(mlp(h), dense.model.layers[0].mlp(h), rtol=0, atol=1e-5)
    groups = [len(g) for g in loaded.product_groups()[:4 if shared else 7]]
    assert groups == ([3, 1, 2, 1] if shared else [1] * 7)  # layer 0: stacked where alike
    lines = "\n".join(p for q in loaded.plans for p in q.describe())
    assert "input gathered (act-order)" in lines
    if not shared:
        assert "act-order input orders differ" in lines


def test_gptq_act_order_models_are_named_to_the_fixed_order_paths(tmp_path):
    """The fused decode steps and the persistent schedule take weights in stored column
    order: `gathered_input` names the first Linear they would get wrong."""
    from qfuse.models.decoder import gathered_input

    folder, dense = write_random(tmp_path, "gptq", 64, act_order=("o_proj",))
    assert gathered_input(dense) is None
    assert gathered_input(load_model(folder)) == (
        "model.layers.0.self_attn.o_proj gathers its input (act-order weight)")


def test_gptq_act_order_held_in_kernel_order_keeps_the_logits(tmp_path):
    """Q/K/V stacked in the kernel's order (bf16 weights) over one shared gather give the
    logits of the MLX-layout model, bit for bit (the reference reads either form alike)."""
    folder, _ = write_random(tmp_path, "gptq", 64, act_order=ALL_PROJECTIONS)
    mlx, held = (load_model(folder, dtype=torch.bfloat16) for _ in range(2))
    assert held.hold_kernel_forms(always=True) > 0
    assert held.model.layers[0].self_attn.k_proj.held.parent is not None  # stacked
    for got, want in zip(_prefill_and_step(held), _prefill_and_step(mlx)):
        assert torch.equal(got, want)


def test_oracle_of_an_act_order_model_puts_the_columns_back(tmp_path):
    from qfuse.oracle import oracle_model

    folder, dense = write_random(tmp_path, "gptq", 64, act_order=ALL_PROJECTIONS)
    with torch.no_grad():
        torch.testing.assert_close(oracle_model(load_model(folder))(IDS), dense(IDS),
                                   rtol=0, atol=1e-5)


def test_quantize_refuses_act_order_it_cannot_write_naming_the_tensor(tmp_path):
    """MLX holds no input permutation: `qfuse quantize` names the g_idx in one line."""
    from qfuse.convert import quantize_checkpoint
    from qfuse.errors import UserError

    folder, _ = write_random(tmp_path, "gptq", 64, act_order=("self_attn.q_proj",))
    with pytest.raises(UserError, match=r"layers\.0\.self_attn\.q_proj\.g_idx: act-order "
                                        r"groups on the input of") as info:
        quantize_checkpoint(folder, tmp_path / "mlx")
    assert "\n" not in str(info.value) and not (tmp_path / "mlx").exists()


@pytest.mark.parametrize("bits,group", [(4, 64), (8, 128), (4, -1)])
def test_compressed_tensors_loads_exactly(tmp_path, bits, group):
    _assert_same_model(*write_random(tmp_path, "ct", group, bits))


# --- precision in the model's dtype ------------------------------------------------------

def _ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at |x| (float32; below the smallest normal, its spacing)."""
    mantissa = {torch.float16: 10, torch.bfloat16: 7}[dtype]
    mag = x.abs().to(torch.float32).clamp(min=torch.finfo(dtype).tiny)
    return torch.exp2(torch.floor(torch.log2(mag)) - mantissa)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
def test_bias_rounds_once_and_weights_stay_within_the_stated_bound(dtype, bits):
    """Scales stored in the model dtype (AWQ/GPTQ write float16, llm-compressor bfloat16):
    the bias is −z·s rounded once to nearest, and each weight is within ½ ulp(z·s) + 1 ulp(w)
    of the format's own (q − z)·s computed in that dtype."""
    gen = torch.Generator().manual_seed(2)
    codes, scale, zero = random_groups(64, 256, 64, bits, gen)
    scale = scale.to(dtype)
    packed, scales, biases = to_mlx(codes, scale, zero, 64, bits, "m")
    exact = -zero.to(torch.float64) * scale.to(torch.float64)
    assert torch.equal(biases.to(torch.float64), exact)  # float32: exact
    biases = biases.to(dtype)
    assert torch.equal(biases, exact.to(dtype))  # one rounding to nearest
    got = dequantize(packed, scales.to(dtype), biases, 64, bits, dtype)
    g_idx = torch.arange(256) // 64
    ref = reference(codes, scale, zero, g_idx, dtype)  # the formats' own, in the dtype
    zs = (zero[:, g_idx] * scale[:, g_idx].to(torch.float32))
    bound = 0.5 * _ulp(zs, dtype) + _ulp(ref, dtype)
    err = (got.to(torch.float32) - ref.to(torch.float32)).abs()
    assert bool((err <= bound).all()), float((err - bound).max())
    assert int((err > 0).sum()) > 0  # the bound is not vacuous: some weights do round


# --- compressed-tensors' own packer and dequantization ------------------------------------

def test_compressed_tensors_package_packs_and_dequantizes_as_qfuse_reads():
    """The package's `pack_to_int32` writes the words qfuse reads, and its compressor's
    `decompress` gives the weights qfuse's converted groups read back (float32)."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    from qfuse.formats import compressed

    gen = torch.Generator().manual_seed(3)
    codes, scale, zero = random_groups(64, 256, 128, 4, gen)
    scale = scale.to(torch.float32)
    signed = (codes - 8).to(torch.int8)
    zp = (zero - 8).to(torch.int8)
    state = {"weight_packed": pack_to_int32(signed, 4), "weight_scale": scale,
             "weight_zero_point": pack_to_int32(zp, 4, packed_dim=0),
             "weight_shape": torch.tensor([64, 256])}
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=False, strategy="group", group_size=128))
    theirs = PackedQuantizationCompressor.decompress(dict(state), scheme)["weight"]
    mine = {f"m.{k}": v for k, v in state.items()}
    u, s, z = compressed.read(lambda n, required=True: mine.get(n), "m", {}, 64, 256)
    packed, scales, biases = to_mlx(u, s, z, 128, 4, "m")
    assert torch.equal(dequantize(packed, scales, biases, 128, 4, torch.float32),
                       theirs.to(torch.float32))
    assert ct is not None


# --- bad files: one line each -------------------------------------------------------------

def _edit(folder, drop=(), replace=None, config=None):
    from safetensors.torch import load_file

    state = load_file(str(folder / "model.safetensors"))
    for name in drop:
        del state[name]
    state |= replace or {}
    save_file(state, str(folder / "model.safetensors"))
    if config:
        raw = json.loads((folder / "config.json").read_text())
        raw["quantization_config"] |= config
        (folder / "config.json").write_text(json.dumps(raw))


Q = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("kind,edit,message", [
    ("awq", {"config": {"quant_method": "hqq"}}, r"quant_method 'hqq' is not supported"),
    ("awq", {"config": {"version": "gemv"}}, r"AWQ version 'gemv' is not supported"),
    ("gptq", {"config": {"bits": 3}}, r"GPTQ with 3 bits is not supported"),
    ("awq", {"config": {"group_size": 48}}, r"group size 48 does not divide the row"),
    ("awq", {"drop": [f"{Q}.scales"]}, rf"{Q}\.scales' is missing"),
    ("gptq", {"drop": [f"{Q}.qzeros"]}, rf"{Q}\.qzeros' is missing"),
    ("ct", {"drop": [f"{Q}.weight_scale"]}, rf"{Q}\.weight_scale' is missing"),
    ("ct", {"config": {"format": "float-quantized"}}, r"format 'float-quantized' is not "),
    ("ct", {"config": {"config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "int"}, "input_activations": {"num_bits": 8, "type": "int"}}}}},
     r"group_0: quantized input activations are not supported"),
    ("gptq", {"replace": {f"{Q}.g_idx": torch.full((128,), 7, dtype=torch.int32)}},
     rf"{Q}\.g_idx: g_idx holds groups outside \[0, 2\)"),
    ("gptq", {"replace": {f"{Q}.g_idx": torch.zeros(100, dtype=torch.int32)}},
     rf"{Q}\.g_idx: g_idx has shape \(100,\)"),
    ("gptq", {"replace": {f"{Q}.g_idx": torch.tensor([0] * 96 + [1] * 32, dtype=torch.int32)
                          [torch.randperm(128, generator=torch.Generator().manual_seed(0))]}},
     rf"{Q}\.g_idx: act-order groups of unequal sizes \(32, 96 columns"),
])
def test_bad_files_get_one_line(tmp_path, kind, edit, message):
    folder, _ = write_random(tmp_path, kind)
    _edit(folder, **edit)
    with pytest.raises(CheckpointError, match=message) as info:
        load_model(folder)
    assert "\n" not in str(info.value)


# --- checkpoints written from a dense model (`writers.write_checkpoint`) ----------------------

@pytest.mark.parametrize("kind", [k for k, v in writers.KINDS.items() if v[0] != "gguf"])
def test_writer_rounds_each_projection_to_nearest_in_its_format(tmp_path, kind):
    """The bundled model written in each format: every projection's stored groups, read as
    the format reads them, are within half a step of the dense weight (no code clips),
    and the folder loads with every projection quantized; GPTQ act-order's groups are no
    runs of columns, q/k/v sharing one order and gate/up another (one input each)."""
    from safetensors import safe_open

    from qfuse.formats import reader
    from qfuse.loading import DEFAULT_MODEL, safetensors_files
    from qfuse.quant import unpack

    dense = {}
    for file in safetensors_files(DEFAULT_MODEL):
        with safe_open(str(file), framework="pt") as f:
            dense |= {n: f.get_tensor(n) for n in f.keys() if n.endswith("_proj.weight")}  # noqa: SIM118
    folder = writers.write_checkpoint(DEFAULT_MODEL, tmp_path / kind, kind)
    q = json.loads((folder / "config.json").read_text())["quantization_config"]
    fmt = reader(q)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        stored = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118

    def get(name, required=True):
        return stored.get(name)

    assert not any(n.endswith("_proj.weight") for n in stored)
    for name, w in dense.items():
        m = name[: -len(".weight")]
        codes, scale, zero = fmt.read(get, m, q, *w.shape)
        if codes.dtype == torch.uint32:  # compressed-tensors: MLX words
            codes = unpack(codes, 4)
        g_idx = stored.get(f"{m}.g_idx", torch.arange(w.shape[1]) // 64).to(torch.int64)
        step = scale.to(torch.float32)[:, g_idx]
        err = (reference(codes, scale, zero, g_idx) - w.to(torch.float32)).abs()
        assert bool((err <= step / 2 * (1 + 2**-20)).all()), m
    model = load_model(folder)
    assert all(lin.bits == 4 for lin in linears(model).values())
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    if kind == "gptq-act-order":
        orders = {p: stored[f"model.layers.0.{p}.g_idx"] for p in (
            "self_attn.q_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")}
        assert torch.equal(orders["self_attn.q_proj"], orders["self_attn.v_proj"])
        assert torch.equal(orders["mlp.gate_proj"], orders["mlp.up_proj"])
        assert not torch.equal(orders["self_attn.q_proj"], orders["mlp.gate_proj"])
        assert attn.q_proj.input_perm is not None and attn.o_proj.input_perm is not None
        assert mlp.gate_proj.input_perm is not None
        assert [len(g) for g in model.product_groups()[:4]] == [3, 1, 2, 1]  # one order each
    else:
        assert attn.q_proj.input_perm is None and mlp.gate_proj.input_perm is None


# --- the command line and the API over a converted folder ---------------------------------

def test_cli_generates_from_an_awq_folder_and_the_api_loads_it(tmp_path, qfuse_here):
    import qfuse
    from qfuse.loading import DEFAULT_MODEL

    # The bundled model round-to-nearest quantized into AWQ's layout (4-bit g128).
    folder = writers.write_checkpoint(DEFAULT_MODEL, tmp_path / "awq", "awq", group=128)
    r = qfuse_here("generate", "--model", folder, "--max-tokens", "6", "Once upon a time")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and r.stdout.strip()
    model, tokenizer = qfuse.load(folder, device="cpu", progress=False)
    assert model.model.layers[0].mlp.down_proj.bits == 4 and tokenizer.get_vocab_size() > 0


def test_cli_refuses_an_unknown_quant_method_in_one_line(tmp_path, qfuse_here):
    folder, _ = write_random(tmp_path, "awq")
    _edit(folder, config={"quant_method": "bitsandbytes"})
    (folder / "tokenizer.json").write_text("{}")
    r = qfuse_here("generate", "--model", folder, "hi")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        (f"qfuse: error: {folder / 'config.json'}: quant_method 'bitsandbytes' is not "
         "supported (qfuse reads awq, gptq, compressed-tensors, MLX and dense checkpoints)")]


@pytest.mark.parametrize("kind,act_order", [("awq", ()), ("gptq", ("mlp.down_proj",))])
def test_quantize_rewrites_a_converted_folder_in_the_mlx_layout(tmp_path, kind, act_order):
    """`qfuse quantize` keeps the source's codes and groups: the MLX folder it writes loads
    as the same model, with a plain `quantization` block."""
    from qfuse.convert import quantize_checkpoint

    folder, dense = write_random(tmp_path, kind, 64, act_order=act_order)
    out = quantize_checkpoint(folder, tmp_path / "mlx")
    raw = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in raw and raw["quantization"] == {"group_size": 64,
                                                                        "bits": 4}
    if act_order:  # gate/up rows and down's columns permuted: the same function
        with torch.no_grad():
            torch.testing.assert_close(load_model(out)(IDS), dense(IDS), rtol=0, atol=1e-5)
    else:
        _assert_same_model(out, dense)


# --- `qfuse info`: each weight's source format, and what the model's dtype rounds ---------

@pytest.mark.parametrize("kind,act_order,text", [
    ("awq", (), "awq 4-bit g64"),
    ("gptq", ("mlp.down_proj",), "gptq 4-bit g64"),
    ("ct", (), "compressed-tensors 4-bit g64"),
])
def test_info_names_each_weights_source_format_grouped_by_layers(tmp_path, kind, act_order,
                                                                 text):
    from qfuse.formats.sources import summarize
    from qfuse.loading import weight_sources

    folder, _ = write_random(tmp_path, kind, 64, act_order=act_order)
    sources = weight_sources(folder)
    lines = summarize({n: s.line(torch.float32) for n, s in sources.items()})
    projections = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj" + \
        ("" if act_order else ",down_proj")
    assert lines == [
        "embed_tokens,norm: dense float32",
        ("layers 0-1 input_layernorm,q_norm,k_norm,post_attention_layernorm,"
         "pre_feedforward_layernorm,post_feedforward_layernorm: dense float32"),
        f"layers 0-1 {projections}: {text}",
        *([f"layers 0-1 down_proj: {text} act-order"] if act_order else [])]


@pytest.mark.parametrize("dtype,stated", [
    (torch.float16, "bias −z·s ≤ 1/128 step"),
    (torch.bfloat16, "bias −z·s ≤ 1/16 step, float16 scales ≤ 2^-8 relative"),
])
def test_info_states_what_the_dtype_rounds_and_the_loaded_model_keeps_to_it(tmp_path, dtype,
                                                                           stated):
    """The rounding `qfuse info` states for an AWQ folder held in ``dtype`` bounds what
    loading it in that dtype does to the biases and scales (against float32, exact)."""
    from qfuse.loading import weight_sources

    folder, _ = write_random(tmp_path, "awq", 64)
    source = weight_sources(folder)["model.layers.0.self_attn.q_proj"]
    assert source.line(dtype) == f"awq 4-bit g64; in {str(dtype)[6:]}: {stated}"
    assert source.rounding(torch.float32) is None
    step = 1 / 128 if dtype == torch.float16 else 1 / 16
    exact, held = linears(load_model(folder)), linears(load_model(folder, dtype=dtype))
    rounded = 0
    for name, lin in exact.items():
        q, h = lin.quantized(), held[name].quantized()
        err = (h.biases.to(torch.float32) - q.biases).abs()
        assert bool((err <= step * q.scales.abs()).all()), name
        rounded += int((err > 0).sum())
        s_err = (h.scales.to(torch.float32) - q.scales).abs()
        assert bool((s_err <= 2.0 ** -8 * q.scales.abs()).all()), name
        if dtype == torch.float16:
            assert torch.equal(h.scales.to(torch.float32), q.scales)  # stored float16
    assert rounded > 0  # the statement is not vacuous: biases do round


def test_cli_info_prints_the_weights_sources(tmp_path, qfuse_here):
    folder, _ = write_random(tmp_path, "gptq", 64, act_order=("mlp.down_proj",))
    r = qfuse_here("info", folder, "--dtype", "bfloat16")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    out = r.stdout.splitlines()
    assert f"weights of {folder} as stored, held in bfloat16:" in out
    assert ("layers 0-1 down_proj: gptq 4-bit g64 act-order; in bfloat16: bias −z·s ≤ 1/16 "
            "step, float16 scales ≤ 2^-8 relative") in out
