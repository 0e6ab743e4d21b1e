"""kvpool-token (issue 24.7): an empty input is refused, not hashed into a digest no client's token matches."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvpool_server.service.auth import hash_token

TOOL = [str(Path(sys.executable).with_name("kvpool-token"))]


def run(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(TOOL + list(args), input=stdin, capture_output=True, text=True, timeout=30)


def test_hash_refuses_an_empty_token():
    for result in (run("hash", stdin="\n"), run("hash", ""), run("hash", stdin="")):
        assert result.returncode == 2 and result.stdout == "" and "empty token" in result.stderr
    assert hash_token("") not in run("hash", stdin="\n").stdout


def test_hash_of_a_token_from_stdin_and_argv():
    assert run("hash", stdin="tok-a\n").stdout.strip() == hash_token("tok-a") == run("hash", "tok-a").stdout.strip()
    new = run("new").stdout.split()
    assert len(new) == 2 and hash_token(new[0]) == new[1]


def test_help_exits_0_and_says_what_each_command_does():
    for flag in ("--help", "-h"):
        result = run(flag)
        assert result.returncode == 0 and "kvpool-token new" in result.stdout and "sha256" in result.stdout
