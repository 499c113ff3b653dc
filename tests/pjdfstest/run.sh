#!/usr/bin/env bash
# Run the POSIX conformance suite pjdfstest (Rust rewrite, crate `pjdfstest` 0.2.2) against plyfs
# mounts, after a baseline run on a plain ext4 directory.
#
#   tests/pjdfstest/run.sh [OPTIONS] [STACK...] [-- TEST_PATTERN...]
#
# STACK is a `--stack` spec, optionally followed by more mount arguments (default: `null`,
# `trace`, `zstd`, `copy`, `null --rules mixed-rules.toml`,
# `gzip:level=9:fast_tails=on`, `crypt`, `zstd,crypt`, `crypt --bind-paths` (a volume made with `plyfs init
# --bind-paths`), `union` (a read-write branch over a read-only branch
# holding files), `mirror` (two branches) and `mirror -o shared`, `version`, `cache` in both write modes over a
# slow branch that is a directory (`--branch`) or a `plyfs serve` (`cache[|remote]`), and `remote` (a `plyfs serve` over a Unix
# socket; `remote --tls` over TLS on loopback; `zstd,remote` compressing in the mount;
# `crypt,remote` decrypting in the mount a volume served as stored), `exofs` and `zstd,exofs` (on an
# exodisk volume of their own), and
# `zstd,ext:socket=@trace,null` (`ext:socket=@LAYER` runs LAYER in a `plyfs host` process)). For each one a fresh lower directory on
# the real disk and an empty mount point are made, plyfs is mounted over them with
# `-o allow_other` (pjdfstest switches to other users), pjdfstest runs inside the mount, and the
# mount is taken down again - always, even on failure or interruption. For a stack with a
# `crypt` layer the lower directory is first made a crypt volume (`plyfs init`, encrypted names)
# with a password file, and the mount is given `--passfile`.
#
# Options:
#   -o OPTS       extra plyfs mount options for every stack (e.g. `passthrough=off`)
#   --no-native   skip the native ext4 baseline
#   --native-only run only the native baseline
#   --tolerate-native
#                 tolerate what fails on the native baseline, on it and on the stacks: for a lower
#                 file system other than ext4 (GlusterFS, with PJDFSTEST_WORKDIR on it), whose own
#                 deviations are not plyfs's
#   --repeat N    run the suite N times per target; a test fails if it fails in any run
#   --keep        keep the work directory (lower directories) after the run
#   -h, --help
# TEST_PATTERNs after `--` are passed to pjdfstest (substring match on test names).
#
# Environment:
#   PLYFS_BIN          plyfs binary to test (default: `cargo build --release`, target/release/plyfs)
#   PJDFSTEST          pjdfstest binary (default: from PATH or ~/.cargo/bin; installed if missing)
#   PJDFSTEST_WORKDIR  where lower directories are made (default /var/tmp; must not be tmpfs)
#   PJDFSTEST_RESULTS  where logs go (default target/pjdfstest/<time>)
#   PJDFSTEST_TIMEOUT  seconds one pjdfstest invocation may take (default 300)
#
# Failures listed in known-failures.txt are tolerated; any other failure (on plyfs or on the
# native baseline) makes the script exit 1. Setup errors exit 2.

# Two passes per target. pjdfstest's EROFS tests remount the file system read-only, which the
# kernel refuses (EBUSY) while any file on it is open for writing or deleted but open - and
# pjdfstest itself leaks such descriptors (open::einval_invalid_combination never closes what it
# opens), so in one combined run every EROFS test after that one fails, on plain ext4 too. The
# main pass therefore runs with allow_remount=false, and a second pass runs only the EROFS tests
# with allow_remount=true. pjdfstest remounts with `mount -o remount,ro`; for a fuse.plyfs mount
# mount(8) hands that to the mount.fuse3 helper, which runs `plyfs` from a fixed PATH
# (/usr/local/bin, /usr/bin, ...) where the plyfs under test need not be, so the EROFS pass puts
# a `mount` wrapper that adds `-i` (no helpers: the kernel's flag alone) first in PATH. The
# helper's own remount (kernel flag and daemon) is tested in crates/cli/tests/mount_helper.rs.
# The root file system cannot be remounted, so the native EROFS pass uses a loop-mounted ext4
# image (skipped if that cannot be made).

