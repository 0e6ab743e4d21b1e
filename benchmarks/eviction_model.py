"""A model of the prefix cache at the trace's own 512-token blocks, to try eviction policies fast before building
one in the core (issue 34; docs/prefix-caching.md, Eviction policy, lists what was tried). Not the harness: that is
benchmarks/replay_trace.py, over the real core; this model's LRU matches it within 0.1 points (4.98% / 12.09% /
27.33% at 1,500 / 5,000 / 16,000 against the core's 4.98 / 12.09 / 27.33 at --block-size 512).

    python benchmarks/eviction_model.py TRACE POLICY CAPACITIES [key=value ...]
    python benchmarks/eviction_model.py trace.jsonl lru 1500,5000,16000
    python benchmarks/eviction_model.py trace.jsonl stats     # the reuse figures docs/prefix-caching.md quotes
    python benchmarks/eviction_model.py trace.jsonl lrfug 1500,5000,16000 hb=24000 g=4   # LRFU, a ghost of 4x

Policies (POLICIES): lru, gdsf, gdsfd, lrfu (half-life lam per request), lrfuc (hl x capacity or hb blocks), lrfug
(+ a ghost of g x capacity), lrfui (new blocks inherit beta x their parent's count), lrfua (first use counts a),
lrfut / lrfus (half-life k x a measured reuse distance), arc. Each request: the longest resident run of its full
blocks is its hit (the last token recomputed), then all its full blocks are used (parked tail first).
"""

import heapq
import json
import sys
import math
from collections import OrderedDict


