"""``@command``: a client method written once as a plan (plan.py), run by the client's ``_run`` -- to its result
(KVPoolClient) or to an awaitable of it (AsyncKVPoolClient)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from kvpool_client.plan import Plan


class RunsPlans(Protocol):
    """What ``@command`` needs of the client (KVPoolCommands): a way to run a plan."""

    def _run(self, plan: Plan[Any]) -> Any: ...


C = TypeVar("C", bound=RunsPlans)
P = ParamSpec("P")
R = TypeVar("R")


def command(plan: Callable[Concatenate[C, P], Plan[R]]) -> Callable[Concatenate[C, P], R]:
    """A method written as a plan, returning what the client's ``_run`` makes of it: the result, or an awaitable."""

    @functools.wraps(plan)
    def run_command(self: C, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._run(plan(self, *args, **kwargs))

    # help() shows what the call returns, not the plan: "Plan[int]" -> "int" (annotations are strings, PEP 563).
    signature = inspect.signature(plan)
    result = signature.return_annotation.removeprefix("Plan[").removesuffix("]")
    run_command.__signature__ = signature.replace(return_annotation=result)  # type: ignore[attr-defined]
    return run_command
