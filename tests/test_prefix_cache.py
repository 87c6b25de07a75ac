"""The prefix store (prefix_cache.py) through the engine, on the tiny checkpoints in process at TP=1 (TP=2:
test_two_ranks_share_a_prefix_alike): a request sharing a prefix with another conversation copies it into its own slot
and prefills only the rest, its first token's logits bitwise those of a slot that prefilled the prefix itself in the
same chunk split, its greedy tokens a whole-prompt prefill's (near-ties exempted: tests/invariants.py); images,
speculative decoding, eviction, a donor still decoding, requests arriving together, the LRU order, cache_salt, echo.

Every test forces copies on (prefix_cache_min=0). The reference for "bitwise" is an engine without a store whose one
slot reuses the prefix it computed itself (Engine._reuse: the same positions, rewound), fed the same chunk split (a
donor's prompt is one pass in both).
"""
import os
import subprocess
import sys

import pytest
import torch

import engine as E
import prefix_cache
import speculative
from helpers import ids, run_tp2
from invariants import tokens_agree_up_to_near_tie

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = 40  # the shared prefix's tokens: five regions of the tiny checkpoints' 8
GIB = 0.01  # a store of ~10 MiB on the tiny geometry: hundreds of regions, tens of windows


@pytest.fixture(scope="module")
def lm(tp1_models):
    return tp1_models("bf16_text")


def engine(model, batch=2, gib=GIB, chunk=E.PREFILL_CHUNK, k=0, context=256, graphs=None) -> E.Engine:
    """graphs: prefill graphs up to this length (on the CPU their padded passes run eagerly: the graph path's logic,
    whose windows the store copies from the rings after the pass)."""
    eng = E.Engine(model, E.EngineConfig(max_batch=batch, max_context=context, prefill_chunk=chunk, speculative=k,
                                         prefix_cache_gib=gib, prefix_cache_min=0, graph_prefill=graphs))
    eng.start()
    return eng


def solo(model, prompt, new, k=0, features=None) -> list:
    """A fresh engine's greedy tokens for the whole prompt, no store."""
    return engine(model, 1, 0, k=k).run([E.Request(prompt, new, features=features)])[0].out


def first_logprobs(r: E.Request):
    """The first token's log-probability and its top alternatives, as floats: bitwise comparable."""
    lp = r.token_logprobs[0]
    return lp.logprob, lp.top


def reference(model, donor: list, prompt: list, new: int, k=0, features=(None, None), graphs=None) -> E.Request:
    """The request after `donor` in one slot of an engine without a store: it reuses what the slot computed. The
    donor's prompt is one pass, as the store's donor's is (whose windows come from that pass)."""
    eng = engine(model, 1, 0, k=k, graphs=graphs)
    eng.run([E.Request(donor, 1, features=features[0])])
    return eng.run([E.Request(prompt, new, logprobs=5, features=features[1])])[0]


@torch.inference_mode()
@pytest.mark.slow
@pytest.mark.parametrize("graphs", [None, 64])
def test_a_prefix_from_another_slot_gives_the_slots_own_logits_bitwise(lm, graphs):
    """Two conversations sharing an N-token prefix arrive together: the second waits for the first's prefill, copies
    the prefix into its own slot (cached = N, a whole number of regions) and prefills only its rest. Its first
    logits are bitwise those of a slot that computed the prefix itself; its greedy tokens a whole-prompt prefill's.
    Also where the first prompt prefills by the graph path (the window then copied from its slot's rings)."""
    P = ids(N, 1)
    a, b = P + ids(5, 2), P + ids(7, 3)
    eng = engine(lm, graphs=graphs)
    ra, rb = E.Request(a, 4, logprobs=5), E.Request(b, 4, logprobs=5)
    eng.run([ra, rb])
    assert ra.slot != rb.slot and ra.cached == 0
    assert rb.cached == N // eng.store.blk * eng.store.blk == N
    assert eng.store.stats["hits"] == 1 and eng.store.stats["tokens_hit"] == N
    assert first_logprobs(rb) == first_logprobs(reference(lm, a, b, 4, graphs=graphs))
    tokens_agree_up_to_near_tie(lm, b, rb.out, solo(lm, b, 4))


