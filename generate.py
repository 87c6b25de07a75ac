"""Generation with Step-5 on converted per-rank shards, under torchrun: one batch, or an interactive chat.

    torchrun --standalone --nproc-per-node=N generate.py --tp-dir OUT/tpN --prompt "..."
    torchrun ... generate.py --tp-dir OUT/tpN --prompt-file long_prompt.txt
    torchrun ... generate.py --tp-dir OUT/tpN --prompt "..." --temperature 0.7 --top-p 0.9 [--top-k 50] [--seed 0]
    torchrun ... generate.py --tp-dir OUT/tpN --prompt-json ids.json [--image-inputs image-inputs.safetensors]
    torchrun ... generate.py --tp-dir OUT/tpN --prompt-json-batch batch.json
    torchrun ... generate.py --tp-dir OUT/tpN --prompt "What is in <image>?" --image photo.jpg
    torchrun ... generate.py --tp-dir OUT/tpN --prompt "..." --speculative 3   # shards from convert.py --keep-mtp
    torchrun ... generate.py --tp-dir OUT/tpN --prompt "..." --json-schema schema.json --thinking-token-budget 64
    torchrun ... generate.py --tp-dir OUT/tpN --prompt-json ids.json --json --logprobs 5
    torchrun ... generate.py --tp-dir OUT/tpN --interactive                      # a chat; /reset, /image F, /exit

TP comes from the shard config and must equal WORLD_SIZE. NCCL on GPUs, gloo on CPU. Rank 0 prepares the prompts
and prints; every rank validates what it receives. Any failure on any rank ends every rank with one message.
The engine (engine.py) owns the cache, the kernels and the CUDA graphs; the runtime (runtime.py) the ranks, the
load and the engine's flags; chat.py the chat template; this file is the command line around them.
"""
import argparse
import codecs
import contextlib
import itertools
import json
import os
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import chat
import config
import engine as E
import grammar as G
import runtime as R
from choice import TOP, Reasoning
from runtime import UserError
from sampling import Sampling
from terminal import Keys

IMAGE_KEYS = ("pixel_values", "patch_pixel_values", "num_patches", "image_embeds")
MAX_LISTED = 10  # bad requests listed in one message
# --prompt-file: a file longer than this many bytes per position of max_position_embeddings cannot fit and is refused
# before it is read (a token of a byte-level BPE averages ~4 bytes; 32 is room for long tokens, chosen, not measured)
PROMPT_FILE_BYTES_PER_TOKEN = 32


# --------------------------------------------------------------------------------------------------
# inputs (rank 0 prepares them; every rank re-validates what it receives)


def check_ids(ids, where: str, cfg: config.Step5Config, max_new_tokens: int, limit: int | None = None) -> list:
    if not isinstance(ids, list) or not ids:
        raise UserError(f"{where}: a prompt must be a non-empty list of token ids")
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise UserError(f"{where}: token {i} is {t!r}, not an integer id")
        if not 0 <= t < cfg.vocab_size:
            raise UserError(f"{where}: token id {t} (position {i}) is outside the vocabulary [0, {cfg.vocab_size})")
    if len(ids) + max_new_tokens > cfg.max_position_embeddings:
        raise UserError(f"{where}: {len(ids)} prompt tokens + {max_new_tokens} new tokens exceed "
                        f"max_position_embeddings={cfg.max_position_embeddings}")
    if limit is not None and len(ids) + max_new_tokens > limit:
        raise UserError(f"{where}: {len(ids)} prompt tokens + {max_new_tokens} new tokens exceed --max-context "
                        f"{limit}")
    return ids


ID_FORMS = '[ids...] or {"prompt_ids": [ids...]}'
REQUEST_FORMS = ('[ids...], {"prompt_ids": [ids...], "image_inputs": "prepared.safetensors"} or '
                 '{"prompt": "text", "images": ["photo.jpg", ...]} ("image_inputs" and "images" optional)')


