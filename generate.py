"""Generation with Step-5 on converted per-rank shards, under torchrun: one batch, or an interactive chat.

    torchrun --standalone --nproc-per-node=N generate.py --tp-dir OUT/tpN --prompt "..."
    torchrun ... generate.py --tp-dir OUT/tpN --prompt "..." --temperature 0.7 --top-p 0.9 [--top-k 50] [--seed 0]
    torchrun ... generate.py --tp-dir OUT/tpN --prompt-json ids.json [--image-inputs image-inputs.safetensors]
    torchrun ... generate.py --tp-dir OUT/tpN --prompt-json-batch batch.json
    torchrun ... generate.py --tp-dir OUT/tpN --prompt "What is in <image>?" --image photo.jpg
    torchrun ... generate.py --tp-dir OUT/tpN --prompt "..." --speculative 3   # shards from convert.py --keep-mtp
    torchrun ... generate.py --tp-dir OUT/tpN --interactive                      # a chat; /reset, /image F, /exit

TP comes from the shard config and must equal WORLD_SIZE. NCCL on GPUs, gloo on CPU. Rank 0 prepares the prompts
and prints; every rank validates what it receives. Any failure on any rank ends every rank with one message.
The engine (engine.py) owns the cache, the kernels and the CUDA graphs; this file is the command line around it.
"""
import argparse
import ctypes
import datetime
import json
import os
import re
import select
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import config
import engine as E
import image_processing
import model as M
from sampling import Sampling

IMAGE_KEYS = ("pixel_values", "patch_pixel_values", "num_patches", "image_embeds")
PROGRESS_AFTER_S = 5.0  # a prefill that runs longer than this reports its progress on rank 0
MAX_LISTED = 10  # bad requests listed in one message
EXIT_BAD_INPUT, EXIT_INTERRUPTED = 2, 130
EXIT_FAILED = 3  # a rank failed (another rank was lost, the engine stopped): every surviving rank exits so


class UserError(Exception):
    """Bad input: reported as one message naming the file, key or value."""


# --------------------------------------------------------------------------------------------------
# inputs (rank 0 prepares them; every rank re-validates what it receives)


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
    if explicit:
        return load_tokenizer(explicit)
    for d in (os.path.join(tp_dir, "tokenizer_files"), os.path.join(tp_dir, os.pardir, "tokenizer_files")):
        if os.path.isfile(os.path.join(d, "tokenizer.json")):
            return load_tokenizer(d)
    return None


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
IMAGE_MARKER = "<image>"  # where a text prompt places an image block; without markers the images lead the text


@dataclass
class Prompt:
    """One request as rank 0 prepared it: ids, and image inputs (a file path, a dict of prepared tensors, or None)."""
    ids: list
    images: str | dict | None = None


def render(tok, messages: list, raw: bool) -> str:
    if raw:
        return "".join(m["content"] for m in messages)
    if not tok.chat_template:
        raise UserError("the tokenizer has no chat template; use --raw-prompt to tokenize plain text")
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def not_utf8(text: str) -> int | None:
    """The position of the first character UTF-8 cannot encode, or None. Such a character is a lone surrogate: a
    JSON \\ud800 escape, or an undecodable byte of a command line or of stdin (Python's surrogateescape); the
    tokenizer refuses it."""
    try:
        text.encode()
        return None
    except UnicodeEncodeError as e:
        return e.start


