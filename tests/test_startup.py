"""Start-up (startup.py) on the tiny checkpoints, in process at TP=1: the launches of requests are only launches that
start-up made (the Triton launchers' launches recorded, not run, with the GPU's launch choices), the builds from
threads make every launch of the warm-up in order and mark Triton's cache, threads compile each kernel variant once,
the decode steps are built from threads before their capture, and the padded prefill and extension graphs read nothing
back to the host.

Start-up's phases are watched on the engine's own Startup object (eng.startup): its public steps (warm_pass,
build_ahead, warm_graphs_ahead) are wrapped there to record what each launches, or stubbed where a test needs only
the decision to run them.
"""
import os
import threading

import pytest
import torch

import engine as E
import model as M
import startup
from test_engine import ids


# the kernel.py functions model.py calls, each dispatching to its Triton launcher or its reference
DISPATCHERS = ("rms_norm", "norm_rope_jobs", "banded_attention", "sliding_decode", "region_summary", "dsa_cache_write",
               "indexer_scores", "select_regions", "sparse_attention", "route", "swiglu", "moe_experts",
               "skinny_linear", "add_norm")


@pytest.fixture
def gpu_launches(monkeypatch):
    """Every kernel call made twice: its Triton launches (with the GPU's launch choices) recorded and not executed,
    then its reference, whose results the model goes on with (the interpreter is too slow for a whole engine's run).
    The switch between the two is per thread (start-up's parallel builds call kernels from several)."""
    import kernel
    from kernels import common
    monkeypatch.setattr(common, "_GPU_LAUNCH", True)
    monkeypatch.setattr(common, "_sms", lambda: 132)
    on = threading.local()
    monkeypatch.setattr(kernel, "_triton", lambda x: getattr(on, "triton", False))

    def both(f):
        def call(*a, **k):
            on.triton = True
            try:
                f(*a, **k)  # its launches, recorded only
            finally:
                on.triton = False
            return f(*a, **k)
        return call
    for name in DISPATCHERS:
        monkeypatch.setattr(kernel, name, both(getattr(kernel, name)))
    warm_lengths = M.Step5ForCausalLM.warm_lengths  # the passes it lists on the Triton path

    def triton_warm_lengths(self, *a):
        on.triton = True
        try:
            return warm_lengths(self, *a)
        finally:
            on.triton = False
    monkeypatch.setattr(M.Step5ForCausalLM, "warm_lengths", triton_warm_lengths)


@pytest.mark.parametrize("path", ["references", "triton launchers"])
@torch.inference_mode()
def test_a_padded_prefill_reads_nothing_back_to_the_host(tp1_models, monkeypatch, request, path):
    """A CUDA graph cannot hold a host read or a host-to-device copy: the padded pass and the extension step (as
    captured, here run on the CPU) make no op that would (a tensor's value read on the host, a data-dependent shape,
    a tensor from host data), through the references or through the Triton launchers (their launches recorded, not
    run, as gpu_launches makes them, then the references). The eager prefill, which reads the cache lengths unless
    told them, is caught reading."""
    import contextlib
    from tools import sass
    from torch.utils._python_dispatch import TorchDispatchMode
    lm = tp1_models("fp8_text")
    launchers = path == "triton launchers"
    if launchers:
        request.getfixturevalue("gpu_launches")
    seen = []
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t, f=torch.Tensor.tolist: seen.append("tolist") or f(t))
    eng = E.Engine(lm, E.EngineConfig(max_batch=2, max_context=256, graph_prefill=64))
    with sass.launch_keys(set(), execute=False) if launchers else contextlib.nullcontext():
        eng.start()
    g = eng.prefill_graphs[64]
    g.inputs[1].fill_(45)
    g.inputs[2].fill_(1)
    banned = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.lift_fresh.default",
              "aten.masked_select.default", "aten.unique_consecutive.default", "aten._unique2.default"}
    seen.clear()

    class Host(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func) in banned:
                seen.append(str(func))
            return func(*args, **(kwargs or {}))
    x = eng.extend_graphs[32]
    x.inputs[1].fill_(20)
    x.inputs[2].fill_(1)
    keys = set()
    with sass.launch_keys(keys, execute=False) if launchers else contextlib.nullcontext(), Host():
        logits = g()
        turn = x()
    assert not seen, f"host reads in the padded prefill: {sorted(set(seen))}"
    assert logits.shape == turn.shape == (1, lm.lm_head.weight.shape[0]) and int(eng.cache.lengths[1]) == 65
    assert (len(keys) > 10) == launchers  # the Triton launchers ran (their launches recorded)
    with sass.launch_keys(set(), execute=False) if launchers else contextlib.nullcontext(), Host():
        lm.forward(g.inputs[0], eng.cache, [64], rows=[0])
    assert "tolist" in seen and "aten.lift_fresh.default" in seen


