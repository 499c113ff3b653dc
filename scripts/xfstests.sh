#!/usr/bin/env bash
# xfstests (fstests) on one plyfs stack, through the mount helper, as the suite mounts any FUSE
# file system: FSTYP=fuse, FUSE_SUBTYP=.plyfs, TEST_DEV and SCRATCH_DEV given as source:DIR.
#
#   scripts/xfstests.sh STACK [CHECK ARGUMENTS...]      (default: -g quick)
#   scripts/xfstests.sh zstd,crypt -g all            (every generic test)
#   scripts/xfstests.sh union generic/035 generic/236
#
# STACK: null, zstd, crypt, zstd,crypt, gzip, union (a read-write upper over a read-only branch),
# mirror (two branches), exofs (null over an exodisk volume, its service started here), or any
# other --stack spec that needs no extra setup.
#
# XFSTESTS_DIR names a built xfstests (https://github.com/kdave/xfstests, `make` as its README
# says); plyfs ships none of it. The run is judged against tests/xfstests/STACK.known (a stack's
# commas become +): every test that fails there must be listed with its reason, and the script
# exits 1 on any other failure. Needs root (the suite's own requirement). Results, with each
# failed test's output and diff: $XFSTESTS_WORK/results (default /var/tmp/plyfs-xfstests/STACK).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

