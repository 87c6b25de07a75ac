"""Chat rendering (chat.py), in process: incremental detokenization, and the CLI's conversation (chat.Conversation:
image markers counted over the whole conversation, the generated ids kept where the template renders them alike).
The chat template and splicing are checked through the front ends too: tests/test_generate.py (the CLI's prompts)
and tests/test_serve.py (chat requests, the reasoning split).
"""
import os

import pytest

import chat
import runtime


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
    """The tiny checkpoint's template renders an answer as its text and <|im_end|>, as generated: the next turn's ids
    begin with the last prompt's ids and the generated ids themselves (the slot's cache then holds all of them), not
    with the tokenizer's own split of the answer's text."""
    tok = tokenizer_of(converted)
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
