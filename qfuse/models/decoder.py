"""One decoder for every supported family (Llama, Mistral, Phi-3/4, Qwen 2/3, Gemma 2/3 text).

Parameter names are those of Hugging Face checkpoints (`model.layers.3.mlp.down_proj.weight`,
with `.scales`/`.biases` beside quantized weights as MLX writes them), so weights
load without remapping (Phi-3's fused qkv_proj/gate_up_proj are split by the loader).
LongRoPE (Phi-3) takes its long frequencies for each pass over a row whose sequence is
then longer than original_max_position_embeddings, as HF does: keys cached before a
sequence crossed that length keep the short ones, as in HF's generation. Family differences come from ModelConfig fields. Every
op goes through `qfuse.ops`, so the tier decides between kernels and the
spelled-out reference.

Two entry points: `forward(input_ids, lengths)` runs a whole (right-padded)
prompt batch and, given a cache, fills it (prefill), or with `past` the next chunk of
prompts the cache holds the start of (chunked prefill); `decode(tokens, cache)`
runs one new token per sequence against the cache. The cache is a slotted `KVCache` or a
`PagedKVCache`, alike to both entry points: a decode step asks its layer cache's
`step_args` where the token goes, what it attends, with which window and block table (a
paged cache's sliding layers attend their window over logical positions, no ring).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .. import choose, ops, reference
from ..kernels.products import fragments
from ..kernels.products.fragments import FragmentWeight
from ..plan import Plan, Plans, Site, SiteOrder
from ..quant import QuantizedTensor
from ..runtime.host_copies import to_device
from . import fused_decode
from .config import ModelConfig, RopeConfig

# What `Decoder.forward` returns logits for: every position, each row's last, none.
LOGITS = ("all", "last", "none")

class Linear(nn.Module):
    """y = x·Wᵀ (+ b) over a dense or MLX-quantized weight [out, in]. ``input_perm``
    (int64 [in] or None): the weight's columns are those of x[..., input_perm] (GPTQ
    act-order, sorted by group at load: `formats`); the product gathers its input."""

    def __init__(self, n_in: int, n_out: int, bias: bool, group_size: int = 0, bits: int = 0):
        super().__init__()
        self.n_in, self.n_out, self.group_size, self.bits = n_in, n_out, group_size, bits
        if bits:
            self.register_buffer("weight", torch.zeros(n_out, n_in * bits // 32, dtype=torch.uint32))
            self.register_buffer("scales", torch.zeros(n_out, n_in // group_size))
            self.register_buffer("biases", torch.zeros(n_out, n_in // group_size))
        else:
            self.weight = nn.Parameter(torch.zeros(n_out, n_in))
        self.bias = nn.Parameter(torch.zeros(n_out)) if bias else None
        # Not saved: the loader sets it from the checkpoint's g_idx (MLX has no such tensor).
        self.register_buffer("input_perm", None, persistent=False)
        self._quantized: tuple[tuple, QuantizedTensor] | None = None
        # The weight in the decode kernel's order (`hold`), instead of the MLX buffers.
        self.held: FragmentWeight | None = None

    def quantized(self) -> QuantizedTensor | None:
        """The weight as one QuantizedTensor, kept while its buffers are the same tensors,
        unmodified (their version counters), so that layouts a kernel derives from it
        (`QuantizedTensor.derived`) are built once, not at every step. A weight `hold`
        keeps in fragment order comes back in the MLX layout anew at each call (bit for
        bit; a copy: writing to it changes nothing)."""
        if not self.bits:
            return None
        if self.held is not None:
            return fragments.to_mlx(self.held)
        parts = (self.weight, self.scales, self.biases)
        key = tuple((id(t), t._version) for t in parts)
        if self._quantized is None or self._quantized[0] != key:
            self._quantized = (key, QuantizedTensor(*parts, self.group_size, self.bits))
        return self._quantized[1]

    def effective_weight(self):
        """What the ops multiply by: the held fragment form, the MLX form or the dense weight."""
        return self.held or self.quantized() or self.weight

    def hold(self, f: FragmentWeight) -> None:
        """Keep the weight as ``f`` (its fragment order, possibly a view of a stacked weight)
        and release the MLX buffers, so the weight is resident once. `state_dict` (saving)
        still gives the MLX words, converted back."""
        self.held = f
        self._quantized = None  # it, and any form derived from it, referenced the buffers
        for name in ("weight", "scales", "biases"):
            setattr(self, name, None)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.held is not None:
            mlx = fragments.to_mlx(self.held)
            destination[prefix + "weight"] = mlx.packed
            destination[prefix + "scales"] = mlx.scales
            destination[prefix + "biases"] = mlx.biases

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(choose.gather(x, self.input_perm), self.effective_weight(), self.bias)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight dense [out, in] in ``dtype``, its columns in x's own order (an
        act-order weight's put back)."""
        w = reference.dense_weight(self.effective_weight(), dtype)
        if self.input_perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.input_perm] = w
        return out

    def site(self, name: str, order: list) -> Site:
        """This product as a plan's site: run(x) → x·Wᵀ (+ b), chosen at its first call."""
        w, b, p = self.effective_weight(), self.bias, self.input_perm
        return Site(name, "product", lambda x: choose.gathered(
            choose.choose_product(choose.gather(x, p), w, b), p), order, self.planned)

    def planned(self, choice: choose.Choice) -> choose.Choice:
        """The choice a plan keeps for this module's op (a tensor-parallel module wraps
        its reduction around it)."""
        return choice


