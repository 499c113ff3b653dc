#!/usr/bin/env bash
# Volumes in the on-disk formats plyfs writes, kept as test fixtures (#31): the code that reads them
# must go on reading them, whatever it becomes. Each format is a small tree made through a real mount
# of this plyfs, packed as tests/fixtures/formats/NAME.tar.gz with what reads it back:
#   lower/     the stored tree (as the layers wrote it, with its user.* extended attributes)
#   stack      the --stack to mount it with
#   options    further `plyfs mount` arguments, one per line, @ROOT@ standing for where it is unpacked
#              (--branch=@ROOT@/base=ro ...)
#   passfile   the crypt password, for the formats that have one (--passfile=@ROOT@/passfile)
#   manifest   what the mount shows: one line per entry, `KIND MODE SIZE SHA256-OR-TARGET PATH`
#   made-by    `plyfs --version` of the plyfs that wrote it
# crates/cli/tests/formats.rs mounts each one and checks it against its manifest.
#
#   scripts/fixtures.sh NAME...         (needs FUSE; with no NAME, every format below is made again)
#
# Make only the new formats' fixtures: the old ones stay as the plyfs of their day wrote them.
#
# A format change adds its fixtures here (and keeps the old ones), or ships a converter a test runs.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PLYFS=${PLYFS_BIN:-$ROOT/target/release/plyfs}
OUT=${FIXTURES_OUT:-$ROOT/tests/fixtures/formats}
[ -x "$PLYFS" ] || { echo "fixtures.sh: no plyfs at $PLYFS (cargo build --release)" >&2; exit 1; }

# NAME  STACK  CRYPT-INIT-ARGUMENTS ("-": not a crypt volume; "tree": made by make_NAME below)
FORMATS=(
  "copy          copy                      -"
  "uuencode      uuencode                  -"
  "gzip          gzip                      -"
  "zstd          zstd                      -"
  "zstd-64k      zstd:chunk=64k            -"
  "zstd-tails    zstd:fast_tails=on        -"
  "lz4           lz4                       -"
  "crypt         crypt                     --cipher=aes-256-gcm"
  "crypt-xchacha crypt                     --cipher=xchacha20-poly1305"
  "crypt-padme   crypt                     --pad=padme"
  "crypt-plain   crypt                     --plaintext-names"
  "zstd+crypt    zstd,crypt                --cipher=aes-256-gcm"
  "union         union                     tree"
  "mirror        mirror[zstd|]             tree"
  "version       version                   tree"
  "reverse       crypt                     tree"
  "exofs         null                      tree"
)

WORK=$(mktemp -d /tmp/plyfs-fixtures.XXXXXX)
MNT=$WORK/mnt
cleanup() {
  if mountpoint -q "$MNT" 2>/dev/null; then "$PLYFS" umount "$MNT" >/dev/null 2>&1 || fusermount3 -uz "$MNT" 2>/dev/null || true; fi
  rm -rf "$WORK"
}
trap cleanup EXIT

# The same files for every format: sizes around the chunk (4 KiB) and the fast-tail cases, text
# and random bytes, a hole, names and a symlink target long enough for crypt's long-name files.
populate() {
  local m=$1
  printf 'plyfs fixture: a short text file\n' > "$m/small.txt"
  : > "$m/empty"
  head -c 4096 /dev/zero | tr '\0' 'a' > "$m/one-chunk"
  head -c 4097 /dev/urandom > "$m/chunk-and-a-byte"
  { for i in $(seq 1 600); do echo "line $i of a compressible file"; done; head -c 20000 /dev/urandom; } > "$m/mixed"
  for i in $(seq 1 40); do printf 'append %02d\n' "$i" >> "$m/appended"; done
  printf 'head' > "$m/sparse"; truncate -s 65536 "$m/sparse"; printf 'tail' >> "$m/sparse"
  mkdir -p "$m/dir/sub"
  printf 'deep\n' > "$m/dir/sub/deep.txt"
  chmod 0640 "$m/dir/sub/deep.txt"; chmod 0750 "$m/dir/sub"
  local long; long=$(printf 'n%.0s' $(seq 1 220))
  printf 'a long name\n' > "$m/dir/$long"
  ln -s "$(printf 'target/%.0s' $(seq 1 300))end" "$m/long-link"
  ln -s small.txt "$m/short-link"
}

# `KIND MODE SIZE SHA256-OR-TARGET PATH` for every entry under the mount, in path order.
manifest() {
  python3 - "$1" <<'EOF'
import hashlib, os, stat, sys
top = sys.argv[1]
rows = []
for d, dirs, files in os.walk(top):
    for n in dirs + files:
        p = os.path.join(d, n)
        rel = os.path.relpath(p, top)
        if rel.startswith(".plyfs"):
            continue
        st = os.lstat(p)
        mode = "%04o" % stat.S_IMODE(st.st_mode)
        if stat.S_ISLNK(st.st_mode):
            rows.append(("link", mode, len(os.readlink(p)), os.readlink(p), rel))
        elif stat.S_ISDIR(st.st_mode):
            rows.append(("dir", mode, 0, "-", rel))
        else:
            with open(p, "rb") as f:
                rows.append(("file", mode, st.st_size, hashlib.sha256(f.read()).hexdigest(), rel))
for r in sorted(rows, key=lambda r: r[4]):
    print(*r)
EOF
}

