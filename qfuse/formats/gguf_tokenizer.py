"""A GGUF file's own tokenizer and chat template, from its metadata (llama.cpp's keys), for a
.gguf file with no tokenizer.json beside it.

`build(metadata)` returns a `tokenizers.Tokenizer` for the two vocabularies llama.cpp's
converter writes for the families qfuse runs, named by `tokenizer.ggml.model`:

- "gpt2": byte-level BPE (Llama 3, Qwen 2/3). `tokens` (spelled in GPT-2's byte alphabet,
  as in tokenizer.json) and `merges` ("left right") make the BPE model; `pre` names the
  regular expression that cuts text into words before the merges (`SPLITS`: GPT-2's,
  Llama 3's, Qwen 2's), then bytes map to the alphabet; the decoder maps them back. Qwen 2's
  text is NFC-normalized first, as its tokenizer.json does. An unknown `pre` is refused:
  another split would give other ids than the model was trained on.
- "llama": sentencepiece (Llama 1/2, Mistral). `tokens` and `scores` only: merges are
  recovered from the scores (each way of cutting a normal token into two tokens is a merge,
  ranked by the whole token's score, highest first), which reproduces sentencepiece's
  BPE encoding (merge the adjacent pair whose join scores highest); characters outside the
  vocabulary fall back to `<0xXX>` byte tokens. A space becomes "▁", and the text gets a
  leading "▁" unless `add_space_prefix` is false; the decoder undoes both.

Both: `token_type` 3 (control: <s>, <|im_start|>) become special added tokens and 4
(user-defined) plain added tokens, so text naming them maps to their ids whole; BOS (EOS) is
added to a plain prompt when `add_bos_token` (`add_eos_token`) says so, by default BOS for
"llama" only, as llama.cpp does. `chat_template(metadata)` is `tokenizer.chat_template`;
`special_tokens(metadata)` the bos/eos/pad/unk strings a template may name. Missing or
malformed keys, or a model other than these, raise FormatError naming the key.
"""

from __future__ import annotations

from .groups import FormatError

MODELS = ("gpt2", "llama")
# llama.cpp's token types.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_GPT2 = None  # ByteLevel's own regular expression (GPT-2's)
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre → the split before byte-level BPE (llama.cpp's names).
SPLITS = {"gpt-2": _GPT2, "phi-2": _GPT2, "llama-bpe": _LLAMA3, "llama3": _LLAMA3,
          "llama-v3": _LLAMA3, "smaug-bpe": _LLAMA3, "falcon3": _LLAMA3, "qwen2": _QWEN2,
          "deepseek-r1-qwen": _QWEN2, "megrez": _QWEN2}
_NFC = {"qwen2", "deepseek-r1-qwen", "megrez"}  # their tokenizer.json normalizes to NFC
# Llama 3's tokenizer.json looks a whole word up before merging (BPE's ignore_merges).
_WHOLE_WORDS = {"llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3"}
_SPECIAL_KEYS = {"bos_token": "bos", "eos_token": "eos", "pad_token": "padding",
                 "unk_token": "unknown"}


def _key(metadata: dict, name: str, kind, required: bool = True):
    """tokenizer.ggml.<name> of the metadata, checked to be a ``kind``; None if absent and
    not required."""
    key = f"tokenizer.ggml.{name}"
    if key not in metadata:
        if required:
            raise FormatError(f"the metadata lacks {key} (needed to build the tokenizer; or put "
                              "the model's tokenizer.json beside the file)")
        return None
    value = metadata[key]
    if not isinstance(value, kind):
        raise FormatError(f"{key} is a {type(value).__name__}, not a {kind.__name__}")
    return value


def _strings(metadata: dict, name: str, required: bool = True) -> list[str] | None:
    values = _key(metadata, name, list, required)
    if values is not None and not all(isinstance(v, str) for v in values):
        raise FormatError(f"tokenizer.ggml.{name} must hold strings")
    return values


def _per_token(metadata: dict, name: str, n: int, kind, required: bool) -> list | None:
    """A per-token array (scores, token_type), checked to hold one ``kind`` per token."""
    values = _key(metadata, name, list, required)
    if values is None:
        return None
    if len(values) != n or not all(isinstance(v, kind) for v in values):
        raise FormatError(f"tokenizer.ggml.{name} holds {len(values)} values, expected one "
                          f"number per token ({n})")
    return values


def _token_id(metadata: dict, which: str, n: int) -> int | None:
    value = _key(metadata, f"{which}_token_id", int, required=False)
    if value is not None and not 0 <= value < n:
        raise FormatError(f"tokenizer.ggml.{which}_token_id is {value}, outside the "
                          f"{n} tokens")
    return value


def check(metadata: dict, vocab_size: int | None = None) -> None:
    """Every check `build` makes that needs no tokenizer built: the model, the arrays it
    needs, the split, the special ids; and, given the model's ``vocab_size``, that no token
    id lies past the embedding."""
    model = _key(metadata, "model", str)
    if model not in MODELS:
        raise FormatError(f"tokenizer.ggml.model is {model!r}, a tokenizer qfuse does not "
                          f"build ({', '.join(MODELS)}); put the model's tokenizer.json beside "
                          "the file")
    tokens = _strings(metadata, "tokens")
    if not tokens:
        raise FormatError("tokenizer.ggml.tokens is empty")
    if vocab_size is not None and len(tokens) > vocab_size:
        raise FormatError(f"tokenizer.ggml.tokens holds {len(tokens)} tokens, more than the "
                          f"model's {vocab_size} embeddings")
    _per_token(metadata, "token_type", len(tokens), int, required=False)
    if model == "gpt2":
        _strings(metadata, "merges")
        pre = _key(metadata, "pre", str)
        if pre not in SPLITS:
            raise FormatError(f"tokenizer.ggml.pre is {pre!r}, a split qfuse does not know "
                              f"({', '.join(SPLITS)}); put the model's tokenizer.json beside "
                              "the file")
    else:
        _per_token(metadata, "scores", len(tokens), (int, float), required=True)
    for which in ("bos", "eos", "unknown", "padding"):
        _token_id(metadata, which, len(tokens))


def build(metadata: dict, vocab_size: int | None = None):
    """The `tokenizers.Tokenizer` the metadata describes (see the module docstring);
    FormatError naming the key for metadata that does not describe one."""
    from tokenizers import AddedToken, Tokenizer, processors

    check(metadata, vocab_size)
    tokens = metadata["tokenizer.ggml.tokens"]
    types = metadata.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a repeated spelling keeps its first id
    llama = metadata["tokenizer.ggml.model"] == "llama"
    tok = Tokenizer(_sentencepiece(metadata, vocab, types) if llama else
                    _byte_level(metadata, vocab))
    if llama:
        _sentencepiece_text(tok, metadata)
    else:
        _byte_level_text(tok, metadata["tokenizer.ggml.pre"])
    for kind, special in ((CONTROL, True), (USER_DEFINED, False)):
        added = [AddedToken(t, normalized=False, special=special)
                 for t, k in zip(tokens, types) if k == kind]
        if added:
            (tok.add_special_tokens if special else tok.add_tokens)(added)
    ends = []
    for which, default in (("bos", llama), ("eos", False)):
        add = _key(metadata, f"add_{which}_token", bool, required=False)
        tid = _token_id(metadata, which, len(tokens))
        if (default if add is None else add) and tid is not None:
            ends.append((which, tokens[tid], tid))
    if ends:
        bos = [t for w, t, _ in ends if w == "bos"]
        eos = [t for w, t, _ in ends if w == "eos"]
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join([*bos, "$A", *eos]),
            pair=" ".join([*bos, "$A", *eos, *bos, "$B:1", *eos]),
            special_tokens=[(t, i) for _, t, i in ends])
    return tok


