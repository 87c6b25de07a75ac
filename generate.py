"""Greedy generation with Step-5 on converted per-rank shards, under torchrun.

    torchrun --standalone --nproc-per-node=N generate.py --tp-dir OUT/tpN --ep-size N --prompt "..."
    torchrun ... generate.py --tp-dir OUT/tpN --prompt-json ids.json [--image-inputs image-inputs.safetensors]
    torchrun ... generate.py --tp-dir OUT/tpN --prompt-json-batch batch.json

TP comes from the shard config and must equal WORLD_SIZE. NCCL on GPUs, gloo on CPU. Rank 0 prepares the prompts
and prints; every rank validates what it receives. Any failure on any rank ends every rank with one message.
"""
import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import kernel
import config
import model as M

IMAGE_KEYS = ("pixel_values", "patch_pixel_values", "num_patches", "image_embeds")


class UserError(Exception):
    """Bad input: reported as one message naming the file, key or value."""


def agree(err: str | None):
    """Every rank learns whether any rank failed; all then stop with the first message (no rank left hanging)."""
    errs = [None] * dist.get_world_size()
    dist.all_gather_object(errs, err)
    first = next((e for e in errs if e), None)
    if first:
        raise UserError(first)


def load_tokenizer(path: str):
    """The converted tokenizer, loaded directly from tokenizer.json as a fast tokenizer (no class auto-selection:
    transformers 5.x maps the legacy class name to an implementation that mangles long byte-level BPE prompts)."""
    from transformers import PreTrainedTokenizerFast
    tj, tc = os.path.join(path, "tokenizer.json"), os.path.join(path, "tokenizer_config.json")
    for f in (tj, tc):
        if not os.path.isfile(f):
            raise UserError(f"{f}: missing (the tokenizer needs tokenizer.json and tokenizer_config.json)")
    try:
        with open(tc) as f:
            conf = json.load(f)
    except json.JSONDecodeError as e:
        raise UserError(f"{tc}: not valid JSON ({e})") from None
    special = {k: v for k, v in conf.items() if k in ("bos_token", "eos_token", "pad_token", "unk_token")
               and isinstance(v, str)}
    tok = PreTrainedTokenizerFast(tokenizer_file=tj, **special)
    template = conf.get("chat_template")
    jinja = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.isfile(jinja):
        with open(jinja) as f:
            template = f.read()
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
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e})") from None


def check_ids(ids, where: str, cfg: config.Step5Config, max_new_tokens: int) -> list:
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
    return ids


def prepare_requests(args, cfg: config.Step5Config, tok) -> list:
    """Rank 0: [(prompt ids, image-inputs path or None)], validated."""
    def chat(text):
        if tok is None:
            raise UserError("--prompt needs a tokenizer: none found in <tp-dir>/../tokenizer_files; pass --tokenizer")
        if args.raw_prompt:
            return tok(text, add_special_tokens=True)["input_ids"]
        if not tok.chat_template:
            raise UserError("the tokenizer has no chat template; use --raw-prompt to tokenize plain text")
        out = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    if args.prompt is not None:
        return [(check_ids(chat(args.prompt), "--prompt", cfg, args.max_new_tokens), args.image_inputs)]
    if args.prompt_json is not None:
        d = read_json(args.prompt_json)
        ids = d.get("prompt_ids") if isinstance(d, dict) else d
        return [(check_ids(ids, args.prompt_json, cfg, args.max_new_tokens), args.image_inputs)]
    d = read_json(args.prompt_json_batch)
    entries = d.get("prompts") if isinstance(d, dict) else d
    if not isinstance(entries, list) or not entries:
        raise UserError(f"{args.prompt_json_batch}: expected a non-empty list of requests or {{\"prompts\": [...]}}")
    base = os.path.dirname(os.path.abspath(args.prompt_json_batch))
    reqs = []
    for i, e in enumerate(entries):
        where = f"{args.prompt_json_batch}: request {i}"
        img = None
        if isinstance(e, dict):
            if "prompt" in e:
                ids = chat(e["prompt"])
            else:
                ids = e.get("prompt_ids")
            img = e.get("image_inputs")
            if img is not None:
                img = os.path.join(base, img)
        else:
            ids = e
        reqs.append((check_ids(ids, where, cfg, args.max_new_tokens), img))
    return reqs


def load_image_inputs(path: str) -> dict:
    """An image-inputs safetensors file -> the model's keyword arguments (same file on every rank)."""
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
    if "num_patches" in t:
        t["num_patches"] = t["num_patches"].long().flatten().tolist()
    return t


