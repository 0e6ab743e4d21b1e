"""One log format (issue 35 item 4): gRPC C-core's own stderr lines come out through kvpool's logging (JSON under
--log-format json, logger grpc.core), rate-limited per source line, or are dropped where kvpool says it better
(the failed bind); other bytes written to fd 2 pass through. Real server processes."""

from __future__ import annotations

import io
import json
import logging
import socket
import subprocess

import grpc

from kvpool_client import KVPoolClient
from kvpool_server.core_log import MAX_LINE_BYTES, CoreLogCapture
from tests.conftest import server_command
from tests.security.certs import CA


def json_lines(text: str) -> list[dict]:
    lines = [line for line in text.splitlines() if line.strip()]
    parsed = []
    for line in lines:
        try:
            parsed.append(json.loads(line))
        except ValueError:
            raise AssertionError(f"not a JSON line: {line!r}\nall of it:\n{text}") from None
    return parsed


def test_a_busy_port_is_said_once_in_json(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run(server_command() + ["--address", f"127.0.0.1:{port}", "--backend", "host",
                                                 "--pool-bytes", "2MiB", "--log-format", "json"],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    records = json_lines(out.stderr + out.stdout)  # no raw "E1202 ... add_port.cc:83] Failed to add port" line
    assert not [r for r in records if r["logger"] == "grpc.core"]  # kvpool says it better:
    assert any(f"port {port} is in use" in r["msg"] for r in records)


def test_tls_handshake_lines_come_out_as_json_once_per_interval(server_factory, tmp_path):
    ca = CA("core-log CA")
    cert, key = ca.issue("kvpool-server", server=True)
    (tmp_path / "s.pem").write_bytes(cert)
    (tmp_path / "s.key").write_bytes(key)
    server = server_factory("--tls-cert", str(tmp_path / "s.pem"), "--tls-key", str(tmp_path / "s.key"),
                            "--log-format", "json", credentials=grpc.ssl_channel_credentials(ca.pem))
    for _ in range(3):  # plaintext to the TLS port: a failed handshake on the server each time
        try:
            with KVPoolClient(server.address, timeout=2, session=False) as kv:
                kv.stats()
        except Exception:  # noqa: BLE001  (ConnectionFailedError: what the client sees is tested elsewhere)
            pass
    assert server.stop() == 0
    core = [r for r in json_lines(server.log()) if r["logger"] == "grpc.core"]
    handshakes = [r for r in core if "Handshake failed" in r["msg"]]
    assert len(handshakes) == 1 and handshakes[0]["msg"].startswith("ssl_transport_security.cc:"), core


def test_emit_maps_levels_drops_what_kvpool_says_and_passes_the_rest(caplog):
    capture = CoreLogCapture()
    capture._real_stderr = io.StringIO()
    with caplog.at_level(logging.DEBUG, logger="grpc.core"):
        capture.emit("W1202 01:02:03.456789   123 chttp2_transport.cc:99] keepalive watchdog fired")
        capture.emit("E1202 01:02:03.456789   123 add_port.cc:83] Failed to add port to server: in use")
        capture.emit("Fatal Python error: Segmentation fault")
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "chttp2_transport.cc:99] keepalive watchdog fired")]
    assert capture._real_stderr.getvalue() == "Fatal Python error: Segmentation fault\n"
    assert MAX_LINE_BYTES == 8192