def prepare_requests(a: "Args", cfg: config.Step5Config, vl, tok, max_context: int | None) -> list:
    """Rank 0: the batch's [Prompt], validated; every bad batch request is listed."""
    new = a.max_new_tokens

    def text_request(text, images, where):
        p = chat.text_ids(tok, vl, text, list(images or []), where, a.raw_prompt)
        extra = f" (with {len(images)} image block(s))" if images else ""
        check_ids(p.ids, where + extra, cfg, new, max_context)
        return p

    if a.prompt is not None or a.prompt_file is not None:
        flag = "--prompt" if a.prompt is not None else f"--prompt-file {a.prompt_file}"
        text = a.prompt if a.prompt is not None else read_prompt_file(a.prompt_file, cfg)
        p = text_request(text, a.images, flag)
        return [chat.Prompt(p.ids, p.images or a.image_inputs)]
    if a.prompt_json is not None:
        path = a.prompt_json
        d = R.read_json(path)
        if isinstance(d, dict):
            if set(d) != {"prompt_ids"}:
                raise UserError(f"{path}: expected {ID_FORMS}, got an object with keys {sorted(d)}")
            d = d["prompt_ids"]
        return [chat.Prompt(check_ids(d, path, cfg, new, max_context), a.image_inputs)]
    path = a.prompt_json_batch
    d = R.read_json(path)
    entries = d.get("prompts") if isinstance(d, dict) else d
    if isinstance(d, dict) and set(d) != {"prompts"}:
        raise UserError(f'{path}: expected a list of requests or {{"prompts": [...]}}, got an object with keys '
                        f'{sorted(d)}')
    if not isinstance(entries, list) or not entries:
        raise UserError(f'{path}: expected a non-empty list of requests or {{"prompts": [...]}}')
    base = os.path.dirname(os.path.abspath(path))
    reqs, bad = [], []
    for i, e in enumerate(entries):
        where = f"request {i}"
        try:
            if not isinstance(e, dict):
                reqs.append(chat.Prompt(check_ids(e, where, cfg, new, max_context)))
                continue
            unknown = sorted(set(e) - {"prompt", "prompt_ids", "image_inputs", "images"})
            if (unknown or ("prompt" in e) == ("prompt_ids" in e) or ("images" in e and "prompt" not in e)
                    or ("images" in e and "image_inputs" in e)):
                raise UserError(f"{where}: expected {REQUEST_FORMS}; got keys {sorted(e)}")
            img = e.get("image_inputs")
            if img is not None and not isinstance(img, str):
                raise UserError(f'{where}: "image_inputs" must be a file name, got {type(img).__name__} {img!r}')
            if "images" in e:
                if not isinstance(e["images"], list) or not all(isinstance(f, str) for f in e["images"]):
                    raise UserError(f'{where}: "images" must be a list of file names, got {e["images"]!r}')
                reqs.append(text_request(e["prompt"], [os.path.join(base, f) for f in e["images"]], where))
                continue
            ids = text_request(e["prompt"], (), where).ids if "prompt" in e else e["prompt_ids"]
            reqs.append(chat.Prompt(check_ids(ids, where, cfg, new, max_context),
                               os.path.join(base, img) if img is not None else None))
        except UserError as err:
            bad.append(str(err))
    if bad:
        more = f"; and {len(bad) - MAX_LISTED} more" if len(bad) > MAX_LISTED else ""
        raise UserError(f"{path}: {len(bad)} of {len(entries)} requests are bad: " + "; ".join(bad[:MAX_LISTED]) + more)
    return reqs


def read_prompt_file(path: str, cfg: config.Step5Config) -> str:
    """--prompt-file: the file's text as it is (UTF-8), refused unread past what max_position_embeddings tokens hold
    at PROMPT_FILE_BYTES_PER_TOKEN bytes a token."""
    limit = PROMPT_FILE_BYTES_PER_TOKEN * cfg.max_position_embeddings
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:  # no such file, a directory, no permission
        raise UserError(f"--prompt-file {path}: cannot read it ({e.strerror or e})") from None
    if len(data) > limit:
        raise UserError(f"--prompt-file {path}: more than {limit} bytes, past what max_position_embeddings="
                        f"{cfg.max_position_embeddings} tokens hold at {PROMPT_FILE_BYTES_PER_TOKEN} bytes a token")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"--prompt-file {path}: not UTF-8 text (byte {e.start}: {data[e.start:e.start + 1]!r})"
                        ) from None


