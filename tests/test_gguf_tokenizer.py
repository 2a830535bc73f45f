"""A .gguf file's own tokenizer and chat template, built from its metadata
(`qfuse.formats.gguf_tokenizer`, through `loading.load_tokenizer` & co. on a file with no
tokenizer.json beside it), encode and decode as the originals do:

- byte-level BPE ("gpt2"): the bundled model's tokenizer.json written into the metadata as
  llama.cpp's converter writes a vocabulary, against that tokenizer.json (with the split
  of Llama 3's and Qwen 2's tokenizer.json for those `pre` names);
- sentencepiece ("llama"): a sentencepiece BPE model trained here, against sentencepiece
  itself (skipped without the package).

Bad metadata gets one line naming the key."""

from __future__ import annotations

import copy
import io
import json

import pytest

gguf = pytest.importorskip("gguf")
from tokenizers import Tokenizer

from qfuse.loading import (
    DEFAULT_MODEL,
    CheckpointError,
    load_chat_template,
    load_tokenizer,
    render_chat,
    special_tokens,
)

TEXTS = ["Hello, world!", "def fibonacci(n):\n    return n if n < 2 else fib(n - 1)\n",
         "héllo wörld — ünïcode 日本語 🙂 Ωmega", "a   b\t\tc\n\n\nd   \n", " leading",
         "  two spaces", "", "don't I'LL HE'S", "1234567 89", "x<eos>y<bos>", "\r\n\r\nend",
         "e\u0301t\u00e9"]  # decomposed and composed é
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
            "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2 + 2?\n  Think."}]
BUNDLED = json.loads((DEFAULT_MODEL / "tokenizer.json").read_text())

# The split and normalizer blocks of Llama 3's and Qwen 2's own tokenizer.json.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _split_then_bytes(pattern: str) -> dict:
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated",
         "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
         "use_regex": False}]}


def reference_tokenizer(pre: str) -> Tokenizer:
    """The bundled tokenizer.json, with the split (and, for Qwen 2, the NFC normalizer and
    for Llama 3 the whole-word lookup) that ``pre`` names in its family's tokenizer.json."""
    raw = copy.deepcopy(BUNDLED)
    if pre == "llama-bpe":
        raw["pre_tokenizer"] = _split_then_bytes(_LLAMA3)
        raw["model"]["ignore_merges"] = True
    elif pre == "qwen2":
        raw["pre_tokenizer"] = _split_then_bytes(_QWEN2)
        raw["normalizer"] = {"type": "NFC"}
    return Tokenizer.from_str(json.dumps(raw))


def add_bundled_tokenizer(w, pre: str = "gpt-2", template: str | None = TEMPLATE) -> None:
    """The bundled tokenizer.json as llama.cpp's converter writes a byte-level vocabulary:
    tokens by id, merges as "left right", special added tokens as control (3), bos/eos
    ids, the chat template."""
    vocab = BUNDLED["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    special = {a["id"] for a in BUNDLED["added_tokens"] if a["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m)
                        for m in BUNDLED["model"]["merges"]])
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_pad_token_id(0)
    if template is not None:
        w.add_chat_template(template)


def write_metadata(path, add) -> None:
    """A .gguf file holding only metadata (``add(writer)``): enough for the tokenizer."""
    w = gguf.GGUFWriter(str(path), "llama")
    add(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2"])
def test_byte_level_tokenizer_encodes_and_decodes_as_its_tokenizer_json(tmp_path, pre):
    path = tmp_path / "m.gguf"
    write_metadata(path, lambda w: add_bundled_tokenizer(w, pre))
    ours, ref = load_tokenizer(path), reference_tokenizer(pre)
    for text in TEXTS:
        ids = ref.encode(text).ids
        assert ours.encode(text).ids == ids, text
        assert ours.decode(ids) == ref.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=False) == \
            ref.decode(ids, skip_special_tokens=False), text
    # The splits differ (digits in threes or one by one, NFC): each pre gets its own.
    if pre != "gpt-2":
        assert any(reference_tokenizer("gpt-2").encode(t).ids != ref.encode(t).ids
                   for t in TEXTS)