def text_ids(tok, vl, text: str, images: list, where: str, raw: bool, messages: list = (),
             blocks: list = ()) -> tuple[Prompt, list]:
    """A user turn (after `messages`, earlier turns whose images have the placeholder `blocks`) -> (its prompt,
    the blocks of every image so far); each IMAGE_MARKER becomes that image's placeholder block (crops, then the
    overview), built from the tokenizer. UserError names `where`."""
    if not isinstance(text, str):
        raise UserError(f'{where}: "prompt" must be a string, got {type(text).__name__} {text!r}')
    at = not_utf8(text)
    if at is not None:
        raise UserError(f"{where}: the text is not valid UTF-8 (character {at}: {text[at]!r})")
    if tok is None:
        raise UserError(f"{where}: a text prompt needs a tokenizer: none found in <tp-dir>/../tokenizer_files; "
                        "pass --tokenizer")
    if images and vl is None:
        raise UserError(f"{where}: images given but the shards hold a text-only model")
    if images and tok.convert_tokens_to_ids(image_processing.IMAGE_TOKENS[0]) != vl.image_token_id:
        raise UserError(f"the tokenizer's {image_processing.IMAGE_TOKENS[0]} id differs from the config's "
                        f"image_token_id={vl.image_token_id}")
    literal = [t for t in image_processing.IMAGE_TOKENS if t in text]
    if literal:
        raise UserError(f"{where}: the text holds the image token {literal[0]!r} literally; images go in with "
                        f"--image (or \"images\") and an {IMAGE_MARKER} marker")
    marks = text.count(IMAGE_MARKER)
    if marks and marks != len(images):
        raise UserError(f"{where}: the text holds {marks} {IMAGE_MARKER} marker(s) for {len(images)} image(s)")
    if images and not marks:  # no markers: the images come first in the user turn, in order
        text = IMAGE_MARKER * len(images) + text
    try:
        rendered = render(tok, list(messages) + [{"role": "user", "content": text}], raw)
    except UserError:
        raise
    except Exception as e:  # a template that does not compile or raises: jinja's and the tokenizer's own errors
        raise UserError(f"{where}: the tokenizer's chat template failed ({type(e).__name__}: {str(e)[:300]}); fix "
                        "chat_template in the tokenizer files, or use --raw-prompt") from None
    inputs, blocks = None, list(blocks)
    if images:
        try:
            batch = image_processing.preprocess([image_processing.load_image(f) for f in images], vl.vision)
            blocks += [image_processing.image_block_ids(tok, lay, vl.vision) for lay in batch.layouts]
        except ValueError as e:  # image_processing: an unreadable file, or a tokenizer without the image tokens
            raise UserError(f"{where}: {e}") from None
        inputs = batch.model_inputs()
    return Prompt(splice(tok, rendered, blocks, raw), inputs), blocks


def splice(tok, rendered: str, blocks: list, raw: bool, marker: str = IMAGE_MARKER) -> list:
    """Rendered text -> its ids, the k-th marker replaced by blocks[k] (an image's placeholder ids); the pieces between
    markers are tokenized apart, so no token spans an image."""
    pieces = rendered.split(marker)
    ids = tok(pieces[0], add_special_tokens=raw)["input_ids"]
    for block, piece in zip(blocks, pieces[1:]):
        ids += block + tok(piece, add_special_tokens=False)["input_ids"]
    return ids


def prepare_requests(a: "Args", cfg: config.Step5Config, vl, tok) -> list:
    """Rank 0: the batch's [Prompt], validated; every bad batch request is listed."""
    new = a.max_new_tokens

    def text_request(text, images, where):
        p = text_ids(tok, vl, text, list(images or []), where, a.raw_prompt)[0]
        extra = f" (with {len(images)} image block(s))" if images else ""
        check_ids(p.ids, where + extra, cfg, new, a.max_context)
        return p

    if a.prompt is not None:
        p = text_request(a.prompt, a.images, "--prompt")
        return [Prompt(p.ids, p.images or a.image_inputs)]
    if a.prompt_json is not None:
        path = a.prompt_json
        d = read_json(path)
        if isinstance(d, dict):
            if set(d) != {"prompt_ids"}:
                raise UserError(f"{path}: expected {ID_FORMS}, got an object with keys {sorted(d)}")
            d = d["prompt_ids"]
        return [Prompt(check_ids(d, path, cfg, new, a.max_context), a.image_inputs)]
    path = a.prompt_json_batch
    d = read_json(path)
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
                reqs.append(Prompt(check_ids(e, where, cfg, new, a.max_context)))
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
            reqs.append(Prompt(check_ids(ids, where, cfg, new, a.max_context),
                               os.path.join(base, img) if img is not None else None))
        except UserError as err:
            bad.append(str(err))
    if bad:
        more = f"; and {len(bad) - MAX_LISTED} more" if len(bad) > MAX_LISTED else ""
        raise UserError(f"{path}: {len(bad)} of {len(entries)} requests are bad: " + "; ".join(bad[:MAX_LISTED]) + more)
    return reqs


def save_prepared(path: str, p: Prompt):
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


def read_config_json(path: str) -> dict:
    if os.path.isdir(path):
        raise UserError(f"{path}: is a directory, not a config file")
    if not os.path.exists(path):
        raise UserError(f"{path}: no such file")
    d = read_json(path)
    if not isinstance(d, dict):
        raise UserError(f"{path}: expected a JSON object")
    return d


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
# the command line's arguments and checks