def save_prepared(path: str, p: chat.Prompt):
    """--save-image-inputs: the prepared tensors to PATH and the prompt ids to PATH's .json sibling, written under
    temporary names and renamed, replayable with --prompt-json PATH.json --image-inputs PATH."""
    from safetensors.torch import save_file
    if not isinstance(p.images, dict):
        raise UserError("--save-image-inputs needs --image files to prepare")
    ids_path = os.path.splitext(path)[0] + ".json"
    t = {k: (torch.tensor(v, dtype=torch.long) if k == "num_patches" else v.contiguous()) for k, v in p.images.items()}
    try:
        save_file(t, path + ".tmp")
        with open(ids_path + ".tmp", "w") as f:
            json.dump({"prompt_ids": p.ids}, f)
        os.replace(path + ".tmp", path)
        os.replace(ids_path + ".tmp", ids_path)
    except OSError as e:
        raise UserError(f"--save-image-inputs {path}: cannot write ({e.strerror})") from None


def writable_target(path: str, flag: str):
    """A file path whose directory exists and is writable, checked before anything is loaded."""
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        raise UserError(f"{flag} {path}: the directory {d} does not exist")
    if not os.access(d, os.W_OK):
        raise UserError(f"{flag} {path}: the directory {d} is not writable")
    if os.path.isdir(path):
        raise UserError(f"{flag} {path}: is a directory")


def load_image_inputs(path: str) -> dict:
    """An image-inputs safetensors file -> the model's keyword arguments (same file on every rank); non-finite
    values are refused."""
    from safetensors.torch import load_file
    if not os.path.isfile(path):
        raise UserError(f"{path}: no such image-inputs file")
    try:
        t = load_file(path)
    except Exception as e:  # safetensors' own error types for truncated / foreign files
        raise UserError(f"{path}: not a readable safetensors file ({e})") from None
    unknown = sorted(set(t) - set(IMAGE_KEYS))
    if unknown:
        raise UserError(f"{path}: unexpected tensor(s) {unknown}; expected some of {list(IMAGE_KEYS)}")
    if not t:
        raise UserError(f"{path}: holds none of {list(IMAGE_KEYS)}")
    for k, v in t.items():
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            i = int((~torch.isfinite(v)).flatten().nonzero()[0])
            raise UserError(f"{path}: {k} holds a non-finite value (flat index {i}: {v.flatten()[i].item()})")
    if "num_patches" in t:
        t["num_patches"] = t["num_patches"].long().flatten().tolist()
    return t


# --------------------------------------------------------------------------------------------------
# the command line's arguments and checks


@dataclass
class Args:
    """generate.py's own options (its flags by their dest names; the engine's are runtime.EngineFlags)."""
    prompt: str | None = None
    prompt_file: str | None = None
    prompt_json: str | None = None
    prompt_json_batch: str | None = None
    interactive: bool = False
    image_inputs: str | None = None
    images: list | None = None
    save_image_inputs: str | None = None
    max_new_tokens: int = 128
    ignore_eos: bool = False
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    json_schema: str | None = None
    regex: str | None = None
    thinking_token_budget: int | None = None
    logprobs: int | None = None
    raw_prompt: bool = False
    print_ids: bool = False
    as_json: bool = False
    hide_reasoning: bool = False

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_k, self.top_p, self.seed, self.min_p, self.presence_penalty,
                        self.frequency_penalty, self.repetition_penalty)

    def constraint(self) -> G.Constraint | None:
        """--json-schema (the file read) or --regex, as the engine takes it (compiled later: GrammarError)."""
        if self.regex is not None:
            return G.Constraint(G.Kind.REGEX, self.regex, field="--regex")
        if self.json_schema is None:
            return None
        try:
            with open(self.json_schema, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"--json-schema {self.json_schema}: {getattr(e, 'strerror', None) or e}") from None
        try:
            return G.Constraint.json_schema(text, True, f"--json-schema {self.json_schema}")
        except G.GrammarError as e:
            raise UserError(str(e)) from None


