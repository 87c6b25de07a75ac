"""The runtime under both front ends (generate.py: one batch or a chat; serve.py: the HTTP server), under torchrun.

It owns what the two share: the process and its device, rank agreement and exit codes, the shard checks and the load,
the tokenizer, one argparse group of engine flags (each front end gives its defaults), the Session that holds a
loaded model and its engine, and the Driver that applies rank 0's decisions (new requests, cancellations, the stop)
to the engine on every rank. Chat rendering is chat.py's.

Every phase ends in agreement, so any failure on any rank ends every rank with one message: a bad flag or input is
one `error:` line on rank 0 and exit code EXIT_BAD_INPUT on every rank; a rank that dies ends each survivor with one
`error: rank N: lost another rank (...)` line and EXIT_FAILED; Ctrl-C ends every rank with one line and
EXIT_INTERRUPTED.
"""
import argparse
import contextlib
import ctypes
import datetime
import json
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field, fields
from typing import NamedTuple

import torch
import torch.distributed as dist

import choice
import config
import engine as E
import grammar
import model as M
import startup
from sampling import Sampling

PROGRESS_AFTER_S = 5.0  # a prefill that runs longer than this reports its progress on rank 0
EXIT_BAD_INPUT, EXIT_INTERRUPTED = 2, 130
EXIT_FAILED = 3  # a rank failed (another rank was lost, the engine stopped): every surviving rank exits so


class UserError(Exception):
    """Bad input: reported as one message naming the file, key or value."""


# --------------------------------------------------------------------------------------------------
# files: JSON, configs, the tokenizer


