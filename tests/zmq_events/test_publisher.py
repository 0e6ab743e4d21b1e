"""ZmqEventPublisher in process, over a core and its event feed: a queue that outgrows its bound, or a batch the
log lost, is restated (AllBlocksCleared, then every cached block) and never blocks the feed; blocks with an extra
key are withheld; a server without pyzmq starts unless the flag is given, and with it says what to install."""

from __future__ import annotations

import sys
import threading

import pytest

pytest.importorskip("zmq", reason="KV events on ZMQ need pyzmq (requirements/server.txt)")
pytest.importorskip("msgpack", reason="KV events on ZMQ need msgpack (requirements/server.txt)")
from kvpool_server.config import ConfigError, load_config  # noqa: E402
from kvpool_server.core import KVCacheManager  # noqa: E402
from kvpool_server.core.block_hash import chain_hashes  # noqa: E402
from kvpool_server.service.build import StartupError  # noqa: E402
from kvpool_server.service.events import EventFeed  # noqa: E402
from kvpool_server.zmq_events import start_publisher, tenant_models  # noqa: E402
from kvpool_server.zmq_events.channel import channel_endpoint, first_seq
from kvpool_server.zmq_events.publisher import ZmqEventPublisher  # noqa: E402
from kvpool_server.zmq_events.wire import TopicMap, engine_hash, model_mask  # noqa: E402
from tests.zmq_events.zmq_consumer import Subscriber, decode_like_llmd  # noqa: E402

BS = 16
MODEL = "m"


class Core:
    """A manager, its feed and lock, driven as the service does: each call under the lock, then publish."""

    def __init__(self, num_blocks: int = 64) -> None:
        self.manager = KVCacheManager(num_blocks, BS)
        self.feed = EventFeed(1, self.manager.allocator.cache, medium="GPU")
        self.lock = threading.Lock()

    def prefill(self, tokens: list[int], extra: bytes = b"") -> int:
        with self.lock:
            seq = self.manager.register(cache_extra_key=extra) if extra else self.manager.register()
            self.manager.append(seq, len(tokens), token_ids=tokens)
            self.feed.publish()
            self.manager.append(seq, 1, token_ids=[0])  # seals
            self.feed.publish()
        return seq


def publisher(core: Core, ipc_dir: str, max_queue_bytes: int = 1 << 20) -> ZmqEventPublisher:
    return ZmqEventPublisher(core.feed, core.lock, TopicMap("pod", {b"": MODEL}), endpoint=f"ipc://{ipc_dir}/pub",
                             connect=False, replay_endpoint=f"ipc://{ipc_dir}/replay", layout="array",
                             max_queue_bytes=max_queue_bytes, replay_batches=100, replay_bytes=1 << 20)


def keys(tokens: list[int]) -> list[int]:
    return [engine_hash(h, model_mask(MODEL)) for h in chain_hashes(tokens, BS)]


def test_a_queue_past_its_bound_is_dropped_and_the_cache_restated(ipc_dir) -> None:
    core = Core()
    pub = publisher(core, ipc_dir, max_queue_bytes=2000)  # about one batch of 32 token ids
    sub = Subscriber(f"ipc://{ipc_dir}/pub", f"ipc://{ipc_dir}/replay")
    pub._restate = False  # as if the start's restate was sent: offers queue
    core.feed.sinks.append(pub.offer)  # the thread is not running: nothing drains the queue
    prompts = [[1000 * k + i for i in range(2 * BS)] for k in range(6)]
    for prompt in prompts:
        core.prefill(prompt)
    assert pub.num_dropped > 0 and pub._restate and pub.queued_bytes <= 2000  # the feed never waited
    pub.check_invariants()
    pub._thread.start()
    messages = sub.recv_all()
    pub.stop()
    events = [e for m in messages for e in decode_like_llmd(m.payload)]
    assert events[0] == ("AllBlocksCleared",)
    assert sorted(h for e in events[1:] for h in e[1]) == sorted(h for p in prompts for h in keys(p))
    assert pub.num_restates == 1
    sub.close()


def test_a_batch_the_log_lost_is_restated(ipc_dir) -> None:
    core = Core()
    pub = publisher(core, ipc_dir)
    sub = Subscriber(f"ipc://{ipc_dir}/pub", f"ipc://{ipc_dir}/replay")
    pub.start()
    assert decode_like_llmd(sub.recv().payload) == [("AllBlocksCleared",)]  # type: ignore[union-attr]
    core.prefill(list(range(BS)))
    assert len(sub.recv_all()) == 1
    with core.lock:
        core.feed.log.next_seq += 1  # a call whose events outgrew the log: its number used, no batch
    core.prefill(list(range(100, 100 + BS)))
    events = [e for m in sub.recv_all() for e in decode_like_llmd(m.payload)]
    pub.stop()
    assert events[0] == ("AllBlocksCleared",)
    assert sorted(h for e in events[1:] for h in e[1]) == sorted(keys(list(range(BS))) + keys(list(range(100, 116))))
    sub.close()


