#!/usr/bin/env bash
# Every GPU check of kvpool in one call to the lent H200 (the `run` tool of this workplace):
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=600)
# .whl holds the pure-Python wheels the GPU image lacks (grpcio-health-checking, grpcio-reflection, both matching
# its grpcio 1.84.0 / protobuf 7.36.2; liger-kernel, the engine's elementwise kernels), fetched here once with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 -d .whl grpcio-health-checking==1.84.0 grpcio-reflection==1.84.0 \
#     liger-kernel==0.8.5
# Logs go to $OUT; docs/results.md quotes them.
set -o pipefail
OUT=${OUT:-/tmp/kvpool-gpu-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/server:$PWD/common:$PWD/client PYTHONUNBUFFERED=1
status=0
only=${1:-all}  # "device": only the first step (copy kernel); "validate": everything but the benchmarks;
                # "bench": only the benchmarks; "client": demo, beam, attach; "datapath": issue 14;
                # "prefix": issue 13; "layers": issues 19 and 20 (service layer before/after, clearing blocks);
                # "engine": issue 22 (torch ops, the decode engine on the pool, bench_engine.py) and issue 32 (below)
                # "engine-prefix": issue 32 alone (the engines on the prefix cache: tests, bench_ttft.py)
                # "tp": issue 26 (tensor-parallel shards: GPU tests, the TP engine, loadgen, decode step, copy bandwidth)
                # "tier": issue 23 (the host tier: GPU tests, offload/restore vs pinned memcpy, hit rates)
                # "fast": issue 21 (the fast path's tests and benchmarks, the core against vLLM's BlockPool)
                # "vllm": issue 31 (the vLLM connector's CUDA data path, without vLLM: bench_vllm_gpu.py)
step() { echo; echo "=== $1"; shift; "$@" || { echo "=== FAILED: $*"; status=1; }; }

nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
python3 -c "import sys, grpc, google.protobuf as p, cupy, numpy; print(sys.version.split()[0], 'grpcio', grpc.__version__, 'protobuf', p.__version__, 'cupy', cupy.__version__, 'numpy', numpy.__version__)"

service_benches() {  # BENCH_SPECS: transport[:pin[=SERVER_CPU,CLIENT_CPU]] ..., e.g. "unix tcp unix:pin=6,7"
    for spec in ${BENCH_SPECS:-unix tcp unix:pin=6,7}; do
        transport=${spec%%:*}; pin=""; [ "$spec" != "$transport" ] && pin="--${spec#*:}"
        step "service benchmark over $transport $pin, server on the GPU backend" \
            bash -c "set -o pipefail; timeout 240 python3 benchmarks/bench_service.py --no-naive --rounds ${BENCH_ROUNDS:-2} --duration 3 \
                --kinds echo,echo-aio,kvpool,echo-stream,echo-aio-stream,kvpool-stream --transport $transport $pin -- --backend gpu 2>&1 \
                | tee $OUT/bench_service_gpu_${transport}${pin:+_pin}.log"
    done
}
core_bench() {
    step "core benchmark (in-process, one core of the H200 host)" \
        bash -c "set -o pipefail; taskset -c 2 python3 benchmarks/bench_core.py --seconds 2 2>&1 | tee $OUT/bench_core_h200.log"
}
if [ "$only" = bench ]; then
    [ -n "$SKIP_CORE" ] || core_bench
    service_benches
    echo "=== gpu_check status $status"; exit $status
fi
if [ "$only" = prefix ]; then  # issue 13: prefix caching on GPU memory, KV events, AppendToken before/after
    # carry=[".whl", ".gpuwork/before"]: .gpuwork/before = `git archive 8579de5 server common` (the tree before
    # prefix caching), for the service benchmark's kvpool-before kinds.
    gpu_loadgen() {  # name, loadgen args: a GPU server (512 MiB pool), loadgen processes attached by CUDA IPC
        name=$1; shift; sock=/tmp/kvp-gpu-$name.sock; rm -f $sock
        python3 -m kvpool_server --backend gpu --pool-bytes 512MiB --unix-socket $sock --address "" --log-level WARNING & spid=$!
        for _ in $(seq 100); do [ -S $sock ] && break; sleep 0.2; done
        timeout ${T_LOADGEN:-150} python3 -m kvpool_client.loadgen.main --target unix:$sock --no-progress --json $OUT/$name.json "$@" 2>&1 | tee $OUT/$name.log
        rc=$?; kill $spid; wait $spid; return $rc
    }
    SP="--workload shared-prefix --num-prompts 4 --shared-tokens 8000 --unique-tokens 1000 -p 4 -c 8"
    step "shared-prefix, 4 processes, GPU pool, KV verified through CUDA IPC" gpu_loadgen shared_prefix_gpu $SP -n ${N_SP:-600}
    step "beam width 4 over the cached prompt, GPU pool" gpu_loadgen beam_prefix_gpu $SP -n 32 --mode beam --beam-width 4
    step "chat, 6 turns, GPU pool" gpu_loadgen chat_gpu --workload chat --turns 6 --turn-tokens 200 -p 4 -c 8 -n 32
    step "KV events to a subscriber (bench_events, 10 s)" \
        bash -c "set -o pipefail; timeout 90 python3 benchmarks/bench_events.py --seconds 10 2>&1 | tee $OUT/bench_events.log"
    if [ -d .gpuwork/before ]; then
        step "AppendToken without token ids: this tree against the tree before prefix caching (unix, pinned)" \
            bash -c "set -o pipefail; timeout 300 python3 benchmarks/bench_service.py --no-naive --rounds ${BENCH_ROUNDS:-3} --duration 3 \
                --kinds echo-aio,kvpool,kvpool-stream --before .gpuwork/before --transport unix --pin=6,7 2>&1 | tee $OUT/bench_service_before_after.log"
    fi
    grep -h "token hit rate\|resident copies\|KV verification\|result:\|beam over" $OUT/*_gpu.log
    echo "=== gpu_check status $status"; exit $status
fi
if [ "$only" = tier ]; then  # issue 23: the prefix cache's host tier (pinned host memory) on the H200
    step "GPU tests of the host tier (GpuTierPool round trips, write-back tickets, failure hook; the service's and the
          loadgen's tier tests over a GPU pool: restores read back the same KV, failed copies are misses)" \
        bash -c "set -o pipefail; KVPOOL_TEST_BACKEND=gpu timeout ${T_TESTS:-240} python3 -m pytest -q -p no:cacheprovider -rs -s \
            tests/offload/test_tier_pool.py tests/offload/test_tier_copy_totals.py tests/offload/test_service_host_tier.py \
            tests/offload/test_tier_restore_unlocked.py tests/offload/test_tier_writeback_holds.py \
            tests/loadgen/test_loadgen_host_tier.py 2>&1 | tee $OUT/tier_tests.log"
    step "start-up with a 64 GiB host tier: SERVING, then the tier pinned in the background (Stats' bytes ready)" \
        bash -c "set -o pipefail; timeout ${T_STARTUP:-240} python3 benchmarks/bench_tier_startup.py --backend gpu \
            --host-tier-bytes ${TIER_STARTUP_BYTES:-64GiB} --timeout 200 --json $OUT/tier_startup.json 2>&1 | tee $OUT/tier_startup.log"
    step "offload / restore GB/s against a plain pinned memcpy, Llama-3-8B layout (2 MiB blocks); AppendToken p50/p99 under churn with / without the tier; hit rates" \
        bash -c "set -o pipefail; timeout ${T_BENCH:-300} python3 benchmarks/bench_tier.py --backend gpu 2>&1 | tee $OUT/bench_tier.log"
    step "AppendToken p50/p99 under churn of 24 recurring prompts (restores from the tier beside the offloads)" \
        bash -c "set -o pipefail; timeout ${T_BENCH:-300} python3 benchmarks/bench_tier.py --backend gpu --sections append --churn-prompts 24 2>&1 | tee $OUT/bench_tier_restores.log"
    tier_loadgen() {  # name, server args: a GPU server (8 MiB pool: 1,024 blocks of 16 tokens), loadgen over CUDA IPC,
                      # KV verified; 32 shared prompts of 2,000 tokens = 4,000 blocks, 4x the pool
        name=$1; shift; sock=/tmp/kvp-tier-$name.sock; rm -f $sock
        python3 -m kvpool_server --backend gpu --pool-bytes 8MiB --unix-socket $sock --address "" --log-level WARNING "$@" & spid=$!
        for _ in $(seq 100); do [ -S $sock ] && break; sleep 0.2; done
        timeout ${T_LOADGEN:-150} python3 -m kvpool_client.loadgen.main --target unix:$sock --no-progress --json $OUT/$name.json \
            --workload shared-prefix --num-prompts 32 --shared-tokens 2000 --unique-tokens 100 -p 2 -c 4 -n ${N_SP:-400} 2>&1 | tee $OUT/$name.log
        rc=$?; kill $spid; wait $spid; return $rc
    }
    step "shared prompts 4x the GPU pool, GPU pool only" tier_loadgen tier_off
    step "the same with a 64 MiB host tier (every prompt fits)" tier_loadgen tier_on --host-tier-bytes 64MiB
    grep -h "token hit rate\|KV verification" $OUT/tier_off.log $OUT/tier_on.log
    echo "=== gpu_check status $status"; exit $status
fi
if [ "$only" = fast ]; then  # issue 21: the fast path on the H200 host (tests, the step, scaling, the core vs vLLM)
    # carry=[".whl", ".vllm-src"]: .vllm-src = `scripts/extract_vllm_core.sh <vllm wheel or git dir> .vllm-src` (the
    # vLLM comparison is skipped without it). About 4 minutes.
    step "the fast path's tests on the H200 host (hostile records, crash cases, idle CPU, the 4-process KV-verified run)" \
        bash -c "set -o pipefail; timeout ${T_TESTS:-200} python3 -m pytest -q -p no:cacheprovider -rs tests/fastpath 2>&1 | tee $OUT/fastpath_tests.log"
    step "the 256-sequence step: unary, stream, fast path, fast path with token ids (unix, pinned, GPU pool)" \
        bash -c "set -o pipefail; timeout 200 python3 benchmarks/bench_service.py --pin 2,3 --transport unix --rounds 2 --duration 3 \
            --no-naive --clients 2 --kinds kvpool,kvpool-stream,kvpool-fast,kvpool-fast-tokens -- --backend gpu 2>&1 | tee $OUT/fast_service.log"
    step "P frontend processes x 64 sequences over the fast path, Health under load, 64 idle channels" \
        bash -c "set -o pipefail; timeout 150 python3 benchmarks/bench_fastpath.py --pin 2 --procs 1,4,16 --seqs 64 --duration 4 \
            --idle 64 --idle-s 10 2>&1 | tee $OUT/fastpath.log"
    step "the core's decode step, one core (no token ids / token ids)" \
        bash -c "for f in '' --token-ids; do taskset -c 2 python3 benchmarks/decode_step.py \$f; done 2>&1 | tee $OUT/decode_step.log"
    if [ -d .vllm-src ]; then
        step "the core's whole cycle (register, prefill, decode, free) vs vLLM v1's BlockPool, caching on + off, one core" \
            bash -c "for d in 16 128; do taskset -c 2 python3 benchmarks/bench_vs_vllm.py --vllm-src .vllm-src --decode-steps \$d \
                --json $OUT/vs_vllm_d\$d.json; done 2>&1 | tee $OUT/vs_vllm.log"
    fi
    echo "=== gpu_check status $status"; exit $status
fi
if [ "$only" = layers ]; then  # issues 19 + 20: the service layer before/after, clearing blocks, the GPU tests
    # carry=[".whl", ".gpuwork"]: .gpuwork/before = `git archive 007e014 server common` (before the service layer).
    B=$PWD/.gpuwork/before; BEFORE="PYTHONPATH=/tmp/site:$B/server:$B/common:$PWD/client"
    step "GPU tests: pool ops, zero_blocks, copy kernel, client kernels (block-major and layer-major)" \
        bash -c "set -o pipefail; KVPOOL_TEST_BACKEND=gpu timeout ${T_TESTS:-200} python3 -m pytest -q -p no:cacheprovider -rs \
            tests/device/test_device_pool_ops.py tests/device/test_device_gpu.py tests/device/test_device_zero.py \
            tests/client/test_kernels_gpu.py tests/security/test_stale_kv.py 2>&1 | tee $OUT/layers_tests.log"
    step "decode step of the core, 256 sequences: before / after, alternating, one core" \
        bash -c "for i in 1 2 3; do env $BEFORE taskset -c 2 python3 benchmarks/decode_step.py | sed 's/^/before /'; \
            taskset -c 2 python3 benchmarks/decode_step.py | sed 's/^/after  /'; done 2>&1 | tee $OUT/decode_step.log"
    for backend in host gpu; do
        step "decode step through the service (parse, scope, lock, core, reply), $backend pool: before / after" \
            bash -c "for i in 1 2 3; do env $BEFORE taskset -c 2 python3 benchmarks/servicer_step.py --backend $backend; \
                taskset -c 2 python3 benchmarks/servicer_step.py --backend $backend; done 2>&1 | tee $OUT/servicer_step_$backend.log"
    done
    step "the fast path's tests on the H200 host (hostile records, crash cases, idle CPU, the 4-process KV-verified run)" \
        bash -c "set -o pipefail; timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/fastpath 2>&1 | tee $OUT/fastpath_tests.log"
    step "zero_blocks on the H200 (default and Llama-3-8B layouts)" \
        bash -c "set -o pipefail; timeout 120 python3 benchmarks/bench_zero.py --backend gpu 2>&1 | tee $OUT/bench_zero.log"
    step "AppendToken / AppendTokenStream end to end, GPU pool: this tree against the tree before (unix, pinned)" \
        bash -c "set -o pipefail; timeout 300 python3 benchmarks/bench_service.py --no-naive --rounds ${BENCH_ROUNDS:-3} --duration 3 \
            --kinds echo-aio,kvpool,kvpool-stream --before $B --transport unix --pin=6,7 -- --backend gpu 2>&1 | tee $OUT/bench_service_layers.log"
    echo "=== gpu_check status $status"; exit $status
fi
engine_prefix() {  # issue 32: the engines on the shared prefix cache (about 3 minutes; the chat run: SKIP_CHAT=1 skips it)
    step "GPU tests: prefill over another frontend's cached prefix vs a full prefill (1 and 2 shards), unsealed blocks no hit, the sealing append after the prefill's writes, resume after a SIGKILL" \
        bash -c "set -o pipefail; timeout ${T_PREFIX_TESTS:-240} python3 -m pytest -q -p no:cacheprovider -rs -s \
            tests/client/test_prefill_attention.py tests/client/test_split_kv.py tests/client/test_layer_helpers.py \
            tests/client/test_engine_prefix.py tests/client/test_engine_resume.py -k 'not cpu' 2>&1 | tee $OUT/engine_prefix_tests.log"
    step "TTFT: random Llama-3-8B fp16, a 4,096-token prefix written by another process + 256 computed, hit (from the pool, from the host tier) vs recompute" \
        bash -c "set -o pipefail; timeout ${T_TTFT:-240} python3 benchmarks/bench_ttft.py --tier --json $OUT/ttft.json 2>&1 | tee $OUT/bench_ttft.log"
    step "TTFT, the same without split-KV (one flash call over the whole context)" \
        bash -c "set -o pipefail; KVPOOL_ENGINE_SPLIT_KV=0 timeout ${T_TTFT:-240} python3 benchmarks/bench_ttft.py --json $OUT/ttft_nosplit.json 2>&1 | tee $OUT/bench_ttft_nosplit.log"
    step "TTFT, the same with the elementwise helpers eager (not Liger's kernels)" \
        bash -c "set -o pipefail; timeout ${T_TTFT:-240} python3 benchmarks/bench_ttft.py --helpers eager --json $OUT/ttft_eager_helpers.json 2>&1 | tee $OUT/bench_ttft_eager_helpers.log"
    step "TTFT, the same without prefill graphs (every prefill eager)" \
        bash -c "set -o pipefail; KVPOOL_ENGINE_PREFILL_GRAPHS=0 timeout ${T_TTFT:-240} python3 benchmarks/bench_ttft.py --json $OUT/ttft_eager.json 2>&1 | tee $OUT/bench_ttft_eager.log"
    [ -n "$SKIP_CHAT" ] || step "TTFT, chat: four engine processes (Llama-3-8B's shape, 8 layers), conversations spread over them, shared pool vs four private caches" \
        bash -c "set -o pipefail; timeout ${T_CHAT:-300} python3 benchmarks/bench_ttft.py --workload chat --quick --json $OUT/ttft_chat.json 2>&1 | tee $OUT/bench_ttft_chat.log"
}
if [ "$only" = engine-prefix ]; then
    engine_prefix
    grep -h "passed\|failed\|error" $OUT/engine_prefix_tests.log | tail -3
    echo "=== gpu_check status $status"; exit $status
fi
if [ "$only" = engine ]; then  # issue 22: KV ops as torch custom ops, the decode engine on the pool vs in-process
    # About 6 minutes: each step has its own time limit, and a failure in one does not stop the next.
    step "GPU tests: kvpool:: ops (vs reference, CUDA graph, torch.compile), the engine vs transformers (greedy, beams, in-process baseline, 3 processes)" \
        bash -c "set -o pipefail; timeout ${T_TESTS:-180} python3 -m pytest -q -p no:cacheprovider -rs -s \
            tests/client/test_torch_ops.py tests/client/test_engine.py -k 'not cpu' 2>&1 | tee $OUT/engine_tests.log"
    step "engine benchmark: random Llama-3-8B, kvpool vs in-process, batch 1/16/64/256, context 512/2048, roofline" \
        bash -c "set -o pipefail; timeout ${T_BENCH:-180} python3 benchmarks/bench_engine.py --json $OUT/engine.json 2>&1 | tee $OUT/bench_engine.log"
    engine_prefix
    grep -h "passed\|failed\|error" $OUT/engine_tests.log $OUT/engine_prefix_tests.log | tail -3
    echo "=== gpu_check status $status"; exit $status
fi
if [ "$only" = tp ]; then  # issue 26: a pool for a tensor-parallel group (N shards; one GPU: all on device 0)
    # carry=[".whl"]. Under ~5 minutes: the GPU tests, the TP engine's, one GPU load-generator run, the two benchmarks.
    # Rank r on device r % GPUs when there are several (N = 8 on 4 GPUs: two shards a device); one GPU: all on 0.
    ndev=$(nvidia-smi -L | wc -l); TPDEV=""
    [ "$ndev" -gt 1 ] && TPDEV="--tp-devices $(for r in 0 1 2 3 4 5 6 7; do printf '%s' "$((r % ndev))"; [ $r -lt 7 ] && printf ','; done)"
    echo "GPUs: $ndev (${TPDEV:-every shard on device 0})"
    step "GPU tests: sharded pool (N shards on one device), stateful test over 1/2/4 shards, ranks over CUDA IPC" \
        bash -c "set -o pipefail; KVPOOL_TEST_BACKEND=gpu timeout ${T_TESTS:-150} python3 -m pytest -q -p no:cacheprovider -rs \
            tests/device/test_sharded_pool.py tests/device/test_stateful_pool.py tests/client/test_tensor_parallel.py 2>&1 \
            | tee $OUT/tp_tests.log"
    step "GPU tests: the tensor-parallel decode engine (N = 2, 4, replicated heads; every shard on device 0, CUDA graphs; with 2+ GPUs also rank r on GPU r % 2, eager) vs transformers and the 1-shard engine" \
        bash -c "set -o pipefail; timeout ${T_ENGINE_TP:-300} python3 -m pytest -q -s -p no:cacheprovider -rs \
            tests/client/test_engine_tp.py -k 'not cpu' 2>&1 | tee $OUT/tp_engine_tests.log"
    tp_loadgen() {  # a GPU server of 4 shards (Llama-like heads), 2 loadgen processes writing every rank by CUDA IPC
        sock=/tmp/kvp-tp.sock; rm -f $sock
        python3 -m kvpool_server --backend gpu --pool-bytes 512MiB --num-kv-heads 8 --head-dim 16 --tensor-parallel 4 \
            --unix-socket $sock --address "" --log-level WARNING & spid=$!
        for _ in $(seq 100); do [ -S $sock ] && break; sleep 0.2; done
        timeout 60 python3 -m kvpool_client.loadgen.main --target unix:$sock --no-progress --json $OUT/tp_loadgen.json \
            -p 2 -c 8 -n 40 --mode beam --beam-width 4 --kv-source device 2>&1 | tee $OUT/tp_loadgen.log
        rc=$?; kill $spid; wait $spid; return $rc
    }
    step "load generator, beam search, GPU pool of 4 shards, KV verified through every rank's mapping and ReadKV" tp_loadgen
    step "decode step (256 sequences, AppendToken with copies) at N = 1, 2, 4, 8 shards, in process" \
        bash -c "set -o pipefail; timeout 200 taskset -c 2 python3 benchmarks/tp_decode_step.py --backend gpu --compare $TPDEV \
            --json $OUT/tp_decode_step.json 2>&1 | tee $OUT/tp_decode_step.log"
    step "COW copy bandwidth per device, N shards copying at once" \
        bash -c "set -o pipefail; timeout 90 python3 benchmarks/tp_copy_bandwidth.py --backend gpu $TPDEV \
            --json $OUT/tp_copy_bandwidth.json 2>&1 | tee $OUT/tp_copy_bandwidth.log"
    echo "=== gpu_check status $status"; exit $status
fi
if [ "$only" = vllm ]; then  # issue 31: the vLLM connector's worker on a GPU pool (CUDA IPC), vLLM's CUDA layouts
    # carry=[".whl"]. About 3 minutes: the sweep (48 variants) after a GPU server (Llama-3-8B layout), a 4,096-token prompt stored and loaded back.
    step "vLLM connector, the copier on CUDA: copies of 1-9 pairs launched directly, byte for byte against the PyTorch path" \
        bash -c "set -o pipefail; timeout ${T_TESTS:-120} python3 -m pytest -q -p no:cacheprovider -rs tests/client/test_vllm_block_copy.py -k cuda 2>&1 | tee $OUT/vllm_copier_tests.log"
    step "vLLM connector, CUDA path: store/load 256 blocks of Llama-3-8B between vLLM-layout tensors (NHD, HND) and kvpool's pool, bytes verified, GB/s vs copy_" \
        bash -c "set -o pipefail; timeout ${T_VLLM:-240} python3 benchmarks/bench_vllm_gpu.py --repeats 20 2>&1 | tee $OUT/vllm_gpu.log"
    step "vLLM connector, the copy kernel's variants (tile, warps, blocks a program, word, eviction hint): GB/s vs copy_, bytes checked, BEST and the DEFAULT line" \
        bash -c "set -o pipefail; timeout ${T_SWEEP:-180} python3 benchmarks/sweep_vllm_copy.py 2>&1 | tee $OUT/vllm_sweep.log"
    echo "=== gpu_check status $status"; exit $status
fi
if [ "$only" = datapath2 ]; then  # issue 14, second part: both layouts, FlexAttention, loadgen --kv-source device
    # Within one short lease: each step has its own time limit; the tables come last.
    step "GPU tests, both layouts (device ops + copy kernel, client kernels, FlexAttention, Llama on the GPU)" \
        bash -c "set -o pipefail; KVPOOL_TEST_BACKEND=gpu timeout ${T_TESTS:-200} python3 -m pytest -q -p no:cacheprovider -rs \
            tests/device/test_device_pool_ops.py tests/device/test_device_gpu.py tests/client/test_kernels_gpu.py \
            tests/client/test_flex_paged.py tests/client/test_integration_llama.py -k 'not cpu and not share_one_server' 2>&1 | tee $OUT/datapath2_tests.log"
    step "3 frontend processes, each its own Llama, greedy + beam search at once against one server (sessions)" \
        bash -c "set -o pipefail; timeout ${T_PROCS:-150} python3 -m pytest -q -p no:cacheprovider -rs -s \
            tests/client/test_integration_llama.py -k share_one_server 2>&1 | tee $OUT/datapath2_processes.log"
    step "the integration's per-step overhead (random Llama-3-8B, batch 1/16/64, kvpool vs its own dense cache)" \
        bash -c "set -o pipefail; timeout ${T_MODEL:-150} python3 benchmarks/bench_datapath.py --sections model --json $OUT/datapath_model.json 2>&1 | tee $OUT/bench_model.log"
    for kvl in layer-major block-major; do
        step "data-path benchmark, $kvl (quick: moves, Triton + FlexAttention decode, copy kernel)" \
            bash -c "set -o pipefail; timeout ${T_BENCH:-100} python3 benchmarks/bench_datapath.py --quick --kv-layout $kvl --json $OUT/datapath_$kvl.json 2>&1 | tee $OUT/bench_$kvl.log"
    done
    step "make run equivalent on the GPU (loadgen --kv-source auto = device: writes through the client kernels)" \
        bash -c "set -o pipefail; timeout ${T_DEMO:-60} python3 scripts/run_demo.py --no-progress --completions 40 2>&1 | tail -25 | tee $OUT/demo_gpu.log"
    for kvl in layer-major block-major; do grep -A30 "^\[$kvl\]" $OUT/bench_$kvl.log; done
    grep -h "passed\|failed\|error" $OUT/datapath2_tests.log | tail -3
    echo "=== gpu_check status $status"; exit $status
fi
if [ "$only" = datapath ]; then  # issue 14: data-path kernels, paged attention, the Llama integration, benchmark
    step "data-path tests on the GPU (kernels vs reference, torch, two processes, paged attention, Llama)" \
        bash -c "set -o pipefail; python3 -m pytest -q -p no:cacheprovider -rs -s tests/client/test_kernels_gpu.py tests/client/test_integration_llama.py tests/client/test_kernels_host.py tests/client/test_attach.py 2>&1 | tee $OUT/datapath_tests.log"
    step "data-path benchmark (Llama-3-8B layout, CUDA IPC)" \
        bash -c "set -o pipefail; python3 benchmarks/bench_datapath.py --json $OUT/datapath.json 2>&1 | tee $OUT/bench_datapath.log"
    echo "=== gpu_check status $status"; exit $status
fi
if [ "$only" = client ]; then
    step "make run equivalent on the GPU" bash -c "set -o pipefail; python3 scripts/run_demo.py --no-progress 2>&1 | tee $OUT/run_demo_gpu.log"
    step "beam search width 4 on the GPU" \
        bash -c "set -o pipefail; python3 scripts/run_demo.py --no-progress --mode beam --beam-width 4 --lengths sharegpt --completions 40 2>&1 | tee $OUT/beam_gpu.log"
    step "client attach tests" bash -c "set -o pipefail; python3 -m pytest -q -p no:cacheprovider tests/client/test_attach.py 2>&1 | tee $OUT/attach_gpu.log"
    echo "=== gpu_check status $status"; exit $status
fi
# Issue 2: the core and device suites and the seed checks with the CuPy backend, plus the copy kernel vs memcpy.
step "device check (pytest tests/device tests/core on the GPU + copy kernel vs memcpy)" \
    bash -c "set -o pipefail; python3 scripts/gpu_device_check.py 2>&1 | tee $OUT/gpu_device_check.log"
[ "$only" = device ] && { echo "=== gpu_check status $status"; exit $status; }
step "seed checks on the GPU pool" \
    bash -c "set -o pipefail; KVPOOL_TEST_BACKEND=gpu python3 -m pytest -q -p no:cacheprovider -s tests/test_seed_checks.py 2>&1 | tee $OUT/seed_gpu.log"
# Issue 3/4: a server on the CuPy backend, client processes attaching by CUDA IPC, KV verified through page tables.
step "make run equivalent (auto backend = GPU): 100 completions, 2 client processes" \
    bash -c "set -o pipefail; python3 scripts/run_demo.py --no-progress 2>&1 | tee $OUT/run_demo_gpu.log"
step "beam search width 4, ShareGPT-like lengths, 2 client processes: copy-on-write on the GPU" \
    bash -c "set -o pipefail; python3 scripts/run_demo.py --no-progress --mode beam --beam-width 4 --lengths sharegpt --completions 40 2>&1 | tee $OUT/beam_gpu.log"
step "client attach tests (GPU case included)" \
    bash -c "set -o pipefail; python3 -m pytest -q -p no:cacheprovider tests/client/test_attach.py 2>&1 | tee $OUT/attach_gpu.log"
# Benchmarks on the H200 host ("validate" stops before them).
[ "$only" = validate ] && { echo "=== gpu_check status $status"; exit $status; }
core_bench
service_benches
echo; echo "=== gpu_check status $status"
exit $status