def check_args(a: Args, flags: R.EngineFlags):
    """Every check of the flags alone (no file read): UserError naming the flag and its value."""
    p = a.sampling.problem(lambda field: "--" + field.replace("_", "-"))
    if p:
        raise UserError(p)
    if a.max_new_tokens < 0:
        raise UserError(f"--max-new-tokens {a.max_new_tokens} must be >= 0")
    if a.json_schema is not None and a.regex is not None:
        raise UserError("--json-schema and --regex are exclusive (one constraint per request)")
    if (a.json_schema or a.regex is not None) and a.ignore_eos:
        raise UserError("--ignore-eos: a constrained answer ends at EOS (--json-schema / --regex give one)")
    if a.thinking_token_budget is not None and not 0 <= a.thinking_token_budget < 2 ** 31:
        raise UserError(f"--thinking-token-budget {a.thinking_token_budget} must be in [0, 2**31) (0: no reasoning)")
    if a.logprobs is not None and not (0 <= a.logprobs <= TOP and a.as_json):
        raise UserError(f"--logprobs {a.logprobs} must be in [0, {TOP}] and goes with --json (where they are printed)")
    if a.interactive and (a.json_schema or a.regex is not None or a.thinking_token_budget is not None):
        raise UserError("--json-schema, --regex and --thinking-token-budget apply to one batch, not --interactive")
    flags.check()
    sources = (sum(x is not None for x in (a.prompt, a.prompt_file, a.prompt_json, a.prompt_json_batch))
               + a.interactive)
    if sources != 1:
        raise UserError("give exactly one of --prompt, --prompt-file, --prompt-json, --prompt-json-batch, "
                        "--interactive")
    text = a.prompt is not None or a.prompt_file is not None
    if a.raw_prompt and not text and not a.interactive:
        raise UserError("--raw-prompt is only valid with --prompt, --prompt-file or --interactive")
    if a.image_inputs and (a.prompt_json_batch or a.interactive):
        raise UserError("--image-inputs applies to --prompt, --prompt-file and --prompt-json; name image files inside "
                        "the batch JSON (or /image FILE in --interactive) instead")
    if a.images and not text:
        raise UserError("--image applies to --prompt and --prompt-file; use \"images\" entries inside a "
                        "--prompt-json-batch file or "
                        "/image FILE in --interactive")
    if a.images and a.image_inputs:
        raise UserError("--image and --image-inputs are exclusive")
    if a.save_image_inputs and not a.images:
        raise UserError("--save-image-inputs needs --image")
    if a.hide_reasoning and not a.interactive:
        raise UserError("--hide-reasoning applies to --interactive (elsewhere the output is the whole completion)")
    if a.interactive and a.as_json:
        raise UserError("--json prints one document at the end: it does not go with --interactive")
    if a.save_image_inputs:
        writable_target(a.save_image_inputs, "--save-image-inputs")
        if a.save_image_inputs.endswith(".json"):
            raise UserError(f"--save-image-inputs {a.save_image_inputs}: the prompt ids go to the .json beside the "
                            "tensor file; name the tensor file .safetensors")
    R.check_launched()


def split(kw: dict) -> tuple[Args, R.EngineFlags]:
    """The flags by dest name -> (generate.py's own, the engine's)."""
    flags, mine = R.EngineFlags.split(kw)
    return Args(**mine), flags


# --------------------------------------------------------------------------------------------------
# the run


def main(tp_dir: str, **kw) -> list:
    """The CLI's run on this rank (under torchrun, or in a process group that already exists): the generated ids of
    each request (the batch) or of each turn (--interactive)."""
    a, flags = split({"tp_dir": tp_dir, **kw})
    check_args(a, flags)
    images = "--image" if a.images else "--image-inputs" if a.image_inputs else None
    with R.process(flags.device) as (rank, world, dev):
        s = R.setup(flags, rank, world, dev, images=images,
                    needs_tokenizer=a.prompt is not None or a.prompt_file is not None or a.interactive)
        out = interactive(s, a) if a.interactive else one_batch(s, a)
        dist.barrier()  # no rank tears the group down while another still talks to it
        return out


def features_of(s: R.Session, prompts: list, max_new_tokens: int) -> list:
    """Every rank: each request's image feature rows at its placeholders (checked per request)."""
    def received():
        for i, p in enumerate(prompts):
            check_ids(p.ids, f"request {i}", s.cfg, max_new_tokens)
            if p.images and s.vl is None:
                raise UserError(f"request {i} has image inputs ({p.images}) but the shards hold a text-only model")
        out = []
        for i, p in enumerate(prompts):
            try:
                out.append(load_image_inputs(p.images) if isinstance(p.images, str) else p.images)
            except UserError as e:
                raise UserError(f"request {i}: {e}") from None
        return out
    images = R.phase(received)
    with torch.inference_mode():
        return R.phase(E.request_features, s.model, [p.ids for p in prompts], images,
                       errors=(UserError, config.ConfigError, ValueError))