@pytest.mark.parametrize("graph_prefill, speculative", [(0, 0), (256, 0), (256, 1)])
@torch.inference_mode()
@pytest.mark.slow
def test_requests_after_start_up_launch_only_what_start_up_compiled(tp1_models, converted, gpu_launches,
                                                                    graph_prefill, speculative):
    """Nothing compiles on the request path: every Triton launch of requests of other prompt lengths and batch sizes
    is one that start-up made, each launch keyed as Triton compiles it (sass.launch_key: constexprs, each integer's
    class, each pointer's alignment), with fresh prompts prefilled eagerly or padded (graph_prefill), and with MTP
    drafts (speculative: verify and draft steps, the MTP layers' absorb of each padded prompt's real rows), and with
    constrained, penalised, logprob and echo requests (their choose steps); and no graph is captured after start-up.
    tools.bench_request counts real compilations on the GPU."""
    from tools import sass
    from conftest import load_tp1
    import choice
    import grammar
    from sampling import Sampling
    d = converted("fp8_text", 1, keep_mtp=bool(speculative))
    lm = load_tp1(d) if speculative else tp1_models("fp8_text")
    grammars = grammar.Grammars(os.path.join(d, "..", "tokenizer_files", "tokenizer.json"), lm.cfg.vocab_size, 4)
    warm, seen = set(), set()
    eng = E.Engine(lm, E.EngineConfig(max_batch=4, max_context=640, prefill_chunk=256, graph_prefill=graph_prefill,
                                      speculative=speculative), grammars=grammars)
    with sass.launch_keys(warm, execute=False):
        eng.start()
    captured = []
    real_capture = startup.Graph.capture
    startup.Graph.capture = lambda g: captured.append(g) or real_capture(g)
    try:
        with sass.launch_keys(seen, execute=False):
            eng.run([E.Request(ids(7, 20), 3)])
            eng.run([E.Request(ids(300, 21), 2), E.Request(ids(23, 22), 4), E.Request(ids(1, 23), 2)])
            eng.run([E.Request(ids(29, 24), 3), E.Request(ids(290, 25), 3)])
            r = eng.run([E.Request(ids(50, 26), 2)])[0]  # a few queries past those that select every region
            eng.run([E.Request(r.ids + r.out + ids(20, 27), 2)])  # a next turn on top of its cache
            # constrained (a reasoning budget), penalised and biased, logprob and echo requests, side by side
            eng.run([E.Request(ids(9, 28), 6, frozenset({4}), Sampling(1.0, seed=1),
                               constraint=grammar.Constraint(grammar.Kind.JSON_OBJECT),
                               reasoning=choice.Reasoning(900, 2), logprobs=2),
                     E.Request(ids(40, 29), 4, sampling=Sampling(0.8, top_k=5, min_p=0.1, presence_penalty=1,
                                                                 repetition_penalty=1.2, logit_bias={7: 3.0})),
                     E.Request(ids(30, 30), 3, logprobs=5, echo=True)])
    finally:
        startup.Graph.capture = real_capture
    assert not captured, "graphs captured after start-up"
    new = seen - warm

    def differs(k):  # the arguments in which a new launch differs from every start-up launch of its kernel
        alike = [w for w in warm if w[0] == k[0]]
        return sorted(set(k[1]) - set.intersection(*(set(w[1]) for w in alike)), key=str) if alike else "a new kernel"
    assert not new, "launches start-up did not make:\n" + "\n".join(f"{k[0]}: {differs(k)}" for k in sorted(new, key=str))
    assert len(warm) > 20 and len(seen) > 10


