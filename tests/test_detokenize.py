"""`IncrementalText` gives, token by token, the whole list's decode (at every point where
that decode has no unfinished character, and says so where it has) wherever the whole
decodes only grow: with the bundled byte-level tokenizer, a SentencePiece-style one (▁
spaces, byte fallback, the leading space stripped) and the serve bench's number tokenizer;
its text only grows, with a decoder that is not token by token too. It decodes short
windows, not the whole list."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models

from qfuse.runtime.detokenize import IncrementalText


def sentencepiece_style() -> Tokenizer:
    """A Llama/Gemma-style decoder over a small vocabulary: byte tokens <0xNN> (multi-byte
    characters arrive a byte at a time) and pieces with ▁ for a space."""
    pieces = ["<unk>", "▁", "▁the", "▁cat", "é", "▁naïve", "ing", "▁", "▁▁", "\n", "x"]
    vocab = {p: i for i, p in enumerate(dict.fromkeys(pieces))}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return tok


def bundled() -> Tokenizer:
    from qfuse.api import load

    return load(progress=False)[1]


class NotTokenByToken:
    """A decode whose text for a longer list does not extend the shorter one's."""

    def decode(self, ids):
        return "".join(chr(97 + i % 26) for i in reversed(ids))


def number_tokenizer():
    from qfuse.bench.serve import NumberTokenizer

    return NumberTokenizer(1000)


def utf8_heavy_ids(tok: Tokenizer, rng: random.Random, n: int) -> list[int]:
    """Ids of text with multi-byte characters, cut at random, mixed with random ids."""
    text = "naïve café — 日本語 🙂 the cat\n" * 4
    ids = tok.encode(text).ids
    out = []
    while len(out) < n:
        if rng.random() < 0.5:
            start = rng.randrange(len(ids))
            out += ids[start: start + rng.randrange(1, 12)]
        else:
            out.append(rng.randrange(tok.get_vocab_size()))
    return out[:n]


@pytest.mark.parametrize("make", [bundled, sentencepiece_style])
def test_equals_the_whole_decode_while_that_only_grows(make):
    """Random cuts and ids: wherever the whole decodes so far have each extended the last
    (always, for text a tokenizer encoded), the text is the whole decode. Byte-fallback
    runs of invalid UTF-8 can turn earlier bytes (a space) into U+FFFD, so that a longer
    list's decode does not extend a shorter one's; a stream cannot take back what it sent,
    so from there the text only grows (and differs from the whole decode there)."""
    tok = make()
    rng = random.Random(0)
    compared = 0
    for trial in range(40):
        ids = utf8_heavy_ids(tok, rng, 80)
        inc = IncrementalText(tok)
        last_full, growing, last_text = "", True, ""
        for n in range(1, len(ids) + 1):
            full = tok.decode(ids[:n])
            complete = inc.add(ids[n - 1])
            if growing:
                assert complete == (not full.endswith("\ufffd")), (trial, n, full)
            if not complete:
                continue
            growing = growing and full.startswith(last_full)
            last_full = full
            assert inc.text.startswith(last_text), (trial, n)  # only grows
            last_text = inc.text
            if growing:
                assert inc.text == full, (trial, n, inc.text, full)
                compared += 1
    assert compared > 200, compared  # the case compares many points, not a few


@pytest.mark.parametrize("make", [bundled, sentencepiece_style])
def test_equals_the_whole_decode_of_encoded_text(make):
    tok = make()
    text = "naïve café — 日本語 🙂 the cat\n  x\tdef f(n):\n    return n ** 2\n" * 6
    ids = tok.encode(text).ids
    inc = IncrementalText(tok)
    for n in range(1, len(ids) + 1):
        full = tok.decode(ids[:n])
        assert inc.add(ids[n - 1]) == (not full.endswith("\ufffd")), n
        if not full.endswith("\ufffd"):
            assert inc.text == full, (n, inc.text, full)
    assert inc.text == tok.decode(ids)


def test_unfinished_characters_wait_for_their_bytes():
    tok = sentencepiece_style()
    vocab = tok.get_vocab()
    inc = IncrementalText(tok)
    snowman = "☃".encode()  # three bytes, three byte-fallback tokens
    for b in snowman[:-1]:
        assert not inc.add(vocab[f"<0x{b:02X}>"])
        assert inc.text == ""
    assert inc.add(vocab[f"<0x{snowman[-1]:02X}>"]) and inc.text == "☃"
    assert inc.add(vocab["▁cat"]) and inc.text == "☃ cat"


def test_the_serve_bench_numbers_give_the_whole_decode():
    tok = number_tokenizer()
    ids = [3, 17, 999, 42, 5, 0, 77]
    inc = IncrementalText(tok)
    for n in range(1, len(ids) + 1):
        assert inc.add(ids[n - 1])
        assert inc.text == tok.decode(ids[:n])


def test_a_decoder_that_is_not_token_by_token_still_only_grows():
    tok = NotTokenByToken()
    inc = IncrementalText(tok)
    last = ""
    for i in [3, 17, 999, 42, 5, 0, 77]:
        assert inc.add(i)
        assert inc.text.startswith(last) and len(inc.text) > len(last)
        last = inc.text


def test_windows_stay_short():
    tok = bundled()

    class Counting:
        longest = 0

        def decode(self, ids):
            Counting.longest = max(Counting.longest, len(ids))
            return tok.decode(ids)

    ids = tok.encode("def fibonacci(n):\n    return n if n < 2 else n - 1\n" * 20).ids
    inc = IncrementalText(Counting())
    for i in ids:
        inc.add(i)
    assert len(ids) > 200 and inc.text == tok.decode(ids)
    assert Counting.longest <= 4, Counting.longest


def test_texts_sharing_single_token_decodes_give_the_same_text_decoding_once_a_token():
    """The serving engine's texts share one dict of single-token decodes: each text is
    still its own list's decode, and once the dict knows a stream's tokens, adding a
    token that settles at once decodes once (its window), not twice."""
    tok = bundled()

    class Counting:
        calls = 0

        def decode(self, ids):
            Counting.calls += 1
            return tok.decode(ids)

    lines = ["def fibonacci(n):\n    return n if n < 2 else n - 1\n",
             "naïve café — 日本語 🙂 the cat\n", "for i in range(10):\n    print(i)\n"]
    ids = [tok.encode(line * 8).ids for line in lines]
    singles: dict[int, str] = {}
    shared = [IncrementalText(Counting(), singles) for _ in ids]
    for stream, text in zip(ids, shared):
        for i in stream:
            text.add(i)
        assert text.text == tok.decode(stream)
    assert singles and all(singles[t] == tok.decode([t]) for t in singles)
    # Again, the dict full: every settled window of one token is a lookup.
    Counting.calls = 0
    again = IncrementalText(Counting(), singles)
    for i in ids[0]:
        again.add(i)
    assert again.text == tok.decode(ids[0])
    assert Counting.calls < 1.2 * len(ids[0]), (Counting.calls, len(ids[0]))  # 2 each before