# A union over a read-only base: the base's files, one removed (a whiteout), a directory removed
# and made again (opaque), one changed (copied up), new ones.
make_union() {
  local dir=$1
  mkdir -p "$dir/base"
  populate "$dir/base"
  mkdir -p "$dir/base/gone-dir/inner"; echo inner > "$dir/base/gone-dir/inner/f"
  echo "--branch=@ROOT@/base=ro" > "$dir/options"
  "$PLYFS" mount "$dir/lower" "$MNT" --stack union --branch "$dir/base=ro" 2>/dev/null
  rm "$MNT/small.txt" "$MNT/dir/sub/deep.txt"
  rm -r "$MNT/gone-dir"; mkdir "$MNT/gone-dir"; echo "made again" > "$MNT/gone-dir/new"
  echo "changed above" >> "$MNT/mixed"
  echo "new in the upper" > "$MNT/upper-only"
}

# Two branches, the first compressed; a file rewritten in place and one truncated.
make_mirror() {
  local dir=$1
  mkdir -p "$dir/b"
  echo "--branch=@ROOT@/b" > "$dir/options"
  "$PLYFS" mount "$dir/lower" "$MNT" --stack 'mirror[zstd|]' --branch "$dir/b" 2>/dev/null
  populate "$MNT"
  printf 'REWRITTEN' | dd of="$MNT/mixed" bs=1 seek=5000 conv=notrunc status=none
  truncate -s 1000 "$MNT/chunk-and-a-byte"
}

# A version store: files rewritten, truncated and removed, so that it holds old versions.
make_version() {
  local dir=$1
  "$PLYFS" mount "$dir/lower" "$MNT" --stack version 2>/dev/null
  populate "$MNT"
  sync
  echo "second version" > "$MNT/small.txt"
  truncate -s 100 "$MNT/mixed"
  rm "$MNT/one-chunk"
}

# A reverse view of a plaintext tree, copied out as a backup would copy it: mounted with crypt.
make_reverse() {
  local dir=$1
  mkdir -p "$dir/plain"
  populate "$dir/plain"
  "$PLYFS" init "$dir/plain" --reverse --kdf-memory 1024 --passfile "$dir/passfile" >/dev/null 2>&1
  "$PLYFS" mount "$dir/plain" "$MNT" --reverse --passfile "$dir/passfile" 2>/dev/null
  cp -a "$MNT/." "$dir/lower/"
  "$PLYFS" umount "$MNT"
  # What is checked is what the copy mounts as, with the plaintext tree gone.
  rm -rf "$dir/plain"
  "$PLYFS" mount "$dir/lower" "$MNT" --stack crypt --passfile "$dir/passfile" 2>/dev/null
}

# exofs on an exodisk volume (volume.img and its key; the test serves it and mounts exodisk:SOCKET):
# small files held in the inode, files with extents, a file with bytes inserted in the middle.
make_exofs() {
  local dir=$1
  rmdir "$dir/lower"
  "$PLYFS" exodisk format "$dir/volume.img" --size 16M >/dev/null 2>&1
  "$PLYFS" exodisk serve "$dir/volume.img" --socket "$dir/s.sock" >/dev/null 2>&1 &
  local service=$!
  for _ in $(seq 1 500); do [ -S "$dir/s.sock" ] && break; sleep 0.01; done
  "$PLYFS" mount "exodisk:$dir/s.sock" "$MNT" --stack null 2>/dev/null
  populate "$MNT"
  "$PLYFS" op "$MNT/mixed" insert 100 "INSERTED" >/dev/null
  sync
  manifest "$MNT" > "$dir/manifest"
  "$PLYFS" umount "$MNT"
  kill -TERM "$service"; wait "$service" || true
  rm -f "$dir/s.sock"
}

mkdir -p "$OUT"
made_by=$("$PLYFS" --version)
for spec in "${FORMATS[@]}"; do
  read -r name stack init <<< "$spec"
  if [ $# -gt 0 ] && ! printf '%s\n' "$@" | grep -qx "$name"; then continue; fi
  dir=$WORK/$name
  mkdir -p "$dir/lower" "$MNT"
  echo "$stack" > "$dir/stack"
  if [ "$init" = tree ]; then
    [ "$name" != reverse ] || echo "correct horse battery staple" > "$dir/passfile"
    "make_$name" "$dir"
  else
    opts=()
    if [ "$init" != - ]; then
      echo "correct horse battery staple" > "$dir/passfile"
      "$PLYFS" init "$dir/lower" --layer crypt --kdf-memory 1024 --passfile "$dir/passfile" $init >/dev/null 2>&1
      opts=(--passfile "$dir/passfile")
    fi
    "$PLYFS" mount "$dir/lower" "$MNT" --stack "$stack" "${opts[@]}" 2>/dev/null
    populate "$MNT"
  fi
  if [ "$name" != exofs ]; then
    sync
    manifest "$MNT" > "$dir/manifest"
    "$PLYFS" umount "$MNT"
  fi
  echo "$made_by" > "$dir/made-by"
  tar -C "$dir" --sparse --xattrs --xattrs-include='user.*' --sort=name --owner=0 --group=0 --numeric-owner -czf "$OUT/$name.tar.gz" .
  echo "$name: $(du -h "$OUT/$name.tar.gz" | cut -f1) ($stack)"
done