@dataclass
class Args:
    """generate.py's options (the CLI's flags, by their dest names)."""
    tp_dir: str
    prompt: str | None = None
    prompt_json: str | None = None
    prompt_json_batch: str | None = None
    interactive: bool = False
    image_inputs: str | None = None
    images: list | None = None
    save_image_inputs: str | None = None
    max_new_tokens: int = 128
    ignore_eos: bool = False
    prefill_chunk: int = E.PREFILL_CHUNK
    max_batch: int | None = None
    max_context: int | None = None
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    speculative: int = 0
    ep_size: int | None = None
    tokenizer: str | None = None
    raw_prompt: bool = False
    print_ids: bool = False
    as_json: bool = False
    device: str = "auto"
    cuda_graph: bool = True

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_k, self.top_p, self.seed)


def check_args(a: Args):
    """Every check of the flags alone (no file read): UserError naming the flag and its value."""
    p = a.sampling.problem(lambda field: "--" + field.replace("_", "-"))
    if p:
        raise UserError(p)
    if a.speculative and not 1 <= a.speculative <= 3:
        raise UserError(f"--speculative {a.speculative}: the checkpoint has at most 3 MTP layers (1..3 drafts)")
    for flag, v, lo in (("--max-new-tokens", a.max_new_tokens, 0), ("--prefill-chunk", a.prefill_chunk, 1),
                        ("--max-batch", a.max_batch, 1), ("--max-context", a.max_context, 16)):
        if v is not None and v < lo:
            raise UserError(f"{flag} {v} must be >= {lo}")
    sources = sum(x is not None for x in (a.prompt, a.prompt_json, a.prompt_json_batch)) + a.interactive
    if sources != 1:
        raise UserError("give exactly one of --prompt, --prompt-json, --prompt-json-batch, --interactive")
    if a.raw_prompt and a.prompt is None and not a.interactive:
        raise UserError("--raw-prompt is only valid with --prompt or --interactive")
    if a.image_inputs and (a.prompt_json_batch or a.interactive):
        raise UserError("--image-inputs applies to --prompt / --prompt-json; name image files inside the batch JSON "
                        "(or /image FILE in --interactive) instead")
    if a.images and a.prompt is None:
        raise UserError("--image applies to --prompt; use \"images\" entries inside a --prompt-json-batch file or "
                        "/image FILE in --interactive")
    if a.images and a.image_inputs:
        raise UserError("--image and --image-inputs are exclusive")
    if a.save_image_inputs and not a.images:
        raise UserError("--save-image-inputs needs --image")
    if a.interactive and a.as_json:
        raise UserError("--json prints one document at the end: it does not go with --interactive")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device cuda, but this torch ({torch.__version__}) sees no CUDA device")
    if a.save_image_inputs:
        writable_target(a.save_image_inputs, "--save-image-inputs")
        if a.save_image_inputs.endswith(".json"):
            raise UserError(f"--save-image-inputs {a.save_image_inputs}: the prompt ids go to the .json beside the "
                            "tensor file; name the tensor file .safetensors")
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        if v not in os.environ:
            raise UserError(f"environment variable {v} is not set: launch with torchrun "
                            "(e.g. torchrun --standalone --nproc-per-node=N generate.py ...)")


def check_tp_dir(tp_dir: str, rank: int):
    if os.path.isfile(tp_dir):
        raise UserError(f"--tp-dir {tp_dir} is a file; it must be the directory with config-r{{rank}}.json and "
                        "model-r{rank}.safetensors")
    if not os.path.exists(os.path.join(tp_dir, f"config-r{rank}.json")) and os.path.isdir(tp_dir):
        sub = sorted(d for d in os.listdir(tp_dir) if d.startswith("tp") and d[2:].isdigit())
        if sub:
            raise UserError(f"--tp-dir {tp_dir} holds {', '.join(sub)}: pass one of them, e.g. --tp-dir "
                            f"{os.path.join(tp_dir, sub[0])}")


# --------------------------------------------------------------------------------------------------
# process life: orphans, Ctrl-C


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


