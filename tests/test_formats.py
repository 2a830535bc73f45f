"""AWQ, GPTQ and compressed-tensors checkpoints load as MLX affine groups (`qfuse.formats`).

Small checkpoints of a tiny random Gemma 3 are written by packers following each format's
documented layout (AutoAWQ's GEMM interleave, AutoGPTQ's row packing and its z − 1 zeros,
compressed-tensors' own `pack_to_int32` where the package imports), with hand-worked words
checking the packers themselves. The converted weights must read back exactly the format's
dequantization (q − z)·s in float32 and within one unit in the last place in float16; the
loaded model's logits must be those of the same model holding the dequantized weights
densely. Bad files get one line (CheckpointError)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from qfuse.formats import awq, gptq
from qfuse.formats.groups import to_mlx
from qfuse.loading import CheckpointError, load_model
from qfuse.models import Decoder, ModelConfig
from qfuse.models.decoder import Linear
from qfuse.quant import dequantize, pack

CONFIG = {"model_type": "gemma3_text", "vocab_size": 256, "hidden_size": 128,
          "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
          "num_key_value_heads": 1, "head_dim": 64, "sliding_window": 8,
          "layer_types": ["sliding_attention", "full_attention"]}
IDS = torch.tensor([[2, 17, 99, 5, 230, 41, 8, 77, 3, 150]])


# --- packers, from each format's documented layout --------------------------------------

def _pack_awq(codes: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's GEMM packing of int codes [rows, cols] into int32 [rows, cols/8]: nibble i
    of word c holds column 8c + ORDER[i] (as in WQLinear_GEMM.from_linear)."""
    rows, cols = codes.shape
    out = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for i, col in enumerate(awq.ORDER):
        out |= codes[:, col::8].to(torch.int64) << (4 * i)
    return _int32(out)