@torch.inference_mode()
@pytest.mark.slow
def test_four_requests_arriving_together_prefill_the_shared_prefix_once(lm):
    """Four conversations with one N-token system prompt in one step: the prefix is prefilled once (counted in
    tokens: N plus each request's own rest), every later one reports cached = N, and each answers as alone."""
    P = ids(N, 4)
    prompts = [P + ids(3 + i, 10 + i) for i in range(4)]
    eng = engine(lm, batch=4)
    reqs = eng.run([E.Request(p, 3) for p in prompts])
    assert eng.prefill_tokens == N + sum(len(p) - N for p in prompts)
    assert [r.cached for r in reqs] == [0, N, N, N]
    for p, r in zip(prompts, reqs):
        tokens_agree_up_to_near_tie(lm, p, r.out, solo(lm, p, 3))


@torch.inference_mode()
@pytest.mark.slow
def test_a_donor_still_decoding_gives_its_prefix_and_keeps_its_tokens(lm):
    """A request whose prefill is done gives its prompt's prefix to one that arrives while it decodes (the store holds
    it from the prefill's end); the donor's own tokens are unchanged."""
    a = ids(N + 1, 5)
    b = a[:N] + ids(6, 6)
    eng = engine(lm)
    ra = eng.submit(E.Request(a, 8))
    for _ in range(3):
        eng.step()
    assert ra.out and ra.finish is None
    rb = eng.submit(E.Request(b, 4, logprobs=5))
    while eng.busy():
        eng.step()
    assert rb.slot != ra.slot and rb.cached == N
    ref = engine(lm, 1, 0)  # the donor's prompt in one pass (the store's donor was not cut), then b in its slot
    ref.run([E.Request(a, 1)])
    assert first_logprobs(rb) == first_logprobs(ref.run([E.Request(b, 4, logprobs=5)])[0])
    assert ra.out == solo(lm, a, 8)
    tokens_agree_up_to_near_tie(lm, b, rb.out, solo(lm, b, 4))


@torch.inference_mode()
@pytest.mark.slow
def test_a_mid_prompt_window_written_by_the_pass_serves_a_shorter_share(lm, monkeypatch):
    """A long prompt stores its prefix every SNAP_EVERY positions, the windows far below its end written by the pass's
    own layers: a request sharing only its first 20 tokens copies 16 of them (the last point below the fork), bitwise as
    a slot that prefilled those 16 itself."""
    monkeypatch.setattr(prefix_cache, "SNAP_EVERY", 16)
    eng = engine(lm)
    donor = ids(150, 80)
    assert len(donor) - 16 > eng.store.margin  # its ring no longer holds the window at 16 when the pass ends
    eng.run([E.Request(donor, 2)])
    b = donor[:20] + ids(9, 81)
    eng.run([E.Request(ids(5, 82), 3), E.Request(ids(5, 83), 3)])  # both slots hold something else
    rb = eng.run([E.Request(b, 4, logprobs=5)])[0]
    assert rb.cached == 16 and eng.store.stats["hits"] == 1
    ref = engine(lm, 1, 0)
    ref.run([E.Request(donor[:17], 1)])
    want = ref.run([E.Request(b, 4, logprobs=5)])[0]
    assert want.cached == 16 and first_logprobs(rb) == first_logprobs(want)
    tokens_agree_up_to_near_tie(lm, b, rb.out, solo(lm, b, 4))


@torch.inference_mode()
def test_a_next_turn_in_another_slot_reuses_the_conversation(lm):
    """A conversation's next turn (its last prompt, answer and a new user turn) finds the conversation stored at the
    last request's release, though another request holds its slot now."""
    t1 = ids(30, 7)
    eng = engine(lm, batch=1)
    r1 = eng.run([E.Request(t1, 5)])[0]
    eng.run([E.Request(ids(20, 8), 2)])  # the slot now holds another conversation
    t2 = t1 + r1.out + ids(9, 9)
    r2 = eng.run([E.Request(t2, 4, logprobs=5)])[0]
    held = len(t1) + len(r1.out) - 1  # the last answer token was never fed
    assert r2.cached == held // 8 * 8 > 0
    tokens_agree_up_to_near_tie(lm, t2, r2.out, solo(lm, t2, 4))