class Interrupt:
    """Ctrl-C on rank 0: a flag the decode loop polls (it never raises inside a collective). In a terminal the
    keys are read from stdin (terminal signals off: torchrun would turn Ctrl-C into a kill of every rank);
    a SIGINT sent to the process sets the flag too, and at the prompt (`reading`) ends the chat as Ctrl-D does:
    when every rank got it (torchrun forwards it), the others are gone and nothing could go on."""

    def __init__(self):
        self.hit = False
        self.reading = False
        self.tty = sys.stdin.isatty()
        self.saved = None
        if self.tty:
            import termios
            self.saved = termios.tcgetattr(sys.stdin)
            mode = termios.tcgetattr(sys.stdin)
            mode[3] &= ~termios.ISIG  # Ctrl-C arrives as the byte 0x03
            termios.tcsetattr(sys.stdin, termios.TCSANOW, mode)
        signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, *_):
        self.hit = True
        SIGINT_SEEN.set()
        if self.reading:
            raise KeyboardInterrupt

    def poll(self) -> bool:
        """Whether Ctrl-C came since the last clear (reads pending keys in a terminal)."""
        if self.tty and select.select([sys.stdin], [], [], 0)[0]:
            if "\x03" in os.read(sys.stdin.fileno(), 1024).decode("utf-8", "replace"):
                self.hit = True
        return self.hit

    def clear(self):
        self.hit = False
        SIGINT_SEEN.clear()

    def restore(self):
        if self.saved is not None:
            import termios
            termios.tcsetattr(sys.stdin, termios.TCSANOW, self.saved)


# --------------------------------------------------------------------------------------------------
# the run


@dataclass
class Session:
    """A loaded model and its engine, with the run's ranks and how rank 0 talks."""
    a: Args
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
    ctl: object = None  # a gloo group for rank 0's per-step decisions (interactive)
    stats: dict = field(default_factory=dict)


def main(tp_dir: str, **kw) -> list:
    """The CLI's run on this rank (under torchrun, or in a process group that already exists): the generated ids of
    each request (the batch) or of each turn (--interactive)."""
    a = Args(tp_dir, **kw)
    check_args(a)
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    use_cuda = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
    dev = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(minutes=30))
    try:
        s = setup(a, rank, world, dev)
        out = interactive(s) if a.interactive else one_batch(s)
        dist.barrier()  # no rank tears the group down while another still talks to it
        return out
    finally:
        if created:
            dist.destroy_process_group()


def setup(a: Args, rank: int, world: int, dev) -> Session:
    say = (lambda *x: print(*x, file=sys.stderr, flush=True)) if rank == 0 else (lambda *x: None)

    # 1. every rank: its own config, the topology it implies, and one conversion on every rank
    def topology():
        check_tp_dir(a.tp_dir, rank)
        cfg_path = os.path.join(a.tp_dir, f"config-r{rank}.json")
        read_config_json(cfg_path)
        cfg, vl, _ = config.load_config(cfg_path)
        if cfg.tp_size != world:
            raise UserError(f"{cfg_path}: tp_size={cfg.tp_size} but WORLD_SIZE={world}: run with "
                            f"--nproc-per-node={cfg.tp_size} (TP comes from the shards, there is no --tp-size)")
        if a.ep_size is not None and a.ep_size != cfg.expert_parallel_size:
            raise UserError(f"--ep-size {a.ep_size} does not match the shards' expert_parallel_size="
                            f"{cfg.expert_parallel_size} (co-located EP equals TP)")
        if a.speculative > cfg.mtp_layers_kept:
            raise UserError(f"--speculative {a.speculative} needs {a.speculative} MTP layer(s) but {cfg_path} keeps "
                            + (f"{cfg.mtp_layers_kept}: use --speculative {cfg.mtp_layers_kept} or less"
                               if cfg.mtp_layers_kept else "none: convert with --keep-mtp"))
        if (a.image_inputs or a.images) and vl is None:
            raise UserError(f"{'--image' if a.images else '--image-inputs'} given but {cfg_path} is a text-only model")
        if a.max_context is not None and a.max_context > cfg.max_position_embeddings:
            raise UserError(f"--max-context {a.max_context} exceeds max_position_embeddings="
                            f"{cfg.max_position_embeddings}")
        return cfg, vl
    cfg, vl = phase(topology)
    if world > 1:
        check_one_conversion(a.tp_dir, rank, world)

    # 2. rank 0: the tokenizer and the EOS set (broadcast with the prompts)
    def tokenizer():
        try:
            tok = find_tokenizer(a.tp_dir, a.tokenizer)
        except UserError as e:
            if a.tokenizer or a.prompt is not None or a.interactive:
                raise
            say(f"warning: {e}; token ids are printed without text")
            tok = None  # ids-only prompts: an auto-discovered tokenizer is optional
        if tok is None and (a.prompt is not None or a.interactive):
            raise UserError("a text prompt needs a tokenizer: none found in <tp-dir>/../tokenizer_files; pass "
                            "--tokenizer DIR")
        eos = set(cfg.eos_token_id) | ({tok.eos_token_id} if tok is not None and tok.eos_token_id is not None
                                       else set())
        if not eos or any(not isinstance(e, int) or e < 0 for e in eos):
            raise UserError(f"invalid EOS id set {sorted(eos, key=str)}")
        return tok, sorted(eos)
    tok, eos = phase(tokenizer) if rank == 0 else (agree(None) or (None, None))
    s = Session(a, rank, world, dev, cfg, vl, tok, broadcast(eos), say=say)
    if world > 1:
        s.ctl = dist.new_group(backend="gloo")
    return s