def _pack_seq(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """GPTQ's packing: 32/bits consecutive codes along ``dim`` per int32, the first lowest."""
    per = 32 // bits
    c = codes.to(torch.int64).movedim(dim, -1)
    c = c.reshape(*c.shape[:-1], c.shape[-1] // per, per)
    out = (c << (torch.arange(per) * bits)).sum(-1)
    return _int32(out).movedim(-1, dim).contiguous()


def _int32(words: torch.Tensor) -> torch.Tensor:
    return (words & 0xFFFFFFFF).to(torch.int64).where(words < 2**31, words - 2**32).to(torch.int32)


# --- hand-worked words --------------------------------------------------------------------

def test_awq_word_holds_columns_in_its_interleaved_order():
    """0x76543210: nibble i holds i, which AWQ's order puts in column ORDER[i]."""
    word = torch.tensor([[0x76543210]], dtype=torch.int32)
    assert awq.unpack_columns(word).tolist() == [[0, 4, 1, 5, 2, 6, 3, 7]]
    assert torch.equal(_pack_awq(awq.unpack_columns(word)), word)


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

def _base() -> Decoder:
    torch.manual_seed(0)
    model = Decoder(ModelConfig.from_dict(CONFIG))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model


def _linears(model: Decoder) -> dict[str, Linear]:
    return {n: m for n, m in model.named_modules()
            if type(m) is Linear and n.startswith("model.layers.")}


def _random_groups(n_out, n_in, group, bits, gen):
    """Codes [out, in], float16 scales and integer zeros [out, in/group]."""
    codes = torch.randint(0, 2**bits, (n_out, n_in), generator=gen)
    S = n_in // group
    scale = (torch.rand(n_out, S, generator=gen) * 0.02 + 0.002).to(torch.float16)
    zero = torch.randint(0, 2**bits, (n_out, S), generator=gen)
    return codes, scale, zero


def _reference(codes, scale, zero, g_idx, dtype=torch.float32):
    """The formats' own dequantization: (q − z)·s of each column's group, in ``dtype``."""
    s = scale[:, g_idx].to(dtype)
    return (codes - zero[:, g_idx]).to(dtype) * s


# Modules of one layer that share an input (GPTQ orders them alike: one Hessian).
_SHARED_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up",
                 "up_proj": "gate_up"}
ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _write(tmp_path, kind: str, group: int = 64, bits: int = 4, act_order=(), shared=True,
           **extra):
    """A checkpoint of format ``kind`` and the dense model it stands for (float32).
    ``act_order``: module name endings whose g_idx is a random order (desc_act); with
    ``shared``, the modules of a layer sharing an input get one order, as GPTQ gives them."""
    model, gen = _base(), torch.Generator().manual_seed(1)
    state = {k: v for k, v in model.state_dict().items()}
    orders: dict = {}
    for name, lin in _linears(model).items():
        n_out, n_in = lin.n_out, lin.n_in
        G = n_in if group == -1 else group
        codes, scale, zero = _random_groups(n_out, n_in, G, bits, gen)
        g_idx = torch.arange(n_in) // G
        if any(name.endswith(a) for a in act_order):
            prefix, _, last = name.rpartition(".")
            key = (prefix, _SHARED_INPUT.get(last, last)) if shared else name
            if key not in orders:
                orders[key] = torch.randperm(n_in, generator=gen)
            g_idx = g_idx[orders[key]]
        dense = _reference(codes, scale, zero, g_idx)
        with torch.no_grad():
            lin.weight.copy_(dense)
        del state[f"{name}.weight"]
        if kind == "awq":
            state |= {f"{name}.qweight": _pack_awq(codes.T), f"{name}.qzeros": _pack_awq(zero.T),
                      f"{name}.scales": scale.T.contiguous()}
        elif kind == "gptq":
            stored = (zero - 1) & (2**bits - 1)  # the original format's z − 1
            state |= {f"{name}.qweight": _pack_seq(codes.T, bits, 0),
                      f"{name}.qzeros": _pack_seq(stored.T, bits, 1),
                      f"{name}.scales": scale.T.contiguous(),
                      f"{name}.g_idx": g_idx.to(torch.int32)}
        else:  # compressed-tensors, asymmetric: u = q + 2^(b−1), zp signed
            state |= {f"{name}.weight_packed": pack(codes, bits).view(torch.int32),
                      f"{name}.weight_shape": torch.tensor([n_out, n_in]),
                      f"{name}.weight_scale": scale,
                      # packed along the output dim, offset like the codes (pack_to_int32)
                      f"{name}.weight_zero_point": _pack_seq(zero, bits, 0)}
            if any(name.endswith(a) for a in act_order):  # llm-compressor's actorder=group
                state[f"{name}.weight_g_idx"] = g_idx.to(torch.int32)
    qcfg = {"awq": {"quant_method": "awq", "bits": bits, "group_size": group, "version": "gemm",
                    "zero_point": True},
            "gptq": {"quant_method": "gptq", "bits": bits, "group_size": group,
                     "desc_act": bool(act_order), "sym": False},
            "ct": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                   "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                       "num_bits": bits, "type": "int", "symmetric": False,
                       "strategy": "group", "group_size": group}}}}}[kind]
    qcfg.update(extra)
    folder = tmp_path / kind
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({**CONFIG, "quantization_config": qcfg}))
    return folder, model


def _assert_same_model(folder, dense):
    loaded = load_model(folder)
    for name, lin in _linears(loaded).items():
        assert lin.bits, name
        got = lin.quantized().dequantize(torch.float32)
        assert torch.equal(got, _linears(dense)[name].weight.detach()), name
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDS), dense(IDS), rtol=0, atol=1e-5)


@pytest.mark.parametrize("group", [64, 128, -1])
def test_awq_loads_exactly(tmp_path, group):
    _assert_same_model(*_write(tmp_path, "awq", group))


@pytest.mark.parametrize("bits,group", [(4, 64), (4, -1), (8, 32), (2, 128)])
def test_gptq_loads_exactly(tmp_path, bits, group):
    _assert_same_model(*_write(tmp_path, "gptq", group, bits))


def test_gptq_act_order_on_down_proj_is_served_by_permuting_gate_and_up(tmp_path):
    folder, dense = _write(tmp_path, "gptq", 64, act_order=("mlp.down_proj",))
    loaded = load_model(folder)
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDS), dense(IDS), rtol=0, atol=1e-5)