class Embedding(Linear):
    """Token embeddings [vocab, hidden], dense or quantized; doubles as a tied lm_head."""

    def __init__(self, vocab: int, hidden: int, group_size: int = 0, bits: int = 0):
        super().__init__(hidden, vocab, False, group_size, bits)

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.held is not None:
            return fragments.dequantize_rows(self.held, ids, dtype)
        if self.bits:
            q = self.quantized()
            # CUDA has no uint32 gather ("index_cuda" not implemented): gather the bits as int32.
            packed = q.packed.view(torch.int32)[ids].view(torch.uint32)
            rows = QuantizedTensor(packed, q.scales[ids], q.biases[ids], q.group_size, q.bits)
            return rows.dequantize(dtype)
        return F.embedding(ids, self.weight).to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, unit_offset: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps, self.unit_offset = eps, unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, self.unit_offset)

    def site(self, name: str, order: list) -> Site:
        """This norm as a plan's site: run(x) → RMSNorm(x)."""
        return Site(name, "rms_norm", lambda x: choose.choose_rms_norm(
            x, self.weight, self.eps, self.unit_offset), order)


def rope_inv_freq(rope: RopeConfig, head_dim: int, long: bool = False) -> torch.Tensor:
    """float32 [head_dim/2], with linear, Llama-3 or LongRoPE frequency scaling as HF
    applies it (LongRoPE: its long factors with ``long``, else its short ones), then
    divided by the config's `freq_factors` where it has them (GGUF's rope_freqs, as
    llama.cpp divides each frequency)."""
    inv = _scaled_inv_freq(rope, head_dim, long)
    if rope.freq_factors:
        inv = inv / torch.tensor(rope.freq_factors, dtype=torch.float32)
    return inv


