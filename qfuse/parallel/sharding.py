"""How each weight of a Decoder splits over N tensor-parallel ranks, and the checks that it can.

Megatron-style layout, chosen so that a decode step needs one all-reduce per sublayer:

- column-parallel (rows of W [out, in] split): q/k/v_proj and gate/up_proj. Rank r
  owns heads [r·Hq/N, (r+1)·Hq/N) and the KV heads they read, and a slice of the
  MLP's intermediate units; a quantized weight splits between rows, so its words,
  scales and biases split the same way and every group stays whole.
- row-parallel (columns of W split): o_proj and down_proj. A quantized weight's
  packed words [out, in·b/32] and scales/biases [out, in/g] split along their last
  axis at the same fractions, which is a split on group boundaries exactly when
  in/N is a multiple of the group size (checked; a group of 32 codes always fills
  whole words, so a group boundary is a word boundary for 3/5/6-bit too). A bias is
  added once: rank 0 keeps it, the other ranks hold zeros.
- vocabulary-parallel (rows split): embed_tokens and lm_head, V/N tokens each.
- replicated: every norm.

The plan is by parameter name, with no default: a parameter this file does not know
is an error, not silently replicated. `RankShard` reads one rank's slices straight
from safetensors (`safe_open(...).get_slice`), through `loading.load_model(shard=)`,
so a rank never holds the whole checkpoint.
"""

from __future__ import annotations

import dataclasses

import torch

from ..errors import UserError
from ..models import Decoder, ModelConfig

COLUMN, ROW, ROW_BIAS, VOCAB, REPLICATED = "column", "row", "row_bias", "vocab", "replicated"
_COLUMN_MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                   "mlp.up_proj")
_ROW_MODULES = ("self_attn.o_proj", "mlp.down_proj")


class TensorParallelError(UserError, ValueError):
    """A tensor-parallel request that cannot run (a size that does not split, a world
    size that does not match); the message is one line."""


def split_kind(name: str) -> str:
    """How parameter ``name`` (HF naming, as in the Decoder's state dict) is split."""
    module, _, leaf = name.rpartition(".")
    if module.endswith(_COLUMN_MODULES):
        return COLUMN
    if module.endswith(_ROW_MODULES):
        return ROW_BIAS if leaf == "bias" else ROW
    if module in ("model.embed_tokens", "lm_head"):
        return VOCAB
    if module.endswith("norm") and leaf == "weight":
        return REPLICATED
    raise ValueError(f"no tensor-parallel rule for parameter {name!r}")


def shard_index(name: str, full_shape: tuple[int, ...], rank: int, world: int):
    """The slices of the full tensor that rank ``rank`` holds (a tuple of slices), or
    None where the rank holds zeros (a row-parallel bias off rank 0)."""
    kind = split_kind(name)
    if kind in (COLUMN, VOCAB):
        n = full_shape[0] // world
        return (slice(rank * n, (rank + 1) * n),)
    if kind == ROW:
        n = full_shape[-1] // world
        return (slice(None),) * (len(full_shape) - 1) + (slice(rank * n, (rank + 1) * n),)
    if kind == ROW_BIAS and rank:
        return None
    return (slice(None),)


def check_world(config: ModelConfig, world: int, quant=lambda path: (0, 0)) -> None:
    """TensorParallelError unless every split of `split_kind` is whole at ``world`` ranks:
    attention and KV heads, intermediate size, vocabulary, and the group boundaries of
    every quantized row-parallel weight (``quant(path) -> (group_size, bits)``)."""
    if world < 1:
        raise TensorParallelError(f"--tp must be at least 1, got {world}")
    sizes = (("attention heads", config.num_attention_heads),
             ("key-value heads", config.num_key_value_heads),
             ("intermediate size", config.intermediate_size),
             ("vocabulary size", config.vocab_size))
    for what, n in sizes:
        if n % world:
            raise TensorParallelError(
                f"tensor parallel over {world} ranks: the model's {what} ({n}) does not "
                f"divide by {world}")
    for layer in range(config.num_hidden_layers):
        for module, n_in in (("self_attn.o_proj", config.num_attention_heads * config.head_dim),
                             ("mlp.down_proj", config.intermediate_size)):
            path = f"model.layers.{layer}.{module}"
            group, bits = quant(path)
            if bits and (n_in // world) % group:
                raise TensorParallelError(
                    f"tensor parallel over {world} ranks: {path} ({bits}-bit, groups of "
                    f"{group}) has {n_in} inputs, so each rank's {n_in // world} would cut a "
                    f"quantization group")


def rank_config(config: ModelConfig, world: int) -> ModelConfig:
    """The config one rank's Decoder reports: its own attention heads, KV heads and
    intermediate size; the full vocabulary (logits are gathered) and head_dim."""
    return dataclasses.replace(
        config, num_attention_heads=config.num_attention_heads // world,
        num_key_value_heads=config.num_key_value_heads // world,
        intermediate_size=config.intermediate_size // world)


def rank_raw_config(raw: dict, world: int) -> dict:
    """A config.json dict with one rank's shapes (vocabulary included: the embedding is
    built at V/N rows), for random-weight models (`qfuse.bench.e2e.random_model`);
    head_dim is made explicit, since HF derives it from the head count."""
    cfg = ModelConfig.from_dict(raw)
    return {**raw, "num_attention_heads": cfg.num_attention_heads // world,
            "num_key_value_heads": cfg.num_key_value_heads // world,
            "intermediate_size": cfg.intermediate_size // world,
            "vocab_size": cfg.vocab_size // world, "head_dim": cfg.head_dim}


def build_rank_model(config: ModelConfig, quant, comm) -> Decoder:
    """An empty Decoder with rank ``comm.rank``'s shapes, made tensor parallel
    (`layers.parallelize`); `RankShard` fills it (`loading.load_model(shard=)`)."""
    from .layers import parallelize

    check_world(config, comm.world, quant)
    local = rank_config(config, comm.world)
    model = Decoder(dataclasses.replace(local, vocab_size=config.vocab_size // comm.world), quant)
    return parallelize(model, comm)


@dataclasses.dataclass
class RankShard:
    """One rank's part of a checkpoint, for `loading.load_model(shard=...)`."""

    comm: object  # comm.Comm: rank, world and the collectives the modules use

    def build(self, config: ModelConfig, quant) -> Decoder:
        return build_rank_model(config, quant, self.comm)

    def read(self, f, raw_name: str, name: str) -> torch.Tensor:
        """Rank's slice of tensor ``raw_name`` from an open safetensors file; only the
        slice's bytes are read."""
        view = f.get_slice(raw_name)
        shape = tuple(view.get_shape())
        index = shard_index(name, shape, self.comm.rank, self.comm.world)
        if index is None:  # a row-parallel bias off rank 0: its dtype, all zeros
            return torch.zeros_like(view[:])
        return view[index]
