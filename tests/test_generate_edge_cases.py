"""generate() edge cases with a scripted model (fixed logits) and tokenizer."""

import torch
from torch import nn

from qfuse.generation import SamplingParams, Summary, generate
from qfuse.models import ModelConfig

V = 16
CFG = ModelConfig.from_dict({"model_type": "llama", "vocab_size": V, "hidden_size": 8,
                             "intermediate_size": 16, "num_hidden_layers": 1,
                             "num_attention_heads": 1, "max_position_embeddings": 64})


class Scripted(nn.Module):
    """Always predicts `logits` (the same row for every sequence)."""

    def __init__(self, logits):
        super().__init__()
        self.config = CFG
        self.model = nn.Module()
        self.model.norm = nn.Module()
        self.model.norm.weight = nn.Parameter(torch.ones(8))
        self.row = torch.tensor(logits, dtype=torch.float32)

    dtype = torch.float32

    def forward(self, ids, lengths, cache):
        return self.row.expand(ids.shape[0], ids.shape[1], V).clone()

    def decode(self, tokens, cache):
        return self.row.expand(tokens.shape[0], V).clone()


class CharTok:
    """Token i <-> chr(ord('a') + i); encode maps each char of the prompt."""

    class _E:
        def __init__(self, ids):
            self.ids = ids

    def encode(self, s):
        return self._E([ord(c) - ord("a") for c in s])

    def decode(self, ids):
        return "".join(chr(ord("a") + i) for i in ids)


def _outputs(model, prompts, **kw):
    return next(e for e in generate(model, CharTok(), prompts, **kw)
                if isinstance(e, Summary)).outputs


def test_repetition_penalty_ignores_right_padding():
    """Token 0 ('a') is the argmax; neither prompt contains it. Batched with a longer
    prompt, the short one is right-padded with id 0 and `history = batch` penalises 0."""
    row = [0.0] * V
    row[0], row[5] = 2.0, 1.9
    model = Scripted(row)
    params = SamplingParams(repetition_penalty=1.3)
    alone = _outputs(model, ["bc"], max_tokens=1, params=params)
    batched = _outputs(model, ["bc", "bcdefg"], max_tokens=1, params=params)
    assert alone[0] == "a"
    assert batched[0] == alone[0]


def test_stop_string_is_not_streamed():
    """Streamed Step.texts should add up to the final output, without the stop string."""
    row = [0.0] * V
    row[3] = 5.0  # always 'd'
    model = Scripted(row)
    streamed = ""
    for e in generate(model, CharTok(), ["b"], max_tokens=5, stop=["dd"]):
        if isinstance(e, Summary):
            final = e.outputs[0]
        else:
            streamed += e.texts[0]
    assert final == ""
    assert streamed == final, f"streamed {streamed!r} though the output is {final!r}"
