"""Rank processes forked from one interpreter that has imported the product's modules once.

A rank started as `python generate.py ...` spends seconds of CPU importing torch and transformers before it reads
its first flag; a test file that starts a hundred
ranks spends minutes on that alone. The server here (`python tests/fork_launcher.py SOCKET`) imports them once and
then, for each request on its Unix socket, forks a child that takes the caller's stdin, stdout and stderr (passed as
file descriptors), the caller's environment, working directory and argv, and runs the script as `__main__`, as the
interpreter would: the child is a process of its own whose exit code, output and signals the test sees as it would a
fresh interpreter's. The server never runs the model, tokenizes or starts a thread, so nothing of its own state
reaches a child but the imported modules.

Client: Launcher(env).popen(args, env=..., stdin=..., stdout=..., stderr=...) -> Proc, a subprocess.Popen look-alike
(pid, stdin/stdout/stderr, poll, wait, communicate, send_signal, kill, returncode).
"""
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_REQUEST = 1 << 16  # one request's JSON (argv, environment, working directory)


# ---------------------------------------------------------------------------------------------- the server
def preload():
    """What every generate.py rank imports, and what its run may import later (transformers through the tokenizer;
    torch._dynamo wherever one of torch's paths reaches it)."""
    sys.path.insert(0, ROOT)
    import torch._dynamo  # noqa: F401
    import transformers  # noqa: F401
    from transformers import PreTrainedTokenizerFast  # noqa: F401
    import generate  # noqa: F401
    sys.path.remove(ROOT)


def run_child(req: dict, fds: list):
    """In the forked child: the caller's fds as 0, 1, 2, its environment and directory; the script as __main__;
    the exit code the interpreter would give."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    script = os.path.abspath(req["argv"][0])
    sys.argv = [req["argv"][0], *req["argv"][1:]]
    sys.path[0] = os.path.dirname(script)
    code = 1
    try:
        import runpy
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:  # the interpreter prints it, then ends by the signal itself
        import traceback
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:  # noqa: B036  (what the interpreter prints for an uncaught exception)
        import traceback
        traceback.print_exc()
    finally:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:
                pass
        if code == -signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)


def serve(path: str):
    preload()
    parent = os.getppid()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(64)
    print("ready", flush=True)
    waiting = {}  # pid -> the connection that hears its exit code
    while os.getppid() == parent:  # the test process gone: so is the server
        if select.select([sock], [], [], 0.02)[0]:
            conn, _ = sock.accept()
            msg, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST, 3)
            req = json.loads(msg)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                sock.close()
                conn.close()
                for c in waiting.values():
                    c.close()
                run_child(req, fds)
            for fd in fds:
                os.close(fd)
            conn.sendall(f"{pid}\n".encode())
            waiting[pid] = conn
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = waiting.pop(pid)
            try:
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:  # the caller stopped listening
                pass
            conn.close()


# ---------------------------------------------------------------------------------------------- the client
class Proc:
    """One forked rank, as subprocess.Popen shows a child: its pipes (text), poll / wait / communicate, signals."""

    def __init__(self, conn: socket.socket, pid: int, args: list, stdin, stdout, stderr):
        self._conn, self.pid, self.args = conn, pid, args
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode = None
        self._got = b""

    def _read_code(self, timeout: float | None) -> bool:
        if self.returncode is not None:
            return True
        self._conn.settimeout(timeout)
        try:
            while not self._got.endswith(b"\n"):
                chunk = self._conn.recv(64)
                if not chunk:
                    raise RuntimeError(f"the fork launcher went away before rank {self.pid} ended")
                self._got += chunk
        except (socket.timeout, BlockingIOError):
            return False
        self.returncode = int(self._got)
        self._conn.close()
        return True

    def poll(self):
        self._read_code(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._read_code(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None):
        """(stdout, stderr) read to their end (None for a stream not piped), then the exit code awaited."""
        t0 = time.monotonic()
        out = {}
        readers = [threading.Thread(target=lambda k, f: out.__setitem__(k, f.read()), args=(k, f), daemon=True)
                   for k, f in (("out", self.stdout), ("err", self.stderr)) if f is not None]
        if self.stdin is not None:
            self.stdin.close()
        for t in readers:
            t.start()
        for t in readers:
            t.join(None if timeout is None else max(0.0, timeout - (time.monotonic() - t0)))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if timeout is None else max(0.0, timeout - (time.monotonic() - t0)))
        for f in (self.stdout, self.stderr):
            if f is not None:
                f.close()
        return out.get("out"), out.get("err")

    def send_signal(self, sig: int):
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self):
        self.send_signal(signal.SIGKILL)


class Launcher:
    """The server, started once (its imports take the few seconds each rank would otherwise spend)."""

    def __init__(self, env: dict, sock_dir: str):
        self.path = os.path.join(sock_dir, "fork_launcher.sock")
        self.server = subprocess.Popen([sys.executable, os.path.abspath(__file__), self.path], cwd=ROOT, env=env,
                                       stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        line = self.server.stdout.readline()
        assert line == "ready\n", f"the fork launcher did not start (exit {self.server.poll()}): {line!r}"

    def popen(self, argv: list, env: dict, stdin=None, stdout=None, stderr=None, cwd: str = ROOT) -> Proc:
        """A rank running `python argv...`; stdin / stdout / stderr as subprocess takes them (None: the test's own,
        subprocess.PIPE, subprocess.DEVNULL, an open file, or subprocess.STDOUT for stderr)."""
        mine, theirs, close = {}, [], []
        for i, (name, spec) in enumerate((("stdin", stdin), ("stdout", stdout), ("stderr", stderr))):
            if spec is None:
                theirs.append(i)
            elif spec == subprocess.STDOUT:  # stderr on stdout's file, as a terminal shows both
                theirs.append(theirs[1])
            elif spec == subprocess.DEVNULL:
                fd = os.open(os.devnull, os.O_RDWR)
                theirs.append(fd)
                close.append(fd)
            elif spec == subprocess.PIPE:
                r, w = os.pipe()
                ours, child = (w, r) if i == 0 else (r, w)
                mine[name] = os.fdopen(ours, "w" if i == 0 else "r", encoding="utf-8")
                theirs.append(child)
                close.append(child)
            else:
                theirs.append(spec.fileno())
        msg = json.dumps({"argv": [str(a) for a in argv], "env": env, "cwd": str(cwd)}).encode()
        assert len(msg) < MAX_REQUEST, len(msg)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        try:
            socket.send_fds(conn, [msg], theirs)
        finally:
            for fd in close:
                os.close(fd)
        got = b""
        while not got.endswith(b"\n"):
            chunk = conn.recv(64)
            assert chunk, "the fork launcher closed the connection"
            got += chunk
        pid, rest = got.split(b"\n", 1)
        p = Proc(conn, int(pid), argv, mine.get("stdin"), mine.get("stdout"), mine.get("stderr"))
        p._got = rest
        return p

    def close(self):
        self.server.kill()
        self.server.wait()
        self.server.stdout.close()
        os.unlink(self.path)


if __name__ == "__main__":
    serve(sys.argv[1])
