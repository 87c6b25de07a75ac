"""Convert an original Step-5 checkpoint into per-rank TP/EP shards (layout "gqa-provider-shared-tp-v2").

    python convert.py --checkpoint CKPT --out-dir OUT --tp-size 8 --ep-size 8 [--check-only]

Writes OUT/tp{N}/model-r{rank}.safetensors, OUT/tp{N}/config-r{rank}.json, OUT/tp{N}/README.md and one shared
OUT/tokenizer_files/. Before converting (and alone, with --check-only) it checks the checkpoint against its config
from the safetensors headers only. Shards are streamed tensor by tensor, so host memory tracks the largest single
tensor rather than the checkpoint, and every floating tensor is checked for NaN/Inf on the way. Each shard's sha256 is
recorded beside it (model-r{rank}.safetensors.sha256) while it is written, with the size, mtime, ctime and inode of
each source file it was read from (model-r{rank}.safetensors.source.json), and read back before PASS. A rerun keeps a
shard only if its header matches, its bytes still hash to that value (re-hashing is skipped with
--no-verify-existing) and its source is unchanged: the same file stats, or, where they differ or are not recorded,
source slices that read again give the same sha256. It rewrites the rest. One run at a time per OUT (a lock file).
MTP layers (index >= num_hidden_layers) are dropped unless --keep-mtp writes them into every rank's shard for
speculative decoding.
"""
import argparse
import contextlib
import fcntl
import hashlib
import json
import math
import os
import re
import secrets
import socket
import struct
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import groupby

import numpy as np
import torch
from safetensors import safe_open

from config import (LAYOUT_VERSION, ConfigError, DuplicateKey, Step5Config, Step5VLConfig, group_window, parse_config,
                    unique_keys)

INDEX = "model.safetensors.index.json"
LOCK = ".convert.lock"  # in OUT: held (flock) by the one run converting into OUT
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "added_tokens.json")
ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "BF16": 2, "F16": 2, "I16": 2, "U16": 2,
            "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}
VISION_PREFIXES = ("vision_model.", "vit_large_projector.")
LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")

# Sharding rules of the layout, matched as substrings, first match wins (so ".sparse_indexer_" replicates only what
# the q/w rules above it left). ("split", d): cut dim d into tp equal pieces; ("group", key): keep the group_window
# rows of G groups (G from the config key); ("full",): replicate. A text name no rule matches is an error.
RULES = [(".self_attn.q_proj.weight", ("split", 0)), (".self_attn.g_proj.weight", ("split", 0)),
         (".self_attn.o_proj.weight", ("split", 1)),
         (".self_attn.k_proj.weight", ("group", "kv")), (".self_attn.v_proj.weight", ("group", "kv")),
         (".mlp.gate_proj.weight", ("split", 0)), (".mlp.up_proj.weight", ("split", 0)),
         (".mlp.down_proj.weight", ("split", 1))]
RULES += [(f".moe.{w}_proj.{s}", ("split", 0)) for w in ("gate", "up", "down") for s in ("weight", "weight_scale_inv")]
RULES += [(".moe.gate.weight", ("full",)), (".moe.router_bias", ("full",)),
          (".share_expert.gate_proj.weight", ("split", 0)), (".share_expert.up_proj.weight", ("split", 0)),
          (".share_expert.down_proj.weight", ("split", 1)),
          (".sparse_indexer_q.weight", ("group", "provider")), (".sparse_indexer_w.weight", ("group", "provider")),
          (".sparse_indexer_", ("full",)), (".ssmax_s", ("full",)),
          (".q_norm.weight", ("full",)), (".k_norm.weight", ("full",)), (".k_norm.bias", ("full",)),
          (".input_layernorm.weight", ("full",)), (".post_attention_layernorm.weight", ("full",)),
          ("model.embed_tokens.weight", ("full",)), ("model.norm.weight", ("full",)), ("lm_head.weight", ("full",))]
# MTP layers (--keep-mtp) are sliding-attention layers with a dense MLP, so the rules above shard their attention, MLP
# and norms; these cover the rest. Each MTP layer's own head is stored as this rank's contiguous vocabulary rows, not
# whole like lm_head, so the kept layers cost a rank V/tp head rows each instead of V.
RULES += [(".eh_proj.weight", ("full",)), (".enorm.weight", ("full",)), (".hnorm.weight", ("full",)),
          (".transformer.shared_head.norm.weight", ("full",)), (".transformer.shared_head.output.weight", ("split", 0))]


class BadFile(Exception):
    """A safetensors file whose header cannot be trusted; the message names the file."""


@dataclass
class TInfo:
    file: str      # file name inside the checkpoint dir (from the index)
    key: str       # on-disk tensor name
    dtype: str
    shape: list
    start: int     # absolute byte offset of the data in the file


