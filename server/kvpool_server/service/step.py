"""A scheduler's step -- a Free, an AppendToken and a RegisterSequences -- as one service call (the fast path's
step record, fastpath/step.py, calls it; the layout is ``kvpool.fastpath_step``'s).

    answer = step(service, call, session_id, free_ids, (ids, counts, token_ids) or None, prompts() or None, hashes)
    answer.statuses[i], answer.freed, answer.append (an AppendPlan), answer.register (a RegisteredPrompt each)

The parts in order -- the Free, then the AppendToken, then the RegisterSequences -- each made by the very service
method its own call is (``service.free``, ``service.append``, ``service.register_many``), in a call scope of its
own (the record's caller and headers; admitted and observed as the record): the same checks, statuses and
messages, each all or none. A part that fails gets its status and the parts after it still run, as they would
after that call failed: the step answers what the three calls, made one after the other, would have answered.

Answers that are not final: a Free of a sequence with a copy in flight raises the service's ``Wait`` before
anything is applied -- and the Free comes first, so the transport (the one adapter, ``answers.honour``) calls the
whole step again once the copy is done, nothing of it applied twice. A Free released in chunks answers an
``Offload``; then the other parts run at once (its sequences are detached: nobody can name them), and the step's
answer is an ``Offload`` too, whose work waits for the last chunk (``service.freeing``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

from kvpool_server.service import register_batch
from kvpool_server.service.answers import Offload, Wait
from kvpool_server.service.errors import Status
from kvpool_server.service.register_batch import PromptToRegister
from kvpool_server.service.scope import OK, Call

if TYPE_CHECKING:
    from kvpool_server.service.kvpool import KVPoolService


class StepAnswer:
    """The parts' statuses (free, append, register) and the OK ones' answers."""

    __slots__ = ("statuses", "freed", "append", "register", "block_size")

    def __init__(self, block_size: int) -> None:
        self.statuses: list[Status] = [OK, OK, OK]
        self.freed = 0
        self.append: Any = None  # an AppendPlan
        self.register: Any = None  # a RegisteredPrompt a prompt
        self.block_size = block_size


def step(service: KVPoolService, call: Call, session_id: int, free_ids: list[int], append: tuple | None,
         prompts: Callable[[], Sequence[PromptToRegister]] | None,
         hashes: Sequence[list[bytes] | None] | None = None) -> StepAnswer | Offload:
    """The step's parts (each absent when empty / None); ``prompts()`` builds the register's prompts (its own
    refusal, as RegisterSequences', is that part's status); ``hashes``: theirs, from the hasher."""
    answer = StepAnswer(service.guard.manager.block_size)
    freeing = None
    if free_ids:
        status, freed = _part(call, "Free", lambda c: service.free(c, free_ids, session_id, 0))
        answer.statuses[0] = status
        if isinstance(freed, Offload):
            freeing = freed
        elif freed is not None:
            answer.freed = int(freed)
    if append is not None:
        ids, counts, tokens = append
        answer.statuses[1], answer.append = _part(call, "AppendToken", lambda c: service.append(
            c, cast(Any, ids), cast(Any, counts), tokens, session_id, 0))
    if prompts is not None:
        answer.statuses[2], answer.register = _part(
            call, register_batch.RPC, lambda c: service.register_many(c, prompts(), session_id, 0, hashes))
    if freeing is None:
        return answer
    return Offload(lambda: _freed(call, answer, freeing), freeing.finish)


def _part(outer: Call, rpc: str, run: Callable[[Call], Any]) -> tuple[Status, Any]:
    """One part as its own call: its status and answer (None when it failed). A ``Wait`` goes through: the step
    is made again."""
    call = outer.scope.call(rpc, outer.headers, admit=False, observe=False)
    call.caller = outer.caller
    try:
        return OK, run(call)
    except Wait:
        raise
    except Exception as exc:  # noqa: BLE001  (the part's status; the parts after it still run)
        return outer.scope.failed(call, exc), None


def _freed(outer: Call, answer: StepAnswer, freeing: Offload) -> StepAnswer:
    """A chunked Free's blocks, once its last chunk is released (a copy thread): the Free part's answer."""
    try:
        answer.freed = int(freeing.work())
    except Exception as exc:  # noqa: BLE001  (the Free part's status)
        answer.statuses[0] = outer.scope.failed(outer.scope.call("Free", outer.headers, admit=False,
                                                                 observe=False), exc)
    return answer