def test_chat_template_renders_the_same_prompt(tmp_path):
    path = tmp_path / "m.gguf"
    write_metadata(path, add_bundled_tokenizer)
    assert load_chat_template(path) == TEMPLATE
    specials = special_tokens(path)
    assert specials == {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
                        "unk_token": None}
    ours = render_chat(load_chat_template(path), MESSAGES, specials)
    ref = render_chat(TEMPLATE, MESSAGES, {"bos_token": "<bos>", "eos_token": "<eos>"})
    assert ours == ref and ours.startswith("<bos><|system|>Be brief.<eos>\n")
    tok, ref_tok = load_tokenizer(path), reference_tokenizer("gpt-2")
    ids = ref_tok.encode(ref, add_special_tokens=False).ids
    assert ids[0] == 2 and ids.count(1) == 2  # <bos>, <eos> whole
    assert tok.encode(ours, add_special_tokens=False).ids == ids


def test_tokenizer_json_beside_the_file_wins(tmp_path):
    from tokenizers import models

    path = tmp_path / "m.gguf"
    write_metadata(path, add_bundled_tokenizer)
    Tokenizer(models.WordLevel({"only": 0}, unk_token="only")).save(
        str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(path).get_vocab_size() == 1


def _sentencepiece_model():
    """A small sentencepiece BPE model (byte fallback, no normalization, spaces kept, as
    Llama's), trained on the standard library's sources."""
    spm = pytest.importorskip("sentencepiece")
    from qfuse.corpus import load_corpus

    train, val = load_corpus(max_chars=200_000)
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(train.splitlines()), model_writer=out, vocab_size=600,
        model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=True, split_digits=True,
        character_coverage=0.99, allow_whitespace_only_pieces=True, num_threads=1,
        minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=out.getvalue()), val


def add_sentencepiece(w, sp) -> None:
    """A sentencepiece model as llama.cpp's converter writes one: pieces, scores, types."""
    n = sp.get_piece_size()
    w.add_tokenizer_model("llama")
    w.add_token_list([sp.id_to_piece(i) for i in range(n)])
    w.add_token_scores([sp.get_score(i) for i in range(n)])
    w.add_token_types([2 if sp.is_unknown(i) else 3 if sp.is_control(i) else
                       6 if sp.is_byte(i) else 5 if sp.is_unused(i) else 1 for i in range(n)])
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())


def test_sentencepiece_tokenizer_encodes_and_decodes_as_sentencepiece(tmp_path):
    sp, val = _sentencepiece_model()
    path = tmp_path / "spm.gguf"
    write_metadata(path, lambda w: add_sentencepiece(w, sp))
    tok = load_tokenizer(path)
    for text in [*TEXTS[:-4], TEXTS[-2], val[:3000]]:  # sentencepiece reads "<eos>" as text
        ids = sp.encode(text)
        assert tok.encode(text, add_special_tokens=False).ids == ids, text
        assert tok.decode(ids) == sp.decode(ids), text
    assert tok.encode("Hi").ids == [sp.bos_id(), *sp.encode("Hi")]  # BOS by default
    # A control token in a prompt (a chat template's "<s>") stays whole, and the text
    # after it gets its own leading "▁", as llama.cpp tokenizes it.
    assert tok.encode("<s>Hi", add_special_tokens=False).ids == [sp.bos_id(), *sp.encode("Hi")]


def _bad(w, drop=(), **replace):
    """The bundled tokenizer's metadata less the keys ``drop``, with ``replace``d values."""
    add_bundled_tokenizer(w)
    for key in drop:
        del w.kv_data[0][key]
    for key, value in replace.items():
        key = "tokenizer.ggml." + key
        del w.kv_data[0][key]
        (w.add_string if isinstance(value, str) else w.add_uint32)(key, value)


@pytest.mark.parametrize("edit,key", [
    ({"model": "bert"}, "tokenizer.ggml.model"),
    ({"drop": ["tokenizer.ggml.model"]}, "tokenizer.ggml.model"),
    ({"drop": ["tokenizer.ggml.tokens"]}, "tokenizer.ggml.tokens"),
    ({"drop": ["tokenizer.ggml.merges"]}, "tokenizer.ggml.merges"),
    ({"pre": "jais"}, "tokenizer.ggml.pre"),
    ({"bos_token_id": 99999}, "tokenizer.ggml.bos_token_id"),
    ({"model": "llama"}, "tokenizer.ggml.scores"),
])
def test_bad_tokenizer_metadata_gets_one_line_naming_the_key(tmp_path, edit, key):
    path = tmp_path / "bad.gguf"
    write_metadata(path, lambda w: _bad(w, **edit))
    with pytest.raises(CheckpointError) as info:
        load_tokenizer(path)
    message = str(info.value)
    assert key in message and str(path) in message and "\n" not in message