def read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f, object_pairs_hook=config.unique_keys)
    except config.DuplicateKey as e:  # the last one would silently win
        raise UserError(f"{path}: {e}") from None
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise UserError(f"{path}: is a directory, not a JSON file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:  # no permission, an I/O error
        raise UserError(f"{path}: cannot read it ({e.strerror or e})") from None


def read_config_json(path: str) -> dict:
    if os.path.isdir(path):
        raise UserError(f"{path}: is a directory, not a config file")
    if not os.path.exists(path):
        raise UserError(f"{path}: no such file")
    d = read_json(path)
    if not isinstance(d, dict):
        raise UserError(f"{path}: expected a JSON object")
    return d


def load_tokenizer(path: str):
    """The converted tokenizer, loaded directly from tokenizer.json as a fast tokenizer (no class auto-selection:
    transformers 5.x maps the legacy class name to an implementation that mangles long byte-level BPE prompts)."""
    from transformers import PreTrainedTokenizerFast
    tj, tc = os.path.join(path, "tokenizer.json"), os.path.join(path, "tokenizer_config.json")
    for f in (tj, tc):
        if not os.path.isfile(f):
            raise UserError(f"{f}: missing (the tokenizer needs tokenizer.json and tokenizer_config.json)")
    conf = read_json(tc)
    if not isinstance(conf, dict):
        raise UserError(f"{tc}: expected a JSON object")
    special = {k: v for k, v in conf.items() if k in ("bos_token", "eos_token", "pad_token", "unk_token")
               and isinstance(v, str)}
    try:
        tok = PreTrainedTokenizerFast(tokenizer_file=tj, **special)
    except Exception as e:  # the tokenizers library's own error types (a truncated or foreign file)
        raise UserError(f"{tj}: not a readable tokenizer ({str(e).splitlines()[0][:200]})") from None
    template = conf.get("chat_template")
    jinja = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.isfile(jinja):
        try:
            with open(jinja, encoding="utf-8") as f:
                template = f.read()
        except UnicodeDecodeError as e:
            raise UserError(f"{jinja}: not UTF-8 text ({e})") from None
    tok.chat_template = template
    return tok


def find_tokenizer(tp_dir: str, explicit: str | None):
    d = tokenizer_dir(tp_dir, explicit)
    return None if d is None else load_tokenizer(d)


def tokenizer_dir(tp_dir: str, explicit: str | None) -> str | None:
    """The tokenizer's directory: the one given, else tokenizer_files in or beside the TP dir (None: not found)."""
    if explicit:
        return explicit
    for d in (os.path.join(tp_dir, "tokenizer_files"), os.path.join(tp_dir, os.pardir, "tokenizer_files")):
        if os.path.isfile(os.path.join(d, "tokenizer.json")):
            return d
    return None


# --------------------------------------------------------------------------------------------------
# ranks: every phase ends in agreement, so any failure stops every rank with one message


def agree(err: str | None, group=None):
    """Every rank learns whether any rank failed; all then stop with the first message (no rank left hanging)."""
    errs = [None] * dist.get_world_size()
    dist.all_gather_object(errs, err, group=group)
    first = next((e for e in errs if e), None)
    if first:
        raise UserError(first)


def phase(fn, *args, errors=(UserError, config.ConfigError, M.ShardError)):
    """Run fn on this rank; the project's error types and a file that cannot be read (OSError) become one message,
    agreed on by every rank."""
    out, err = None, None
    try:
        out = fn(*args)
    except errors as e:
        err = str(e)
    except OSError as e:  # no permission, an I/O error: the file and what the system said
        err = f"{e.filename}: {e.strerror}" if e.filename and e.strerror else f"{type(e).__name__}: {e}"
    agree(err)
    return out


def broadcast(obj, src: int = 0, group=None):
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def failure(e: Exception) -> tuple[str, bool]:
    """-> (what failed, in one line; whether another rank was lost). gloo raises plain RuntimeErrors whose first
    line is '[file:line] what happened. Advice...'."""
    text = str(e).splitlines()[0] if str(e) else ""
    if isinstance(e, dist.DistError) or "gloo" in text or "NCCL" in text:
        said = re.sub(r"^\[[^]]*\] ", "", text).split(". ")[0]
        return f"lost another rank ({said[:200]})", True
    return f"{type(e).__name__}: {text[:300]}", False


# --------------------------------------------------------------------------------------------------
# shard checks: one conversion on every rank, before any weight is read


def check_tp_dir(tp_dir: str, rank: int):
    if os.path.isfile(tp_dir):
        raise UserError(f"--tp-dir {tp_dir} is a file; it must be the directory with config-r{{rank}}.json and "
                        "model-r{rank}.safetensors")
    if not os.path.exists(os.path.join(tp_dir, f"config-r{rank}.json")) and os.path.isdir(tp_dir):
        sub = sorted(d for d in os.listdir(tp_dir) if d.startswith("tp") and d[2:].isdigit())
        if sub:
            raise UserError(f"--tp-dir {tp_dir} holds {', '.join(sub)}: pass one of them, e.g. --tp-dir "
                            f"{os.path.join(tp_dir, sub[0])}")


def conversion_identity(tp_dir: str, rank: int) -> dict:
    """What must be equal on every rank of one conversion: this rank's config (there is no rank field in it) and its
    shard's metadata less the rank, read from headers only."""
    from safetensors import safe_open
    cfg_path = os.path.join(tp_dir, f"config-r{rank}.json")
    shard = os.path.join(tp_dir, f"model-r{rank}.safetensors")
    config = read_config_json(cfg_path)
    if not os.path.isfile(shard):
        raise UserError(f"{shard}: no such shard file")  # the loader's words
    try:
        with safe_open(shard, "pt", device="cpu") as f:
            return {"config": config, "shard": {k: v for k, v in (f.metadata() or {}).items() if k != "rank"}}
    except Exception as e:  # safetensors' own error types
        raise UserError(f"{shard}: not a readable safetensors file ({e})") from None


def first_difference(a, b, where: str = "") -> str | None:
    """The first key path where two JSON values differ, as 'path: a vs b'."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            d = first_difference(a.get(k, "<absent>"), b.get(k, "<absent>"), f"{where}.{k}" if where else k)
            if d:
                return d
        return None
    return None if a == b else f"{where} = {json.dumps(b)[:80]} (rank 0: {json.dumps(a)[:80]})"


def check_one_conversion(tp_dir: str, rank: int, world: int):
    """Before any weight is read: every rank's config and shard metadata come from one conversion."""
    mine = phase(conversion_identity, tp_dir, rank)
    every = [None] * world
    dist.all_gather_object(every, mine)
    for r in range(1, world):
        for part, name in (("config", f"config-r{r}.json"), ("shard", f"model-r{r}.safetensors")):
            d = first_difference(every[0][part], every[r][part])
            if d:
                raise UserError(f"{os.path.join(tp_dir, name)} differs from rank 0's: {d} (a file of another "
                                "conversion? every rank's files must come from one convert.py run)")


# --------------------------------------------------------------------------------------------------
# the engine's flags: one group, each front end's defaults


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one message from rank 0, after every rank agreed (see run_cli)
        raise UserError(f"{self.prog}: {message}")

    def print_help(self, file=None):  # --help under torchrun: rank 0's text, once
        if os.environ.get("RANK", "0") == "0":
            super().print_help(file)


def add_engine_flags(ap: argparse.ArgumentParser, *, prefill_chunk: int, max_batch: int | str):
    """The flags of the shards, the tokenizer and the engine, generate.py's and serve.py's alike (EngineFlags).
    max_batch: the default number of slots, or (a str) how the front end sizes them when the flag is not given."""
    g = ap.add_argument_group("shards, tokenizer and engine")
    g.add_argument("--tp-dir", required=True, help="directory with config-r{rank}.json and model-r{rank}.safetensors")
    g.add_argument("--tokenizer", "--tokenizer-path", "--checkpoint", "--ckpt-path", dest="tokenizer",
                   help="tokenizer directory (default: tokenizer_files beside the TP dir); --checkpoint and "
                   "--ckpt-path name the original checkpoint directory, whose tokenizer files are used")
    g.add_argument("--max-batch", type=int, default=None if isinstance(max_batch, str) else max_batch, metavar="B",
                   help="cache slots: requests decoded together (default"
                   + (f": {max_batch})" if isinstance(max_batch, str) else f" {max_batch})"))
    g.add_argument("--max-context", type=int, metavar="T", help="positions per slot: prompt + new tokens (default: "
                   "what fits in the device's memory after the weights, capped at the config's "
                   "max_position_embeddings)")
    g.add_argument("--prefill-chunk", type=int, default=prefill_chunk, metavar="N",
                   help="prefill at most N prompt tokens per engine step: bounds activation memory and how long a "
                   f"prompt stalls the running streams (default {prefill_chunk})")
    g.add_argument("--prefill-layers-per-step", type=int, default=E.PREFILL_LAYERS_PER_STEP, metavar="N",
                   help="while streams decode, a prefill pass runs N of the model's layers per engine step, a decode "
                   "step after each part, so a prompt's arrival stalls the running streams for N layers, not a whole "
                   "pass; fresh prompts then replay their prefill graphs only up to "
                   f"{E.GRAPH_BUSY} tokens (default {E.PREFILL_LAYERS_PER_STEP}: whole passes; a candidate, 16 for "
                   "instance, still to be measured on a GPU; with --speculative passes run whole)")
    g.add_argument("--speculative", type=int, default=0, metavar="K",
                   help="draft K tokens per step with the checkpoint's MTP layers (1..3; shards converted with "
                   "--keep-mtp); greedy output is unchanged, sampled output keeps its distribution")
    g.add_argument("--prefix-cache-gib", type=float, default=None, metavar="G",
                   help="device memory of the prefix store, which keeps prompt prefixes across requests so a shared "
                   "system prompt, tools block or resent history prefills once whatever slot a request lands in "
                   "(default: as much as one slot's cache, at most 1/8 of the caches and the store together)")
    g.add_argument("--no-prefix-cache", dest="prefix_cache_gib", action="store_const", const=0.0,
                   help="no prefix store: a request reuses only what its own slot holds")
    g.add_argument("--prefix-cache-min", type=int, default=E.PREFIX_MIN, metavar="N",
                   help="copy a stored prefix only when it saves at least N prompt tokens over the slot's own "
                   f"(default {E.PREFIX_MIN}; 0: any whole region)")
    g.add_argument("--ep-size", "--expert-parallel-size", dest="ep_size", type=int, default=None,
                   help="expert-parallel size; must equal the shards' expert_parallel_size (= TP), which is the "
                   "default")
    g.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    g.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false",
                   help="launch decode kernels eagerly instead of replaying captured CUDA graphs (debugging)")
    g.add_argument("--verify", action="store_true", help="before loading, check every rank's shard against the "
                   "sha256 convert.py recorded beside it (model-r{rank}.safetensors.sha256): reads each shard once "
                   "more")