def _scaled_inv_freq(rope: RopeConfig, head_dim: int, long: bool) -> torch.Tensor:
    if rope.rope_type == "longrope":
        factors = torch.tensor(rope.long_factor if long else rope.short_factor,
                               dtype=torch.float32)
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (factors * rope.theta**exponents)
    inv = reference.rope_inv_freq(head_dim, rope.theta)
    if rope.rope_type == "linear":
        return inv / rope.factor
    if rope.rope_type == "llama3":
        old = rope.original_max_position_embeddings
        low_wavelen, high_wavelen = old / rope.low_freq_factor, old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, quant):
        super().__init__()
        H, D, Hq, Hkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        prefix = f"model.layers.{layer}.self_attn"
        b = cfg.attention_bias
        self.q_proj = Linear(H, Hq * D, b, *quant(f"{prefix}.q_proj"))
        self.k_proj = Linear(H, Hkv * D, b, *quant(f"{prefix}.k_proj"))
        self.v_proj = Linear(H, Hkv * D, b, *quant(f"{prefix}.v_proj"))
        self.o_proj = Linear(Hq * D, H, cfg.o_proj_bias, *quant(f"{prefix}.o_proj"))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps, cfg.norm_unit_offset)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps, cfg.norm_unit_offset)
        self.cfg, self.layer = cfg, layer
        self.sliding = cfg.layer_types[layer] == "sliding_attention"
        self.window = cfg.sliding_window if self.sliding else None
        # float32 always (HF computes RoPE frequencies in float32 whatever the model
        # dtype), so kept out of the module's buffers that `.to(dtype)` converts.
        self.rope = cfg.rope[cfg.layer_types[layer]]
        self._inv_freq = {("cpu", False): rope_inv_freq(self.rope, D)}
        if self.rope.rope_type == "longrope":
            self._inv_freq["cpu", True] = rope_inv_freq(self.rope, D, long=True)

    def inv_freq(self, device: torch.device, long: bool = False) -> torch.Tensor:
        key = (str(device), long)
        if key not in self._inv_freq:
            self._inv_freq[key] = self._inv_freq["cpu", long].to(device)
        return self._inv_freq[key]

    def rope_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype,
                     seq_lens: torch.Tensor | None = None):
        """cos/sin [B, T, D] for positions [B, T]. LongRoPE picks its long frequencies for
        a row whose sequence (``seq_lens`` [B], default its last position + 1) is longer
        than original_max_position_embeddings, as HF does for a pass (HF looks at the
        batch's longest; here each row at its own, so rows do not change each other), and
        scales cos and sin by its attention factor."""
        inv = self.inv_freq(positions.device)
        if self.rope.rope_type == "longrope":
            if seq_lens is None:
                seq_lens = positions.amax(-1) + 1
            # torch.where, not a host branch: no sync, and a CUDA graph can hold it.
            long = (seq_lens > self.rope.original_max_position_embeddings)[:, None, None]
            inv = torch.where(long, self.inv_freq(positions.device, long=True), inv)
        return reference.rope_cos_sin(positions, inv, dtype, self.rope.attention_factor)

    def sites(self, prefix: str, kind: str, order: list) -> dict[str, Site]:
        """The attention's op sites for a ``kind`` pass ("decode", "prefill")."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        ws, bs = [p.effective_weight() for p in projs], [p.bias for p in projs]
        perms = [p.input_perm for p in projs]
        q_norm, k_norm = self.qk_norms()
        eps, offset = self.cfg.rms_norm_eps, self.cfg.norm_unit_offset
        scale, softcap = self.cfg.attn_scale, self.cfg.attn_logit_softcapping
        sites = {
            "qkv": Site(f"{prefix}.qkv", "stacked product",
                        lambda x: choose.choose_stacked_product(x, ws, bs, perms), order),
            "rotate": Site(f"{prefix}.rotate", "qk norm + rope",
                           lambda q, k, cos, sin: choose.choose_norm_and_rotate(
                               q, k, q_norm, k_norm, eps, offset, cos, sin), order),
            "o_proj": self.o_proj.site(f"{prefix}.o_proj", order),
        }
        if kind in ("decode", "mixed"):  # a mixed step's decode rows take the decode sites
            for part in ("k", "v"):
                sites[f"append_{part}"] = Site(
                    f"{prefix}.append_{part}", "kv append",
                    lambda x, positions, cache, table: choose.choose_kv_append(x, cache),
                    order)
            name = "decode_attention" if kind == "mixed" else "attention"
            sites[name] = Site(
                f"{prefix}.{name}", "decode attention",
                lambda q, k, v, lengths, window, table: choose.choose_decode_attention(
                    q, k, v, scale, softcap, table, window), order)
        if kind != "decode":
            # Chosen by device and soft-cap alone: one choice serves chunks of any length.
            sites["attention"] = Site(
                f"{prefix}.attention", "prompt attention",
                lambda q, k, v, lengths, masks: choose.choose_prompt_attention(
                    q, scale, self.window, softcap), order)
        return sites

    def rotary_tables(self, x: torch.Tensor, positions: torch.Tensor, rope_tables: dict,
                      seq_lens: torch.Tensor | None = None):
        """cos/sin [B, T, D] per layer type, shared by the layers of one forward pass (the
        same positions and frequencies give the same tables: one computation per pass
        instead of one per layer, ~7 small kernels each). ``seq_lens``: `rope_cos_sin`'s."""
        kind = self.cfg.layer_types[self.layer]
        if kind not in rope_tables:
            rope_tables[kind] = self.rope_cos_sin(positions, x.dtype, seq_lens)
        return rope_tables[kind]

    def _qkv(self, s: dict, x: torch.Tensor, positions: torch.Tensor, rope_tables: dict,
             seq_lens: torch.Tensor | None = None):
        """x [B, T, H], positions [B, T] → q [B, Hq, T, D], k, v [B, Hkv, T, D], rotated."""
        B, T, _ = x.shape
        D = self.cfg.head_dim
        q, k, v = (y.view(B, T, -1, D).transpose(1, 2) for y in s["qkv"](x))
        cos, sin = self.rotary_tables(x, positions, rope_tables, seq_lens)
        q, k = s["rotate"](q, k, cos, sin)
        return q, k, v

    def qk_norms(self):
        """The q_norm and k_norm weights, or (None, None) for a family without them."""
        if self.cfg.qk_norm:
            return self.q_norm.weight, self.k_norm.weight
        return None, None

    def forward(self, s: dict, x, positions, lengths, cache=None, rope_tables=None, past=0):
        """Prompts, through the prefill plan's sites ``s``: x [B, T, H] right-padded,
        lengths [B]. Fills `cache` if given. With ``past``, x continues prompts whose
        first ``past`` tokens `cache` holds (a chunked prefill): its queries also attend
        to those tokens' keys, read from the cache."""
        B, T, _ = x.shape
        tables = {} if rope_tables is None else rope_tables  # shared by the pass's layers
        # Right-padded rows: a row's sequence ends at its length, not at the batch's.
        q, k, v = self._qkv(s, x, positions, tables, past + lengths)
        out = self._prompt_attention(s, q, k, v, lengths, cache, tables, past)
        return s["o_proj"](out.transpose(1, 2).reshape(B, T, -1))

    def _prompt_attention(self, s: dict, q, k, v, lengths, cache, tables: dict, past: int):
        """q [B, Hq, T, D], k, v [B, Hkv, T, D] of prompts (with ``past``: chunks after
        that many tokens ``cache`` holds, whose keys they also attend) → [B, Hq, T, D];
        k and v go to ``cache`` if given."""
        keys, values = k, v
        if past:
            # Only the keys the window lets the chunk's first query see (a ring holds no more).
            first = 0 if self.window is None else max(0, past - self.window + 1)
            before_k, before_v = cache.layers[self.layer].read(first, past, k.dtype)
            keys, values = torch.cat([before_k, k], 2), torch.cat([before_v, v], 2)
        out = s["attention"](q, keys, values, lengths, tables)
        if cache is not None:  # after the read above: a ring's slots are reused
            cache.layers[self.layer].write_prompt(k, v, cache.host_lengths, past)
        return out

    def mixed(self, s: dict, x, positions, seq_lens, cache, indices, decodes: int,
              chunks: list, tables: dict):
        """One mixed step through the mixed plan's sites ``s`` (`Decoder.mixed`): x [N, 1,
        H], the decode rows' tokens first, then each chunk's; the products run over all N
        rows, the attention per segment: the decode rows as `decode` runs them over
        ``cache`` (their view) with ``indices``, each chunk (view, past, T, lengths [1]) as
        a one-row prompt after its ``past`` cached tokens, as `forward` runs it."""
        N = x.shape[0]
        q, k, v = self._qkv(s, x, positions, tables, seq_lens)  # [N, H*, 1, D]
        outs = []
        if decodes:
            layer = cache.layers[self.layer]
            slots, attended, window, table = layer.step_args(indices)
            s["append_k"](k[:decodes, :, 0], slots, layer.k, table)
            s["append_v"](v[:decodes, :, 0], slots, layer.v, table)
            outs.append(s["decode_attention"](q[:decodes, :, 0], layer.k, layer.v, attended,
                                              window, table))  # [decodes, Hq, D]
        at = decodes
        for view, past, T, lengths in chunks:
            # this chunk's tokens as one prompt: [1, H*, T, D]
            qc, kc, vc = (t[at:at + T, :, 0].transpose(0, 1)[None] for t in (q, k, v))
            out = self._prompt_attention(s, qc, kc, vc, lengths, view, tables, past)
            outs.append(out[0].transpose(0, 1))  # [T, Hq, D]
            at += T
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return s["o_proj"](out.reshape(N, 1, -1))

    def decode(self, s: dict, x, positions, cache, indices, rope_tables=None):
        """One token per sequence, through the decode plan's sites ``s``: x [B, 1, H],
        positions [B, 1] = each sequence's length; indices: the cache's step_indices() of
        this step (a `KVCache` or a `PagedKVCache`: its layer's `step_args` say where the
        token goes and what the query attends, the one place the two kinds differ)."""
        B = x.shape[0]
        q, k, v = self._qkv(s, x, positions, {} if rope_tables is None else rope_tables)
        layer = cache.layers[self.layer]
        slots, attended, window, table = layer.step_args(indices)
        s["append_k"](k[:, :, 0], slots, layer.k, table)
        s["append_v"](v[:, :, 0], slots, layer.v, table)
        out = s["attention"](q[:, :, 0], layer.k, layer.v, attended, window, table)
        return s["o_proj"](out.reshape(B, 1, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, quant):
        super().__init__()
        H, I = cfg.hidden_size, cfg.intermediate_size
        prefix = f"model.layers.{layer}.mlp"
        self.gate_proj = Linear(H, I, False, *quant(f"{prefix}.gate_proj"))
        self.up_proj = Linear(H, I, False, *quant(f"{prefix}.up_proj"))
        self.down_proj = Linear(I, H, False, *quant(f"{prefix}.down_proj"))
        self.act = cfg.hidden_act

    def forward(self, x):
        if self.gate_proj.input_perm is not None or self.up_proj.input_perm is not None:
            # act-order: the products apart, each gathering its input
            return self.down_proj(ops.gated_act(self.gate_proj(x), self.up_proj(x), self.act))
        return ops.mlp(x, self.gate_proj.effective_weight(), self.up_proj.effective_weight(),
                       self.down_proj.effective_weight(), self.act)

    def site(self, name: str, order: list) -> Site:
        """This MLP as a plan's site: run(x) → down(act(x·gateᵀ)·(x·upᵀ))."""
        g, u, d = (p.effective_weight() for p in (self.gate_proj, self.up_proj, self.down_proj))
        perms = (self.gate_proj.input_perm, self.up_proj.input_perm)
        return Site(name, "mlp", lambda x: choose.choose_mlp(x, g, u, d, self.act, perms=perms),
                    order, self.planned)

    def planned(self, choice: choose.Choice) -> choose.Choice:
        """The choice a plan keeps for this MLP (a tensor-parallel MLP wraps its reduction
        around it)."""
        return choice


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, quant):
        super().__init__()
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset)
        self.self_attn = Attention(cfg, layer, quant)
        self.mlp = MLP(cfg, layer, quant)
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        self.sandwich = cfg.sandwich_norms

    def sites(self, prefix: str, kind: str, order: list) -> dict[str, Site]:
        """The layer's op sites for a ``kind`` pass, in the order they run."""
        eps, offset = self.input_layernorm.eps, self.input_layernorm.unit_offset

        def joint(name, post, after):
            pw = None if post is None else post.weight
            nw = None if after is None else after.weight
            return Site(f"{prefix}.{name}", "residual joint",
                        lambda a, r: choose.choose_residual_rms_norm(a, r, pw, nw, eps, offset),
                        order)

        sites = {"input_norm": self.input_layernorm.site(f"{prefix}.input_norm", order),
                 **self.self_attn.sites(f"{prefix}.self_attn", kind, order),
                 "mlp": self.mlp.site(f"{prefix}.mlp", order)}
        if self.sandwich:  # Gemma 2/3: h = x + norm(attn(norm(x))); out = h + norm(mlp(norm(h)))
            sites["attn_joint"] = joint("attn_joint", self.post_attention_layernorm,
                                        self.pre_feedforward_layernorm)
            sites["mlp_joint"] = joint("mlp_joint", self.post_feedforward_layernorm, None)
        else:
            sites["attn_joint"] = joint("attn_joint", None, self.post_attention_layernorm)
        return sites

    def forward(self, s: dict, x, positions, lengths, cache=None, rope_tables=None, past=0):
        """A prompt pass through the prefill plan's sites ``s`` (`Attention.forward`)."""
        a = self.self_attn(s, s["input_norm"](x), positions, lengths, cache, rope_tables, past)
        return self._rest(s, a, x)

    def decode(self, s: dict, x, positions, cache, indices, rope_tables=None):
        """One decode step through the decode plan's sites ``s`` (`Attention.decode`)."""
        a = self.self_attn.decode(s, s["input_norm"](x), positions, cache, indices, rope_tables)
        return self._rest(s, a, x)

    def mixed(self, s: dict, x, positions, seq_lens, cache, indices, decodes, chunks,
              tables):
        """One mixed step through the mixed plan's sites ``s`` (`Attention.mixed`)."""
        a = self.self_attn.mixed(s, s["input_norm"](x), positions, seq_lens, cache, indices,
                                 decodes, chunks, tables)
        return self._rest(s, a, x)

    def _rest(self, s: dict, a, x):
        """After attention: the residual joints and the MLP."""
        h, n = s["attn_joint"](a, x)
        if self.sandwich:
            return s["mlp_joint"](s["mlp"](n), h)[0]
        return h + s["mlp"](n)


