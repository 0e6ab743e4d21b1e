#!/usr/bin/env bash
# The images built and run for real (`make image-smoke BASE=...`; not part of `make test`):
#   scripts/image_smoke.sh [BASE_IMAGE]
# 1. builds docker/Dockerfile's server, loadgen and client targets; BASE_IMAGE, when given, stands in for both of
#    its bases (CUDA_IMAGE and CLIENT_IMAGE): a Debian/Ubuntu image with python3, python3-venv and a `python` binary,
#    e.g. the one `make image-base` makes with debootstrap where no registry can be reached; without it the
#    Dockerfile's own bases are used (pulled from Docker Hub);
# 2. runs the server image: host network but no TCP listener (the unix socket /run/kvpool/kvpool.sock on a volume
#    of its own; KVPOOL_SMOKE_PORT=N adds TCP on 127.0.0.1:N and points the load generators there), a shareable IPC
#    namespace, the host backend (a POSIX shared-memory pool in that namespace's /dev/shm), and waits for the image's
#    own HEALTHCHECK to say healthy;
# 3. runs the loadgen image, then the client image, each with the server's IPC and pid namespaces and the host
#    network: they map the server's pool (--kv-path attach), verify every token's KV, and their JSON summaries must
#    pass scripts/image_smoke_check.py (ok, 0 KV errors, the pool attached, appends over the fast path, the pool
#    empty and its invariants holding at the end);
# 4. sends the server SIGTERM (`docker kill -s TERM`) and requires exit status 0 within 30 s and the server's
#    "stopped" line; 5. removes the containers and the volume (the images stay: KVPOOL_SMOKE_RMI=1 removes them).
# Every container is on the host network (or none): no traffic goes to the Docker bridge's addresses.
# Logs and summaries go to KVPOOL_SMOKE_OUT (default out/image-smoke). Settings: KVPOOL_SMOKE_TAG (image tag,
# default smoke), KVPOOL_SMOKE_BACKEND (host), KVPOOL_SMOKE_POOL_BYTES (64MiB, within KVPOOL_SMOKE_SHM_SIZE, 512m), KVPOOL_SMOKE_COMPLETIONS (100),
# KVPOOL_SMOKE_BUILDKIT (0: the classic builder, which needs no `# syntax=` frontend image from a registry),
# KVPOOL_SMOKE_NO_BUILD=1 (use the images already tagged).
set -uo pipefail
cd "$(dirname "$0")/.."

base=${1:-}
tag=${KVPOOL_SMOKE_TAG:-smoke}
out=${KVPOOL_SMOKE_OUT:-out/image-smoke}
backend=${KVPOOL_SMOKE_BACKEND:-host}
pool_bytes=${KVPOOL_SMOKE_POOL_BYTES:-64MiB}
completions=${KVPOOL_SMOKE_COMPLETIONS:-100}
port=${KVPOOL_SMOKE_PORT:-}
shm_size=${KVPOOL_SMOKE_SHM_SIZE:-512m}
name=kvpool-smoke-$$
server=$name-server
volume=$name-socket
socket=/run/kvpool/kvpool.sock

say() { echo "image-smoke $(date -u +%H:%M:%S) $*"; }
fail() { say "FAIL: $*"; exit 1; }

cleanup() {
    docker rm -f "$server" "$name-loadgen" "$name-client" >/dev/null 2>&1
    docker volume rm -f "$volume" >/dev/null 2>&1
    if [ "${KVPOOL_SMOKE_RMI:-0}" = 1 ]; then
        docker rmi "kvpool-server:$tag" "kvpool-loadgen:$tag" "kvpool-client:$tag" >/dev/null 2>&1
    fi
    say "containers and volume removed"
}

