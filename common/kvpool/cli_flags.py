"""What every kvpool command line shares: no abbreviated flags, and a pointer for the flags of other tools.

argparse takes any unambiguous prefix of a long flag by default, so ``kvpool-server --port 53220`` silently meant
``--port-file 53220`` (the server started on its default address and wrote a file named 53220). Every kvpool CLI
is built with ``allow_abbrev=False`` (subcommands too) and declares, hidden, the flags a vLLM user types by habit
(``foreign_flags``): each is refused at once with the kvpool flag that does the job::

    parser = argparse.ArgumentParser(prog="kvpool-server", allow_abbrev=False)
    refuse_foreign_flags(parser, "kvpool-server", {"--port": "use --address HOST:PORT"})
    # kvpool-server --port 53220  ->  exit 2, "--port is not a kvpool-server flag; use --address HOST:PORT"
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

# vLLM's serving flags -> kvpool-server's equivalents (the server owns the pool vLLM would size itself).
VLLM_SERVER_FLAGS: Mapping[str, str] = {
    "--port": "use --address HOST:PORT (e.g. --address 127.0.0.1:{value})",
    "--host": "use --address HOST:PORT (e.g. --address {value}:50051)",
    "--gpu-memory-utilization": "use --gpu-memory-fraction F (the KV pool's share of the FREE GPU memory, not of the "
    "whole device), or --pool-bytes",
    "--max-model-len": "use --max-seq-len N",
    "--tensor-parallel-size": "use --tensor-parallel N",
    "--kv-cache-dtype": "use --dtype",
    "--num-gpu-blocks-override": "use --num-blocks N",
    "--swap-space": "use --host-tier-bytes (e.g. --host-tier-bytes 4GiB)",
}
# Flags of a server (kvpool-server's or vLLM's) given to a client tool.
CLIENT_TARGET_FLAGS: Mapping[str, str] = {
    "--port": "use --target HOST:PORT (e.g. --target 127.0.0.1:{value})",
    "--host": "use --target HOST:PORT (e.g. --target {value}:50051)",
    "--address": "use --target HOST:PORT (--address is kvpool-server's)",
}


class ForeignFlag(argparse.Action):
    """A flag of another tool: refused with a message naming the kvpool flag to use instead (``{value}`` in the
    hint: the value given, or its placeholder)."""

    def __init__(self, option_strings: list[str], dest: str, prog: str = "", hint: str = "", **kwargs: Any) -> None:
        self.prog, self.hint = prog, hint
        kwargs.update(nargs="?", help=argparse.SUPPRESS, default=argparse.SUPPRESS)
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        placeholder = (self.option_strings[0].lstrip("-").split("-")[-1]).upper()
        hint = self.hint.format(value=values if isinstance(values, str) and values else placeholder)
        parser.error(f"{option_string} is not a {self.prog} flag; {hint}")


def refuse_foreign_flags(parser: argparse.ArgumentParser, prog: str, flags: Mapping[str, str]) -> None:
    """Declare each of ``flags`` (flag -> what to use instead) on ``parser``, hidden, to be refused when given."""
    for flag, hint in flags.items():
        parser.add_argument(flag, action=ForeignFlag, prog=prog, hint=hint, dest="_foreign_" + flag.strip("-"))
