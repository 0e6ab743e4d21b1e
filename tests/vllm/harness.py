"""Real processes for the vLLM tests: vLLM engines (engine_driver.py) and a kvpool server that can be SIGKILLed and
started again on the same unix socket, with a tokens file of three tenants (gamma with a small max_blocks)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.conftest import server_command, wait_serving
from tests.vllm.engine_driver import REPLY_MARK
from tests.vllm.tiny_model import server_layout_args

ENGINE_START_TIMEOUT_S = 600.0  # two cores, several engines starting together
DRIVER = Path(__file__).with_name("engine_driver.py")
ROOT = Path(__file__).resolve().parents[2]
TENANTS = ("alpha", "beta", "gamma")
QUOTA_BLOCKS = 12  # gamma's max_blocks: a prompt of 13 full blocks or more cannot be stored
LIMITS = {"gamma": [f"max_blocks = {QUOTA_BLOCKS}"]}


class Engine:
    """One engine_driver.py process; ``ask`` sends a request and waits for its answer."""

    def __init__(self, name: str, model: Path, workdir: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log_path = workdir / f"engine-{name}.log"
        proc_env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", VLLM_LOGGING_LEVEL="INFO")
        proc_env.update(env or {})
        self._log = open(self.log_path, "w")  # noqa: SIM115  (closed in stop())
        self.proc = subprocess.Popen([sys.executable, str(DRIVER), str(model), *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True, env=proc_env,
                                     cwd=str(ROOT), start_new_session=True)
        self._lock = threading.Lock()
        self._ready = False

    def wait_ready(self) -> None:
        if not self._ready:
            reply = self._read(ENGINE_START_TIMEOUT_S)
            assert reply.get("ready"), reply
            self._ready = True

    def _read(self, timeout: float) -> dict:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"engine {self.name} exited ({self.proc.poll()}):\n{self.log()[-6000:]}")
            if line.startswith(REPLY_MARK):
                return json.loads(line[len(REPLY_MARK):])
        raise TimeoutError(f"engine {self.name}: no answer in {timeout} s")

    def ask(self, request: dict, timeout: float = 600.0) -> dict:
        self.wait_ready()
        with self._lock:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            return self._read(timeout)

    def generate(self, prompts: list[list[int]], max_tokens: int = 8) -> dict:
        return self.ask({"op": "generate", "prompts": prompts, "max_tokens": max_tokens})

    def start(self, prompts: list[list[int]], max_tokens: int, tokens: int) -> int:
        """Add the requests and step until each has ``tokens`` output tokens; they stay running (nothing steps
        them) until ``finish``. Needs an engine started with VLLM_ENABLE_V1_MULTIPROCESSING=0. Returns the steps."""
        reply = self.ask({"op": "start", "prompts": prompts, "max_tokens": max_tokens, "tokens": tokens})
        assert "error" not in reply, reply
        return reply["steps"]

    def finish(self) -> dict:
        """Step the requests ``start`` left running to their end: the answer of ``generate``."""
        return self.ask({"op": "finish"})

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


class KVPoolServer:
    """kvpool-server on ``socket`` (host pool in the tiny model's layout), with the tenants' tokens file."""

    def __init__(self, workdir: Path, socket: str, num_blocks: int = 2048) -> None:
        self.workdir = workdir
        self.socket = socket
        self.address = f"unix:{socket}"
        self.num_blocks = num_blocks
        self.tokens_file = workdir / "tokens.toml"
        self.token_files = {t: workdir / f"token-{t}" for t in TENANTS}
        lines = []
        for tenant in TENANTS:
            token = f"token-of-{tenant}-{os.getpid()}"
            self.token_files[tenant].write_text(token + "\n")
            self.token_files[tenant].chmod(0o600)
            lines += [f"[tenants.{tenant}]", "may_attach = true", *LIMITS.get(tenant, []), ""]
            lines += ["[[tokens]]", f'sha256 = "{hashlib.sha256(token.encode()).hexdigest()}"',
                      f'tenant = "{tenant}"', ""]
        self.tokens_file.write_text("\n".join(lines))
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        if os.path.exists(self.socket):
            os.unlink(self.socket)
        self.starts += 1
        log = open(self.workdir / f"kvpool-{self.starts}.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            server_command() + ["--backend", "host", "--num-blocks", str(self.num_blocks), "--unix-socket",
                                self.socket, "--address", "", "--auth-tokens", str(self.tokens_file),
                                *server_layout_args()],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        log.close()
        wait_serving(self.address, self.proc)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()

    def client(self, tenant: str = "alpha"):
        from kvpool_client import KVPoolClient

        token = self.token_files[tenant].read_text().strip()
        return KVPoolClient(self.address, token=token, timeout=10.0)


def wait_for(predicate, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not reached in {timeout} s")
        time.sleep(0.1)
