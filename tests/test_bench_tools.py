"""tools.bench_serve --tools (tools.bench_tools) on the tiny checkpoint: serve.py's HTTP side and engine loop in this
process, with the engine's grammars over the checkpoint's own tokenizer (its chat template of Step's form and its
marker tokens), driven by the benchmark's streaming chat clients, plain and tool-calling, also under --speculative.
What is asserted is what the benchmark prints and counts, not a timing."""
import json
import os

import pytest

from conftest import load_tp1

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_tok_dir(converted):
    return os.path.join(os.path.dirname(converted("bf16_text", 1, keep_mtp=True)), "tokenizer_files")


@pytest.mark.parametrize("speculative,chars", [(0, 6), (2, 0)])
def test_tools_mode_prints_tool_calling_beside_plain_and_their_ratio(converted, tiny_tok_dir, capsys, speculative,
                                                                     chars):
    """Each cell runs plain (ignore_eos: max_tokens each) and tool-calling requests: a forced call of exactly 6
    characters, which closes (finish tool_calls), or of free text, closed where the model closes it or cut at
    max_tokens. Asserted: the printed rows, their token counts (usage equal to the ids the chunks carried, else the
    benchmark exits), the calls the streamed deltas assemble to, and the ratio."""
    import runtime
    from tools import bench_serve, bench_tools
    lm = load_tp1(converted("bf16_text", 1, keep_mtp=True))
    tok = runtime.load_tokenizer(tiny_tok_dir)
    bench_serve.check_window(tok, lm.cfg.vocab_size // lm.cfg.tp_size)
    s = bench_serve.local_engine(lm, tok, 2, 1024, 128, speculative=speculative,
                                 tokenizer_file=os.path.join(tiny_tok_dir, "tokenizer.json"))
    url = bench_serve.local_server(s)
    max_tokens = 72
    bench_tools.main(url, None, tiny_tok_dir, [2], [30], 1, max_tokens, 11, 1000, 0, chars, True)
    out = capsys.readouterr().out.strip().splitlines()
    rows = json.loads(out[-1])
    assert [(r["kind"], r["clients"], r["requests"]) for r in rows] == [("plain", 2, 2), ("tools", 2, 2)]
    for r in rows:
        assert r["decode_tok_s"] > 0 and r["stream_tok_s_p50"] > 0 and r["prompt_tokens_mean"] > 30, r
        if r["kind"] == "plain":
            assert r["finish"] == {"length": r["requests"]} and r["completion_tokens_mean"] == max_tokens, r
            assert r["calls"] == [], r
            continue
        closed = r["finish"].get("tool_calls", 0)
        assert closed + r["finish"].get("length", 0) == r["requests"], r
        assert len(r["calls"]) == closed and r["completion_tokens_mean"] <= max_tokens, r
        for name, args in r["calls"]:
            text = json.loads(args)["text"]
            assert name == "write_note" and isinstance(text, str) and "<" not in text, r["calls"]
            assert len(text) == chars or not chars, r["calls"]
        if chars:
            assert closed == r["requests"] and r["completion_tokens_mean"] < max_tokens, r
        assert r["ratio"]["stream"] > 0 and r["ratio"]["aggregate"] > 0, r["ratio"]
    text = "\n".join(out[:-1])
    assert sum(x.startswith("plain ") for x in out) == 1 and sum(x.startswith("tools ") for x in out) == 1, text
    assert text.count("tools / plain decode tok/s:") == 1 and "target >= 95%" in text, text


def test_local_tokenizer_writes_steps_chat_template_beside_a_given_tokenizer(tiny_tok_dir, tmp_path):
    """--local's tokenizer directory: a tokenizer.json given there is used, a chat template of Step's form written
    beside it (tools render, the markers are single tokens), and the chat markers checked against the logits window."""
    import shutil

    from tools import bench_serve
    shutil.copyfile(os.path.join(tiny_tok_dir, "tokenizer.json"), tmp_path / "tokenizer.json")
    tok = bench_serve.local_tokenizer(str(tmp_path))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=tools, tokenize=False,
                                   add_generation_prompt=True)
    assert text.startswith("<s><|im_start|>system\n# Tools") and text.endswith("<|im_start|>assistant\n<think>\n")
    assert '"name": "f"' in text
    ids = tok("<tool_call></tool_call><think></think>", add_special_tokens=False)["input_ids"]
    assert len(ids) == 4 and tok.convert_ids_to_tokens(ids) == ["<tool_call>", "</tool_call>", "<think>", "</think>"]
    bench_serve.check_window(tok, max(ids) + 1)
    with pytest.raises(SystemExit, match="logits window"):
        bench_serve.check_window(tok, max(ids))