@torch.inference_mode()
@pytest.mark.slow
def test_start_up_builds_from_threads_until_a_start_up_has_built_its_kernels(tp1_models, gpu_launches, monkeypatch,
                                                                             tmp_path):
    """The builds from threads are for a Triton cache that lacks the warm-up's kernels: a start-up leaves a marker in
    Triton's cache directory, and the next start-up of the same code, passes, config and device warms up in order
    (its builds would only read the disk cache, the threads contending for the GIL); other passes (another context)
    or another cache directory build from threads again; without threads nothing is marked."""
    import triton

    from tools import sass
    lm = tp1_models("fp8_text")
    built, in_order = [], []

    def start(context, cache_dir, threads=2):
        monkeypatch.setattr(triton.knobs.cache, "dir", str(cache_dir))
        in_order.clear()
        with sass.launch_keys(set(), execute=False):  # the warm-up's launches recorded, not interpreted
            eng = E.Engine(lm, E.EngineConfig(max_batch=1, max_context=context, prefill_chunk=64,
                                              build_threads=threads))
            st, warm = eng.startup, eng.startup.warm_pass
            st.build_ahead = lambda passes, threads: built.append(len(passes))

            def counted_warm(p0, n, cache=None, mtps=None, main=True):
                in_order.append(cache is None)
                return warm(p0, n, cache, mtps, main)
            st.warm_pass = counted_warm
            eng.start()
        return len(in_order)
    assert start(256, tmp_path / "a") == 0 and len(built) == 1  # from threads (stubbed here), then marked
    assert [f.startswith("step5-built-") for f in os.listdir(tmp_path / "a")] == [True]
    assert start(256, tmp_path / "a") > 0 and len(built) == 1  # marked: in order
    assert start(128, tmp_path / "a") == 0 and len(built) == 2  # other passes (a shorter context): threads
    assert start(256, tmp_path / "b") == 0 and len(built) == 3  # another cache: threads
    assert start(256, tmp_path / "c", threads=0) > 0 and not (tmp_path / "c").exists()
    (tmp_path / "ro").write_text("a file where the cache directory would be")  # an unwritable cache: not marked
    assert start(256, tmp_path / "ro" / "cache") == 0 and len(built) == 4


@torch.inference_mode()
@pytest.mark.slow
def test_start_up_builds_ahead_from_threads_every_launch_of_the_warm_up_in_order(tp1_models, gpu_launches, monkeypatch,
                                                                                 tmp_path):
    """Start-up's parallel kernel builds make every launch of the warm-up passes in order, which they replace: each
    pass run from a thread, in a cache of its own as long as the pass needs (not the engine's), makes the launches
    the same pass makes on the engine's cache."""
    from tools import sass
    lm = tp1_models("fp8_text")
    ahead, warm, threads = set(), set(), set()

    def record(st: startup.Startup):  # the builds' launches, the warm-up's in order, the threads that ran passes
        build, run_warm = st.build_ahead, st.warm_pass

        def recorded_build(*a):
            with sass.launch_keys(ahead, execute=False):
                build(*a)

        def recorded_warm(p0, n, cache=None, mtps=None, main=True):
            if cache is not None:  # a pass of the parallel builds
                threads.add(threading.get_ident())
                return run_warm(p0, n, cache, mtps)
            with sass.launch_keys(warm, execute=False):
                return run_warm(p0, n, main=main)
        st.build_ahead, st.warm_pass = recorded_build, recorded_warm
    import triton
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))  # no start-up has built into it
    for n in (0, 3):  # the warm-up in order, then the builds from threads
        eng = E.Engine(lm, E.EngineConfig(max_batch=2, max_context=640, prefill_chunk=256, build_threads=n))
        record(eng.startup)
        with sass.launch_keys(set(), execute=False):  # the decode graphs' launches too: recorded, not interpreted
            eng.start()
    assert len(threads) > 1 and eng.startup.timing["build_s"] > 0
    missed = warm - ahead
    assert not missed, "warm-up launches the parallel builds did not make:\n" + "\n".join(
        map(str, sorted(missed, key=str)))
    assert len(warm) > 20


