"""Stop strings over streamed text: emit text as it comes, but hold back a tail that could be the start of a stop
string, and cut the text where one appears (the stop string itself is not emitted, as in OpenAI's API).

Worked example with stop ``["\\n\\n"]``: push("red\\n") -> "red" (the "\\n" may start a stop), push("\\nblue") ->
"" and the match "\\n\\n"; the request then ends with finish reason "stop".
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._pending = ""
        self.matched: str | None = None

    def push(self, text: str) -> str:
        """Feed new text; returns what can be emitted now. After a match (``matched`` is set) returns "" forever."""
        if self.matched is not None:
            return ""
        buf = self._pending + text
        hits = [(buf.find(s), s) for s in self.stops if s in buf]
        if hits:
            cut, self.matched = min(hits)
            self._pending = ""
            return buf[:cut]
        keep = max((_overlap(buf, s) for s in self.stops), default=0)
        self._pending = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The held-back tail, at the end of the stream."""
        out, self._pending = ("" if self.matched is not None else self._pending), ""
        return out


def _overlap(text: str, stop: str) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of ``stop``."""
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0