@dataclass
class EngineFlags:
    """add_engine_flags' flags by their dest names: where the shards and the tokenizer are, the engine's size, and
    where it runs."""
    tp_dir: str
    tokenizer: str | None = None
    max_batch: int | None = None  # None: the front end sizes the slots (generate.py: the batch's size)
    max_context: int | None = None
    prefill_chunk: int = E.PREFILL_CHUNK
    speculative: int = 0
    ep_size: int | None = None
    device: str = "auto"
    cuda_graph: bool = True
    verify: bool = False
    prefix_cache_gib: float | None = None
    prefix_cache_min: int = E.PREFIX_MIN
    prefill_layers_per_step: int = E.PREFILL_LAYERS_PER_STEP

    @classmethod
    def split(cls, kw: dict) -> tuple["EngineFlags", dict]:
        """Flags by dest name -> (the engine's, the front end's own)."""
        mine = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in kw.items() if k in mine}), {k: v for k, v in kw.items() if k not in mine}

    def check(self):
        """Every check of these flags alone (no file read): UserError naming the flag and its value."""
        if self.speculative and not 1 <= self.speculative <= 3:
            raise UserError(f"--speculative {self.speculative}: the checkpoint has at most 3 MTP layers (1..3 drafts)")
        for flag, v, lo in (("--prefill-chunk", self.prefill_chunk, 1), ("--max-batch", self.max_batch, 1),
                            ("--max-context", self.max_context, 16), ("--prefix-cache-min", self.prefix_cache_min, 0),
                            ("--prefill-layers-per-step", self.prefill_layers_per_step, 0)):
            if v is not None and v < lo:
                raise UserError(f"{flag} {v} must be >= {lo}")
        if self.prefix_cache_gib is not None and not 0 <= self.prefix_cache_gib < float("inf"):
            raise UserError(f"--prefix-cache-gib {self.prefix_cache_gib} must be a number of GiB >= 0")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise UserError(f"--device cuda, but this torch ({torch.__version__}) sees no CUDA device")