def main(tp_dir: str, prompt: str | None = None, prompt_json: str | None = None, prompt_json_batch: str | None = None,
         image_inputs: str | None = None, max_new_tokens: int = 128, ep_size: int = 8, tokenizer: str | None = None,
         raw_prompt: bool = False, print_ids: bool = False, as_json: bool = False, device: str = "auto",
         cuda_graph: bool = True):
    args = argparse.Namespace(**locals())
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        if v not in os.environ:
            raise UserError(f"environment variable {v} is not set: launch with torchrun "
                            "(e.g. torchrun --standalone --nproc-per-node=N generate.py ...)")
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    dev = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(minutes=30))
    try:
        out = _run(args, rank, world, dev)
        dist.barrier()  # no rank tears the group down while another still talks to it
        return out
    finally:
        if created:
            dist.destroy_process_group()


def _run(args, rank: int, world: int, dev: torch.device):
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if rank == 0 else (lambda *a: None)
    # 1. every rank: its own config, and the topology it implies
    err, cfg, vl = None, None, None
    try:
        cfg_path = os.path.join(args.tp_dir, f"config-r{rank}.json")
        cfg, vl, _ = config.load_config(cfg_path)
        if cfg.tp_size != world:
            raise UserError(f"{cfg_path}: tp_size={cfg.tp_size} but WORLD_SIZE={world}: run with "
                            f"--nproc-per-node={cfg.tp_size} (TP comes from the shards, there is no --tp-size)")
        if args.ep_size != cfg.expert_parallel_size:
            raise UserError(f"--ep-size {args.ep_size} does not match the shards' expert_parallel_size="
                            f"{cfg.expert_parallel_size} (co-located EP equals TP)")
        if args.max_new_tokens < 0:
            raise UserError(f"--max-new-tokens {args.max_new_tokens} must be >= 0")
        if args.image_inputs and vl is None:
            raise UserError(f"--image-inputs given but {cfg_path} is a text-only model")
    except (UserError, config.ConfigError) as e:
        err = str(e)
    agree(err)
    M.set_parallel(world, rank)

    # 2. rank 0: tokenizer, prompts, EOS set -> broadcast; every rank re-validates
    payload, err, tok = [None], None, None
    if rank == 0:
        try:
            try:
                tok = find_tokenizer(args.tp_dir, args.tokenizer)
            except UserError:
                if args.tokenizer or args.prompt is not None:
                    raise
                tok = None  # ids-only prompts: an auto-discovered tokenizer is optional
            reqs = prepare_requests(args, cfg, tok)
            eos = set(cfg.eos_token_id) | ({tok.eos_token_id} if tok is not None and tok.eos_token_id is not None
                                           else set())
            if not eos or any(not isinstance(e, int) or e < 0 for e in eos):
                raise UserError(f"invalid EOS id set {sorted(eos, key=str)}")
            payload = [(reqs, sorted(eos))]
        except (UserError, config.ConfigError) as e:
            err = str(e)
    agree(err)
    dist.broadcast_object_list(payload, src=0)
    reqs, eos = payload[0]
    err, images = None, None
    try:
        for i, (ids, img) in enumerate(reqs):
            check_ids(ids, f"request {i}", cfg, args.max_new_tokens)
            if img and vl is None:
                raise UserError(f"request {i} has image inputs ({img}) but the shards hold a text-only model")
        if any(img for _, img in reqs):
            images = [load_image_inputs(img) if img else None for _, img in reqs]
    except UserError as e:
        err = str(e)
    agree(err)
    n_tok = [len(ids) for ids, _ in reqs]
    say(f"loading Step-5 TP={world}, co-located EP={cfg.expert_parallel_size} on {dev.type} "
        + (f"({n_tok[0]} prompt tokens)" if len(reqs) == 1 else f"(batch={len(reqs)}, prompt tokens={n_tok})"))

    # 3. every rank: strict load of its shard
    t0, err, m = time.perf_counter(), None, None
    try:
        m = M.Step5ForCausalLM.from_shard(os.path.join(args.tp_dir, f"model-r{rank}.safetensors"), cfg, dev, vl)
    except (M.ShardError, config.ConfigError) as e:
        err = str(e)
    agree(err)
    kernel.set_backend(dev.type == "cuda")
    m.use_cuda_graph = args.cuda_graph
    say(f"loaded in {time.perf_counter() - t0:.1f} s; compute path: "
        + (f"Triton kernels (kernel.py), decode as {'a CUDA graph' if args.cuda_graph else 'eager launches'}"
           if dev.type == "cuda" else "PyTorch reference (CPU)"))

    # 4. image features per request (each request's placeholders are checked against its own rows)
    kw, err = {}, None
    try:
        if images is not None:
            feats = []
            for i, ((ids, _), img) in enumerate(zip(reqs, images)):
                f = m.image_embeds(**img) if img else None
                n = sum(t == vl.image_token_id for t in ids)
                rows = 0 if f is None else f.shape[0]
                if n != rows:
                    raise UserError(f"request {i}: {n} image placeholder(s) (id {vl.image_token_id}) but its image "
                                    f"inputs give {rows} feature row(s)")
                if f is not None:
                    feats.append(f)
            kw["image_embeds"] = torch.cat(feats)
    except (UserError, ValueError) as e:
        err = str(e)
    agree(err)

    # 5. generate
    out = m.generate_greedy([ids for ids, _ in reqs], args.max_new_tokens, eos, **kw)
    st = m.stats
    say(f"prefill: {st['prefill_tokens']} tokens in {st['prefill_s']:.3f} s "
        f"({st['prefill_tokens'] / max(st['prefill_s'], 1e-9):.1f} tok/s); decode: {st['decode_tokens']} tokens in "
        f"{st['decode_s']:.3f} s ({st['decode_tokens'] / max(st['decode_s'], 1e-9):.1f} tok/s)")
    if rank == 0:
        texts = [tok.decode(o, skip_special_tokens=False) if tok is not None else None for o in out]
        results = [{"prompt_token_count": n, "completion_token_ids": o, "completion": t}
                   for n, o, t in zip(n_tok, out, texts)]
        if args.as_json:
            doc = ({**results[0], "eos_token_ids": eos} if len(results) == 1
                   else {"batch_size": len(results), "eos_token_ids": eos, "results": results})
            print(json.dumps(doc, ensure_ascii=False))
        else:
            for i, r in enumerate(results):
                head = f"[{i}] " if len(results) > 1 else ""
                print(f"{head}{r['completion'] if r['completion'] is not None else '(no tokenizer)'}")
                if args.print_ids:
                    print(f"{head}ids: {r['completion_token_ids']}")
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp-dir", required=True, help="directory with config-r{rank}.json and model-r{rank}.safetensors")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="user text; the chat template is applied unless --raw-prompt")
    src.add_argument("--prompt-json", help='exact ids: [ids...] or {"prompt_ids": [ids...]}')
    src.add_argument("--prompt-json-batch", help='[[ids...], ...] or {"prompts": [{"prompt_ids": [...], '
                     '"image_inputs": "file.safetensors"}, {"prompt": "text"}, ...]}')
    ap.add_argument("--image-inputs", help="safetensors with pixel_values [+ patch_pixel_values, num_patches] "
                    "or image_embeds, for --prompt / --prompt-json")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--ep-size", "--expert-parallel-size", dest="ep_size", type=int, default=8,
                    help="must equal the shards' expert_parallel_size (= TP)")
    ap.add_argument("--tokenizer", "--tokenizer-path", "--checkpoint", "--ckpt-path", dest="tokenizer",
                    help="tokenizer directory, e.g. the original checkpoint (default: tokenizer_files beside the "
                    "TP dir)")
    ap.add_argument("--raw-prompt", action="store_true", help="tokenize --prompt as plain text, no chat template")
    ap.add_argument("--print-ids", action="store_true", help="also print the generated token ids")
    ap.add_argument("--json", dest="as_json", action="store_true", help="print one JSON document with ids and text")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false",
                    help="launch decode kernels eagerly instead of replaying a captured CUDA graph (debugging)")
    a = ap.parse_args()
    if a.raw_prompt and a.prompt is None:
        ap.error("--raw-prompt is only valid with --prompt")
    if a.image_inputs and a.prompt_json_batch:
        ap.error("--image-inputs applies to --prompt / --prompt-json; name image files inside the batch JSON instead")
    code = 0
    try:
        main(**vars(a))
    except UserError as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {e}", file=sys.stderr)
        code = 2
    # The process group is destroyed by now. Skip interpreter finalisation: with gloo, a worker thread that is still
    # being torn down then can abort the process ("terminate called without an active exception", seen about once
    # in 30 CPU runs) after a fully successful run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
