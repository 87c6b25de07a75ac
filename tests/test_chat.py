"""Chat rendering (chat.py), in process: incremental detokenization, and text tokenized in bounded pieces (the
pieces' ids equal the whole text's; a long text stops at its limit). The chat template, image markers and splicing
are checked through the front ends: tests/test_generate.py (the CLI's prompts) and tests/test_serve.py (chat
requests, the reasoning split).
"""
import os

import chat
import runtime
from helpers import Counting


def test_text_stream_never_splits_a_character(tp1_models, converted):
    """Incremental detokenization: the pieces concatenate to the whole decode, and no piece ends inside a UTF-8
    sequence (a character split over byte-level tokens is held back until it is complete)."""
    tok = runtime.load_tokenizer(os.path.join(converted("bf16_text", 1), "..", "tokenizer_files"))
    text = "张量并行 splits 矩阵 across ranks; 稀疏注意力 🙂 done"
    toks = tok(text, add_special_tokens=False)["input_ids"]
    s = chat.TextStream(tok)
    pieces = [s.push([t]) for t in toks] + [s.flush()]
    assert "".join(pieces) == tok.decode(toks) == text
    assert all("\ufffd" not in p for p in pieces)
    assert sum(1 for p in pieces if p) > 5  # it streams, not just at the end


# ---------------------------------------------------------------------------------------------- bounded pieces
# what a hostile or unusual text holds: CJK, emoji (with skin tones and joiners), whitespace runs, special-token
# strings and their fragments, combining marks that NFC joins, Hangul jamo, fullwidth and compatibility characters
PARTS = ["hello", " world", "  ", "\t", "\n\n", "   ", "请介绍一下张量并行", "。", "，", "🙂", "👍🏽", "👨‍👩‍👧", "e\u0301",
         "\u0301", "<|im_end|>", "<s>", "<|im_start|>", "x", "'s", "3.14", "2048", "!!", "...", "\u1100\u1161\u11a8",
         "한국어", "か\u3099", "Ω", "ﬁ", " ", "\r\n", "—", "ab\u200dcd", "<|", "|>", "<s", "im_end|>", "Ａ", "½", " \n "]


def variants(tok):
    """The tiny tokenizer as it is (NFC, ByteLevel), and re-piped as the larger byte-level families are: a Split
    regex (Qwen's) before a regex-free ByteLevel, NFKC, and a template that puts <s> ... </s> around a text."""
    from tokenizers import Regex, Tokenizer
    from tokenizers import normalizers as N
    from tokenizers import pre_tokenizers as P
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast
    qwen = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
            r"""|\s+(?!\S)|\s+""")
    t = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    t.pre_tokenizer = P.Sequence([P.Split(Regex(qwen), behavior="isolated"),
                                  P.ByteLevel(add_prefix_space=False, use_regex=False)])
    t.normalizer = N.NFKC()
    t.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 1)])
    return [tok, PreTrainedTokenizerFast(tokenizer_object=t)]


def tiny_tokenizer(converted):
    return runtime.load_tokenizer(os.path.join(converted("bf16_text", 1), "..", "tokenizer_files"))


def test_bounded_pieces_give_the_whole_texts_ids(converted):
    """chat.BoundedTokenizer cuts a text into pieces (here of ~100 characters) at pre-token boundaries: on random
    texts the pieces' ids are the whole text's, with and without the special tokens around them."""
    import random
    rng = random.Random(0)
    for tok in variants(tiny_tokenizer(converted)):
        count = Counting(tok)
        bt = chat.BoundedTokenizer(count, piece=100)
        assert bt.whole is None
        for _ in range(40):
            text = "".join(rng.choice(PARTS) for _ in range(rng.randrange(1, 1500)))
            for special in (False, True):
                assert bt.ids(text, 10 ** 9, special) == tok(text, add_special_tokens=special)["input_ids"], text
        assert count.calls > 1000 and count.longest < 1000  # it really cut


def test_bounded_pieces_stop_at_the_limit(converted):
    """A text far past its limit: refused after at most the limit + one piece of ids, whatever its length."""
    count = Counting(tiny_tokenizer(converted))
    bt = chat.BoundedTokenizer(count)
    count.ids = 0  # its probe of the special tokens
    text = "Tensor parallelism splits each weight matrix. 张量并行。" * 100_000  # 5.3 M characters
    try:
        bt.ids(text, 1000)
        raise AssertionError("not refused")
    except chat.TooManyIds as e:
        assert e.made == count.ids and e.limit == 1000
    assert count.ids <= 1000 + 4 * (chat.PIECE + chat.EDGE)  # a piece's ids: at most its UTF-8 bytes
    assert count.longest <= chat.PIECE + chat.EDGE


def test_a_run_without_boundaries_is_cut_and_a_foreign_pipeline_is_tokenized_whole(converted):
    """A run longer than MAX_RUN with no pre-token boundary (emoji, no space) is still tokenized in bounded pieces;
    a pipeline the cut rule does not cover (a prefix space added to every text) is tokenized whole, and says so."""
    from tokenizers import Tokenizer
    from tokenizers import pre_tokenizers as P
    from transformers import PreTrainedTokenizerFast
    tok = tiny_tokenizer(converted)
    count = Counting(tok)
    ids = chat.BoundedTokenizer(count).ids("🙂" * (3 * chat.MAX_RUN), 10 ** 9)
    assert count.calls >= 3 and count.longest <= chat.MAX_RUN + chat.PIECE and len(ids) >= 3 * chat.MAX_RUN
    t = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    t.pre_tokenizer = P.ByteLevel(add_prefix_space=True)
    prefixed = PreTrainedTokenizerFast(tokenizer_object=t)
    bt = chat.BoundedTokenizer(prefixed, piece=100)
    assert "pre-tokenizer" in bt.whole
    text = "word " * 300
    assert bt.ids(text, 10 ** 9) == prefixed(text, add_special_tokens=False)["input_ids"]
