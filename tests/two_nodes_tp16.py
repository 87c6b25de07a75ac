"""TP=EP=16 on two "nodes", CPU/gloo stand-in for the two-node BF16 layout (16 ranks, one expert per rank here).

    python tests/two_nodes_tp16.py [--workdir DIR] [--keep] [--cases bf16_text,fp8_vl_image] [--no-cli]

Writes the tiny checkpoints (the test suite's bf16_text and fp8_vl kinds: default geometry, which divides at TP=16),
converts them at TP=1 and TP=16, and for each case launches every 16-rank job as two torchrun agents on 127.0.0.1
(`--nnodes=2 --nproc-per-node=8 --node-rank={0,1} --master-addr=127.0.0.1 --master-port=P`), run in parallel:
  1. the generate.py CLI (--prompt-json-batch, --json): both agents exit 0; generate.py itself checks at the end that
     all 16 ranks produced the same tokens and fails otherwise;
  2. tests/tp_logits_dump.py at TP=1 (one process): TP=1's greedy tokens, teacher-forced logits and its recorded
     routing / DSA region decisions (model.Pins);
  3. tests/tp_logits_dump.py at TP=16 (two agents again): generate.main() on the batch, then a teacher-forced replay
     of TP=1's tokens with TP=1's decisions pinned. Checks: max |dlogit| / std(TP=1 logits) < 0.15 (the single-node
     TP=2/4 tolerance of tests/test_generate.py) at every step and request; TP=16's tokens equal the CLI's; TP=16's
     tokens equal TP=1's up to an explained near-tie (a decision of the free runs flipped, or TP=1's top-1/top-2
     margin within the tolerance), as in test_greedy_tokens_and_logits_agree_across_tp.
Cases: bf16_text (two text prompts of 12 and 45 ids: below and above the DSA top-k span of 32, so the 45-token
prompt prunes regions) and fp8_vl_image (the 12-id prompt, and the 45-id prompt with a 728x728 image: 169
placeholders). Prints the figures; exits non-zero on any failure. OMP_NUM_THREADS=1 for every rank.
"""
import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
import torch  # noqa: E402

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
TP, NODES = 16, 2
NEW = 4
LOGIT_TOL = 0.15  # x std(TP=1 logits), decisions pinned: tests/test_generate.py's cross-TP tolerance
TIMEOUT = 600
GRACE = 30  # seconds a node may outlive the other's failure
CKPT = {"bf16_text": dict(fp8=False, vl=False, seed=1), "fp8_vl": dict(seed=0)}  # conftest.CKPT_KINDS
CASES = {"bf16_text": ("bf16_text", False), "fp8_vl_image": ("fp8_vl", True)}


class Failed(Exception):
    pass


def check(cond, msg):
    if not cond:
        raise Failed(msg)


def ids_prompt(n: int, seed: int) -> list:
    r = random.Random(seed)
    return [r.randrange(11, 1024) for _ in range(n)]  # no special ids (0..10)


PROMPTS = [ids_prompt(12, 112), ids_prompt(45, 145)]  # tests/test_generate.py's 12- and 45-token prompts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", DUMP_DEVICE="cpu")


def two_nodes(args: list, log: str) -> str:
    """One 16-rank job as two torchrun agents (node ranks 0 and 1) on this host, in parallel. Both must exit 0.
    -> node 0's stdout (rank 0 prints there)."""
    port = free_port()
    procs, files = [], []
    for node in range(NODES):
        cmd = [TORCHRUN, f"--nnodes={NODES}", f"--nproc-per-node={TP // NODES}", f"--node-rank={node}",
               "--master-addr=127.0.0.1", f"--master-port={port}", *map(str, args)]
        if node == 0:
            print("  $ " + " ".join(cmd[:1] + ["--node-rank={0,1}" if a.startswith("--node-rank") else a
                                               for a in cmd[1:]]), flush=True)
        out, err = open(f"{log}.n{node}.out", "w+"), open(f"{log}.n{node}.err", "w+")
        files.append((out, err))
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=out, stderr=err, start_new_session=True))
    deadline = time.monotonic() + TIMEOUT
    failed_at = None  # once a node fails, the other gets GRACE seconds to fail too (not the full timeout)
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now > failed_at + GRACE):
            for p in procs:  # SIGTERM: the agent stops its workers (each in a session of its own), then exits
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            if failed_at is None:
                raise Failed(f"two-node launch timed out after {TIMEOUT} s (logs: {log}.n*.err)")
            break
        time.sleep(0.2)
    rcs = [p.returncode for p in procs]
    texts = []
    for out, err in files:
        out.seek(0), err.seek(0)
        texts.append((out.read(), err.read()))
        out.close(), err.close()
    for node, rc in enumerate(rcs):
        errs = "".join(line + "\n" for line in texts[node][1].splitlines() if line.startswith("error:"))
        check(rc == 0, f"node {node} exited {rc}:\n{errs}... {texts[node][1][-1500:]}\n(log: {log}.n{node}.err)")
    return texts[0][0]