@torch.inference_mode()
def test_a_different_cache_salt_never_hits(lm):
    """The same prompt under another cache_salt reuses nothing, from the store or from the slot it lands in; under
    the same salt it does."""
    P = ids(N + 4, 11)
    eng = engine(lm, batch=1)
    eng.run([E.Request(P, 2, cache_salt="tenant-a")])
    other = eng.run([E.Request(P[:N] + ids(5, 12), 2, cache_salt="tenant-b")])[0]
    unsalted = eng.run([E.Request(P[:N] + ids(5, 13), 2)])[0]
    same = eng.run([E.Request(P[:N] + ids(5, 14), 2, cache_salt="tenant-a")])[0]
    assert other.cached == 0 and unsalted.cached == 0
    assert same.cached == N
    with pytest.raises(ValueError, match="cache_salt must be a string"):
        eng.submit(E.Request(P, 1, cache_salt=7))


@torch.inference_mode()
def test_echo_requests_bypass_the_store(lm):
    """An echo request computes every prompt token's logprob itself: no copy in, and nothing looked up."""
    P = ids(N + 4, 15)
    eng = engine(lm, batch=2)
    eng.run([E.Request(P, 2)])
    before = dict(eng.store.stats)
    r = eng.run([E.Request(P[:N] + ids(4, 16), 1, logprobs=0, echo=True)])[0]
    assert r.cached == 0 and eng.store.stats == before
    assert len(r.prompt_logprobs) == N + 4


@torch.inference_mode()
def test_the_store_evicts_the_least_recently_used_prefix(lm):
    """A store with room for two windows: a third prefix evicts the least recently used one (a lookup refreshes), and
    the pages it alone held are freed."""
    eng = engine(lm, batch=1)
    st = eng.store
    two = prefix_cache.size_for(lm, [eng.cache], 0)  # the pools' unit sizes
    budget = 2 * two.snap_bytes / prefix_cache.SNAP_SHARE
    small = prefix_cache.PrefixStore(eng, prefix_cache.size_for(lm, [eng.cache], int(budget)))
    assert small.size.snaps == 2 and small.size.pages >= 6
    keys = [ids(16, 20 + i) for i in range(3)]
    assert small.put(0, keys[0], None, 16) and small.put(0, keys[1], None, 16)
    assert small.lookup(keys[0], None, 16).n == 16  # refreshes keys[0]: keys[1] is now the least recently used
    free = len(small.free_pages)
    assert small.put(0, keys[2], None, 16)
    assert small.stats["evictions"] == 1 and len(small.free_pages) == free
    assert small.lookup(keys[1], None, 16) is None
    assert small.lookup(keys[0], None, 16).n == 16 and small.lookup(keys[2], None, 16).n == 16
    # shared regions are stored once: a prefix that extends keys[0] adds one page below keys[0]'s
    pages = small.lookup(keys[0], None, 16).pages
    assert small.put(0, keys[0] + ids(8, 30), None, 24)
    assert small.lookup(keys[0] + ids(8, 30), None, 24).pages[:2] == pages
    assert st is not small and st.stats["evictions"] == 0


@torch.inference_mode()
@pytest.mark.slow
def test_after_eviction_recycled_pages_give_the_right_prefix(lm):
    """A store that holds one conversation at a time: the second evicts the first (whose next request then reuses
    nothing from the store) and takes its pages; a request sharing the second's prefix copies it from the recycled
    pages, bitwise as the slot's own reuse."""
    snap = prefix_cache.size_for(lm, [lm.new_cache(1, 16, device="meta")], 0).snap_bytes
    eng = engine(lm, batch=1, gib=2.5 * snap / (1 << 30))  # one window, 8 regions
    assert eng.store.size.snaps == 1 and eng.store.size.pages < 2 * N // 8
    A, C = ids(N + 1, 40), ids(N + 1, 41)
    eng.run([E.Request(A, 1)])  # stores A's first N (at its usable end, and again at its release)
    eng.run([E.Request(C, 1)])  # C's evicts A's and takes its pages
    assert eng.store.stats["evictions"] == 1
    eng.run([E.Request(ids(5, 42), 1)])  # the slot holds something else (too short to be stored)
    b = C[:N] + ids(6, 45)
    rb = eng.run([E.Request(b, 4, logprobs=5)])[0]
    assert rb.cached == N
    eng.run([E.Request(ids(5, 44), 1)])
    ra = eng.run([E.Request(A[:N] + ids(5, 43), 2)])[0]
    assert ra.cached == 0
    ref = engine(lm, 1, 0)
    ref.run([E.Request(C, 1)])
    assert first_logprobs(rb) == first_logprobs(ref.run([E.Request(b, 4, logprobs=5)])[0])
    tokens_agree_up_to_near_tie(lm, b, rb.out, solo(lm, b, 4))