def read_header(path: str) -> tuple[dict, dict, int]:
    """(entries, metadata, header bytes) of a safetensors file, reading only the header, checked as the safetensors
    library checks it when it opens the file: the tensors' data_offsets tile the data section from 0 without gaps or
    overlaps, the data section is exactly that long (a truncated or padded file is caught without touching the data),
    the metadata maps strings to strings, and the path is UTF-8."""
    try:
        os.fsencode(path).decode()
    except UnicodeDecodeError:
        raise BadFile(f"{path!r}: the safetensors library opens only UTF-8 paths; rename it") from None
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise BadFile(f"{path}: {size} bytes, too short for a safetensors header")
            n = struct.unpack("<Q", raw)[0]
            if n > size - 8:
                raise BadFile(f"{path}: header length {n} exceeds the file size {size}")
            header = json.loads(f.read(n), object_pairs_hook=unique_keys)
    except OSError as e:
        raise BadFile(f"{path}: cannot read ({e.strerror})") from None
    except DuplicateKey as e:
        raise BadFile(f"{path}: header: {e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadFile(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise BadFile(f"{path}: header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise BadFile(f"{path}: header: __metadata__ must map strings to strings, got {json.dumps(meta)[:200]}")
    spans = []
    for name, e in header.items():
        try:
            b, t = e["data_offsets"]
            shape = e["shape"]
            if not all(type(x) is int and x >= 0 for x in (b, t, *shape)):
                raise TypeError
            want = math.prod(shape) * ITEMSIZE[e["dtype"]]
        except (KeyError, TypeError, ValueError):
            raise BadFile(f"{path}: malformed header entry for {name}: {json.dumps(e)[:200]}") from None
        if t - b != want:
            raise BadFile(f"{path}: {name} has data_offsets {[b, t]} for {want} bytes of {e['dtype']} {e['shape']}")
        spans.append((b, t, name))
    end = 0
    for b, t, name in sorted(spans):
        if b != end:
            raise BadFile(f"{path}: {name} has data_offsets {[b, t]}: "
                          f"{'it overlaps the tensor before it' if b < end else f'bytes {end}..{b - 1} belong to no tensor'}")
        end = t
    if end != size - 8 - n:
        raise BadFile(f"{path}: data section is {size - 8 - n} bytes but the header describes {end} "
                      f"({'truncated' if end > size - 8 - n else 'trailing bytes'})")
    return header, meta, 8 + n


def load_json(path: str) -> dict:
    if os.path.isdir(path):
        raise SystemExit(f"error: {path}: is a directory, not a JSON file")
    try:
        with open(path) as f:
            d = json.load(f, object_pairs_hook=unique_keys)
    except FileNotFoundError:
        raise SystemExit(f"error: {path}: no such file") from None
    except DuplicateKey as e:
        raise SystemExit(f"error: {path}: {e}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SystemExit(f"error: {path}: not readable JSON ({e})") from None
    if not isinstance(d, dict):
        raise SystemExit(f"error: {path}: expected a JSON object")
    return d


@contextlib.contextmanager
def naming(path: str):
    """An OSError while reading or writing `path` ends the run with one line naming it: the OS gives write() and
    fsync() errors (disk full, quota, a file size limit) no file name, and a temporary name means nothing to users."""
    try:
        yield
    except OSError as e:
        raise SystemExit(f"error: {path}: {e.strerror or e}") from None


def is_mtp(name: str, tc: Step5Config) -> bool:
    m = LAYER_RE.match(name)
    return bool(m) and int(m.group(1)) >= tc.num_hidden_layers


def expected_tensors(tc: Step5Config, vl: Step5VLConfig | None, mtp: int = 0) -> dict:
    """name -> (shape, dtype) the config implies: the text model's tensors, the first `mtp` MTP layers' 17 each and,
    for a VL checkpoint, the vision tower's and projector's (all BF16)."""
    D, V, H, G, hd = tc.hidden_size, tc.vocab_size, tc.num_attention_heads, tc.num_attention_groups, tc.head_dim
    E, F, S, I = tc.moe_num_experts, tc.moe_intermediate_size, tc.share_expert_dim, tc.intermediate_size
    fp8 = tc.config_fp8_layers()
    blk = (tc.quantization_config or {}).get("weight_block_size", [128, 128])
    e = {"model.embed_tokens.weight": ([V, D], "BF16"), "model.norm.weight": ([D], "F32"),
         "lm_head.weight": ([V, D], "BF16")}
    for i in range(tc.num_hidden_layers + mtp):
        p = f"model.layers.{i}."
        for k, shape in (("input_layernorm.weight", [D]), ("post_attention_layernorm.weight", [D]),
                         ("self_attn.q_norm.weight", [hd]), ("self_attn.k_norm.weight", [hd])):
            e[p + k] = (shape, "F32")
        for k, shape in (("q_proj", [H * hd, D]), ("k_proj", [G * hd, D]), ("v_proj", [G * hd, D]),
                         ("o_proj", [D, H * hd]), ("g_proj", [H, D])):
            e[p + f"self_attn.{k}.weight"] = (shape, "BF16")
        if i >= tc.num_hidden_layers:  # MTP (§3.6 gives shapes; dtypes as the main layers': norms F32, linears BF16)
            e.update({p + "eh_proj.weight": ([D, 2 * D], "BF16"), p + "enorm.weight": ([D], "F32"),
                      p + "hnorm.weight": ([D], "F32"), p + "transformer.shared_head.norm.weight": ([D], "F32"),
                      p + "transformer.shared_head.output.weight": ([V, D], "BF16")})
        elif tc.is_dsa(i):
            P, IH, a = tc.sparse.proxy_dim, tc.sparse.n_heads, p + "self_attn."
            e.update({a + "sparse_indexer_q.weight": ([IH * P, D], "BF16"), a + "sparse_indexer_k.weight": ([P, D], "BF16"),
                      a + "sparse_indexer_z.weight": ([P, D], "BF16"), a + "sparse_indexer_w.weight": ([IH, D], "F32"),
                      a + "sparse_indexer_q_norm.weight": ([P], "F32"), a + "sparse_indexer_k_norm.weight": ([P], "F32"),
                      a + "sparse_indexer_k_norm.bias": ([P], "F32"), a + "ssmax_s": ([H], "F32")})
        if not tc.is_moe(i):
            for k, shape in (("gate_proj", [I, D]), ("up_proj", [I, D]), ("down_proj", [D, I])):
                e[p + f"mlp.{k}.weight"] = (shape, "BF16")
            continue
        e[p + "moe.gate.weight"] = ([E, D], "BF16")
        e[p + "moe.router_bias"] = ([E], "F32")
        for k, (n, m) in (("gate_proj", (F, D)), ("up_proj", (F, D)), ("down_proj", (D, F))):
            e[p + f"moe.{k}.weight"] = ([E, n, m], "F8_E4M3" if i in fp8 else "BF16")
            if i in fp8:
                e[p + f"moe.{k}.weight_scale_inv"] = ([E, -(-n // blk[0]), -(-m // blk[1])], "F32")
        for k, shape in (("gate_proj", [S, D]), ("up_proj", [S, D]), ("down_proj", [D, S])):
            e[p + f"share_expert.{k}.weight"] = (shape, "BF16")
    if vl is not None:
        v = vl.vision
        W, Hm, P, C = v.width, v.mlp_hidden, v.patch_size, v.num_channels
        e.update({"vision_model.conv1.weight": ([W, C, P, P], "BF16"),
                  "vision_model.positional_embedding": ([v.grid * v.grid, W], "BF16"),
                  "vision_model.ln_pre.weight": ([W], "BF16"), "vision_model.ln_pre.bias": ([W], "BF16"),
                  "vision_model.vit_downsampler1.weight": ([2 * W, W, 3, 3], "BF16"),
                  "vision_model.vit_downsampler1.bias": ([2 * W], "BF16"),
                  "vision_model.vit_downsampler2.weight": ([4 * W, 2 * W, 3, 3], "BF16"),
                  "vision_model.vit_downsampler2.bias": ([4 * W], "BF16"),
                  "vit_large_projector.weight": ([D, 4 * W], "BF16")})
        for b in range(v.layers):
            p = f"vision_model.transformer.resblocks.{b}."
            for k, shape in (("ln_1.weight", [W]), ("ln_1.bias", [W]), ("attn.in_proj_weight", [3 * W, W]),
                             ("attn.in_proj_bias", [3 * W]), ("attn.out_proj.weight", [W, W]),
                             ("attn.out_proj.bias", [W]), ("ls_1.gamma", [W]), ("ln_2.weight", [W]),
                             ("ln_2.bias", [W]), ("mlp.c_fc.weight", [Hm, W]), ("mlp.c_fc.bias", [Hm]),
                             ("mlp.c_proj.weight", [W, Hm]), ("mlp.c_proj.bias", [W]), ("ls_2.gamma", [W])):
                e[p + k] = (shape, "BF16")
    return e


def split_problems(tc: Step5Config, tp: int) -> list[str]:
    """Every way tp fails to divide the geometry (the runtime's own validate() stops at the first)."""
    out = []
    dims = [("num_attention_heads", tc.num_attention_heads), ("intermediate_size", tc.intermediate_size),
            ("vocab_size", tc.vocab_size)]
    if tc.moe_layers:
        dims += [("moe_num_experts", tc.moe_num_experts), ("share_expert_dim", tc.share_expert_dim)]
    out += [f"tp_size={tp} does not divide {k}={n}" for k, n in dims if n % tp]
    groups = [("num_attention_groups", tc.num_attention_groups)]
    if tc.sparse:
        groups.append(("sparse_config.num_provider_groups", tc.sparse.n_provider_groups))
    for k, g in groups:
        try:
            group_window(g, tp, 0)
        except ConfigError:
            out.append(f"tp_size={tp} neither divides nor is a multiple of {k}={g}")
    if not out and (tc.num_attention_heads // tp) % group_window(tc.num_attention_groups, tp, 0)[1]:
        out.append(f"tp_size={tp}: {tc.num_attention_heads // tp} local query heads do not divide over the local KV groups")
    return out


@dataclass
class Source:
    path: str
    raw: dict
    tc: Step5Config
    vl: Step5VLConfig | None
    tensors: dict   # output name -> TInfo; of the MTP layers only those kept
    n_mtp: int      # MTP tensors skipped
    mtp: int        # MTP layers kept (--keep-mtp: num_nextn_predict_layers; else 0)
    warnings: list  # printed once, with the audit's or the conversion's result


def out_dir_problems(ckpt: str, out_dir: str, tp: int) -> list[str]:
    """Conversion writes files directly into OUT (its lock), OUT/tpN and OUT/tokenizer_files, and nowhere else; none of
    the three may be the checkpoint directory or lie inside it (a checkpoint named tp8 under OUT is OUT/tp8). An OUT
    that only contains the checkpoint (--checkpoint /data/X --out-dir /data) is fine: the outputs land beside it.
    Real paths, so a symlinked OUT, OUT/tpN or OUT/tokenizer_files counts as its target."""
    src, found = os.path.realpath(ckpt), []
    for p in (out_dir, os.path.join(out_dir, f"tp{tp}"), os.path.join(out_dir, "tokenizer_files")):
        real = os.path.realpath(p)
        if os.path.commonpath([src, real]) == src:
            found.append((real != src, p, real, "is" if real == src else "is inside"))
    if not found:
        return []
    _, p, real, how = min(found)  # the most direct relation names the problem best
    shown = p if real == os.path.abspath(p) else f"{p} (-> {real})"
    return [f"--out-dir {out_dir}: the output {shown} {how} the checkpoint directory {src}; conversion would write "
            "into the source, choose an --out-dir outside it"]


def tokenizer_problems(ckpt: str) -> list[str]:
    """The tokenizer files conversion copies must be what generate.py can load: UTF-8 text, JSON where named .json
    (a truncated download or a file saved in another encoding would only fail at the first prompt)."""
    out = []
    for f in TOKENIZER_FILES:
        path = os.path.join(ckpt, f)
        if os.path.isdir(path):
            out.append(f"{f}: is a directory, not a file")
            continue
        try:
            with open(path, "rb") as fh:
                text = fh.read().decode("utf-8")
            if f.endswith(".json"):
                json.loads(text)
        except FileNotFoundError:
            continue
        except OSError as e:
            out.append(f"{f}: cannot read ({e.strerror})")
        except UnicodeDecodeError as e:
            out.append(f"{f}: not UTF-8 text ({e})")
        except json.JSONDecodeError as e:
            out.append(f"{f}: not valid JSON ({e})")
    return out


def audit(ckpt: str, tp: int, out_dir: str | None = None, keep_mtp: bool = False) -> Source:
    """Header-only check of a checkpoint against its config. Prints what was checked; exits listing every problem."""
    if os.path.isfile(ckpt):
        raise SystemExit(f"error: --checkpoint {ckpt} is a file, not a directory (give the directory that holds "
                         "config.json)")
    if not os.path.isdir(ckpt):
        raise SystemExit(f"error: checkpoint directory {ckpt} does not exist")
    raw = load_json(os.path.join(ckpt, "config.json"))
    try:
        tc, vl = parse_config(raw, os.path.join(ckpt, "config.json"))
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    wm = load_json(os.path.join(ckpt, INDEX)).get("weight_map")
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise SystemExit(f"error: {os.path.join(ckpt, INDEX)}: no weight_map of tensor name -> file name")
    problems, headers = [], {}
    for fname in sorted(set(wm.values())):
        path = os.path.join(ckpt, fname)
        if os.path.basename(fname) != fname:
            problems.append(f"{INDEX}: file name {fname!r} is not a plain file name inside the checkpoint")
        elif not os.path.isfile(path):
            how = "is a directory, not a safetensors file" if os.path.isdir(path) else "missing"
            problems.append(f"{fname}: named by {INDEX} for {sum(v == fname for v in wm.values())} tensors but {how}")
        else:
            try:
                headers[fname] = read_header(path)
            except BadFile as e:
                problems.append(str(e))
    L, tensors, n_mtp, unverified = tc.num_hidden_layers, {}, 0, set()
    mtp = tc.num_nextn_predict_layers if keep_mtp else 0
    if keep_mtp and not mtp:  # an error, not a warning: shards lacking what was asked for would fail later, at load
        problems.append("--keep-mtp: num_nextn_predict_layers=0 in config.json, the checkpoint declares no MTP layers "
                        "to keep (convert without --keep-mtp)")
    for key, fname in sorted(wm.items()):
        m = LAYER_RE.match(key)
        if m and int(m.group(1)) >= L + mtp:
            n_mtp += 1
            continue
        # some packagings prefix the vision tower and projector with "model."; the shards use one spelling
        name = key[len("model."):] if key.startswith("model.") and key[6:].startswith(VISION_PREFIXES) else key
        if fname not in headers:
            unverified.add(name)
        elif key not in headers[fname][0]:
            problems.append(f"{key}: {INDEX} places it in {fname}, whose header has no such tensor")
            unverified.add(name)
        elif name in tensors:
            problems.append(f"{key}: listed twice (with and without the 'model.' prefix)")
        else:
            h = headers[fname][0][key]
            tensors[name] = TInfo(fname, key, h["dtype"], list(h["shape"]), headers[fname][2] + h["data_offsets"][0])
    expected = expected_tensors(tc, vl, mtp)
    for name, (shape, dtype) in expected.items():
        t = tensors.get(name)
        if t is None:
            if name not in unverified:
                problems.append(f"{name}: missing (expected {dtype} {shape})")
        elif t.shape != shape or t.dtype != dtype:
            problems.append(f"{name} in {t.file}: {t.dtype} {t.shape}, expected {dtype} {shape}")
    problems += [f"{n} in {t.file}: unexpected tensor ({t.dtype} {t.shape})" for n, t in tensors.items() if n not in expected]
    n_fp8 = 0
    for name, t in tensors.items():
        if t.dtype.startswith("F8_"):
            n_fp8 += 1
            # 128 x 128 blocks: config.parse_config refuses any other weight_block_size
            s, grid = tensors.get(name + "_scale_inv"), [*t.shape[:-2], -(-t.shape[-2] // 128), -(-t.shape[-1] // 128)]
            if s is None:  # absent, or in an unreadable file (already a problem of its own)
                if name + "_scale_inv" not in unverified:
                    problems.append(f"{name} in {t.file}: FP8 weight without its {name}_scale_inv")
            elif s.shape != grid or s.dtype != "F32":
                problems.append(f"{name}_scale_inv in {s.file}: {s.dtype} {s.shape}, expected F32 {grid} for {t.shape}")
    # experts in an unreadable file (already a problem) are unknown, not BF16: no second, false disagreement
    unknown = {i for i in tc.moe_layers if any(n.startswith(f"model.layers.{i}.moe.") for n in unverified)}
    have = {i for i in tc.moe_layers if f"model.layers.{i}.moe.gate_proj.weight_scale_inv" in tensors} - unknown
    want = tc.config_fp8_layers()
    for i in sorted((have ^ want) - unknown):
        problems.append(f"model.layers.{i}.moe: experts are {'FP8' if i in have else 'BF16'} in the checkpoint "
                        f"(gate_proj.weight_scale_inv {'present' if i in have else 'absent'}) but quantization_config "
                        f"declares {'FP8' if i in want else 'BF16'}")
    problems += split_problems(tc, tp)
    if out_dir:
        problems += out_dir_problems(ckpt, out_dir, tp)
    ignored = sorted(f for f in os.listdir(ckpt) if f.endswith(".safetensors") and f not in wm.values())
    kept = f"{sum(is_mtp(n, tc) for n in tensors)} MTP tensors kept (layers {L}..{L + mtp - 1}), " if mtp else ""
    print(f"checked {ckpt}: {'composite VL' if vl else 'text-only'} config ({raw.get('model_type')}), "
          f"{len(wm)} indexed tensors in {len(set(wm.values()))} files (headers only; not indexed, ignored: "
          f"{', '.join(ignored) or 'none'}); {len(expected)} expected tensors by name/shape/dtype, {kept}"
          f"{n_mtp} MTP tensors skipped; FP8 experts on MoE layers {sorted(have) or 'none'}"
          f"{f' (not checked: {str(sorted(unknown))[1:-1]}, whose tensors could not be read)' if unknown else ''}, "
          f"{n_fp8} FP8 scale grids; "
          f"TP=EP={tp} split of heads, KV/provider groups, dense/shared widths, experts, vocab")
    problems += tokenizer_problems(ckpt)
    # not an error: prompts given as token ids need no tokenizer
    no_tok = [f for f in ("tokenizer.json", "tokenizer_config.json") if not os.path.exists(os.path.join(ckpt, f))]
    warnings = [f"warning: {ckpt} has no {' or '.join(no_tok)}: generate.py --prompt will fail without "
                "--tokenizer DIR (token-id prompts still work)"] if no_tok else []
    if problems:
        raise SystemExit(f"error: {len(problems)} problem(s) in {ckpt}:\n" + "\n".join(f"  {p}" for p in problems))
    return Source(ckpt, raw, tc, vl, tensors, n_mtp, mtp, warnings)


def fingerprint(src: Source) -> str:
    """The conversion's identity, for the shard metadata and every config-r{rank}.json (model.py and generate.py
    compare them): config, tensor inventory and the first bytes of every converted tensor (a few KB of reads), so a
    checkpoint with the same geometry but other weights gets another value. Kept MTP tensors count when --keep-mtp
    keeps them; without the flag the value is the one earlier conversions wrote. It samples the weights, so it does
    not decide alone whether a shard may be kept: each shard's SourceRecord does (see judge_existing)."""
    h = hashlib.sha256(json.dumps(src.raw, sort_keys=True).encode())
    body = sorted(src.tensors.items(), key=lambda kv: (kv[1].file, kv[0]))  # holds only the MTP layers kept
    for fname, group in groupby(body, lambda kv: kv[1].file):
        with open(os.path.join(src.path, fname), "rb") as f:
            for name, t in group:
                f.seek(t.start)
                h.update(json.dumps([name, t.key, t.dtype, t.shape]).encode() + f.read(64))
    return h.hexdigest()[:32]


@dataclass
class Piece:
    name: str
    src: TInfo
    sel: tuple | None   # (dim, begin, end) or None for the whole tensor
    shape: list
    rule: str


@dataclass(frozen=True)
class FileStat:
    """What the filesystem says about a source file. Writing a file, or putting an old mtime back with os.utime
    (touch -r, a copy keeping times), sets its ctime to the current time, and nothing sets it to another value; a
    replaced file has another inode. So while all four are equal, the file holds the bytes read when they were taken,
    short of damage below the filesystem (only a full re-read would see that)."""
    size: int
    mtime_ns: int
    ctime_ns: int
    inode: int

    @classmethod
    def of(cls, path: str) -> "FileStat":
        st = os.stat(path)
        return cls(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


@dataclass
class SourceRecord:
    """What a shard was made of, written beside it as model-r{rank}.safetensors.source.json: its sha256 and the
    FileStat of every source file it was read from, taken as they were read."""
    sha256: str
    files: dict  # source file name -> FileStat

    def dumps(self) -> bytes:
        files = {f: vars(st) for f, st in sorted(self.files.items())}
        return (json.dumps({"sha256": self.sha256, "files": files}, indent=1) + "\n").encode()

    @classmethod
    def load(cls, path: str) -> "SourceRecord":
        """The record, or ValueError saying why there is none to trust."""
        name = os.path.basename(path)
        try:
            with open(path) as f:
                d = json.load(f)
            rec = cls(d["sha256"], {k: FileStat(**v) for k, v in d["files"].items()})
        except FileNotFoundError:
            raise ValueError(f"no source record ({name} missing)") from None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{name} unreadable ({type(e).__name__}: {e})") from None
        if not isinstance(rec.sha256, str) or not re.fullmatch(r"[0-9a-f]{64}", rec.sha256):
            raise ValueError(f"{name} holds no sha256")
        return rec


def rank_plan(src: Source, tp: int, rank: int) -> list[Piece]:
    """This rank's tensors in file order: widest dtype first so every tensor stays aligned without padding."""
    G = {"kv": src.tc.num_attention_groups, "provider": src.tc.sparse.n_provider_groups if src.tc.sparse else 0}
    plan = []
    for name, t in src.tensors.items():
        rule = ("full",) if name.startswith(VISION_PREFIXES) else next((r for s, r in RULES if s in name), None)
        if rule is None:
            raise SystemExit(f"error: {name}: no sharding rule matches this tensor")
        sel = None
        if rule[0] == "split":
            n = t.shape[rule[1]] // tp
            sel = (rule[1], rank * n, (rank + 1) * n)
        elif rule[0] == "group":
            first, count = group_window(G[rule[1]], tp, rank)
            rows = t.shape[0] // G[rule[1]]
            sel = (0, first * rows, (first + count) * rows)
        shape = list(t.shape)
        if sel:
            shape[sel[0]] = sel[2] - sel[1]
        how = {"full": "replicated", "split": "split dim {}", "group": "group window of {} groups, dim 0"}[rule[0]]
        plan.append(Piece(name, t, sel, shape, how.format(rule[1] if rule[0] == "split" else G.get(rule[-1]))))
    return sorted(plan, key=lambda p: (-ITEMSIZE[p.src.dtype], p.src.file, p.name))


def shard_header(plan: list[Piece], meta: dict) -> tuple[bytes, int]:
    """safetensors header bytes (padded with spaces to 8-byte alignment) and the total file size."""
    entries, off = {"__metadata__": meta}, 0
    for p in plan:
        n = math.prod(p.shape) * ITEMSIZE[p.src.dtype]
        entries[p.name] = {"dtype": p.src.dtype, "shape": p.shape, "data_offsets": [off, off + n]}
        off += n
    js = json.dumps(entries, separators=(",", ":")).encode()
    js += b" " * (-len(js) % 8)
    return struct.pack("<Q", len(js)) + js, 8 + len(js) + off


# A float is NaN or Inf exactly when all bits of its exponent field are set (e4m3fn has no Inf: its NaNs 0x7F / 0xFF
# are the codes with exponent and mantissa all set). dtype -> (that bit pattern E, same-width signed and unsigned ints).
NON_FINITE = {torch.float64: (0x7FF0000000000000, np.int64, np.uint64),
              torch.float32: (0x7F800000, np.int32, np.uint32), torch.float16: (0x7C00, np.int16, np.uint16),
              torch.bfloat16: (0x7F80, np.int16, np.uint16), torch.float8_e4m3fn: (0x7F, np.int8, np.uint8),
              torch.float8_e5m2: (0x7C, np.int8, np.uint8)}


def first_non_finite(t: torch.Tensor) -> int | None:
    """Flat index of the first NaN/Inf element of a contiguous tensor (None: all finite, or not a float dtype).

    E is the run of bits just below the sign, so a code with the sign clear is non-finite iff, as a signed integer,
    it is >= E, and one with the sign set iff, as an unsigned integer, it is >= sign | E. Two max-reductions over the
    raw bits then decide, with no temporary array: several times faster than torch.isfinite on BF16 on CPU, and FP8
    has no isfinite at all. Only a tensor that fails pays for locating its first bad element."""
    if t.dtype not in NON_FINITE or t.numel() == 0:
        return None
    e, signed, unsigned = NON_FINITE[t.dtype]
    raw = t.reshape(-1).view(torch.uint8).numpy()
    s, u = raw.view(signed), raw.view(unsigned)
    neg = unsigned(e | 1 << (8 * u.itemsize - 1))
    if s.max() < e and u.max() < neg:
        return None
    return int(np.flatnonzero((s >= e) | (u >= neg))[0])


def source_index(p: Piece, flat: int) -> list[int]:
    """The source tensor's index of element `flat` of piece p (its slice, shifted by the slice's start)."""
    idx = list(np.unravel_index(flat, p.shape)) if p.shape else []
    if p.sel:
        idx[p.sel[0]] += p.sel[1]
    return [int(i) for i in idx]


def read_pieces(src: Source, plan: list[Piece], stats: dict):
    """Each piece's bytes, in plan order: one tensor (or slice) at a time through the memory map, one source file
    mapped at a time (so mapped pages do not pile up across the checkpoint), each checked finite on the way. Fills
    stats with each file's FileStat as first read, and stops if a file changes while it is read."""
    for fname, pieces in groupby(plan, lambda p: p.src.file):
        fpath = os.path.join(src.path, fname)
        with naming(fpath):
            # stat before opening: a file replaced in between then shows as a changed inode at the end
            seen = stats.setdefault(fname, FileStat.of(fpath))
            with safe_open(fpath, framework="pt") as f:
                for p in pieces:
                    if p.sel is None:
                        t = f.get_tensor(p.src.key)
                    else:
                        d, b, e = p.sel
                        sl = f.get_slice(p.src.key)
                        t = sl[b:e] if d == 0 else sl[:, b:e]
                    if list(t.shape) != p.shape:  # the header was planned from the source headers read earlier
                        raise SystemExit(f"error: {fname}: {p.src.key} changed during the conversion")
                    t = t.contiguous()
                    bad = first_non_finite(t)
                    if bad is not None:
                        raise SystemExit(f"error: {fname}: {p.src.key} holds a non-finite value "
                                         f"({float(t.reshape(-1)[bad].float())}) at index {source_index(p, bad)}; "
                                         "convert.py refuses non-finite weights (fix or re-download that file)")
                    yield p, t.reshape(-1).view(torch.uint8).numpy().data
            if FileStat.of(fpath) != seen:
                raise SystemExit(f"error: {fpath}: changed while convert.py was reading it; rerun once it is "
                                 "complete")


def stale_reason(path: str, head: bytes, size: int, plan: list[Piece], meta: dict) -> str | None:
    """None when the existing shard is exactly what this run would write (judged from its header and length);
    otherwise why it must be rewritten."""
    if not os.path.exists(path):
        return "missing"
    try:
        entries, have_meta, _ = read_header(path)
    except BadFile as e:
        return str(e).split(": ", 1)[1]
    for k, v in meta.items():
        if have_meta.get(k) != v:
            return f"metadata {k}={have_meta.get(k)!r}, this conversion writes {v!r}"
    want = {p.name: (p.src.dtype, p.shape) for p in plan}
    if set(entries) != set(want):
        return f"key set differs ({len(set(want) - set(entries))} missing, {len(set(entries) - set(want))} unexpected)"
    for n, (dtype, shape) in want.items():
        if (entries[n]["dtype"], entries[n]["shape"]) != (dtype, shape):
            return f"{n} is {entries[n]['dtype']} {entries[n]['shape']}, want {dtype} {shape}"
    with open(path, "rb") as f:
        if os.path.getsize(path) != size or f.read(len(head)) != head:
            return "tensor order/offsets differ from this converter's layout"
    return None


def sha256_file(path: str, rank: int, tp: int) -> str:
    h, size, buf = hashlib.sha256(), os.path.getsize(path), bytearray(1 << 24)
    t0 = last = time.time()
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            h.update(memoryview(buf)[:n])
            if time.time() - last > 15:
                last = time.time()
                print(f"  rank {rank}/{tp}: verifying sha256, {f.tell() / 2**30:.2f} of {size / 2**30:.2f} GiB, "
                      f"{last - t0:.0f} s", file=sys.stderr)
    return h.hexdigest()


def recorded_sha256(path: str) -> str:
    """The sha256 recorded beside the shard when it was written, or ValueError saying why there is none."""
    name = os.path.basename(path) + ".sha256"
    try:
        with open(path + ".sha256") as f:
            want = (f.read().split() or [""])[0]
    except FileNotFoundError:
        raise ValueError(f"no sha256 recorded ({name} missing)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{name} unreadable ({e})") from None
    if not re.fullmatch(r"[0-9a-f]{64}", want):
        raise ValueError(f"{name} holds no sha256")
    return want


@dataclass
class Verdict:
    keep: bool
    why: str                              # kept: what was checked beyond header, metadata and length; else: why not
    record: SourceRecord | None = None    # kept after re-reading the source: the record to write instead


def judge_existing(path: str, src: Source, plan: list[Piece], head: bytes, size: int, meta: dict, rank: int,
                   tp: int, verify: bool) -> Verdict:
    """May the shard at `path` be kept? Its header, metadata and length must be what this run writes, its bytes
    must hash to the sha256 recorded beside it (unless not `verify`), and it must be made of today's source bytes.
    When every source file it was read from has the FileStat its source record holds, it is; when any differs (a
    touch, a copy, a fix, a re-download) or there is no valid record (a shard of an earlier converter), that shard's
    source slices are read again and hashed with its header, and it is kept only if that gives its sha256. A content
    change never hides behind an unchanged size and mtime."""
    why = stale_reason(path, head, size, plan, meta)
    if why:
        return Verdict(False, why)
    name = os.path.basename(path)
    try:
        want = recorded_sha256(path)
    except ValueError as e:
        if verify:
            return Verdict(False, f"{e}, so its contents cannot be verified")
        want = None
    try:
        rec = SourceRecord.load(path + ".source.json")
        if want and rec.sha256 != want:
            raise ValueError(f"{name}.source.json records another sha256 than {name}.sha256")
    except ValueError as e:
        rec, no_record = None, str(e)
    want = want or (rec.sha256 if rec else None)
    if want is None:  # --no-verify-existing, and neither file says what the shard's bytes hash to
        return Verdict(False, f"neither {name}.sha256 nor {name}.source.json records its sha256, so it cannot be "
                              "matched to today's source")
    if verify and (got := sha256_file(path, rank, tp)) != want:
        return Verdict(False, f"its sha256 {got[:12]}... differs from the {want[:12]}... recorded in {name}.sha256 "
                              "(changed since written)")
    now = {f: FileStat.of(os.path.join(src.path, f)) for f in sorted({p.src.file for p in plan})}
    if rec and now == rec.files:
        return Verdict(True, "source files' size/mtime/ctime/inode unchanged")
    reason = no_record if rec is None else ", ".join(
        sorted(f for f in now.keys() | rec.files.keys() if now.get(f) != rec.files.get(f))) + " changed on disk"
    print(f"  rank {rank}/{tp}: {reason}; re-reading the shard's source slices to compare", file=sys.stderr)
    stats, h = {}, hashlib.sha256(head)
    for _, data in read_pieces(src, plan, stats):
        h.update(data)
    if h.hexdigest() != want:
        return Verdict(False, f"the source's bytes differ from those it was made from (re-read since {reason})")
    return Verdict(True, f"source re-read since {reason}: same bytes", SourceRecord(want, stats))


def temp_path(path: str) -> str:
    """A temporary name beside `path`, unique to this process and call, so no two writers ever share one."""
    name = f".{os.path.basename(path)}.{os.getpid()}-{secrets.token_hex(4)}.partial"
    return os.path.join(os.path.dirname(path), name)


def write_shard(path: str, src: Source, plan: list[Piece], head: bytes, size: int, rank: int, tp: int) -> str:
    """Stream the shard: header first, then each slice from read_pieces, hashing the bytes as they go out (no second
    read) into a sha256sum-format sidecar: one small file per shard, written after its shard, so there is no shared
    manifest to rewrite N times, and `sha256sum -c` checks it by hand. A run killed between the renames leaves a
    shard without a sidecar, which a resume rewrites, or without a source record, which makes a resume re-read its
    source slices; a run that fails removes its temporary file. Returns the shard's sha256."""
    tmp = temp_path(path)
    t0 = last = time.time()
    h, stats = hashlib.sha256(head), {}
    try:
        with naming(path):  # read_pieces names a source file that fails to read
            with open(tmp, "wb") as out:
                out.write(head)
                for _, data in read_pieces(src, plan, stats):
                    out.write(data)
                    h.update(data)
                    if time.time() - last > 15:
                        last = time.time()
                        print(f"  rank {rank}/{tp}: {out.tell() / 2**30:.2f} of {size / 2**30:.2f} GiB written, "
                              f"{last - t0:.0f} s", file=sys.stderr)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    write_bytes(path + ".sha256", f"{h.hexdigest()}  {os.path.basename(path)}\n".encode())
    write_bytes(path + ".source.json", SourceRecord(h.hexdigest(), stats).dumps())
    return h.hexdigest()


def write_bytes(path: str, data: bytes):
    tmp = temp_path(path)
    try:
        with naming(path):
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


@contextlib.contextmanager
def out_dir_lock(out_dir: str):
    """Hold an exclusive lock on OUT/.convert.lock while converting into OUT. A second run refuses at once, naming the
    holder, rather than waiting an unknown time behind it. The kernel drops a flock when its holder dies (kill -9
    too), so a crashed run never leaves OUT locked, and while one is held any *.partial file in OUT is a dead run's.
    The file stays (deleting it would let two runs lock two different files) and is emptied when the run ends."""
    path = os.path.join(out_dir, LOCK)
    if os.path.islink(path):  # writing through it would empty whatever it points to (a source file, say)
        raise SystemExit(f"error: {path} is a symbolic link; the lock must be a plain file: remove the link")
    with naming(path):  # e.g. a filesystem without locks; O_NOFOLLOW: a link made since the check above fails here
        f = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644), "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "pid unknown"
            f.close()
            raise SystemExit(f"error: {path} is held by another convert.py ({holder}) converting into {out_dir}; "
                             "wait for it to finish or stop it") from None
    try:
        f.truncate(0)
        f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
        yield
    finally:
        f.truncate(0)
        f.close()


def changed_since_written(path: str, size: int, sha: str | None, rank: int, tp: int) -> str | None:
    """None when the shard at `path` still has the size and (when given) the sha256 this run wrote."""
    if (got := os.path.getsize(path)) != size:
        return f"{path}: changed after convert.py wrote it (now {got} bytes, written {size})"
    if sha and (got := sha256_file(path, rank, tp)) != sha:
        return f"{path}: changed after convert.py wrote it (sha256 now {got[:12]}..., written {sha[:12]}...)"
    return None


def rank_config(raw: dict, tp: int, fp: str, mtp: int = 0) -> dict:
    """Source config + the layout fields (tp_size, expert_parallel_size, tp_layout_version; no rank field, so every
    rank's copy is identical), and mtp_layers_kept when --keep-mtp wrote MTP layers (absent otherwise, so a default
    conversion's configs are unchanged). The VL form keeps its nesting and identity; these keys and
    source_fingerprint go both at the top and into text_config so either reader finds them. No auto_map: nothing
    points at remote code."""
    cfg = json.loads(json.dumps(raw))
    add = {"tp_size": tp, "expert_parallel_size": tp, "tp_layout_version": LAYOUT_VERSION}
    if mtp:
        add["mtp_layers_kept"] = mtp
    for d in (cfg, cfg.get("text_config")):
        if isinstance(d, dict):
            d.pop("auto_map", None)
            d.pop("use_triton_sliding_attention", None)
            d.update(add, source_fingerprint=fp)
    return cfg


def readme(src: Source, tp: int, fp: str, plan0: list[Piece]) -> str:
    rows, seen = [], set()
    for p in sorted(plan0, key=lambda p: p.name):
        kind = re.sub(r"\.\d+\.", ".N.", p.name)
        if kind in seen:
            continue
        seen.add(kind)
        rows.append(f"| `{kind}` | {p.src.dtype} | {p.src.shape} | {p.shape} | {p.rule} |")
    L, m = src.tc.num_hidden_layers, src.mtp
    kept = (f"MTP layers {L}..{L + m - 1} kept ({sum(is_mtp(p.name, src.tc) for p in plan0)} tensors, "
            f"`mtp_layers_kept: {m}` in the configs; each `transformer.shared_head.output` stored as the rank's "
            "vocabulary rows), " if m else "")
    return (f"# Step-5 shards: TP = EP = {tp}, layout `{LAYOUT_VERSION}`\n\n"
            f"Source fingerprint `{fp}`; {len(plan0)} tensors per rank, {kept}{src.n_mtp} MTP tensors excluded. "
            "`model-r{rank}.safetensors` (its sha256 in `model-r{rank}.safetensors.sha256`, the source files it "
            "was read from in `model-r{rank}.safetensors.source.json`) + "
            "`config-r{rank}.json` per rank; `lm_head` is stored whole and narrowed "
            "to the rank's vocabulary rows at load; KV and indexer groups are duplicated on adjacent ranks when "
            "tp exceeds the group count.\n\n| tensor (first of its kind) | dtype | source shape | rank-0 shape | rule |\n|---|---|---|---|---|\n"
            + "\n".join(rows) + "\n")


def main(checkpoint: str, out_dir: str | None, tp_size: int = 8, ep_size: int | None = None, check_only: bool = False,
         verify_existing: bool = True, keep_mtp: bool = False):
    ep_size = tp_size if ep_size is None else ep_size
    if tp_size < 1 or ep_size != tp_size:
        raise SystemExit(f"error: --tp-size={tp_size} and --ep-size={ep_size} must be equal and >= 1 (co-located TP/EP)")
    if not out_dir and not check_only:
        raise SystemExit("error: --out-dir is required unless --check-only")
    src = audit(checkpoint, tp_size, out_dir, keep_mtp)
    if check_only:
        for w in src.warnings:
            print(w, file=sys.stderr)
        print("check passed (headers only: NaN/Inf in tensor values are checked while converting); nothing written")
        return
    fp = fingerprint(src)
    cfg = rank_config(src.raw, tp_size, fp, src.mtp)
    try:
        parse_config(cfg, "per-rank config")  # what the runtime will read must parse, with its tp checks
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"error: cannot create {out_dir}: {e.strerror}") from None
    with out_dir_lock(out_dir):
        write_outputs(src, out_dir, tp_size, fp, cfg, verify_existing)


def read_or_none(path: str) -> bytes | None:
    if not os.path.isfile(path):
        return None
    with naming(path), open(path, "rb") as f:
        return f.read()


def tokenizer_files_in_use(src: Source, out_dir: str, tp_size: int) -> str | None:
    """OUT/tokenizer_files serves every OUT/tpN: None when this run may write the source's files there, else why not
    (another tpN uses files that differ from the source's: a conversion of another checkpoint)."""
    others = sorted(d for d in os.listdir(out_dir) if re.fullmatch(r"tp\d+", d) and d != f"tp{tp_size}"
                    and os.path.isdir(os.path.join(out_dir, d)))
    if not others:  # nothing else uses them: no file is read
        return None
    tok_dir = os.path.join(out_dir, "tokenizer_files")
    differ = [f for f in TOKENIZER_FILES
              if read_or_none(os.path.join(src.path, f)) != read_or_none(os.path.join(tok_dir, f))]
    if not differ:
        return None
    return (f"{tok_dir} serves {', '.join(os.path.join(out_dir, d) for d in others)}, and this checkpoint's "
            f"{differ[0]} {'differs from' if os.path.isfile(os.path.join(src.path, differ[0])) else 'is missing beside'} "
            f"the one there (a conversion of another checkpoint?): use another --out-dir, or remove those")


def write_outputs(src: Source, out_dir: str, tp_size: int, fp: str, cfg: dict, verify_existing: bool):
    """Everything main writes, under the output directory's lock."""
    tp_dir = os.path.join(out_dir, f"tp{tp_size}")
    tok_dir = os.path.join(out_dir, "tokenizer_files")
    try:
        os.makedirs(tp_dir, exist_ok=True)
        os.makedirs(tok_dir, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"error: cannot create {tp_dir}: {e.strerror}") from None
    outputs = [os.path.join(tp_dir, f"model-r{r}.safetensors{x}") for r in range(tp_size)
               for x in ("", ".sha256", ".source.json")]
    outputs += [os.path.join(tp_dir, f"config-r{r}.json") for r in range(tp_size)] + [os.path.join(tp_dir, "README.md")]
    for p in outputs + [os.path.join(tok_dir, f) for f in TOKENIZER_FILES]:  # refused before anything is written
        if os.path.isdir(p):
            raise SystemExit(f"error: {p} is a directory; convert.py writes a file there (move the directory away)")
    why = tokenizer_files_in_use(src, out_dir, tp_size)
    if why:
        raise SystemExit(f"error: {why}")
    for d in (tp_dir, tok_dir):  # a dead run's leftovers (the lock rules out a live one); never mistaken for outputs
        for f in os.listdir(d):
            if f.endswith(".partial"):
                os.remove(os.path.join(d, f))
    t0, plan0, not_hashed, shards = time.time(), None, 0, {}
    for rank in range(tp_size):
        plan = rank_plan(src, tp_size, rank)
        plan0 = plan0 or plan
        meta = {"format": "pt", "format_version": "1", "step4_tp_layout": LAYOUT_VERSION, "tp_size": str(tp_size),
                "expert_parallel_size": str(tp_size), "rank": str(rank), "source_fingerprint": fp}
        head, size = shard_header(plan, meta)
        path = os.path.join(tp_dir, f"model-r{rank}.safetensors")
        v = judge_existing(path, src, plan, head, size, meta, rank, tp_size, verify_existing)
        if v.keep:
            shards[rank] = (path, size, None)  # checked above, in this run
            if v.record:
                write_bytes(path + ".source.json", v.record.dumps())
            if verify_existing:
                print(f"rank {rank}: {path} is complete and matches (header, metadata, length, {v.why}, sha256 "
                      "verified); kept")
            else:
                not_hashed += 1
                print(f"rank {rank}: {path} matches (header, metadata, length, {v.why}); kept, contents not "
                      "verified (--no-verify-existing)")
            continue
        if v.why != "missing":
            print(f"rank {rank}: rewriting {path}: {v.why}")
        shards[rank] = (path, size, write_shard(path, src, plan, head, size, rank, tp_size))
        print(f"rank {rank}: wrote {path} ({len(plan)} tensors, {size / 2**20:.1f} MiB, {time.time() - t0:.1f} s)")
    for rank in range(tp_size):
        write_bytes(os.path.join(tp_dir, f"config-r{rank}.json"), (json.dumps(cfg, indent=2) + "\n").encode())
    write_bytes(os.path.join(tp_dir, "README.md"), readme(src, tp_size, fp, plan0).encode())
    copied = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(src.path, f))]
    for f in copied:
        write_bytes(os.path.join(tok_dir, f), read_or_none(os.path.join(src.path, f)))
    stale = [f for f in TOKENIZER_FILES if copied and f not in copied and os.path.isfile(os.path.join(tok_dir, f))]
    for f in stale:  # an earlier version of this checkpoint's (tokenizer_files_in_use rules out another's in use)
        with naming(os.path.join(tok_dir, f)):
            os.remove(os.path.join(tok_dir, f))
    print(f"tokenizer files: {', '.join(copied) or 'none found in the checkpoint'} -> {tok_dir}"
          + (f" (removed {', '.join(stale)}: not in the checkpoint)" if stale else ""))
    # every shard this run wrote read back before PASS, in parallel (hashlib and file reads release the GIL)
    with ThreadPoolExecutor(min(tp_size, os.cpu_count() or 1)) as ex:
        problems = [w for w in ex.map(lambda r: changed_since_written(*shards[r], r, tp_size), range(tp_size)) if w]
    if problems:
        raise SystemExit(f"error: {problems[0]}; rerun to rewrite it")
    for w in src.warnings:
        print(w, file=sys.stderr)
    if not_hashed:
        print(f"warning: {not_hashed} kept shard(s) were not checked against their sha256 (--no-verify-existing); "
              "rerun without it to verify them", file=sys.stderr)
    print(f"PASS: {tp_size} ranks in {tp_dir} (shards written by this run read back: size and sha256 match; "
          f"{time.time() - t0:.1f} s)")


def cli(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="original checkpoint directory")
    ap.add_argument("--out-dir", "--out_dir", dest="out_dir", help="output root (OUT/tp{N}, OUT/tokenizer_files)")
    ap.add_argument("--tp-size", "--tp_size", dest="tp_size", type=int, default=8,
                    help="tensor-parallel size, the number of ranks to shard for (default: 8)")
    ap.add_argument("--ep-size", "--expert-parallel-size", dest="ep_size", type=int, default=None,
                    help="expert-parallel size; must equal --tp-size (default: --tp-size)")
    ap.add_argument("--check-only", "--check_only", dest="check_only", action="store_true",
                    help="check the checkpoint from its safetensors headers only; write nothing")
    ap.add_argument("--no-verify-existing", dest="verify_existing", action="store_false",
                    help="on a rerun, keep shards whose header matches and whose source is unchanged without "
                         "re-hashing them against their recorded sha256 (faster; damage inside the shard goes "
                         "unnoticed)")
    ap.add_argument("--keep-mtp", "--keep_mtp", dest="keep_mtp", action="store_true",
                    help="also write the checkpoint's MTP layers (num_nextn_predict_layers of them) into every "
                         "rank's shard, for generate.py --speculative")
    a = ap.parse_args(argv)
    try:
        main(a.checkpoint, a.out_dir, a.tp_size, a.ep_size, a.check_only, a.verify_existing, a.keep_mtp)
    except KeyboardInterrupt:  # write_shard has removed its temporary file; complete shards stay for the rerun
        raise SystemExit("error: interrupted (Ctrl-C); shards already complete are kept: rerun the same command to "
                         "resume") from None
    except OSError as e:  # permissions, a file vanishing mid-run: name it, no traceback (writes name theirs: naming)
        raise SystemExit(f"error: {e.filename}: {e.strerror}" if e.filename else f"error: {e}") from None


if __name__ == "__main__":
    cli()
