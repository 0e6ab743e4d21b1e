"""No kvpool command line takes an abbreviated flag, and the flags a vLLM user types by habit name kvpool's own
(issue 30, item 12: ``kvpool-server --port 53220`` silently meant ``--port-file 53220``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvpool_client.kvctl import build_parser as kvctl_parser
from kvpool_client.loadgen.args import build_parser as loadgen_parser
from kvpool_server.config import build_parser as server_parser
from tests.conftest import server_command


def refusal(parser, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_kvpool_server_dash_dash_port_is_refused_naming_address_and_writes_no_file(tmp_path: Path):
    done = subprocess.run([*server_command(), "--backend", "host", "--pool-bytes", "2MiB", "--port", "53220"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "--port is not a kvpool-server flag; use --address HOST:PORT (e.g. --address 127.0.0.1:53220)" in \
        done.stderr
    assert not (tmp_path / "53220").exists()  # once, it was the port file


@pytest.mark.parametrize("argv, hint", [
    (["--host", "0.0.0.0"], "--host is not a kvpool-server flag; use --address HOST:PORT"),
    (["--gpu-memory-utilization", "0.9"], "use --gpu-memory-fraction F"),
    (["--max-model-len=4096"], "--max-model-len is not a kvpool-server flag; use --max-seq-len N"),
    (["--tensor-parallel-size", "2"], "use --tensor-parallel N"),
])
def test_vllm_flags_name_the_server_flag_to_use(argv, hint, capsys):
    assert hint in refusal(server_parser(), argv, capsys)


@pytest.mark.parametrize("parser, argv", [
    (server_parser, ["--pool-b", "1MiB"]),
    (server_parser, ["--port-f", "x"]),
    (server_parser, ["--tensor-par", "2"]),
    (kvctl_parser, ["--tim=3", "stats"]),
    (kvctl_parser, ["stats", "--tim", "3"]),  # a subcommand's own parser
    (kvctl_parser, ["events", "--from", "3"]),
    (kvctl_parser, ["top", "--iter", "1"]),
    (loadgen_parser, ["--proc", "3"]),
    (loadgen_parser, ["--complet", "3"]),
])
def test_no_cli_takes_a_prefix_of_a_flag(parser, argv, capsys):
    assert "unrecognized arguments" in refusal(parser(), argv, capsys)


@pytest.mark.parametrize("parser, argv, hint", [
    (kvctl_parser, ["--port", "50051", "stats"], "--port is not a kvctl flag; use --target HOST:PORT"),
    (kvctl_parser, ["stats", "--address", "h:1"], "--address is not a kvctl flag; use --target HOST:PORT"),
    (loadgen_parser, ["--host", "h"], "--host is not a kvpool-loadgen flag; use --target HOST:PORT (e.g. --target "
                                      "h:50051)"),
])
def test_client_tools_name_target_for_server_flags(parser, argv, hint, capsys):
    assert hint in refusal(parser(), argv, capsys)


def test_full_flags_still_parse():
    assert server_parser().parse_args(["--port-file", "p", "--address", "127.0.0.1:0"]).port_file == "p"
    assert kvctl_parser().parse_args(["stats", "--timeout", "3"]).timeout == 3.0
    assert loadgen_parser().parse_args(["--processes", "3"]).processes == 3


def test_kvpool_token_takes_only_its_words():
    done = subprocess.run([sys.executable, "-m", "kvpool_server.service.auth", "--port", "1"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "usage: kvpool-token hash TOKEN | kvpool-token new" in done.stderr