def test_start_up_threads_compile_each_kernel_variant_once(monkeypatch):
    """Start-up's threads that launch a Triton kernel variant before it is built compile it once
    (startup.one_build_per_variant): the first builds it, the others wait and take that build; other variants build
    side by side. Without it every thread compiles its own (Triton's JIT looks its cache up before compiling, stores
    after)."""
    import time
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from triton.runtime.jit import JITFunction
    builds, running, most, lock = [], [0], [0], threading.Lock()

    def compile_variant(self, key, signature, device, *rest):  # stands for Triton's: slow, stores its build
        with lock:
            builds.append(key)
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.2)
        self.device_caches[device][0][key] = built = object()
        with lock:
            running[0] -= 1
        return built
    monkeypatch.setattr(JITFunction, "_do_compile", compile_variant)
    fn = SimpleNamespace(device_caches={0: ({}, None, None, None, None)})
    wanted = ["a", "a", "b", "a", "b", "a"]

    def launch_all():
        fn.device_caches[0][0].clear()
        builds.clear()
        most[0] = 0
        with ThreadPoolExecutor(len(wanted)) as pool:
            return list(pool.map(lambda key: JITFunction._do_compile(fn, key, None, 0, None, None, None, False),
                                 wanted))
    launch_all()
    assert len(builds) == len(wanted)  # each thread its own build
    with startup.one_build_per_variant():
        got = launch_all()
    assert sorted(builds) == ["a", "b"] and most[0] >= 2
    assert len({id(k) for k, key in zip(got, wanted) if key == "a"}) == 1
    assert JITFunction._do_compile is compile_variant  # put back


@torch.inference_mode()
def test_start_up_builds_the_decode_steps_from_threads_before_capturing_them(tp1_models, gpu_launches, monkeypatch,
                                                                             tmp_path):
    """A start-up that builds from threads also runs each batch bucket's decode step once from a thread (a bucket a
    thread) before the captures: the captures, on the start-up's thread, make no launch the threads did not make,
    and the slots hold nothing after start-up."""
    import triton

    from tools import sass
    lm = tp1_models("fp8_text")
    ahead, captured, warmed_on = set(), set(), set()
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))  # no start-up has built into it
    eng = E.Engine(lm, E.EngineConfig(max_batch=4, max_context=256, prefill_chunk=64, build_threads=3))
    st = eng.startup
    st.build_ahead = lambda passes, threads: None  # the prefill passes' builds
    warm_graphs = st.warm_graphs_ahead

    def watch(g: startup.Graph):  # its captures' launches recorded, the threads of its warm-ups noted
        capture, warm = g.capture, g.warm

        def recorded_capture():
            with sass.launch_keys(captured, execute=False):
                capture()

        def noted_warm():
            warmed_on.add(threading.get_ident())
            warm()
        g.capture, g.warm = recorded_capture, noted_warm

    def recorded_warm_graphs(threads):  # every graph exists by now
        for g in [g for gs in eng.graphs.values() for g in gs] + list(eng.extend_graphs.values()):
            watch(g)
        with sass.launch_keys(ahead, execute=False):
            warm_graphs(threads)
    st.warm_graphs_ahead = recorded_warm_graphs
    with sass.launch_keys(set(), execute=False):  # the prefill warm-ups' launches: recorded, not interpreted
        eng.start()
    assert list(eng.graphs) == [1, 2, 4] and len(warmed_on - {threading.get_ident()}) > 1
    missed = captured - ahead
    assert captured and not missed, "decode launches the threads did not make:\n" + "\n".join(
        map(str, sorted(missed, key=str)))
    assert not eng.cache.lengths.any()


