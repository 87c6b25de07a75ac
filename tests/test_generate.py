"""generate.py end to end (ranks on gloo) and the greedy loop's batch contract (identical tokens on all ranks,
position-independent batch rows, EOS compaction, bad input), and seeded sampling (--temperature, --top-k, --top-p,
--seed: the same tokens on every rank, reproducible with the seed).

Each rank is a process of its own, forked from one interpreter that imported the product once
(tests/fork_launcher.py: a new interpreter spends ~3 CPU s on imports, and this file starts over a hundred ranks);
torchrun and new interpreters where they are what a test checks (its exit code, its watchdog, Ctrl-C,
PYTHONIOENCODING, a whole generation as a user starts it).

Cross-TP: the same packed batch (prompts of 12, 45 and 70 tokens: below and above topk*region_block_size = 32, so
the DSA layers really prune) is generated at TP = 1, 2 and 4 on the FP8 VL and the BF16 text-only tiny checkpoints.
Another TP size rounds its partial sums differently (correctly), and tiny random models are chaotic: a replicated
router whose k-th and (k+1)-th expert scores are one rounding apart, or a DSA region score near-tie, picks
differently. So tests/tp_logits_dump.py replays TP=1's greedy tokens teacher-forced at every TP size, and:
  * with TP=1's routing and region decisions pinned (model.Pins), every step's full-vocabulary logits agree with
    TP=1's within LOGIT_TOL * std(logits), at every step and request, no exemption;
  * the CLI's own (unpinned) tokens agree with TP=1's up to the first step where TP=1's top-1/top-2 margin is within
    that tolerance or the free runs' decisions differ at or before that step (an explained near-tie);
  * TP=1's teacher-forced argmax reproduces generate.py's tokens exactly (the CLI and the model agree).
"""
import json
import os
import random
import shutil
import socket
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import chat  # noqa: E402
import engine  # noqa: E402
import fork_launcher  # noqa: E402
import generate  # noqa: E402
import helpers  # noqa: E402
import model as M  # noqa: E402
import runtime  # noqa: E402
from invariants import NOISE, decisions_differ, gen_and_dump, pinned, tokens_agree_up_to_near_tie  # noqa: E402

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
LENGTHS = (12, 45, 70)  # < 32 <= 45, 70: the longer prompts prune DSA regions
NEW = 6
LOGIT_TOL = 0.15  # x std of the logits, decisions pinned (std ~8 on the fixture)
TIMEOUT = 120


def ids_prompt(n: int, seed: int) -> list:
    r = random.Random(seed)
    return [r.randrange(11, 1024) for _ in range(n)]  # no special ids (0..10), so no image placeholder (5)


PROMPTS = [ids_prompt(n, 100 + n) for n in LENGTHS]


