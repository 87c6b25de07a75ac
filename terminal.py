"""Rank 0's keyboard in `generate.py --interactive`: lines at the prompt, Ctrl-C during an answer, and the terminal's
settings put back however the process ends.

- In a terminal the chat runs in cbreak mode without echo or terminal signals (ICANON, ECHO and ISIG off): each key
  arrives when it is pressed, and Ctrl-C as the byte 0x03. With ISIG on, Ctrl-C would make the terminal send SIGINT
  to torchrun and every rank, ending the run; in canonical mode it would wait for Enter. At the prompt, read_line
  edits the line itself (echo, Backspace, Ctrl-U; Ctrl-C drops the line, Ctrl-D on an empty line ends the chat,
  Enter sends it). During an answer, poll reads what was typed without waiting: a Ctrl-C stops the answer, and the
  other keys wait for the next prompt, which takes them as typed there (Enter among them sends that line).
- Restoring. The saved settings are put back when the chat ends. A process killed by SIGKILL runs no code (nor does
  one whose launcher was killed: PR_SET_PDEATHSIG), so a watchdog process holds the saved settings too: started
  before they change, it waits on a pipe whose writing end only this process holds, and when the pipe closes without
  the word that the settings are back (this process ended, however), it puts them back. It runs in a session of its
  own, so the signals sent to the job (torchrun's, the shell's) do not reach it. The watchdog, not the launcher:
  torchrun is not ours, and the other ranks die with rank 0.
- Outside a terminal (a pipe, a file) lines are read as they come; Ctrl-C is SIGINT, as for any process.
A SIGINT sent to rank 0 stops an answer too (poll), and at the prompt ends the chat as Ctrl-D does: when every rank
got it (torchrun forwards it), the others are gone and nothing could go on.
"""
import codecs
import os
import select
import signal
import subprocess
import sys
import unicodedata

import runtime as R

CTRL_C, CTRL_D, CTRL_U, ESC = "\x03", "\x04", "\x15", "\x1b"
BACKSPACE = ("\x7f", "\x08")
DONE = b"restored"  # what this process writes to the watchdog once it has put the settings back itself

# The watchdog: argv[1] is the terminal's descriptor, argv[2] the settings (termios.tcgetattr's list, repr). It reads
# its stdin (the pipe) to the end and puts the settings back unless it was told they are back.
_WATCHDOG = """import ast, os, sys, termios
fd, saved, said = int(sys.argv[1]), ast.literal_eval(sys.argv[2]), b""
while chunk := os.read(0, 64):
    said += chunk
if said != %r:
    try:
        termios.tcsetattr(fd, termios.TCSANOW, saved)
    except termios.error:  # the terminal is gone
        pass
""" % DONE


