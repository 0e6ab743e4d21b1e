#!/usr/bin/env bash
# Extract the three vLLM files that benchmarks/bench_vs_vllm.py loads (vLLM v1's BlockPool, its KV cache utilities
# and its block hashing; about 90 KB at vLLM 0.33, 150 KB at 0.32.0 as pip installs it) into DIR, and note where
# they came from in DIR/VLLM_SOURCE.txt.
# vLLM's code is never committed to kvpool: DIR lies outside the repository (or in an ignored path).
#
#   scripts/extract_vllm_core.sh SOURCE DIR [REV]
#
# SOURCE is one of
#   - a git directory of vLLM, bare or not (a mirror, a clone): the files at REV (default HEAD), via git archive;
#   - a vLLM checkout or an installed vLLM's site-packages (a folder holding vllm/v1/core/block_pool.py): the files
#     as they are;
#   - a vLLM wheel (pip download --no-deps vllm): the files inside it.
# Then: .venv/bin/python benchmarks/bench_vs_vllm.py --vllm-src DIR   (or VLLM_SRC=DIR make bench)
set -euo pipefail
[ $# -ge 2 ] || { sed -n 2,14p "$0"; exit 2; }
SOURCE=$1 DIR=$2 REV=${3:-HEAD}
FILES=(vllm/utils/hashing.py vllm/v1/core/kv_cache_utils.py vllm/v1/core/block_pool.py)
mkdir -p "$DIR"
if [ -f "$SOURCE" ] && [[ "$SOURCE" == *.whl ]]; then
    python3 - "$SOURCE" "$DIR" "${FILES[@]}" <<'EOF'
import sys, zipfile
wheel, out, names = sys.argv[1], sys.argv[2], sys.argv[3:]
with zipfile.ZipFile(wheel) as z:
    for name in names:
        z.extract(name, out)
EOF
    origin="wheel $(basename "$SOURCE")"
elif git --git-dir="$SOURCE" rev-parse -q --verify "$REV^{commit}" >/dev/null 2>&1; then
    git --git-dir="$SOURCE" archive "$REV" "${FILES[@]}" | tar -x -C "$DIR"
    origin="git $(git --git-dir="$SOURCE" rev-parse "$REV^{commit}")"
elif git -C "$SOURCE" rev-parse -q --verify "$REV^{commit}" >/dev/null 2>&1 && [ "$REV" != HEAD ]; then
    git -C "$SOURCE" archive "$REV" "${FILES[@]}" | tar -x -C "$DIR"
    origin="git $(git -C "$SOURCE" rev-parse "$REV^{commit}")"
elif [ -f "$SOURCE/vllm/v1/core/block_pool.py" ]; then
    (cd "$SOURCE" && tar -c "${FILES[@]}") | tar -x -C "$DIR"
    tree=$(cd "$SOURCE" && pwd -P)
    origin="tree $tree"  # + vLLM's version (an installed vLLM), + the commit where SOURCE is vLLM's own checkout
    version=$(sed -n "s/^__version__ = version = '\(.*\)'$/\1/p" "$SOURCE/vllm/_version.py" 2>/dev/null || true)
    [ -z "$version" ] || origin="$origin, vLLM $version"
    if [ "$(git -C "$SOURCE" rev-parse --show-toplevel 2>/dev/null)" = "$tree" ]; then
        origin="$origin at $(git -C "$SOURCE" rev-parse HEAD)"
    fi
else
    echo "extract_vllm_core.sh: $SOURCE is neither a vLLM git directory, a checkout nor a wheel" >&2
    exit 1
fi
echo "$origin" > "$DIR/VLLM_SOURCE.txt"
du -cb "${FILES[@]/#/$DIR/}" | tail -1 | awk -v d="$DIR" -v o="$origin" '{print "extracted " $1 " bytes of vLLM (" o ") into " d}'
