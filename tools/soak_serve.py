"""Soak a running serve.py with legal, malicious and disconnecting clients at once, for a few minutes: every request
must be answered or cleanly refused (the status and code its kind expects), the ranks' memory must stay flat, and
the server's log must hold no traceback.

    torchrun --standalone --nproc-per-node=2 serve.py --tp-dir OUT/tp2 --port 8000 --max-context 1024 \\
        --max-connections 64 2> rank0.err &
    python -m tools.soak_serve --url http://127.0.0.1:8000 --seconds 180 --launcher $! --log rank0.err

Each of --clients threads loops over kinds drawn at random (KINDS): legal requests (chat, a completion of a list of
prompts, streams, an image, the GET endpoints; 503 overloaded counts as a clean refusal, counted apart when it came
at the connection cap: a fresh connection closed for a newer one), malicious ones (a text of megabytes, an id list
past the body limit, broken and deeply nested JSON, refused fields, a wrong key, a body past 32 MiB, a flood of idle
sockets, headers sent a byte a second), and clients that go away (a stream dropped, an upload cut, a reset while the
answer is made). One more thread sends a body that stalls (the server answers 408). Prints one line per kind
(outcomes counted), the RSS and open descriptors of every rank before, every 30 s and after (--launcher: torchrun's
pid, whose children are the ranks; or --pids), the traceback lines of --log, and a JSON document; exits 1 when a
request got an outcome its kind does not expect, or the log holds a traceback.
"""
import argparse
import base64
import collections
import io
import json
import os
import random
import socket
import struct
import threading
import time

import httpx

TIMEOUT_S = 120  # any one request
IDS = (11, 1000)  # token ids of legal prompts: clear of the tiny checkpoint's special ids, inside any vocabulary


