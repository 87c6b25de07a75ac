"""convert.py: round trip at TP 1/2/4/8, header-only --check-only on good and broken checkpoints, resume, memory."""
import json
import os
import re
import shutil
import struct
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import convert  # noqa: E402
from config import LAYOUT_VERSION, parse_config  # noqa: E402
from tiny_checkpoint import make_checkpoint  # noqa: E402

INDEX = "model.safetensors.index.json"


# ---------------------------------------------------------------------------------------------- fixtures
def conversions(ckpts, tmp_path_factory, keep_mtp: bool):
    """get(kind, tp) -> out dir of a clean conversion (one out dir per kind and TP), made once per session."""
    cache = {}

    def get(kind, tp):
        if (kind, tp) not in cache:
            out = str(tmp_path_factory.mktemp(f"out_{'mtp_' if keep_mtp else ''}{kind}_tp{tp}"))
            convert.main(ckpts[kind], out, tp_size=tp, ep_size=tp, keep_mtp=keep_mtp)
            cache[kind, tp] = out
        return cache[kind, tp]
    return get


@pytest.fixture(scope="session")
def converted(ckpts, tmp_path_factory):
    return conversions(ckpts, tmp_path_factory, keep_mtp=False)


def source_tensors(ckpt):
    wm = json.load(open(os.path.join(ckpt, INDEX)))["weight_map"]
    out = {}
    for name, fname in wm.items():
        with safe_open(os.path.join(ckpt, fname), "pt") as f:
            out[name] = f.get_tensor(name)
    return out


def bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def same(a, b):
    """Bit-for-bit equality (FP8 and BF16 compared as raw bytes)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def window(G, tp, r):  # written independently of config.group_window
    # rank r's (first, count): tp dividing G splits the groups; G dividing tp gives one group to tp/G adjacent ranks
    return (r * (G // tp), G // tp) if G % tp == 0 else (r // (tp // G), 1)


SPLIT0 = (".q_proj.weight", ".g_proj.weight", ".mlp.gate_proj.weight", ".mlp.up_proj.weight",
          ".share_expert.gate_proj.weight", ".share_expert.up_proj.weight", ".moe.gate_proj.weight",
          ".moe.up_proj.weight", ".moe.down_proj.weight", "_proj.weight_scale_inv",
          ".transformer.shared_head.output.weight")  # an MTP layer's head: vocabulary rows, unlike the whole lm_head
SPLIT1 = (".o_proj.weight", ".mlp.down_proj.weight", ".share_expert.down_proj.weight")
GROUPED = (".k_proj.weight", ".v_proj.weight", ".sparse_indexer_q.weight", ".sparse_indexer_w.weight")


def dir_bytes(root):
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            out[os.path.relpath(p, root)] = open(p, "rb").read()
    return out


# ---------------------------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("kind,tp", [("fp8_vl", 1), ("fp8_vl", 2), ("fp8_vl", 4), ("fp8_vl", 8), ("bf16_text", 2),
                                     ("bf16_text", 8)])
def test_shards_reassemble_to_the_source_bit_for_bit(ckpts, converted, kind, tp):
    ckpt, out = ckpts[kind], converted(kind, tp)
    src = source_tensors(ckpt)
    raw = json.load(open(os.path.join(ckpt, "config.json")))
    text = raw.get("text_config", raw)
    L, G = text["num_hidden_layers"], text["num_attention_groups"]
    shards = [load_file(os.path.join(out, f"tp{tp}", f"model-r{r}.safetensors")) for r in range(tp)]
    mtp = {n for n in src if n.startswith("model.layers.") and int(n.split(".")[2]) >= L}
    assert mtp, "fixture should carry MTP layers"
    keep = set(src) - mtp
    for r, sh in enumerate(shards):
        assert set(sh) == keep, f"rank {r}: key set differs: {sorted(set(sh) ^ keep)[:5]}"
    assert_slices(src, shards, keep, G, tp)
    if kind == "fp8_vl":
        assert any(n.startswith("vision_model.") for n in keep) and "vit_large_projector.weight" in keep
        assert any(s.dtype == torch.float8_e4m3fn for s in shards[0].values())


def assert_slices(src, shards, names, G, tp):
    """Each rank's tensor is its slice of the source, bit for bit, by the layout's rules (restated here)."""
    for name in sorted(names):
        s, parts = src[name], [sh[name] for sh in shards]
        if name.endswith(SPLIT0):
            assert same(torch.cat(parts, 0), s), name
        elif name.endswith(SPLIT1):
            assert same(torch.cat(parts, 1), s), name
        elif name.endswith(GROUPED):
            rows = s.shape[0] // G
            for r, p in enumerate(parts):
                first, count = window(G, tp, r)
                assert same(p, s[first * rows:(first + count) * rows]), (name, r)
            if tp > G:  # one group duplicated on tp / G adjacent ranks
                assert all(same(parts[r], parts[r + 1]) for r in range(0, tp, 2)), name
        else:  # replicated, vision and projector included
            assert all(same(p, s) for p in parts), name


@pytest.mark.parametrize("kind,tp", [("fp8_vl", 8), ("bf16_text", 2)])
def test_rank_configs_and_metadata(ckpts, converted, kind, tp):
    out = os.path.join(converted(kind, tp), f"tp{tp}")
    raw = json.load(open(os.path.join(ckpts[kind], "config.json")))
    texts = [open(os.path.join(out, f"config-r{r}.json")).read() for r in range(tp)]
    assert len(set(texts)) == 1, "per-rank configs are identical copies"
    cfg = json.loads(texts[0])
    fps = set()
    for r in range(tp):
        with safe_open(os.path.join(out, f"model-r{r}.safetensors"), "pt") as f:
            m = f.metadata()
        assert m == {"format": "pt", "format_version": "1", "step4_tp_layout": LAYOUT_VERSION, "tp_size": str(tp),
                     "expert_parallel_size": str(tp), "rank": str(r), "source_fingerprint": m["source_fingerprint"]}
        fps.add(m["source_fingerprint"])
    assert fps == {cfg["source_fingerprint"]}
    readers = [cfg, cfg["text_config"]] if kind == "fp8_vl" else [cfg]
    for d in readers:
        assert (d["tp_size"], d["expert_parallel_size"], d["tp_layout_version"]) == (tp, tp, LAYOUT_VERSION)
        assert d["source_fingerprint"] == cfg["source_fingerprint"]
        assert "auto_map" not in d and "use_triton_sliding_attention" not in d
    if kind == "fp8_vl":
        assert cfg["model_type"] == "step5_vl" and cfg["architectures"] == ["Step5ForConditionalGeneration"]
        assert cfg["vision_config"] == raw["vision_config"] and cfg["quantization_config"] == raw["quantization_config"]
    tc, vl = parse_config(cfg)
    assert tc.tp_size == tp and (vl is not None) == (kind == "fp8_vl")
    tok = os.path.join(os.path.dirname(out), "tokenizer_files")
    assert sorted(os.listdir(tok)) == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    assert "| rule |" in open(os.path.join(out, "README.md")).read()


def test_vision_tensors_with_model_prefix_are_accepted(ckpts, tmp_path):
    """Some packagings spell the tower `model.vision_model.*`; the shards use the unprefixed names."""
    ck = str(tmp_path / "ck")
    shutil.copytree(ckpts["fp8_vl"], ck)
    idx = json.load(open(os.path.join(ck, INDEX)))
    for fname in sorted(set(idx["weight_map"].values())):
        d = load_file(os.path.join(ck, fname))
        d = {("model." + k if k.startswith(("vision_model.", "vit_large")) else k): v for k, v in d.items()}
        save_file(d, os.path.join(ck, fname), metadata={"format": "pt"})
    idx["weight_map"] = {("model." + k if k.startswith(("vision_model.", "vit_large")) else k): v
                         for k, v in idx["weight_map"].items()}
    json.dump(idx, open(os.path.join(ck, INDEX), "w"))
    convert.main(ck, str(tmp_path / "out"), tp_size=2)
    a = load_file(str(tmp_path / "out" / "tp2" / "model-r1.safetensors"))
    src = source_tensors(ckpts["fp8_vl"])
    assert same(a["vit_large_projector.weight"], src["vit_large_projector.weight"])
    assert same(a["vision_model.conv1.weight"], src["vision_model.conv1.weight"])


# ---------------------------------------------------------------------------------------------- --check-only
@pytest.mark.parametrize("kind", ["fp8_vl", "bf16_text"])
def test_check_only_passes_and_writes_nothing(ckpts, tmp_path, monkeypatch, capsys, kind):
    def no_data(*a, **k):
        raise AssertionError("--check-only opened a tensor reader")
    monkeypatch.setattr(convert, "safe_open", no_data)
    convert.main(ckpts[kind], str(tmp_path / "out"), tp_size=8, check_only=True)
    assert not (tmp_path / "out").exists()
    printed = capsys.readouterr().out
    assert "check passed" in printed and "MTP tensors skipped" in printed and "extra-unindexed" in printed


def test_check_only_never_reads_tensor_data(ckpts, tmp_path):
    """Overwrite every data byte of every shard (header and length kept): a header-only check still passes."""
    ck = str(tmp_path / "ck")
    shutil.copytree(ckpts["fp8_vl"], ck)
    for fname in set(json.load(open(os.path.join(ck, INDEX)))["weight_map"].values()):
        path = os.path.join(ck, fname)
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            f.seek(8 + n)
            f.write(b"\xff" * (size - 8 - n))
    convert.main(ck, None, tp_size=4, check_only=True)


def rewrite_file(ck, fname, edit):
    path = os.path.join(ck, fname)
    save_file(edit(load_file(path)), path, metadata={"format": "pt"})


def test_check_only_lists_every_problem(ckpts, tmp_path):
    ck = str(tmp_path / "broken")
    shutil.copytree(ckpts["fp8_vl"], ck)
    idx = json.load(open(os.path.join(ck, INDEX)))
    wm = idx["weight_map"]
    missing, shape, dtype = "model.layers.0.self_attn.q_norm.weight", "model.layers.1.mlp.up_proj.weight", "model.norm.weight"
    scale, moved, extra = "model.layers.3.moe.up_proj.weight_scale_inv", "lm_head.weight", "model.layers.0.self_attn.bogus.weight"
    touched = {wm[n] for n in (missing, shape, dtype, scale, moved)}
    for n in (missing, shape, dtype, scale):
        def edit(d, n=n):
            if n == shape:
                d[n] = torch.zeros(500, d[n].shape[1], dtype=torch.bfloat16)
            elif n == dtype:
                d[n] = d[n].to(torch.bfloat16)
            else:
                del d[n]
            return d
        rewrite_file(ck, wm[n], edit)
    rewrite_file(ck, wm[missing], lambda d: {**d, extra: torch.zeros(4, 4, dtype=torch.bfloat16)})
    wm[extra] = wm[missing]
    del wm[missing], wm[scale]
    files = sorted(set(wm.values()))
    wm[moved] = next(f for f in files if f != wm[moved] and f != files[-1])  # the last file holds a stray copy
    truncated = next(f for f in files if f not in touched and f != wm[moved])
    json.dump(idx, open(os.path.join(ck, INDEX), "w"))
    with open(os.path.join(ck, truncated), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(ck, truncated)) - 100)
    r = subprocess.run([sys.executable, "convert.py", "--checkpoint", ck, "--check-only", "--tp-size", "2"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    err = r.stderr
    assert f"{missing}: missing" in err
    assert shape in err and "[500, 256]" in err
    assert f"{dtype} in" in err and "BF16 [256], expected F32 [256]" in err
    assert "model.layers.3.moe.up_proj.weight in" in err and "FP8 weight without its" in err
    assert f"{moved}: {INDEX} places it in {wm[moved]}" in err
    assert truncated in err and "truncated" in err
    assert f"{extra} in" in err and "unexpected tensor" in err
    assert not os.path.exists(os.path.join(ck, "tp2"))


def test_check_only_rejects_tp_that_does_not_divide(ckpts):
    with pytest.raises(SystemExit) as e:
        convert.main(ckpts["fp8_vl"], None, tp_size=3, check_only=True)
    msg = str(e.value)
    for k in ("num_attention_heads=16", "intermediate_size=512", "vocab_size=1024", "moe_num_experts=16",
              "share_expert_dim=128", "num_attention_groups=4", "num_provider_groups=4"):
        assert k in msg, k


def test_fp8_layer_disagreeing_with_quantization_config(ckpts, tmp_path):
    ck = str(tmp_path / "ck")
    shutil.copytree(ckpts["fp8_vl"], ck)
    cfg = json.load(open(os.path.join(ck, "config.json")))
    cfg["quantization_config"]["modules_to_not_convert"].append("model.layers.2.moe.experts.w13_weight")
    json.dump(cfg, open(os.path.join(ck, "config.json"), "w"))
    with pytest.raises(SystemExit) as e:
        convert.main(ck, None, tp_size=2, check_only=True)
    assert "model.layers.2.moe: experts are FP8 in the checkpoint" in str(e.value)


@pytest.mark.parametrize("damage", ["truncated", "missing"])
@pytest.mark.slow
def test_unreadable_source_file_is_the_only_problem_reported(ckpts, tmp_path, damage):
    """The tensors of an unreadable file are unknown, not BF16: no false FP8/BF16 disagreement, no wrong summary."""
    ck = str(tmp_path / "ck")
    shutil.copytree(ckpts["fp8_vl"], ck)
    wm = json.load(open(os.path.join(ck, INDEX)))["weight_map"]
    fname = wm["model.layers.4.moe.gate_proj.weight_scale_inv"]
    path = os.path.join(ck, fname)
    if damage == "truncated":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 100)
    else:
        os.remove(path)
    r = subprocess.run([sys.executable, "convert.py", "--checkpoint", ck, "--check-only", "--tp-size", "2"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "1 problem(s)" in r.stderr and fname in r.stderr, r.stderr
    assert "experts are" not in r.stderr and "FP8 weight without" not in r.stderr, r.stderr
    assert "FP8 experts on MoE layers [2, 3] (not checked: 4, 5" in r.stdout, r.stdout


def test_checkpoint_without_tokenizer_json_warns(ckpts, tmp_path, capsys):
    """Id-only prompts still work, so it is a warning, in the audit and in the conversion summary."""
    ck = str(tmp_path / "ck")
    shutil.copytree(ckpts["bf16_text"], ck)
    os.remove(os.path.join(ck, "tokenizer.json"))
    warning = (f"warning: {ck} has no tokenizer.json: generate.py --prompt will fail without --tokenizer DIR "
               "(token-id prompts still work)")
    capsys.readouterr()
    convert.main(ck, None, tp_size=2, check_only=True)
    printed = capsys.readouterr()
    assert "check passed" in printed.out and warning in printed.err, printed
    convert.main(ck, str(tmp_path / "out"), tp_size=2)
    printed = capsys.readouterr()
    assert "PASS" in printed.out and warning in printed.err, printed


def test_tokenizer_files_another_conversion_uses_are_never_replaced(ckpts, tmp_path, capsys):
    """OUT/tokenizer_files serves every OUT/tpN: a checkpoint whose tokenizer differs is refused while another tpN
    is there; alone in OUT it replaces them, and a file its checkpoint no longer has is removed, not left behind."""
    a, b, out = str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "out")
    shutil.copytree(ckpts["bf16_text"], a)
    shutil.copytree(ckpts["bf16_text"], b)
    tc = json.load(open(os.path.join(b, "tokenizer_config.json")))
    tc["chat_template"] = "{% for m in messages %}{{ m.content }}{% endfor %}"
    json.dump(tc, open(os.path.join(b, "tokenizer_config.json"), "w"))
    open(os.path.join(a, "chat_template.jinja"), "w").write("{{ messages[0].content }}")
    convert.main(a, out, tp_size=1)
    kept = dir_bytes(os.path.join(out, "tokenizer_files"))
    with pytest.raises(SystemExit, match=r"tokenizer_files serves .*/out/tp1, and this checkpoint's "
                                         r"tokenizer_config.json differs from the one there"):
        convert.main(b, out, tp_size=2)
    assert dir_bytes(os.path.join(out, "tokenizer_files")) == kept
    shutil.rmtree(os.path.join(out, "tp1"))
    capsys.readouterr()
    convert.main(b, out, tp_size=2)
    assert "(removed chat_template.jinja: not in the checkpoint)" in capsys.readouterr().out
    for f in os.listdir(os.path.join(out, "tokenizer_files")):
        assert open(os.path.join(out, "tokenizer_files", f), "rb").read() == open(os.path.join(b, f), "rb").read()
    assert not os.path.exists(os.path.join(out, "tokenizer_files", "chat_template.jinja"))


# ---------------------------------------------------------------------------------------------- bad input
def _bad_config(ck):
    open(os.path.join(ck, "config.json"), "w").write("{not json")


def _garbage_shard(ck):
    open(os.path.join(ck, "model-00002-of-00004.safetensors"), "wb").write(b"\x10" * 64)


def _string_heads(ck):
    cfg = json.load(open(os.path.join(ck, "config.json")))
    cfg["text_config"]["num_attention_heads"] = "16"
    json.dump(cfg, open(os.path.join(ck, "config.json"), "w"))


def _file_not_dir(ck):
    shutil.rmtree(ck)
    open(ck, "w").write("{}")


@pytest.mark.parametrize("case,args,needle", [
    ("missing dir", ["--tp-size", "2"], "does not exist"),
    ("malformed json", ["--tp-size", "2"], "config.json: not readable JSON"),
    ("ep != tp", ["--tp-size", "2", "--ep-size", "4"], "--ep-size=4"),
    ("garbage header", ["--tp-size", "2"], "model-00002-of-00004.safetensors: header length"),
    ("string-typed field", ["--tp-size", "2"],
     'config.json: num_attention_heads="16" must be an integer (got a JSON string)'),
    ("checkpoint is a file", ["--tp-size", "2"], "is a file, not a directory"),
])
def test_bad_input_is_one_clear_message(ckpts, tmp_path, case, args, needle):
    ck = str(tmp_path / "ck")
    if case != "missing dir":
        shutil.copytree(ckpts["fp8_vl"], ck)
    {"malformed json": _bad_config, "garbage header": _garbage_shard, "string-typed field": _string_heads,
     "checkpoint is a file": _file_not_dir}.get(case, lambda ck: None)(ck)
    r = subprocess.run([sys.executable, "convert.py", "--checkpoint", ck, "--out-dir", str(tmp_path / "out"), *args],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode != 0 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "out" / "tp2").exists()


def test_cli_accepts_underscore_and_long_flag_spellings(ckpts, converted, tmp_path):
    out = str(tmp_path / "out")
    r = subprocess.run([sys.executable, "convert.py", "--checkpoint", ckpts["bf16_text"], "--out_dir", out,
                        "--tp_size", "2", "--expert-parallel-size", "2"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert dir_bytes(out) == dir_bytes(converted("bf16_text", 2))


def _overlap(tmp_path, how):
    """(checkpoint, out dir) where the outputs would land in or around the checkpoint."""
    if how == "same":
        return "ck", "ck"
    if how == "inside":
        return "ck", "ck/converted"
    if how == "checkpoint named tp2, out = its parent":  # OUT/tp2 is the checkpoint itself
        return "tp2", "."
    if how == "out is a symlink to the checkpoint":
        os.symlink(tmp_path / "ck", tmp_path / "link")
        return "ck", "link"
    if how == "out/tokenizer_files is a symlink into the checkpoint":
        os.makedirs(tmp_path / "out")
        os.symlink(tmp_path / "ck", tmp_path / "out" / "tokenizer_files")
        return "ck", "out"


@pytest.mark.parametrize("check_only", [False, True])
@pytest.mark.parametrize("how", ["same", "inside", "checkpoint named tp2, out = its parent",
                                 "out is a symlink to the checkpoint",
                                 "out/tokenizer_files is a symlink into the checkpoint"])
def test_out_dir_overlapping_the_checkpoint_is_refused(ckpts, tmp_path, how, check_only):
    ck_name, out_name = _overlap(tmp_path, how)
    ck = str(tmp_path / ck_name)
    shutil.copytree(ckpts["bf16_text"], ck)
    before = dir_bytes(ck)
    with pytest.raises(SystemExit) as e:
        convert.main(ck, str(tmp_path / out_name), tp_size=2, check_only=check_only)
    assert "--out-dir" in str(e.value) and "checkpoint" in str(e.value), e.value
    if check_only:
        assert "1 problem(s)" in str(e.value), e.value
    assert dir_bytes(ck) == before
    assert not os.path.exists(os.path.join(ck, "tp2")) and not os.path.exists(os.path.join(ck, "tokenizer_files"))


def test_out_dir_beside_the_checkpoint_is_accepted(ckpts, tmp_path):
    ck = str(tmp_path / "ck")
    shutil.copytree(ckpts["bf16_text"], ck)
    convert.main(ck, str(tmp_path / "ck-out"), tp_size=2)  # a shared name prefix is not containment
    assert os.path.exists(tmp_path / "ck-out" / "tp2" / "model-r1.safetensors")


# ---------------------------------------------------------------------------------------------- resume
def test_interrupted_run_resumes_to_identical_output(ckpts, converted, tmp_path, monkeypatch):
    clean = converted("fp8_vl", 2)
    out = str(tmp_path / "out")
    real = convert.write_shard

    def dies_on_rank_1(path, src, plan, head, size, rank, tp):
        if rank == 1:
            open(os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.partial"), "wb").write(head)
            raise KeyboardInterrupt
        real(path, src, plan, head, size, rank, tp)
    monkeypatch.setattr(convert, "write_shard", dies_on_rank_1)
    with pytest.raises(KeyboardInterrupt):
        convert.main(ckpts["fp8_vl"], out, tp_size=2)
    assert not os.path.exists(os.path.join(out, "tp2", "model-r1.safetensors")), "no truncated file under the final name"
    monkeypatch.setattr(convert, "write_shard", real)
    r0 = os.stat(os.path.join(out, "tp2", "model-r0.safetensors"))
    convert.main(ckpts["fp8_vl"], out, tp_size=2)
    assert dir_bytes(out) == dir_bytes(clean)
    r0b = os.stat(os.path.join(out, "tp2", "model-r0.safetensors"))
    assert (r0.st_ino, r0.st_mtime_ns) == (r0b.st_ino, r0b.st_mtime_ns), "complete shard was rewritten"


def test_damaged_outputs_are_rewritten_and_complete_ones_kept(ckpts, converted, tmp_path, capsys):
    clean = converted("fp8_vl", 2)
    out = str(tmp_path / "out")
    shutil.copytree(clean, out)
    tp2 = os.path.join(out, "tp2")
    with open(os.path.join(tp2, "model-r0.safetensors"), "r+b") as f:
        f.truncate(1000)
    os.remove(os.path.join(tp2, "config-r1.json"))
    os.remove(os.path.join(out, "tokenizer_files", "tokenizer.json"))
    open(os.path.join(tp2, ".model-r1.safetensors.partial"), "wb").write(b"stale")
    r1 = os.stat(os.path.join(tp2, "model-r1.safetensors"))
    capsys.readouterr()
    convert.main(ckpts["fp8_vl"], out, tp_size=2)
    printed = capsys.readouterr().out
    assert "rank 0: rewriting" in printed and "rank 1:" in printed and "kept" in printed
    assert dir_bytes(out) == dir_bytes(clean)
    r1b = os.stat(os.path.join(tp2, "model-r1.safetensors"))
    assert (r1.st_ino, r1.st_mtime_ns) == (r1b.st_ino, r1b.st_mtime_ns)


def test_shard_of_another_tp_size_is_rewritten(ckpts, converted, tmp_path, capsys):
    clean = converted("fp8_vl", 2)
    out = str(tmp_path / "out")
    shutil.copytree(clean, out)
    shutil.copyfile(os.path.join(converted("fp8_vl", 4), "tp4", "model-r1.safetensors"),
                    os.path.join(out, "tp2", "model-r1.safetensors"))
    capsys.readouterr()
    convert.main(ckpts["fp8_vl"], out, tp_size=2)
    assert "rank 1: rewriting" in capsys.readouterr().out
    assert dir_bytes(out) == dir_bytes(clean)


def test_shards_of_another_source_are_rewritten(ckpts, converted, tmp_path, capsys):
    """Same geometry, other weights (another seed): the fingerprint tells them apart."""
    out = str(tmp_path / "out")
    convert.main(ckpts["fp8_vl_seed1"], out, tp_size=2)
    capsys.readouterr()
    convert.main(ckpts["fp8_vl"], out, tp_size=2)
    printed = capsys.readouterr().out
    assert printed.count("source_fingerprint") == 2, printed
    assert dir_bytes(out) == dir_bytes(converted("fp8_vl", 2))


def _overwrite_4k(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        f.write(b"\x5a" * 4096)


@pytest.mark.parametrize("damage", ["4 KB overwritten", "checksum missing", "checksum garbled"])
def test_shard_whose_content_does_not_match_its_checksum_is_rewritten(ckpts, converted, tmp_path, capsys, damage):
    clean = converted("fp8_vl", 2)
    out = str(tmp_path / "out")
    shutil.copytree(clean, out)
    shard = os.path.join(out, "tp2", "model-r1.safetensors")
    if damage == "4 KB overwritten":
        _overwrite_4k(shard)
    elif damage == "checksum missing":
        os.remove(shard + ".sha256")
    else:
        open(shard + ".sha256", "w").write("not a checksum\n")
    r0 = os.stat(os.path.join(out, "tp2", "model-r0.safetensors"))
    capsys.readouterr()
    convert.main(ckpts["fp8_vl"], out, tp_size=2)
    printed = capsys.readouterr().out
    assert f"rank 1: rewriting {shard}: " in printed and "sha256" in printed, printed
    assert "rank 0:" in printed and "sha256 verified); kept" in printed, printed
    assert dir_bytes(out) == dir_bytes(clean)
    r0b = os.stat(os.path.join(out, "tp2", "model-r0.safetensors"))
    assert (r0.st_ino, r0.st_mtime_ns) == (r0b.st_ino, r0b.st_mtime_ns)


def test_checksum_sidecar_matches_the_shard(ckpts, converted):
    """The recorded checksum is the sha256 of the whole file, in sha256sum's format."""
    import hashlib
    tp2 = os.path.join(converted("bf16_text", 2), "tp2")
    for r in range(2):
        name = f"model-r{r}.safetensors"
        digest = hashlib.sha256(open(os.path.join(tp2, name), "rb").read()).hexdigest()
        assert open(os.path.join(tp2, name + ".sha256")).read() == f"{digest}  {name}\n"