def check_launched():
    """torchrun's environment is there (each front end checks it after its flags: a bad flag is named first)."""
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        if v not in os.environ:
            raise UserError(f"environment variable {v} is not set: launch with torchrun "
                            "(e.g. torchrun --standalone --nproc-per-node=N generate.py ...)")


# --------------------------------------------------------------------------------------------------
# the process and its device, the Session


class Place(NamedTuple):
    """This process's rank, the world size and its device."""
    rank: int
    world: int
    dev: torch.device


@contextlib.contextmanager
def process(device: str):
    """This rank's Place in the process group torchrun describes (NCCL on GPUs, gloo on CPU), created here and
    destroyed on leaving, unless one exists already (tests/tp_logits_dump.py runs generate.main in its own)."""
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    dev = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(minutes=30))
    try:
        yield Place(rank, world, dev)
    finally:
        if created:
            dist.destroy_process_group()


@dataclass
class Session:
    """A loaded model and its engine, with the run's ranks and how rank 0 talks."""
    flags: EngineFlags
    rank: int
    world: int
    dev: torch.device
    cfg: config.Step5Config
    vl: object
    tok: object
    eos: list
    model: M.Step5ForCausalLM = None
    eng: E.Engine = None
    say: object = print


def setup(flags: EngineFlags, rank: int, world: int, dev, *, needs_tokenizer: bool,
          images: str | None = None) -> Session:
    """Every rank's config, the topology it implies and one conversion on every rank; rank 0's tokenizer and the EOS
    set. needs_tokenizer: text comes in (else a tokenizer not found is a warning: ids are printed without text);
    images: the flag that gave images, refused for a text-only model."""
    say = (lambda *x: print(*x, file=sys.stderr, flush=True)) if rank == 0 else (lambda *x: None)

    # 1. every rank: its own config, the topology it implies, and one conversion on every rank
    def topology():
        check_tp_dir(flags.tp_dir, rank)
        cfg_path = os.path.join(flags.tp_dir, f"config-r{rank}.json")
        read_config_json(cfg_path)
        cfg, vl, _ = config.load_config(cfg_path)
        if cfg.tp_size != world:
            raise UserError(f"{cfg_path}: tp_size={cfg.tp_size} but WORLD_SIZE={world}: run with "
                            f"--nproc-per-node={cfg.tp_size} (TP comes from the shards, there is no --tp-size)")
        if flags.ep_size is not None and flags.ep_size != cfg.expert_parallel_size:
            raise UserError(f"--ep-size {flags.ep_size} does not match the shards' expert_parallel_size="
                            f"{cfg.expert_parallel_size} (co-located EP equals TP)")
        k, kept = flags.speculative, cfg.mtp_layers_kept
        if k > kept:
            raise UserError(f"--speculative {k} needs {k} MTP layer(s) but {cfg_path} keeps "
                            + (f"{kept}: use --speculative {kept} or less" if kept
                               else "none: convert with --keep-mtp"))
        if images and vl is None:
            raise UserError(f"{images} given but {cfg_path} is a text-only model")
        if flags.max_context is not None and flags.max_context > cfg.max_position_embeddings:
            raise UserError(f"--max-context {flags.max_context} exceeds max_position_embeddings="
                            f"{cfg.max_position_embeddings}")
        return cfg, vl
    cfg, vl = phase(topology)
    if world > 1:
        check_one_conversion(flags.tp_dir, rank, world)

    # 2. rank 0: the tokenizer and the EOS set (broadcast)
    def tokenizer():
        try:
            tok = find_tokenizer(flags.tp_dir, flags.tokenizer)
        except UserError as e:
            if flags.tokenizer or needs_tokenizer:
                raise
            say(f"warning: {e}; token ids are printed without text")
            tok = None  # ids-only prompts: an auto-discovered tokenizer is optional
        if tok is None and needs_tokenizer:
            raise UserError("a text prompt needs a tokenizer: none found in <tp-dir>/../tokenizer_files; pass "
                            "--tokenizer DIR")
        eos = set(cfg.eos_token_id) | ({tok.eos_token_id} if tok is not None and tok.eos_token_id is not None
                                       else set())
        if not eos or any(not isinstance(e, int) or e < 0 for e in eos):
            raise UserError(f"invalid EOS id set {sorted(eos, key=str)}")
        return tok, sorted(eos)
    tok, eos = phase(tokenizer) if rank == 0 else (agree(None) or (None, None))
    return Session(flags, rank, world, dev, cfg, vl, tok, broadcast(eos), say=say)


