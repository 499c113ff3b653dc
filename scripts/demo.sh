#!/usr/bin/env bash
# Install what is missing, build plyfs, and show a demo stack at work: a trace layer over a null
# layer, mounted over a sample directory.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh
cargo build --release --quiet
plyfs=$PWD/target/release/plyfs

demo=$(mktemp -d /tmp/plyfs-demo.XXXXXX)
lower=$demo/lower mnt=$demo/mnt
mkdir -p "$lower/docs" "$mnt"
echo "hello from the lower directory" > "$lower/docs/readme.txt"
seq 1 1000 > "$lower/numbers.txt"

cleanup() {
  if grep -q " $mnt fuse" /proc/mounts; then "$plyfs" umount "$mnt" || umount -l "$mnt"; fi
  rm -rf "$demo"
}
trap cleanup EXIT INT TERM

step() { printf '\n\033[1m$ %s\033[0m\n' "$*"; eval "$@"; }

step "$plyfs" layers
step "$plyfs" mount "$lower" "$mnt" --stack "trace:log=$demo/trace.jsonl,null"
step ls -l "$mnt" "$mnt/docs"
step "echo 'written through plyfs' > $mnt/docs/new.txt"
step cat "$lower/docs/new.txt"
step "wc -l < $mnt/numbers.txt"
step ln "$mnt/docs/new.txt" "$mnt/hardlink.txt"
step stat -c "'%i %h %n'" "$mnt/docs/new.txt" "$mnt/hardlink.txt"
step ls "$mnt/.plyfs" "$mnt/.plyfs/null"
step "$plyfs" op "$mnt/docs" --list
step "$plyfs" op "$mnt/docs/new.txt" lower-info
step "$plyfs op $mnt stats | head -n 20"
step "$plyfs" umount "$mnt"
step "head -n 3 $demo/trace.jsonl"
printf '\nplyfs works: the demo mounted, served and unmounted %s.\n' "$mnt"
