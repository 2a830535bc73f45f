"""Every size of config.json is checked before anything is allocated: a size that is not
a positive integer (vocab_size, hidden_size, intermediate_size, layers, heads, KV heads,
head_dim, max positions, the sliding window) or heads that do not divide as the model
needs is a ConfigError (a qfuse.UserError) naming the field; the CLI says it in one line,
exit 2, and `qfuse.load` raises it (a negative vocab_size was a torch.zeros traceback)."""

import json
import shutil

import pytest

import qfuse
from qfuse.loading import DEFAULT_MODEL
from qfuse.models import ModelConfig
from qfuse.models.config import ConfigError

LLAMA = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 256}
SIZES = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
         "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"]


@pytest.mark.parametrize("value", [-5, 0, 1.5, True, "64", [64]])
@pytest.mark.parametrize("field", SIZES)
def test_a_size_that_is_not_a_positive_integer_is_named(field, value):
    with pytest.raises(ConfigError, match=f"^{field} must be a positive integer, got "):
        ModelConfig.from_dict({**LLAMA, field: value})


@pytest.mark.parametrize("changes, fragment", [
    ({"hidden_size": 66}, "hidden_size (66) is not a multiple of num_attention_heads (4)"),
    ({"head_dim": 15}, "head_dim must be even"),
    ({"num_key_value_heads": 3}, ("num_attention_heads (4) is not a multiple of "
                                  "num_key_value_heads (3)")),
    ({"model_type": "gemma3_text", "sliding_window": -1},
     "sliding_window that is a positive integer, got -1"),
    ({"model_type": "gemma3_text", "sliding_window_pattern": 0},
     "sliding_window_pattern must be a positive integer, got 0"),
    ({"model_type": "gemma2", "query_pre_attn_scalar": -64},
     "query_pre_attn_scalar must be a number above 0, got -64"),
    ({"final_logit_softcapping": 0}, "final_logit_softcapping must be a number above 0"),
    ({"attn_logit_softcapping": float("nan")}, "attn_logit_softcapping must be a number above 0"),
])
def test_sizes_that_do_not_fit_together_are_named(changes, fragment):
    with pytest.raises(ConfigError) as caught:
        ModelConfig.from_dict({**LLAMA, **changes})
    assert fragment in str(caught.value)


def test_what_hf_leaves_to_defaults_stays_accepted():
    """null KV heads and head_dim are derived (as in HF); an explicit head_dim need not
    divide hidden_size (Gemma: 8 heads of 256 over 2304)."""
    cfg = ModelConfig.from_dict({**LLAMA, "num_key_value_heads": None, "head_dim": None,
                                 "final_logit_softcapping": None})
    assert (cfg.num_key_value_heads, cfg.head_dim) == (4, 16)
    cfg = ModelConfig.from_dict({**LLAMA, "hidden_size": 66, "head_dim": 32})
    assert cfg.head_dim == 32


@pytest.fixture
def broken(tmp_path):
    """broken(**fields) -> a copy of the bundled model whose config.json has ``fields``."""
    def make(**fields):
        out = tmp_path / "m"
        shutil.copytree(DEFAULT_MODEL, out)
        cfg = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**cfg, **fields}))
        return out
    return make


@pytest.mark.parametrize("field, value", [("vocab_size", -5), ("hidden_size", 0),
                                          ("num_hidden_layers", -1), ("head_dim", 2.5),
                                          ("max_position_embeddings", 0)])
def test_the_cli_says_it_in_one_line(field, value, broken, qfuse_here):
    m = broken(**{field: value})
    r = qfuse_here("generate", str(m), "def f():", "--max-tokens", "2")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines() == [(f"qfuse: error: {m / 'config.json'}: {field} must be a "
                                     f"positive integer, got {value!r}")]


def test_load_raises_a_user_error(broken):
    with pytest.raises(qfuse.UserError, match="vocab_size must be a positive integer, got -5"):
        qfuse.load(broken(vocab_size=-5))