def one_batch(s: R.Session, a: Args) -> list:
    def requests():
        reqs = prepare_requests(a, s.cfg, s.vl, s.tok, s.flags.max_context)
        if a.save_image_inputs:
            save_prepared(a.save_image_inputs, reqs[0])
        return reqs
    prompts = R.phase(requests) if s.rank == 0 else R.agree(None)
    prompts = R.broadcast(prompts)
    n_tok = [len(p.ids) for p in prompts]
    R.load(s, f"({n_tok[0]} prompt tokens)" if len(prompts) == 1 else f"(batch={len(prompts)}, prompt tokens={n_tok})")
    feats = features_of(s, prompts, a.max_new_tokens)
    constraint = R.phase(a.constraint)
    R.start_engine(s, s.flags.max_batch or len(prompts), s.flags.max_context, constrained=constraint is not None)
    if constraint is not None:  # every rank compiles it (bounded fuel: the same verdict everywhere)
        R.phase(s.eng.grammars.compiled, constraint, errors=(UserError, G.GrammarError))
    if a.temperature > 0:
        s.say(f"sampling: temperature {a.temperature}, top-k {a.top_k or 'off'}, top-p "
              f"{a.top_p if a.top_p < 1 else 'off'}, seed {a.seed} (reproducible on {s.dev.type} with this seed)")
    stop = frozenset() if a.ignore_eos else frozenset(s.eos)
    think = R.phase(reasoning_of, s, a, prompts)
    reqs = [E.Request(p.ids, a.max_new_tokens, stop, a.sampling, f, a.logprobs, False, constraint, r)
            for p, f, r in zip(prompts, feats, think)]
    stream = Stream(s, reqs[0]) if len(reqs) == 1 and not a.as_json and s.rank == 0 else None

    def on_step(o):
        for r, ids in o.tokens:
            if r is stream.req:
                stream.push(ids)
    t0 = time.perf_counter()
    with torch.inference_mode(), engine_errors():
        s.eng.run(reqs, on_step if stream is not None else None)
    report_speed(s, reqs, t0, stream, a.print_ids)
    out = [r.out for r in reqs]
    E.check_same_on_all_ranks(out, s.dev)
    if s.rank == 0 and stream is None:
        report(out, s.tok, n_tok, s.eos, a.print_ids, a.as_json,
               [r.token_logprobs for r in reqs] if a.logprobs is not None else None)
    return out


def reasoning_of(s: R.Session, a: Args, prompts: list) -> list:
    """Per request: its open reasoning block as the engine takes it (the prompt's last <think> after its last
    </think>: the chat template opened one), with --thinking-token-budget; None where it opens none. Every rank
    reads the same ids, so every rank agrees. A budget no prompt can use is refused."""
    think = R.broadcast(chat.think_ids(s.tok) if s.tok is not None else None)

    def last(ids: list, t: int) -> int:
        return max((i for i, x in enumerate(ids) if x == t), default=-1)
    out = [Reasoning(think[1], a.thinking_token_budget) if think and last(p.ids, think[0]) > last(p.ids, think[1])
           else None for p in prompts]
    if a.thinking_token_budget is not None and not any(out):
        raise UserError("--thinking-token-budget applies to a chat whose template opens a reasoning block (<think>); "
                        "these prompts open none")
    return out


@contextlib.contextmanager
def engine_errors():
    """A request's computation that went wrong (engine.EngineError) is the run's one message."""
    try:
        yield
    except E.EngineError as e:
        raise UserError(str(e)) from None


def report_speed(s: R.Session, reqs: list, t0: float, stream=None, print_ids: bool = False):
    """After the requests ran from t0 (streaming the first one when `stream`, whose text then ends before the speed
    line: the two share the terminal), the speed line on rank 0: prefill as the prompt tokens computed (reused ones
    excluded) up to the last first token, decode after it."""
    if s.dev.type == "cuda":
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    if stream is not None:
        stream.close(print_ids)
    firsts = [r.t_first for r in reqs if r.t_first is not None]
    t1 = max(firsts) if firsts else t2  # no token (--max-new-tokens 0): the whole run was prefill
    computed = sum(len(r.ids) - r.cached for r in reqs)
    n_dec = sum(max(len(r.out) - 1, 0) for r in reqs)
    pre, dec = t1 - t0, t2 - t1
    s.say(f"prefill: {computed} tokens in {pre:.3f} s ({computed / max(pre, 1e-9):.1f} tok/s)"
          + (f", {sum(r.cached for r in reqs)} reused from the cache" if any(r.cached for r in reqs) else "")
          + f"; decode: {n_dec} tokens in {dec:.3f} s ({n_dec / max(dec, 1e-9):.1f} tok/s)")
    if s.eng.spec is not None:
        st = s.eng.spec.stats
        acc = ", ".join(f"depth {j + 1}: {x}/{p}" for j, (x, p) in enumerate(zip(st["accepted"], st["proposed"])))
        s.say(f"speculative: {s.flags.speculative} MTP draft(s) per step; accepted {acc}; "
              f"{n_dec / max(st['verify_rows'], 1):.2f} tokens per request and verify step")