def torchrun(n: int, *args, timeout: int = TIMEOUT, script: str = "generate.py"):
    cmd = [TORCHRUN, "--standalone", f"--nproc-per-node={n}", script, *map(str, args)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def ranks(n: int, *args, script: str = "generate.py", env: dict | None = None,
          timeout: int = 180) -> subprocess.CompletedProcess:
    """n ranks (launch_ranks) seen as torchrun shows them: every rank's stdout and stderr (in rank order), exit 0
    only when every rank's is."""
    res = launch_ranks(n, list(args), timeout, script=script, env=env)
    rc = next((rc for rc, _, _ in res if rc != 0), 0)
    return subprocess.CompletedProcess(args, rc, "".join(so for _, so, _ in res), "".join(se for _, _, se in res))


def gen_json(n: int, tp_dir: str, *args) -> dict:
    r = ranks(n, "--tp-dir", tp_dir, "--ep-size", n, "--json", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def write_json(path, obj) -> str:
    with open(path, "w") as f:
        json.dump(obj, f)
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Ranks forked from one interpreter that imported the product once (tests/fork_launcher.py): each is a process of its
# own, as `python generate.py` starts it, less the ~3 s of imports. Started on first use, stopped with the module.
_FORKS = {}


def forked() -> fork_launcher.Launcher:
    if "launcher" not in _FORKS:
        _FORKS["launcher"] = fork_launcher.Launcher(dict(os.environ, OMP_NUM_THREADS="1"), _FORKS["dir"])
    return _FORKS["launcher"]


@pytest.fixture(scope="module", autouse=True)
def _fork_launcher(tmp_path_factory):
    _FORKS["dir"] = str(tmp_path_factory.mktemp("forks"))
    yield
    if "launcher" in _FORKS:
        _FORKS.pop("launcher").close()


def rank_env(r: int, n: int, port: int, base: dict | None = None, **extra) -> dict:
    """The environment torchrun gives rank r of n (over base, the test's own by default)."""
    return dict(os.environ if base is None else base, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(n),
                LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", **extra)


def dump_ranks(n: int, argv: list, env: dict) -> subprocess.CompletedProcess:
    """invariants.gen_and_dump's launch: tests/tp_logits_dump.py's ranks forked as generate.py's are."""
    return ranks(n, *argv[1:], script=argv[0], env=env, timeout=600)


def start_rank(args: list, env: dict, fresh: bool = False, script: str = "generate.py", **pipes):
    """`python SCRIPT args` in env: forked from the launcher, or with fresh=True a new interpreter (for what an
    interpreter reads at its start: PYTHONIOENCODING). Where a GPU is visible every rank is a new interpreter: the
    CUDA driver is not to be forked."""
    argv = [script, *map(str, args)]
    if fresh or torch.cuda.is_available():
        return subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, text=True, **pipes)
    return forked().popen(argv, env, **pipes)


def launch_ranks(n: int, args: list, timeout: int = 180, env_extra: dict | None = None, stdout0=subprocess.PIPE,
                 fresh: bool = False, script: str = "generate.py", env: dict | None = None):
    """The environment torchrun gives each rank, but every rank a process of its own, so each rank's exit code and
    stderr can be checked (torchrun SIGTERMs the survivors of the first failure). -> [(rc, stdout, stderr)].
    stdout0: rank 0's stdout; fresh: new interpreters rather than forked ranks; env: the base environment (the
    test's own by default)."""
    port = free_port()
    procs = []
    for r in range(n):
        procs.append(start_rank(args, rank_env(r, n, port, env, **(env_extra or {})), fresh, script,
                                stdout=stdout0 if r == 0 else subprocess.PIPE, stderr=subprocess.PIPE))
    out = []
    try:
        for p in procs:
            so, se = p.communicate(timeout=timeout)
            out.append((p.returncode, so, se))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # a hang: the test fails on the TimeoutExpired raised above
                p.wait()
    return out


# ---------------------------------------------------------------------------------------------- cross-TP
def image_batch(tmp) -> list:
    """PROMPTS with the middle request asking about an image (a 728x728 overview: 169 placeholders, id 5)."""
    from safetensors.torch import save_file
    px = torch.randn(1, 3, 728, 728, generator=torch.Generator().manual_seed(7))
    save_file({"pixel_values": px}, str(tmp / "img.safetensors"))
    ids = PROMPTS[1][:20] + [6] + [5] * 169 + [7] + PROMPTS[1][20:]  # <im_start> placeholders <im_end>
    return [PROMPTS[0], {"prompt_ids": ids, "image_inputs": "img.safetensors"}, PROMPTS[2]]


@pytest.mark.parametrize("kind,images,tps", [("fp8_vl", False, (2, 4)), ("bf16_text", False, (2,)),
                                             ("fp8_vl", True, (2,))])  # TP=4 once: 4 ranks on CI's 2 cores
@pytest.mark.slow
def test_greedy_tokens_and_logits_agree_across_tp(kind, images, tps, converted, tmp_path):
    reqs = image_batch(tmp_path) if images else PROMPTS
    lengths = [len(r["prompt_ids"]) if isinstance(r, dict) else len(r) for r in reqs]
    batch = write_json(tmp_path / "batch.json", reqs)
    toks1, d1 = gen_and_dump(1, converted(kind, 1), batch, None, None, tmp_path, lengths, NEW, launch=dump_ranks)
    assert all(len(t) == NEW for t in toks1)  # --ignore-eos: a checkpoint's EOS never ends a request early
    L1 = d1["logits"]  # [NEW, 3, V]
    assert L1.shape == (NEW, 3, 1024)
    # the CLI's tokens are the model's teacher-forced argmax at TP=1 (same prefixes): exactly
    assert L1.argmax(-1).T.tolist() == toks1  # argmax: the lowest id on ties, as sampling.greedy
    pins = tmp_path / "pins_tp1.pt"
    torch.save(d1["pins"], pins)
    std = L1.std().item()
    top2 = L1.topk(2, dim=-1).values
    margin = top2[..., 0] - top2[..., 1]  # [NEW, 3]
    for tp in tps:
        toks, d = gen_and_dump(tp, converted(kind, tp), batch, [t[:-1] for t in toks1], pins, tmp_path, lengths, NEW,
                               launch=dump_ranks)
        diff = (d["pinned_logits"] - L1).abs().amax(-1)  # [NEW, 3]
        print(f"{kind} TP={tp} vs TP=1, decisions pinned: max |dlogit| / std = {diff.max().item() / std:.4f}")
        assert diff.max().item() < LOGIT_TOL * std, (kind, tp, diff / std)
        for b in range(3):
            if toks[b] == toks1[b]:
                continue
            s = next(i for i, (x, y) in enumerate(zip(toks[b], toks1[b])) if x != y)
            flipped = decisions_differ(d1["pins"], d["pins"], b, lengths[b] - 1 + s)
            assert flipped or margin[s, b].item() <= LOGIT_TOL * std, (
                f"{kind} TP={tp} request {b} diverges at step {s} with TP=1 margin {margin[s, b].item():.3f}, "
                f"no decision flipped: {toks[b]} vs {toks1[b]}")


# ---------------------------------------------------------------------------------------------- in-process TP=1
@pytest.fixture(scope="module")
def tp1_model(tp1_models):
    return tp1_models("fp8_vl")


EOS = [1, 2, 4]


@pytest.mark.slow
def test_each_batch_request_gets_its_tokens_alone(tp1_model, converted, tmp_path):
    """Position independence inside one batch is exact (reversing the batch gives each row its bits); a batch of
    another size runs GEMMs of other row counts, so the batch's decisions are pinned into the single runs and a
    token may differ only at a measured near-tie."""
    m = tp1_model
    with pinned(m, M.Pins()) as rec:
        batch = helpers.generate(m, PROMPTS, NEW, EOS)[0]
    for b, p in enumerate(PROMPTS):
        with pinned(m, M.Pins(rec.data, requests=[b])):
            alone = helpers.generate(m, [p], NEW, EOS)[0][0]
        tokens_agree_up_to_near_tie(m, p, alone, batch[b], NOISE["fp8"])
    # the same again in the reverse order (row results do not depend on their position)
    assert helpers.generate(m, PROMPTS[::-1], NEW, EOS)[0] == batch[::-1]
    # the torchrun CLI at TP=1 gives the in-process tokens
    doc = gen_json(1, converted("fp8_vl", 1), "--prompt-json-batch", write_json(tmp_path / "b.json", PROMPTS),
                   "--max-new-tokens", NEW)
    assert [r["completion_token_ids"] for r in doc["results"]] == batch


def test_router_rows_do_not_depend_on_the_batch(tp1_model):
    """Batch-position independence at its root: the replicated router gives every row the same ids and weights alone and in a batch."""
    g = torch.Generator().manual_seed(0)
    cfg = tp1_model.cfg
    bad = []
    for li in cfg.moe_layers:
        moe = tp1_model.model.layers[li].moe
        x = torch.randn(8, cfg.hidden_size, generator=g).bfloat16()
        route = lambda t: M.kernel.route(t, moe.gate.weight, moe.router_bias, cfg.moe_top_k,  # noqa: E731
                                         cfg.moe_router_scaling_factor, cfg.norm_expert_weight)
        ids, w, _ = route(x)
        for i in range(x.shape[0]):
            ia, wa, _ = route(x[i:i + 1])
            if not (torch.equal(ia[0], ids[i]) and torch.equal(wa[0], w[i])):
                bad.append((li, i, (wa[0] - w[i]).abs().max().item()))
    assert not bad, bad


def test_eos_request_leaves_the_batch_and_no_cache_is_copied(tp1_model, monkeypatch):
    """A request that emits an EOS id leaves the decode batch at once (the step already queued when the host reads
    its EOS is the last to carry it); the others decode on in their own slots, whose caches are never copied."""
    m = tp1_model
    with pinned(m, M.Pins()) as rec:
        base = helpers.generate(m, PROMPTS, NEW, [])[0]  # no EOS: every request runs NEW steps
    assert all(len(o) == NEW for o in base)
    # an EOS id that request 1 emits at step s (and not before), which the others never emit
    s, eos = next((s, base[1][s]) for s in (2, 3, 1, 4) if base[1][s] not in base[1][:s] + base[0] + base[2])
    steps, storage, serving = [], [], []
    real_forward, real_run = M.Step5ForCausalLM.forward, engine.Engine.run

    def spy_run(self, reqs):  # start-up's warm-up steps over each batch bucket are not the requests' steps
        serving.append(True)
        return real_run(self, reqs)

    def spy_forward(self, ids, cache, seq_lens=None, *a, rows=None, **k):
        if seq_lens is None and serving:
            steps.append(rows.tolist())
            storage.append(tuple(t.data_ptr() for lc in cache.layers for t in vars(lc).values()))
        return real_forward(self, ids, cache, seq_lens, *a, rows=rows, **k)
    monkeypatch.setattr(M.Step5ForCausalLM, "forward", spy_forward)
    monkeypatch.setattr(engine.Engine, "run", spy_run)
    with pinned(m, M.Pins(rec.data)):  # after the EOS the batch is smaller: other GEMM row counts
        out = helpers.generate(m, PROMPTS, NEW, [eos])[0]
    assert out[1] == base[1][:s + 1]  # stops at the EOS, EOS included
    for b in (0, 2):
        tokens_agree_up_to_near_tie(m, PROMPTS[b], out[b], base[b], NOISE["fp8"])
    # decode steps 0..s carry all three slots, the rest the two others (no padding: 2 is a batch bucket)
    assert steps == [[0, 1, 2]] * (s + 1) + [[0, 2]] * (NEW - 2 - s)
    assert len(set(storage)) == 1  # every step wrote into the same cache tensors


@pytest.mark.slow
def test_max_new_tokens_zero_returns_empty_completions(tp1_model, converted, tmp_path):
    assert helpers.generate(tp1_model, PROMPTS, 0, EOS)[0] == [[], [], []]
    doc = gen_json(1, converted("fp8_vl", 1), "--prompt-json-batch", write_json(tmp_path / "b.json", PROMPTS[:2]),
                   "--max-new-tokens", 0)
    assert [r["completion_token_ids"] for r in doc["results"]] == [[], []]
    assert [r["completion"] for r in doc["results"]] == ["", ""]


# ---------------------------------------------------------------------------------------------- text output
@pytest.mark.slow
def test_prompt_text_print_ids_and_speed_lines(converted):
    # one whole generation as a user starts it: torchrun, each rank a new interpreter (elsewhere ranks are forked)
    r = torchrun(2, "--tp-dir", converted("bf16_text", 2), "--ep-size", 2, "--prompt", "请介绍一下张量并行。",
                 "--max-new-tokens", 4, "--print-ids")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 2 and lines[1].startswith("ids: "), r.stdout
    ids = json.loads(lines[1][len("ids: "):])
    assert len(ids) >= 1 and all(isinstance(t, int) and 0 <= t < 1024 for t in ids)
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(converted("bf16_text", 2), "..", "tokenizer_files",
                                                              "tokenizer.json"))
    assert lines[0] == tok.decode(ids, skip_special_tokens=False).strip() or lines[0] == tok.decode(ids)
    # chat template applied: 'loading ... (N prompt tokens)' counts the templated prompt
    n_plain = len(tok("请介绍一下张量并行。")["input_ids"])
    n = int(r.stderr.split(" prompt tokens)")[0].rsplit("(", 1)[1])
    assert n > n_plain + 4
    assert "prefill:" in r.stderr and "tok/s" in r.stderr and "decode:" in r.stderr
    assert "error" not in r.stderr.lower()


# ---------------------------------------------------------------------------------------------- bad input
def assert_all_ranks_fail(res, *words):
    """Every rank exits non-zero without a traceback; rank 0 prints exactly one 'error:' line naming the words."""
    for r, (rc, so, se) in enumerate(res):
        assert rc != 0, f"rank {r} exited 0:\n{se[-2000:]}"
        assert "Traceback" not in se, f"rank {r}:\n{se[-3000:]}"
    errs = [line for line in res[0][2].splitlines() if line.startswith("error:")]
    assert len(errs) == 1, res[0][2][-3000:]
    for w in words:
        assert w in errs[0], (w, errs[0])
    for r, (rc, so, se) in enumerate(res[1:], 1):
        assert "error:" not in se, f"rank {r} should stay quiet:\n{se}"
    return errs[0]


@pytest.fixture(scope="module")
def tp2(converted):
    return converted("fp8_vl", 2)


def test_bad_malformed_json(tp2, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2,")
    assert_all_ranks_fail(launch_ranks(2, ["--tp-dir", tp2, "--ep-size", 2, "--prompt-json", bad]),
                          str(bad), "not valid JSON")


@pytest.mark.slow
def test_bad_ids_outside_vocab_and_empty_prompt(tp2, tmp_path):
    # both in one batch file would stop at the first; two files, two runs
    p = write_json(tmp_path / "oov.json", {"prompt_ids": [11, 12, 1024, 13]})
    assert_all_ranks_fail(launch_ranks(2, ["--tp-dir", tp2, "--ep-size", 2, "--prompt-json", p]),
                          "token id 1024", "position 2", "outside the vocabulary")
    p = write_json(tmp_path / "empty.json", [[11, 12], []])
    assert_all_ranks_fail(launch_ranks(2, ["--tp-dir", tp2, "--ep-size", 2, "--prompt-json-batch", p]),
                          "request 1", "non-empty")


@pytest.mark.slow
def test_bad_batch_lists_every_bad_request(tp2, tmp_path):
    reqs = [[11, 12], {"prompt": 5}, {"ids": [11, 12]}, {"prompt_ids": [11, "x"]}, [11, 13],
            {"prompt_ids": [11], "prompt": "both"}]
    err = assert_all_ranks_fail(
        launch_ranks(2, ["--tp-dir", tp2, "--prompt-json-batch", write_json(tmp_path / "b.json", reqs)]),
        "4 of 6 requests are bad", 'request 1: "prompt" must be a string', "request 2: expected",
        '{"prompt_ids": [ids...]', "got keys ['ids']", "request 3: token 1 is 'x'", "request 5: expected")
    assert "request 0" not in err and "request 4" not in err
    # a long list is capped, with the count of the rest
    err = assert_all_ranks_fail(
        launch_ranks(2, ["--tp-dir", tp2, "--prompt-json-batch", write_json(tmp_path / "c.json", [[]] * 25)]),
        "25 of 25 requests are bad", "and 15 more")
    assert "request 10" not in err
    # --prompt-json with another key names the accepted forms
    assert_all_ranks_fail(
        launch_ranks(2, ["--tp-dir", tp2, "--prompt-json", write_json(tmp_path / "d.json", {"ids": [11]})]),
        "expected [ids...] or {\"prompt_ids\": [ids...]}", "keys ['ids']")


@pytest.mark.slow
def test_bad_image_placeholders_without_image_inputs(tp2, tmp_path):
    p = write_json(tmp_path / "p.json", [11, 5, 5, 12])  # id 5 is the tiny VL checkpoint's <im_patch>
    assert_all_ranks_fail(launch_ranks(2, ["--tp-dir", tp2, "--prompt-json", p]),
                          "request 0", "2 image placeholder(s)", "0 feature row(s)")


@pytest.mark.slow
def test_ep_size_defaults_to_the_shards(tp2, tmp_path):
    p = write_json(tmp_path / "p.json", [11, 12, 13])
    res = launch_ranks(2, ["--tp-dir", tp2, "--prompt-json", p, "--max-new-tokens", 2, "--json"])
    assert all(rc == 0 for rc, _, _ in res), res[0][2][-2000:]
    assert "co-located EP=2" in res[0][2]
    assert len(json.loads(res[0][1])["completion_token_ids"]) == 2


def wide_image(path) -> str:
    """A 900x300 RGB file: wide enough to be cut into a row of crops (the tiny tower keeps the 728/504 geometry)."""
    from PIL import Image
    g = torch.Generator().manual_seed(3)
    Image.fromarray((torch.rand(300, 900, 3, generator=g) * 255).to(torch.uint8).numpy()).save(path)
    return str(path)


@pytest.mark.slow
def test_image_file_and_prepared_inputs_give_the_same_tokens(tp2, tmp_path):
    img = wide_image(tmp_path / "wide.png")
    prep = tmp_path / "prep.safetensors"
    res = launch_ranks(2, ["--tp-dir", tp2, "--prompt", "What is in <image> this picture?", "--image", img,
                           "--save-image-inputs", prep, "--max-new-tokens", 4, "--json"])
    assert all(rc == 0 for rc, _, _ in res), res[0][2][-3000:]
    by_file = json.loads(res[0][1])
    ids = json.load(open(tmp_path / "prep.json"))["prompt_ids"]
    crops = ids.count(8)  # <patch_start>: the wide image is cut into crops (one row: no <patch_newline>, id 10)
    assert by_file["prompt_token_count"] == len(ids) and crops >= 2 and ids.count(10) == 0
    assert ids.count(5) == crops * 81 + 169 and ids.count(6) == 1  # placeholders: each crop, then the overview
    res = launch_ranks(2, ["--tp-dir", tp2, "--prompt-json", tmp_path / "prep.json", "--image-inputs", prep,
                           "--max-new-tokens", 4, "--json"])
    assert all(rc == 0 for rc, _, _ in res), res[0][2][-3000:]
    assert json.loads(res[0][1])["completion_token_ids"] == by_file["completion_token_ids"]
    # the same request as a batch entry (image path relative to the batch file)
    batch = write_json(tmp_path / "b.json", [{"prompt": "What is in <image> this picture?", "images": ["wide.png"]}])
    res = launch_ranks(2, ["--tp-dir", tp2, "--prompt-json-batch", batch, "--max-new-tokens", 4, "--json"])
    assert all(rc == 0 for rc, _, _ in res), res[0][2][-3000:]
    assert json.loads(res[0][1])["completion_token_ids"] == by_file["completion_token_ids"]


@pytest.mark.slow
def test_bad_image_files_and_requests(tp2, converted, tmp_path):
    img = wide_image(tmp_path / "wide.png")
    fake = tmp_path / "fake.jpg"
    fake.write_text("not an image")
    run = lambda *a: launch_ranks(2, ["--tp-dir", tp2, "--max-new-tokens", 2, *a])  # noqa: E731  (a later flag wins)
    assert_all_ranks_fail(run("--prompt", "hi", "--image", fake), str(fake), "not an image")
    assert_all_ranks_fail(run("--prompt", "hi", "--image", tmp_path / "none.png"), "none.png", "no such image file")
    assert_all_ranks_fail(run("--prompt", "<image> and <image>", "--image", img), "2 <image> marker(s) for 1 image")
    assert_all_ranks_fail(run("--prompt", "hi", "--image", img, "--max-new-tokens", 1900),
                          "with 1 image block(s)", "exceed max_position_embeddings=2048")
    assert_all_ranks_fail(launch_ranks(2, ["--tp-dir", converted("bf16_text", 2), "--prompt", "hi", "--image", img]),
                          "--image given", "text-only model")


def test_bad_ep_size(tp2, tmp_path):
    p = write_json(tmp_path / "p.json", [11, 12, 13])
    assert_all_ranks_fail(launch_ranks(2, ["--tp-dir", tp2, "--ep-size", 4, "--prompt-json", p]),
                          "--ep-size 4", "expert_parallel_size=2")


def test_bad_world_size_unlike_tp_size(tp2, tmp_path):
    p = write_json(tmp_path / "p.json", [11, 12, 13])
    assert_all_ranks_fail(launch_ranks(1, ["--tp-dir", tp2, "--ep-size", 2, "--prompt-json", p]),
                          "tp_size=2", "WORLD_SIZE=1", "--nproc-per-node=2")


def test_bad_shard_from_another_conversion(tp2, converted, tmp_path):
    mixed = tmp_path / "tp2"
    shutil.copytree(tp2, mixed)
    shutil.copy(os.path.join(converted("fp8_vl_seed2", 2), "model-r1.safetensors"), mixed / "model-r1.safetensors")
    p = write_json(tmp_path / "p.json", [11, 12, 13])
    err = assert_all_ranks_fail(launch_ranks(2, ["--tp-dir", mixed, "--ep-size", 2, "--prompt-json", p]),
                                "model-r1.safetensors", "source_fingerprint")
    assert "another conversion" in err


def test_bad_missing_tp_dir(tmp_path):
    p = write_json(tmp_path / "p.json", [11, 12, 13])
    missing = tmp_path / "nowhere" / "tp2"
    assert_all_ranks_fail(launch_ranks(2, ["--tp-dir", missing, "--ep-size", 2, "--prompt-json", p]),
                          str(missing), "no such file")
    # the flag itself left out: argparse names it (no torchrun needed to get that far)
    r = subprocess.run([sys.executable, "generate.py", "--prompt-json", p], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0 and "--tp-dir" in r.stderr and "Traceback" not in r.stderr


def test_bad_no_torchrun_env(tp2, tmp_path):
    p = write_json(tmp_path / "p.json", [11, 12, 13])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    r = subprocess.run([sys.executable, "generate.py", "--tp-dir", tp2, "--ep-size", "2", "--prompt-json", p],
                       cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert "RANK is not set" in r.stderr and "torchrun" in r.stderr


def test_text_that_is_not_utf8_and_a_failing_chat_template_are_named(converted):
    """An undecodable byte (from argv or stdin, as Python's surrogateescape gives it, or a JSON \\udcff escape) and a
    chat template that does not compile get one message each; on the command line every rank ends without a
    traceback."""
    d = converted("bf16_text", 2)
    tok = runtime.load_tokenizer(os.path.join(d, "..", "tokenizer_files"))
    with pytest.raises(runtime.UserError, match=r"--prompt: the text is not valid UTF-8 \(character 2: '\\udcff'\)"):
        chat.text_ids(tok, None, "ab\udcffcd", [], "--prompt", False)
    tok.chat_template = "{% for m in messages %}{{ m.content }"
    with pytest.raises(runtime.UserError, match=r"request 0: the tokenizer's chat template failed \(TemplateSyntax"):
        chat.text_ids(tok, None, "hi", [], "request 0", False)
    res = launch_ranks(2, ["--tp-dir", d, "--prompt", os.fsdecode(b"ab\xffcd")])
    assert_all_ranks_fail(res, "--prompt: the text is not valid UTF-8")


@pytest.mark.slow
def test_stdout_that_cannot_be_written_ends_the_run_with_one_line(converted):
    """Rank 0's stdout on a full disk (or a pipe whose reader left): the run ends on every rank as it would, and rank
    0 then says once that the output is lost, instead of dying mid-run and taking the other rank's collective down."""
    with open("/dev/full", "w") as full:
        res = launch_ranks(2, ["--tp-dir", converted("bf16_text", 2), "--prompt", "hi", "--max-new-tokens", 6,
                               "--ignore-eos"], stdout0=full)
    assert [rc for rc, _, _ in res] == [runtime.EXIT_BAD_INPUT, 0], res[0][2][-3000:]
    assert not any("Traceback" in se for _, _, se in res), res[0][2][-3000:] + res[1][2][-3000:]
    errs = [line for line in res[0][2].splitlines() if line.startswith("error:")]
    assert errs == ["error: cannot write to stdout (No space left on device): the output is lost"], res[0][2][-3000:]


@pytest.mark.slow
def test_a_stdout_that_is_not_utf8_gets_escapes(converted):
    """Rank 0's stdout in latin-1 (PYTHONIOENCODING): the streamed text's characters latin-1 lacks are written as
    backslash escapes (64 tokens of the tiny vocabulary hold some), the run ends as usual; --json escapes them in
    JSON's own form."""
    args = ["--tp-dir", converted("bf16_text", 1), "--prompt", "请介绍一下张量并行。", "--max-new-tokens", 64,
            "--ignore-eos"]
    (rc, so, se), = launch_ranks(1, args, env_extra={"PYTHONIOENCODING": "latin-1"}, fresh=True)
    assert rc == 0 and "Traceback" not in se and "\\u" in so, se[-3000:]
    (rc, so, se), = launch_ranks(1, [*args, "--json"], env_extra={"PYTHONIOENCODING": "latin-1"}, fresh=True)
    assert rc == 0 and so.isascii() and len(json.loads(so)["completion_token_ids"]) == 64, se[-3000:]


@pytest.mark.slow
def test_bad_cpu_plan_past_the_hosts_memory_names_the_flag(converted, tmp_path):
    """On CPU the memory plan is made against the host memory available to the rank: slots it cannot hold are
    refused naming the flag, before anything is allocated."""
    p = write_json(tmp_path / "p.json", [11, 12, 13])
    d = converted("bf16_text", 1)
    assert_all_ranks_fail(launch_ranks(1, ["--tp-dir", d, "--prompt-json", p, "--max-batch", 100000,
                                           "--max-context", 512]),
                          "the engine does not fit", "(host memory)",
                          "lower --max-context (512), --max-batch (100000) or --prefix-cache-gib")
    assert_all_ranks_fail(launch_ranks(1, ["--tp-dir", d, "--prompt-json", p, "--max-batch", 10 ** 8]),
                          "no room for a KV cache", "free on host memory", "lower --max-batch (100000000)")


@pytest.mark.slow
def test_bad_verify_names_a_shard_whose_bytes_changed(converted, tmp_path):
    """--verify hashes every rank's shard against the sha256 convert.py recorded beside it, before loading: 2,000
    flipped bytes in rank 1's shard (which load and run without it) are named with the file; a shard without its
    record is named too."""
    d = tmp_path / "tp2"
    shutil.copytree(converted("bf16_text", 2), d)
    p = write_json(tmp_path / "p.json", [11, 12, 13])
    res = launch_ranks(2, ["--tp-dir", d, "--prompt-json", p, "--max-new-tokens", 2, "--verify"])
    assert all(rc == 0 for rc, _, _ in res) and "--verify: every rank's shard has the sha256" in res[0][2], res[0][2]
    shard = d / "model-r1.safetensors"
    data = bytearray(shard.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 2000] = bytes(b ^ 0x01 for b in data[mid:mid + 2000])  # mantissa bits: still finite weights
    shard.write_bytes(bytes(data))
    res = launch_ranks(2, ["--tp-dir", d, "--prompt-json", p, "--max-new-tokens", 2])
    assert all(rc == 0 for rc, _, _ in res), res[0][2][-3000:]
    assert_all_ranks_fail(launch_ranks(2, ["--tp-dir", d, "--prompt-json", p, "--verify"]), str(shard),
                          "differs from the", "recorded in model-r1.safetensors.sha256")
    os.remove(d / "model-r1.safetensors.sha256")
    assert_all_ranks_fail(launch_ranks(2, ["--tp-dir", d, "--prompt-json", p, "--verify"]), str(shard),
                          "model-r1.safetensors.sha256 missing")


@pytest.mark.slow
def test_prompt_file_is_the_prompt_text(converted, tmp_path):
    """--prompt-file FILE gives the file's text as --prompt gives it (for prompts past argv's 128 KiB); a missing
    file, one that is not UTF-8 and one past what the context could hold are named."""
    d = converted("bf16_text", 1)
    f = tmp_path / "prompt.txt"
    f.write_text("请介绍一下张量并行。", encoding="utf-8")
    by_arg = gen_json(1, d, "--prompt", "请介绍一下张量并行。", "--max-new-tokens", 4)
    by_file = gen_json(1, d, "--prompt-file", f, "--max-new-tokens", 4)
    assert by_file == by_arg
    run = lambda *a: launch_ranks(1, ["--tp-dir", d, *a])  # noqa: E731
    assert_all_ranks_fail(run("--prompt-file", tmp_path / "none.txt"), "--prompt-file", "none.txt: cannot read it (No such file")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    assert_all_ranks_fail(run("--prompt-file", tmp_path / "latin1.txt"), "latin1.txt: not UTF-8 text (byte 3")
    (tmp_path / "big.txt").write_text("x" * (generate.PROMPT_FILE_BYTES_PER_TOKEN * 2048 + 1))
    assert_all_ranks_fail(run("--prompt-file", tmp_path / "big.txt"), "big.txt: more than 65536 bytes",
                          "max_position_embeddings=2048")
    assert_all_ranks_fail(run("--prompt-file", f, "--prompt", "hi"), "exactly one of --prompt, --prompt-file")


# ---------------------------------------------------------------------------------------------- sampling
@pytest.mark.slow
def test_sampling_at_tp2_is_the_same_on_every_rank_and_reproducible(converted, tmp_path):
    batch = write_json(tmp_path / "b.json", PROMPTS)

    def run():
        r = ranks(2, "--tp-dir", converted("fp8_vl", 2), "--prompt-json-batch", batch, "--max-new-tokens", NEW,
                  "--json", "--temperature", 1, "--seed", 3)
        assert r.returncode == 0, r.stderr[-3000:]  # generate.py fails when the ranks' tokens differ
        assert r.stderr.count("sampling: temperature 1.0, top-k off, top-p off, seed 3") == 1, r.stderr[-3000:]
        return [x["completion_token_ids"] for x in json.loads(r.stdout)["results"]]
    assert run() == run()


@pytest.mark.parametrize("kw,words", [
    ({"temperature": -0.5}, ["--temperature -0.5", "finite number >= 0"]),
    ({"temperature": float("nan")}, ["--temperature nan"]),
    ({"temperature": 1.0, "top_p": 0.0}, ["--top-p 0.0", "(0, 1]"]),
    ({"temperature": 1.0, "top_p": 1.5}, ["--top-p 1.5", "(0, 1]"]),
    ({"temperature": 1.0, "top_k": -1}, ["--top-k -1", "[0, 2**63)"]),
    ({"temperature": 1.0, "top_k": 2 ** 63}, ["--top-k 9223372036854775808", "[0, 2**63)"]),
    ({"top_k": 5}, ["--top-k 5", "needs --temperature > 0"]),
    ({"top_p": 0.9}, ["--top-p 0.9", "needs --temperature > 0"]),
])
def test_bad_sampling_settings(kw, words):
    with pytest.raises(generate.UserError) as e:
        generate.main("unused", **kw)  # refused first: before torchrun's environment or any file is read
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.slow
def test_bad_sampling_flags_end_every_rank_with_one_message(tmp_path):
    p = write_json(tmp_path / "p.json", [11, 12, 13])
    run = lambda *a: launch_ranks(2, ["--tp-dir", tmp_path, "--prompt-json", p, *a])  # noqa: E731  (dir never read)
    assert_all_ranks_fail(run("--temperature", -1), "--temperature -1.0", "finite number >= 0")
    assert_all_ranks_fail(run("--top-p", 0.9), "--top-p 0.9", "needs --temperature > 0")


# ---------------------------------------------------------------------------------------------- speculative (MTP)
@pytest.fixture(scope="module")
def mtp_out(converted):
    """mtp_out(tp) -> OUT/tp{tp} of the BF16 text checkpoint converted with --keep-mtp."""
    return lambda tp: converted("bf16_text", tp, keep_mtp=True)


@pytest.mark.slow
def test_speculative_cli_and_bad_flags(mtp_out, converted, tmp_path):
    batch = write_json(tmp_path / "b.json", PROMPTS[:2])
    res = launch_ranks(2, ["--tp-dir", mtp_out(2), "--prompt-json-batch", batch, "--max-new-tokens", 6, "--json",
                           "--speculative", 2])
    assert all(rc == 0 for rc, _, _ in res), res[0][2][-3000:]
    assert "speculative: 2 MTP draft(s) per step; accepted depth 1:" in res[0][2]
    plain = launch_ranks(2, ["--tp-dir", mtp_out(2), "--prompt-json-batch", batch, "--max-new-tokens", 6, "--json"])
    assert json.loads(res[0][1])["batch_size"] == json.loads(plain[0][1])["batch_size"] == 2
    assert_all_ranks_fail(launch_ranks(2, ["--tp-dir", converted("bf16_text", 2), "--prompt-json-batch", batch,
                                           "--speculative", 1]), "--speculative 1 needs 1 MTP layer", "--keep-mtp")
    sampled = launch_ranks(2, ["--tp-dir", mtp_out(2), "--prompt-json-batch", batch, "--max-new-tokens", 6, "--json",
                               "--speculative", 2, "--temperature", 1, "--seed", 3])
    assert all(rc == 0 for rc, _, _ in sampled), sampled[0][2][-3000:]  # the ranks agreed on every token


# ---------------------------------------------------------------------------------------------- --interactive, streaming
class Chat:
    """generate.py --interactive with every rank a process of its own (as launch_ranks), rank 0 reading the lines
    the test writes; stderr is collected by a thread so the test can wait for a line."""

    def __init__(self, n: int, args: list):
        import threading
        port = free_port()
        self.procs, self.err = [], [[] for _ in range(n)]
        for r in range(n):
            p = start_rank(["--interactive", *args], rank_env(r, n, port),
                           stdin=subprocess.PIPE if r == 0 else subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
            self.procs.append(p)
            threading.Thread(target=lambda f, out: out.extend(f), args=(p.stderr, self.err[r]), daemon=True).start()

    def wait_for(self, text: str, count: int = 1, timeout: float = 120):
        import time
        t0 = time.time()
        while sum(text in line for line in self.err[0]) < count:
            assert time.time() - t0 < timeout, f"no {text!r} after {timeout} s:\n" + "".join(self.err[0])[-3000:]
            assert self.procs[0].poll() is None, "rank 0 exited:\n" + "".join(self.err[0])[-3000:]
            time.sleep(0.1)

    def say(self, line: str):
        self.procs[0].stdin.write(line + "\n")
        self.procs[0].stdin.flush()

    def close(self, timeout: float = 120) -> list:
        self.procs[0].stdin.close()
        out = []
        try:
            for p, err in zip(self.procs, self.err):
                so = p.stdout.read()
                p.wait(timeout=timeout)
                out.append((p.returncode, so, "".join(err)))
        finally:
            for p in self.procs:
                if p.poll() is None:
                    p.kill()
        return out


def speed_lines(err: str) -> list:
    """(computed, reused, decoded) of each `prefill: N tokens ..., M reused ...; decode: K tokens` line."""
    import re
    out = []
    for m in re.finditer(r"prefill: (\d+) tokens in [^;]*?(?:, (\d+) reused from the cache)?; decode: (\d+) tokens",
                         err):
        out.append((int(m.group(1)), int(m.group(2) or 0), int(m.group(3))))
    return out


@pytest.mark.slow
def test_interactive_turns_reuse_the_cache_and_reset_refuse_and_stop(converted):
    """A three-turn chat at TP=2 from piped stdin: turns 2 and 3 prefill only what the cache does not hold (at least
    the last turn's prompt is reused); /reset starts over; a turn past --max-context is refused with a message and the
    session goes on; SIGINT during an answer stops that answer and keeps the session."""
    import signal
    import time
    d = converted("bf16_text", 2)
    chat = Chat(2, ["--tp-dir", d, "--max-new-tokens", 6, "--max-context", 400])
    chat.wait_for("interactive: up to")
    for i, line in enumerate(["hello there", "and then?", "tell me more"]):
        chat.say(line)
        chat.wait_for("prefill:", i + 1)
    chat.say("/reset")
    chat.wait_for("(a new conversation)")
    chat.say("x " * 500)  # far past the 400 positions
    chat.wait_for("/reset starts a new conversation")
    chat.say("hello there")
    chat.wait_for("prefill:", 4)
    res = chat.close()
    assert all(rc == 0 for rc, _, _ in res), res[0][2][-3000:]
    err = res[0][2]
    assert "Traceback" not in err and "Traceback" not in res[1][2]
    lines = speed_lines(err)
    assert len(lines) == 4, err
    (n1, m1, d1), (n2, m2, d2), (n3, m3, _), (n4, m4, _) = lines
    import config
    blk = config.load_config(os.path.join(d, "config-r0.json"))[0].sparse.block  # reuse stops at a region boundary
    # each turn reuses at least the last turn's prompt (down to a region boundary) but its generation prompt's
    # opened reasoning block, which the Step template does not write back into the history (STEP5_CHAT.md §4); only
    # the rest is computed
    tok = runtime.load_tokenizer(os.path.join(d, "..", "tokenizer_files"))
    think = len(tok("<think>\n", add_special_tokens=False)["input_ids"])
    assert m1 == 0 and m2 >= (n1 - think) // blk * blk > 0 and m3 >= (n2 + m2 - think) // blk * blk > m2, lines
    assert n4 + m4 == n1, lines  # after /reset the first turn again (its tokens may be reused from the slot)
    assert res[0][1].count("\n") == 4  # one answer line per answered turn

    # SIGINT during an answer: the answer stops, the session goes on
    chat = Chat(2, ["--tp-dir", d, "--max-new-tokens", 400, "--ignore-eos"])
    chat.wait_for("interactive: up to")
    chat.say("tell me a long story")
    chat.wait_for("start-up")
    time.sleep(4)
    chat.procs[0].send_signal(signal.SIGINT)
    chat.wait_for("(stopped)")
    chat.say("/exit")
    res = chat.close()
    assert all(rc == 0 for rc, _, _ in res), res[0][2][-3000:]
    lines = speed_lines(res[0][2])
    assert len(lines) == 1 and lines[0][2] < 399, res[0][2][-2000:]

    # Ctrl-C where stdin is no terminal reaches every rank (torchrun forwards it): during an answer the chat ends with
    # one line; at the prompt it ends as Ctrl-D does. Never a traceback or a hang.
    for during_answer in (True, False):
        chat = Chat(2, ["--tp-dir", d, "--max-new-tokens", 400, "--ignore-eos"])
        chat.wait_for("interactive: up to")
        if during_answer:
            chat.say("tell me a long story")
            chat.wait_for("start-up")
            time.sleep(4)
        for p in chat.procs:
            p.send_signal(signal.SIGINT)
        res = chat.close()
        assert not any("Traceback" in err for _, _, err in res), res[0][2][-3000:] + res[1][2][-3000:]
        if during_answer:
            assert res[0][0] == runtime.EXIT_INTERRUPTED and res[0][2].rstrip().endswith("interrupted"), res[0][2]
        assert all(rc in (0, runtime.EXIT_INTERRUPTED) for rc, _, _ in res), res


@pytest.mark.slow
def test_turns_after_an_image_turn_hold_the_whole_conversation(converted, tmp_path):
    """A turn whose typed <image> marker places its /image file: the three turns after it have growing prompts (the
    history once held two markers for one image, and every later prompt was cut at the second)."""
    chat = Chat(1, ["--tp-dir", converted("fp8_vl", 1), "--max-new-tokens", 4])
    chat.wait_for("interactive: up to")
    chat.say(f"/image {wide_image(tmp_path / 'wide.png')}")
    chat.wait_for("goes with the next turn")
    for i, line in enumerate(["What is in <image> here?", "and then?", "tell me more about it", "why is that so?"]):
        chat.say(line)
        chat.wait_for("prefill:", i + 1)
    res = chat.close()
    assert res[0][0] == 0, res[0][2][-3000:]
    sizes = [n + m for n, m, _ in speed_lines(res[0][2])]
    assert len(sizes) == 4 and sizes == sorted(set(sizes)), (sizes, res[0][2][-3000:])


@pytest.mark.slow
def test_a_rank_that_dies_ends_the_other_with_one_line(converted):
    """kill -9 of rank 1 during an answer: rank 0's next collective fails; it says so in one line and exits
    EXIT_FAILED, no traceback."""
    import time
    chat = Chat(2, ["--tp-dir", converted("bf16_text", 2), "--max-new-tokens", 400, "--ignore-eos"])
    chat.wait_for("interactive: up to")
    chat.say("tell me a long story")
    chat.wait_for("start-up")
    time.sleep(2)
    chat.procs[1].kill()
    rc, _, err = chat.close()[0]
    assert rc == runtime.EXIT_FAILED and "Traceback" not in err, err[-3000:]
    assert [line for line in err.splitlines() if line.startswith("error:")][0].startswith(
        "error: rank 0: lost another rank ("), err[-3000:]


@pytest.mark.slow
def test_streamed_text_is_the_json_completion(converted):
    """A single request's text streams to stdout as it is decoded; it is the --json document's completion, and on a
    terminal (stdout and stderr on one file) its line ends before the speed line."""
    d = converted("bf16_text", 1)
    args = ["--tp-dir", d, "--prompt", "请介绍一下张量并行。", "--max-new-tokens", 12, "--ignore-eos"]
    p = start_rank(args, rank_env(0, 1, free_port()), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = p.communicate(timeout=TIMEOUT)
    j = ranks(1, *args, "--json")
    assert p.returncode == 0 and j.returncode == 0, (out + j.stderr)[-3000:]
    text = json.loads(j.stdout)["completion"]
    assert out.count(text + "\nprefill: ") == 1, out[-3000:]


# ---------------------------------------------------------------------------------------------- hardening
@pytest.mark.slow
def test_bad_ranks_of_two_conversions_are_named_before_loading(tp2, tmp_path):
    """Every rank's config and shard metadata must come from one conversion: a config-r1.json with one number edited
    is named with the field, before any weight is read."""
    mixed = tmp_path / "tp2"
    shutil.copytree(tp2, mixed)
    cfg = json.load(open(mixed / "config-r1.json"))
    cfg["text_config"]["rms_norm_eps"] = 1e-3
    json.dump(cfg, open(mixed / "config-r1.json", "w"))
    p = write_json(tmp_path / "p.json", [11, 12, 13])
    assert_all_ranks_fail(launch_ranks(2, ["--tp-dir", mixed, "--prompt-json", p]), "config-r1.json",
                          "text_config.rms_norm_eps", "rank 0", "another conversion")


@pytest.mark.slow
def test_bad_non_finite_inputs_and_logits_stop_with_a_message(converted, tmp_path):
    """NaN image embeddings are refused naming the file and tensor; a NaN config number names the field; a NaN weight
    is refused at load naming the shard and the tensor; finite weights that make the logits non-finite (an overflow)
    stop generation naming the request and the token."""
    from safetensors.torch import load_file, save_file
    vl = converted("fp8_vl", 1)
    save_file({"image_embeds": torch.full((169, 256), float("nan"))}, str(tmp_path / "nan.safetensors"))
    ids = write_json(tmp_path / "img.json", [11] + [5] * 169 + [12])
    assert_all_ranks_fail(launch_ranks(1, ["--tp-dir", vl, "--prompt-json", ids, "--image-inputs",
                                           tmp_path / "nan.safetensors"]), "nan.safetensors", "image_embeds",
                          "non-finite")
    text = converted("bf16_text", 1)
    bad = tmp_path / "tp1"
    shutil.copytree(text, bad)
    cfg = json.load(open(bad / "config-r0.json"))
    cfg["rms_norm_eps"] = float("nan")
    json.dump(cfg, open(bad / "config-r0.json", "w"))
    p = write_json(tmp_path / "p.json", [11, 12, 13])
    assert_all_ranks_fail(launch_ranks(1, ["--tp-dir", bad, "--prompt-json", p]), "config-r0.json", "rms_norm_eps")
    shutil.copy(os.path.join(text, "config-r0.json"), bad / "config-r0.json")
    t = load_file(str(bad / "model-r0.safetensors"))
    from safetensors import safe_open
    with safe_open(str(bad / "model-r0.safetensors"), "pt") as f:
        meta = f.metadata()
    q = t["model.layers.0.self_attn.q_proj.weight"].clone()
    t["model.layers.0.self_attn.q_proj.weight"][3, 5] = float("nan")
    save_file(t, str(bad / "model-r0.safetensors"), metadata=meta)
    i = 3 * q.shape[1] + 5
    assert_all_ranks_fail(launch_ranks(1, ["--tp-dir", bad, "--prompt-json", p]), "model-r0.safetensors",
                          "model.layers.0.self_attn.q_proj.weight holds a non-finite value", f"flat index {i}: nan")
    t["model.layers.0.self_attn.q_proj.weight"] = q
    t["lm_head.weight"].fill_(3e38)  # finite, but the head's sums overflow
    save_file(t, str(bad / "model-r0.safetensors"), metadata=meta)
    assert_all_ranks_fail(launch_ranks(1, ["--tp-dir", bad, "--prompt-json", p]), "request 0", "non-finite logits",
                          "new token 0")


@pytest.mark.slow
def test_bad_flags_are_reported_once_in_every_run_under_torchrun(tmp_path):
    """Validated before any rank can exit, and printed by rank 0 after every rank agreed: the message appears in
    every run (it was lost in about half of them), once, argparse's too; torchrun then exits with its own 1."""
    p = write_json(tmp_path / "p.json", [11, 12, 13])
    for args, word in ((["--temperature", "-1"], "--temperature -1.0"), (["--top-p", "0"], "--top-p 0.0"),
                       (["--seed", "-1"], "--seed -1"), (["--no-such-flag"], "unrecognized arguments")):
        r = torchrun(2, "--tp-dir", tmp_path, "--prompt-json", p, *args)
        errs = [x for x in r.stderr.splitlines() if x.startswith("error:")]
        assert r.returncode == 1 and len(errs) == 1 and word in errs[0], (args, r.stderr[-2000:])
    r = torchrun(2, "--help")
    assert r.returncode == 0 and r.stdout.count("usage:") == 1, r.stdout[-2000:]


@pytest.mark.slow
def test_bad_paths_files_and_requests_are_named(converted, tmp_path):
    vl = converted("fp8_vl", 1)
    p = write_json(tmp_path / "p.json", [11, 12, 13])
    run = lambda *a: launch_ranks(1, ["--max-new-tokens", 2, *a])  # noqa: E731
    f = tmp_path / "file"
    f.write_text("x")
    assert_all_ranks_fail(run("--tp-dir", f, "--prompt-json", p), str(f), "is a file")
    assert_all_ranks_fail(run("--tp-dir", os.path.dirname(vl), "--prompt-json", p), "holds tp1", "--tp-dir")
    twice = tmp_path / "twice.json"
    twice.write_text('{"prompt_ids": [1, 2], "prompt_ids": [3]}')  # json.load would keep the last silently
    assert_all_ranks_fail(run("--tp-dir", vl, "--prompt-json", twice), "twice.json", '"prompt_ids" appears twice')
    extra = write_json(tmp_path / "extra.json", {"prompts": [[11, 12]], "max_tokens": 5})
    assert_all_ranks_fail(run("--tp-dir", vl, "--prompt-json-batch", extra), "extra.json", "'max_tokens'")
    assert_all_ranks_fail(run("--tp-dir", vl, "--prompt", "hi", "--image", p, "--save-image-inputs",
                              tmp_path / "x.json"), "--save-image-inputs", "name the tensor file .safetensors")
    for content, word in ((None, "is a directory"), (b"\xff\xfe{", "not valid JSON")):
        d = tmp_path / f"tp_{word[:6].strip()}" / "tp1"
        shutil.copytree(vl, d)
        os.remove(d / "config-r0.json")
        if content is None:
            os.mkdir(d / "config-r0.json")
        else:
            (d / "config-r0.json").write_bytes(content)
        assert_all_ranks_fail(run("--tp-dir", d, "--prompt-json", p), "config-r0.json", word)
    d = tmp_path / "no_shard" / "tp2"  # two ranks: rank 0's shard missing, not "rank 1's differs from rank 0's"
    shutil.copytree(converted("fp8_vl", 2), d)
    os.remove(d / "model-r0.safetensors")
    assert_all_ranks_fail(launch_ranks(2, ["--tp-dir", d, "--prompt-json", p]), "model-r0.safetensors: no such shard")
    img = wide_image(tmp_path / "w.png")
    assert_all_ranks_fail(run("--tp-dir", vl, "--prompt", "hi", "--image", img, "--save-image-inputs",
                              tmp_path / "nowhere" / "x.safetensors"), "--save-image-inputs", "does not exist")
    if not torch.cuda.is_available():
        assert_all_ranks_fail(run("--tp-dir", vl, "--prompt-json", p, "--device", "cuda"), "--device cuda",
                              "no CUDA device")
    for bad in (3, [1, 2], {"a": 1}):
        b = write_json(tmp_path / "b.json", [{"prompt_ids": [11, 12], "image_inputs": bad}])
        assert_all_ranks_fail(run("--tp-dir", vl, "--prompt-json-batch", b), "request 0", '"image_inputs" must be')
    assert_all_ranks_fail(run("--tp-dir", vl, "--prompt", "look: <im_patch> here"), "<im_patch>", "literally")
    b = write_json(tmp_path / "b2.json", [[11, 12], {"prompt_ids": [11, 5, 12], "image_inputs": "gone.safetensors"}])
    assert_all_ranks_fail(run("--tp-dir", vl, "--prompt-json-batch", b), "request 1", "gone.safetensors")
    # a truncated tokenizer.json: named for a text prompt; a warning for an id prompt, which needs none
    out = tmp_path / "tok" / "tp1"
    shutil.copytree(vl, out)
    shutil.copytree(os.path.join(vl, "..", "tokenizer_files"), out / ".." / "tokenizer_files")
    tj = out / ".." / "tokenizer_files" / "tokenizer.json"
    tj.write_text(tj.read_text()[:200])
    assert_all_ranks_fail(run("--tp-dir", out, "--prompt", "hi"), "tokenizer.json", "not a readable tokenizer")
    (rc, so, se), = run("--tp-dir", out, "--prompt-json", p, "--json")
    assert rc == 0 and "warning:" in se and "tokenizer.json" in se and json.loads(so)["completion"] is None, se
    ids = json.loads(so)["completion_token_ids"]
    (rc, so, se), = run("--tp-dir", out, "--prompt-json", p)  # streamed: without a tokenizer the ids are the output
    assert rc == 0 and so == f"ids: {ids}\n", (so, se[-2000:])
    shutil.copy(os.path.join(vl, "..", "tokenizer_files", "tokenizer.json"), tj)
    tc = out / ".." / "tokenizer_files" / "tokenizer_config.json"
    tc.write_bytes(b"\xff\xfe not utf-8")
    assert_all_ranks_fail(run("--tp-dir", out, "--prompt", "hi"), "tokenizer_config.json", "not valid JSON")


def wait_line(proc, text: str, lines: list, timeout: float = 120):
    import time
    t0 = time.time()
    while not any(text in x for x in lines):
        assert time.time() - t0 < timeout and proc.poll() is None, "".join(lines)[-3000:]
        time.sleep(0.1)


@pytest.mark.slow
def test_ctrl_c_ends_every_rank_with_one_line(converted):
    """SIGINT (torchrun forwards Ctrl-C to every worker) mid-generation: rank 0 prints one 'interrupted' line, no rank
    prints a traceback, every rank exits with 130."""
    import signal
    import threading
    port = free_port()
    procs, errs = [], [[], []]
    for r in range(2):  # new interpreters: Ctrl-C as a user's run meets it
        procs.append(start_rank(["--tp-dir", converted("bf16_text", 2), "--prompt", "hi", "--max-new-tokens", 1500,
                                 "--ignore-eos"], rank_env(r, 2, port), fresh=True, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE))
        threading.Thread(target=lambda f, out: out.extend(f), args=(procs[-1].stderr, errs[r]), daemon=True).start()
    try:
        wait_line(procs[0], "start-up", errs[0])
        for p in procs:
            p.send_signal(signal.SIGINT)
        codes = [p.wait(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    import time
    time.sleep(0.5)  # the stderr threads' last lines
    assert codes == [130, 130], "".join(errs[0])[-2000:]
    assert "".join(errs[0]).count("interrupted") == 1 and "interrupted" not in "".join(errs[1])
    assert not any("Traceback" in "".join(e) for e in errs), "".join(errs[0])[-3000:] + "".join(errs[1])[-3000:]


@pytest.mark.slow
def test_workers_exit_when_their_launcher_is_killed(converted):
    """kill -9 of torchrun: each worker notices its parent is gone (PR_SET_PDEATHSIG, and a watchdog) and exits
    within seconds instead of holding its GPU."""
    import signal
    import threading
    import time
    tr = subprocess.Popen([TORCHRUN, "--standalone", "--nproc-per-node=2", "generate.py", "--tp-dir",
                           converted("bf16_text", 2), "--interactive"], cwd=ROOT, stdin=subprocess.PIPE,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines = []
    threading.Thread(target=lambda: lines.extend(tr.stderr), daemon=True).start()
    try:
        wait_line(tr, "interactive: up to", lines)  # the workers now wait on stdin for a turn
        kids = [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == tr.pid]
        assert len(kids) == 2, kids
        tr.send_signal(signal.SIGKILL)
        t0 = time.time()
        while any(_alive(k) for k in kids) and time.time() - t0 < 20:
            time.sleep(0.2)
        assert not any(_alive(k) for k in kids), f"workers {kids} outlived their launcher by 20 s"
    finally:
        tr.kill()


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_interactive_answers_show_reasoning_apart_and_hide_it_on_request(tmp_path, capsys):
    """--interactive's stream (Stream with apart): the prompt's open reasoning block and the answer after </think>
    are told apart on a stdout that is no terminal ([reasoning] / [answer]), the reasoning left out with
    --hide-reasoning; the same ids without `apart` stream the completion's text, markers spelled."""
    from types import SimpleNamespace

    import tiny_checkpoint
    tiny_checkpoint.write_tokenizer(str(tmp_path), 1024)
    tok = runtime.load_tokenizer(str(tmp_path))
    think = chat.think_ids(tok)
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    out = enc("Some thought") + [think[1]] + enc("\nThe answer")
    req = SimpleNamespace(ids=enc("hi") + [think[0]] + enc("\n"), out=out)
    shown = {}
    for key, kw in (("apart", dict(apart=True)), ("hidden", dict(apart=True, hide_reasoning=True)), ("plain", {})):
        st = generate.Stream(SimpleNamespace(tok=tok), req, **kw)
        for t in out:
            st.push([t])
        st.close(False)
        shown[key] = capsys.readouterr().out
    assert shown["apart"] == "[reasoning] Some thought [answer] \nThe answer\n"
    assert shown["hidden"] == "\nThe answer\n"
    assert shown["plain"] == tok.decode(out, skip_special_tokens=False) + "\n"
    with pytest.raises(runtime.UserError, match="--hide-reasoning"):
        generate.check_args(generate.Args(prompt="x", hide_reasoning=True), runtime.EngineFlags(tp_dir="x"))


@pytest.mark.slow
def test_cli_json_schema_with_a_reasoning_budget_and_logprobs(converted, tmp_path):
    """--json-schema FILE with --thinking-token-budget 2, sampled, with --logprobs 2 under --json (TP=2): the answer
    after </think> validates, the reasoning takes at most 2 tokens, each token has its logprob and 2 alternatives;
    --logprobs without --json and a schema that cannot compile are refused naming the flag."""
    import jsonschema
    schema = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9},
                                               "tag": {"enum": ["a", "b"]}}, "required": ["id", "tag"],
              "additionalProperties": False}
    path = write_json(tmp_path / "schema.json", schema)
    d = converted("bf16_text", 2)
    out = gen_json(2, d, "--prompt", "Give me a record", "--json-schema", path, "--thinking-token-budget", 2,
                   "--temperature", 1, "--seed", 3, "--logprobs", 2, "--max-new-tokens", 60)
    import runtime
    tok = runtime.load_tokenizer(os.path.join(d, "..", "tokenizer_files"))
    ids = out["completion_token_ids"]
    end = tok.convert_tokens_to_ids("</think>")
    assert end in ids and ids.index(end) <= 2 and ids[-1] in out["eos_token_ids"], ids
    jsonschema.validate(json.loads(tok.decode(ids[ids.index(end) + 1:-1])), schema)
    assert len(out["completion_logprobs"]) == len(ids) and all(len(x[1]) == 2 for x in out["completion_logprobs"])
    r = ranks(2, "--tp-dir", d, "--prompt", "hi", "--logprobs", 2)
    assert r.returncode != 0 and "--logprobs 2" in r.stderr and "--json" in r.stderr
    bad = write_json(tmp_path / "bad.json", {"type": "object", "properties": {"a": {"type": "string",
                                                                                     "pattern": "("}}})
    r = ranks(2, "--tp-dir", d, "--prompt", "hi", "--json-schema", bad)
    assert r.returncode != 0 and f"--json-schema {bad}" in r.stderr, r.stderr[-2000:]