class _Body(nn.Module):
    def __init__(self, cfg: ModelConfig, quant):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, *quant("model.embed_tokens"))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, quant) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset)


class Decoder(nn.Module):
    """A causal LM. ``quant(path) -> (group_size, bits)`` says how each Linear is stored
    ((0, 0) for dense)."""

    def __init__(self, cfg: ModelConfig, quant=lambda path: (0, 0)):
        super().__init__()
        self.config = cfg
        self.model = _Body(cfg, quant)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, *quant("lm_head"))
        # Not a module attribute: plans hold callables, not parameters.
        self.__dict__["plans"] = Plans(self._make_plan)

    def _make_plan(self, kind: str, key: tuple) -> Plan:
        """The sites of a ``kind`` pass; each makes its choice at its first call."""
        order = SiteOrder()
        layers = [layer.sites(f"layers.{i}", kind, order)
                  for i, layer in enumerate(self.model.layers)]
        head = self.model.embed_tokens if self.config.tie_word_embeddings else self.lm_head
        model = {"norm": self.model.norm.site("norm", order), "head": head.site("head", order)}
        if kind == "decode":  # the layers as fused steps, or layer by layer: chosen once
            for i, sites in enumerate(layers):
                sites.update(fused_decode.sites(self, i, f"layers.{i}", order))
            model["layers"] = Site("layers", "decode layers", fused_decode.choose_layers, order)
        return Plan(kind, key, layers, model, order)

    def decode_plan(self, rows: int = 1, kv_bits: int = 0, kv_group_size: int = 64,
                    context: int = 8) -> Plan:
        """The plan of a decode step over ``rows`` sequences with a fresh cache of that
        format, made now by one prefill token and one decode step (what `qfuse info`
        prints; the generation loop's own cache has the format of its call)."""
        from ..runtime.cache import KVCache

        device = self.model.norm.weight.device
        cache = KVCache(self.config, rows, context, self.dtype, device, kv_bits, kv_group_size)
        ids = torch.zeros(rows, 1, dtype=torch.int64, device=device)
        with torch.no_grad():
            self(ids, cache=cache, logits="none")
            self.decode(ids[:, 0], cache)
            return self.plans.get("decode", rows, cache)  # the key holds grad's state

    def replan(self) -> None:
        """Forget the plans: their sites bound the weights as they were held."""
        self.plans.clear()

    def _apply(self, fn, *args, **kwargs):  # .to(), .cuda(), .half(): new tensors
        self.replan()
        return super()._apply(fn, *args, **kwargs)

    def load_state_dict(self, *args, **kwargs):  # assign=True puts new tensors in place
        self.replan()
        return super().load_state_dict(*args, **kwargs)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    def hold_kernel_forms(self, always: bool = False) -> int:
        """Keep every quantized weight the decode kernels take in their fragment order
        alone (`Linear.hold`): Q/K/V and gate/up each as one stacked weight whose parts are
        views, so a product over the stack is one launch and no copy. Chosen once, here
        (`ops.holds_fragments`: tier, levers, device, weight), unless ``always`` (tests: the
        reference then dequantizes the held form, bit for bit as the MLX words). Returns
        the number of Linears now held."""
        held = 0
        with torch.no_grad():
            for linears in self.product_groups():
                held += _hold_stacked(linears, always)
        self.replan()
        return held

    def product_groups(self) -> list[list[Linear]]:
        """Every weight a forward multiplies by, grouped as one product multiplies them:
        Q/K/V and gate/up stacked, the others alone, the head last (the embeddings when
        tied). Linears whose inputs are gathered in different orders (act-order) are not
        stacked: each is its own product."""
        groups = []
        for layer in self.model.layers:
            a, m = layer.self_attn, layer.mlp
            groups += [*_one_order([a.q_proj, a.k_proj, a.v_proj]), [a.o_proj],
                       *_one_order([m.gate_proj, m.up_proj]), [m.down_proj]]
        groups.append([self.model.embed_tokens])
        if not self.config.tie_word_embeddings:
            groups.append([self.lm_head])
        return groups

    def product_kernels(self, rows: int) -> tuple[str, ...] | None:
        """The kernel each weight product over ``rows`` token rows takes
        (`ops.fragment_route`, one entry per distinct weight shape, in `product_groups`
        order), when every one is row-invariant (`ops.ROW_INVARIANT_ROUTES`); None
        otherwise: a dense or MLX-held weight (cuBLAS or the other quantized kernels,
        which promise no row invariance), or the reference (a CPU). Then, where they
        depend on the rows, the layer path (fused steps or sites) and the decode
        attention's form (`choose.decode_attention_route`). Two row counts whose
        tuples are equal compute each row alike, so batch invariance across batch sizes
        rests on it (`serving.engine.step_buckets`)."""
        routes, asked = [], set()
        for linears in self.product_groups():
            held = linears[0].held
            if held is None:
                return None
            w = held.parent or held  # a stacked group runs as one product over its parent
            if (w.n, w.k, w.group_size) in asked:
                continue
            asked.add((w.n, w.k, w.group_size))
            x = torch.empty(rows, w.k, dtype=self.dtype, device=w.device)
            route = ops.fragment_route(x, w)
            if route not in ops.ROW_INVARIANT_ROUTES:
                return None
            routes.append(route)
        # Fused steps or layer by layer: each row-invariant, but not alike. The plan's
        # choice needs a cache; the part that depends on the rows is this.
        if choose.refusal("fused_steps", x.device) is None and \
                fused_decode.gpu_refusal(x.device) is None:
            routes.append("fused_steps" if fused_decode.rows_admitted(self, rows)
                          else "layer_sites")
        # Decode attention: split, or whole contexts from some row count on (each a
        # function of the sequence alone, but not alike).
        attention = choose.decode_attention_route(x.device, rows)
        if attention is not None:
            routes.append(attention)
        return tuple(routes)

    def _embed(self, ids):
        h = self.model.embed_tokens.lookup(ids, self.dtype)
        if self.config.embed_scale:
            h = h * self.embed_multiplier(h.dtype)
        return h

    def embed_multiplier(self, dtype: torch.dtype) -> float:
        """The embedding multiplier rounded to the model dtype, as HF rounds it, as a Python
        float (exact: a bf16/fp16 value), made once per dtype rather than as a tensor in
        every forward and decode step."""
        cached = self.__dict__.setdefault("_embed_multipliers", {})
        if dtype not in cached:
            cached[dtype] = float(torch.tensor(self.config.embed_multiplier, dtype=dtype))
        return cached[dtype]

    def _logits(self, plan: Plan, h, normed: bool = False):
        logits = plan.model["head"](h if normed else plan.model["norm"](h))
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def forward(self, input_ids, lengths=None, cache=None, hidden_states=None, past=0,
                logits="all", host_lengths=None):
        """input_ids [B, T] (right-padded to T); lengths [B] (default T). Returns logits
        [B, T, vocab] (``logits="all"``), each row's at its last real token [B, vocab]
        (``"last"``: what a prefill samples from, without the [B, T, vocab] tensor of a
        long prompt) or None (``"none"``: a chunk that samples nothing). With a cache, the
        prompt's keys and values are written to it. ``past``: the tokens of each prompt
        already in ``cache`` (a chunked prefill, one chunk per call): input_ids are the
        next ones, at positions past..past+T-1, and the cache's lengths become past +
        lengths. ``hidden_states``: a list that receives each layer's output (for the
        gates). ``host_lengths``: ``lengths`` as a host list, so that the pass reads none
        from the device (a sync, which a pass captured in a CUDA graph may not make)."""
        B, T = input_ids.shape
        if logits not in LOGITS:
            raise ValueError(f"logits must be one of {', '.join(LOGITS)}, got {logits!r}")
        if past < 0 or (past and cache is None):
            raise ValueError(f"past={past} needs a cache holding that many tokens")
        if cache is not None and past + T > cache.max_tokens:
            raise ValueError(f"a prompt of {past + T} tokens does not fit a cache of "
                             f"{cache.max_tokens}")
        if lengths is None:
            lengths = torch.full((B,), T, dtype=torch.int64, device=input_ids.device)
        positions = torch.arange(past, past + T, device=input_ids.device).expand(B, T)
        if cache is not None:  # one host read of the lengths for the whole prefill
            # The host lengths first: a paged cache takes its pages there, all or nothing
            # (OutOfPages), and the device lengths must not move when it refuses.
            if host_lengths is None:
                host_lengths = lengths.tolist()
            cache.host_lengths = [past + int(n) for n in host_lengths]
            cache.lengths.copy_(lengths + past)
        # One plan per prompt shape and logits kind: the head sees B or B·T rows.
        plan = self.plans.get("prefill" if not past else "chunk", (B, T, logits), cache)
        h = self._embed(input_ids)
        tables: dict = {}
        for layer, sites in zip(self.model.layers, plan.layers):
            h = layer(sites, h, positions, lengths, cache, tables, past)
            if hidden_states is not None:
                hidden_states.append(h)
        if logits == "none":
            return None
        if logits == "last":
            return self._logits(plan, h[torch.arange(B, device=h.device), lengths - 1])
        return self._logits(plan, h)

    def decode(self, tokens, cache, hidden_states=None):
        """tokens [B] → logits [B, vocab]; appends to the cache at each sequence's length."""
        cache.reserve_step()  # the capacity check, on the host: no device sync
        positions = cache.lengths.to(torch.int64)[:, None]
        indices = cache.step_indices()
        plan = self.plans.get("decode", tokens.shape[0], cache)
        h = self._embed(tokens[:, None])
        n = plan.model["layers"](self, plan, h, positions, cache, indices, hidden_states)
        cache.lengths += 1
        return self._logits(plan, n, normed=True)[:, 0]

    def mixed(self, tokens, cache, decodes: int, chunks: list[int], logits_at: list[int]):
        """One serving step over a flat token batch: ``decodes`` sequences' next token and
        a chunk of ``chunks[i]`` prompt tokens of each of the others, in one pass. tokens
        int64 [N] (N = decodes + sum(chunks)): the decode rows' tokens, then each chunk's;
        ``cache``: a paged cache's view of the step's rows in that order
        (`PagedKVCache.select`), each holding its tokens so far; logits_at: the flat
        indices of the tokens whose logits come back. Returns logits [len(logits_at),
        vocab], or None where logits_at is empty (no head over no rows).

        Every product, norm and the MLP run once over the N rows (the weights read once
        for all of them); attention runs per segment: the decode rows as `decode` runs
        them, each chunk as `forward(..., past=)` runs a one-row chunk, attending to the
        pages its row holds. Every row's pages are taken first, all or nothing
        (`OutOfPages` before anything changed)."""
        host = cache.host_lengths
        if len(host) != decodes + len(chunks) or min(chunks, default=1) < 1:
            raise ValueError(f"{len(host)} rows for {decodes} decode rows and chunks {chunks}")
        N = decodes + sum(chunks)
        if tokens.shape != (N,):
            raise ValueError(f"tokens of shape {tuple(tokens.shape)} for {N} step tokens")
        pasts = host[decodes:]
        positions = host[:decodes] + [p + i for p, T in zip(pasts, chunks) for i in range(T)]
        seq_lens = [n + 1 for n in host[:decodes]] + [p + T for p, T in zip(pasts, chunks)
                                                      for _ in range(T)]
        # The views before the growth: a decode row's device length is its token's position.
        dec = cache.part(0, decodes) if decodes else None
        parts = [cache.part(decodes + i, decodes + i + 1) for i in range(len(chunks))]
        cache.host_lengths = [n + 1 for n in host[:decodes]] + [
            p + T for p, T in zip(pasts, chunks)]
        C = len(chunks)
        dev = to_device(positions + seq_lens + list(chunks) + list(logits_at), tokens.device)
        lengths = dev[2 * N: 2 * N + C]
        specs = [(view, p, T, lengths[i:i + 1])
                 for i, (view, p, T) in enumerate(zip(parts, pasts, chunks))]
        indices = dec.step_indices() if decodes else None
        # One plan per (decode rows, step tokens, logit rows): what its sites' choices
        # depend on (the products' on N, the decode sites' on the decode rows, the head's
        # on its rows; the prompt attention's on the device alone), not on how the prompt
        # tokens are cut into chunks, so varied cuts share a plan.
        plan = self.plans.get("mixed", (decodes, N, len(logits_at)), cache)
        h = self._embed(tokens[:, None])
        tables: dict = {}
        for layer, sites in zip(self.model.layers, plan.layers):
            h = layer.mixed(sites, h, dev[:N, None], dev[N: 2 * N], dec, indices, decodes,
                            specs, tables)
        if not logits_at:
            return None
        return self._logits(plan, h[dev[2 * N + C:]])[:, 0]

    def decode_layers(self, plan: Plan, h, positions, cache, indices, hidden_states=None):
        """Every layer's decode step through its sites, then the final norm: h [B, 1, H]
        (the embedded tokens) → [B, 1, H]."""
        tables: dict = {}
        for layer, sites in zip(self.model.layers, plan.layers):
            h = layer.decode(sites, h, positions, cache, indices, tables)
            if hidden_states is not None:
                hidden_states.append(h)
        return plan.model["norm"](h)