@torch.inference_mode()
@pytest.mark.slow
def test_start_up_sizes_its_builds_to_the_memory_left(tp1_models, gpu_launches, monkeypatch, tmp_path):
    """The free memory start-up sees (a figure faked on the engine's Startup object) sizes its builds: where it holds
    two of the largest warm-up passes side by side they run from threads, as many together as it holds, and the
    decode steps' threads likewise; where it does not (a whole rank on an H100), the warm-up runs in order."""
    import triton

    from tools import sass
    import time
    lm = tp1_models("fp8_text")

    def start(spare_passes: float):
        """A start-up whose device has the plan's needs and `spare_passes` of its largest pass free beside them ->
        (its log: the passes run from threads, the most running at once and the most memory they took together,
        the threads given the decode steps, the passes run in order; the memory the builds had)."""
        monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path / str(spare_passes)))  # no start-up built there
        eng = E.Engine(lm, E.EngineConfig(max_batch=4, max_context=256, prefill_chunk=64, build_threads=8))
        st, warm, lock = eng.startup, eng.startup.warm_pass, threading.Lock()
        log = {"ahead": [], "running": [], "most": 0, "most_bytes": 0, "order": 0}
        largest = max(st._pass_bytes(p0, n) for p0, n in lm.warm_lengths(eng.max_context, 64))
        p = st.plan
        free = p.caches + p.prefill + p.graphs + p.headroom + int(spare_passes * largest)
        st.free_memory = lambda: free - (p.caches if eng.cache is not None else 0)  # the instrument

        def logged_warm(p0, n, cache=None, mtps=None, main=True):
            if cache is None:
                log["order"] += 1
                return warm(p0, n, main=main)
            with lock:
                log["running"].append(st._pass_bytes(p0, n))
                log["most"] = max(log["most"], len(log["running"]))
                log["most_bytes"] = max(log["most_bytes"], sum(log["running"]))
            time.sleep(0.05)  # the threads' passes overlap
            with lock:
                log["running"].remove(st._pass_bytes(p0, n))
            log["ahead"].append((p0, n))
        st.warm_pass = logged_warm
        st.warm_graphs_ahead = lambda threads: log.update(graph_threads=threads)
        with sass.launch_keys(set(), execute=False):
            eng.start()
        return log, free - p.headroom
    passes = lm.warm_lengths(256, 64)
    log, room = start(spare_passes=1.5)
    assert log["ahead"] == [] and log["order"] > 0 and "graph_threads" not in log  # tight: in order
    log, room = start(spare_passes=2.5)
    assert sorted(log["ahead"]) == sorted(passes) and log["order"] == 0 and 2 <= log["most"] < 8, log
    assert log["most_bytes"] <= room and 1 <= log["graph_threads"] <= 8, (log, room)
    log, room = start(spare_passes=40)
    assert log["most"] > 2 and log["most_bytes"] <= room and log["graph_threads"] == 8, (log, room)


