"""Chat rendering (chat.py), in process: incremental detokenization. The chat template, image markers and splicing
are checked through the front ends: tests/test_generate.py (the CLI's prompts) and tests/test_serve.py (chat
requests, the reasoning split).
"""
import os

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
