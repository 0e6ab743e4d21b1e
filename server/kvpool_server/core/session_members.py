"""SessionMembers: which live sequences belong to which session -- what a session's end frees."""

from __future__ import annotations

from kvpool_server.core.errors import InvariantViolationError
from kvpool_server.core.seq_index import SequenceIndex


class SessionMembers:
    """The manager's record of sessions and their sequences (by internal id), kept off the append path: a
    sequence joins a session when registered or forked with a ``session_id`` (``own``) and leaves it when freed
    (``disown``).

    Invariants (``check_invariants``): ``session_of_seq`` and ``seqs_of_session`` are the same relation read both
    ways, over live sequences only, with no empty set.
    """

    def __init__(self) -> None:
        self.session_of_seq: dict[int, int] = {}  # seq_id -> session_id, for sequences that belong to a session
        self.seqs_of_session: dict[int, set[int]] = {}  # session_id -> its live seq_ids

    def own(self, seq_ids: list[int], session_id: int) -> None:
        """``seq_ids`` (new) belong to ``session_id`` (0: to none)."""
        if session_id:
            self.seqs_of_session.setdefault(session_id, set()).update(seq_ids)
            for seq_id in seq_ids:
                self.session_of_seq[seq_id] = session_id

    def disown(self, seq_ids: list[int]) -> None:
        """``seq_ids`` are freed: they leave their sessions (a session left with none is forgotten)."""
        if not self.session_of_seq:
            return
        for seq_id in seq_ids:
            session_id = self.session_of_seq.pop(seq_id, 0)
            if session_id:
                members = self.seqs_of_session[session_id]
                members.discard(seq_id)
                if not members:
                    del self.seqs_of_session[session_id]

    def seq_ids(self, session_id: int) -> list[int]:
        """The live sequences of a session, sorted."""
        return sorted(self.seqs_of_session.get(session_id, ()))

    def check_invariants(self, live: SequenceIndex) -> None:
        """Raise InvariantViolationError naming the first broken invariant; ``live``: the live sequences."""
        pairs = {(seq_id, session_id) for session_id, seq_ids in self.seqs_of_session.items() for seq_id in seq_ids}
        if pairs != set(self.session_of_seq.items()) or any(not s for s in self.seqs_of_session.values()):
            raise InvariantViolationError("session_of_seq and seqs_of_session disagree (or a session has an empty set)")
        dead = [seq_id for seq_id in self.session_of_seq if seq_id not in live]
        if dead:
            raise InvariantViolationError(f"sequences {dead[:8]} belong to a session but are not live")
