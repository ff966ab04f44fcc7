#!/usr/bin/env bash
# Interleaved A/B of one change on the device machine: "new" is this tree, "old" a copy of it
# with PATCH applied in reverse (make PATCH with `git diff > PATCH` before committing the change).
# CMD runs ROUNDS times in each tree, alternating old/new so drift hits both alike; a literal
# {tag} in CMD becomes old1, new1, old2, ... (use it in output file names, with absolute paths).
# Usage (repo root): bash bench/ab.sh PATCH ROUNDS CMD...
#   bash bench/ab.sh ab.patch 2 python3 -m bench.offline --workload nano --out $OUT/offline_{tag}.json
set -uo pipefail
PATCH=$(realpath "$1"); ROUNDS=$2; shift 2
NEW=$PWD; OLD=$(mktemp -d)/old
cp -r "$NEW" "$OLD" && (cd "$OLD" && patch -s -R -p1 < "$PATCH") || { echo "reverse patch failed"; exit 2; }
export PYTHONUNBUFFERED=1
for i in $(seq 1 "$ROUNDS"); do
  for tag in old new; do
    dir=$OLD; [[ $tag == new ]] && dir=$NEW
    echo "== $tag$i"
    (cd "$dir" && PYTHONPATH=$dir "${@//\{tag\}/$tag$i}") 2>&1 | tail -4
  done
done