die() { echo "xfstests.sh: $*" >&2; exit 1; }
[ $# -ge 1 ] || die "usage: scripts/xfstests.sh STACK [CHECK ARGUMENTS...]"
STACK=$1; shift
[ $# -gt 0 ] || set -- -g quick
[ "$(id -u)" = 0 ] || die "xfstests needs root"
XFSTESTS_DIR=${XFSTESTS_DIR:-/var/lib/xfstests}
[ -x "$XFSTESTS_DIR/check" ] && [ -x "$XFSTESTS_DIR/ltp/fsstress" ] ||
  die "no built xfstests at $XFSTESTS_DIR (set XFSTESTS_DIR; build kdave/xfstests with make, as its README says)"
NAME=${STACK//,/+}
KNOWN=$ROOT/tests/xfstests/$NAME.known
[ -f "$KNOWN" ] || die "no known-failures file $KNOWN for stack $STACK (create it, even empty)"
PLYFS=${PLYFS_BIN:-$ROOT/target/release/plyfs}
[ -x "$PLYFS" ] || die "no plyfs at $PLYFS (cargo build --release)"

# (No + in the path: the tests put TEST_DIR into sed patterns.)
WORK=${XFSTESTS_WORK:-/var/tmp/plyfs-xfstests/${STACK//,/-}}
# The lower directories live on an ext4 image of their own (sparse, XFSTESTS_DISK big), so that the
# tests that fill the file system fill that, not the machine's disk, and runs on several stacks at
# once do not fill each other's.
DISK=$WORK/disk
# mirror's second branches live on an image of their own, 1 GiB larger: a test that fills the
# file system fills the first branch first, and the write is refused there (ENOSPC) before the
# second branch could fail for want of room, which would leave the rest of the run on one branch.
BRANCH_DISK=$WORK/branch-disk
TEST_LOWER=$DISK/test SCRATCH_LOWER=$DISK/scratch TEST_MNT=$WORK/test-mnt SCRATCH_MNT=$WORK/scratch-mnt

unmount_all() {
  local m
  for m in "$TEST_MNT" "$SCRATCH_MNT" "$DISK" "$BRANCH_DISK"; do
    if mountpoint -q "$m" 2>/dev/null; then umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true; fi
  done
}
unmount_all
rm -rf "$WORK"
mkdir -p "$DISK" "$TEST_MNT" "$SCRATCH_MNT" "$WORK/bin" "$WORK/results"
# Sparse, but the tests that fill the file system make it all real: refuse to start without that
# much room on the machine's disk (several runs at once, or images left behind, filled it once and
# made every run's writes fail).
SIZE=${XFSTESTS_DISK:-16G}
need=$(numfmt --from=iec "$SIZE")
[ "$STACK" != mirror ] || need=$(( 2 * need + (1 << 30) ))
free=$(( $(stat -f -c '%a * %S' "$WORK") ))
[ "$free" -ge "$need" ] ||
  die "$WORK: $(numfmt --to=iec "$free") free, and the lower file systems' images may take $(numfmt --to=iec "$need") (set XFSTESTS_DISK smaller)"
truncate -s "$SIZE" "$WORK/disk.img"
mkfs.ext4 -q -F "$WORK/disk.img"
mount -o loop "$WORK/disk.img" "$DISK"
mkdir -p "$TEST_LOWER" "$SCRATCH_LOWER"

# The mount helper is plyfs itself: mount(8) runs /sbin/mount.fuse.plyfs for -t fuse.plyfs. The
# one under test takes its place while any run uses it (runs on several stacks at once share it,
# each holding a shared lock); the last run to end puts back what was there before.
HELPER=/sbin/mount.fuse.plyfs
SAVED_HELPER=/var/tmp/plyfs-xfstests/mount.fuse.plyfs.saved
mkdir -p /var/tmp/plyfs-xfstests
exec 9>/var/tmp/plyfs-xfstests/helper.lock
flock -s 9
if [ "$(readlink -f "$HELPER" 2>/dev/null)" != "$(readlink -f "$PLYFS")" ]; then
  if [ -e "$HELPER" ] || [ -L "$HELPER" ]; then mv "$HELPER" "$SAVED_HELPER"; fi
  ln -s "$PLYFS" "$HELPER"
fi
SERVICES=()
restore() {
  local status=$?
  unmount_all
  rm -f "$WORK/disk.img" "$WORK/branch.img"    # the results stay; the images can be gigabytes
  [ ${#SERVICES[@]} = 0 ] || kill "${SERVICES[@]}" 2>/dev/null || true
  if flock -xn 9; then
    rm -f "$HELPER"
    if [ -e "$SAVED_HELPER" ] || [ -L "$SAVED_HELPER" ]; then mv "$SAVED_HELPER" "$HELPER"; fi
  fi
  exit $status
}
trap restore EXIT
trap 'exit 130' INT TERM

# The users the suite runs tests as.
for u in fsgqa fsgqa2 123456-fsgqa; do
  id "$u" >/dev/null 2>&1 || useradd -m "$u"
done

# exofs: a volume and its exodisk service for each of the two file systems, and the stack over it.
TEST_SOURCE=$TEST_LOWER SCRATCH_SOURCE=$SCRATCH_LOWER
if [ "$STACK" = exofs ]; then
  for d in test scratch; do
    "$PLYFS" exodisk format "$DISK/$d.img" --size "${XFSTESTS_EXOFS_SIZE:-4G}" >/dev/null
    "$PLYFS" exodisk serve "$DISK/$d.img" --socket "$WORK/$d.sock" --log "$WORK/$d.serve.log" >>"$WORK/$d.serve.log" 2>&1 &
    SERVICES+=($!)
  done
  for d in test scratch; do
    for _ in $(seq 100); do [ -S "$WORK/$d.sock" ] && break; sleep 0.1; done
    [ -S "$WORK/$d.sock" ] || die "the exodisk service of $d did not start (see $WORK/$d.serve.log)"
  done
  TEST_SOURCE=exodisk:$WORK/test.sock SCRATCH_SOURCE=exodisk:$WORK/scratch.sock
fi
SPEC=$STACK
[ "$STACK" != exofs ] || SPEC=null

# What each stack needs besides stack=.
OPTIONS="stack=$SPEC"
TEST_EXTRA= SCRATCH_EXTRA=
case ,$STACK, in
  *,crypt,*|*,crypt:*)
    printf 'xfstests-%s\n' "$NAME" > "$WORK/passfile"
    chmod 600 "$WORK/passfile"
    for d in "$TEST_LOWER" "$SCRATCH_LOWER"; do
      "$PLYFS" init "$d" --layer crypt --kdf-memory 1024 --passfile "$WORK/passfile" >/dev/null
    done
    OPTIONS+=",passfile=$WORK/passfile" ;;
esac
case $STACK in
  union)
    # A read-only lower branch with a few files of its own, as union is used.
    for d in test scratch; do
      mkdir -p "$DISK/$d-ro/base/sub"
      echo "from the read-only branch" > "$DISK/$d-ro/base/readme"
      seq 1 10000 > "$DISK/$d-ro/base/sub/numbers"
    done
    TEST_EXTRA=",branch=$DISK/test-ro=ro" SCRATCH_EXTRA=",branch=$DISK/scratch-ro=ro" ;;
  mirror)
    truncate -s $(( $(numfmt --from=iec "$SIZE") + (1 << 30) )) "$WORK/branch.img"
    mkfs.ext4 -q -F "$WORK/branch.img"
    mkdir -p "$BRANCH_DISK"
    mount -o loop "$WORK/branch.img" "$BRANCH_DISK"
    mkdir -p "$BRANCH_DISK/test-b" "$BRANCH_DISK/scratch-b"
    TEST_EXTRA=",branch=$BRANCH_DISK/test-b" SCRATCH_EXTRA=",branch=$BRANCH_DISK/scratch-b" ;;
esac

# xfstests asks df for the mounted type and compares it with FSTYP ("fuse"); the kernel shows
# fuse.plyfs (as it shows fuse.glusterfs, which the suite itself maps to glusterfs).
cat > "$WORK/bin/df" <<'EOF'
#!/bin/sh
/usr/bin/df "$@" | sed 's/ fuse\.plyfs / fuse       /'
EOF
chmod +x "$WORK/bin/df"

cat > "$WORK/config" <<EOF
export FSTYP=fuse
export FUSE_SUBTYP=.plyfs
export TEST_DEV=source:$TEST_SOURCE
export TEST_DIR=$TEST_MNT
export SCRATCH_DEV=source:$SCRATCH_SOURCE
export SCRATCH_MNT=$SCRATCH_MNT
export TEST_FS_MOUNT_OPTS="-o $OPTIONS$TEST_EXTRA,allow_other"
export MOUNT_OPTIONS="-o $OPTIONS$SCRATCH_EXTRA,allow_other"
export RESULT_BASE=$WORK/results
EOF

python3 "$ROOT/tests/xfstests/judge.py" --excludes "$KNOWN" > "$WORK/excluded"

echo "== xfstests on $STACK: $* (plyfs $("$PLYFS" --version | cut -d' ' -f2-), xfstests $(. "$XFSTESTS_DIR/VERSION"; echo "$PACKAGE_MAJOR.$PACKAGE_MINOR.$PACKAGE_REVISION"))" >&2
# check exits 1 when any test failed, known or not: the judge decides (and a run that never got
# to its summary, having no `Ran:` line, fails there).
(cd "$XFSTESTS_DIR" && PATH=$WORK/bin:$PATH HOST_OPTIONS=$WORK/config ./check -E "$WORK/excluded" "$@") 2>&1 | tee "$WORK/check.out" || true

# Judge the run against the known failures.
python3 "$ROOT/tests/xfstests/judge.py" "$KNOWN" "$WORK/check.out" "$STACK"
