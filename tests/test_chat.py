"""Chat rendering (chat.py), in process: incremental detokenization, the CLI's conversation (chat.Conversation:
image markers counted over the whole conversation, the generated ids kept where the template renders them alike),
and text tokenized in bounded pieces (the pieces' ids equal the whole text's; a long text stops at its limit). The
chat template and splicing are checked through the front ends too: tests/test_generate.py (the CLI's prompts) and
tests/test_serve.py (chat requests, the reasoning split).
"""
import os

import pytest

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


# ---------------------------------------------------------------------------------------------- Conversation
def tokenizer_of(converted, kind="bf16_text"):
    return runtime.load_tokenizer(os.path.join(converted(kind, 1), "..", "tokenizer_files"))


def pieces(tok, text: str) -> list:
    """Ids of `text` one character at a time: ids the model may generate for a text that the tokenizer itself splits
    otherwise."""
    return [t for c in text for t in tok(c, add_special_tokens=False)["input_ids"]]


# a template that renders each message's content as it is, and no reasoning block in the generation prompt: an
# answer re-renders exactly as generated (the tiny checkpoint's own Step-form template opens <think> and drops it)
PLAIN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def next_turn(tok, answer: str):
    """A turn answered with `answer` (generated one character at a time, then EOS), and the next turn -> (the
    conversation, the first turn, the generated ids, the next turn, the next turn's rendering)."""
    conv = chat.Conversation(tok, None, raw=False)
    t1 = conv.ask("hello there", [], "turn 1")
    out = pieces(tok, answer) + [tok.eos_token_id]
    conv.answered(t1, out, [tok.eos_token_id])
    t2 = conv.ask("and then?", [], "turn 2")
    return conv, t1, out, t2, chat.render(tok, conv.messages + [t2.message], raw=False)


def test_a_next_turn_keeps_the_generated_ids_its_template_renders_alike(converted):
    """A template that renders an answer as its text and <|im_end|>, as generated: the next turn's ids begin with the
    last prompt's ids and the generated ids themselves (the slot's cache then holds all of them), not with the
    tokenizer's own split of the answer's text."""
    tok = tokenizer_of(converted)
    tok.chat_template = PLAIN_TEMPLATE
    conv, t1, out, t2, rendered = next_turn(tok, "hello")
    assert conv.messages[-1] == {"role": "assistant", "content": "hello"}
    assert t2.prompt.ids[:len(t1.prompt.ids) + len(out)] == t1.prompt.ids + out
    assert tok.decode(t2.prompt.ids, skip_special_tokens=False) == rendered
    whole = tok(rendered, add_special_tokens=False)["input_ids"]
    assert whole != t2.prompt.ids and whole[:len(t1.prompt.ids)] == t1.prompt.ids  # the tokenizer splits "hello" so
    # a third turn keeps both earlier answers' ids
    conv.answered(t2, pieces(tok, "ok") + [tok.eos_token_id], [tok.eos_token_id])
    t3 = conv.ask("more", [], "turn 3")
    assert t3.prompt.ids[:len(t2.prompt.ids) + 3] == t2.prompt.ids + pieces(tok, "ok") + [tok.eos_token_id]


def test_a_next_turn_takes_the_templates_ids_where_it_renders_the_answer_otherwise(converted):
    """A template that drops past reasoning (as the Step template does) renders the answer otherwise than it was
    generated: the next turn keeps the last prompt's ids and tokenizes the rest as the template renders it."""
    tok = tokenizer_of(converted)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
                         "{{ m['content'].split('</think>')[-1] }}{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    _, t1, _, t2, rendered = next_turn(tok, "<think>hmm</think>hello")
    first = tok.decode(t1.prompt.ids, skip_special_tokens=False)
    assert "hmm" not in rendered and rendered.startswith(first)
    n = len(t1.prompt.ids)
    assert t2.prompt.ids[:n] == t1.prompt.ids
    assert t2.prompt.ids[n:] == tok(rendered[len(first):], add_special_tokens=False)["input_ids"]


def test_image_markers_are_counted_over_the_whole_conversation(converted, tmp_path):
    """A typed <image> places its turn's image once; an answer that holds the text <image> stays text; every later
    turn's prompt holds the whole conversation (the splice once cut everything after a second marker for one image);
    a template that drops a message with an image is refused."""
    import numpy as np
    from PIL import Image

    import config
    tok = tokenizer_of(converted, "fp8_vl")
    tok.chat_template = PLAIN_TEMPLATE  # its prompts end as the tail below says
    vl = config.load_config(os.path.join(converted("fp8_vl", 1), "config-r0.json"))[1]
    img = str(tmp_path / "img.png")
    Image.fromarray((np.random.default_rng(0).random((300, 300, 3)) * 255).astype("uint8")).save(img)
    conv = chat.Conversation(tok, vl, raw=False)
    t = conv.ask("What is in <image>?", [img], "turn 1")
    n_img = t.prompt.ids.count(vl.image_token_id)
    assert n_img > 0
    sizes = [len(t.prompt.ids)]
    for i, text in enumerate(["and then?", "tell me more about it", "and <image> here?"]):
        conv.answered(t, pieces(tok, f"an <image> {i}") + [tok.eos_token_id], [tok.eos_token_id])
        if "<image>" in text:
            with pytest.raises(runtime.UserError, match=r"1 <image> marker\(s\) for 0 image"):
                conv.ask(text, [], "turn")
            text = text.replace("<image>", "")
        t = conv.ask(text, [], f"turn {i + 2}")
        sizes.append(len(t.prompt.ids))
        assert t.prompt.ids.count(vl.image_token_id) == n_img
        tail = f"{i}<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
        assert tok.decode(t.prompt.ids, skip_special_tokens=False).endswith("an <image> " + tail)
    assert sizes == sorted(set(sizes)), sizes
    tok.chat_template = ("{% for m in messages[-1:] %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}<|im_start|>assistant\n")  # only the last message
    with pytest.raises(runtime.UserError, match="rendered 0 image.s. of the conversation's 1: it dropped"):
        conv.ask("and now?", [], "turn 5")


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