def load(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def run(reqs, cap, policy, **kw):
    # state: resident set; policy object
    P = POLICIES[policy](cap, **kw)
    hit = tot = 0
    for t, r in enumerate(reqs):
        ids = r["hash_ids"]
        L = r["input_length"]
        nfull = L // 512
        reusable = (L - 1) // 512
        k = 0
        while k < reusable and ids[k] in P.res:
            k += 1
        hit += k * 512
        tot += L
        full = ids[:nfull]
        P.access(full, k, t)
    return hit / tot


class LRU:
    def __init__(self, cap):
        self.cap = cap
        self.res = OrderedDict()

    def access(self, blocks, k, t):
        # in use: all blocks of the request. new blocks need room
        for b in blocks:
            self.res.pop(b, None)
        # evict from the LRU (excluding in-use: they are popped)
        need = len(self.res) + len(blocks) - self.cap
        while need > 0 and self.res:
            self.res.popitem(last=False)
            need -= 1
        for b in reversed(blocks):
            self.res[b] = None  # tail parked first -> oldest
        # head is newest


class Heap:
    """priority policy: evict min key; lazy heap."""

    def __init__(self, cap, **kw):
        self.cap = cap
        self.res = {}
        self.heap = []
        self.kw = kw
        self.L = 0.0
        self.freq = {}
        self.last = {}
        self.depth = {}
        self.seq = 0

    def key(self, b, d, t):
        raise NotImplementedError

    def access(self, blocks, k, t):
        for b in blocks:
            self.res.pop(b, None)
        need = len(self.res) + len(blocks) - self.cap
        while need > 0 and self.heap:
            pr, s, b = heapq.heappop(self.heap)
            if self.res.get(b) != s:
                continue
            del self.res[b]
            self.L = max(self.L, pr[0] if isinstance(pr, tuple) else pr)
            need -= 1
            self.on_evict(b)
        n = len(blocks)
        for d in range(n - 1, -1, -1):
            b = blocks[d]
            self.freq[b] = self.freq.get(b, 0) + 1
            self.seq += 1
            pr = self.key(b, d, t, n)
            self.res[b] = self.seq
            heapq.heappush(self.heap, (pr, self.seq, b))
            self.last[b] = t
        if len(self.heap) > 4 * self.cap + 1000:
            self.heap = [(p, s, b) for p, s, b in self.heap if self.res.get(b) == s]
            heapq.heapify(self.heap)

    def on_evict(self, b):
        if not self.kw.get("keepfreq", True):
            self.freq.pop(b, None)


class GDSF(Heap):  # L + freq
    def key(self, b, d, t, n):
        return self.L + self.freq[b] * self.kw.get("w", 1.0)


class GDSFd(Heap):  # L + freq * depth weight
    def key(self, b, d, t, n):
        return self.L + self.freq[b] * self.kw.get("w", 1.0) + self.kw.get("dw", 0.0) / (d + 1)


class LRFU(Heap):  # CRF with decay
    def __init__(self, cap, **kw):
        super().__init__(cap, **kw)
        self.crf = {}

    def key(self, b, d, t, n):
        lam = self.kw.get("lam", 0.001)
        c, lt = self.crf.get(b, (0.0, t))
        c = 1.0 + c * math.pow(0.5, lam * (t - lt))
        self.crf[b] = (c, t)
        # compare in log-time space: score = log2(c) + lam * t (monotone equivalent of c*2^(lam*t))
        return math.log2(c) + lam * t


POLICIES = {"lru": LRU, "gdsf": GDSF, "gdsfd": GDSFd, "lrfu": LRFU}


class LRFUc(Heap):
    """CRF, time in blocks accessed, half-life hl * capacity (or absolute hb blocks)"""

    def __init__(self, cap, **kw):
        super().__init__(cap, **kw)
        self.crf = {}
        self.clock = 0
        self.lam = 1.0 / (kw["hl"] * cap) if "hl" in kw else 1.0 / kw["hb"]

    def access(self, blocks, k, t):
        super().access(blocks, k, t)
        self.clock += len(blocks)

    def key(self, b, d, t, n):
        t = self.clock
        lam = self.lam
        c, lt = self.crf.get(b, (0.0, t))
        c = 1.0 + c * math.pow(0.5, lam * (t - lt))
        self.crf[b] = (c, t)
        return math.log2(c) + lam * t


POLICIES["lrfuc"] = LRFUc


class LRFUg(LRFUc):
    """CRF kept for evicted blocks in a bounded ghost FIFO of g*cap entries (g=0: none)"""

    def __init__(self, cap, **kw):
        super().__init__(cap, **kw)
        self.ghost = OrderedDict()
        self.g = int(kw.get("g", 1) * cap)

    def on_evict(self, b):
        self.ghost[b] = None
        while len(self.ghost) > self.g:
            old, _ = self.ghost.popitem(last=False)
            if old not in self.res:
                self.crf.pop(old, None)

    def key(self, b, d, t, n):
        self.ghost.pop(b, None)
        return super().key(b, d, t, n)


POLICIES["lrfug"] = LRFUg


class ARC:
    def __init__(self, cap, **kw):
        self.c = cap
        self.p = 0.0
        self.T1 = OrderedDict()
        self.T2 = OrderedDict()
        self.B1 = OrderedDict()
        self.B2 = OrderedDict()
        self.res = {}

    def _replace(self, inB2):
        if self.T1 and (len(self.T1) > self.p or (inB2 and len(self.T1) == self.p)):
            b, _ = self.T1.popitem(last=False)
            self.B1[b] = None
        elif self.T2:
            b, _ = self.T2.popitem(last=False)
            self.B2[b] = None
        else:
            b, _ = self.T1.popitem(last=False)
            self.B1[b] = None
        del self.res[b]

    def access(self, blocks, k, t):
        for b in reversed(blocks):
            c = self.c
            if b in self.T1 or b in self.T2:
                self.T1.pop(b, None)
                self.T2.pop(b, None)
                self.T2[b] = None
                continue
            if b in self.B1:
                self.p = min(c, self.p + max(len(self.B2) / max(1, len(self.B1)), 1))
                self._replace(False)
                del self.B1[b]
                self.T2[b] = None
                self.res[b] = 1
                continue
            if b in self.B2:
                self.p = max(0, self.p - max(len(self.B1) / max(1, len(self.B2)), 1))
                self._replace(True)
                del self.B2[b]
                self.T2[b] = None
                self.res[b] = 1
                continue
            L1 = len(self.T1) + len(self.B1)
            if L1 == c:
                if len(self.T1) < c:
                    self.B1.popitem(last=False)
                    self._replace(False)
                else:
                    b0, _ = self.T1.popitem(last=False)
                    del self.res[b0]
            elif L1 < c and L1 + len(self.T2) + len(self.B2) >= c:
                if L1 + len(self.T2) + len(self.B2) == 2 * c:
                    self.B2.popitem(last=False)
                self._replace(False)
            self.T1[b] = None
            self.res[b] = 1


POLICIES["arc"] = ARC


class LRFUi(LRFUg):
    """new blocks inherit beta * their parent's CRF (a conversation's new turn is as alive as its past)"""

    def access(self, blocks, k, t):
        self.blocks = blocks
        super().access(blocks, k, t)

    def key(self, b, d, t, n):
        self.ghost.pop(b, None)
        t = self.clock
        lam = self.lam
        if b in self.crf:
            c, lt = self.crf[b]
            c = 1.0 + c * math.pow(0.5, lam * (t - lt))
        else:
            c = 1.0
            if d > 0:
                pc, plt = self.crf.get(self.blocks[d - 1], (0.0, t))
                c = max(1.0, self.kw.get("beta", 1.0) * pc * math.pow(0.5, lam * (t - plt)))
        self.crf[b] = (c, t)
        return math.log2(c) + lam * t


POLICIES["lrfui"] = LRFUi


class LRFUa(LRFUg):
    def key(self, b, d, t, n):
        self.ghost.pop(b, None)
        t = self.clock
        lam = self.lam
        if b in self.crf:
            c, lt = self.crf[b]
            c = 1.0 + c * math.pow(0.5, lam * (t - lt))
        else:
            c = self.kw["a"]
        self.crf[b] = (c, t)
        return math.log2(c) + lam * t


POLICIES["lrfua"] = LRFUa


class LRFUt(Heap):
    """rank in time: t + H*log2(count); H = k * geometric-mean deepest reuse gap (EMA of log2), ghost g*cap"""

    def __init__(self, cap, **kw):
        super().__init__(cap, **kw)
        self.st = {}
        self.clock = 0
        self.ghost = OrderedDict()
        self.g = int(kw.get("g", 4) * cap)
        self.lg = math.log2(kw.get("h0", 1000))
        self.k = kw.get("k", 2.5)
        self.a = kw.get("a", 0.01)

    def access(self, blocks, k, t):
        now = self.clock
        for b in blocks:
            s = self.st.get(b) or self.ghost.get(b)
            if s is not None:
                self.lg += self.a * (math.log2(max(1, now - s[1])) - self.lg)
        self.H = self.k * 2**self.lg
        super().access(blocks, k, t)
        self.clock += len(blocks)

    def on_evict(self, b):
        self.ghost[b] = self.st.pop(b)
        while len(self.ghost) > self.g:
            self.ghost.popitem(last=False)

    def key(self, b, d, t, n):
        now = self.clock
        H = self.H
        s = self.st.pop(b, None) or self.ghost.pop(b, None)
        if s is None:
            r = now
        else:
            x = (s[0] - now) / H
            r = now + H * math.log2(1 + 2**x) if x > -60 else now
        self.st[b] = (r, now)
        return r


POLICIES["lrfut"] = LRFUt


class LRFUs(LRFUt):
    """like LRFUt, but the gap from a sampled long memory: hashes with b % R == 0, last use kept (bounded S)"""

    def __init__(self, cap, **kw):
        super().__init__(cap, **kw)
        self.R = int(kw.get("R", 1))
        self.S = int(kw.get("S", 10**9))
        self.mem = OrderedDict()

    def access(self, blocks, k, t):
        now = self.clock
        for b in blocks:
            if b % self.R == 0:
                last = self.mem.pop(b, None)
                if last is not None:
                    self.lg += self.a * (math.log2(max(1, now - last)) - self.lg)
                self.mem[b] = now
                while len(self.mem) > self.S:
                    self.mem.popitem(last=False)
        self.H = self.k * 2**self.lg
        Heap.access(self, blocks, k, t)
        self.clock += len(blocks)


POLICIES["lrfus"] = LRFUs

def reuse_stats(reqs):
    """The trace's reuse figures (docs/prefix-caching.md): how often a block used k times is used again, and how
    many blocks of traffic come between a request and the last use of its deepest block seen before."""
    from collections import Counter

    uses = Counter(b for r in reqs for b in r["hash_ids"][: r["input_length"] // 512])
    at_least = Counter()
    for n in uses.values():
        for k in range(1, n + 1):
            at_least[k] += 1
    print(f"distinct blocks {len(uses)}, used once {100 * (at_least[1] - at_least[2]) / at_least[1]:.0f}%")
    for k in (1, 2, 3):
        print(f"a block used {k}x is used again: {100 * at_least[k + 1] / at_least[k]:.0f}%")
    last, clock, gaps = {}, 0, []
    for r in reqs:
        ids = r["hash_ids"][: r["input_length"] // 512]
        k = 0
        while k < len(ids) and ids[k] in last:
            k += 1
        if k >= 2:
            gaps.append(clock - last[ids[k - 1]])
        for b in ids:
            last[b] = clock
        clock += len(ids)
    gaps.sort()
    print("blocks of traffic before a reuse: " + ", ".join(f"p{q} {gaps[len(gaps) * q // 100]}" for q in (10, 50, 90)))


if __name__ == "__main__":
    reqs = load(sys.argv[1])
    pol = sys.argv[2]
    if pol == "stats":
        reuse_stats(reqs)
        sys.exit(0)
    kw = {k: float(v) for k, v in (a.split("=") for a in sys.argv[4:])}
    for cap in map(int, sys.argv[3].split(",")):
        print(pol, kw, cap, f"{100 * run(reqs, cap, pol, **kw):.2f}%", flush=True)
