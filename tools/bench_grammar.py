"""Constrained decoding at the real vocabulary (128,896 tokens): the grammar library's costs on this host (grammar.py:
the tokenizer view, a compile per schema, the mask per token, memory) and, with --engine, the decode rate of
json_schema requests beside unconstrained ones on one GPU holding one whole TP=EP=8 rank of random weights
(tools.rank's build), against the same batch unconstrained.

    python -m tools.bench_grammar                                   # the host's costs
    python -m tools.bench_grammar --tokenizer OUT/tokenizer_files/tokenizer.json
    python -m tools.bench_grammar --engine --batch 1 16             # decode tok/s, constrained against not
    python -m tools.bench_grammar --engine --batch 1 16 --speculative 2

Without --tokenizer, a byte-level BPE of 128,896 tokens is trained here with `tokenizers` on the Python sources of
the installed packages and Zipf-distributed CJK words (the checkpoint's specials and chat markers first; about a
minute on 2 cores), and kept in --tokenizer-out for the next run. The mask walk follows random paths of each grammar
(each step a token drawn uniformly from those the mask allows, the end taken half the time it is allowed), as a
random-weight model sampling at a high temperature would; strings with patterns cost the most.
"""
import argparse
import glob
import json
import os
import random
import resource
import site
import time

import torch

import grammar as G

V = 128896
EOS = 4
SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "vip", "new"]}, "maxItems": 4}},
        "required": ["name", "age"], "additionalProperties": False},
    "order": {"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
        "items": {"type": "array", "minItems": 1, "maxItems": 5, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "maxLength": 12}, "qty": {"type": "integer", "minimum": 1, "maximum": 99},
            "price": {"type": "number", "minimum": 0, "maximum": 10000}}, "required": ["sku", "qty", "price"],
            "additionalProperties": False}},
        "status": {"enum": ["open", "paid", "shipped", "cancelled"]},
        "notes": {"type": ["string", "null"], "maxLength": 200}},
        "required": ["id", "items", "status"], "additionalProperties": False},
    "tool": {"type": "object", "properties": {
        "name": {"enum": ["get_weather", "search", "book_flight"]},
        "arguments": {"anyOf": [
            {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
             "required": ["city"], "additionalProperties": False},
            {"type": "object", "properties": {"query": {"type": "string"}, "k": {"type": "integer"}},
             "required": ["query"], "additionalProperties": False}]}},
        "required": ["name", "arguments"], "additionalProperties": False},
    "wide60": {"type": "object", "properties": {f"field_{i}": {"type": ["integer", "string", "boolean"]}
                                                for i in range(60)},
               "required": [f"field_{i}" for i in range(0, 60, 3)], "additionalProperties": False},
}
# a long answer for the engine's decode rate: it cannot end within the measured tokens
LONG = {"type": "object", "properties": {"items": {"type": "array", "minItems": 400, "items": {
    "type": "object", "properties": {"k": {"type": "string", "maxLength": 12}, "v": {"type": "integer"}},
    "required": ["k", "v"], "additionalProperties": False}}}, "required": ["items"], "additionalProperties": False}