def load(s: Session, note: str):
    """Every rank's shard (its sha256 first with --verify), loaded strictly (model.from_shard: non-finite weights
    refused); times on rank 0."""
    say = s.say
    say(f"loading Step-5 TP={s.world}, co-located EP={s.cfg.expert_parallel_size} on {s.dev.type} {note}")
    shard = os.path.join(s.flags.tp_dir, f"model-r{s.rank}.safetensors")
    if s.flags.verify:
        t0 = time.perf_counter()
        phase(verify_shard, shard, s.rank, s.world)
        say(f"--verify: every rank's shard has the sha256 recorded beside it ({time.perf_counter() - t0:.1f} s)")
    t0 = time.perf_counter()
    s.model = phase(lambda: M.Step5ForCausalLM.from_shard(shard, s.cfg, s.dev, s.vl, s.rank))
    if s.dev.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    n = os.path.getsize(shard)
    say(f"loaded {startup.size_text(n)} per rank in {dt:.1f} s ({startup.size_text(int(n / max(dt, 1e-9)))}/s); "
        "compute path: "
        + (f"Triton kernels (kernel.py), decode as {'CUDA graphs' if s.flags.cuda_graph else 'eager launches'}"
           if s.dev.type == "cuda" else "PyTorch reference (CPU)"))
    return dt