def test_blocks_with_an_extra_key_are_withheld(ipc_dir) -> None:
    core = Core()
    pub = publisher(core, ipc_dir)
    sub = Subscriber(f"ipc://{ipc_dir}/pub", f"ipc://{ipc_dir}/replay")
    pub.start()
    assert decode_like_llmd(sub.recv().payload) == [("AllBlocksCleared",)]  # type: ignore[union-attr]
    core.prefill(list(range(2 * BS)), extra=b"lora:sql")
    core.prefill(list(range(BS)))
    messages = sub.recv_all()
    pub.stop()
    assert [e[1] for m in messages for e in decode_like_llmd(m.payload)] == [keys(list(range(BS)))]
    assert pub.wire.num_withheld == 2
    pub.check_invariants()
    sub.close()


def test_sequence_numbers_start_from_the_clock() -> None:
    assert first_seq(1_700_000_000.0) == 1_700_000_000_000 << 20
    assert first_seq(1_700_000_000.001) > first_seq(1_700_000_000.0) + 1000  # room for 2**20 batches a ms
    assert first_seq() < 2**63  # a signed 64-bit number for centuries to come


def test_a_socket_per_model_is_the_next_port_or_path() -> None:
    assert channel_endpoint("tcp://127.0.0.1:5557", 0) == "tcp://127.0.0.1:5557"
    assert channel_endpoint("tcp://127.0.0.1:5557", 2) == "tcp://127.0.0.1:5559"
    assert channel_endpoint("tcp://127.0.0.1:0", 2) == "tcp://127.0.0.1:0"  # any free port, each its own
    assert channel_endpoint("ipc:///run/kv/events", 1) == "ipc:///run/kv/events-1"
    assert channel_endpoint("", 3) == ""  # no replay socket


def test_without_pyzmq_the_flag_says_what_to_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "zmq", None)  # import zmq raises ImportError
    config = load_config(["--kv-events-publish", "ipc:///tmp/x", "--kv-events-model", "m"], {})
    with pytest.raises(StartupError, match="pip install pyzmq msgpack"):
        start_publisher(config, guard=None)  # type: ignore[arg-type]
    assert start_publisher(load_config([], {}), guard=None) is None  # type: ignore[arg-type]  # no flag: no import


@pytest.mark.parametrize(("argv", "message"), [
    (["--kv-events-publish", "tcp://0.0.0.0:5557", "--kv-events-model", "m"], "reachable from other hosts"),
    (["--kv-events-publish", "tcp://*:5557", "--kv-events-model", "m"], "reachable from other hosts"),
    (["--kv-events-publish", "tcp://127.0.0.1:5557"], "needs a model name"),
    (["--kv-events-publish", "udp://127.0.0.1:5557", "--kv-events-model", "m"], "tcp://HOST:PORT or ipc://PATH"),
    (["--kv-events-publish", "ipc:///tmp/x", "--kv-events-tenant-models", "a=m,b=m"], "of its own"),
    (["--kv-events-publish", "ipc:///tmp/x", "--kv-events-model", "m", "--kv-events-tenant-models", "a=m"],
     "of its own"),
    (["--kv-events-publish", "ipc:///tmp/x", "--kv-events-model", "m@x"], "no '@'"),
    (["--kv-events-publish", "ipc:///tmp/x", "--kv-events-tenant-models", "a"], "tenant=model"),
    (["--kv-events-replay", "ipc:///tmp/x"], "needs --kv-events-publish"),
    (["--kv-events-publish", "ipc:///tmp/x", "--kv-events-model", "m", "--kv-events-connect",
      "--kv-events-socket-per-model"], "one endpoint connected to"),
    (["--kv-events-publish", "ipc:///tmp/x", "--kv-events-model", "m", "--kv-events-pod", "a,b@c"], "no '@'"),
])
def test_settings_that_cannot_work_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(argv, {})


def test_insecure_allows_a_network_endpoint_and_tenants_map_to_salts() -> None:
    config = load_config(["--kv-events-publish", "tcp://*:5557", "--insecure", "--kv-events-model", "base",
                          "--kv-events-tenant-models", "acme=m-acme, beta=m-beta"], {})
    assert tenant_models(config) == {b"": "base", b"acme": "m-acme", b"beta": "m-beta"}


def test_the_replay_buffer_keeps_the_last_messages_within_its_bounds(ipc_dir) -> None:
    core = Core(num_blocks=512)
    pub = publisher(core, ipc_dir)  # replay_batches=100
    sub = Subscriber(f"ipc://{ipc_dir}/pub", f"ipc://{ipc_dir}/replay")
    pub.start()
    assert decode_like_llmd(sub.recv().payload) == [("AllBlocksCleared",)]  # type: ignore[union-attr]
    for k in range(120):
        core.prefill([10_000 + 16 * k + i for i in range(BS)])
    live = sub.recv_all()
    pub.check_invariants()
    replayed = sub.replay(0)
    pub.stop()
    assert len(live) == 120 and len(replayed) == 100  # the opening and the 20 oldest batches left it
    assert replayed == [(m.seq, m.payload) for m in live[-100:]]
    sub.close()


def test_an_endpoint_that_cannot_be_bound_stops_the_start_with_a_message(tmp_path) -> None:
    import subprocess

    from tests.conftest import server_command

    proc = subprocess.run([*server_command(), "--backend", "host", "--num-blocks", "8", "--address", "127.0.0.1:0",
                           "--kv-events-publish", f"ipc://{tmp_path}/no/such/dir/events", "--kv-events-model", "m"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "--kv-events-publish ipc://" in proc.stderr and "No such file or directory" in proc.stderr
