"""Where each session's requests last went: the session policy sends a session back there while that replica
has room (its cache holds the conversation, even when an earlier turn overflowed off the session's place on
the ring), and routers share these bindings so a session keeps its replica whichever router it reaches.
Bounded: the least recently used sessions are forgotten first, and a binding lapses after `ttl_s`."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable


class SessionBindings:
    def __init__(
        self, clock: Callable[[], float], ttl_s: float = 600.0, max_sessions: int = 100_000, max_outbox: int = 0
    ) -> None:
        """`max_outbox` > 0: bindings this router makes are also kept (that many at most) for its peers."""
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._clock = clock
        self._bound: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._outbox: deque[tuple[str, str]] | None = deque(maxlen=max_outbox) if max_outbox > 0 else None
        self.on_news: Callable[[], None] | None = None
        """Called when the outbox gains a binding (the peers' publisher wakes)."""

    def get(self, session: str) -> str | None:
        """The replica `session` is bound to, if the binding is still fresh."""
        found = self._bound.get(session)
        if found is None:
            return None
        replica, at = found
        if self._clock() - at > self.ttl_s:
            del self._bound[session]
            return None
        return replica

    def bind(self, session: str, replica: str) -> None:
        """This router sent `session`'s request to `replica` (peers hear of it only when that changed it)."""
        found = self._bound.get(session)
        if self._outbox is not None and (found is None or found[0] != replica):
            self._outbox.append((session, replica))
            if self.on_news is not None:
                self.on_news()
        self._set(session, replica)

    def learn(self, session: str, replica: str) -> None:
        """A peer sent `session` to `replica`."""
        self._set(session, replica)

    def forget_replica(self, replica: str) -> None:
        """`replica` left the fleet: its sessions go back to the ring."""
        for session in [s for s, (rid, _) in self._bound.items() if rid == replica]:
            del self._bound[session]

    def take_outbox(self) -> list[tuple[str, str]]:
        if not self._outbox:
            return []
        pairs = list(self._outbox)
        self._outbox.clear()
        return pairs

    def _set(self, session: str, replica: str) -> None:
        self._bound[session] = (replica, self._clock())
        self._bound.move_to_end(session)
        while len(self._bound) > self.max_sessions:
            self._bound.popitem(last=False)

    def __len__(self) -> int:
        return len(self._bound)