@torch.inference_mode()
@pytest.mark.slow
def test_an_image_prefix_is_reused_for_the_same_image_only(tp1_models):
    """A prefix holding an image is copied for a request with the same image's features (bitwise as the slot's own
    reuse), and only up to the image for another image of the same size."""
    vm = tp1_models("bf16_vl")
    img, D = vm.vl.image_token_id, vm.cfg.hidden_size
    pre = ids(10, 50)
    P = pre + [img] * 9 + ids(N - 19, 51)  # N tokens, the image in regions 1 and 2
    f1 = torch.randn(9, D, generator=torch.Generator().manual_seed(1)).bfloat16()
    f2 = torch.randn(9, D, generator=torch.Generator().manual_seed(2)).bfloat16()
    a, b = P + ids(4, 52), P + ids(6, 53)
    eng = engine(vm)
    eng.run([E.Request(a, 1, features=f1)])
    eng.run([E.Request(ids(12, 54), 1), E.Request(ids(12, 55), 1)])  # both slots hold something else
    same = eng.run([E.Request(b, 4, logprobs=5, features=f1)])[0]
    assert same.cached == N
    ref = reference(vm, a, b, 4, features=(f1, f1))
    assert first_logprobs(same) == first_logprobs(ref) and same.out == ref.out
    eng.run([E.Request(ids(12, 56), 1), E.Request(ids(12, 57), 1)])
    other = eng.run([E.Request(b, 2, logprobs=5, features=f2)])[0]
    assert other.cached <= len(pre) // 8 * 8  # never past the image's first region
    fresh = engine(vm, 1, 0).run([E.Request(b, 2, logprobs=5, features=f2)])[0]
    assert first_logprobs(other) == first_logprobs(fresh) and other.out == fresh.out


@pytest.mark.slow
def test_two_ranks_share_a_prefix_alike(converted, tmp_path):
    """TP=2 (tests/prefix_cache_tp2.py): the second of two conversations sharing N tokens copies them into another
    slot on both ranks, prefills only its rest, and its first logprobs and tokens are bitwise those of a slot that
    computed the prefix itself; the ranks agree."""
    runs = run_tp2("prefix_cache_tp2.py", converted("bf16_text", 2), tmp_path / "out")
    assert runs[0] == runs[1]
    store, slot = runs[0]["store"], runs[0]["slot"]
    assert store["cached"] == N and store["slots"] == [0, 1] and store["prefilled"] == N + 5 + 7
    assert slot["cached"] == N and slot["slots"] == [0, 0]
    assert store["first"] == slot["first"] and store["out"] == slot["out"]


@pytest.fixture(scope="module")
def mtp(converted):
    import config
    import model as M
    d = converted("bf16_text", 1, keep_mtp=True)
    cfg = config.load_config(os.path.join(d, "config-r0.json"))[0]
    return M.Step5ForCausalLM.from_shard(os.path.join(d, "model-r0.safetensors"), cfg)


@torch.inference_mode()
@pytest.mark.slow
def test_speculative_copies_the_mtp_layers_windows(mtp, monkeypatch):
    """With --speculative 2 the copy carries the MTP layers' windows too: the second conversation's first logprobs
    and its first drafts (the MTP layers' output on the copied state) are bitwise a slot's own reuse of the same
    prefix; its tokens are plain greedy's on the whole prompt."""
    drafts = {}
    first = speculative.Speculator.first_drafts

    def record(self, reqs, slots):
        first(self, reqs, slots)
        for r, d in zip(reqs, self.drafts[slots].tolist()):
            drafts.setdefault(tuple(r.ids), []).append(d)
    monkeypatch.setattr(speculative.Speculator, "first_drafts", record)
    P = ids(N + 4, 60)  # a slot's own reuse keeps K + 2 short of the common prefix: N at a region
    a, b = P + ids(5, 61), P + ids(7, 62)
    eng = engine(mtp, k=2)
    ra, rb = E.Request(a, 3), E.Request(b, 6, logprobs=5)  # a holds its slot while b is admitted
    eng.run([ra, rb])
    assert rb.slot != ra.slot and rb.cached == N
    ref = reference(mtp, a, b, 6, k=2)
    assert ref.cached == N
    assert first_logprobs(rb) == first_logprobs(ref)
    assert drafts[tuple(b)][0] == drafts[tuple(b)][1]  # ours, then the reference's
    tokens_agree_up_to_near_tie(mtp, b, rb.out, solo(mtp, b, 6))