class Stream:
    """Rank 0: one request's text on stdout as it is decoded (never a broken UTF-8 sequence). In a chat (`apart`),
    reasoning (between <think> and </think>, the prompt's open block included) is shown apart: dimmed in a terminal,
    else between REASONING_HEAD and REASONING_TAIL lines; hidden with --hide-reasoning. Elsewhere the text is the
    completion's, markers spelled."""

    def __init__(self, s: R.Session, req, apart: bool = False, hide_reasoning: bool = False):
        self.req, self.text = req, chat.TextStream(s.tok) if s.tok is not None else None
        self.think = chat.think_ids(s.tok) if s.tok is not None and apart else None
        self.hide = hide_reasoning
        self.tty = sys.stdout.isatty()
        self.reasoning = self.think is not None and _opened(req.ids, self.think)
        if self.reasoning:
            self._mark(True)

    def push(self, ids: list):
        if self.text is None:
            return
        run = []
        for t in ids:
            if self.think is not None and t in self.think:
                self._write(self.text.push(run) + self.text.flush())
                run = []
                if (t == self.think[0]) != self.reasoning:
                    self.reasoning = not self.reasoning
                    self._mark(self.reasoning)
            else:
                run.append(t)
        self._write(self.text.push(run))
        sys.stdout.flush()

    def _write(self, text: str):
        if text and not (self.reasoning and self.hide):
            sys.stdout.write(text)

    def _mark(self, start: bool):
        """The start or end of the reasoning on screen."""
        if self.hide:
            return
        if self.tty:
            sys.stdout.write(DIM if start else UNDIM)
        else:
            sys.stdout.write(REASONING_HEAD if start else REASONING_TAIL)

    def close(self, print_ids: bool):
        if self.text is not None:
            self._write(self.text.flush())
            if self.reasoning and self.tty and not self.hide:
                sys.stdout.write(UNDIM)
            sys.stdout.write("\n")
        if print_ids or self.text is None:  # without a tokenizer the ids are the output
            print(f"ids: {self.req.out}")
        sys.stdout.flush()


DIM, UNDIM = "\x1b[2m", "\x1b[0m"  # a terminal's faint text (SGR 2), and back
REASONING_HEAD, REASONING_TAIL = "[reasoning] ", " [answer] "  # where stdout is no terminal: no new lines


def _opened(ids: list, think: tuple) -> bool:
    """The ids leave a reasoning block open (their last think marker is <think>)."""
    last = next((t for t in reversed(ids) if t in think), None)
    return last == think[0]


def report(out, tok, n_tok, eos, print_ids, as_json, logprobs: list | None = None):
    """The batch's results; --json: one document (with --logprobs, each token's [logprob, [[id, logprob], ...]])."""
    texts = [tok.decode(o, skip_special_tokens=False) if tok is not None else None for o in out]
    results = [{"prompt_token_count": n, "completion_token_ids": o, "completion": t}
               for n, o, t in zip(n_tok, out, texts)]
    for r, lp in zip(results, logprobs or []):
        r["completion_logprobs"] = [[x.logprob, [list(y) for y in x.top]] for x in lp]
    if as_json:
        doc = ({**results[0], "eos_token_ids": eos} if len(results) == 1
               else {"batch_size": len(results), "eos_token_ids": eos, "results": results})
        utf8 = codecs.lookup(sys.stdout.encoding or "ascii").name == "utf-8"
        print(json.dumps(doc, ensure_ascii=not utf8))  # \uXXXX escapes where stdout cannot show the text
        return
    for i, r in enumerate(results):
        head = f"[{i}] " if len(results) > 1 else ""
        if r["completion"] is not None:
            print(f"{head}{r['completion']}")
        if print_ids or r["completion"] is None:  # without a tokenizer the ids are the output
            print(f"{head}ids: {r['completion_token_ids']}")


# --------------------------------------------------------------------------------------------------
# --interactive: a chat whose cache is reused turn after turn


HELP = ("commands: /reset (a new conversation), /image FILE (attach to the next turn), /exit (or Ctrl-D); Ctrl-C "
        "stops an answer")