@pytest.mark.parametrize("room", [False, True])
@torch.inference_mode()
def test_builds_from_threads_need_room_for_what_they_leave_taken(tp1_models, gpu_launches, monkeypatch, tmp_path,
                                                                 room):
    """Builds from threads leave memory taken outside the allocator (loaded kernels, library workspaces), and the
    headroom is still needed beside it (the graphs' captures run in it). On a
    device with room for two of the largest warm-up passes side by side (free memory faked on the engine's Startup
    object, and the leftover estimate set on it), they run from threads only where the plan has room for the leftover
    (its spare memory and half of its caches, the context being fitted): then the plan after them sees what they left
    and keeps its whole headroom; where it has not, the warm-up runs in order, said in one line."""
    import triton

    from tools import sass
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))  # no start-up built there: builds from threads
    lm = tp1_models("fp8_text")
    said = []
    eng = E.Engine(lm, E.EngineConfig(max_batch=2, prefill_chunk=64, build_threads=2, prefix_cache_gib=0),
                   said.append)
    st, p = eng.startup, eng.startup.plan
    largest = max(st._pass_bytes(p0, n) for p0, n in lm.warm_lengths(eng.max_context, 64))
    free = p.caches + p.prefill + p.graphs + p.headroom + int(2.5 * largest)  # two of the largest passes fit
    built = []
    st.free_memory = lambda: free - st.leftover * bool(built) - (p.caches if eng.cache is not None else 0)
    st.replan()
    spare = int(2.5 * largest) + st.plan.caches // 2  # the tiny model's context is capped: its caches leave spare
    st.leftover = spare - largest if room else spare + largest  # the instrument: what the builds leave taken
    st.build_ahead = lambda passes, threads: built.append(len(passes))
    st.warm_graphs_ahead = lambda threads: None
    with sass.launch_keys(set(), execute=False):
        eng.start()
    if not room:
        assert not built and any("leave taken" in x and "kernels build in order" in x for x in said), said
        return
    assert built and st.plan.free == free - st.leftover  # the plan after them saw what they left
    assert st.plan.headroom == p.headroom and st.plan.fits()  # the headroom kept whole


def test_a_start_up_that_runs_out_of_memory_names_the_flags(tp1_models):
    """An out-of-memory error during start-up (raised here from a warm-up pass, as a GPU raises it) is one
    MemoryError that names the flags sizing what start-up allocates, not a traceback."""
    lm = tp1_models("fp8_text")
    eng = E.Engine(lm, E.EngineConfig(max_batch=2, max_context=256, prefill_chunk=64, build_threads=0))

    def out_of_memory(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    eng.startup.warm_pass = out_of_memory
    eng.startup._plain_graph = out_of_memory  # the CPU warms no pass: its decode graphs' warm-up runs
    with pytest.raises(MemoryError, match=r"start-up ran out of memory on cpu \(CUDA out of memory. Tried to allocate "
                       r"2.00 GiB\); lower --max-context \(256\), --max-batch \(2\) or --prefill-chunk \(64\)"):
        eng.start()


@torch.inference_mode()
def test_the_widest_extension_step_is_planned_only_where_its_graph_fits(tp1_models):
    """The 128-token extension step's graph is held by the memory plan only where it fits beside a given context (the
    free memory faked on the engine's Startup object, graphs charged as on a GPU), and then start-up builds that step
    too; one byte short, the steps stay at 16, 32 and 64."""
    lm = tp1_models("fp8_text")
    eng = E.Engine(lm, E.EngineConfig(max_batch=1, max_context=256, prefill_chunk=64, graph_prefill=64))
    st = eng.startup
    eng.use_graph = True  # the plan charges the graphs' memory (the engine itself still runs eagerly on the CPU)
    narrow = st._plan_for(eng.config, startup.EXTEND[:-1])[0]
    need = narrow.free - narrow.spare()  # what the narrow plan takes
    for extra, want in ((startup.EXTEND_GRAPH - 1, startup.EXTEND[:-1]), (startup.EXTEND_GRAPH, startup.EXTEND)):
        st.free_memory = lambda: need + extra
        st.replan()
        assert st.plan.extend == want and st.plan.fits()
    eng.use_graph = False
    eng.start()
    assert list(eng.extend_graphs) == [16, 32, 64, 128]
