#!/usr/bin/env bash
# The randomized differential tester (crates/cli/tests/fsx.rs) through real mounts, outside CI.
#
#   scripts/fsx.sh [--long] [--ops N] [--seed N] [FILTER]
#
#   --long     a million operations per configuration (CI runs 250-400)
#   --ops N    N operations per configuration
#   --seed N   replay seed N exactly (the seed a failure printed)
#   FILTER     only configurations whose test name contains it (e.g. zstd_4k_fast_tails)
#
# Every configuration mounts its own stack: null (passthrough and cached), trace, and each
# size-changing layer with fast tails off and on, with 4 KiB and 64 KiB chunks. Needs root.
set -euo pipefail
cd "$(dirname "$0")/.."
FILTER=()
while [ $# -gt 0 ]; do
  case "$1" in
    --long) export PLYFS_FSX_OPS=1000000; shift ;;
    --ops) export PLYFS_FSX_OPS="$2"; shift 2 ;;
    --seed) export PLYFS_FSX_SEED="$2"; shift 2 ;;
    -h|--help) sed -n '2,/^set/{/^set/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
    *) FILTER+=("$1"); shift ;;
  esac
done
exec cargo test --release --test fsx -- --nocapture --test-threads 2 "${FILTER[@]}"