command -v docker >/dev/null || fail "no docker client"
docker info >/dev/null 2>&1 || fail "no Docker engine answers"
mkdir -p "$out" || fail "cannot create $out"
rm -f "$out"/*.log "$out"/*.json

# 1. build. --network host: the RUN steps (apt-get, pip) use the host's network, never the bridge.
if [ "${KVPOOL_SMOKE_NO_BUILD:-0}" != 1 ]; then
    build_args=()
    [ -n "$base" ] && build_args=(--build-arg "CUDA_IMAGE=$base" --build-arg "CLIENT_IMAGE=$base")
    for target in server loadgen client; do
        say "building target $target as kvpool-$target:$tag${base:+ from $base}"
        start=$SECONDS
        DOCKER_BUILDKIT=${KVPOOL_SMOKE_BUILDKIT:-0} docker build --network host "${build_args[@]}" \
            -f docker/Dockerfile --target "$target" -t "kvpool-$target:$tag" . > "$out/build-$target.log" 2>&1 \
            || { tail -n 30 "$out/build-$target.log"; fail "build of $target (log: $out/build-$target.log)"; }
        say "built kvpool-$target:$tag in $((SECONDS - start)) s ($(docker image inspect -f '{{.Size}}' "kvpool-$target:$tag" | awk '{printf "%.0f MB", $1/1e6}'))"
    done
fi
trap cleanup EXIT

# 2. the server.
address=""
target=unix:$socket
if [ -n "$port" ]; then address=127.0.0.1:$port; target=$address; fi
say "starting $server: backend $backend, pool $pool_bytes, unix:$socket${address:+ and $address}"
docker run -d --name "$server" --network host --ipc shareable --shm-size "$shm_size" --init \
    -v "$volume:/run/kvpool" -e "KVPOOL_ADDRESS=$address" -e "KVPOOL_UNIX_SOCKET=$socket" \
    -e "KVPOOL_BACKEND=$backend" -e "KVPOOL_POOL_BYTES=$pool_bytes" "kvpool-server:$tag" > /dev/null \
    || fail "docker run $server"
start=$SECONDS
health=starting
while [ $((SECONDS - start)) -lt 120 ]; do
    health=$(docker inspect -f '{{.State.Status}}/{{.State.Health.Status}}' "$server")
    case $health in
        running/healthy) break ;;
        running/*) sleep 1 ;;
        *) break ;;
    esac
done
docker inspect -f '{{range .State.Health.Log}}exit {{.ExitCode}}: {{.Output}}{{end}}' "$server" | grep -v '^$' > "$out/health.log"
if [ "$health" != running/healthy ]; then
    docker logs "$server" 2>&1 | tail -n 20
    cat "$out/health.log"
    fail "server not healthy after $((SECONDS - start)) s (state $health)"
fi
say "server healthy after $((SECONDS - start)) s (the image's HEALTHCHECK said $(tail -n 1 "$out/health.log"))"

# 3. the load generators: the server's IPC namespace (its /dev/shm: the pool, the fast-path channels) and pid
# namespace, as in docker/compose.yaml; KV written into the mapped pool and read back.
loadgen() {  # image, container name suffix
    local image=$1 suffix=$2
    say "running $image: $completions completions, --kv-path attach, KV verified (--verify both)"
    docker run --name "$name-$suffix" --network host --ipc "container:$server" --pid "container:$server" \
        -v "$volume:/run/kvpool" "$image" --target "$target" --kv-path attach --verify both --no-progress \
        -p 2 -c 8 -n "$completions" --json /results/summary.json > "$out/$suffix.log" 2>&1
    local rc=$?
    grep -E "KV verification errors|completions  |result:" "$out/$suffix.log" | sed 's/^/    /'
    docker cp "$name-$suffix:/results/summary.json" "$out/$suffix.json" > /dev/null 2>&1
    [ $rc = 0 ] || { tail -n 20 "$out/$suffix.log"; fail "$image exited $rc"; }
    grep -q "result: PASS" "$out/$suffix.log" || fail "$image printed no 'result: PASS'"
    python3 scripts/image_smoke_check.py "$out/$suffix.json" --kv-path attach --fast-path || fail "$image's summary"
}
loadgen "kvpool-loadgen:$tag" loadgen
loadgen "kvpool-client:$tag" client

# 4. SIGTERM: the server's graceful shutdown must end the container by itself with status 0.
say "SIGTERM to $server"
start=$SECONDS
docker kill -s TERM "$server" > /dev/null || fail "docker kill -s TERM"
code=$(timeout 30 docker wait "$server") || fail "server still running 30 s after SIGTERM"
docker logs "$server" > "$out/server.log" 2>&1
tail -n 2 "$out/server.log" | sed 's/^/    /'
[ "$code" = 0 ] || fail "server exited $code after SIGTERM"
grep -q "stopped" "$out/server.log" || fail "no 'stopped' line in the server's log"
say "server exited 0 after $((SECONDS - start)) s"
say "PASS"
