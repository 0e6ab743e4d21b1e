"""kvpool-loadgen: many client processes driving one kvpool server like a serving frontend would.

workload.py  what to run: length distributions, per-request specs, the beam rule (pure, seeded)
pattern.py   the KV each token must hold, unique to (writer seq_id, position)
worker.py    one client process: register, prefill, batched decode steps, writes through attach(), verify, free
sampler.py   a thread polling Stats for the server's view of memory over time
metrics.py   series -> the summary (utilization, fragmentation, naive comparison, sharing, latency)
dashboard.py the progress bar and the final dashboard; plot.py the PNG
main.py      the CLI: spawn workers, collect, report
"""