def one_process(args: list) -> str:
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node=1", *map(str, args)]
    print("  $ " + " ".join(cmd), flush=True)
    r = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=TIMEOUT)
    check(r.returncode == 0, f"TP=1 run exited {r.returncode}:\n{r.stderr[-3000:]}")
    return r.stdout


def dump(tp: int, tp_dir: str, batch: str, forced, pins, work: str, tag: str):
    """tests/tp_logits_dump.py: generate.main() on the batch, then the teacher-forced replay(s). -> (tokens, dump)."""
    spec, out = os.path.join(work, f"spec_{tag}.json"), os.path.join(work, f"logits_{tag}.pt")
    with open(spec, "w") as f:
        json.dump({"batch_file": batch, "new": NEW, "forced": forced, "pins": pins}, f)
    args = [os.path.join(ROOT, "tests", "tp_logits_dump.py"), tp_dir, spec, out]
    stdout = one_process(args) if tp == 1 else two_nodes(args, os.path.join(work, tag))
    return [x["completion_token_ids"] for x in json.loads(stdout)["results"]], torch.load(out, weights_only=False)


def prepare(work: str, kinds: set) -> dict:
    import convert
    from tiny_checkpoint import make_checkpoint
    dirs = {}
    for kind in sorted(kinds):
        ck = make_checkpoint(os.path.join(work, "ckpt", kind), **CKPT[kind])
        out = os.path.join(work, "converted", kind)
        with open(os.path.join(work, f"convert_{kind}.log"), "w") as log, contextlib.redirect_stdout(log):
            for tp in (1, TP):
                convert.main(ck, out, tp_size=tp, ep_size=tp)
        dirs[kind] = out
    return dirs


def batch_file(work: str, images: bool) -> str:
    reqs = list(PROMPTS)
    if images:
        from safetensors.torch import save_file
        px = torch.randn(1, 3, 728, 728, generator=torch.Generator().manual_seed(7))
        save_file({"pixel_values": px}, os.path.join(work, "img.safetensors"))
        p = PROMPTS[1]
        reqs[1] = {"prompt_ids": p[:20] + [6] + [5] * 169 + [7] + p[20:], "image_inputs": "img.safetensors"}
    path = os.path.join(work, f"batch_{'image' if images else 'text'}.json")
    with open(path, "w") as f:
        json.dump(reqs, f)
    return path


