"""Load a running serve.py with concurrent streaming clients: TTFT and decode speed as clients see them.

    torchrun --standalone --nproc-per-node=8 serve.py --tp-dir /data/step5-shards/tp8 --max-batch 16 &
    python -m tools.bench_serve --url http://127.0.0.1:8000 --clients 1 4 16 --prompt-tokens 1024 8192 --max-tokens 256

Each (clients, prompt length) cell runs `clients` streaming clients at once, each sending --requests requests one
after the other: /v1/completions with a prompt of random token ids (a fresh prompt per request, so no prefix is reused),
ignore_eos and max_tokens, so every request decodes exactly max_tokens tokens. Per cell: TTFT p50 / p99 (request
sent -> first token), aggregate decode tok/s (every token after each request's first, over the cell's wall time), the
median stream's decode tok/s, and inter-token gaps p50 / p99. One request first warms the server up.

    python -m tools.bench_serve --local --clients 1 4 16 --prompt-tokens 1024 8192     # one GPU, no shards needed
    python -m tools.bench_serve --local --max-batch 1 --clients 1 --prompt-tokens 1024 --max-tokens 128 --tools
    python -m tools.bench_serve --local --max-batch 1 --clients 1 --prompt-tokens 1024 --max-tokens 128 --tools \
        --speculative 2

--local serves one whole TP=EP=8 rank of random FP8 weights (tools.rank's build, with --speculative K its first K MTP
layers) on this process's GPU through serve.py's own HTTP side and engine loop, and measures it the same way from a
client process of its own (clients never share the server's interpreter). Its tokenizer (local_tokenizer, kept in
--tokenizer DIR) is a byte-level BPE of the model's whole vocabulary with the checkpoint's specials and Step's chat
markers first, inside the rank's logits window, and a chat template of Step's form, so chat requests with tools,
tool_choice and thinking_token_budget work there; constrained requests get the engine's grammars over it. Before the
server, the completions mode runs each cell's load through the engine alone (no HTTP, the same closed loop of
clients) and prints it beside the server's figures: what the server adds to the engine.

--tools (tools.bench_tools) runs each cell as streamed chat requests twice, plain and tool-calling (tool_choice
"required", the call forced by the grammar), and prints the tool-calling decode tok/s beside plain's with their ratio
(issue 56's target: >= 95%). Against --url it needs --tokenizer, the served checkpoint's tokenizer directory.
"""
import argparse
import asyncio
import json
import os
import random
import time

import httpx

from tools.bench_stream import HEADER, closed_loop, events, line, summary


async def one(client: httpx.AsyncClient, url: str, prompt: list, max_tokens: int) -> dict:
    """A streaming request -> its token arrival times (seconds after it was sent)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "return_token_ids": True}
    t0 = time.perf_counter()
    times = []
    async for doc in events(client, url + "/v1/completions", body):
        n = len(doc["choices"][0].get("token_ids") or []) if doc["choices"] else 0
        times += [time.perf_counter() - t0] * n
    return {"times": times}


async def cell(url: str, key: str | None, clients: int, n_prompt: int, requests: int, max_tokens: int,
               lo: int, hi: int, rng: random.Random) -> dict:
    async def send(client, c, i):
        return await one(client, url, [rng.randrange(lo, hi) for _ in range(n_prompt)], max_tokens)
    runs, wall = await closed_loop(key, clients, requests, send)
    return summary(runs, clients, n_prompt, wall)


def word_tokenizer(n: int):
    """A tokenizer of n word-level tokens "<i>" (decoding needs one; the random rank has none)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    t = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(n)}, unk_token="<0>"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<0>")