@dataclass
class Chat:
    """Rank 0: the conversation, the /image files for its next turn, and the keyboard."""
    conv: chat.Conversation
    keys: Keys
    pending: list = field(default_factory=list)


def next_turn(s: R.Session, a: Args, c: Chat, rid: int, limit: int) -> tuple[R.Decision, chat.Turn | None]:
    """Rank 0: lines of stdin until one decides: a turn to answer (one new request, the whole conversation so far),
    or the end (/exit, Ctrl-D, a SIGINT at the prompt). Commands and refused turns are answered here."""
    say = s.say
    while True:
        line = c.keys.read_line()
        word = "" if line is None else line.strip()
        if line is None or word == "/exit":
            return R.Decision(stop=True), None
        if word == "/reset":
            c.conv.reset()
            c.pending = []
            say("(a new conversation)")
        elif word.startswith("/image"):
            f = word[len("/image"):].strip()
            if s.vl is None:
                say("the shards hold a text-only model: /image is not available")
            elif not os.path.isfile(f):
                say(f"{f or '/image'}: no such image file")
            else:
                c.pending.append(f)
                say(f"(image {f} goes with the next turn)")
        elif word.startswith("/"):
            say(f"unknown command {word.split()[0]}; {HELP}")
        elif line.strip():
            images, c.pending = c.pending, []
            try:
                turn = c.conv.ask(line, images, "this turn")
                p = turn.prompt
                if len(p.ids) + a.max_new_tokens > limit:
                    raise UserError(f"this turn: the conversation ({len(p.ids)} tokens) + --max-new-tokens "
                                    f"{a.max_new_tokens} exceed the context of {limit} tokens; /reset starts a "
                                    "new conversation")
                check_ids(p.ids, "this turn", s.cfg, a.max_new_tokens)
            except UserError as e:
                say(f"error: {e}")
                continue
            stop = frozenset() if a.ignore_eos else frozenset(s.eos)
            new = R.New(rid, p.ids, p.images, a.max_new_tokens, a.sampling, stop, continues=bool(c.conv.messages))
            return R.Decision(new=[new]), turn


def interactive(s: R.Session, a: Args) -> list:
    """Rank 0 reads each user turn and decides; every rank applies its decision (runtime.Driver, as the server's
    engine loop does) and extends the conversation's slot with the tokens its cache does not hold yet (the engine
    keeps the longest common prefix of the ids: chat.Conversation keeps the last prompt's and answer's ids where the
    template renders them alike). After each step of an answer, rank 0 decides whether Ctrl-C cancels it."""
    R.load(s, "(interactive)")
    R.start_engine(s, 1, s.flags.max_context)
    drv = R.Driver(s)
    k = s.flags.speculative
    limit = s.eng.max_context - (k + 1 if k else 0)
    s.say(f"interactive: up to {limit} tokens of conversation; {HELP}")
    c = Chat(chat.Conversation(s.tok, s.vl, a.raw_prompt), Keys()) if s.rank == 0 else None
    rids = itertools.count()  # rank 0's
    answers, last = [], None  # each turn's ids; the last turn's request (its features: the conversation's images)
    try:
        while True:
            d, turn = next_turn(s, a, c, next(rids), limit) if s.rank == 0 else (None, None)
            d = drv.agree(d)
            if d.stop:
                break
            with torch.inference_mode():
                refused = drv.apply(d, last.features if last is not None else None)
            if refused:
                s.say(f"error: {refused[0][1]}")
                continue
            rid = d.new[0].rid
            req = drv.reqs[rid]
            stream = Stream(s, req, True, a.hide_reasoning) if s.rank == 0 else None
            if c is not None:
                c.keys.clear()
            t0 = time.perf_counter()
            with torch.inference_mode(), engine_errors():
                while s.eng.busy():
                    for u in drv.step():
                        if stream is not None:
                            stream.push(u.ids)
                    d = R.Decision(cancel=[rid] if c.keys.poll() else []) if s.rank == 0 else None  # rank 0's Ctrl-C
                    drv.apply(drv.agree(d))
            report_speed(s, [req], t0, stream, a.print_ids)
            if req.finish == "cancelled":
                s.say("(stopped)")
            if c is not None:
                c.conv.answered(turn, req.out, s.eos)
            answers.append(req.out)
            last = req
    finally:
        if c is not None:
            c.keys.restore()
    return answers