def load(s: Session, note: str):
    """Strict load of every rank's shard, then the engine: memory plan, warm-up, graphs (times on rank 0)."""
    a, say = s.a, s.say
    say(f"loading Step-5 TP={s.world}, co-located EP={s.cfg.expert_parallel_size} on {s.dev.type} {note}")
    t0 = time.perf_counter()
    shard = os.path.join(a.tp_dir, f"model-r{s.rank}.safetensors")
    s.model = phase(lambda: M.Step5ForCausalLM.from_shard(shard, s.cfg, s.dev, s.vl, s.rank))
    if s.dev.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    gb = os.path.getsize(shard) / 1e9
    say(f"loaded in {dt:.1f} s ({gb / max(dt, 1e-9):.2f} GB/s per rank); compute path: "
        + (f"Triton kernels (kernel.py), decode as {'CUDA graphs' if a.cuda_graph else 'eager launches'}"
           if s.dev.type == "cuda" else "PyTorch reference (CPU)"))
    return dt


def start_engine(s: Session, max_batch: int, max_context: int | None):
    a = s.a

    def make():
        try:
            return E.Engine(s.model, E.EngineConfig(max_batch, max_context, a.prefill_chunk, a.speculative,
                                                    a.cuda_graph), s.say)
        except (MemoryError, ValueError) as e:
            raise UserError(str(e)) from None
    s.eng = phase(make)
    s.eng.progress = progress_printer(s)
    s.eng.start()


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


def broadcast(obj, src: int = 0, group=None):
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def features_of(s: Session, prompts: list) -> list:
    """Every rank: each request's image feature rows at its placeholders (checked per request)."""
    def received():
        for i, p in enumerate(prompts):
            check_ids(p.ids, f"request {i}", s.cfg, s.a.max_new_tokens)
            if p.images and s.vl is None:
                raise UserError(f"request {i} has image inputs ({p.images}) but the shards hold a text-only model")
        out = []
        for i, p in enumerate(prompts):
            try:
                out.append(load_image_inputs(p.images) if isinstance(p.images, str) else p.images)
            except UserError as e:
                raise UserError(f"request {i}: {e}") from None
        return out
    images = phase(received)
    with torch.inference_mode():
        return phase(E.request_features, s.model, [p.ids for p in prompts], images,
                     errors=(UserError, config.ConfigError, ValueError))


def one_batch(s: Session) -> list:
    a, say = s.a, s.say

    def requests():
        reqs = prepare_requests(a, s.cfg, s.vl, s.tok)
        if a.save_image_inputs:
            save_prepared(a.save_image_inputs, reqs[0])
        return reqs
    prompts = phase(requests) if s.rank == 0 else agree(None)
    prompts = broadcast(prompts)
    n_tok = [len(p.ids) for p in prompts]
    load(s, f"({n_tok[0]} prompt tokens)" if len(prompts) == 1 else f"(batch={len(prompts)}, prompt tokens={n_tok})")
    feats = features_of(s, prompts)
    start_engine(s, a.max_batch or len(prompts), a.max_context)
    if a.temperature > 0:
        say(f"sampling: temperature {a.temperature}, top-k {a.top_k or 'off'}, top-p "
            f"{a.top_p if a.top_p < 1 else 'off'}, seed {a.seed} (reproducible on {s.dev.type} with this seed)")
    stop = frozenset() if a.ignore_eos else frozenset(s.eos)
    reqs = [E.Request(p.ids, a.max_new_tokens, stop, a.sampling, f) for p, f in zip(prompts, feats)]
    stream = Stream(s, reqs[0]) if len(reqs) == 1 and not a.as_json and s.rank == 0 else None
    generate_and_report(s, reqs, stream)
    out = [r.out for r in reqs]
    E.check_same_on_all_ranks(out, s.dev)
    if s.rank == 0 and stream is None:
        report(out, s.tok, n_tok, s.eos, a.print_ids, a.as_json)
    return out