def verify_shard(path: str, rank: int, world: int):
    """--verify: the shard's bytes hash to the sha256 convert.py recorded beside it (model-r{rank}.safetensors.sha256,
    read as convert.py reads it)."""
    import convert
    try:
        want = convert.recorded_sha256(path)
    except ValueError as e:
        raise UserError(f"{path}: {e}; --verify checks the sha256 that convert.py writes beside each shard") from None
    got = convert.sha256_file(path, rank, world)
    if got != want:
        raise UserError(f"{path}: its sha256 {got[:12]}... differs from the {want[:12]}... recorded in "
                        f"{os.path.basename(path)}.sha256: the file changed after convert.py wrote it (convert again)")


def start_engine(s: Session, max_batch: int, max_context: int | None, constrained: bool = False):
    """The engine made (its memory plan refused naming the flags, as one message of every rank) and started. A rank
    whose start-up runs out of memory may be inside a collective with the others, so it says so itself, in one line,
    and leaves; the others' next collective fails. constrained: every rank gets grammar.Grammars over the tokenizer
    beside the shards, its tokenizer view built now (every rank runs its own matchers: a view built at the first
    constrained request would stall the engine loop of the ranks that did not compile it ahead)."""
    f = s.flags

    def grammars():
        d = tokenizer_dir(f.tp_dir, f.tokenizer)
        if d is None or not os.path.isfile(os.path.join(d, "tokenizer.json")):
            raise UserError(f"rank {s.rank}: constrained decoding needs tokenizer.json on every rank; none in "
                            f"{d or f.tp_dir + '/../tokenizer_files'} (pass --tokenizer DIR)")
        g = grammar.Grammars(os.path.join(d, "tokenizer.json"), s.cfg.vocab_size, s.eos[0])
        t0 = time.perf_counter()
        g.view()
        s.say(f"grammars: the tokenizer view over {s.cfg.vocab_size} ids built in {time.perf_counter() - t0:.1f} s")
        return g
    g = phase(grammars) if constrained else None

    def make():
        try:
            return E.Engine(s.model, E.EngineConfig(max_batch, max_context, f.prefill_chunk, f.speculative,
                                                    f.cuda_graph, prefix_cache_gib=f.prefix_cache_gib,
                                                    prefix_cache_min=f.prefix_cache_min,
                                                    prefill_layers_per_step=f.prefill_layers_per_step), s.say,
                                    grammars=g)
        except (MemoryError, ValueError) as e:
            raise UserError(str(e)) from None
    s.eng = phase(make)
    s.eng.progress = progress_printer(s)
    try:
        s.eng.start()
    except MemoryError as e:
        print(f"error: rank {s.rank}: {e}", file=sys.stderr, flush=True)
        exit_now(EXIT_BAD_INPUT)


def progress_printer(s: Session):
    """Prefill progress on rank 0 once a prefill runs longer than PROGRESS_AFTER_S (then every PROGRESS_AFTER_S)."""
    state = {"t0": None, "last": 0.0}

    def progress(first, n, longest, i, layers, start):
        now = time.perf_counter()
        if state["t0"] is None or first == start and i == 1:  # a new prefill (a reused prefix skipped)
            state["t0"], state["last"] = now, 0.0
        el = now - state["t0"]  # host time: the launch queue keeps it close behind the device's
        if el > PROGRESS_AFTER_S and el - state["last"] > PROGRESS_AFTER_S:
            if s.dev.type == "cuda":  # only when a line is due: a sync per layer would stall the launch queue
                torch.cuda.synchronize()
                el = time.perf_counter() - state["t0"]
            state["last"] = el
            s.say(f"prefill: tokens {first}-{min(first + n, longest)} of {longest}, layer {i}/{layers} after {el:.0f} s")
    return progress if s.rank == 0 else None


# --------------------------------------------------------------------------------------------------
# rank 0's decisions, applied to the engine on every rank