def test_compressed_tensors_act_order_on_down_proj_is_served_too(tmp_path):
    folder, dense = _write(tmp_path, "ct", 64, act_order=("mlp.down_proj",))
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
    folder, dense = _write(tmp_path, "gptq", 64, act_order=ALL_PROJECTIONS, shared=shared)
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

    folder, dense = _write(tmp_path, "gptq", 64, act_order=("o_proj",))
    assert gathered_input(dense) is None
    assert gathered_input(load_model(folder)) == (
        "model.layers.0.self_attn.o_proj gathers its input (act-order weight)")


def test_gptq_act_order_held_in_kernel_order_keeps_the_logits(tmp_path):
    """Q/K/V stacked in the kernel's order (bf16 weights) over one shared gather give the
    logits of the MLX-layout model, bit for bit (the reference reads either form alike)."""
    folder, _ = _write(tmp_path, "gptq", 64, act_order=ALL_PROJECTIONS)
    mlx, held = (load_model(folder, dtype=torch.bfloat16) for _ in range(2))
    assert held.hold_kernel_forms(always=True) > 0
    assert held.model.layers[0].self_attn.k_proj.held.parent is not None  # stacked
    for got, want in zip(_prefill_and_step(held), _prefill_and_step(mlx)):
        assert torch.equal(got, want)


def test_oracle_of_an_act_order_model_puts_the_columns_back(tmp_path):
    from qfuse.oracle import oracle_model

    folder, dense = _write(tmp_path, "gptq", 64, act_order=ALL_PROJECTIONS)
    with torch.no_grad():
        torch.testing.assert_close(oracle_model(load_model(folder))(IDS), dense(IDS),
                                   rtol=0, atol=1e-5)


def test_quantize_refuses_act_order_it_cannot_write_naming_the_tensor(tmp_path):
    """MLX holds no input permutation: `qfuse quantize` names the g_idx in one line."""
    from qfuse.convert import quantize_checkpoint
    from qfuse.errors import UserError

    folder, _ = _write(tmp_path, "gptq", 64, act_order=("self_attn.q_proj",))
    with pytest.raises(UserError, match=r"layers\.0\.self_attn\.q_proj\.g_idx: act-order "
                                        r"groups on the input of") as info:
        quantize_checkpoint(folder, tmp_path / "mlx")
    assert "\n" not in str(info.value) and not (tmp_path / "mlx").exists()


@pytest.mark.parametrize("bits,group", [(4, 64), (8, 128), (4, -1)])
def test_compressed_tensors_loads_exactly(tmp_path, bits, group):
    _assert_same_model(*_write(tmp_path, "ct", group, bits))


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
    codes, scale, zero = _random_groups(64, 256, 64, bits, gen)
    scale = scale.to(dtype)
    packed, scales, biases = to_mlx(codes, scale, zero, 64, bits, "m")
    exact = -zero.to(torch.float64) * scale.to(torch.float64)
    assert torch.equal(biases.to(torch.float64), exact)  # float32: exact
    biases = biases.to(dtype)
    assert torch.equal(biases, exact.to(dtype))  # one rounding to nearest
    got = dequantize(packed, scales.to(dtype), biases, 64, bits, dtype)
    g_idx = torch.arange(256) // 64
    ref = _reference(codes, scale, zero, g_idx, dtype)  # the formats' own, in the dtype
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
    codes, scale, zero = _random_groups(64, 256, 128, 4, gen)
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
    folder, _ = _write(tmp_path, kind)
    _edit(folder, **edit)
    with pytest.raises(CheckpointError, match=message) as info:
        load_model(folder)
    assert "\n" not in str(info.value)


# --- the command line and the API over a converted folder ---------------------------------

