"""The runtime under both front ends (runtime.py), in process: files and the tokenizer, rank 0's progress lines, the
engine flags each front end declares with its own defaults, and the decisions rank 0 broadcasts applied to an engine
(runtime.Driver). The front ends' end-to-end behaviour under torchrun is tests/test_generate.py's and
tests/test_serve.py's.
"""
import os
import re
import subprocess
import sys

import pytest
import torch

import engine
import generate
import runtime
import serve
from invariants import ROOT


def test_a_json_file_that_cannot_be_read_is_named(tmp_path):
    import socket
    path = str(tmp_path / "p.json")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(path)  # open() fails on a socket even for root, as it does on a file without read permission
        with pytest.raises(runtime.UserError, match=r"p\.json: cannot read it \(No such device or address\)"):
            runtime.read_json(path)


def test_tokenizer_loads_directly_and_keeps_long_prompts(converted):
    """The runtime loads tokenizer.json itself; a long mixed-script prompt keeps every token (the regression
    was a 4,373-token prompt collapsing to 74 under automatic class selection) and equals the raw tokenizer's ids."""
    from tokenizers import Tokenizer
    d = os.path.join(converted("bf16_text", 2), "..", "tokenizer_files")
    tok = runtime.load_tokenizer(d)
    text = " ".join(["Sparse attention selects regions; 稀疏注意力为每个查询选择区域。"] * 300)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    raw = Tokenizer.from_file(os.path.join(d, "tokenizer.json")).encode(text, add_special_tokens=False).ids
    assert ids == raw and len(ids) > 4000
    assert tok.decode(ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True, add_generation_prompt=True)
    chat = list(chat["input_ids"] if hasattr(chat, "keys") else chat)
    assert chat[:2] == [tok.bos_token_id, tok.convert_tokens_to_ids("<|im_start|>")] and tok.eos_token_id == 4


def test_prefill_progress_times_each_prefill_from_its_own_start(monkeypatch):
    """Rank 0's progress lines time a prefill from its first layer, also one that starts after a reused prefix."""
    said, now = [], [0.0]
    monkeypatch.setattr(runtime.time, "perf_counter", lambda: now[0])
    progress = runtime.progress_printer(runtime.Session(None, 0, 1, torch.device("cpu"), None, None, None, [],
                                                        say=said.append))
    for prefill, start in ((0, 0), (1, 8)):
        now[0] = 100.0 * prefill  # the second prefill starts 100 s after the first
        progress(start, 16 - start, 16, 1, 2, start)
        now[0] += runtime.PROGRESS_AFTER_S + 1
        progress(start, 16 - start, 16, 2, 2, start)
    monkeypatch.undo()
    assert said == [f"prefill: tokens {a}-16 of 16, layer 2/2 after 6 s" for a in (0, 8)]


@pytest.mark.parametrize("script,parse,source,chunk,batch", [
    ("generate.py", generate.parser, ["--prompt", "hi"], engine.PREFILL_CHUNK, None),
    ("serve.py", serve.parser, [], 4096, 16),
])
@pytest.mark.slow
def test_each_front_end_declares_the_engine_flags_with_its_own_defaults(script, parse, source, chunk, batch):
    """One group of engine flags, two sets of defaults: generate.py prefills engine.PREFILL_CHUNK tokens a step and
    sizes its slots from the batch; serve.py prefills 4096 a step, so running streams keep their pace, over 16 slots.
    The parsed defaults are these, and --help prints them."""
    a = parse().parse_args(["--tp-dir", "shards", *source])
    assert (a.prefill_chunk, a.max_batch) == (chunk, batch)
    flags, _ = runtime.EngineFlags.split(vars(a))
    assert (flags.prefill_chunk, flags.max_batch, flags.tp_dir) == (chunk, batch, "shards")
    r = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")})
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    text = " ".join(r.stdout.split())  # argparse wraps to the terminal's width
    said = {flag: re.search(rf"{flag} [A-Z] .*?\(default:? ([^)]*)\)", text).group(1)
            for flag in ("--prefill-chunk", "--max-batch")}
    assert said == {"--prefill-chunk": str(chunk),
                    "--max-batch": str(batch) if batch else "the batch's size, 1 with --interactive"}, said


def test_driver_applies_rank_0s_decisions_to_the_engine(tp1_models):
    """The decisions rank 0 broadcasts, applied on one rank (world 1: nothing to broadcast): each step's updates name
    their request by rid and end with it; a chat's next turn (`continues`) puts the conversation's image feature rows
    before its own; a request whose placeholders its images do not fill is refused by its rid (the server's 400),
    the others go on; a cancellation ends its request."""
    m = tp1_models("fp8_vl")
    s = runtime.Session(runtime.EngineFlags("unused"), 0, 1, torch.device("cpu"), m.cfg, m.vl, None, [], model=m)
    s.eng = engine.Engine(m, engine.EngineConfig(max_batch=2, max_context=128))
    s.eng.start()
    drv = runtime.Driver(s)
    img, g = m.vl.image_token_id, torch.Generator().manual_seed(0)
    rows = [torch.randn(n, m.cfg.hidden_size, generator=g).bfloat16() for n in (3, 2)]
    first = [11, 12] + [img] * 3 + [13]
    nxt = first + [21, 22, 14] + [img] * 2 + [15]

    def new(rid, ids, e, continues=False):
        return runtime.New(rid, ids, {"image_embeds": e}, 3, engine.Sampling(), frozenset(), continues)
    with torch.inference_mode():
        d = drv.agree(runtime.Decision(new=[new(7, first, rows[0])]))
        assert d == runtime.Decision(new=[new(7, first, rows[0])]) and drv.apply(d) == []
        r1 = drv.reqs[7]
        updates = []
        while s.eng.busy():
            updates += drv.step()
        assert {u.rid for u in updates} == {7} and all(u.req is r1 for u in updates)
        assert [t for u in updates for t in u.ids] == r1.out and len(r1.out) == 3
        assert [u.done for u in updates][-1] and not any(u.done for u in updates[:-1]) and drv.reqs == {}

        refused = drv.apply(runtime.Decision(new=[new(8, nxt, rows[1], continues=True), new(9, nxt, rows[1])]),
                            r1.features)
        assert [rid for rid, _ in refused] == [9], refused
        assert "5 image placeholder(s)" in refused[0][1] and not refused[0][1].startswith("request 0"), refused
        r2 = drv.reqs[8]
        assert torch.equal(r2.features, torch.cat(rows)) and list(drv.reqs) == [8]
        drv.apply(runtime.Decision(cancel=[8, 9]))  # 9 was never submitted: nothing to cancel
        updates = drv.step()
        assert [(u.rid, u.done, u.req.finish) for u in updates] == [(8, True, "cancelled")] and drv.reqs == {}


def test_stdout_writes_what_its_encoding_cannot_show_as_escapes():
    """A stdout that is not UTF-8 (PYTHONIOENCODING=latin-1) gets a backslash escape for a character it lacks, as
    Python's stderr does, instead of a UnicodeEncodeError that would end rank 0 mid-run."""
    import io
    raw = io.BytesIO()
    out = runtime.Stdout(io.TextIOWrapper(raw, encoding="latin-1"))
    out.write("naïve 张量 🙂\n")
    out.flush()
    assert out.lost is None and raw.getvalue() == "naïve \\u5f20\\u91cf \\U0001f642\n".encode("latin-1")