@dataclass
class New:
    """A new request, as every rank submits it."""
    rid: int
    ids: list
    images: dict | None  # prepared image inputs (image_processing.ImageBatch.model_inputs), or None
    max_tokens: int
    sampling: Sampling
    stop_ids: frozenset
    continues: bool = False  # a chat's next turn: the conversation's image feature rows so far come before its own
    logprobs: int | None = None  # engine.Request's: top alternatives per token; None: no logprobs
    echo: bool = False  # the prompt's logprobs too
    constraint: grammar.Constraint | None = None
    reasoning: choice.Reasoning | None = None  # the prompt opened a reasoning block: its end and budget
    cache_salt: str | None = None  # engine.Request's: prefixes shared only within one salt
    share: int = 0  # engine.Request's: leading ids other requests likely share (a system turn), stored for them


def request_of(n: New, features) -> E.Request:
    """A New as the engine takes it, with its image feature rows (or None)."""
    return E.Request(n.ids, n.max_tokens, n.stop_ids, n.sampling, features, n.logprobs, n.echo, n.constraint,
                     n.reasoning, n.cache_salt, n.share)


@dataclass
class Decision:
    """What every rank applies before an engine step, in this order."""
    new: list = field(default_factory=list)
    cancel: list = field(default_factory=list)  # rids
    stop: bool = False


class Update(NamedTuple):
    """One request's news from an engine step."""
    rid: int
    req: E.Request
    ids: list  # the ids it emitted in the step
    done: bool  # it ended in the step (req.finish says how)


class Driver:
    """Every rank: rank 0's decisions, broadcast over a gloo group of their own and applied to the engine in the same
    order on every rank, and the engine's steps as each request's updates. Rank 0 alone decides; the others follow."""

    def __init__(self, s: Session, timeout_s: float | None = None):
        self.s = s
        self.group = (dist.new_group(backend="gloo", timeout=None if timeout_s is None
                                     else datetime.timedelta(seconds=timeout_s)) if s.world > 1 else None)
        self.reqs, self.rid_of = {}, {}  # rid -> engine Request; engine Request -> rid (until it ends)

    def agree(self, d: Decision | None) -> Decision:
        """Rank 0's decision (the other ranks pass None) on every rank."""
        return broadcast(d, group=self.group) if self.s.world > 1 else d

    def apply(self, d: Decision, history: torch.Tensor | None = None) -> list:
        """d's new requests submitted (their image features computed on every rank: they hold a collective), then its
        cancellations. history: the image feature rows [n, D] of the conversation so far (the interactive chat's
        earlier turns), which come first in a request that `continues`. -> (rid, why) of each new request the engine
        refused: the same inputs on every rank, the same refusal everywhere."""
        model, eng, refused = self.s.model, self.s.eng, []
        for n in d.new:
            try:
                if n.continues:
                    rows = [x for x in (history, model.image_features(**n.images) if n.images else None)
                            if x is not None]
                    feats = torch.cat(rows) if rows else None
                else:
                    feats = E.request_features(model, [n.ids], [n.images])[0]
                r = eng.submit(request_of(n, feats))
            except ValueError as e:
                refused.append((n.rid, str(e).removeprefix("request 0: ")))
                continue
            self.reqs[n.rid], self.rid_of[r] = r, n.rid
        for rid in d.cancel:
            if rid in self.reqs:
                eng.cancel(self.reqs[rid])
        return refused

    def step(self) -> list:
        """One engine step -> an Update per request that emitted ids in it or ended, in the engine's order."""
        out = self.s.eng.step()
        news = {}
        for r, ids in out.tokens:
            news.setdefault(r, []).extend(ids)
        for r in out.finished:
            news.setdefault(r, [])
        ended = set(map(id, out.finished))
        updates = [Update(self.rid_of[r], r, ids, id(r) in ended) for r, ids in news.items()]
        for r in out.finished:
            del self.reqs[self.rid_of.pop(r)]
        return updates


# --------------------------------------------------------------------------------------------------
# process life: orphans, Ctrl-C, stdout, the exit code


