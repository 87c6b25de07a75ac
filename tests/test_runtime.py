"""The runtime under both front ends (runtime.py), in process: files and the tokenizer, rank 0's progress lines. The
front ends' end-to-end behaviour under torchrun is tests/test_generate.py's and tests/test_serve.py's.
"""
import os

import pytest
import torch

import runtime


def test_a_json_file_that_cannot_be_read_is_named(tmp_path):
    import socket
    path = str(tmp_path / "p.json")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(path)  # open() fails on a socket even for root, as it does on a file without read permission
        with pytest.raises(runtime.UserError, match=r"p\.json: cannot read it \(No such device or address\)"):
            runtime.read_json(path)


def test_tokenizer_loads_directly_and_keeps_long_prompts(converted):
    """The runtime loads tokenizer.json itself; a long mixed-script prompt keeps every token (the regression
    was a 4,373-token prompt collapsing to 74 under automatic class selection) and equals the raw tokenizer's ids."""
    from tokenizers import Tokenizer
    d = os.path.join(converted("bf16_text", 2), "..", "tokenizer_files")
    tok = runtime.load_tokenizer(d)
    text = " ".join(["Sparse attention selects regions; 稀疏注意力为每个查询选择区域。"] * 300)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    raw = Tokenizer.from_file(os.path.join(d, "tokenizer.json")).encode(text, add_special_tokens=False).ids
    assert ids == raw and len(ids) > 4000
    assert tok.decode(ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True, add_generation_prompt=True)
    chat = list(chat["input_ids"] if hasattr(chat, "keys") else chat)
    assert chat[0] == tok.convert_tokens_to_ids("<|im_start|>") and tok.eos_token_id == 4


def test_prefill_progress_times_each_prefill_from_its_own_start(monkeypatch):
    """Rank 0's progress lines time a prefill from its first layer, also one that starts after a reused prefix."""
    said, now = [], [0.0]
    monkeypatch.setattr(runtime.time, "perf_counter", lambda: now[0])
    progress = runtime.progress_printer(runtime.Session(None, 0, 1, torch.device("cpu"), None, None, None, [],
                                                        say=said.append))
    for prefill, start in ((0, 0), (1, 8)):
        now[0] = 100.0 * prefill  # the second prefill starts 100 s after the first
        progress(start, 16 - start, 16, 1, 2, start)
        now[0] += runtime.PROGRESS_AFTER_S + 1
        progress(start, 16 - start, 16, 2, 2, start)
    monkeypatch.undo()
    assert said == [f"prefill: tokens {a}-16 of 16, layer 2/2 after 6 s" for a in (0, 8)]
