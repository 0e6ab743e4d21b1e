"""A frontend process for the session tests: it opens a session, builds some state, says READY on stdout, then does
what it is told until it is killed (or stopped).

    python tests/sessions/session_worker.py TARGET MODE [PARENT_SEQ_ID] [TTL_S]

MODE  idle     register 3 sequences with tokens, then sleep (its KeepAlive stream open)
      append   the same, then append a token to all of them in a loop (killed mid-AppendToken, most likely)
      fork     fork PARENT_SEQ_ID (another session's) 2 times and append to the children (copy-on-write), then sleep
      zombie   register 1 sequence, then wait for a line on stdin; then try an append and print its outcome
"""

from __future__ import annotations

import sys
import time

from kvpool_client import KVPoolClient, KVPoolClientError


def main() -> None:
    target, mode = sys.argv[1], sys.argv[2]
    parent = int(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3] != "-" else 0
    ttl = float(sys.argv[4]) if len(sys.argv) > 4 else None
    client = KVPoolClient(target, lease_ttl_s=ttl, client_name=f"worker-{mode}")
    if mode == "fork":
        seq_ids = client.fork(parent, 2)
        client.append(seq_ids, 3)
    else:
        seq_ids = [client.register() for _ in range(1 if mode == "zombie" else 3)]
        client.append(seq_ids, 20)
    print("READY", client.session_id, *seq_ids, flush=True)
    if mode == "append":
        while True:
            client.append(seq_ids, 1)
            if client.stats().num_blocks_free < 8:
                client.free(seq_ids)
                seq_ids = [client.register() for _ in range(3)]
    elif mode == "zombie":
        sys.stdin.readline()
        try:
            client.append(seq_ids, 1)
            print("APPLIED", flush=True)
        except KVPoolClientError as error:
            print("REFUSED", type(error).__name__, flush=True)
        return
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