def local_tokenizer(tok_dir: str):
    """--local's tokenizer, kept in tok_dir: its tokenizer.json, else a byte-level BPE of the whole vocabulary trained
    into it (tools.bench_grammar's: the checkpoint's specials and Step's six chat markers as ids 0-16), and its
    tokenizer_config.json, else one written with the chat template of Step's form (tiny_checkpoint.CHAT_TEMPLATE, the
    test checkpoints' own). -> the tokenizer, loaded as serve.py loads one."""
    import runtime as R
    import tiny_checkpoint
    from tools.bench_grammar import train_tokenizer
    os.makedirs(tok_dir, exist_ok=True)
    path, conf = os.path.join(tok_dir, "tokenizer.json"), os.path.join(tok_dir, "tokenizer_config.json")
    if not os.path.isfile(path):
        t0 = time.perf_counter()
        train_tokenizer(path)
        print(f"trained a byte-level BPE for --local in {time.perf_counter() - t0:.0f} s -> {path}", flush=True)
    if not os.path.isfile(conf):
        with open(conf, "w") as f:
            json.dump({"bos_token": "<s>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                       "chat_template": tiny_checkpoint.CHAT_TEMPLATE}, f)
    return R.load_tokenizer(tok_dir)


def check_window(tok, window: int):
    """SystemExit unless the chat markers' ids lie inside the rank's logits window [0, window): the model could not
    write them else."""
    import chat
    import tool_calls
    for ids in (chat.think_ids(tok), tool_calls.call_ids(tok)):
        if ids is None or max(ids) >= window:
            raise SystemExit(f"error: the tokenizer's chat markers are {ids}, not ids inside the rank's logits window "
                             f"[0, {window})")


def local_engine(model, tok, max_batch: int, max_context: int | None, prefill_chunk: int,
                 build_threads: int | None = None, speculative: int = 0, tokenizer_file: str | None = None,
                 prefill_layers_per_step: int | None = None):
    """serve.py's session around `model` in this process (one rank, world 1), its engine started; speculative: MTP
    drafts per step (the model keeps that many MTP layers); tokenizer_file: `tok`'s tokenizer.json, for the engine's
    grammars (constrained requests, tool_choice "required"; None: such requests are refused); prefill_layers_per_step:
    the engine's (None: its default)."""
    import engine as E
    import grammar
    import runtime as R
    dev = next(model.parameters()).device
    layers = E.PREFILL_LAYERS_PER_STEP if prefill_layers_per_step is None else prefill_layers_per_step
    flags = R.EngineFlags("(local)", max_batch=max_batch, max_context=max_context, prefill_chunk=prefill_chunk,
                          speculative=speculative, prefill_layers_per_step=layers)
    s = R.Session(flags, 0, 1, dev, model.cfg, None, tok, sorted(model.cfg.eos_token_id), model=model)
    g = None
    if tokenizer_file is not None:
        g = grammar.Grammars(tokenizer_file, model.cfg.vocab_size, s.eos[0])
        g.view()  # built now, not on the engine loop at the first constrained request
    s.eng = E.Engine(model, E.EngineConfig(max_batch, max_context, prefill_chunk, speculative,
                                           build_threads=build_threads, prefill_layers_per_step=layers), print,
                     grammars=g)
    s.eng.start()
    return s


def local_server(s) -> str:
    """serve.py's HTTP side on a free loopback port and its engine loop in a daemon thread, as serve.py runs them,
    around a local_engine session. -> the server's URL."""
    import socket
    import threading

    import torch

    import runtime as R
    import serve as S
    sock = socket.create_server(("127.0.0.1", 0))
    hub, _, _ = S.start_http(s, S.Options(port=0), sock)

    def loop():
        with torch.inference_mode():
            S.engine_loop(R.Driver(s), hub, [0.0])
    threading.Thread(target=loop, daemon=True, name="engine").start()
    return f"http://127.0.0.1:{sock.getsockname()[1]}"


def engine_cell(eng, clients: int, n_prompt: int, requests: int, max_tokens: int, lo: int, hi: int,
                rng: random.Random) -> dict:
    """The same load as `cell`, through the engine in this thread without HTTP: `clients` requests in flight, each
    client sending its next when one ends; token times as the host reads them (the server's own floor)."""
    import engine as E
    left = [requests] * clients
    sent, times, owner = {}, {}, {}

    def send(c):
        r = eng.submit(E.Request([rng.randrange(lo, hi) for _ in range(n_prompt)], max_tokens))
        left[c] -= 1
        sent[r.rid], times[r.rid], owner[r.rid] = time.perf_counter(), [], c
    t0 = time.perf_counter()
    for c in range(clients):
        send(c)
    while eng.busy():
        out = eng.step()
        now = time.perf_counter()
        for r, ids in out.tokens:
            times[r.rid] += [now - sent[r.rid]] * len(ids)
        for r in out.finished:
            if left[owner[r.rid]]:
                send(owner[r.rid])
    return summary([{"times": t} for t in times.values()], clients, n_prompt, time.perf_counter() - t0)


def main(url: str, key: str | None, clients: list, prompt_tokens: list, requests: int, max_tokens: int, lo: int,
         hi: int, seed: int, as_json: bool, direct: dict | None = None):
    """The HTTP cells; `direct` ((clients, prompt) -> the engine_cell of the same load): printed beside them with
    the server's share of the engine's decode rate."""
    rng = random.Random(seed)
    asyncio.run(cell(url, key, 1, 16, 1, 4, lo, hi, rng))  # warm-up
    print(HEADER)
    rows = []
    for n in prompt_tokens:
        for c in clients:
            r = asyncio.run(cell(url, key, c, n, requests, max_tokens, lo, hi, rng))
            rows.append(r)
            e = (direct or {}).get((c, n))
            print((line("engine", e) + "\n" if e else "") + line("server", r)
                  + (f"   = {r['decode_tok_s'] / e['decode_tok_s']:.1%} of the engine's decode tok/s" if e else ""),
                  flush=True)
    if as_json:
        print(json.dumps(rows))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m tools.bench_serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=os.environ.get("STEP5_API_KEY"))
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--requests", type=int, default=4, help="requests per client, one after the other")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--ids", type=int, nargs=2, default=[1000, 100000], metavar=("LO", "HI"),
                    help="prompt ids are drawn from [LO, HI): clear of special and image ids, inside the vocabulary "
                    "(the tiny test checkpoint: 11 1000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", dest="as_json", action="store_true", help="also print the rows as one JSON document")
    ap.add_argument("--tools", action="store_true", help="streamed chat, plain and tool-calling (tools.bench_tools)")
    ap.add_argument("--call-chars", type=int, default=0, metavar="N",
                    help="--tools: the forced call's one string parameter is exactly N characters (default: free "
                    "text, closed where the model closes it)")
    ap.add_argument("--tokenizer", default=None, metavar="DIR",
                    help="--tools against --url: the served checkpoint's tokenizer directory; --local: the local "
                    "server's (default $TMPDIR/bench_serve_tokenizer; a tokenizer.json is trained into it when it "
                    "has none, a tokenizer_config.json with Step's chat template written when it has none)")
    ap.add_argument("--local", action="store_true", help="serve a random whole rank on this GPU instead of --url")
    ap.add_argument("--max-batch", type=int, default=16, help="--local: the engine's slots")
    ap.add_argument("--max-context", type=int, default=None, help="--local: positions per slot (default: what fits)")
    ap.add_argument("--prefill-chunk", type=int, default=None, help="--local: default serve.py's")
    ap.add_argument("--build-threads", type=int, default=None, help="--local: start-up's parallel kernel builds")
    ap.add_argument("--speculative", type=int, default=0, help="--local: MTP drafts per decode step (1-3)")
    ap.add_argument("--prefill-layers-per-step", type=int, default=None,
                    help="--local: a prefill pass's layers per step while streams decode (default serve.py's; 0: whole "
                    "passes)")
    ap.add_argument("--graph-busy", type=int, default=None, metavar="N",
                    help="--local: while streams decode, fresh prompts replay prefill graphs up to N padded tokens "
                    "(engine.GRAPH_BUSY, set in this process for the measurement)")
    a = ap.parse_args()
    if a.prefill_chunk is None:
        from serve import PREFILL_CHUNK
        a.prefill_chunk = PREFILL_CHUNK
    if a.call_chars < 0:
        raise SystemExit(f"error: --call-chars {a.call_chars} must be >= 0 (0: free text)")
    if a.tools and not a.local and a.tokenizer is None:
        raise SystemExit("error: --tools against --url needs --tokenizer, the served checkpoint's tokenizer directory")
    direct = None
    if a.local:
        import torch

        import engine as E
        from tools.rank import build
        if a.graph_busy is not None:
            E.GRAPH_BUSY = a.graph_busy
        a.tokenizer = a.tokenizer or os.path.join(os.environ.get("TMPDIR", "/tmp"), "bench_serve_tokenizer")
        tok = local_tokenizer(a.tokenizer)
        m = build(mtp=a.speculative)
        check_window(tok, m.cfg.vocab_size // m.cfg.tp_size)
        s = local_engine(m, tok, a.max_batch, a.max_context, a.prefill_chunk, a.build_threads, a.speculative,
                         os.path.join(a.tokenizer, "tokenizer.json"), a.prefill_layers_per_step)
        if not a.tools:
            rng, direct = random.Random(a.seed + 1), {}
            with torch.inference_mode():  # the same load through the engine alone first: what the server adds to it
                for n in a.prompt_tokens:
                    for c in a.clients:
                        direct[c, n] = engine_cell(s.eng, c, n, a.requests, a.max_tokens, a.ids[0], a.ids[1], rng)
        a.url, a.api_key = local_server(s), None
    if a.tools:
        from tools import bench_tools
        target, cells = bench_tools.main, (a.url, a.api_key, a.tokenizer, a.clients, a.prompt_tokens, a.requests,
                                           a.max_tokens, a.ids[0], a.ids[1], a.seed, a.call_chars, a.as_json)
    else:
        target, cells = main, (a.url, a.api_key, a.clients, a.prompt_tokens, a.requests, a.max_tokens, a.ids[0],
                               a.ids[1], a.seed, a.as_json, direct)
    if a.local:  # the clients in a process of their own, as real clients are: not sharing the server's interpreter
        import multiprocessing
        p = multiprocessing.get_context("spawn").Process(target=target, args=cells)
        p.start()
        p.join()
        raise SystemExit(p.exitcode)
    target(*cells)
