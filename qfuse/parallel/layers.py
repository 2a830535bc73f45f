"""The four module kinds that make N per-rank Decoders one tensor-parallel model.

`parallelize(model, comm)` re-classes modules of an ordinary Decoder built with one
rank's shapes, in place: parameter names, weights and kernels stay exactly those of
the single-GPU model (no wrapper in the state dict, no copy of the weights), and
only these forwards (and the choices a plan keeps for them: `planned`) change:

- `RowParallelLinear` (each attention's o_proj) and `RowParallelMLP` (each MLP):
  the rank's partial sum over its heads or intermediate units, then one all-reduce.
  Both outputs are reduced before the decoder layer adds the residual or applies a
  post-norm (Gemma's sandwich norms need the full sum).
- `VocabParallelEmbedding`: each rank looks up the ids in its vocabulary range and
  zeros the others; the all-reduce then adds exact zeros, so the result is bitwise
  the single-GPU lookup. As a tied head it gathers its logit columns.
- `VocabParallelHead` (an untied lm_head): gathers its logit columns.

Each re-classed module keeps ``comm`` (comm.Comm) as an attribute. Only modules of
exactly the base class are re-classed, so that a subclass added later is an error
here rather than a forward silently losing its reduction.
"""

from __future__ import annotations

import dataclasses

import torch

from ..choose import Choice
from ..models.decoder import MLP, Decoder, Embedding, Linear


class RowParallelLinear(Linear):
    """y = Σ_ranks x_r·W_rᵀ: this rank's input columns, summed over ranks (o_proj)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(super().forward(x))

    def planned(self, choice: Choice) -> Choice:
        return _then(choice, self.comm.all_reduce)


class RowParallelMLP(MLP):
    """The MLP over this rank's intermediate units, summed over ranks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(super().forward(x))

    def planned(self, choice: Choice) -> Choice:
        return _then(choice, self.comm.all_reduce)


class VocabParallelEmbedding(Embedding):
    """Rows [vocab_start, vocab_start + n_out) of the embedding; ids outside look up zeros."""

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.n_out)
        rows = super().lookup(torch.where(inside, local, torch.zeros_like(local)), dtype)
        return self.comm.all_reduce(rows.masked_fill(~inside[..., None], 0))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather_last(super().forward(h))

    def planned(self, choice: Choice) -> Choice:
        return _then(choice, self.comm.all_gather_last)


class VocabParallelHead(Linear):
    """lm_head over this rank's vocabulary rows; the logits gathered over ranks."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather_last(super().forward(h))

    def planned(self, choice: Choice) -> Choice:
        return _then(choice, self.comm.all_gather_last)


def _then(choice: Choice, collective) -> Choice:
    """The plan's choice for a re-classed module: its launcher, then the collective."""
    run = choice.run
    return dataclasses.replace(choice, run=lambda *args: collective(run(*args)))


def _recast(module, base: type, kind: type, **attrs) -> None:
    if type(module) is not base:
        raise TypeError(f"tensor parallel expects a {base.__name__}, found "
                        f"{type(module).__name__}: teach qfuse.parallel.layers about it")
    module.__class__ = kind
    for key, value in attrs.items():
        setattr(module, key, value)


def parallelize(model: Decoder, comm) -> Decoder:
    """Make a Decoder built with one rank's shapes (heads, KV heads, intermediate size
    and vocabulary divided by ``comm.world``) that rank's part of the tensor-parallel
    model, in place; its config then reports the full vocabulary."""
    for layer in model.model.layers:
        _recast(layer.self_attn.o_proj, Linear, RowParallelLinear, comm=comm)
        _recast(layer.mlp, MLP, RowParallelMLP, comm=comm)
    embed = model.model.embed_tokens
    _recast(embed, Embedding, VocabParallelEmbedding, comm=comm,
            vocab_start=comm.rank * embed.n_out)
    if not model.config.tie_word_embeddings:
        _recast(model.lm_head, Linear, VocabParallelHead, comm=comm)
    # Sampling, the repetition penalty and the caller see the gathered vocabulary.
    model.config = dataclasses.replace(model.config, vocab_size=embed.n_out * comm.world)
    model.replan()  # plans made before bound the single-GPU forwards
    return model
