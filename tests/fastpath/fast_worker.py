"""A frontend process for the fast-path tests: opens a session and its fast-path channel, registers 3 sequences,
says READY on stdout, then does what MODE says.

    python tests/fastpath/fast_worker.py TARGET MODE [TTL_S]

MODE  append   append a token to its sequences in a loop, over the channel (killed mid-record, most likely)
      step     step records in a loop -- a Free, an append with token ids and a register of prompts each
      zombie   wait for a line on stdin; then try an append and print APPLIED or REFUSED <exception class>
"""

from __future__ import annotations

import sys

from kvpool_client import KVPoolClient, KVPoolClientError


def main() -> None:
    target, mode = sys.argv[1], sys.argv[2]
    ttl = float(sys.argv[3]) if len(sys.argv) > 3 else None
    client = KVPoolClient(target, lease_ttl_s=ttl, client_name=f"fast-{mode}")
    seq_ids = [client.register() for _ in range(3)]
    client.append(seq_ids, 20)
    assert client.fast_path_open, "the channel did not open"
    print("READY", client.session_id, *seq_ids, flush=True)
    if mode == "append":
        while True:
            client.append(seq_ids, 1)
            if client.stats().num_blocks_free < 8:
                client.free(seq_ids)
                seq_ids = [client.register() for _ in range(3)]
    elif mode == "step":
        prompts = [list(range(3, 3 + 70)), list(range(5, 5 + 40))]
        while True:
            result = client.step(free=seq_ids[:1], append=(seq_ids[1:], [1] * len(seq_ids[1:]), [7] * len(seq_ids[1:])),
                                 register=(prompts, []))
            seq_ids = seq_ids[1:] + [r.seq_id for r in result.value("registered")]
    elif mode == "zombie":
        sys.stdin.readline()
        try:
            client.append(seq_ids, 1)
            print("APPLIED", flush=True)
        except KVPoolClientError as error:
            print("REFUSED", type(error).__name__, flush=True)


if __name__ == "__main__":
    main()