# one long string with bounds: it cannot end within the measured tokens either
BOUNDED = {"type": "object", "properties": {"text": {"type": "string", "minLength": 3000, "maxLength": 4000}},
           "required": ["text"], "additionalProperties": False}


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def train_tokenizer(path: str):
    """A byte-level BPE of V tokens (module docstring), written to path."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    import tiny_checkpoint
    files = [f for d in site.getsitepackages() for f in glob.glob(os.path.join(d, "**", "*.py"), recursive=True)]
    rng = random.Random(0)
    cjk = [chr(c) for c in range(0x4E00, 0x4E00 + 3000)]
    words = ["".join(rng.choice(cjk) for _ in range(rng.randint(1, 4))) for _ in range(40000)]

    def lines():
        budget = 60 << 20
        for f in sorted(files):
            if budget <= 0:
                break
            try:
                with open(f, errors="replace") as src:
                    text = src.read()
            except OSError:
                continue
            budget -= len(text)
            yield text
        for _ in range(300000):
            yield "".join(words[min(int(rng.paretovariate(1.0)) - 1, len(words) - 1)] for _ in range(8))
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = tiny_checkpoint.SPECIAL_TOKENS + tiny_checkpoint.CHAT_TOKENS
    tok.train_from_iterator(lines(), trainer=trainers.BpeTrainer(
        vocab_size=V, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.save(path)


def walk(grammars: G.Grammars, c: G.Constraint, walks: int, steps: int, rng: random.Random) -> list:
    """Seconds of each mask fill along random paths of the grammar."""
    row = torch.zeros(1, grammars.words, dtype=torch.int32)
    times, compiled = [], grammars.compiled(c)
    for _ in range(walks):
        m = grammars.matcher(compiled, frozenset({EOS}))
        for _ in range(steps):
            t = time.perf_counter()
            assert m.fill(row) is G.Status.OK, m.error
            times.append(time.perf_counter() - t)
            allowed = G.allowed_ids(row[0], V).tolist()
            if EOS in allowed and (rng.random() < 0.5 or len(allowed) == 1):
                break
            m.advance([rng.choice([t for t in allowed if t != EOS])])
    return times


def host_costs(tokenizer: str, walks: int, steps: int):
    r0, t0 = rss_mb(), time.perf_counter()
    grammars = G.Grammars(tokenizer, V, EOS)
    grammars.view()
    print(f"tokenizer view: {time.perf_counter() - t0:.2f} s, +{rss_mb() - r0:.0f} MB RSS", flush=True)
    rng = random.Random(0)
    print(f"{'grammar':>12} {'compile ms':>10} | mask us: {'median':>6} {'p90':>6} {'p99':>6} {'max':>6} {'mean':>6} "
          f"| tokens  RSS MB", flush=True)
    cases = [(k, G.Constraint.json_schema(s)) for k, s in SCHEMAS.items()]
    cases += [("json_object", G.Constraint(G.Kind.JSON_OBJECT)),
              ("regex", G.Constraint(G.Kind.REGEX, r"[0-9]{3}-[a-z]{2,9}"))]
    for name, c in cases:
        t = time.perf_counter()
        grammars.compiled(c)
        tc = time.perf_counter() - t
        ts = sorted(walk(grammars, c, walks, steps, rng))
        q = lambda f: ts[min(int(len(ts) * f), len(ts) - 1)] * 1e6  # noqa: E731
        print(f"{name:>12} {tc * 1e3:10.1f} | {'':9}{q(.5):6.0f} {q(.9):6.0f} {q(.99):6.0f} {ts[-1] * 1e6:6.0f} "
              f"{sum(ts) / len(ts) * 1e6:6.0f} | {len(ts):6d} {rss_mb():7.0f}", flush=True)
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")
    return grammars


def engine_rates(grammars: G.Grammars, batches: list, new: int, speculative: int, prefill_chunk: int | None = None,
                 build_threads: int | None = None):
    """Decode tok/s of B requests: unconstrained, one constrained beside B - 1 unconstrained, all constrained; for a
    long JSON answer and for one long bounded string (a counted lexeme: llguidance walks the whole vocabulary at each
    of its steps), with the host's mask time per step."""
    import engine as E
    from tools.rank import build
    fills = [0, 0.0]
    real = G.Matcher.fill

    def timed(self, rows, drafts=()):
        t = time.perf_counter()
        try:
            return real(self, rows, drafts)
        finally:
            fills[0] += 1
            fills[1] += time.perf_counter() - t
    G.Matcher.fill = timed
    m = build(mtp=speculative)
    with torch.inference_mode():
        eng = E.Engine(m, E.EngineConfig(max(batches), 4096, prefill_chunk=prefill_chunk or E.PREFILL_CHUNK,
                                         speculative=speculative, build_threads=build_threads), print,
                       grammars=grammars)
        eng.start()
        cases = {"json": G.Constraint.json_schema(LONG), "bounded": G.Constraint.json_schema(BOUNDED)}
        for c in cases.values():
            grammars.compile(c)
        g = torch.Generator().manual_seed(0)
        print(f"{'grammar':>8} {'batch':>5} {'constrained':>11} | {'decode tok/s':>12} {'vs none':>7} | host mask ms/step")
        for name, c in cases.items():
            for b in batches:
                base = None
                for k in sorted({0, 1, b}):
                    reqs = [E.Request(torch.randint(11, 100000, (64,), generator=g).tolist(), new,
                                      frozenset({EOS}) if i < k else frozenset(), constraint=c if i < k else None)
                            for i in range(b)]
                    fills[:] = [0, 0.0]
                    torch.cuda.synchronize()
                    eng.run(reqs)
                    torch.cuda.synchronize()
                    t1 = max(r.t_first for r in reqs)
                    dt = time.perf_counter() - t1
                    rate = sum(len(r.out) - 1 for r in reqs) / dt
                    base = base or rate
                    steps = max(len(r.out) for r in reqs)
                    print(f"{name:>8} {b:5d} {k:11d} | {rate:12.1f} {rate / base:7.1%} | "
                          f"{fills[1] * 1e3 / max(steps, 1):.3f}", flush=True)
    G.Matcher.fill = real


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m tools.bench_grammar", description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", help="a tokenizer.json of 128,896 ids (default: one trained here)")
    ap.add_argument("--tokenizer-out", default=os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                            "bench_grammar_bpe128896.json"))
    ap.add_argument("--walks", type=int, default=8, help="random paths per grammar")
    ap.add_argument("--steps", type=int, default=300, help="tokens per path at most")
    ap.add_argument("--engine", action="store_true", help="also the decode rates on this GPU")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--speculative", type=int, default=0)
    ap.add_argument("--prefill-chunk", type=int, default=None,
                    help="the engine's (default its own; 4096 fits a whole rank on an H100)")
    ap.add_argument("--build-threads", type=int, default=None, help="start-up's parallel kernel builds (0: off)")
    a = ap.parse_args()
    path = a.tokenizer
    if path is None:
        path = a.tokenizer_out
        if not os.path.exists(path):
            t = time.perf_counter()
            train_tokenizer(path)
            print(f"trained a {V}-token byte-level BPE in {time.perf_counter() - t:.0f} s -> {path}")
    with open(path) as f:
        n = len(json.load(f)["model"]["vocab"])
    print(f"tokenizer {path}: {n} tokens, the model's vocabulary {V}")
    gr = host_costs(path, a.walks, a.steps)
    if a.engine:
        engine_rates(gr, a.batch, a.new, a.speculative, a.prefill_chunk, a.build_threads)
