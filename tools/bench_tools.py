"""bench_serve --tools: decode tok/s of streamed tool-calling chat requests beside plain streamed chat ones, through
the server as a client sees it (issue 56's Measure: the tool-calling rate >= 95% of the plain one).

Each (clients, prompt length) cell runs twice, the same load of `clients` streaming clients each sending --requests
chat requests one after the other, every request a fresh user message of about `prompt` tokens after the same tool:
- plain: tool_choice "none" (the tools rendered, nothing forced or parsed), ignore_eos: max_tokens tokens each;
- tools: tool_choice "required", parallel_tool_calls false: the grammar forces one call of the tool, whose one
  string parameter is free text by default, the grammar a real tool's text parameter gets (raw text without '<',
  closed only by "\n</parameter>": with random weights over a real-sized vocabulary a call seldom closes and runs to
  max_tokens, finishing "length"), or exactly --call-chars N characters (a counted repetition, whose masks cost more:
  a call of a few hundred characters closes, finishes "tool_calls" and streams its deltas). The rows say how many
  calls closed and the mean tokens of each kind.
Both send the same prompt (the tools in the system turn either way). Tools requests ask thinking_token_budget 0 (the
call starts at once: random weights would reason forever); plain ones ask no budget, as a plain chat does (they
reason for their max_tokens), so the rates differ by the whole tool path: the budget and the grammar's masks (the
choose graph after each forward), the call parser, the call's deltas.

How tok/s is counted: a tool call's deltas carry it whole at </tool_call>, so its text cannot time the tokens.
Both kinds ask return_token_ids, which puts each engine step's ids on a chunk of its own (plain requests get a chunk
per step anyway), and a token's time is its chunk's arrival; the count is usage.completion_tokens
(stream_options.include_usage), checked equal to the ids the chunks carried. A stream's decode tok/s is (tokens - 1)
/ (last token's time - first token's time); the cell's "decode tok/s" is every token after each request's first over
the cell's wall time, as bench_serve's other rows. The ratio printed is tools / plain of the streams' median decode
tok/s (batch 1: the decode rate one agent sees) and of the cell's aggregate.
"""
import asyncio
import collections
import json
import random
import time

import httpx

from tools.bench_stream import HEADER, closed_loop, events, line, summary

KINDS = ("plain", "tools")
TARGET = 0.95  # issue 56: tool-calling decode tok/s at least this share of plain's


def tool(chars: int) -> dict:
    """The benchmark's tool: one required string parameter, free text (chars 0) or exactly `chars` characters."""
    text = {"type": "string", **({"minLength": chars, "maxLength": chars} if chars else {})}
    return {"type": "function", "function": {
        "name": "write_note", "description": "Write a note of the given text.",
        "parameters": {"type": "object", "properties": {"text": text}, "required": ["text"]}}}