def _byte_level(metadata: dict, vocab: dict):
    from tokenizers import models

    merges = []
    for n, m in enumerate(metadata["tokenizer.ggml.merges"]):
        pair = m.split(" ")
        if len(pair) != 2:
            raise FormatError(f"tokenizer.ggml.merges[{n}] is {m!r}, not two tokens apart by "
                              "a space")
        merges.append(tuple(pair))
    pre = metadata["tokenizer.ggml.pre"]
    try:
        return models.BPE(vocab, merges, ignore_merges=pre in _WHOLE_WORDS)
    except Exception as e:  # `tokenizers` raises a bare Exception (a merge of unknown tokens)
        raise FormatError(f"tokenizer.ggml.merges do not fit tokenizer.ggml.tokens ({e})") from e


def _byte_level_text(tok, pre: str) -> None:
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers

    split = SPLITS[pre]
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre in _NFC:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()


def _sentencepiece(metadata: dict, vocab: dict, types: list[int]):
    """A BPE model whose merges rank as sentencepiece's scores: for each normal token, every
    cut into two tokens of the vocabulary, the token's score deciding the order (ties: the
    lower token id, then the shorter left part)."""
    from tokenizers import models

    tokens, scores = metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.scores"]
    ranked = []
    for i, (t, kind) in enumerate(zip(tokens, types)):
        if kind != NORMAL or vocab[t] != i:
            continue
        for cut in range(1, len(t)):
            if t[:cut] in vocab and t[cut:] in vocab:
                ranked.append((-scores[i], i, cut))
    ranked.sort()
    merges = [(tokens[i][:cut], tokens[i][cut:]) for _, i, cut in ranked]
    unk = _token_id(metadata, "unknown", len(tokens))
    if unk is None:
        unk = next((i for i, k in enumerate(types) if k == UNKNOWN), None)
    return models.BPE(vocab, merges, unk_token=None if unk is None else tokens[unk],
                      fuse_unk=True, byte_fallback=BYTE in types)


def _sentencepiece_text(tok, metadata: dict) -> None:
    from tokenizers import decoders, normalizers

    prefix = _key(metadata, "add_space_prefix", bool, required=False)
    prefix = True if prefix is None else prefix
    space = normalizers.Replace(" ", "\u2581")
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), space]) if prefix \
        else space
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)


def chat_template(metadata: dict) -> str | None:
    """tokenizer.chat_template, if the file has one."""
    template = metadata.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise FormatError("tokenizer.chat_template is not a string")
    return template


def special_tokens(metadata: dict) -> dict:
    """{"bos_token": "<s>", ...}: the strings of the special ids the file names (None for
    those it does not), as a chat template reads them."""
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    out = {}
    for name, which in _SPECIAL_KEYS.items():
        tid = _token_id(metadata, which, len(tokens)) if tokens else None
        out[name] = tokens[tid] if tid is not None else None
    return out