def generate_and_report(s: Session, reqs: list, stream=None, interrupt: "Interrupt | None" = None,
                        stoppable: bool = False):
    """Run the requests on the engine (streaming the first one when `stream`, whose text then ends before the speed
    line: the two share the terminal), then the speed line on rank 0: prefill as the prompt tokens computed (reused
    ones excluded) up to the last first token, decode after it.
    stoppable (every rank): after each step rank 0 says whether Ctrl-C (its `interrupt`) cancels the requests."""
    t0 = time.perf_counter()

    def on_step(o):
        if stream is not None:
            for r, ids in o.tokens:
                if r is stream.req:
                    stream.push(ids)
        if stoppable:  # rank 0's Ctrl-C, the same decision on every rank
            if broadcast(interrupt.poll() if s.rank == 0 else None, group=s.ctl):
                for r in reqs:
                    s.eng.cancel(r)
    with torch.inference_mode():
        try:
            s.eng.run(reqs, on_step)
        except E.EngineError as e:
            raise UserError(str(e)) from None
    if s.dev.type == "cuda":
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    if stream is not None:
        stream.close(s.a.print_ids)
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
        s.say(f"speculative: {s.a.speculative} MTP draft(s) per step; accepted {acc}; "
              f"{n_dec / max(st['verify_rows'], 1):.2f} tokens per request and verify step")


class Stream:
    """Rank 0: one request's text on stdout as it is decoded (never a broken UTF-8 sequence)."""

    def __init__(self, s: Session, req):
        self.req, self.text = req, E.TextStream(s.tok) if s.tok is not None else None

    def push(self, ids: list):
        if self.text is not None:
            sys.stdout.write(self.text.push(ids))
            sys.stdout.flush()

    def close(self, print_ids: bool):
        if self.text is None:
            print("(no tokenizer)")
        else:
            sys.stdout.write(self.text.flush() + "\n")
        if print_ids:
            print(f"ids: {self.req.out}")
        sys.stdout.flush()


def report(out, tok, n_tok, eos, print_ids, as_json):
    texts = [tok.decode(o, skip_special_tokens=False) if tok is not None else None for o in out]
    results = [{"prompt_token_count": n, "completion_token_ids": o, "completion": t}
               for n, o, t in zip(n_tok, out, texts)]
    if as_json:
        doc = ({**results[0], "eos_token_ids": eos} if len(results) == 1
               else {"batch_size": len(results), "eos_token_ids": eos, "results": results})
        print(json.dumps(doc, ensure_ascii=False))
        return
    for i, r in enumerate(results):
        head = f"[{i}] " if len(results) > 1 else ""
        print(f"{head}{r['completion'] if r['completion'] is not None else '(no tokenizer)'}")
        if print_ids:
            print(f"{head}ids: {r['completion_token_ids']}")


# --------------------------------------------------------------------------------------------------
# --interactive: a chat whose cache is reused turn after turn


HELP = "commands: /reset (a new conversation), /image FILE (attach to the next turn), /exit (or Ctrl-D)"


def read_turn(intr: Interrupt) -> str | None:
    """Rank 0: the next line of stdin (None at its end, or on a SIGINT while waiting for it)."""
    if intr.tty:
        sys.stderr.write("> ")
        sys.stderr.flush()
    intr.reading = True
    try:
        line = sys.stdin.readline()
    except KeyboardInterrupt:
        return None
    finally:
        intr.reading = False
    if not line:
        return None
    return line.rstrip("\n").replace("\x03", "") if "\x03" not in line else ""  # a Ctrl-C in the line drops it