def body(kind: str, text: str, max_tokens: int, chars: int) -> dict:
    """One streamed chat request of `kind` (KINDS) over a user message `text`."""
    b = {"messages": [{"role": "user", "content": text}], "tools": [tool(chars)], "max_tokens": max_tokens,
         "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    if kind == "plain":
        return {**b, "tool_choice": "none", "ignore_eos": True}
    return {**b, "tool_choice": "required", "parallel_tool_calls": False, "thinking_token_budget": 0}


def prompt_text(tok, n: int, lo: int, hi: int, rng: random.Random) -> str:
    """A user message of about n tokens: random ids of [lo, hi) as text (special tokens left out), cut to n tokens
    once re-tokenized."""
    text = tok.decode([rng.randrange(lo, hi) for _ in range(n)], skip_special_tokens=True)
    return tok.decode(tok(text, add_special_tokens=False)["input_ids"][:n], skip_special_tokens=True)


async def one(client: httpx.AsyncClient, url: str, b: dict) -> dict:
    """A streamed chat request -> its token arrival times (seconds after it was sent), usage, finish reason and the
    calls its deltas assemble to (name -> arguments text)."""
    t0 = time.perf_counter()
    times, usage, finish, calls = [], None, None, {}
    async for doc in events(client, url + "/v1/chat/completions", b):
        usage = doc.get("usage") or usage
        for c in doc["choices"]:
            times += [time.perf_counter() - t0] * len(c.get("token_ids") or [])
            finish = c.get("finish_reason") or finish
            for d in c["delta"].get("tool_calls") or []:
                f = d.get("function", {})
                k = calls.setdefault(d["index"], [None, ""])
                k[0] = f.get("name") or k[0]
                k[1] += f.get("arguments") or ""
    if usage is None or usage["completion_tokens"] != len(times):
        raise SystemExit(f"error: the stream carried {len(times)} token ids but its usage says "
                         f"{usage and usage['completion_tokens']} completion tokens")
    return {"times": times, "prompt_tokens": usage["prompt_tokens"], "finish": finish,
            "calls": [tuple(v) for _, v in sorted(calls.items())]}


async def cell(url: str, key: str | None, kind: str, clients: int, n_prompt: int, requests: int, max_tokens: int,
               chars: int, texts: list) -> dict:
    """One kind's run of a cell: bench_stream.summary's figures, with the finish reasons, the calls made and the
    prompts' mean length as the server counted them."""
    async def send(client, c, i):  # client c's requests: texts[c], texts[c + clients], ...
        return await one(client, url, body(kind, texts[c + i * clients], max_tokens, chars))
    runs, wall = await closed_loop(key, clients, requests, send)
    return {**summary(runs, clients, n_prompt, wall), "kind": kind,
            "finish": dict(collections.Counter(r["finish"] for r in runs)),
            "calls": [c for r in runs for c in r["calls"]],
            "completion_tokens_mean": sum(len(r["times"]) for r in runs) / len(runs),
            "prompt_tokens_mean": sum(r["prompt_tokens"] for r in runs) / len(runs)}


def ratio(tools: dict, plain: dict) -> dict:
    """tools / plain of the streams' median decode tok/s and of the cell's aggregate."""
    return {"stream": tools["stream_tok_s_p50"] / plain["stream_tok_s_p50"],
            "aggregate": tools["decode_tok_s"] / plain["decode_tok_s"]}


def main(url: str, key: str | None, tokenizer: str, clients: list, prompt_tokens: list, requests: int,
         max_tokens: int, lo: int, hi: int, seed: int, chars: int, as_json: bool):
    """The cells, plain then tools, each cell's rows followed by the ratio. tokenizer: a directory holding the served
    checkpoint's tokenizer (the prompts' text is made with it)."""
    import runtime as R
    tok = R.load_tokenizer(tokenizer)
    rng = random.Random(seed)
    for kind in KINDS:  # warm-up: the first request of each kind (the tool grammar's compile among them)
        asyncio.run(cell(url, key, kind, 1, 16, 1, 8, chars, [prompt_text(tok, 16, lo, hi, rng)]))
    print(HEADER + "   completion / prompt tokens (mean), finish reasons")
    rows = []
    for n in prompt_tokens:
        for c in clients:
            texts = [prompt_text(tok, n, lo, hi, rng) for _ in range(c * requests)]
            got = {k: asyncio.run(cell(url, key, k, c, n, requests, max_tokens, chars, texts)) for k in KINDS}
            q = ratio(got["tools"], got["plain"])
            rows += [{**got[k], "ratio": q} if k == "tools" else got[k] for k in KINDS]
            for k in KINDS:
                r = got[k]
                print(f"{line(k, r)}   {r['completion_tokens_mean']:.0f} / {r['prompt_tokens_mean']:.0f}, "
                      + ", ".join(f"{f} {m}" for f, m in sorted(r["finish"].items())), flush=True)
            print(f"{'':9s} tools / plain decode tok/s: {q['stream']:.1%} per stream (median), {q['aggregate']:.1%} "
                  f"aggregate; target >= {TARGET:.0%}: {'met' if q['stream'] >= TARGET else 'NOT met'}", flush=True)
    if as_json:
        print(json.dumps(rows))