set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
PJDFSTEST_VERSION=0.2.2
# An entry may add mount arguments after the spec, e.g. `null --rules FILE`: the last one mixes
# compressed files (half of the names, by rule) with untouched ones. Where the kernel allows FUSE
# io_uring (scripts/test.sh gives its permission), mounts carry their requests over it by default;
# the `-o io_uring=off` entries use /dev/fuse.
DEFAULT_STACKS=(null trace zstd copy "gzip:level=9:fast_tails=on" "null --rules $HERE/mixed-rules.toml" crypt zstd,crypt union mirror "mirror -o shared" version
  cache "cache:mode=write-back:delay=0s" "cache[|remote]" "cache:mode=write-back:delay=0s[|remote]"
  "crypt --bind-paths" remote "remote --tls" zstd,remote crypt,remote "zstd,ext:socket=@trace,null" exofs zstd,exofs
  "null -o io_uring=off" "zstd -o io_uring=off" "crypt -o io_uring=off")

die() { echo "pjdfstest/run.sh: $*" >&2; exit 2; }
say() { echo "== $*" >&2; }

usage() { sed -n '2,/^$/{s/^# \{0,1\}//;p}' "$0"; }

# ---------------------------------------------------------------------------------------------
# Arguments

MOUNT_OPTS=""
RUN_NATIVE=1
RUN_STACKS=1
TOLERATE_NATIVE=0
REPEAT=1
KEEP=0
STACKS=()
PATTERNS=()
while [ $# -gt 0 ]; do
  case "$1" in
    -o) [ $# -ge 2 ] || die "-o needs an argument"; MOUNT_OPTS="$2"; shift 2 ;;
    -o*) MOUNT_OPTS="${1#-o}"; shift ;;
    --no-native) RUN_NATIVE=0; shift ;;
    --native-only|--native) RUN_STACKS=0; shift ;;
    --tolerate-native) TOLERATE_NATIVE=1; shift ;;
    --repeat) [ $# -ge 2 ] || die "--repeat needs an argument"; REPEAT="$2"; shift 2 ;;
    --keep) KEEP=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; PATTERNS=("$@"); break ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) STACKS+=("$1"); shift ;;
  esac
