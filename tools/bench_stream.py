"""What a streaming client of the server measures, shared by tools.bench_serve (completions) and tools.bench_tools
(chat, plain and tool-calling): the server-sent events of one request, a cell's figures from each request's token
arrival times, and the printed row."""
import asyncio
import json
import statistics
import time

import httpx


def pct(xs: list, p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


async def events(client: httpx.AsyncClient, url: str, body: dict):
    """The JSON documents of a streamed request's server-sent events; a refusal or an error event ends the bench."""
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"error: {r.status_code} {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            doc = json.loads(line[6:])
            if "error" in doc:
                raise SystemExit(f"error: {doc['error']['message']}")
            yield doc


async def closed_loop(key: str | None, clients: int, requests: int, send) -> tuple[list, float]:
    """`clients` clients at once, each sending `requests` requests one after the other: await send(client, c, i) makes
    client c's i-th request and returns its run -> (every run, the wall seconds of them all)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    limits = httpx.Limits(max_connections=clients + 1)
    async with httpx.AsyncClient(headers=headers, timeout=None, limits=limits) as client:
        async def worker(c):
            return [await send(client, c, i) for i in range(requests)]
        t0 = time.perf_counter()
        runs = [r for w in await asyncio.gather(*[worker(c) for c in range(clients)]) for r in w]
        return runs, time.perf_counter() - t0


def summary(runs: list, clients: int, n_prompt: int, wall: float) -> dict:
    """A cell's figures from each request's token times (seconds after it was sent)."""
    ttft = [r["times"][0] for r in runs if r["times"]]
    decoded = sum(max(len(r["times"]) - 1, 0) for r in runs)
    streams = [(len(r["times"]) - 1) / (r["times"][-1] - r["times"][0]) for r in runs if len(r["times"]) > 1
               and r["times"][-1] > r["times"][0]]
    gaps = [b - a for r in runs for a, b in zip(r["times"], r["times"][1:])]
    return {"clients": clients, "prompt_tokens": n_prompt, "requests": len(runs), "wall_s": wall,
            "ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p99_ms": 1e3 * pct(ttft, 99), "decode_tok_s": decoded / wall,
            "stream_tok_s_p50": statistics.median(streams) if streams else float("nan"),
            "gap_p50_ms": 1e3 * pct(gaps, 50), "gap_p99_ms": 1e3 * pct(gaps, 99)}


HEADER = (f"{'':9s} {'clients':>7} {'prompt':>7} {'reqs':>5} {'TTFT p50':>9} {'p99 ms':>8} {'decode tok/s':>13} "
          f"{'stream tok/s':>13} {'gap p50':>8} {'p99 ms':>7}")


def line(kind: str, r: dict) -> str:
    return (f"{kind:9s} {r['clients']:>7} {r['prompt_tokens']:>7} {r['requests']:>5} {r['ttft_p50_ms']:>9.0f} "
            f"{r['ttft_p99_ms']:>8.0f} {r['decode_tok_s']:>13.1f} {r['stream_tok_s_p50']:>13.1f} "
            f"{r['gap_p50_ms']:>8.1f} {r['gap_p99_ms']:>7.1f}")