def run_case(name: str, out_root: str, work: str, cli: bool) -> dict:
    from invariants import decisions_differ
    kind, images = CASES[name]
    tp1, tp16 = os.path.join(out_root, "tp1"), os.path.join(out_root, f"tp{TP}")
    batch = batch_file(work, images)
    with open(batch) as f:
        lengths = [len(e["prompt_ids"]) if isinstance(e, dict) else len(e) for e in json.load(f)]
    fig = {"case": name, "prompt_tokens": lengths}
    print(f"[{name}] prompts of {lengths} tokens, {NEW} new tokens", flush=True)
    if cli:  # 1. the CLI itself, two nodes
        t = time.monotonic()
        doc = json.loads(two_nodes(["generate.py", "--tp-dir", tp16, "--ep-size", TP, "--prompt-json-batch", batch,
                                    "--max-new-tokens", NEW, "--json"], os.path.join(work, f"{name}_cli")))
        cli_toks = [r["completion_token_ids"] for r in doc["results"]]
        check([r["prompt_token_count"] for r in doc["results"]] == lengths, f"prompt counts {doc}")
        fig["cli_s"] = round(time.monotonic() - t, 1)
        print(f"  TP=16 CLI (2 nodes x 8 ranks): exit 0 on both nodes, tokens {cli_toks} ({fig['cli_s']} s)",
              flush=True)
    # 2. TP=1: tokens, logits, decisions
    t = time.monotonic()
    toks1, d1 = dump(1, tp1, batch, None, None, work, f"{name}_tp1")
    check(all(len(x) == NEW for x in toks1), f"a request hit EOS early at TP=1: {toks1}")
    L1 = d1["logits"]
    check(L1.argmax(-1).T.tolist() == toks1, "TP=1 teacher-forced argmax differs from generate.py's tokens")
    pins = os.path.join(work, f"pins_{name}_tp1.pt")
    torch.save(d1["pins"], pins)
    fig["tp1_s"] = round(time.monotonic() - t, 1)
    print(f"  TP=1 tokens {toks1} ({fig['tp1_s']} s)", flush=True)
    # 3. TP=16, two nodes: generate.main() again, then TP=1's tokens teacher-forced with TP=1's decisions pinned
    t = time.monotonic()
    toks16, d16 = dump(TP, tp16, batch, [x[:-1] for x in toks1], pins, work, f"{name}_tp16")
    fig["tp16_dump_s"] = round(time.monotonic() - t, 1)
    if cli:
        check(toks16 == cli_toks, f"TP=16 generate.main() tokens {toks16} differ from the CLI's {cli_toks}")
    std = L1.std().item()
    diff = (d16["pinned_logits"] - L1).abs().amax(-1)  # [NEW, B]
    fig["max_dlogit_over_std_pinned"] = round(diff.max().item() / std, 4)
    fig["max_dlogit_over_std_free"] = round((d16["logits"] - L1).abs().amax(-1).max().item() / std, 4)
    fig["std"] = round(std, 3)
    top2 = L1.topk(2, dim=-1).values
    margin = top2[..., 0] - top2[..., 1]
    agree = []
    for b in range(len(lengths)):
        if toks16[b] == toks1[b]:
            agree.append("same")
            continue
        s = next(i for i, (x, y) in enumerate(zip(toks16[b], toks1[b])) if x != y)
        flipped = decisions_differ(d1["pins"], d16["pins"], b, lengths[b] - 1 + s)
        check(flipped or margin[s, b].item() <= LOGIT_TOL * std,
              f"{name} request {b} diverges at step {s} (TP=1 margin {margin[s, b].item():.3f}, std {std:.3f}), "
              f"no decision flipped: {toks16[b]} vs {toks1[b]}")
        agree.append(f"differs from step {s} ({'decision flipped' if flipped else 'near-tie'})")
    fig["tp16_vs_tp1_tokens"] = agree
    print(f"  TP=16 tokens {toks16} vs TP=1: {agree}; decisions pinned: max |dlogit| / std = "
          f"{fig['max_dlogit_over_std_pinned']:.4f} (std {std:.3f}, limit {LOGIT_TOL}); unpinned: "
          f"{fig['max_dlogit_over_std_free']:.4f} ({fig['tp16_dump_s']} s)", flush=True)
    check(diff.max().item() < LOGIT_TOL * std,
          f"{name}: pinned max |dlogit| / std = {diff.max().item() / std:.4f} >= {LOGIT_TOL}: per step/request\n"
          f"{diff / std}")
    return fig


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", help="scratch directory (default: a new temporary one, removed unless --keep)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory (logs: *.n0.err / *.n1.err)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {', '.join(CASES)}")
    ap.add_argument("--no-cli", dest="cli", action="store_false",
                    help="skip the separate generate.py CLI launch (the TP=16 dump still runs generate.main())")
    ap.add_argument("--json", dest="as_json", action="store_true", help="also print the figures as one JSON line")
    a = ap.parse_args(argv)
    cases = [c for c in a.cases.split(",") if c]
    bad = [c for c in cases if c not in CASES]
    if bad or not cases:
        ap.error(f"--cases: unknown {bad}; choose from {', '.join(CASES)}")
    work = a.workdir or tempfile.mkdtemp(prefix="two_nodes_tp16_")
    os.makedirs(work, exist_ok=True)
    t0 = time.monotonic()
    figs, code = [], 0
    try:
        outs = prepare(work, {CASES[c][0] for c in cases})
        print(f"checkpoints written and converted at TP=1 and TP={TP} in {time.monotonic() - t0:.1f} s ({work})",
              flush=True)
        for c in cases:
            figs.append(run_case(c, outs[CASES[c][0]], work, a.cli))
        print(f"PASS: TP=EP={TP} on {NODES} nodes x {TP // NODES} ranks, {len(cases)} case(s), "
              f"{time.monotonic() - t0:.1f} s", flush=True)
    except (Failed, subprocess.TimeoutExpired) as e:
        print(f"FAIL: {e}", file=sys.stderr, flush=True)
        code = 1
    finally:
        if a.as_json:
            print(json.dumps(figs))
        if not a.keep and not a.workdir and code == 0:
            shutil.rmtree(work, ignore_errors=True)
        elif code:
            print(f"scratch kept for inspection: {work}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