done
[ ${#STACKS[@]} -gt 0 ] || STACKS=("${DEFAULT_STACKS[@]}")
[ "$RUN_STACKS" = 1 ] || STACKS=()
[[ "$REPEAT" =~ ^[1-9][0-9]*$ ]] || die "--repeat wants a positive number"
TIMEOUT=${PJDFSTEST_TIMEOUT:-300}

[ "$(id -u)" -eq 0 ] || die "must run as root (pjdfstest switches users; the mounts need allow_other)"
for tool in timeout mountpoint awk sed; do command -v "$tool" >/dev/null || die "$tool not found"; done
REAL_MOUNT=$(command -v mount) || die "mount not found"

# ---------------------------------------------------------------------------------------------
# Cleanup: unmount everything this script mounted, whatever happens.

PLYFS=plyfs
WORK=""
MOUNTS=()        # plyfs mount points, in mount order
DAEMONS=()       # their daemon pids
SERVERS=()       # `plyfs serve` pids of remote stacks
LOOP_MNT=""      # the loop-mounted ext4 image of the native EROFS pass
CHILD=""         # the running pjdfstest (its `timeout` wrapper)

unmount_plyfs() { # MOUNTPOINT DAEMON_PID
  local mnt=$1 pid=${2:-}
  if mountpoint -q "$mnt" 2>/dev/null; then
    timeout 30 "$PLYFS" umount "$mnt" >/dev/null 2>&1 ||
      { echo "pjdfstest/run.sh: plyfs umount $mnt failed; detaching it with umount -l" >&2; umount -l "$mnt" 2>/dev/null || true; }
  fi
  # The daemon exits once unmounted; if it does not, stop it (only this pid, which we started).
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
      echo "pjdfstest/run.sh: plyfs daemon $pid still running after unmount; terminating it" >&2
      kill "$pid" 2>/dev/null || true
    fi
  fi
}

stop_server() { # PID (a `plyfs serve` this script started)
  local pid=$1
  [ -n "$pid" ] || return 0
  kill "$pid" 2>/dev/null || return 0
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null || true
}

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [ -n "$CHILD" ] && kill -0 "$CHILD" 2>/dev/null; then
    kill -TERM "$CHILD" 2>/dev/null || true
    wait "$CHILD" 2>/dev/null || true
  fi
  local i
  for ((i = ${#MOUNTS[@]} - 1; i >= 0; i--)); do unmount_plyfs "${MOUNTS[$i]}" "${DAEMONS[$i]}"; done
  for pid in ${SERVERS[@]+"${SERVERS[@]}"}; do stop_server "$pid"; done
  if [ -n "$LOOP_MNT" ] && mountpoint -q "$LOOP_MNT" 2>/dev/null; then
    umount "$LOOP_MNT" 2>/dev/null || umount -l "$LOOP_MNT" 2>/dev/null || true
  fi
  if [ -n "$WORK" ] && [ -d "$WORK" ]; then
    if grep -qF " $WORK/" /proc/self/mounts; then
      echo "pjdfstest/run.sh: something is still mounted under $WORK; leaving it in place" >&2
    elif [ "$KEEP" = 1 ]; then
      echo "pjdfstest/run.sh: work directory kept: $WORK" >&2
    else
      rm -rf --one-file-system "$WORK"
    fi
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---------------------------------------------------------------------------------------------
# Prerequisites: pjdfstest, its dummy users, plyfs.

find_pjdfstest() {
  if [ -n "${PJDFSTEST:-}" ]; then echo "$PJDFSTEST"
  elif command -v pjdfstest >/dev/null; then command -v pjdfstest
  elif [ -x "${CARGO_HOME:-$HOME/.cargo}/bin/pjdfstest" ]; then echo "${CARGO_HOME:-$HOME/.cargo}/bin/pjdfstest"
  fi
}
PJD=$(find_pjdfstest)
if [ -z "$PJD" ] || ! [ -x "$PJD" ]; then
  [ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
  command -v cargo >/dev/null || die "cargo not found; install Rust (scripts/deps.sh) first"
  say "installing pjdfstest $PJDFSTEST_VERSION (cargo install)"
  cargo install pjdfstest --version "$PJDFSTEST_VERSION" --locked >&2 ||
    die "cargo install pjdfstest failed (on Debian it may need: apt-get install libacl1-dev)"
  PJD=${CARGO_HOME:-$HOME/.cargo}/bin/pjdfstest
  [ -x "$PJD" ] || die "pjdfstest not found in ${CARGO_HOME:-$HOME/.cargo}/bin after installing it"
fi
"$PJD" --version >&2 || true

# pjdfstest needs two unprivileged users, each with a group of its own (its defaults are `nobody`
# and `tests`). `nobody` exists everywhere; `tests` is made here if missing.
getent passwd nobody >/dev/null || die "no user 'nobody'"
NOBODY_GROUP=$(id -gn nobody)
if ! getent passwd tests >/dev/null; then
  say "creating the system user 'tests' (pjdfstest's second dummy user)"
  useradd --system --user-group --no-create-home --home-dir / --shell /usr/sbin/nologin \
    --comment "Dummy user for pjdfstest" tests
fi
TESTS_GROUP=$(id -gn tests)

if [ ${#STACKS[@]} -gt 0 ]; then
  if [ -n "${PLYFS_BIN:-}" ]; then
    PLYFS=$PLYFS_BIN
  else
    [ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
    say "building plyfs (release)"
    (cd "$REPO" && cargo build --release >&2)
    PLYFS=$REPO/target/release/plyfs
  fi
  [ -x "$PLYFS" ] || die "plyfs binary not found: $PLYFS"
  PLYFS=$(cd "$(dirname "$PLYFS")" && pwd)/$(basename "$PLYFS")
fi

# ---------------------------------------------------------------------------------------------
# Work and results directories, configurations.

WORK_BASE=${PJDFSTEST_WORKDIR:-/var/tmp}
mkdir -p "$WORK_BASE"
case "$(stat -f -c %T "$WORK_BASE")" in
  tmpfs|ramfs) die "$WORK_BASE is $(stat -f -c %T "$WORK_BASE"); set PJDFSTEST_WORKDIR to a directory on a disk (ext4)" ;;
esac
WORK=$(mktemp -d "$WORK_BASE/plyfs-pjd.XXXXXX")
chmod 755 "$WORK"
RESULTS=${PJDFSTEST_RESULTS:-$REPO/target/pjdfstest/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
say "work directory $WORK ($(stat -f -c %T "$WORK_BASE")); logs in $RESULTS"

make_config() { # ALLOW_REMOUNT OUT
  grep -q '^allow_remount *=' "$HERE/plyfs.toml" || die "plyfs.toml has no 'allow_remount =' line"
  sed "s/^allow_remount *=.*/allow_remount = $1/" "$HERE/plyfs.toml" >"$2"
  if ! grep -q '^\[dummy_auth\]' "$2"; then
    printf '\n[dummy_auth]\nentries = [["nobody", "%s"], ["tests", "%s"]]\n' "$NOBODY_GROUP" "$TESTS_GROUP" >>"$2"
  fi
}
CONFIG=$WORK/pjdfstest.toml
CONFIG_RO=$WORK/pjdfstest-remount.toml
make_config false "$CONFIG"
make_config true "$CONFIG_RO"
cp "$CONFIG" "$RESULTS/pjdfstest.toml"

SHIM=$WORK/bin
mkdir -p "$SHIM"
printf '#!/bin/sh\n# Remount without helpers (see run.sh).\nexec %s -i "$@"\n' "$REAL_MOUNT" >"$SHIM/mount"
chmod 755 "$SHIM/mount"

KNOWN=$WORK/known-failures
sed -e 's/#.*//' -e 's/[[:space:]]//g' -e '/^$/d' "$HERE/known-failures.txt" | sort -u >"$KNOWN"

# A secondary file system for the EXDEV tests: for plyfs mounts, a directory on the disk.
SECONDARY=$WORK/secondary
mkdir -p "$SECONDARY"
chmod 777 "$SECONDARY"

# ---------------------------------------------------------------------------------------------
# Running pjdfstest and reading its output.

export NO_COLOR=1 RUST_BACKTRACE=0 RUST_LIB_BACKTRACE=0

# Run pjdfstest in the background so a signal to this script is handled at once (the traps kill
# it by pid). Sets RC.
run_pjdfstest() { # LOG ENV_PATH ARGS...
  local log=$1 path=$2
  shift 2
  (cd / && PATH="$path" exec timeout --kill-after=10 "$TIMEOUT" "$PJD" "$@") >"$log" 2>&1 &
  CHILD=$!
  RC=0
  wait "$CHILD" || RC=$?
  CHILD=""
  if [ "$RC" -eq 124 ] || [ "$RC" -eq 137 ]; then
    echo "pjdfstest/run.sh: pjdfstest timed out after ${TIMEOUT}s (see $log)" >&2
  elif ! grep -q '^Summary:' "$log"; then
    echo "pjdfstest/run.sh: pjdfstest ended without a summary (exit $RC; see $log)" >&2
    tail -5 "$log" >&2
  fi
}

# One `NAME STATUS` line per test from a pjdfstest log (STATUS: pass fail skip xfail xpass).
parse_results() { # LOG
  sed 's/\x1b\[[0-9;]*m//g' "$1" | awk '
    /^[^ \t].*::[^ \t]*[ \t]+(ok|FAILED|skipped|failed as expected|PASSED UNEXPECTEDLY)$/ {
      s = $0; name = $1
      if (s ~ /PASSED UNEXPECTEDLY$/) st = "xpass"
      else if (s ~ /failed as expected$/) st = "xfail"
      else if (s ~ /FAILED$/) st = "fail"
      else if (s ~ /skipped$/) st = "skip"
      else st = "pass"
      print name, st
    }'
}

# The message pjdfstest printed under a failed test.
# awk reads to the end rather than exiting early: an early exit would kill sed with SIGPIPE, and
# under pipefail and errexit that ended the whole script in the middle of a report.
failure_detail() { # LOG NAME
  sed 's/\x1b\[[0-9;]*m//g' "$1" | awk -v want="$2" '
    done { next }
    /^[^ \t].*::[^ \t]*[ \t]+(ok|FAILED|skipped|failed as expected|PASSED UNEXPECTEDLY)$/ {
      if (grab) { done = 1; next }
      if ($1 == want && $0 ~ /FAILED$/) { grab = 1; n = 0 }
      next
    }
    grab && (/^$/ || /^(Stack )?[Bb]acktrace:/) { done = 1; next }
    grab && n < 12 { sub(/^[ \t]+/, ""); print "        " $0; n++ }'
}

# Merge result lists: a later list overrides skips (the EROFS pass), a failure anywhere wins.
merge_results() { # OUT FILES...
  local out=$1
  shift
  awk '
    { if (!($1 in st)) { order[++n] = $1; st[$1] = $2 }
      else if ($2 == "fail" || $2 == "xpass") st[$1] = $2
      else if (st[$1] == "skip") st[$1] = $2 }
    END { for (i = 1; i <= n; i++) print order[i], st[order[i]] }' "$@" >"$out"
}

declare -A NATIVE_FAILED=()
OVERALL=0
SUMMARY=$RESULTS/summary.txt
: >"$SUMMARY"

# Run both passes for one target. LABEL names the logs; DIR is where tests run; SEC is the
# secondary file system or ""; RO_DIR is a directory on a remountable file system or "".
# Sets TARGET_ERROR when pjdfstest timed out or crashed.
run_target() { # LABEL DIR SEC RO_DIR
  local label=$1 dir=$2 sec=$3 ro_dir=$4 r log sec_args=() results=()
  [ -n "$sec" ] && sec_args=(-s "$sec")
  for ((r = 1; r <= REPEAT; r++)); do
    log=$RESULTS/$label.log
    [ "$REPEAT" -gt 1 ] && log=$RESULTS/$label.run$r.log
    run_pjdfstest "$log" "$PATH" -c "$CONFIG" -p "$dir" "${sec_args[@]}" ${PATTERNS[@]+"${PATTERNS[@]}"}
    if [ "$RC" -eq 124 ] || [ "$RC" -eq 137 ]; then
      TARGET_ERROR=${TARGET_ERROR:-"pjdfstest timed out after ${TIMEOUT}s"}
    elif ! grep -q '^Summary:' "$log"; then
      TARGET_ERROR=${TARGET_ERROR:-"pjdfstest ended without a summary (exit $RC)"}
    fi
    parse_results "$log" >"$log.results"
    results+=("$log.results")
  done
  # The EROFS pass, if the main pass selected any EROFS test.
  if grep -q 'erofs' "${results[0]}"; then
    if [ -n "$ro_dir" ]; then
      log=$RESULTS/$label.erofs.log
      local ro_patterns=(erofs)
      [ ${#PATTERNS[@]} -gt 0 ] && ro_patterns=("${PATTERNS[@]}")
      run_pjdfstest "$log" "$SHIM:$PATH" -c "$CONFIG_RO" -p "$ro_dir" "${ro_patterns[@]}"
      if ! grep -q '^Summary:' "$log"; then
        TARGET_ERROR=${TARGET_ERROR:-"pjdfstest ended without a summary in the EROFS pass (exit $RC)"}
      fi
      parse_results "$log" | awk '$1 ~ /erofs/' >"$log.results"
      results+=("$log.results")
    else
      echo "   (EROFS tests skipped: no remountable file system for $label)" >&2
    fi
  fi
  merge_results "$RESULTS/$label.results" "${results[@]}"
}

# Print and record the outcome of one target; updates OVERALL and NATIVE_FAILED.
report_target() { # LABEL TITLE IS_NATIVE
  local label=$1 title=$2 native=$3 res=$RESULTS/$1.results out=$RESULTS/$1.report
  local pass fail skip total name st tags f d
  pass=$(awk '$2 == "pass" || $2 == "xfail"' "$res" | wc -l)
  fail=$(awk '$2 == "fail" || $2 == "xpass"' "$res" | wc -l)
  skip=$(awk '$2 == "skip"' "$res" | wc -l)
  total=$(wc -l <"$res")
  {
    echo
    echo "### $title: $pass passed, $fail failed, $skip skipped ($total tests)"
    if [ -n "$TARGET_ERROR" ]; then
      echo "  ERROR: $TARGET_ERROR (see $RESULTS/$label*.log)"
      OVERALL=1
    fi
    while read -r name st; do
      if [ "$st" != fail ] && [ "$st" != xpass ]; then continue; fi
      tags=""
      if grep -qxF "$name" "$KNOWN"; then
        tags="known failure, tolerated"
      elif [ "$TOLERATE_NATIVE" = 1 ] && { [ "$native" = 1 ] || [ -n "${NATIVE_FAILED[$name]:-}" ]; }; then
        tags="fails on the lower file system itself, tolerated"
      else
        OVERALL=1
      fi
      if [ "$native" = 0 ] && [ -n "${NATIVE_FAILED[$name]:-}" ]; then tags="${tags:+$tags; }also fails natively"; fi
      echo "  FAILED $name${tags:+ [$tags]}"
      for f in "$RESULTS/$label".log "$RESULTS/$label".run*.log "$RESULTS/$label".erofs.log; do
        [ -f "$f" ] || continue
        d=$(failure_detail "$f" "$name")
        if [ -n "$d" ]; then echo "$d"; break; fi
      done
      if [ "$native" = 1 ]; then NATIVE_FAILED[$name]=1; fi
    done <"$res"
    while read -r name st; do
      if [ "$st" = skip ]; then echo "  skipped $name"; fi
    done <"$res"
    while read -r name; do
      if grep -qxF "$name pass" "$res"; then echo "  note: $name is in known-failures.txt but passed"; fi
    done <"$KNOWN"
  } >"$out"
  tee -a "$SUMMARY" <"$out" >&2
}

# ---------------------------------------------------------------------------------------------
# Native baseline: a plain directory on the same disk the lower directories live on.

if [ "$RUN_NATIVE" = 1 ]; then
  say "native baseline on $(stat -f -c %T "$WORK") ($WORK/native)"
  mkdir -p "$WORK/native"
  chmod 755 "$WORK/native"
  # The EROFS pass needs a file system that may be remounted: a loop-mounted ext4 image.
  NATIVE_RO=""
  NATIVE_SEC=""
  if command -v mkfs.ext4 >/dev/null && truncate -s 64M "$WORK/ext4.img" 2>/dev/null &&
    mkfs.ext4 -q -F "$WORK/ext4.img" >/dev/null 2>&1 && mkdir -p "$WORK/loop" &&
    "$REAL_MOUNT" -o loop "$WORK/ext4.img" "$WORK/loop" 2>/dev/null; then
    LOOP_MNT=$WORK/loop
    chmod 755 "$LOOP_MNT"
    NATIVE_RO=$LOOP_MNT
    mkdir -p "$LOOP_MNT/secondary" && chmod 777 "$LOOP_MNT/secondary"
    NATIVE_SEC=$LOOP_MNT/secondary
  else
    echo "   (cannot loop-mount an ext4 image: the native EROFS tests are skipped)" >&2
    if [ -d /dev/shm ] && [ "$(stat -c %d /dev/shm)" != "$(stat -c %d "$WORK")" ]; then
      NATIVE_SEC=$(mktemp -d /dev/shm/plyfs-pjd-secondary.XXXXXX)
    fi
  fi
  TARGET_ERROR=""
  run_target native "$WORK/native" "$NATIVE_SEC" "$NATIVE_RO"
  report_target native "native $(stat -f -c %T "$WORK") ($WORK/native)" 1
  if [ -n "$LOOP_MNT" ]; then
    umount "$LOOP_MNT" 2>/dev/null || umount -l "$LOOP_MNT" || true
    LOOP_MNT=""
  elif [ -n "$NATIVE_SEC" ]; then
    rm -rf "$NATIVE_SEC"
  fi
fi

# ---------------------------------------------------------------------------------------------
# plyfs stacks.

i=0
for entry in ${STACKS[@]+"${STACKS[@]}"}; do
  i=$((i + 1))
  spec=${entry%% *}
  extra=()
  [ "$spec" = "$entry" ] || read -r -a extra <<<"${entry#* }"
  [ ${#extra[@]} -eq 0 ] || spec="$spec ${extra[*]}"
  label="$i-$(printf '%s' "$spec" | tr -c 'A-Za-z0-9_.-' '_' | cut -c1-40)"
  lower=$WORK/$i-lower
  mnt=$WORK/$i-mnt
  mkdir -p "$lower" "$mnt"
  chmod 755 "$lower"
  opts=allow_other${MOUNT_OPTS:+,$MOUNT_OPTS}
  say "stack '$spec' (-o $opts): $lower on $mnt"
  TARGET_ERROR=""
  MOUNTS+=("$mnt")   # registered first, so the traps unmount it even if mounting is interrupted
  DAEMONS+=("")
  # A crypt layer needs a crypt volume below, unlocked with its password.
  if [[ ",${entry%% *}," == *,crypt[,:]* ]]; then
    passfile=$WORK/$i-passfile
    printf 'pjdfstest password %s\n' "$i" >"$passfile"
    chmod 600 "$passfile"
    # `--bind-paths` among a crypt stack's arguments is a setting of its volume, for `init`.
    init_args=() && [[ " ${extra[*]-} " == *" --bind-paths "* ]] && init_args=(--bind-paths) && read -r -a extra <<<"${extra[*]/--bind-paths/}"
    out=$("$PLYFS" init "$lower" --layer crypt --passfile "$passfile" ${init_args[@]+"${init_args[@]}"} 2>&1) || {
      {
        echo
        echo "### plyfs stack '$spec': plyfs init FAILED"
        echo "$out" | sed 's/^/  /'
      } | tee -a "$SUMMARY" >&2
      OVERALL=1
      continue
    }
    extra+=(--passfile "$passfile")
  fi
  # A fan-out layer gets its further branches here: a union writes over a read-only branch that
  # already holds files; a mirror gets a second, empty branch.
  case ",${entry%% *}" in
    *,union*)
      ro=$WORK/$i-ro
      mkdir -p "$ro/dir/sub" && chmod 755 "$ro"
      echo "lower file" >"$ro/file" && echo "deeper" >"$ro/dir/sub/file" && ln -sf file "$ro/link"
      extra+=(--branch "$ro=ro")
      ;;
    *,mirror*)
      mkdir -p "$WORK/$i-mirror" && chmod 755 "$WORK/$i-mirror"
      extra+=(--branch "$WORK/$i-mirror")
      ;;
    *,cache*\[*) ;;
    *,cache*)
      # The lower is the fast branch (the copies); the files themselves live on the slow one.
      mkdir -p "$WORK/$i-slow" && chmod 755 "$WORK/$i-slow"
      extra+=(--branch "$WORK/$i-slow")
      ;;
  esac
  # A stack ending in `remote` mounts a stack that `plyfs serve` exports over a Unix socket: the
  # layers before `remote` run in the mount, `null` in the server.
  mount_lower=$lower
  mount_stack=${entry%% *}
  server=""
  # `ext:socket=@LAYER` hosts LAYER in a `plyfs host` process of its own and reaches it there.
  if [[ "$mount_stack" =~ ext:socket=@([a-z0-9]+) ]]; then
    hosted=${BASH_REMATCH[1]}
    hsock=$WORK/$i.host.sock
    "$PLYFS" host "$hosted" --socket "$hsock" 2>"$RESULTS/$label.host.log" &
    SERVERS+=("$!")
    for _ in $(seq 100); do [ -S "$hsock" ] && break; sleep 0.05; done
    [ -S "$hsock" ] || die "plyfs host did not make $hsock (see $RESULTS/$label.host.log)"
    mount_stack=${mount_stack/@$hosted/$hsock}
  fi
  # With `--tls` among its arguments, over TCP on loopback with TLS and a pre-shared key.
  tls=0
  rest=()
  for a in ${extra[@]+"${extra[@]}"}; do if [ "$a" = --tls ]; then tls=1; else rest+=("$a"); fi; done
  extra=(${rest[@]+"${rest[@]}"})
  if [[ ",$mount_stack" == *,remote ]]; then
    # A crypt layer in the mount decrypts a volume the server serves as stored, without its key.
    serve_args=(--stack null)
    if [[ ",$mount_stack," == *,crypt[,:]* ]]; then serve_args+=(--as-stored); fi
    if [ "$tls" = 1 ]; then
      head -c 32 /dev/urandom >"$WORK/$i.psk"
      chmod 600 "$WORK/$i.psk"
      port=$((20000 + ($$ + i * 97) % 20000))
      "$PLYFS" serve "$lower" --listen "tcp:127.0.0.1:$port" --psk "$WORK/$i.psk" --no-root-squash "${serve_args[@]}" 2>"$RESULTS/$label.server.log" &
      server=$!
      SERVERS+=("$server")
      for _ in $(seq 100); do grep -q serving "$RESULTS/$label.server.log" 2>/dev/null && break; sleep 0.05; done
      mount_lower=tcp:127.0.0.1:$port
      extra+=(--psk "$WORK/$i.psk")
    else
      sock=$WORK/$i.sock
      "$PLYFS" serve "$lower" --listen "unix:$sock" "${serve_args[@]}" 2>"$RESULTS/$label.server.log" &
      server=$!
      SERVERS+=("$server")
      for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.05; done
      [ -S "$sock" ] || die "plyfs serve did not make $sock (see $RESULTS/$label.server.log)"
      mount_lower=unix:$sock
    fi
    mount_stack=${mount_stack%remote}
    mount_stack=${mount_stack%,}
    mount_stack=${mount_stack:-null}
  fi
  # `cache...[|remote]`: the lower is the fast branch, and the slow one a `plyfs serve` of a
  # directory of its own over a Unix socket.
  if [[ "$mount_stack" =~ ^(cache[^[]*)\[\|remote\]$ ]]; then
    cache_spec=${BASH_REMATCH[1]}
    mkdir -p "$WORK/$i-slow" && chmod 755 "$WORK/$i-slow"
    sock=$WORK/$i.slow.sock
    "$PLYFS" serve "$WORK/$i-slow" --listen "unix:$sock" --stack null 2>"$RESULTS/$label.server.log" &
    server=$!
    SERVERS+=("$server")
    for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.05; done
    [ -S "$sock" ] || die "plyfs serve did not make $sock (see $RESULTS/$label.server.log)"
    mount_stack="$cache_spec[@$lower | remote:addr=unix:$sock]"
    mount_lower=-
  fi
  # A stack ending in `exofs` mounts exofs on an exodisk volume of its own (an image in the work
  # directory, served by `plyfs exodisk serve`); the layers before `exofs` run in the mount.
  if [[ ",$mount_stack" == *,exofs ]]; then
    img=$WORK/$i.img
    "$PLYFS" exodisk format "$img" --size 512M >/dev/null
    "$PLYFS" exodisk serve "$img" --socket "$WORK/$i.exo.sock" 2>"$RESULTS/$label.server.log" &
    server=$!
    SERVERS+=("$server")
    for _ in $(seq 200); do [ -S "$WORK/$i.exo.sock" ] && break; sleep 0.05; done
    [ -S "$WORK/$i.exo.sock" ] || die "plyfs exodisk serve did not make its socket (see $RESULTS/$label.server.log)"
    mount_lower=exodisk:$WORK/$i.exo.sock
    mount_stack=${mount_stack%exofs}
    mount_stack=${mount_stack%,}
    mount_stack=${mount_stack:-null}
  fi
  out=$(timeout 60 "$PLYFS" mount "$mount_lower" "$mnt" --stack "$mount_stack" ${extra[@]+"${extra[@]}"} -o "$opts" --log "$RESULTS/$label.daemon.log" 2>&1) || {
    echo "$out" >&2
    {
      echo
      echo "### plyfs stack '$spec': MOUNT FAILED"
      echo "$out" | sed 's/^/  /'
    } | tee -a "$SUMMARY" >&2
    OVERALL=1
    continue
  }
  echo "   $out" >&2
  pid=$(echo "$out" | sed -n 's/.*(pid \([0-9]*\)).*/\1/p' | head -1)
  DAEMONS[${#DAEMONS[@]} - 1]=${pid:-}
  mountpoint -q "$mnt" || die "plyfs mount reported success but $mnt is not a mount point"
  run_target "$label" "$mnt" "$SECONDARY" "$mnt"
  if [[ "$spec" == trace* ]]; then
    timeout 10 "$PLYFS" op "$mnt" stats >"$RESULTS/$label.stats.json" 2>&1 || true
  fi
  unmount_plyfs "$mnt" "${pid:-}"
  DAEMONS[${#DAEMONS[@]} - 1]=""   # gone; never signal that pid again
  if [ -n "$server" ]; then
    stop_server "$server"
    SERVERS=("${SERVERS[@]/$server}")
    if grep -qi 'panick' "$RESULTS/$label.server.log" 2>/dev/null; then
      TARGET_ERROR=${TARGET_ERROR:-"plyfs serve panicked (see $RESULTS/$label.server.log)"}
    fi
  fi
  if mountpoint -q "$mnt"; then TARGET_ERROR=${TARGET_ERROR:-"$mnt still mounted after plyfs umount"}; fi
  if grep -qi 'panick' "$RESULTS/$label.daemon.log" 2>/dev/null; then
    TARGET_ERROR=${TARGET_ERROR:-"the plyfs daemon panicked (see $RESULTS/$label.daemon.log)"}
  fi
  report_target "$label" "plyfs stack '$spec' (-o $opts)" 0
done

echo >&2
if [ "$OVERALL" = 0 ]; then
  say "pjdfstest: no unexpected failures (summary: $SUMMARY)"
else
  say "pjdfstest: UNEXPECTED FAILURES (summary: $SUMMARY)"
fi
exit "$OVERALL"