# --------------------------------------------------------------------------------------------------
# the CLI


def parser() -> R.Parser:
    ap = R.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", help="user text; the chat template is applied unless --raw-prompt")
    ap.add_argument("--prompt-file", metavar="FILE", help="user text read from FILE (UTF-8, as it is), as --prompt: "
                    "for prompts longer than a command line holds")
    ap.add_argument("--prompt-json", help=f"exact ids: {ID_FORMS}")
    ap.add_argument("--prompt-json-batch", help='[[ids...], ...] or {"prompts": [{"prompt_ids": [...], '
                    '"image_inputs": "file.safetensors"}, {"prompt": "text", "images": ["photo.jpg"]}, ...]}')
    ap.add_argument("--interactive", action="store_true", help="a multi-turn chat on stdin; answers stream; the "
                    "conversation's cache is reused turn after turn")
    ap.add_argument("--image", dest="images", action="append", metavar="FILE",
                    help="an image file for --prompt / --prompt-file (repeatable, in order); each goes where the "
                    "text has an "
                    f"{chat.IMAGE_MARKER} marker, or before the text without markers")
    ap.add_argument("--save-image-inputs", metavar="OUT.safetensors",
                    help="also write the prepared image tensors there and the prompt ids to OUT.json")
    ap.add_argument("--image-inputs", help="safetensors with pixel_values [+ patch_pixel_values, num_patches] "
                    "or image_embeds, for --prompt / --prompt-file / --prompt-json")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--ignore-eos", action="store_true",
                    help="generate exactly --max-new-tokens tokens per request, past any EOS (benchmarks, tests)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample from softmax(logits / T); 0 (the default) is greedy decoding")
    ap.add_argument("--top-k", type=int, default=0, help="sample among the K most likely tokens (0: no limit; "
                    "needs --temperature)")
    ap.add_argument("--top-p", type=float, default=1.0, help="sample within the smallest set of most likely tokens "
                    "whose probability reaches P (1: no limit; needs --temperature)")
    ap.add_argument("--seed", type=int, default=0, help="seed of each request's random stream (default 0): the same "
                    "seed gives the same draws on the same device type, whatever the batch")
    ap.add_argument("--min-p", type=float, default=0.0, help="sample among the tokens at least P times as likely as "
                    "the most likely one (0: no limit; needs --temperature)")
    ap.add_argument("--presence-penalty", type=float, default=0.0, help="subtract P from the logit of each token "
                    "the output holds (OpenAI's; [-2, 2])")
    ap.add_argument("--frequency-penalty", type=float, default=0.0, help="subtract F times each token's count in "
                    "the output from its logit (OpenAI's; [-2, 2])")
    ap.add_argument("--repetition-penalty", type=float, default=1.0, help="divide the positive and multiply the "
                    "negative logits of the prompt's and output's tokens by R (> 0; 1: none)")
    ap.add_argument("--json-schema", metavar="FILE", help="the answer is JSON valid under the JSON schema in FILE "
                    "(after the reasoning block, when the chat template opens one)")
    ap.add_argument("--regex", help="the answer matches this regular expression (Rust regex syntax, whole answer)")
    ap.add_argument("--thinking-token-budget", type=int, metavar="N", help="end the reasoning block after N tokens "
                    "(0: no reasoning); for prompts whose chat template opens <think>")
    ap.add_argument("--logprobs", type=int, metavar="K", help="with --json: each generated token's log-probability "
                    f"(the model's raw distribution) and its K most likely alternatives (0..{TOP})")
    ap.add_argument("--raw-prompt", action="store_true", help="tokenize the text as plain text, no chat template")
    ap.add_argument("--print-ids", action="store_true", help="also print the generated token ids")
    ap.add_argument("--json", dest="as_json", action="store_true", help="print one JSON document with ids and text")
    ap.add_argument("--hide-reasoning", action="store_true", help="--interactive: answers leave out the reasoning "
                    "(shown dimmed in a terminal, between [reasoning] and [answer] lines elsewhere)")
    R.add_engine_flags(ap, prefill_chunk=E.PREFILL_CHUNK, max_batch="the batch's size, 1 with --interactive")
    return ap


def parse_cli(argv: list) -> dict:
    kw = vars(parser().parse_args(argv))
    check_args(*split(kw))
    return kw


if __name__ == "__main__":
    R.exit_now(R.run_cli(sys.argv[1:], parse_cli, main))
