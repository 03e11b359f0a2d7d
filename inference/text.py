"""From tokens to text as they arrive: incremental UTF-8 decoding and stop strings.

A BPE token can end in the middle of a UTF-8 character (an emoji is often two or three
byte-level tokens), so text is shown only once its characters are complete. Text that could be
the beginning of a stop string is held back until it is clear whether the stop string follows.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Sequence

import tiktoken

_ESCAPE = re.compile(r"\\(?:u([0-9a-fA-F]{4})|(.))", re.DOTALL)
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def decode_escapes(text: str) -> str:
    r"""`\n`, `\t`, `\r`, `\\` and `\uXXXX` as the characters they name: the shell and Hydra
    pass `'stop=["\n\n"]'` on as backslash, n. Any other backslash stays as written."""
    # group 1: the hex digits of \\uXXXX; group 2: the character after any other backslash
    return _ESCAPE.sub(lambda m: chr(int(m[1], 16)) if m[1] else _ESCAPES.get(m[2], m[0]), text)


class TextStream:
    """One sample's text, token by token. `push` returns the text that became safe to show;
    the sample ends at the first stop string (which is not shown) or at `finish`."""

    def __init__(self, tokenizer: tiktoken.Encoding, stop: Sequence[str] = ()):
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._token_bytes = tokenizer.decode_single_token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = tuple(stop)
        self._held = ""  # decoded, not yet shown: it may be the start of a stop string
        self.text = ""  # everything shown so far
        self.done = False

    def push(self, token: int) -> str:
        """Add one token; return the new text that is now complete (possibly "")."""
        if self.done:
            return ""
        return self._release(self._utf8.decode(self._token_bytes(token)))

    def finish(self) -> str:
        """End the sample (end-of-text or token budget); return whatever was held back, with
        an unfinished character shown as U+FFFD."""
        if self.done:
            return ""
        shown = self._release(self._utf8.decode(b"", final=True))
        rest, self._held, self.done = self._held, "", True
        self.text += rest
        return shown + rest

    def _release(self, new: str) -> str:
        buf = self._held + new
        hits = [i for i in (buf.find(s) for s in self._stop) if i >= 0]
        if hits:
            self._held, self.done, shown = "", True, buf[: min(hits)]
        else:
            held = max((_overlap(buf, s) for s in self._stop), default=0)
            self._held, shown = buf[len(buf) - held :], buf[: len(buf) - held]
        self.text += shown
        return shown


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of stop."""
    longest_first = range(min(len(text), len(stop) - 1), 0, -1)
    return next((n for n in longest_first if text.endswith(stop[:n])), 0)