def _awq_of_bundled(dst):
    """The bundled model with its first layer's projections round-to-nearest quantized into
    AWQ's layout (4-bit, g128, asymmetric; the other layers dense, as AWQ's
    modules_to_not_convert leaves them: a quicker test), and its tokenizer."""
    import shutil

    from safetensors import safe_open

    from qfuse.loading import DEFAULT_MODEL, safetensors_files

    state = {}
    for file in safetensors_files(DEFAULT_MODEL):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                t = f.get_tensor(name)
                if not (name.startswith("model.layers.0.") and name.endswith("_proj.weight")):
                    state[name] = t
                    continue
                w = t.to(torch.float32)
                g = w.reshape(w.shape[0], -1, 128)
                lo, hi = g.amin(-1), g.amax(-1)
                s = ((hi - lo) / 15).clamp(min=1e-6).to(torch.float16)
                z = torch.round(-lo / s.float()).clamp(0, 15).to(torch.int64)
                q = (torch.round(g / s.float().unsqueeze(-1)) + z.unsqueeze(-1)).clamp(0, 15)
                q = q.reshape(w.shape).to(torch.int64)
                m = name[: -len(".weight")]
                state |= {f"{m}.qweight": _pack_awq(q.T), f"{m}.qzeros": _pack_awq(z.T),
                          f"{m}.scales": s.T.contiguous()}
    dst.mkdir()
    save_file(state, str(dst / "model.safetensors"))
    raw = json.loads((DEFAULT_MODEL / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128,
                                  "version": "gemm", "zero_point": True}
    (dst / "config.json").write_text(json.dumps(raw))
    shutil.copyfile(DEFAULT_MODEL / "tokenizer.json", dst / "tokenizer.json")
    return dst


def test_cli_generates_from_an_awq_folder_and_the_api_loads_it(tmp_path):
    import subprocess
    import sys

    import qfuse

    folder = _awq_of_bundled(tmp_path / "awq")
    r = subprocess.run([sys.executable, "-m", "qfuse", "generate", "--model", str(folder),
                        "--max-tokens", "6", "Once upon a time"], capture_output=True,
                       text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and r.stdout.strip()
    model, tokenizer = qfuse.load(folder, device="cpu", progress=False)
    assert model.model.layers[0].mlp.down_proj.bits == 4 and tokenizer.get_vocab_size() > 0


def test_cli_refuses_an_unknown_quant_method_in_one_line(tmp_path):
    import subprocess
    import sys

    folder, _ = _write(tmp_path, "awq")
    _edit(folder, config={"quant_method": "bitsandbytes"})
    (folder / "tokenizer.json").write_text("{}")
    r = subprocess.run([sys.executable, "-m", "qfuse", "generate", "--model", str(folder),
                        "hi"], capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        (f"qfuse: error: {folder / 'config.json'}: quant_method 'bitsandbytes' is not "
         "supported (qfuse reads awq, gptq, compressed-tensors, MLX and dense checkpoints)")]


@pytest.mark.parametrize("kind,act_order", [("awq", ()), ("gptq", ("mlp.down_proj",))])
def test_quantize_rewrites_a_converted_folder_in_the_mlx_layout(tmp_path, kind, act_order):
    """`qfuse quantize` keeps the source's codes and groups: the MLX folder it writes loads
    as the same model, with a plain `quantization` block."""
    from qfuse.convert import quantize_checkpoint

    folder, dense = _write(tmp_path, kind, 64, act_order=act_order)
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

    folder, _ = _write(tmp_path, kind, 64, act_order=act_order)
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

    folder, _ = _write(tmp_path, "awq", 64)
    source = weight_sources(folder)["model.layers.0.self_attn.q_proj"]
    assert source.line(dtype) == f"awq 4-bit g64; in {str(dtype)[6:]}: {stated}"
    assert source.rounding(torch.float32) is None
    step = 1 / 128 if dtype == torch.float16 else 1 / 16
    exact, held = _linears(load_model(folder)), _linears(load_model(folder, dtype=dtype))
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


def test_cli_info_prints_the_weights_sources(tmp_path):
    import subprocess
    import sys

    folder, _ = _write(tmp_path, "gptq", 64, act_order=("mlp.down_proj",))
    r = subprocess.run([sys.executable, "-m", "qfuse", "info", str(folder), "--dtype",
                        "bfloat16"], capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    out = r.stdout.splitlines()
    assert f"weights of {folder} as stored, held in bfloat16:" in out
    assert ("layers 0-1 down_proj: gptq 4-bit g64 act-order; in bfloat16: bias −z·s ≤ 1/16 "
            "step, float16 scales ≤ 2^-8 relative") in out