def exit_with_launcher():
    """A worker whose launcher (torchrun) dies exits at once: the kernel sends SIGKILL when the parent goes
    (PR_SET_PDEATHSIG), and a watchdog thread catches a parent that died before that was set."""
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the watchdog alone

    def watch():
        while True:
            if os.getppid() != parent:
                os._exit(EXIT_INTERRUPTED)
            time.sleep(0.5)
    threading.Thread(target=watch, daemon=True, name="launcher-watchdog").start()
    if os.getppid() != parent:
        os._exit(EXIT_INTERRUPTED)


# A SIGINT reached this process: a failure that follows (a collective whose peer the same Ctrl-C ended) is reported
# as the interruption it is, in one line, not as a traceback.
SIGINT_SEEN = threading.Event()


class Stdout:
    """sys.stdout that never raises: a reader that went away (`| head`) or a full disk must not end rank 0 mid-run,
    since the other ranks would then die in their next collective. What follows the first failure is dropped, and
    `lost` says why. A stdout whose encoding cannot show a character (PYTHONIOENCODING=latin-1, a C locale) gets its
    backslash escape, as Python's stderr does."""

    def __init__(self, stream):
        self.stream, self.lost = stream, None
        if hasattr(stream, "reconfigure"):  # a character its encoding lacks is written as \uXXXX, as on stderr
            stream.reconfigure(errors="backslashreplace")

    def _do(self, fn, *a):
        if self.lost is None:
            try:
                fn(*a)
            except OSError as e:
                self.lost = e.strerror or str(e)

    def write(self, text: str) -> int:
        self._do(self.stream.write, text)
        return len(text)

    def flush(self):
        self._do(self.stream.flush)

    def __getattr__(self, name):  # isatty, encoding, fileno, ... as the stream has them
        return getattr(self.stream, name)


def run_cli(argv: list, parse, run) -> int:
    """Parse, run, and end every rank alike: a bad flag or input prints one `error:` line on rank 0 (after every
    rank has agreed, so no rank can exit before it is printed) and every rank exits with EXIT_BAD_INPUT; Ctrl-C
    prints one line and exits with EXIT_INTERRUPTED; a rank that lost another prints one line and exits with
    EXIT_FAILED. parse(argv) -> run's keyword arguments (UserError on a bad flag): each front end passes its pair."""
    rank = int(os.environ.get("RANK", "0"))
    if "TORCHELASTIC_RUN_ID" in os.environ:
        exit_with_launcher()
    def on_sigint(*_):  # torchrun forwards Ctrl-C to every worker as SIGINT
        SIGINT_SEEN.set()
        raise KeyboardInterrupt
    signal.signal(signal.SIGINT, on_sigint)
    err = None
    try:
        a = parse(argv)
    except UserError as e:
        err = str(e)
    if err is not None:
        if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
            try:  # every rank waits until rank 0 has printed: nobody exits before the message is out
                dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
                if rank == 0:
                    print(f"error: {err}", file=sys.stderr, flush=True)
                dist.barrier()
                dist.destroy_process_group()
                return EXIT_BAD_INPUT
            except Exception:  # no process group possible: each rank says it (rank 0's line is the one that counts)
                pass
        if rank == 0:
            print(f"error: {err}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    out = sys.stdout = Stdout(sys.stdout)
    try:
        run(**a)
        out.flush()
        if out.lost is not None:
            raise UserError(f"cannot write to stdout ({out.lost}): the output is lost")
        return 0
    except UserError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except BaseException as e:
        if not SIGINT_SEEN.is_set():
            what, lost = failure(e) if isinstance(e, Exception) else (None, False)
            if not lost:
                raise
            print(f"error: rank {rank}: {what}", file=sys.stderr, flush=True)  # each survivor of a dead peer, once
            return EXIT_FAILED
        # Ctrl-C: whatever it interrupted (a collective whose peer has already gone, too) ends in one line
        if rank == 0:
            print("interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED


def exit_now(code: int):
    """End the process with `code`, its output flushed. The process group is destroyed by now. Interpreter
    finalisation is skipped: with gloo, a worker thread that is still being torn down then can abort the process
    ("terminate called without an active exception", seen about once in 30 CPU runs) after a fully successful run;
    serve.py's uvicorn threads are alive then too."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