def test_no_verify_existing_skips_the_hash_and_says_so(ckpts, converted, tmp_path):
    clean = converted("fp8_vl", 2)
    out = str(tmp_path / "out")
    shutil.copytree(clean, out)
    shard = os.path.join(out, "tp2", "model-r1.safetensors")
    _overwrite_4k(shard)
    damaged = open(shard, "rb").read()
    r = subprocess.run([sys.executable, "convert.py", "--checkpoint", ckpts["fp8_vl"], "--out-dir", out,
                        "--tp-size", "2", "--no-verify-existing"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "contents not verified (--no-verify-existing)" in r.stdout, r.stdout
    assert "2 kept shard(s) were not checked against their sha256" in r.stderr, r.stderr
    assert open(shard, "rb").read() == damaged, "the user asked to keep without re-hashing"


def test_source_is_never_modified(ckpts, converted):
    before = dir_bytes(ckpts["bf16_text"])
    converted("bf16_text", 2)
    assert dir_bytes(ckpts["bf16_text"]) == before


# ---------------------------------------------------------------------------------------------- --keep-mtp
@pytest.fixture(scope="session")
def converted_mtp(ckpts, tmp_path_factory):
    return conversions(ckpts, tmp_path_factory, keep_mtp=True)


def mtp_names(src, text):
    L, n = text["num_hidden_layers"], text["num_nextn_predict_layers"]
    return {k for k in src if k.startswith("model.layers.") and L <= int(k.split(".")[2]) < L + n}


@pytest.mark.parametrize("kind,tp", [("bf16_text", 1), ("bf16_text", 2), ("fp8_vl", 2)])
def test_keep_mtp_writes_the_mtp_layers_sliced_bit_for_bit(ckpts, converted, converted_mtp, kind, tp):
    ckpt, out = ckpts[kind], os.path.join(converted_mtp(kind, tp), f"tp{tp}")
    src = source_tensors(ckpt)
    text = json.load(open(os.path.join(ckpt, "config.json")))
    text = text.get("text_config", text)
    L, n, G, V = (text[k] for k in ("num_hidden_layers", "num_nextn_predict_layers", "num_attention_groups",
                                    "vocab_size"))
    mtp = mtp_names(src, text)
    assert len(mtp) == 17 * n and n == 2
    shards = [load_file(os.path.join(out, f"model-r{r}.safetensors")) for r in range(tp)]
    plain = [load_file(os.path.join(converted(kind, tp), f"tp{tp}", f"model-r{r}.safetensors")) for r in range(tp)]
    for r, (sh, pl) in enumerate(zip(shards, plain)):
        assert set(sh) == set(pl) | mtp, f"rank {r}: {sorted(set(sh) ^ (set(pl) | mtp))[:5]}"
        assert all(same(sh[k], pl[k]) for k in pl), f"rank {r}: a main tensor differs from the default conversion"
    assert_slices(src, shards, mtp, G, tp)
    for i in range(L, L + n):  # the MTP head is this rank's vocabulary window, not the whole head like lm_head
        name = f"model.layers.{i}.transformer.shared_head.output.weight"
        for r, sh in enumerate(shards):
            assert same(sh[name], src[name][r * V // tp:(r + 1) * V // tp]), (name, r)
        assert all(same(sh[f"model.layers.{i}.eh_proj.weight"], src[f"model.layers.{i}.eh_proj.weight"])
                   for sh in shards)
    assert {shards[0][k].dtype for k in mtp} == {torch.bfloat16, torch.float32}  # kept as stored, never quantized
    readme = open(os.path.join(out, "README.md")).read()
    assert f"MTP layers {L}..{L + n - 1} kept ({17 * n} tensors" in readme, readme


@pytest.mark.parametrize("kind,tp", [("fp8_vl", 2), ("bf16_text", 1)])
def test_keep_mtp_configs_carry_mtp_layers_kept_and_nothing_else_changes(ckpts, converted, converted_mtp, kind, tp):
    """Only the configs' mtp_layers_kept and the fingerprint (which then covers the MTP tensors too) differ from a
    default conversion; a default conversion's configs have no such key."""
    out, plain = os.path.join(converted_mtp(kind, tp), f"tp{tp}"), os.path.join(converted(kind, tp), f"tp{tp}")
    for r in range(tp):
        cfg = json.load(open(os.path.join(out, f"config-r{r}.json")))
        base = json.load(open(os.path.join(plain, f"config-r{r}.json")))
        readers = [(cfg, base), (cfg["text_config"], base["text_config"])] if kind == "fp8_vl" else [(cfg, base)]
        for d, b in readers:
            assert d["mtp_layers_kept"] == 2 and "mtp_layers_kept" not in b
            skip = ("mtp_layers_kept", "text_config", "source_fingerprint")
            assert {k: v for k, v in d.items() if k not in skip} == {k: v for k, v in b.items() if k not in skip}
            assert d.get("source_fingerprint") != b.get("source_fingerprint") or "source_fingerprint" not in b
        assert parse_config(cfg)[0].mtp_layers_kept == 2 and parse_config(base)[0].mtp_layers_kept == 0
        with safe_open(os.path.join(out, f"model-r{r}.safetensors"), "pt") as f, \
                safe_open(os.path.join(plain, f"model-r{r}.safetensors"), "pt") as g:
            fm, gm = f.metadata(), g.metadata()
            assert fm.pop("source_fingerprint") != gm.pop("source_fingerprint") and fm == gm
    assert "kept" not in open(os.path.join(plain, "README.md")).read().split("\n\n")[1]


@pytest.mark.parametrize("value,needle", [
    (2, None), (0, None),
    ("2", 'mtp_layers_kept="2" must be an integer (got a JSON string)'),
    (True, "mtp_layers_kept=true must be an integer (got a JSON boolean)"),
    (-1, "mtp_layers_kept=-1 must be between 0 and num_nextn_predict_layers=2"),
    (3, "mtp_layers_kept=3 must be between 0 and num_nextn_predict_layers=2"),
], ids=["2", "0", "string", "boolean", "negative", "above num_nextn_predict_layers"])
def test_config_mtp_layers_kept_is_validated(value, needle):
    from config import ConfigError, Step5Config
    from tiny_checkpoint import tiny_text_config
    d = tiny_text_config(mtp_layers_kept=value)
    if needle is None:
        assert Step5Config.from_dict(d).mtp_layers_kept == value
        return
    with pytest.raises(ConfigError) as e:
        Step5Config.from_dict(d)
    assert str(e.value) == needle


@pytest.mark.slow
def test_check_only_with_keep_mtp_audits_the_mtp_layers(ckpts, tmp_path):
    ck = str(tmp_path / "ck")
    shutil.copytree(ckpts["bf16_text"], ck)
    idx = json.load(open(os.path.join(ck, INDEX)))
    wm = idx["weight_map"]
    missing, shape, dtype = ("model.layers.9.eh_proj.weight", "model.layers.8.transformer.shared_head.output.weight",
                             "model.layers.9.enorm.weight")

    def edit(d):
        d.pop(missing, None)
        if shape in d:
            d[shape] = d[shape][:, :128].contiguous()
        if dtype in d:
            d[dtype] = d[dtype].to(torch.bfloat16)
        return d
    for fname in {wm[missing], wm[shape], wm[dtype]}:
        rewrite_file(ck, fname, edit)
    del wm[missing]
    json.dump(idx, open(os.path.join(ck, INDEX), "w"))
    cli = [sys.executable, "convert.py", "--checkpoint", ck, "--check-only", "--tp-size", "2"]
    r = subprocess.run(cli + ["--keep-mtp"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert "3 problem(s)" in r.stderr, r.stderr
    assert f"{missing}: missing (expected BF16 [256, 512])" in r.stderr
    assert f"{shape} in {wm[shape]}: BF16 [1024, 128], expected BF16 [1024, 256]" in r.stderr
    assert f"{dtype} in {wm[dtype]}: BF16 [256], expected F32 [256]" in r.stderr
    assert "33 MTP tensors kept (layers 8..9), 0 MTP tensors skipped" in r.stdout, r.stdout
    r = subprocess.run(cli, cwd=ROOT, capture_output=True, text=True)  # not kept: not audited, only counted
    assert r.returncode == 0 and "33 MTP tensors skipped" in r.stdout and "kept" not in r.stdout, r.stderr


def test_check_only_with_keep_mtp_passes_and_counts(ckpts, capsys):
    convert.main(ckpts["fp8_vl"], None, tp_size=4, check_only=True, keep_mtp=True)
    assert "34 MTP tensors kept (layers 8..9), 0 MTP tensors skipped" in capsys.readouterr().out


def test_keep_mtp_on_a_checkpoint_without_mtp_layers_is_refused(tmp_path):
    ck = make_checkpoint(str(tmp_path / "ck"), fp8=False, vl=False, text_overrides={"num_nextn_predict_layers": 0})
    with pytest.raises(SystemExit) as e:
        convert.main(ck, str(tmp_path / "out"), tp_size=2, keep_mtp=True)
    assert "1 problem(s)" in str(e.value) and "--keep-mtp: num_nextn_predict_layers=0" in str(e.value), e.value
    assert not (tmp_path / "out").exists()
    convert.main(ck, str(tmp_path / "out"), tp_size=2)  # the same checkpoint converts without the flag


def test_resume_switching_keep_mtp_rewrites_every_shard(ckpts, converted, converted_mtp, tmp_path, capsys):
    """A shard without the MTP layers is not complete for a --keep-mtp run, and the other way round (the fingerprint,
    which covers kept MTP tensors, differs; so does the key set)."""
    out = str(tmp_path / "out")
    shutil.copytree(converted("bf16_text", 2), out)
    for keep, clean, why in ((True, converted_mtp("bf16_text", 2), "metadata source_fingerprint="),
                             (False, converted("bf16_text", 2), "metadata source_fingerprint=")):
        capsys.readouterr()
        convert.main(ckpts["bf16_text"], out, tp_size=2, keep_mtp=keep)
        printed = capsys.readouterr().out
        for r in range(2):
            assert f"rank {r}: rewriting {os.path.join(out, 'tp2', f'model-r{r}.safetensors')}: {why}" in printed
        assert dir_bytes(out) == dir_bytes(clean)
    convert.main(ckpts["bf16_text"], out, tp_size=2, keep_mtp=False)
    assert capsys.readouterr().out.count("sha256 verified); kept") == 2


# ---------------------------------------------------------------------------------------------- memory
def _peak_mib(code):
    # VmHWM is per address space (reset at exec); ru_maxrss would inherit the forking test process's peak
    out = subprocess.run([sys.executable, "-c", code + "\nprint([l for l in open('/proc/self/status') "
                          "if l.startswith('VmHWM')][0].split()[1])"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    return int(out.split()[-1]) / 1024


@pytest.mark.slow
def test_conversion_memory_stays_below_one_rank_shard(tmp_path):
    """At TP=1 one rank's shard is the whole checkpoint; streaming must add far less than that."""
    ck = make_checkpoint(str(tmp_path / "ck"), vl=False, n_files=6,
                         text_overrides=dict(moe_num_experts=32, moe_intermediate_size=512, hidden_size=512))
    size = sum(os.path.getsize(os.path.join(ck, f)) for f in os.listdir(ck) if f.endswith(".safetensors")) / 2**20
    idle = _peak_mib("import convert")
    peak = _peak_mib(f"import convert; convert.main({ck!r}, {str(tmp_path / 'out')!r}, tp_size=1)")
    assert size > 60 and peak - idle < 0.6 * size, f"conversion added {peak - idle:.0f} MiB for a {size:.0f} MiB checkpoint"


def test_keep_mtp_resume_sees_a_source_whose_mtp_weights_alone_changed(ckpts, tmp_path, capsys):
    """With --keep-mtp the fingerprint covers the MTP tensors: shards of a source that differs only there are
    rewritten on resume, not kept."""
    src = str(tmp_path / "ckpt")
    shutil.copytree(ckpts["bf16_text"], src)
    out = str(tmp_path / "out")
    convert.main(src, out, tp_size=1, keep_mtp=True)
    name = "model.layers.8.eh_proj.weight"
    with open(os.path.join(src, INDEX)) as f:
        path = os.path.join(src, json.load(f)["weight_map"][name])
    with safe_open(path, "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    tensors[name] = -tensors[name]
    save_file(tensors, path, metadata=meta)
    capsys.readouterr()
    convert.main(src, out, tp_size=1, keep_mtp=True)
    printed = capsys.readouterr().out
    assert "rank 0: rewriting" in printed and "source_fingerprint" in printed, printed


def _with_header(path: str, edit) -> str:
    """A copy of a two-tensor safetensors file at path + '.x' whose header is edit(header) (the data kept)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header, data = json.loads(f.read(n)), f.read()
    raw = json.dumps(edit(header)).encode()
    with open(path + ".x", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)
    return path + ".x"


@pytest.mark.parametrize("edit,needle", [
    (lambda h: {**h, "a": {**h["a"], "data_offsets": ["0", "16"]}}, "malformed header entry for a"),
    (lambda h: {**h, "b": {**h["b"], "data_offsets": [8, 24]}}, "b has data_offsets [8, 24]: it overlaps"),
    (lambda h: {**h, "__metadata__": ["x"]}, "__metadata__ must map strings to strings"),
    (lambda h: {**h, "__metadata__": {"k": 1}}, "__metadata__ must map strings to strings"),
])
def test_header_the_safetensors_library_would_refuse_is_refused_by_the_audit(tmp_path, edit, needle):
    """The audit reads headers itself; what it passes, safetensors must open (else the run fails after a PASS)."""
    path = str(tmp_path / "t.safetensors")
    save_file({"a": torch.zeros(4), "b": torch.ones(4)}, path, metadata={"format": "pt"})
    assert convert.read_header(path)[1] == {"format": "pt"}
    with pytest.raises(convert.BadFile, match=re.escape(needle)):
        convert.read_header(_with_header(path, edit))
    bad = str(tmp_path / os.fsdecode(b"\xff.safetensors"))
    shutil.copy(path, bad)
    with pytest.raises(convert.BadFile, match="opens only UTF-8 paths"):
        convert.read_header(bad)


# ---------------------------------------------------------------------------------------------- non-finite values
def _poke(ck, name, flat_index, raw: bytes):
    """Overwrite element `flat_index` of tensor `name` in its source file with `raw` (header and length kept)."""
    path = os.path.join(ck, json.load(open(os.path.join(ck, INDEX)))["weight_map"][name])
    entries, _, start = convert.read_header(path)
    with open(path, "r+b") as f:
        f.seek(start + entries[name]["data_offsets"][0] + flat_index * len(raw))
        f.write(raw)
    return os.path.basename(path)


# (tensor, dtype's non-finite bytes, flat element index, that index in the tensor's shape, value as printed)
NON_FINITE = [("model.layers.1.mlp.up_proj.weight", b"\xc0\x7f", 512 * 256 - 1, "[511, 255]", "nan"),   # BF16, split
              ("model.layers.1.self_attn.o_proj.weight", b"\x80\xff", 3 * 768 + 700, "[3, 700]", "-inf"),  # split dim 1
              ("model.norm.weight", b"\x00\x00\x80\x7f", 100, "[100]", "inf"),                       # F32, replicated
              ("model.layers.3.moe.up_proj.weight", b"\x7f", 5 * 192 * 256 + 7, "[5, 0, 7]", "nan"),  # E4M3 0x7F
              ("model.layers.3.moe.down_proj.weight", b"\xff", 15 * 256 * 192 + 255 * 192 + 191, "[15, 255, 191]",
               "nan"),                                                                                # E4M3 0xFF
              ("model.layers.3.moe.up_proj.weight_scale_inv", b"\x00\x00\xc0\x7f", 1, "[0, 0, 1]", "nan")]


@pytest.mark.parametrize("name,raw,flat,index,value", NON_FINITE,
                         ids=[n[0].split(".", 3)[-1] + n[4] for n in NON_FINITE])
@pytest.mark.slow
def test_non_finite_weight_is_refused_naming_tensor_file_and_index(ckpts, tmp_path, name, raw, flat, index, value):
    ck = str(tmp_path / "ck")
    shutil.copytree(ckpts["fp8_vl"], ck)
    fname = _poke(ck, name, flat, raw)
    before = dir_bytes(ck)
    out = str(tmp_path / "out")
    r = subprocess.run([sys.executable, "convert.py", "--checkpoint", ck, "--out-dir", out, "--tp-size", "2"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    err = r.stderr.strip().splitlines()
    assert err[-1] == f"error: {fname}: {name} holds a non-finite value ({value}) at index {index}; convert.py " \
                      "refuses non-finite weights (fix or re-download that file)", r.stderr
    assert not any(f.endswith(".partial") for f in os.listdir(os.path.join(out, "tp2")))
    assert "PASS" not in r.stdout and dir_bytes(ck) == before


def test_check_only_says_values_are_checked_during_conversion(ckpts, capsys):
    convert.main(ckpts["bf16_text"], None, tp_size=2, check_only=True)
    assert "check passed (headers only: NaN/Inf in tensor values are checked while converting); nothing written" \
        in capsys.readouterr().out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_first_non_finite_finds_nan_and_inf(dtype):
    info = torch.finfo(dtype)
    fin = torch.tensor([0.0, -1.5, info.max, info.min, info.tiny], dtype=dtype)
    assert convert.first_non_finite(fin) is None
    for v in (float("nan"), float("inf"), float("-inf")):
        assert convert.first_non_finite(torch.cat([fin, torch.tensor([v], dtype=dtype), fin]).reshape(1, -1)) == 5, v


@pytest.mark.parametrize("dtype,finite,bad", [
    (torch.float8_e4m3fn, [0x00, 0x7E, 0x80, 0xFE, 0x01], [0x7F, 0xFF]),  # no Inf; 0x7E = 448 is finite
    (torch.float8_e5m2, [0x00, 0x7B, 0x80, 0xFB, 0x01], [0x7C, 0xFC, 0x7D, 0x7F, 0xFD, 0xFF]),  # +-Inf, NaNs
], ids=["e4m3", "e5m2"])
def test_first_non_finite_knows_the_fp8_encodings(dtype, finite, bad):
    fin = torch.tensor(finite, dtype=torch.uint8)
    assert convert.first_non_finite(fin.view(dtype)) is None
    for b in bad:
        t = torch.cat([fin, torch.tensor([b], dtype=torch.uint8), fin]).view(dtype)
        assert convert.first_non_finite(t) == 5, hex(b)


def test_first_non_finite_finds_the_first_bad_element_of_a_long_tensor():
    t = torch.zeros(3 << 20 | 5)
    t[2 << 20 | 3] = float("nan")
    t[-1] = float("-inf")
    assert convert.first_non_finite(t) == 2 << 20 | 3
    t[2 << 20 | 3] = 0
    assert convert.first_non_finite(t) == t.numel() - 1
    assert convert.first_non_finite(torch.zeros(0, 4)) is None
    assert convert.first_non_finite(torch.ones(3, dtype=torch.int64)) is None


@pytest.mark.parametrize("edit,needle", [
    ({"sliding_window": 0}, "sliding_window=0 must be > 0"),
    ({"rms_norm_eps": -1}, "rms_norm_eps=-1 must be > 0"),
    ({"max_position_embeddings": -5}, "max_position_embeddings=-5 must be > 0"),
    ({"moe_top_k": 0, "num_experts_per_tok": 0}, "moe_top_k=0 must be > 0"),
    ({"rope_theta": -1}, "rope_theta=-1 must be > 0"),
    ({"rope_theta": [10000.0] * 3 + [0.0] + [10000.0] * 6}, "rope_theta[3]=0.0 must be > 0"),
])
def test_config_size_or_scale_of_zero_or_less_is_refused(ckpts, edit, needle):
    """Values that pass every shape check and then fail late (a window of 0), give NaN (eps or rope_theta <= 0) or
    silently route to no expert (top-k 0) are refused, naming the field."""
    from config import ConfigError
    cfg = json.load(open(os.path.join(ckpts["fp8_vl"], "config.json")))
    cfg["text_config"].update(edit)
    with pytest.raises(ConfigError) as e:
        parse_config(cfg)
    assert str(e.value) == f"config.json: {needle}"


@pytest.mark.parametrize("path,value", [
    (("text_config", "rms_norm_eps"), float("nan")), (("text_config", "rope_theta", 3), float("inf")),
    (("text_config", "moe_router_scaling_factor"), float("-inf")),
    (("text_config", "rope_scaling", "factor"), float("nan")), (("text_config", "swiglu_limits", 0), float("inf")),
    (("vision_config", "layer_norm_eps"), float("nan")), (("vision_config", "rope_theta"), float("inf")),
    (("vision_config", "mlp_ratio"), float("nan")),
])
@pytest.mark.slow
def test_non_finite_config_number_is_refused_naming_the_field(ckpts, tmp_path, path, value):
    """Python's json reads NaN / Infinity / -Infinity as floats; every reader of a config (convert.py, and
    config.load_config for generate.py's per-rank configs) refuses them, naming the field."""
    from config import ConfigError, load_config
    cfg = json.load(open(os.path.join(ckpts["fp8_vl"], "config.json")))
    d = cfg
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value
    field = (".".join(str(k) for k in path if not isinstance(k, int))
             + "".join(f"[{k}]" for k in path if isinstance(k, int)))
    needle = f"{field}={json.dumps(value)} is not a finite number"
    with pytest.raises(ConfigError) as e:
        parse_config(cfg)
    assert str(e.value) == f"config.json: {needle}"
    if path[0] == "text_config":  # the text-only form names the field at the top level
        with pytest.raises(ConfigError) as e:
            parse_config(cfg["text_config"])
        assert str(e.value) == f"config.json: {needle.split('.', 1)[1]}"
    ck = str(tmp_path / "ck")
    shutil.copytree(ckpts["fp8_vl"], ck)
    json.dump(cfg, open(os.path.join(ck, "config.json"), "w"))
    r = subprocess.run([sys.executable, "convert.py", "--checkpoint", ck, "--out-dir", str(tmp_path / "out"),
                        "--tp-size", "2"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.strip() == f"error: {os.path.join(ck, 'config.json')}: {needle}", r.stderr
    assert not (tmp_path / "out").exists()
    per_rank = str(tmp_path / "config-r0.json")
    json.dump(cfg, open(per_rank, "w"))
    with pytest.raises(ConfigError) as e:
        load_config(per_rank)
    assert str(e.value) == f"{per_rank}: {needle}"


# ------------------------------------------------------------------------------------------- resume vs a changed source
def _flip_late_byte(ck, name="model.layers.1.mlp.up_proj.weight", keep_mtime=False):
    """Change one BF16 element far past a tensor's first 64 bytes (in its last row: rank 1's slice at TP=2), the
    file's size kept; with keep_mtime its atime/mtime are put back too (as `touch -r` or a careful copy would)."""
    path = os.path.join(ck, json.load(open(os.path.join(ck, INDEX)))["weight_map"][name])
    st = os.stat(path)
    _poke(ck, name, 512 * 256 - 3, b"\x80\x3f")  # 1.0
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.path.getsize(path) == st.st_size


def _records(tp2, edit):
    """Replace the two ranks' source records by edit(their texts); a None text removes that record."""
    recs = [os.path.join(tp2, f"model-r{r}.safetensors.source.json") for r in range(2)]
    for rec, text in zip(recs, edit([open(rec).read() for rec in recs])):
        if text is None:
            os.remove(rec)
        else:
            open(rec, "w").write(text)


# how the change shows on a rerun: (keep the file's mtime, edit of the source records, why rank r re-reads)
RESUME_CASES = {
    "mtime changed": (False, None, "{fname} changed on disk"),
    "size and mtime unchanged": (True, None, "{fname} changed on disk"),  # ctime tells
    # no valid record (a shard of an earlier converter, or a run killed before its record): the same re-read
    "record missing": (True, lambda texts: [None, None],
                       "no source record (model-r{r}.safetensors.source.json missing)"),
    "record garbled": (True, lambda texts: ["{", "{"], "model-r{r}.safetensors.source.json unreadable ("),
    "records swapped": (True, lambda texts: texts[::-1],
                        "model-r{r}.safetensors.source.json records another sha256 than model-r{r}.safetensors.sha256"),
}


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_resume_rewrites_a_shard_whose_source_bytes_changed_past_the_first_bytes(ckpts, tmp_path, capsys, case):
    """The fingerprint samples only the first bytes of each tensor; each shard's source record (its source files'
    size, mtime, ctime and inode, beside the shard's sha256) sees the change, or is missing, so the source is re-read
    for that shard, and only the shard whose bytes really differ is rewritten; the other is kept with a new record."""
    keep_mtime, edit, why = RESUME_CASES[case]
    ck, out = str(tmp_path / "ck"), str(tmp_path / "out")
    shutil.copytree(ckpts["bf16_text"], ck)
    convert.main(ck, out, tp_size=2)
    tp2 = os.path.join(out, "tp2")
    if edit:
        _records(tp2, edit)
    _flip_late_byte(ck, keep_mtime=keep_mtime)
    capsys.readouterr()
    convert.main(ck, out, tp_size=2)
    printed = capsys.readouterr().out
    fname = json.load(open(os.path.join(ck, INDEX)))["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    assert f"rank 1: rewriting {tp2}/model-r1.safetensors: the source's bytes differ from those it was made from " \
           f"(re-read since {why.format(fname=fname, r=1)}" in printed, printed
    assert f"rank 0: {tp2}/model-r0.safetensors is complete and matches (header, metadata, length, source re-read " \
           f"since {why.format(fname=fname, r=0)}" in printed, printed
    assert "same bytes, sha256 verified); kept" in printed, printed
    fresh = str(tmp_path / "fresh")
    convert.main(ck, fresh, tp_size=2)
    assert dir_bytes(out) == dir_bytes(fresh)


def test_no_verify_existing_still_sees_a_changed_source(ckpts, tmp_path, capsys):
    """--no-verify-existing skips re-hashing the shards, not the source check: a stale shard is a wrong answer."""
    ck, out = str(tmp_path / "ck"), str(tmp_path / "out")
    shutil.copytree(ckpts["bf16_text"], ck)
    convert.main(ck, out, tp_size=2)
    _flip_late_byte(ck, keep_mtime=True)
    capsys.readouterr()
    convert.main(ck, out, tp_size=2, verify_existing=False)
    printed = capsys.readouterr().out
    assert "rank 1: rewriting" in printed and "the source's bytes differ" in printed, printed
    assert "changed on disk: same bytes); kept, contents not verified (--no-verify-existing)" in printed, printed
    fresh = str(tmp_path / "fresh")
    convert.main(ck, fresh, tp_size=2)
    assert dir_bytes(out) == dir_bytes(fresh)


def test_resume_keeps_shards_of_an_unchanged_source_without_reading_it(ckpts, converted, tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "out")
    shutil.copytree(converted("bf16_text", 2), out)

    def no_data(*a, **k):
        raise AssertionError("the source was read although its files are unchanged")
    monkeypatch.setattr(convert, "safe_open", no_data)
    capsys.readouterr()
    convert.main(ckpts["bf16_text"], out, tp_size=2)
    printed = capsys.readouterr().out
    for r in range(2):
        assert f"rank {r}: {os.path.join(out, 'tp2', f'model-r{r}.safetensors')} is complete and matches (header, " \
               "metadata, length, source files' size/mtime/ctime/inode unchanged, sha256 verified); kept" in printed
    assert dir_bytes(out) == dir_bytes(converted("bf16_text", 2))


def test_resume_after_touching_the_source_rereads_it_and_keeps_the_shards(ckpts, tmp_path, capsys):
    ck, out = str(tmp_path / "ck"), str(tmp_path / "out")
    shutil.copytree(ckpts["bf16_text"], ck)
    convert.main(ck, out, tp_size=2)
    before = {r: os.stat(os.path.join(out, "tp2", f"model-r{r}.safetensors")) for r in range(2)}
    for f in os.listdir(ck):
        os.utime(os.path.join(ck, f))
    capsys.readouterr()
    convert.main(ck, out, tp_size=2)
    printed = capsys.readouterr().out
    assert printed.count("changed on disk: same bytes, sha256 verified); kept") == 2, printed
    for r in range(2):
        st = os.stat(os.path.join(out, "tp2", f"model-r{r}.safetensors"))
        assert (st.st_ino, st.st_mtime_ns) == (before[r].st_ino, before[r].st_mtime_ns)
    capsys.readouterr()
    convert.main(ck, out, tp_size=2)  # the refreshed records now match: no second re-read
    assert capsys.readouterr().out.count("size/mtime/ctime/inode unchanged, sha256 verified); kept") == 2


# ---------------------------------------------------------------------------------------------- two runs, one --out-dir
# A real convert.py process (convert.cli) whose first source read waits until the file argv[1] exists, so a test can
# act while it holds the output directory with a shard half written.
HOLD = """
import os, sys, time
import convert
real, held = convert.safe_open, []
def held_open(*a, **k):
    if not held:
        held.append(1)
        print("HOLDING", file=sys.stderr, flush=True)
        while not os.path.exists(sys.argv[1]):
            time.sleep(0.05)
    return real(*a, **k)
convert.safe_open = held_open
convert.cli(sys.argv[2:])
"""


def _start_held(go, args):
    p = subprocess.Popen([sys.executable, "-c", HOLD, go, *args], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    for line in p.stderr:
        if line.strip() == "HOLDING":
            return p
    raise AssertionError(f"the held run ended early: {p.communicate()}")


@pytest.mark.slow
def test_a_second_conversion_into_the_same_out_dir_is_refused_at_once(ckpts, converted, tmp_path):
    import socket
    out, go = str(tmp_path / "out"), str(tmp_path / "go")
    args = ["--checkpoint", ckpts["fp8_vl"], "--out-dir", out, "--tp-size", "2"]
    a = _start_held(go, args)
    try:
        partial = [f for f in os.listdir(os.path.join(out, "tp2")) if f.endswith(".partial")]
        assert len(partial) == 1 and partial[0].startswith(f".model-r0.safetensors.{a.pid}-"), partial
        b = subprocess.run([sys.executable, "convert.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert b.returncode == 1 and b.stderr.strip() == (
            f"error: {out}/.convert.lock is held by another convert.py (pid {a.pid} on {socket.gethostname()}) "
            f"converting into {out}; wait for it to finish or stop it"), b.stderr
        assert "PASS" not in b.stdout
    finally:
        open(go, "w").close()
        a_out, a_err = a.communicate(timeout=300)
    assert a.returncode == 0 and "PASS" in a_out, a_err
    assert dir_bytes(out) == dir_bytes(converted("fp8_vl", 2))


def test_a_lock_file_that_is_a_symbolic_link_is_refused_and_its_target_kept(tmp_path):
    """Writing the holder into a linked lock would empty the file it points to (a source checkpoint's, say)."""
    target, out = tmp_path / "keep.json", tmp_path / "out"
    target.write_text("{}")
    out.mkdir()
    os.symlink(target, out / ".convert.lock")
    with pytest.raises(SystemExit, match="convert.lock is a symbolic link; the lock must be a plain file"):
        with convert.out_dir_lock(str(out)):
            pass
    assert target.read_text() == "{}"


def test_a_run_killed_mid_shard_leaves_nothing_the_next_run_keeps(ckpts, converted, tmp_path):
    import signal
    out, go = str(tmp_path / "out"), str(tmp_path / "go")
    args = ["--checkpoint", ckpts["fp8_vl"], "--out-dir", out, "--tp-size", "2"]
    a = _start_held(go, args)
    os.kill(a.pid, signal.SIGKILL)
    a.communicate(timeout=60)
    assert any(f.endswith(".partial") for f in os.listdir(os.path.join(out, "tp2")))
    r = subprocess.run([sys.executable, "convert.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "PASS" in r.stdout, r.stderr
    assert dir_bytes(out) == dir_bytes(converted("fp8_vl", 2))


@pytest.mark.parametrize("damage", ["truncated", "4 KB overwritten"])
def test_a_shard_changed_after_its_rename_fails_the_run(ckpts, tmp_path, monkeypatch, capsys, damage):
    """Before PASS every shard written is checked again (size, then sha256 re-read): bytes someone else wrote
    into OUT after the rename are not passed off as this conversion."""
    out = str(tmp_path / "out")
    real = convert.write_shard

    def clobbered(path, *a):
        sha = real(path, *a)
        if path.endswith("model-r1.safetensors"):
            if damage == "truncated":
                os.truncate(path, os.path.getsize(path) // 2)
            else:
                _overwrite_4k(path)
        return sha
    monkeypatch.setattr(convert, "write_shard", clobbered)
    with pytest.raises(SystemExit) as e:
        convert.main(ckpts["fp8_vl"], out, tp_size=2)
    shard = os.path.join(out, "tp2", "model-r1.safetensors")
    assert str(e.value).startswith(f"error: {shard}: changed after convert.py wrote it ("), e.value
    assert str(e.value).endswith("; rerun to rewrite it"), e.value
    assert "PASS" not in capsys.readouterr().out


# ----------------------------------------------------------------------------- partial downloads, tokenizer, Ctrl-C
def _scale_in_its_own_file(ck, name="model.layers.3.moe.up_proj.weight_scale_inv"):
    """Move one FP8 scale grid into model-scales.safetensors (its weight stays where it was), as a release may."""
    fname = "model-scales.safetensors"
    idx = json.load(open(os.path.join(ck, INDEX)))
    wm = idx["weight_map"]
    home = os.path.join(ck, wm[name])
    d = load_file(home)
    save_file({name: d.pop(name)}, os.path.join(ck, fname), metadata={"format": "pt"})
    save_file(d, home, metadata={"format": "pt"})
    wm[name] = fname
    json.dump(idx, open(os.path.join(ck, INDEX), "w"))
    return os.path.join(ck, fname)


@pytest.mark.parametrize("check_only", [True, False], ids=["check-only", "convert"])
@pytest.mark.parametrize("damage", ["missing", "truncated"])
@pytest.mark.slow
def test_scale_grid_in_a_missing_or_truncated_file_is_one_problem(ckpts, tmp_path, damage, check_only):
    """A partial download: the FP8 weight's file is complete, its weight_scale_inv's file is not."""
    ck = str(tmp_path / "ck")
    shutil.copytree(ckpts["fp8_vl"], ck)
    path = _scale_in_its_own_file(ck)
    convert.main(ck, None, tp_size=2, check_only=True)  # the split itself is a valid checkpoint
    if damage == "missing":
        os.remove(path)
    else:
        os.truncate(path, os.path.getsize(path) - 10)
    r = subprocess.run([sys.executable, "convert.py", "--checkpoint", ck, "--tp-size", "2",
                        *(["--check-only"] if check_only else ["--out-dir", str(tmp_path / "out")])],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "error: 1 problem(s)" in r.stderr and "model-scales.safetensors" in r.stderr, r.stderr
    assert ("but missing" if damage == "missing" else "truncated") in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def _truncate_tokenizer(ck):
    p = os.path.join(ck, "tokenizer.json")
    os.truncate(p, os.path.getsize(p) // 2)


def _latin1_tokenizer_config(ck):
    p = os.path.join(ck, "tokenizer_config.json")
    data = open(p, "rb").read()
    open(p, "wb").write(data.replace(b'"<s>"', '"<s>\u00e9"'.encode("latin-1")))


def _tokenizer_json_is_a_directory(ck):
    os.remove(os.path.join(ck, "tokenizer.json"))
    os.mkdir(os.path.join(ck, "tokenizer.json"))


@pytest.mark.parametrize("check_only", [True, False], ids=["check-only", "convert"])
@pytest.mark.parametrize("damage,needle", [
    (_truncate_tokenizer, "tokenizer.json: not valid JSON ("),
    (_latin1_tokenizer_config, "tokenizer_config.json: not UTF-8 text ('utf-8' codec can't decode byte 0xe9"),
    (_tokenizer_json_is_a_directory, "tokenizer.json: is a directory, not a file"),
], ids=["truncated tokenizer.json", "latin-1 tokenizer_config.json", "tokenizer.json is a directory"])
@pytest.mark.slow
def test_bad_tokenizer_file_is_named(ckpts, tmp_path, damage, needle, check_only):
    """The tokenizer files convert.py copies are checked first: JSON ones must be UTF-8 JSON, the rest UTF-8."""
    ck = str(tmp_path / "ck")
    shutil.copytree(ckpts["bf16_text"], ck)
    damage(ck)
    r = subprocess.run([sys.executable, "convert.py", "--checkpoint", ck, "--tp-size", "2",
                        *(["--check-only"] if check_only else ["--out-dir", str(tmp_path / "out")])],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "error: 1 problem(s)" in r.stderr and f"  {needle}" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_ctrl_c_ends_with_one_line_and_the_rerun_resumes(ckpts, converted, tmp_path):
    import signal
    out, go = str(tmp_path / "out"), str(tmp_path / "go")
    args = ["--checkpoint", ckpts["fp8_vl"], "--out-dir", out, "--tp-size", "2"]
    a = _start_held(go, args)
    a.send_signal(signal.SIGINT)
    _, err = a.communicate(timeout=120)
    assert a.returncode == 1 and err.strip() == ("error: interrupted (Ctrl-C); shards already complete are kept: "
                                                 "rerun the same command to resume"), err
    assert not any(f.endswith(".partial") for f in os.listdir(os.path.join(out, "tp2")))
    r = subprocess.run([sys.executable, "convert.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "PASS" in r.stdout, r.stderr
    assert dir_bytes(out) == dir_bytes(converted("fp8_vl", 2))


# ----------------------------------------------------------------------------------------- messages that name the thing
def _limit_file_size():
    import resource
    import signal
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG instead of killing
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))


def test_a_failed_write_names_the_file(ckpts, tmp_path):
    """The OS gives write() errors no file name (`error: : No space left on device` was the result); a file size
    limit fails the same write() with EFBIG."""
    out = str(tmp_path / "out")
    r = subprocess.run([sys.executable, "convert.py", "--checkpoint", ckpts["bf16_text"], "--out-dir", out,
                        "--tp-size", "2"], cwd=ROOT, capture_output=True, text=True, preexec_fn=_limit_file_size)
    shard = os.path.join(out, "tp2", "model-r0.safetensors")
    assert r.returncode == 1 and r.stderr.strip() == f"error: {shard}: File too large", r.stderr
    assert not any(f.endswith(".partial") for f in os.listdir(os.path.join(out, "tp2")))


def test_disk_full_at_fsync_names_the_file(ckpts, tmp_path, monkeypatch):
    import errno

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(convert.os, "fsync", full)
    out = str(tmp_path / "out")
    with pytest.raises(SystemExit) as e:
        convert.main(ckpts["bf16_text"], out, tp_size=2)
    assert str(e.value) == f"error: {os.path.join(out, 'tp2', 'model-r0.safetensors')}: No space left on device"


def _index_file_is_a_directory(ck):
    f = os.path.join(ck, "model-00002-of-00004.safetensors")
    os.remove(f)
    os.mkdir(f)


def _index_is_a_directory(ck):
    os.remove(os.path.join(ck, INDEX))
    os.mkdir(os.path.join(ck, INDEX))


def _duplicate_index_key(ck):
    text = open(os.path.join(ck, INDEX)).read()
    line = next(ln for ln in text.splitlines() if '"model.norm.weight"' in ln)
    open(os.path.join(ck, INDEX), "w").write(text.replace(line, line.rstrip(",") + ",\n" + line, 1))


def _duplicate_config_key(ck):
    text = open(os.path.join(ck, "config.json")).read()
    open(os.path.join(ck, "config.json"), "w").write(text.replace('"rms_norm_eps": 1e-05,',
                                                                  '"rms_norm_eps": 1e-05, "rms_norm_eps": 1e-06,', 1))


def _duplicate_header_key(ck):
    """A safetensors header naming one tensor twice (same length, so only the duplicate is wrong)."""
    path = os.path.join(ck, "model-00001-of-00004.safetensors")
    data = open(path, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    head = json.loads(data[8:8 + n])
    a, b = sorted(k for k in head if k != "__metadata__")[:2]
    raw = data[8:8 + n].replace(f'"{b}"'.encode(), f'"{a}"'.encode().ljust(len(b) + 2), 1)
    open(path, "wb").write(data[:8] + raw + data[8 + n:])
    return a


@pytest.mark.parametrize("case,needle", [
    (_index_file_is_a_directory, "model-00002-of-00004.safetensors: named by model.safetensors.index.json for "),
    (_index_is_a_directory, f"{INDEX}: is a directory, not a JSON file"),
    (_duplicate_index_key, f'{INDEX}: key "model.norm.weight" appears twice in one JSON object'),
    (_duplicate_config_key, 'config.json: key "rms_norm_eps" appears twice in one JSON object'),
    (_duplicate_header_key, 'model-00001-of-00004.safetensors: header: key "'),
], ids=["index-named file is a directory", "index is a directory", "duplicate key in the index",
        "duplicate key in config.json", "duplicate key in a safetensors header"])
@pytest.mark.slow
def test_directories_and_duplicate_keys_are_named(ckpts, tmp_path, case, needle):
    ck = str(tmp_path / "ck")
    shutil.copytree(ckpts["fp8_vl"], ck)
    case(ck)
    r = subprocess.run([sys.executable, "convert.py", "--checkpoint", ck, "--check-only", "--tp-size", "2"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 1 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    if case is _index_file_is_a_directory:
        assert "but is a directory, not a safetensors file" in r.stderr and "missing" not in r.stderr, r.stderr
    if case is _duplicate_header_key:
        assert "appears twice in one JSON object" in r.stderr, r.stderr


def test_an_output_path_that_is_a_directory_is_named(ckpts, tmp_path):
    out = str(tmp_path / "out")
    os.makedirs(os.path.join(out, "tp2", "model-r1.safetensors"))
    with pytest.raises(SystemExit) as e:
        convert.main(ckpts["bf16_text"], out, tp_size=2)
    path = os.path.join(out, "tp2", "model-r1.safetensors")
    assert str(e.value) == (f"error: {path} is a directory; convert.py writes a file there (move the directory "
                            "away)"), e.value
    assert not os.path.exists(os.path.join(out, "tp2", "model-r0.safetensors")), "refused before writing anything"


def test_per_rank_config_with_a_duplicate_key_is_refused():
    from config import ConfigError, load_config
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        f.write('{"hidden_size": 256, "hidden_size": 512}')
    with pytest.raises(ConfigError) as e:
        load_config(f.name)
    assert str(e.value) == f'{f.name}: key "hidden_size" appears twice in one JSON object'
    os.remove(f.name)


def test_help_states_the_defaults():
    r = subprocess.run([sys.executable, "convert.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    text = " ".join(r.stdout.split())
    assert r.returncode == 0 and "--tp-size TP_SIZE" in text, r.stdout
    assert "number of ranks to shard for (default: 8)" in text and "(default: --tp-size)" in text, r.stdout


@pytest.mark.parametrize("check_only", [False, True])
def test_out_dir_holding_the_checkpoint_beside_the_outputs_is_accepted(ckpts, tmp_path, check_only):
    """--checkpoint /data/X --out-dir /data writes /data/tp2 and /data/tokenizer_files, beside X, not into it."""
    data = tmp_path / "data"
    ck = str(data / "X")
    shutil.copytree(ckpts["bf16_text"], ck)
    before = dir_bytes(ck)
    convert.main(ck, str(data), tp_size=2, check_only=check_only)
    assert dir_bytes(ck) == before
    assert os.path.exists(data / "tp2" / "model-r1.safetensors") != check_only


def test_checkpoint_named_tokenizer_files_under_out_is_refused(ckpts, tmp_path):
    ck = str(tmp_path / "tokenizer_files")
    shutil.copytree(ckpts["bf16_text"], ck)
    with pytest.raises(SystemExit) as e:
        convert.main(ck, str(tmp_path), tp_size=2)
    assert f"the output {os.path.join(str(tmp_path), 'tokenizer_files')} is the checkpoint directory" in str(e.value)