def interactive(s: Session) -> list:
    """Rank 0 reads each user turn and broadcasts it; every rank extends the conversation's slot with the tokens its
    cache does not hold yet (the engine keeps the longest common prefix of the rendered conversation)."""
    a, say = s.a, s.say
    load(s, "(interactive)")
    start_engine(s, 1, a.max_context)
    intr = Interrupt() if s.rank == 0 else None
    limit = s.eng.max_context - (a.speculative + 1 if a.speculative else 0)
    say(f"interactive: up to {limit} tokens of conversation; {HELP}")
    chat = {"messages": [], "blocks": [], "feats": []}  # the conversation: turns, image blocks, image features
    pending, answers = [], []  # /image files for the next turn; each turn's ids
    stop = frozenset() if a.ignore_eos else frozenset(s.eos)
    try:
        while True:
            cmd = None
            if s.rank == 0:
                line = read_turn(intr)
                word = "" if line is None else line.strip()
                cmd = (("exit",) if line is None or word == "/exit" else ("reset",) if word == "/reset"
                       else ("image", word[len("/image"):].strip()) if word.startswith("/image")
                       else ("help", word) if word.startswith("/") else ("say", line))
            cmd = broadcast(cmd, group=s.ctl)
            if cmd[0] == "exit":
                break
            if cmd[0] == "help":
                say(f"unknown command {cmd[1].split()[0]}; {HELP}")
                continue
            if cmd[0] == "reset":
                chat, pending = {"messages": [], "blocks": [], "feats": []}, []
                say("(a new conversation)")
                continue
            if cmd[0] == "image":
                if s.vl is None:
                    say("the shards hold a text-only model: /image is not available")
                elif not os.path.isfile(cmd[1]):
                    say(f"{cmd[1] or '/image'}: no such image file")
                else:
                    pending.append(cmd[1])
                    say(f"(image {cmd[1]} goes with the next turn)")
                continue
            text = cmd[1]
            if not text.strip():
                continue
            turn = None
            if s.rank == 0:
                try:
                    p, blocks = text_ids(s.tok, s.vl, text, pending, "this turn", a.raw_prompt, chat["messages"],
                                         chat["blocks"])
                    if len(p.ids) + a.max_new_tokens > limit:
                        raise UserError(f"this turn: the conversation ({len(p.ids)} tokens) + --max-new-tokens "
                                        f"{a.max_new_tokens} exceed the context of {limit} tokens; /reset starts a "
                                        "new conversation")
                    check_ids(p.ids, "this turn", s.cfg, a.max_new_tokens)
                    turn = (p, blocks)
                except UserError as e:
                    turn = str(e)
            turn = broadcast(turn)
            n_images, pending = len(pending), []
            if isinstance(turn, str):
                say(f"error: {turn}")
                continue
            p, blocks = turn
            with torch.inference_mode():
                f = s.model.image_features(**p.images) if p.images else None
            feats = chat["feats"] + ([f] if f is not None else [])
            req = E.Request(p.ids, a.max_new_tokens, stop, a.sampling, torch.cat(feats) if feats else None)
            stream = Stream(s, req) if s.rank == 0 else None
            if intr is not None:
                intr.clear()
            generate_and_report(s, [req], stream, intr, stoppable=True)
            if req.finish == "cancelled":
                say("(stopped)")
            answer = broadcast(s.tok.decode([t for t in req.out if t not in s.eos], skip_special_tokens=False)
                               if s.rank == 0 else None, group=s.ctl)
            content = IMAGE_MARKER * n_images + text
            chat = {"messages": chat["messages"] + [{"role": "user", "content": content},
                                                    {"role": "assistant", "content": answer}],
                    "blocks": blocks, "feats": feats}
            answers.append(req.out)
    finally:
        if intr is not None:
            intr.restore()
    return answers


# --------------------------------------------------------------------------------------------------
# the CLI


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one message from rank 0, after every rank agreed (see __main__)
        raise UserError(f"{self.prog}: {message}")

    def print_help(self, file=None):  # --help under torchrun: rank 0's text, once
        if os.environ.get("RANK", "0") == "0":
            super().print_help(file)


