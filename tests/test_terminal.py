"""Rank 0's keyboard in the chat (terminal.py) through a pseudo-terminal: the line editor in process, and
`generate.py --interactive` under torchrun with its stdio on a pty, as in a terminal: Ctrl-C stops an answer without
Enter and keeps the session, text typed during an answer goes to the next turn, and the terminal's settings come back
when rank 0 or torchrun is killed.
"""
import io
import os
import signal
import sys
import termios
import threading
import time

import pytest

import terminal
from test_generate import _ppid, speed_lines

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
FLAGS = (termios.ICANON, termios.ECHO, termios.ISIG)


def lflags(fd: int) -> tuple:
    """Which of ICANON, ECHO and ISIG the terminal has on."""
    mode = termios.tcgetattr(fd)[3]
    return tuple(bool(mode & f) for f in FLAGS)


@pytest.fixture
def keys():
    """Keys on the slave side of a new pty (its echo collected), and the master side to type on."""
    master, slave = os.openpty()
    saved, handler = termios.tcgetattr(slave), signal.getsignal(signal.SIGINT)
    stdin, echo = open(slave, encoding="utf-8", closefd=False), io.StringIO()
    k = terminal.Keys(stdin, echo)
    try:
        yield k, master, slave, saved, echo
    finally:
        k.restore()
        signal.signal(signal.SIGINT, handler)
        os.close(master)
        os.close(slave)


def test_the_prompt_edits_its_line_and_takes_what_was_typed_during_an_answer(keys):
    """In cbreak mode without echo or signals: Backspace (a wide character's two columns), Ctrl-U, arrow keys ignored,
    Enter sends; keys read during an answer (poll) are the next line's start, a Ctrl-C among them is taken; Ctrl-C at
    the prompt drops the line; Ctrl-D on an empty line ends the input; restore puts the settings back."""
    k, master, slave, saved, echo = keys
    assert lflags(slave) == (False, False, False) and k.tty
    os.write(master, "abc\x7fd\x1b[A\x1bOBxy张\x7f\r".encode())
    assert k.read_line() == "abdxy"
    assert echo.getvalue() == "> abc\b \bdxy张\b\b  \b\b\n"
    os.write(master, "you\x15me\r".encode())
    assert k.read_line() == "me"
    assert not k.poll()
    os.write(master, b"typed \x03ahead")
    time.sleep(0.1)
    assert k.poll() and k.ahead == "typed ahead"
    k.clear()
    assert not k.hit
    os.write(master, b" more\rnext\r")
    echo.truncate(0)
    echo.seek(0)
    assert k.read_line() == "typed ahead more" and echo.getvalue() == "> typed ahead more\n"
    assert k.read_line() == "next"
    os.write(master, b"dropped\x03kept\x04\r\x04")  # Ctrl-D on a line that holds text: nothing
    assert k.read_line() == "kept"
    assert k.read_line() is None
    k.restore()
    assert termios.tcgetattr(slave) == saved


class PtyRun:
    """torchrun of generate.py with its stdin, stdout and stderr on a new pty that is its controlling terminal (as a
    shell's job: with ISIG on, Ctrl-C would signal torchrun and every rank); what it writes is collected."""

    def __init__(self, args: list):
        self.master, self.slave = os.openpty()
        self.saved = termios.tcgetattr(self.slave)
        self.pid = os.fork()
        if self.pid == 0:  # the child: a session of its own whose controlling terminal is the pty
            try:
                os.setsid()
                import fcntl
                fcntl.ioctl(self.slave, termios.TIOCSCTTY, 0)
                for fd in (0, 1, 2):
                    os.dup2(self.slave, fd)
                os.chdir(ROOT)
                os.execve(TORCHRUN, [TORCHRUN, "--standalone", "--nproc-per-node=1", "generate.py", *map(str, args)],
                          dict(os.environ, OMP_NUM_THREADS="1"))
            finally:
                os._exit(127)
        self.out, self.code = bytearray(), None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        while True:
            try:
                data = os.read(self.master, 4096)
            except OSError:  # the slave's last holder closed it
                return
            if not data:
                return
            self.out += data

    def text(self) -> str:
        return self.out.decode(errors="replace")

    def wait_for(self, text: str, count: int = 1, timeout: float = 120):
        t0 = time.time()
        while self.text().count(text) < count:
            assert time.time() - t0 < timeout, f"no {text!r} after {timeout} s:\n" + self.text()[-3000:]
            assert self.poll() is None, "torchrun exited:\n" + self.text()[-3000:]
            time.sleep(0.05)

    def type(self, data: str):
        os.write(self.master, data.encode())

    def workers(self) -> list:
        return [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == self.pid]

    def poll(self) -> int | None:
        """torchrun's exit code, or None while it runs."""
        if self.code is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.code = os.waitstatus_to_exitcode(status)
        return self.code

    def wait(self, timeout: float = 60) -> int:
        t0 = time.time()
        while self.poll() is None:
            assert time.time() - t0 < timeout, "torchrun did not exit:\n" + self.text()[-3000:]
            time.sleep(0.1)
        return self.code

    def close(self):
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        os.close(self.master)
        os.close(self.slave)


@pytest.mark.slow
def test_ctrl_c_stops_an_answer_without_enter_and_the_next_line_is_answered(converted):
    """In a terminal: Ctrl-C during an answer stops it at once (no Enter), the session goes on, and what was typed
    during the answer is the start of the next turn, which is answered; /exit ends the chat and the terminal's
    settings are back."""
    run = PtyRun(["--tp-dir", converted("bf16_text", 1), "--interactive", "--max-new-tokens", 400, "--ignore-eos"])
    try:
        run.wait_for("interactive: up to")
        run.type("tell me a long story\r")
        run.wait_for("> tell me a long story\r\n")
        time.sleep(2)  # answering (400 tokens take ~20 s here)
        run.type("typed ahead")
        run.type("\x03")
        run.wait_for("(stopped)", timeout=30)
        run.type(" more\r")
        run.wait_for("prefill:", 2)
        run.type("/exit\r")
        assert run.wait() == 0, run.text()[-3000:]
        text = run.text()
        assert "> typed ahead more\r\n" in text and "Traceback" not in text, text[-3000:]
        lines = speed_lines(text)
        assert len(lines) == 2 and lines[0][2] < 399 and lines[1][2] == 399, text[-3000:]
        assert termios.tcgetattr(run.slave) == run.saved
    finally:
        run.close()


@pytest.mark.parametrize("victim", ["rank 0", "torchrun"])
@pytest.mark.slow
def test_the_terminal_is_restored_when_rank_0_or_torchrun_is_killed(converted, victim):
    """kill -9 of rank 0 (or of torchrun, whose workers then die) during the chat: nothing of the chat runs any more,
    and the terminal's settings are put back (by the watchdog)."""
    run = PtyRun(["--tp-dir", converted("bf16_text", 1), "--interactive"])
    try:
        run.wait_for("interactive: up to")
        assert not lflags(run.slave)[2]  # the chat runs without terminal signals
        rank0, = run.workers()
        os.kill(rank0 if victim == "rank 0" else run.pid, signal.SIGKILL)
        run.wait()
        t0 = time.time()
        while termios.tcgetattr(run.slave) != run.saved and time.time() - t0 < 10:
            time.sleep(0.1)
        assert lflags(run.slave) == (True, True, True) and termios.tcgetattr(run.slave) == run.saved
    finally:
        run.close()