class Keys:
    """Rank 0's stdin in the chat (see the module docstring): read_line at the prompt, poll during an answer,
    restore at the end. `hit`: a Ctrl-C (or SIGINT) since the last clear."""

    def __init__(self, stdin=None, echo=None):
        """echo: where the prompt and the typed keys are shown (default: stderr, or the terminal itself where stderr
        goes elsewhere: with the terminal's own echo off, the user would type blind)."""
        self.stdin = stdin or sys.stdin
        self.fd = self.stdin.fileno()
        self.tty = os.isatty(self.fd)
        self.echo = echo or (sys.stderr if sys.stderr.isatty() or not self.tty
                             else open(os.ttyname(self.fd), "w", errors="backslashreplace"))
        self.hit, self.reading, self.ahead = False, False, ""
        self.saved = self.watchdog = None
        if self.tty:
            import termios
            self.decoder = codecs.getincrementaldecoder(self.stdin.encoding or "utf-8")("surrogateescape")
            self.saved = termios.tcgetattr(self.fd)
            self.watchdog = _start_watchdog(self.fd, self.saved)
            mode = termios.tcgetattr(self.fd)
            mode[3] &= ~(termios.ICANON | termios.ECHO | termios.ISIG)
            mode[6][termios.VMIN], mode[6][termios.VTIME] = 1, 0
            termios.tcsetattr(self.fd, termios.TCSANOW, mode)
        signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, *_):
        self.hit = True
        R.SIGINT_SEEN.set()
        if self.reading:
            raise KeyboardInterrupt

    # ---- during an answer
    def poll(self) -> bool:
        """Whether Ctrl-C came since the last clear; in a terminal the keys typed meanwhile are read, a Ctrl-C taken
        and the rest kept for the next prompt."""
        while self.tty and select.select([self.fd], [], [], 0)[0]:
            data = os.read(self.fd, 4096)
            if not data:
                break
            text = self.decoder.decode(data)
            self.hit |= CTRL_C in text
            self.ahead += text.replace(CTRL_C, "")
        return self.hit

    def clear(self):
        self.hit = False
        R.SIGINT_SEEN.clear()

    # ---- at the prompt
    def read_line(self, prompt: str = "> ") -> str | None:
        """The next line (None at the end of the input, Ctrl-D on an empty line, or a SIGINT while waiting)."""
        self.reading = True
        try:
            return self._edit(prompt) if self.tty else self._plain()
        except KeyboardInterrupt:
            return None
        finally:
            self.reading = False

    def _plain(self) -> str | None:
        line = self.stdin.readline()
        if not line:
            return None
        return line.rstrip("\n") if CTRL_C not in line else ""  # a Ctrl-C in the line drops it

    def _say(self, text: str):
        self.echo.write(text)
        self.echo.flush()

    def _edit(self, prompt: str) -> str | None:
        """The line as the user edits it, starting with what was typed during the answer."""
        line, esc = [], ""
        self._say(prompt)
        while True:
            if not self.ahead:
                data = os.read(self.fd, 4096)
                if not data:  # the terminal hung up
                    return None
                self.ahead = self.decoder.decode(data)
            ch, self.ahead = self.ahead[0], self.ahead[1:]
            if esc:  # an escape sequence (arrow and function keys: ESC [ ... final byte, ESC O x; Alt+key: ESC x)
                esc += ch
                if len(esc) == 2 and ch in "[O" or esc[1] == "[" and not (len(esc) > 2 and "@" <= ch <= "~"):
                    continue
                esc = ""  # it ended: ignored
            elif ch == ESC:
                esc = ch
            elif ch in "\r\n":
                self._say("\n")
                return "".join(line)
            elif ch == CTRL_C:  # the line is dropped; a new prompt
                self._say("^C\n" + prompt)
                line = []
            elif ch == CTRL_D:
                if not line:
                    self._say("\n")
                    return None
            elif ch in BACKSPACE:
                if line:
                    w = _width(line.pop())
                    self._say("\b" * w + " " * w + "\b" * w)
            elif ch == CTRL_U:
                w = sum(map(_width, line))
                self._say("\b" * w + " " * w + "\b" * w)
                line = []
            elif ch == "\t" or ch >= " ":
                line.append(ch)
                self._say(ch)

    # ---- the end
    def restore(self):
        """The terminal's settings as they were, and the watchdog told so."""
        if self.saved is None:
            return
        import termios
        termios.tcsetattr(self.fd, termios.TCSANOW, self.saved)
        try:
            self.watchdog.stdin.write(DONE)
            self.watchdog.stdin.close()
        except OSError:  # the watchdog is gone (killed with the job): nothing else to tell
            pass
        self.saved = None


def _width(ch: str) -> int:
    """Terminal columns of one character: 2 for wide (CJK) characters, 0 for combining marks."""
    if unicodedata.combining(ch):
        return 0
    return 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1


def _start_watchdog(fd: int, saved: list) -> subprocess.Popen:
    """The watchdog of the terminal `fd`'s settings `saved` (see the module docstring); its stdin is the pipe, and
    the terminal its descriptor of the same number as a copy of `fd` here."""
    tty = os.dup(fd)  # fd may be 0, which the pipe takes in the watchdog
    try:
        return subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(tty), repr(saved)], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, pass_fds=(tty,), start_new_session=True)
    finally:
        os.close(tty)
