#!/usr/bin/env bash
# Install what is missing, build plyfs, and show five demo stacks at work over sample directories:
# a trace layer over a null layer, a zstd compression layer, per-file layers chosen by attributes
# and rules in one mount, an encrypted volume (compress, then encrypt, names encrypted), and trees:
# a union over a read-only base and a mirror resynced after a branch failed.
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

# Compression: files are stored zstd-compressed in 4 KiB chunks; stat shows the real sizes.
packed=$demo/packed
mkdir -p "$packed"
step "$plyfs" mount "$packed" "$mnt" --stack zstd
step cp -r /usr/share/common-licenses "$mnt/licenses"
step "for i in \$(seq 1 200); do echo \"log line \$i\" >> $mnt/licenses/app.log; done"
step "ls -l $mnt/licenses | head -n 6"
step "ls -l $packed/licenses | head -n 6"
step "cmp /usr/share/common-licenses/GPL-3 $mnt/licenses/GPL-3 && echo identical"
step "$plyfs" op "$mnt/licenses/GPL-3" sca-stats
step "$plyfs" du "$mnt"
step "$plyfs" umount "$mnt"
step "$plyfs" fsck "$packed" --stack zstd

# Per-file layers: logs/ compressed by its directory attribute, *.md by a rule, the rest untouched.
mixed=$demo/mixed
mkdir -p "$mixed"
printf '[[rule]]\nglob = "*.md"\nlayers = "gzip:level=9"\n' > "$demo/rules.toml"
step "$plyfs" mount "$mixed" "$mnt" --stack null --rules "$demo/rules.toml"
step mkdir "$mnt/logs"
step setfattr -n user.plyfs.layers -v zstd:level=3 "$mnt/logs"
step "for i in \$(seq 1 3000); do echo \"request \$i served\"; done > $mnt/logs/app.log"
step cp /usr/share/common-licenses/GPL-3 "$mnt/GPL-3.md"
step cp /usr/share/common-licenses/GPL-3 "$mnt/GPL-3.txt"
step ls -l "$mnt" "$mnt/logs"
step ls -l "$mixed" "$mixed/logs"
step "$plyfs" policy explain "$mnt/logs/app.log"
step "$plyfs" policy explain "$mnt/GPL-3.txt"
step setfattr -n user.plyfs.layers -v lz4 "$mnt/GPL-3.txt"
step "$plyfs" policy apply "$mnt/GPL-3.txt"
step "ls -l $mixed/GPL-3.txt && cmp /usr/share/common-licenses/GPL-3 $mnt/GPL-3.txt && echo identical"
step "$plyfs" umount "$mnt"

# Encryption: a crypt volume (the demo's password comes from a file; without --passfile plyfs asks).
vault=$demo/vault
mkdir -p "$vault"
echo "demo password" > "$demo/password"
step "$plyfs" init "$vault" --layer crypt --passfile "$demo/password"
step "$plyfs" mount "$vault" "$mnt" --stack zstd,crypt --passfile "$demo/password"
step mkdir "$mnt/private"
step cp /usr/share/common-licenses/GPL-3 "$mnt/private/GPL-3"
step "echo 'the secret plan' > $mnt/private/plan.txt"
step ls -l "$mnt/private"
step "ls -lR $vault | head -n 8"
step "grep -rl 'secret plan' $vault || echo 'no plaintext below'"
step "$plyfs" op "$mnt/private/GPL-3" crypt-info
step "$plyfs" umount "$mnt"
step "echo wrong > $demo/wrong; $plyfs mount $vault $mnt --stack crypt --passfile $demo/wrong || true"
step "$plyfs" mount "$vault" "$mnt" --stack crypt --passfile "$demo/password"
step "cmp /usr/share/common-licenses/GPL-3 $mnt/private/GPL-3 && cat $mnt/private/plan.txt"
step "$plyfs" umount "$mnt"
# Trees: a union writes over a read-only base (copy-up, whiteouts); a mirror keeps two copies.
base=$demo/base upper=$demo/upper
mkdir -p "$base/etc" "$upper"
echo "from the read-only base" > "$base/etc/motd"
echo "remove me" > "$base/old.txt"
step "$plyfs" mount "$upper" "$mnt" --stack union --branch "$base=ro"
step "echo 'changed in the union' >> $mnt/etc/motd"
step rm "$mnt/old.txt"
step ls -l "$mnt" "$mnt/etc"
step "cat $base/etc/motd; ls -l $upper $upper/etc"
step "$plyfs" op "$mnt" branch-list
step "$plyfs" umount "$mnt"
copy1=$demo/copy1 copy2=$demo/copy2
mkdir -p "$copy1" "$copy2"
step "$plyfs" mount "$copy1" "$mnt" --stack "'mirror[|fault]'" --branch "$copy2"
step "$plyfs" op "$mnt" fault-add@mirror.1.fault error=EIO
step "echo 'written while the second copy is failing' > $mnt/note.txt"
step "$plyfs op $mnt mirror-status | grep -E 'state|stale'"
step "$plyfs" op "$mnt" fault-clear@mirror.1.fault
step "$plyfs op $mnt resync | grep -E 'paths|bytes' | head -n 2"
step "diff -r --exclude=.plyfs-mirror.log $copy1 $copy2 && echo 'the two copies are identical'"
step "$plyfs" umount "$mnt"
printf '\nplyfs works: the five demos mounted, served and unmounted %s.\n' "$mnt"