TOOLS = [{"type": "function", "function": {
    "name": "search", "description": "Search the project's notes for a phrase and return the matching lines.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "description": "the phrase"},
                                                    "limit": {"type": "integer"}}, "required": ["query"]}}}]


@torch.inference_mode()
@pytest.mark.slow
def test_the_hit_rate_of_a_rendered_tool_loop_is_measured(lm, converted):
    """An agent's loop through the chat template (tools in the system turn; each step's reasoning and tool call, then
    the tool's result; at each new user turn the template drops the past turns' reasoning): every request's prompt
    is rendered again from the messages, as a server receives it. Each reports at most what it truly shares with an
    earlier prompt (region-rounded), and the loop's hit rate is printed (reported, not assumed)."""
    import runtime
    tok = runtime.load_tokenizer(os.path.join(converted("bf16_text", 1), "..", "tokenizer_files"))
    eng = engine(lm, batch=1, context=2048)
    msgs = [{"role": "system", "content": "You are a careful agent. Use the tools before you answer."}]
    seen, rows = [], []
    for turn in range(3):
        msgs.append({"role": "user", "content": f"Question {turn}: what do the notes say about topic {turn}?"})
        for step in range(3):
            ids_ = tok.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=True, tokenize=False)
            prompt = tok(ids_, add_special_tokens=False)["input_ids"]
            r = eng.run([E.Request(prompt, 2)])[0]
            best = max((E.common_prefix(prompt, p) for p in seen), default=0)
            rows.append((len(prompt), r.cached, min(best, len(prompt) - 1) // 8 * 8))
            seen += [prompt, prompt + r.out]
            if step < 2:
                msgs.append({"role": "assistant", "content": "", "reasoning_content": f"Step {step}: look it up.",
                             "tool_calls": [{"type": "function", "function": {
                                 "name": "search", "arguments": {"query": f"topic {turn} part {step}"}}}]})
                msgs.append({"role": "tool", "content": f"line {step}: topic {turn} is covered in part {step}."})
            else:
                msgs.append({"role": "assistant", "content": f"Topic {turn} is covered in parts 0 and 1.",
                             "reasoning_content": "Both lookups agree."})
    prompt_tokens, cached = sum(n for n, _, _ in rows), sum(c for _, c, _ in rows)
    print(f"\ntool loop: {len(rows)} requests, {prompt_tokens} prompt tokens, {cached} cached: hit rate "
          f"{cached / prompt_tokens:.1%} (shared with an earlier prompt, at regions: "
          f"{sum(b for *_, b in rows) / prompt_tokens:.1%}); per request (prompt, cached, shared): {rows}")
    assert all(c <= b for _, c, b in rows)  # never more than is truly shared
    assert rows[0][1] == 0 and cached > 0


@pytest.mark.slow
def test_the_bench_runs_at_tiny_shapes():
    """tools/bench_prefix_cache.py --tiny (the device's measurement at the tiny checkpoint's shapes, on the CPU): its
    hit copies the whole prefix, and its agents prefill their shared system prompt once."""
    r = subprocess.run([sys.executable, "-m", "tools.bench_prefix_cache", "--tiny", "--reps", "1"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "copied from the store (cached 64)" in r.stdout and "hit / alone" in r.stdout
    assert "the copy alone: 64 positions" in r.stdout  # timed while the prefix is stored
    assert "store: mean TTFT" in r.stdout and "104 tokens prefilled, 96 cached" in r.stdout, r.stdout


@torch.inference_mode()
def test_a_shared_leading_part_is_stored_for_requests_that_come_later(lm):
    """A request's `share` (a system turn its front end rendered) is stored too: a later request in another
    conversation that shares only that part copies it (cached = share, rounded down to a region), though its slot
    was taken by another prompt in between. Without `share`, the first request stores only its end, and the later
    one finds nothing to copy."""
    S = ids(N + 3, 21)  # 43 shared ids: five whole regions
    for share, want in ((len(S), N), (0, 0)):
        eng = engine(lm, batch=1)
        eng.run([E.Request(S + ids(20, 22), 2, share=share)])
        eng.run([E.Request(ids(30, 23), 2)])  # the one slot now holds another prompt
        later = eng.run([E.Request(S + ids(9, 24), 2)])[0]
        assert later.cached == want
    with pytest.raises(ValueError, match="share"):
        eng.submit(E.Request(S, 1, share=len(S) + 1))