def parser() -> Parser:
    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp-dir", required=True, help="directory with config-r{rank}.json and model-r{rank}.safetensors")
    ap.add_argument("--prompt", help="user text; the chat template is applied unless --raw-prompt")
    ap.add_argument("--prompt-json", help=f"exact ids: {ID_FORMS}")
    ap.add_argument("--prompt-json-batch", help='[[ids...], ...] or {"prompts": [{"prompt_ids": [...], '
                    '"image_inputs": "file.safetensors"}, {"prompt": "text", "images": ["photo.jpg"]}, ...]}')
    ap.add_argument("--interactive", action="store_true", help="a multi-turn chat on stdin; answers stream; the "
                    "conversation's cache is reused turn after turn")
    ap.add_argument("--image", dest="images", action="append", metavar="FILE",
                    help="an image file for --prompt (repeatable, in order); each goes where the text has an "
                    f"{IMAGE_MARKER} marker, or before the text without markers")
    ap.add_argument("--save-image-inputs", metavar="OUT.safetensors",
                    help="also write the prepared image tensors there and the prompt ids to OUT.json")
    ap.add_argument("--image-inputs", help="safetensors with pixel_values [+ patch_pixel_values, num_patches] "
                    "or image_embeds, for --prompt / --prompt-json")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--ignore-eos", action="store_true",
                    help="generate exactly --max-new-tokens tokens per request, past any EOS (benchmarks, tests)")
    ap.add_argument("--prefill-chunk", type=int, default=E.PREFILL_CHUNK, metavar="N",
                    help=f"prefill at most N prompt tokens per engine step (bounds activation memory; default "
                    f"{E.PREFILL_CHUNK})")
    ap.add_argument("--max-batch", type=int, metavar="B", help="cache slots (requests decoded together; default: "
                    "the batch's size, 1 with --interactive)")
    ap.add_argument("--max-context", type=int, metavar="T", help="positions per slot (default: what fits in the "
                    "device's memory after the weights, capped at the config's max_position_embeddings)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample from softmax(logits / T); 0 (the default) is greedy decoding")
    ap.add_argument("--top-k", type=int, default=0, help="sample among the K most likely tokens (0: no limit; "
                    "needs --temperature)")
    ap.add_argument("--top-p", type=float, default=1.0, help="sample within the smallest set of most likely tokens "
                    "whose probability reaches P (1: no limit; needs --temperature)")
    ap.add_argument("--seed", type=int, default=0, help="seed of each request's random stream (default 0): the same "
                    "seed gives the same draws on the same device type, whatever the batch")
    ap.add_argument("--speculative", type=int, default=0, metavar="K",
                    help="draft K tokens per step with the checkpoint's MTP layers (1..3; shards converted with "
                    "--keep-mtp); greedy output is unchanged, sampled output keeps its distribution")
    ap.add_argument("--tokenizer", "--tokenizer-path", "--checkpoint", "--ckpt-path", dest="tokenizer",
                    help="tokenizer directory (default: tokenizer_files beside the TP dir); --checkpoint and "
                    "--ckpt-path name the original checkpoint directory, whose tokenizer files are used")
    ap.add_argument("--raw-prompt", action="store_true", help="tokenize the text as plain text, no chat template")
    ap.add_argument("--print-ids", action="store_true", help="also print the generated token ids")
    ap.add_argument("--json", dest="as_json", action="store_true", help="print one JSON document with ids and text")
    add_placement_flags(ap)
    return ap


def add_placement_flags(ap: argparse.ArgumentParser):
    """The flags of where the engine runs, generate.py's and serve.py's alike."""
    ap.add_argument("--ep-size", "--expert-parallel-size", dest="ep_size", type=int, default=None,
                    help="expert-parallel size; must equal the shards' expert_parallel_size (= TP), which is the "
                    "default")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false",
                    help="launch decode kernels eagerly instead of replaying captured CUDA graphs (debugging)")


def parse_cli(argv: list) -> dict:
    a = vars(parser().parse_args(argv))
    check_args(Args(**a))
    return a


def failure(e: Exception) -> tuple[str, bool]:
    """-> (what failed, in one line; whether another rank was lost). gloo raises plain RuntimeErrors whose first
    line is '[file:line] what happened. Advice...'."""
    text = str(e).splitlines()[0] if str(e) else ""
    if isinstance(e, dist.DistError) or "gloo" in text or "NCCL" in text:
        said = re.sub(r"^\[[^]]*\] ", "", text).split(". ")[0]
        return f"lost another rank ({said[:200]})", True
    return f"{type(e).__name__}: {text[:300]}", False


class Stdout:
    """sys.stdout that never raises: a reader that went away (`| head`) or a full disk must not end rank 0 mid-run,
    since the other ranks would then die in their next collective. What follows the first failure is dropped, and
    `lost` says why."""

    def __init__(self, stream):
        self.stream, self.lost = stream, None

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


def run_cli(argv: list, parse=parse_cli, run=main) -> int:
    """Parse, run, and end every rank alike: a bad flag or input prints one `error:` line on rank 0 (after every
    rank has agreed, so no rank can exit before it is printed) and every rank exits with EXIT_BAD_INPUT; Ctrl-C
    prints one line and exits with EXIT_INTERRUPTED. parse(argv) -> run's keyword arguments (UserError on a bad
    flag); serve.py passes its own pair."""
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


if __name__ == "__main__":
    code = run_cli(sys.argv[1:])
    # The process group is destroyed by now. Skip interpreter finalisation: with gloo, a worker thread that is still
    # being torn down then can abort the process ("terminate called without an active exception", seen about once
    # in 30 CPU runs) after a fully successful run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