def _one_order(linears: list[Linear]) -> list[list[Linear]]:
    """``linears`` as one group where they gather their input alike, else one group each."""
    if choose.same_order([lin.input_perm for lin in linears]):
        return [linears]
    return [[lin] for lin in linears]


def gathered_input(model: Decoder) -> str | None:
    """Why a path that takes the weights in their stored column order (the fused decode
    steps, the persistent schedule) cannot run ``model``: the first Linear that gathers
    its input (act-order, `Linear.input_perm`), named; None where none does."""
    return next((f"{name} gathers its input (act-order weight)"
                 for name, m in model.named_modules()
                 if isinstance(m, Linear) and m.input_perm is not None), None)


def _hold_stacked(linears: list[Linear], always: bool) -> int:
    """Hold the Linears' weights as one stacked fragment weight (each part a view of it);
    each alone where `fragments.concat` refuses to stack them; none where one is not the
    kernel's."""
    if any(lin.held is not None for lin in linears):
        return 0
    ws = [lin.quantized() for lin in linears]
    if any(w is None or not ops.holds_fragments(w, always) for w in ws):
        return 0
    parts = [fragments.repack(w) for w in ws]
    del ws
    try:
        stacked = parts[0] if len(parts) == 1 else fragments.concat(parts)
    except ValueError:  # rows that are not whole tiles, or another K or group
        for lin, f in zip(linears, parts):
            lin.hold(f)
        return len(linears)
    del parts
    row = 0
    for lin in linears:
        lin.hold(stacked if len(linears) == 1 else stacked.rows(row, lin.n_out))
        row += lin.n_out
    return len(linears)