def png(seed: int) -> str:
    """A small random PNG as a data: URL."""
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (40, 60, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class Soak:
    def __init__(self, url: str, key: str | None, rng: random.Random):
        self.url, self.key, self.rng = url, key, rng
        self.host, self.port = url.removeprefix("http://").split(":")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.outcomes = collections.defaultdict(collections.Counter)  # kind -> outcome -> count
        self.unexpected = []  # (kind, outcome, detail)
        self.lock = threading.Lock()

    def note(self, kind: str, outcome: str, ok: bool, detail: str = ""):
        with self.lock:
            self.outcomes[kind][outcome] += 1
            if not ok:
                self.unexpected.append((kind, outcome, detail[:300]))

    def post(self, path: str, body, **kw) -> httpx.Response:
        data = body if isinstance(body, bytes) else json.dumps(body, ensure_ascii=False).encode()
        return httpx.post(self.url + path, content=data, timeout=TIMEOUT_S,
                          headers={"Content-Type": "application/json", **self.headers, **kw.pop("headers", {})})

    def expect(self, kind: str, r: httpx.Response, status: int, code: str | None = None):
        """The answer its kind expects, or a clean refusal under load (503 overloaded)."""
        err = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") else {}
        got = f"{r.status_code} {err.get('code') or ''}".strip()
        if r.status_code == 503 and err.get("code") == "overloaded" and int(r.headers.get("retry-after", 0)) >= 1:
            at_cap = "--max-connections" in err.get("message", "")  # turned away at accept, not by the queue
            return self.note(kind, got + (" at the connection cap" if at_cap else ""), True)
        self.note(kind, got, r.status_code == status and (code is None or err.get("code") == code), r.text)

    def sock(self, head: bytes = b"", body: bytes = b"") -> socket.socket:
        s = socket.create_connection((self.host, int(self.port)), timeout=TIMEOUT_S)
        if head:
            auth = f"\r\nAuthorization: Bearer {self.key}\r\n\r\n".encode() if self.key else b"\r\n\r\n"
            s.sendall(head.replace(b"\r\n\r\n", auth, 1) + body)
        return s

    def prompt(self, n: int) -> list:
        return [self.rng.randrange(*IDS) for _ in range(n)]

    # ---- legal
    def chat(self):
        r = self.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a prime number."}],
                                               "max_tokens": self.rng.randrange(1, 9), "temperature": 0})
        self.expect("chat", r, 200)

    def completions(self):
        r = self.post("/v1/completions", {"prompt": [self.prompt(self.rng.randrange(2, 40)) for _ in range(2)],
                                          "max_tokens": 4, "ignore_eos": True})
        self.expect("completions (2 prompts)", r, 200)

    def stream(self):
        body = {"prompt": self.prompt(self.rng.randrange(2, 60)), "max_tokens": 8, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", self.url + "/v1/completions", json=body, headers=self.headers,
                          timeout=TIMEOUT_S) as r:
            if r.status_code != 200:
                r.read()
                return self.expect("stream", r, 200)
            lines = [x for x in r.iter_lines() if x]
        done = lines[-1:] == ["data: [DONE]"]
        self.note("stream", "200 [DONE]" if done else "200 cut", done, str(lines[-2:]))

    def image(self):
        msg = [{"type": "image_url", "image_url": {"url": png(self.rng.randrange(1000))}},
               {"type": "text", "text": "What is in this picture?"}]
        r = self.post("/v1/chat/completions", {"messages": [{"role": "user", "content": msg}], "max_tokens": 2})
        self.expect("image", r, 200)

    def gets(self):
        for path in ("/health", "/v1/models", "/metrics"):
            r = httpx.get(self.url + path, headers=self.headers, timeout=TIMEOUT_S)
            self.expect("GET endpoints", r, 200)

    # ---- malicious
    def huge_text(self):
        r = self.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "tensor 张量 " * 1_200_000}]})
        self.expect("text of 17 MB", r, 400, "context_length_exceeded")

    def huge_ids(self):
        r = self.post("/v1/completions", b'{"prompt": [' + b"11," * 12_000_000 + b"11]}")
        self.expect("ids past 32 MiB", r, 413, "body_too_large")

    def bad_json(self):
        body = self.rng.choice([b"{not json", b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", b"[1, 2]"])
        self.expect("broken JSON", self.post("/v1/completions", body), 400)

    def bad_field(self):
        refused = self.rng.choice([{"n": 0}, {"logprobs": True}, {"temperature": "x"}, {"temperature": -1},
                                   {"max_tokens": 10 ** 9}, {"stop": 5}])
        body = {"prompt": "hi", "max_tokens": 1, **refused}  # one token: a field wrongly taken is answered at once
        self.expect("refused field", self.post("/v1/completions", body), 400)

    def wrong_key(self):
        r = httpx.post(self.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=TIMEOUT_S,
                       headers={"Authorization": "Bearer wrong"})
        self.expect("wrong key", r, 401 if self.key else 200)

    def oversize(self):
        s = self.sock(b"POST /v1/completions HTTP/1.1\r\nHost: s\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 40000000\r\n\r\n")
        got = s.recv(200)
        s.close()
        self.note("Content-Length past 32 MiB", got.split(b"\r\n")[0].decode(errors="replace"),
                  got.startswith(b"HTTP/1.1 413"), repr(got))

    def idle_flood(self):
        socks = []
        try:
            for _ in range(200):
                socks.append(self.sock())
            time.sleep(2)
        except OSError as e:
            return self.note("200 idle sockets", f"client failed: {e.strerror}", False)
        finally:
            for s in socks:
                s.close()
        self.note("200 idle sockets", "held and let go", True)

    def slow_header(self):
        s, t0 = self.sock(), time.monotonic()
        try:
            for c in b"GET /health HTTP/1.1\r\nHost: s\r\nX-Slow: " + b"a" * 100:
                s.sendall(bytes([c]))
                time.sleep(1)
                if time.monotonic() - t0 > 30:
                    return self.note("headers a byte a second", "still open after 30 s", False)
        except OSError:
            return self.note("headers a byte a second", "closed by the server", True)
        finally:
            s.close()
        self.note("headers a byte a second", "sent in full", False)

    def slow_body(self):
        s = self.sock(b"POST /v1/completions HTTP/1.1\r\nHost: s\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n", b'{"prompt": "')
        got = s.recv(200)
        s.close()
        self.note("a body that stalls", got.split(b"\r\n")[0].decode(errors="replace"), got.startswith(b"HTTP/1.1 408"),
                  repr(got))

    # ---- going away
    def drop_stream(self):
        body = {"prompt": self.prompt(5), "max_tokens": 200, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", self.url + "/v1/completions", json=body, headers=self.headers,
                          timeout=TIMEOUT_S) as r:
            if r.status_code != 200:
                r.read()
                return self.expect("stream dropped", r, 200)
            next(iter(r.iter_lines()))
        self.note("stream dropped", "dropped", True)

    def drop_upload(self):
        s = self.sock(b"POST /v1/chat/completions HTTP/1.1\r\nHost: s\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 5000000\r\n\r\n", b'{"messages": [{"role": "user", "content": "' + b"a" * 50000)
        s.close()
        self.note("upload cut", "dropped", True)

    def reset_answer(self):
        body = json.dumps({"prompt": self.prompt(5), "max_tokens": 200, "ignore_eos": True}).encode()
        s = self.sock(b"POST /v1/completions HTTP/1.1\r\nHost: s\r\nContent-Type: application/json\r\n"
                      b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n", body)
        time.sleep(0.3)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
        self.note("reset while answered", "dropped", True)


# kind -> weight: legal requests most of the time
KINDS = {"chat": 6, "completions": 4, "stream": 6, "image": 2, "gets": 2, "huge_text": 1, "huge_ids": 1,
         "bad_json": 2, "bad_field": 2, "wrong_key": 1, "oversize": 1, "idle_flood": 1, "slow_header": 1,
         "drop_stream": 2, "drop_upload": 2, "reset_answer": 2}


def rss_mib(pids: list) -> list:
    out = []
    for p in pids:
        with open(f"/proc/{p}/status") as f:
            out.append(round(int(next(x for x in f if x.startswith("VmRSS:")).split()[1]) / 1024))
    return out


def fds(pids: list) -> list:
    """Every rank's open file descriptors (connections among them)."""
    return [len(os.listdir(f"/proc/{p}/fd")) for p in pids]


def ranks(launcher: int) -> list:
    with open(f"/proc/{launcher}/task/{launcher}/children") as f:
        return sorted(int(x) for x in f.read().split())


def main(url: str, key: str | None, seconds: float, clients: int, pids: list, log: str | None, seed: int) -> int:
    soak = Soak(url, key, random.Random(seed))
    before, fds_before = rss_mib(pids), fds(pids)
    end = time.monotonic() + seconds
    kinds, weights = list(KINDS), list(KINDS.values())

    def client(i: int):
        rng = random.Random(seed * 1000 + i)
        while time.monotonic() < end:
            kind = rng.choices(kinds, weights)[0]
            try:
                getattr(soak, kind)()
            except (httpx.HTTPError, OSError, ValueError) as e:  # a legal request must never meet these
                soak.note(kind, f"client error: {type(e).__name__}", False, str(e))

    def staller():
        while time.monotonic() < end - 35:
            soak.slow_body()
    timeline = []

    def sample():  # every rank's RSS and descriptors every 30 s: growth that levels off (native caches by shape) or not
        while time.monotonic() < end:
            time.sleep(min(30, max(end - time.monotonic(), 0)))
            timeline.append((rss_mib(pids), fds(pids)))
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)] + [
        threading.Thread(target=staller), threading.Thread(target=sample, daemon=True)]
    for t in threads:
        t.start()
    for t in threads[:-1]:
        t.join()
    time.sleep(12)  # the server's sweep lets go of what the last clients left (HEADER_TIMEOUT_S)
    after, fds_after = rss_mib(pids), fds(pids)
    traces = [x for x in open(log).read().splitlines() if "Traceback" in x] if log else []
    for kind in sorted(soak.outcomes):
        print(f"{kind:28s} " + ", ".join(f"{o}: {n}" for o, n in soak.outcomes[kind].most_common()))
    total = sum(sum(c.values()) for c in soak.outcomes.values())
    print(f"{total} requests in {seconds:.0f} s from {clients} clients; unexpected outcomes: {len(soak.unexpected)}; "
          f"RSS MiB per rank before {before}, after {after}; descriptors per rank before {fds_before}, after "
          f"{fds_after}; traceback lines in the log: " + (str(len(traces)) if log else "(no --log)"))
    print(f"every 30 s, per rank: RSS MiB {[t[0] for t in timeline]}, descriptors {[t[1] for t in timeline]}")
    for u in soak.unexpected[:20]:
        print("unexpected:", u)
    print(json.dumps({"requests": total, "outcomes": {k: dict(v) for k, v in soak.outcomes.items()},
                      "unexpected": len(soak.unexpected), "rss_mib_before": before, "rss_mib_after": after,
                      "rss_mib_every_30_s": [t[0] for t in timeline], "fds_before": fds_before,
                      "fds_after": fds_after, "fds_every_30_s": [t[1] for t in timeline],
                      "tracebacks": len(traces) if log else None}))
    return 1 if soak.unexpected or traces else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m tools.soak_serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=os.environ.get("STEP5_API_KEY"))
    ap.add_argument("--seconds", type=float, default=180)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--launcher", type=int, help="torchrun's pid: its children are the ranks whose RSS is read")
    ap.add_argument("--pids", type=int, nargs="*", default=[], help="the ranks' pids (instead of --launcher)")
    ap.add_argument("--log", help="rank 0's stderr, searched for tracebacks")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    raise SystemExit(main(a.url, a.api_key, a.seconds, a.clients, ranks(a.launcher) if a.launcher else a.pids,
                          a.log, a.seed))
