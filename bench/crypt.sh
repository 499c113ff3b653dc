#!/usr/bin/env bash
# bench/crypt.sh: the benchmarks of the crypt layer (issue #5): plyfs's encryption against
# gocryptfs and the plain directory, every baseline measured in the same run.
#
#   bench/crypt.sh [--quick] [--runs N] [--only BENCHES] [--no-write-doc]
#
# Configurations:
#   native      the lower directory itself
#   gocryptfs   gocryptfs 2.3 (Debian's package): `gocryptfs -init -scryptn 10`, then mounted with
#               its defaults (AES-256-GCM, encrypted names)
#   crypt       plyfs --stack crypt       (a volume made by `plyfs init --layer crypt`: AES-256-GCM,
#                                         encrypted names)
#   zstd-crypt  plyfs --stack zstd,crypt  (the same kind of volume; compress, then seal, collapsed
#                                         into one layer)
#   null        plyfs --stack null        (no encryption; passthrough on: for reference)
#
# Benchmarks (--only takes a comma-separated list of these names):
#   io     all five configurations mounted side by side, every step done in each of them in turn:
#          sequential write of a 1 GiB file of incompressible data (psync: pwrite(2) of 1 MiB
#          blocks; timed from open(2) to after close(2)), without fsync and with an fsync before
#          the close (fio's --end_fsync=1); then, after unmounting, dropping caches and mounting
#          again, a cold sequential read (caches dropped; fio, 1 MiB blocks, psync, open
#          included) and two warm reads straight after it; a 256 MiB file, read once, then warm
#          4 KiB random reads (fio randread, psync) for 10 s                       MiB/s, IOPS
#   tree   the tarball of /usr/include (as bench/sca.sh and bench/policy.sh build it) in each
#          configuration: untar (then sync, timed apart), read every file cold (remount, caches
#          dropped; find -exec cat), ls -lR cold (remount, caches dropped) and warm, rm -rf (then
#          sync). In the first
#          repetition every file and symlink is read back through a fresh mount and checked
#          against the tarball's, the lower directory is checked for plaintext names and data,
#          and its space (du) is taken                                                 s, bytes
#   comp   a 256 MiB compressible text file (the headers of /usr/include, repeated) in native,
#          gocryptfs, crypt and zstd-crypt: written (as io, from memory; then sync, timed apart),
#          read cold and warm (fio); the space it takes in the lower directory; checked against
#          the source through a fresh mount in the first repetition          MiB/s, bytes
#
# Each repetition runs every configuration of a benchmark (in a rotated order, so slow drifts in
# the machine's noise hit them all alike); the median over repetitions is reported. Raw values go
# to BENCH_OUT/crypt/results.csv; a run rewrites the section between the markers
# <!-- crypt:begin --> and <!-- crypt:end --> in docs/benchmarks.md (appended if missing).
#
# Environment: PLYFS_BIN (use this binary instead of building; PLYFS_REV describes it in the
# report), BENCH_OUT (default REPO/bench-out; must not be on tmpfs), CRYPT_DOC (write the section
# into this file instead of docs/benchmarks.md).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ALL_BENCHES=(io tree comp)
CMDLINE="${PLYFS_BIN:+PLYFS_BIN=$PLYFS_BIN }bench/crypt.sh${*:+ $*}"

usage() {
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
    echo "Options:"
    echo "  --quick          2 runs; a 512 MiB file, 128 MiB files for random reads (5 s) and compressible data (explicit options win)"
    echo "  --runs N         repetitions per measurement (default 5)"
    echo "  --only LIST      comma-separated benchmarks (default: all)"
    echo "  --no-write-doc   do not touch docs/benchmarks.md"
}

quick=0 runs="" only="" write_doc=1
while (($#)); do
    case $1 in
        --quick) quick=1 ;;
        --runs) runs=${2:?--runs needs a number}; shift ;;
        --runs=*) runs=${1#*=} ;;
        --only) only=${2:?--only needs a list}; shift ;;
        --only=*) only=${1#*=} ;;
        --no-write-doc) write_doc=0 ;;
        -h | --help) usage; exit 0 ;;
        *) echo "crypt.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
    shift
done
MiB=1048576
if ((quick)); then
    RUNS=${runs:-2}
    IO_SIZE=$((512 * MiB))
    RAND_SIZE=$((128 * MiB))
    RAND_TIME=5
    COMP_SIZE=$((128 * MiB))
else
    RUNS=${runs:-5}
    IO_SIZE=$((1024 * MiB))
    RAND_SIZE=$((256 * MiB))
    RAND_TIME=10
    COMP_SIZE=$((256 * MiB))
fi
[[ $RUNS =~ ^[1-9][0-9]*$ ]] || { echo "crypt.sh: --runs must be a positive integer" >&2; exit 2; }
if [[ -n $only ]]; then
    IFS=, read -r -a BENCHES <<<"$only"
    for b in "${BENCHES[@]}"; do
        [[ " ${ALL_BENCHES[*]} " == *" $b "* ]] || { echo "crypt.sh: unknown benchmark '$b' (${ALL_BENCHES[*]})" >&2; exit 2; }
    done
else
    BENCHES=("${ALL_BENCHES[@]}")
fi
want() { [[ " ${BENCHES[*]} " == *" $1 "* ]]; }
[[ $EUID -eq 0 ]] || { echo "crypt.sh: must run as root (drop_caches, mounting)" >&2; exit 1; }

# Progress goes to the script's own standard error (fd 3), even from inside a redirected command
# or from the cleanup trap.
exec 3>&2
. "$REPO/bench/common.sh"

# ---------------------------------------------------------------- dependencies
install_missing fio fusermount3:fuse3 python3 jq zstd gocryptfs

# ---------------------------------------------------------------- directories
set_out_dir crypt.sh
DATA=$OUT/data
S=$OUT/crypt
LOWERS=$S/lower # one lower directory per benchmark and configuration: $LOWERS/BENCH-CFG
MNTS=$S/mnt     # one mount point per configuration: $MNTS/CFG
LOGDIR=$S/logs
WORK=$S/work
TS=$(date +%Y%m%d-%H%M%S)
CSV=$S/results-$TS.csv
FAILLOG=$S/failures-$TS.log
MISMATCH=$S/mismatches-$TS.log
TARBALL=$OUT/include.tar # shared with bench/run.sh, bench/sca.sh and bench/policy.sh
PWFILE=$S/password

if grep -q " $MNTS/" /proc/self/mountinfo; then
    echo "crypt.sh: something is still mounted under $MNTS (from an earlier run?); unmount it first" >&2
    exit 1
fi

# ---------------------------------------------------------------- state and cleanup
CHILD=""            # pid of the background command being waited for
declare -A MPID=()  # mount point -> the daemon serving it (plyfs or gocryptfs), while mounted
declare -A MKIND=() # mount point -> plyfs | gocryptfs, while mounted
CUR_CFG=""
CUR_BENCH=""
REP=0

pid_alive() { # PID: exists and is not a zombie
    local st
    st=$(sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1) || return 1
    [[ -n $st && $st != Z && $st != X ]]
}

# unmount_at MNT: unmount one of our mounts, then wait (bounded) for its daemon to exit; a daemon
# still running 10 s after its unmount is sent SIGTERM (it is one this script started).
unmount_at() {
    local mnt=$1 pid i
    [[ -n ${MKIND[$mnt]:-} ]] || return 0
    if is_mounted "$mnt"; then
        if [[ ${MKIND[$mnt]} == plyfs ]]; then
            timeout 60 "$PLYFS" umount "$mnt" 2>>"$FAILLOG" ||
                timeout 30 "$PLYFS" umount --lazy "$mnt" 2>>"$FAILLOG" ||
                fusermount3 -uz "$mnt" 2>>"$FAILLOG" ||
                umount -l "$mnt" 2>>"$FAILLOG" || true
        else
            timeout 60 fusermount3 -u "$mnt" 2>>"$FAILLOG" ||
                umount -l "$mnt" 2>>"$FAILLOG" || true
        fi
    fi
    if is_mounted "$mnt"; then
        log "WARNING: $mnt is still mounted after unmounting"
        return 1
    fi
    pid=${MPID[$mnt]:-}
    if [[ -n $pid ]]; then
        for ((i = 0; i < 100; i++)); do
            pid_alive "$pid" || break
            sleep 0.1
        done
        if pid_alive "$pid"; then
            log "WARNING: daemon $pid (${MKIND[$mnt]}) still running 10 s after unmount; terminating it"
            echo "daemon $pid (${MKIND[$mnt]}) still running after unmount; sent SIGTERM" >>"$FAILLOG"
            kill -TERM "$pid" 2>/dev/null || true
        fi
    fi
    unset "MKIND[$mnt]" "MPID[$mnt]"
}

unmount_all() { # every mount of ours; returns 1 if one stays mounted
    local mnt rc=0
    for mnt in "${!MKIND[@]}"; do
        unmount_at "$mnt" || rc=1
    done
    return "$rc"
}

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [[ -n $CHILD ]]; then
        kill -TERM "$CHILD" 2>/dev/null || true
        wait "$CHILD" 2>/dev/null || true
        CHILD=""
    fi
    if ((${#MKIND[@]})); then
        log "cleanup: unmounting ${!MKIND[*]}"
        unmount_all || true
    fi
    rm -rf "$WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---------------------------------------------------------------- plyfs binary
use_plyfs crypt.sh "$S/bin" 1

# The commit the run starts from (HEAD may move while it runs; the binary under test does not).
HEAD_AT_START=$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)
T_START=$SECONDS
rm -rf "$LOWERS" "$WORK" "$LOGDIR"
mkdir -p "$S" "$LOWERS" "$MNTS" "$LOGDIR" "$WORK" "$DATA"
echo "rep,bench,config,metric,value,unit" >"$CSV"
: >"$FAILLOG"
: >"$MISMATCH"
echo "plyfs-crypt-bench-password" >"$PWFILE"
chmod 600 "$PWFILE"

# ---------------------------------------------------------------- helpers (python)
# pwrite.py PATH SIZE FSYNC [SRC]: write SIZE bytes sequentially in 1 MiB pwrite(2)s (fio's
# psync engine does the same), timed from open(2) to after close(2): with FSYNC=1 an fsync(2)
# comes before the close. The data: SRC's first SIZE bytes (read into memory first), or else a
# 16 MiB pool of random bytes, cycled (incompressible at any chunk size). Prints the seconds.
cat >"$S/pwrite.py" <<'PY'
import os, sys, time
path, size, fsync = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
BS = 1 << 20
if len(sys.argv) > 4:
    with open(sys.argv[4], "rb") as f:
        pool = f.read(size)
    if len(pool) < size:
        sys.exit(f"{sys.argv[4]}: shorter than {size} bytes")
else:
    pool = os.urandom(16 * BS)
pool = memoryview(pool)
t0 = time.perf_counter()
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
off = 0
while off < size:
    n = min(BS, size - off)
    p = off % len(pool)
    buf = pool[p:p + n]
    done = 0
    while done < n:
        done += os.pwrite(fd, buf[done:], off + done)
    off += n
if fsync:
    os.fsync(fd)
os.close(fd)
t1 = time.perf_counter()
print(f"{t1 - t0:.6f}")
PY

# leakcheck.py LOWER NEEDLE...: how many files under LOWER contain one of the NEEDLEs (bytes) or
# have one of them in their name; prints "FILES_WITH_DATA FILES_WITH_NAME".
cat >"$S/leakcheck.py" <<'PY'
import os, sys
top = sys.argv[1]
needles = [n.encode() for n in sys.argv[2:]]
data_hits = name_hits = 0
for d, dirs, files in os.walk(top):
    for n in dirs + files:
        if any(x in n.encode() for x in needles):
            name_hits += 1
    for n in files:
        p = os.path.join(d, n)
        if os.path.islink(p):
            continue
        with open(p, "rb") as f:
            b = f.read()
        if any(x in b for x in needles):
            data_hits += 1
print(data_hits, name_hits)
PY

# ---------------------------------------------------------------- data
TREE_FILES=0 TREE_LINKS=0 TREE_BYTES=0 TAR_BYTES=0
if want tree; then
    if [[ ! -s $TARBALL ]]; then
        log "creating $TARBALL from /usr/include"
        tar -C /usr -cf "$TARBALL.tmp" include
        mv "$TARBALL.tmp" "$TARBALL"
    fi
    # A reference copy of our own, with the md5 sums of its files and the targets of its symlinks.
    TREE_SRC=$DATA/crypt-tree
    STAMP="$(stat -c %s-%Y "$TARBALL")"
    if [[ ! -f $DATA/crypt-tree.stamp || $(cat "$DATA/crypt-tree.stamp") != "$STAMP" ]]; then
        log "unpacking the reference tree into $TREE_SRC"
        rm -rf "$TREE_SRC"
        mkdir -p "$TREE_SRC"
        tar -C "$TREE_SRC" -xf "$TARBALL"
        (cd "$TREE_SRC" && find . -type f | LC_ALL=C sort) >"$DATA/crypt-tree.files"
        (cd "$TREE_SRC" && xargs -d '\n' md5sum <"$DATA/crypt-tree.files") >"$DATA/crypt-tree.md5"
        (cd "$TREE_SRC" && find . -type l -printf '%p\t%l\n' | LC_ALL=C sort) >"$DATA/crypt-tree.links"
        echo "$STAMP" >"$DATA/crypt-tree.stamp"
    fi
    TREE_FILES=$(wc -l <"$DATA/crypt-tree.files")
    TREE_LINKS=$(wc -l <"$DATA/crypt-tree.links")
    TREE_BYTES=$(cd "$TREE_SRC" && xargs -d '\n' stat -c %s <"$DATA/crypt-tree.files" | awk '{ s += $1 } END { printf "%d", s }')
    TAR_BYTES=$(stat -c %s "$TARBALL")
fi
# The compressible file: the headers of /usr/include concatenated (in a fixed order), repeated up
# to COMP_SIZE.
COMP_SRC=$DATA/crypt-text-$((COMP_SIZE / MiB))M
if want comp && [[ ! -s $COMP_SRC || $(stat -c %s "$COMP_SRC") -ne $COMP_SIZE ]]; then
    log "creating $COMP_SRC ($((COMP_SIZE / MiB)) MiB of repeated header text)"
    find /usr/include -type f -name '*.h' | LC_ALL=C sort | xargs cat >"$WORK/text.one"
    [[ -s $WORK/text.one ]] || { echo "crypt.sh: no headers under /usr/include" >&2; exit 1; }
    # The file's contents over and over; head cuts the stream (the SIGPIPE is expected).
    { while :; do cat "$WORK/text.one" || break; done; } 2>/dev/null | head -c "$COMP_SIZE" >"$COMP_SRC.tmp" || true
    [[ $(stat -c %s "$COMP_SRC.tmp") -eq $COMP_SIZE ]] || { echo "crypt.sh: could not build $COMP_SRC" >&2; exit 1; }
    mv "$COMP_SRC.tmp" "$COMP_SRC"
    rm -f "$WORK/text.one"
fi
COMP_ZSTD_RATIO=""
if want comp; then
    # What zstd -3 (the layer's default level) makes of the whole file, for reference.
    COMP_ZSTD_RATIO=$(zstd -3 -q -c "$COMP_SRC" 2>/dev/null | wc -c | awk -v s="$COMP_SIZE" '{ printf "%.4f", $1 / s }') || COMP_ZSTD_RATIO=""
fi

# ---------------------------------------------------------------- mounting
declare -A STACK=([crypt]=crypt [zstd-crypt]=zstd,crypt [null]=null)
MOUNT_N=0
IOMODES=$S/io-modes-$TS.txt
: >"$IOMODES"
declare -A IOMODE_SEEN=()

# init_lower CFG LOWER: a fresh lower directory for CFG (a new volume for the encrypting ones).
init_lower() {
    local cfg=$1 lower=$2 out
    rm -rf "$lower"
    mkdir -p "$lower"
    case $cfg in
        crypt | zstd-crypt)
            if ! out=$(timeout 60 "$PLYFS" init "$lower" --layer crypt --passfile "$PWFILE" --kdf-memory 1024 2>&1); then
                log "plyfs init failed: $out"
                echo "$CUR_BENCH rep $REP $cfg: plyfs init failed: $out" >>"$FAILLOG"
                return 1
            fi
            ;;
        gocryptfs)
            if ! out=$(timeout 60 gocryptfs -init -q -extpass "cat $PWFILE" -scryptn 10 "$lower" 2>&1); then
                log "gocryptfs -init failed: $out"
                echo "$CUR_BENCH rep $REP $cfg: gocryptfs -init failed: $out" >>"$FAILLOG"
                return 1
            fi
            ;;
    esac
}

# gocryptfs_pid MNT: the gocryptfs daemon serving MNT (it forks itself into the background with
# -fg and the mount point as its last argument).
gocryptfs_pid() {
    local p last
    for p in /proc/[0-9]*; do
        [[ $(readlink "$p/exe" 2>/dev/null) == */gocryptfs ]] || continue
        last=$(tr '\0' '\n' <"$p/cmdline" 2>/dev/null | tail -n 1) || continue
        [[ $last == "$1" ]] && { echo "${p#/proc/}"; return 0; }
    done
    return 0
}

# target_of CFG LOWER MNT: the directory CFG's files go to.
target_of() { if [[ $1 == native ]]; then echo "$2"; else echo "$3"; fi; }

# mount_at CFG LOWER MNT: mount CFG over LOWER at MNT (native: nothing to do).
mount_at() {
    local cfg=$1 lower=$2 mnt=$3 out args=()
    [[ $cfg == native ]] && return 0
    mkdir -p "$mnt"
    MOUNT_N=$((MOUNT_N + 1))
    if [[ $cfg == gocryptfs ]]; then
        if ! out=$(timeout 60 gocryptfs -q -extpass "cat $PWFILE" "$lower" "$mnt" 2>&1); then
            log "gocryptfs mount failed: $out"
            echo "$CUR_BENCH rep $REP $cfg: gocryptfs mount failed: $out" >>"$FAILLOG"
            is_mounted "$mnt" && MKIND[$mnt]=gocryptfs
            return 1
        fi
        # (Its background process logs to syslog, which is not there: "SwitchToSyslog" noise.)
        grep -v 'Syslog' <<<"$out" >>"$LOGDIR/gocryptfs-$MOUNT_N.log" || true
        MKIND[$mnt]=gocryptfs
        MPID[$mnt]=$(gocryptfs_pid "$mnt")
    else
        [[ $cfg == crypt || $cfg == zstd-crypt ]] && args=(--passfile "$PWFILE")
        if ! out=$(timeout 60 "$PLYFS" mount "$lower" "$mnt" --stack "${STACK[$cfg]}" "${args[@]}" \
            --log "$LOGDIR/$CUR_BENCH-$cfg-$MOUNT_N.log" 2>&1); then
            log "plyfs mount failed: $out"
            echo "$CUR_BENCH rep $REP $cfg: plyfs mount failed: $out" >>"$FAILLOG"
            is_mounted "$mnt" && MKIND[$mnt]=plyfs
            return 1
        fi
        MKIND[$mnt]=plyfs
        MPID[$mnt]=$(sed -n 's/.*(pid \([0-9]*\)).*/\1/p' <<<"$out" | head -n 1)
        if [[ -z ${IOMODE_SEEN[$cfg]:-} ]]; then
            IOMODE_SEEN[$cfg]=1
            printf '%s\t%s\t%s\n' "$cfg" "--stack ${STACK[$cfg]}" \
                "$(sed -n 's/.*file I\/O: \(.*\); log: .*/\1/p' <<<"$out" | head -n 1)" >>"$IOMODES"
        fi
    fi
    is_mounted "$mnt" || { log "$cfg: $mnt is not mounted after mounting"; return 1; }
}

# remount_cold CFG LOWER MNT: unmount, drop caches, mount again (native: drop caches).
remount_cold() {
    if [[ $1 != native ]]; then
        unmount_at "$3" || return 1
    fi
    drop_caches
    mount_at "$@"
}

# daemon_pid CFG MNT: the daemon serving CFG at MNT (empty for native).
daemon_pid() { [[ $1 == native ]] && return 0; echo "${MPID[$2]:-}"; }

# pid_cpu_ns PID: its CPU time so far (all threads), in ns; 0 without a PID.
CLK_TCK=$(getconf CLK_TCK)
if [[ -r /proc/self/schedstat ]]; then CPU_SOURCE=schedstat; else CPU_SOURCE=stat; fi
pid_cpu_ns() {
    [[ -n $1 && -r /proc/$1/stat ]] || { echo 0; return; }
    if [[ $CPU_SOURCE == schedstat ]]; then
        cat "/proc/$1"/task/*/schedstat 2>/dev/null | awk '{ s += $1 } END { printf "%.0f", s }'
    else
        sed 's/^.*) //' "/proc/$1/stat" | awk -v hz="$CLK_TCK" '{ printf "%.0f", ($12 + $13) * 1e9 / hz }'
    fi
}

# warm_up DIR PROGRAM...: after dropping caches, page the programs under test back in, and the
# daemon behind DIR (a create, write, read and unlink through it).
warm_up() {
    local d=$1 p
    shift
    for p in "$@"; do
        case $p in
            python3) python3 -c pass ;;
            *) "$p" --version >/dev/null 2>&1 || true ;;
        esac
    done
    echo warm >"$d/.warm-up" && cat "$d/.warm-up" >/dev/null && rm -f "$d/.warm-up"
}

# ---------------------------------------------------------------- measurements
record() { # metric value unit
    echo "$REP,$CUR_BENCH,$CUR_CFG,$1,$2,$3" >>"$CSV"
    log "  rep $REP $CUR_BENCH $CUR_CFG $1: $2 $3"
}

fail() { # what message...
    local w=$1
    shift
    log "  FAILED rep $REP $CUR_BENCH $CUR_CFG $w: $*"
    {
        echo "$CUR_BENCH rep $REP $CUR_CFG $w: $*"
        [[ -s $WORK/err ]] && tail -n 20 "$WORK/err" | sed 's/^/    /'
    } >>"$FAILLOG"
    return 0
}

mismatch() { # what message...
    log "  DATA MISMATCH rep $REP $CUR_BENCH $CUR_CFG $1: $2"
    echo "$CUR_BENCH rep $REP $CUR_CFG $1: $2" >>"$MISMATCH"
}

# rotated CONFIGS...: prints the configurations in the order of repetition $REP.
rotated() {
    local n=$# i
    local a=("$@")
    for ((i = 0; i < n; i++)); do echo "${a[$(((i + REP - 1) % n))]}"; done
}

cpu_delta() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", (b - a) / 1e9 }'; }

# pwrite_timed METRIC FILE SIZE FSYNC [SRC]: a timed sequential write (see pwrite.py) of FILE,
# removed first, after a sync and dropped caches; MiB/s, and the daemon's CPU time.
pwrite_timed() {
    local metric=$1 file=$2 size=$3 fsync=$4 src=${5:-} pid t0 t1 secs
    pid=$(daemon_pid "$CUR_CFG" "$MNTS/$CUR_CFG")
    rm -f "$file"
    sync
    drop_caches
    [[ -n $src ]] && cat "$src" >/dev/null
    python3 -c pass
    t0=$(pid_cpu_ns "$pid")
    if ! run_timed 900 python3 "$S/pwrite.py" "$file" "$size" "$fsync" ${src:+"$src"} >"$WORK/out" 2>"$WORK/err"; then
        fail "$metric" "the write failed or timed out"
        return 1
    fi
    t1=$(pid_cpu_ns "$pid")
    secs=$(cat "$WORK/out")
    record "$metric" "$(awk -v t="$secs" -v s="$size" 'BEGIN { printf "%.1f", s / 1048576 / t }')" MiB/s
    [[ -z $pid ]] || record "${metric}_daemon_cpu" "$(cpu_delta "$t0" "$t1")" s
}

# fio_read METRIC FILE SIZE: a sequential read with fio (1 MiB blocks, psync), MiB/s (fio's
# bandwidth, which includes its open of the file), and the daemon's CPU time.
fio_read() {
    local metric=$1 file=$2 size=$3 pid t0 t1 bw
    pid=$(daemon_pid "$CUR_CFG" "$MNTS/$CUR_CFG")
    t0=$(pid_cpu_ns "$pid")
    if ! run_timed 900 fio --name="$metric" --filename="$file" --readonly --rw=read --bs=1M \
        --size="$size" --ioengine=psync --numjobs=1 --invalidate=0 \
        --output-format=json --output="$WORK/fio.json" >/dev/null 2>"$WORK/err"; then
        fail "$metric" "fio failed or timed out"
        return 1
    fi
    t1=$(pid_cpu_ns "$pid")
    if ! bw=$(jq -er '.jobs[0].read.bw_bytes' "$WORK/fio.json") || [[ $(jq -r '.jobs[0].error' "$WORK/fio.json") != 0 ]]; then
        fail "$metric" "fio reported an error"
        return 1
    fi
    record "$metric" "$(awk -v b="$bw" 'BEGIN { printf "%.1f", b / 1048576 }')" MiB/s
    [[ -z $pid ]] || record "${metric}_daemon_cpu" "$(cpu_delta "$t0" "$t1")" s
}

# fio_randread FILE SIZE: 4 KiB random reads (psync) for RAND_TIME seconds; IOPS and MiB/s.
fio_randread() {
    local file=$1 size=$2 pid t0 t1 iops bw
    pid=$(daemon_pid "$CUR_CFG" "$MNTS/$CUR_CFG")
    t0=$(pid_cpu_ns "$pid")
    if ! run_timed 900 fio --name=randread --filename="$file" --readonly --rw=randread --bs=4k \
        --size="$size" --ioengine=psync --numjobs=1 --invalidate=0 --time_based --runtime="$RAND_TIME" \
        --norandommap --randrepeat=0 --output-format=json --output="$WORK/fio.json" >/dev/null 2>"$WORK/err"; then
        fail randread "fio failed or timed out"
        return 1
    fi
    t1=$(pid_cpu_ns "$pid")
    if ! iops=$(jq -er '.jobs[0].read.iops' "$WORK/fio.json") || ! bw=$(jq -er '.jobs[0].read.bw_bytes' "$WORK/fio.json") ||
        [[ $(jq -r '.jobs[0].error' "$WORK/fio.json") != 0 ]]; then
        fail randread "fio reported an error"
        return 1
    fi
    record randread_iops "$(awk -v b="$iops" 'BEGIN { printf "%.0f", b }')" IOPS
    record randread "$(awk -v b="$bw" 'BEGIN { printf "%.1f", b / 1048576 }')" MiB/s
    [[ -z $pid ]] || record randread_daemon_cpu_per_s "$(awk -v a="$t0" -v b="$t1" -v t="$RAND_TIME" 'BEGIN { printf "%.3f", (b - a) / 1e9 / t }')" s/s
}

# space LOWER: "APPARENT ALLOCATED" bytes under LOWER (du -sb, du -sB1).
space() { echo "$(du -sb "$1" | cut -f1) $(du -sB1 "$1" | cut -f1)"; }

# The needles of the plaintext check: a line of text found in stdio.h, and the name stdio.h.
NEEDLE_DATA="extern int fprintf (FILE *__restrict __stream"
NEEDLE_NAME="stdio.h"

# ================================================================ 1. io
IO_CFGS=(native gocryptfs crypt zstd-crypt null)
bench_io() {
    CUR_BENCH=io
    local mb=$((IO_SIZE / MiB)) cfg lower t metric fsync a b
    log "io: ${IO_CFGS[*]} side by side; a $mb MiB file written (no fsync, fsync), read cold and warm; 4 KiB random reads of a $((RAND_SIZE / MiB)) MiB file"
    # One untimed write of the same size first: the first large write of a run is often much
    # slower on this kind of machine, whichever configuration makes it.
    mkdir -p "$LOWERS/io-warm-up"
    python3 "$S/pwrite.py" "$LOWERS/io-warm-up/big.dat" "$IO_SIZE" 1 >/dev/null
    rm -rf "${LOWERS:?}/io-warm-up"
    sync
    local -A ok=()
    for ((REP = 1; REP <= RUNS; REP++)); do
        log "io rep $REP/$RUNS"
        ok=()
        for cfg in "${IO_CFGS[@]}"; do
            CUR_CFG=$cfg
            init_lower "$cfg" "$LOWERS/io-$cfg" && mount_at "$cfg" "$LOWERS/io-$cfg" "$MNTS/$cfg" && ok[$cfg]=1 ||
                fail mount "could not set up or mount; skipping $cfg in this repetition"
        done
        for cfg in "${IO_CFGS[@]}"; do
            [[ -n ${ok[$cfg]:-} ]] || continue
            t=$(target_of "$cfg" "$LOWERS/io-$cfg" "$MNTS/$cfg")
            warm_up "$t" python3 fio
        done
        # The writes: each variant in every configuration in turn.
        for metric in write write_fsync; do
            fsync=0
            [[ $metric == write_fsync ]] && fsync=1
            for CUR_CFG in $(rotated "${IO_CFGS[@]}"); do
                [[ -n ${ok[$CUR_CFG]:-} ]] || continue
                t=$(target_of "$CUR_CFG" "$LOWERS/io-$CUR_CFG" "$MNTS/$CUR_CFG")
                pwrite_timed "$metric" "$t/big.dat" "$IO_SIZE" "$fsync" || unset "ok[$CUR_CFG]"
            done
        done
        # The file of the random reads (untimed).
        for CUR_CFG in "${IO_CFGS[@]}"; do
            [[ -n ${ok[$CUR_CFG]:-} ]] || continue
            t=$(target_of "$CUR_CFG" "$LOWERS/io-$CUR_CFG" "$MNTS/$CUR_CFG")
            python3 "$S/pwrite.py" "$t/rand.dat" "$RAND_SIZE" 1 >/dev/null 2>"$WORK/err" ||
                { fail rand.dat "writing the file of the random reads failed"; unset "ok[$CUR_CFG]"; }
        done
        sync
        # Unmount, drop caches, mount: the cold reads in turn (caches dropped before each), each
        # followed by two warm reads of the same file.
        for cfg in "${IO_CFGS[@]}"; do unmount_at "$MNTS/$cfg" || true; done
        drop_caches
        for CUR_CFG in "${IO_CFGS[@]}"; do
            [[ -n ${ok[$CUR_CFG]:-} ]] || continue
            mount_at "$CUR_CFG" "$LOWERS/io-$CUR_CFG" "$MNTS/$CUR_CFG" || { fail remount "remount failed"; unset "ok[$CUR_CFG]"; }
        done
        for CUR_CFG in $(rotated "${IO_CFGS[@]}"); do
            [[ -n ${ok[$CUR_CFG]:-} ]] || continue
            t=$(target_of "$CUR_CFG" "$LOWERS/io-$CUR_CFG" "$MNTS/$CUR_CFG")
            drop_caches
            warm_up "$t" fio
            fio_read read_cold "$t/big.dat" "$IO_SIZE" && fio_read read_warm "$t/big.dat" "$IO_SIZE" &&
                fio_read read_warm2 "$t/big.dat" "$IO_SIZE" || true
        done
        # Warm random reads: the file read once (so it is in whatever cache the system keeps),
        # then 4 KiB random reads.
        for CUR_CFG in $(rotated "${IO_CFGS[@]}"); do
            [[ -n ${ok[$CUR_CFG]:-} ]] || continue
            t=$(target_of "$CUR_CFG" "$LOWERS/io-$CUR_CFG" "$MNTS/$CUR_CFG")
            cat "$t/rand.dat" >/dev/null
            fio_randread "$t/rand.dat" "$RAND_SIZE" || true
        done
        for cfg in "${IO_CFGS[@]}"; do unmount_at "$MNTS/$cfg" || true; done
        sync
        if ((REP == 1)); then
            # What is stored below: the space against the data written, and no plaintext.
            for CUR_CFG in "${IO_CFGS[@]}"; do
                [[ -n ${ok[$CUR_CFG]:-} ]] || continue
                lower=$LOWERS/io-$CUR_CFG
                read -r a b <<<"$(space "$lower")"
                record lower_apparent "$a" B
                record lower_allocated "$b" B
            done
        fi
        for cfg in "${IO_CFGS[@]}"; do rm -rf "${LOWERS:?}/io-$cfg"; done
        sync
    done
}

# ================================================================ 2. tree
TREE_CFGS=(native gocryptfs crypt zstd-crypt null)
bench_tree() {
    CUR_BENCH=tree
    log "tree: ${TREE_CFGS[*]}; $TREE_FILES files, $TREE_LINKS symlinks, $((TREE_BYTES / MiB)) MiB"
    local lower mnt t a b nd nn
    for ((REP = 1; REP <= RUNS; REP++)); do
        for CUR_CFG in $(rotated "${TREE_CFGS[@]}"); do
            log "tree rep $REP/$RUNS: $CUR_CFG"
            lower=$LOWERS/tree-$CUR_CFG
            mnt=$MNTS/$CUR_CFG
            t=$(target_of "$CUR_CFG" "$lower" "$mnt")
            drop_caches
            if ! init_lower "$CUR_CFG" "$lower" || ! mount_at "$CUR_CFG" "$lower" "$mnt"; then
                fail mount "could not set up or mount; skipping"
                unmount_at "$mnt" || true
                rm -rf "$lower"
                continue
            fi
            # Warm the input (the tarball), not the file system under test.
            cat "$TARBALL" >/dev/null
            warm_up "$t" tar ls find cat rm
            if run_timed 900 tar -C "$t" -xf "$TARBALL" 2>"$WORK/err"; then
                record untar "$ELAPSED" s
                run_timed 900 sync && record untar_sync "$ELAPSED" s
            else
                fail untar "tar -xf failed"
                unmount_at "$mnt" || true
                rm -rf "$lower"
                continue
            fi
            if ((REP == 1)); then
                # Every file and symlink read back through a fresh mount, against the source's.
                if remount_cold "$CUR_CFG" "$lower" "$mnt"; then
                    if ! (cd "$t" && md5sum -c --quiet "$DATA/crypt-tree.md5") >"$WORK/md5" 2>&1; then
                        mismatch tree "$(grep -c -v ': OK$' "$WORK/md5" || true) files read through the mount differ from the source: $(head -c 400 "$WORK/md5")"
                    else
                        record md5_ok "$TREE_FILES" files
                    fi
                    if ! (cd "$t" && find . -type l -printf '%p\t%l\n' | LC_ALL=C sort) | cmp -s - "$DATA/crypt-tree.links"; then
                        mismatch tree "the symlinks read through the mount differ from the source's"
                    else
                        record links_ok "$TREE_LINKS" links
                    fi
                else
                    fail remount "remount for the check failed"
                fi
                # What is stored below: its space, and whether names or data show in the clear.
                sync
                read -r a b <<<"$(space "$lower")"
                record lower_apparent "$a" B
                record lower_allocated "$b" B
                read -r nd nn <<<"$(python3 "$S/leakcheck.py" "$lower" "$NEEDLE_DATA" "$NEEDLE_NAME")"
                record plain_data_files "$nd" files
                record plain_names "$nn" names
                case $CUR_CFG in
                    native | null) ((nd > 0 && nn > 0)) || mismatch lower "the plaintext check found nothing in an unencrypted tree ($nd, $nn): the check is broken" ;;
                    *) ((nd == 0 && nn == 0)) || mismatch lower "$nd files below hold plaintext, $nn names below are plaintext" ;;
                esac
            fi
            # Read every file, cold.
            if remount_cold "$CUR_CFG" "$lower" "$mnt"; then
                warm_up "$t" find cat
                if run_timed 900 bash -c 'cd "$1" && find . -type f -exec cat {} + >/dev/null' _ "$t" 2>"$WORK/err"; then
                    record read "$ELAPSED" s
                else fail read "reading the tree failed"; fi
            else
                fail remount "remount for the cold read failed"
                rm -rf "$lower"
                continue
            fi
            # ls -lR: cold (fresh mount, no caches), then warm; then rm -rf.
            if remount_cold "$CUR_CFG" "$lower" "$mnt"; then
                warm_up "$t" ls rm
                if run_timed 600 ls -lR "$t/include" >/dev/null 2>"$WORK/err"; then
                    record ls_cold "$ELAPSED" s
                    if run_timed 600 ls -lR "$t/include" >/dev/null 2>"$WORK/err"; then
                        record ls_warm "$ELAPSED" s
                    else fail ls_warm "ls -lR failed"; fi
                else fail ls_cold "ls -lR failed"; fi
                if run_timed 900 rm -rf "$t/include" 2>"$WORK/err"; then
                    record rm "$ELAPSED" s
                    run_timed 900 sync && record rm_sync "$ELAPSED" s
                    [[ -z $(ls -A "$t" 2>/dev/null) ]] || fail rm "entries left after rm -rf: $(ls -A "$t" | head -c 200)"
                else fail rm "rm -rf failed"; fi
            else
                fail remount "remount for ls -lR failed"
            fi
            unmount_at "$mnt" || true
            rm -rf "$lower"
            sync
        done
    done
}

# ================================================================ 3. compressible data
COMP_CFGS=(native gocryptfs crypt zstd-crypt)
bench_comp() {
    CUR_BENCH=comp
    local mb=$((COMP_SIZE / MiB)) lower mnt t a0 b0 a b
    log "comp: ${COMP_CFGS[*]}; a $mb MiB compressible text file"
    for ((REP = 1; REP <= RUNS; REP++)); do
        for CUR_CFG in $(rotated "${COMP_CFGS[@]}"); do
            log "comp rep $REP/$RUNS: $CUR_CFG"
            lower=$LOWERS/comp-$CUR_CFG
            mnt=$MNTS/$CUR_CFG
            t=$(target_of "$CUR_CFG" "$lower" "$mnt")
            if ! init_lower "$CUR_CFG" "$lower" || ! mount_at "$CUR_CFG" "$lower" "$mnt"; then
                fail mount "could not set up or mount; skipping"
                unmount_at "$mnt" || true
                rm -rf "$lower"
                continue
            fi
            sync
            read -r a0 b0 <<<"$(space "$lower")"
            warm_up "$t" python3 fio
            if pwrite_timed write "$t/text.dat" "$COMP_SIZE" 0 "$COMP_SRC"; then
                run_timed 900 sync && record write_sync "$ELAPSED" s
                read -r a b <<<"$(space "$lower")"
                record lower_apparent $((a - a0)) B
                record lower_allocated $((b - b0)) B
                if remount_cold "$CUR_CFG" "$lower" "$mnt"; then
                    warm_up "$t" fio
                    fio_read read_cold "$t/text.dat" "$COMP_SIZE" && fio_read read_warm "$t/text.dat" "$COMP_SIZE" || true
                    if ((REP == 1)); then
                        if remount_cold "$CUR_CFG" "$lower" "$mnt" && cmp -s "$t/text.dat" "$COMP_SRC"; then
                            record cmp_ok 1 files
                        else
                            mismatch text.dat "the file read back through a fresh mount differs from the source"
                        fi
                    fi
                else
                    fail remount "remount for the reads failed"
                fi
            fi
            unmount_at "$mnt" || true
            rm -rf "$lower"
            sync
        done
    done
}

# ---------------------------------------------------------------- the runs
log "benchmarks: ${BENCHES[*]}; runs: $RUNS; raw results in $CSV"
log "lower directories in $LOWERS (on $(findmnt -no FSTYPE -T "$OUT")); plyfs: $PLYFS ($PLYFS_REV)"
T_BENCH=$SECONDS
want io && bench_io
want tree && bench_tree
want comp && bench_comp
rm -rf "$LOWERS"
ELAPSED_TOTAL=$((SECONDS - T_START))
log "done in $((ELAPSED_TOTAL / 60)) min $((ELAPSED_TOTAL % 60)) s (measurements $(((SECONDS - T_BENCH) / 60)) min)"
cp -f "$CSV" "$S/results.csv"

# Anything the plyfs daemons logged at warning level or above (numbers become N).
DAEMON_WARNINGS=$(cat "$LOGDIR"/*.log 2>/dev/null | sed 's/\x1b\[[0-9;]*m//g' |
    sed -nE 's/^[^ ]+ +(WARN|ERROR) /\1 /p' | sed -E ':a; s/(: [^0-9]*)[0-9]+/\1N/; ta' |
    sort | uniq -c | sort -rn | head -n 30 || true)

# ---------------------------------------------------------------- report
export BENCH_CSV=$CSV BENCH_DOC=${CRYPT_DOC:-$REPO/docs/benchmarks.md} BENCH_WRITE_DOC=$write_doc \
    BENCH_RUNS=$RUNS BENCH_QUICK=$quick BENCH_CMD=$CMDLINE BENCH_KERNEL=$(uname -r) \
    BENCH_CPU="$(lscpu | sed -n 's/^Model name: *//p' | head -n 1)" BENCH_NCPU=$(nproc) \
    BENCH_MEM="$(free -g | awk '/^Mem:/ { print $2 " GiB" }')" BENCH_FIO="$(fio --version)" \
    BENCH_GOCRYPTFS="$(gocryptfs -version 2>/dev/null | head -n 1)" \
    BENCH_AES="$(grep -qw aes /proc/cpuinfo && echo yes || echo no)" \
    BENCH_REV=$PLYFS_REV BENCH_HEAD=$HEAD_AT_START BENCH_CPU_SOURCE=$CPU_SOURCE \
    BENCH_FSTYPE="$(findmnt -no FSTYPE -T "$OUT")" BENCH_FSOPTS="$(findmnt -no OPTIONS -T "$OUT")" \
    BENCH_TREE_FILES=$TREE_FILES BENCH_TREE_LINKS=$TREE_LINKS BENCH_TREE_BYTES=$TREE_BYTES BENCH_TAR_BYTES=$TAR_BYTES \
    BENCH_IOMODES=$IOMODES BENCH_FAILLOG=$FAILLOG BENCH_MISMATCH=$MISMATCH BENCH_WARNINGS=$DAEMON_WARNINGS \
    BENCH_SECONDS=$ELAPSED_TOTAL BENCH_BENCHES="${BENCHES[*]}" BENCH_IO_SIZE=$IO_SIZE BENCH_RAND_SIZE=$RAND_SIZE \
    BENCH_RAND_TIME=$RAND_TIME BENCH_COMP_SIZE=$COMP_SIZE BENCH_COMP_ZSTD=$COMP_ZSTD_RATIO

python3 - <<'PY'
import csv, os, statistics, datetime

E = os.environ
runs = int(E["BENCH_RUNS"])
benches = E["BENCH_BENCHES"].split()
raw = {}
with open(E["BENCH_CSV"]) as f:
    for r in csv.DictReader(f):
        try:
            raw.setdefault((r["bench"], r["config"], r["metric"]), []).append(float(r["value"]))
        except ValueError:
            pass

def vals(bench, cfg, metric):
    return raw.get((bench, cfg, metric), [])

def m(bench, cfg, metric):
    v = vals(bench, cfg, metric)
    return statistics.median(v) if v else None

def best(bench, cfg, metric, high=True):
    v = vals(bench, cfg, metric)
    return (max(v) if high else min(v)) if v else None

def short(bench, cfg, metric):
    k = len(vals(bench, cfg, metric))
    return f" [{k}/{runs}]" if 0 < k < runs else ""

def sp(bench, cfg, metric):
    v = vals(bench, cfg, metric)
    if len(v) < 2 or not statistics.median(v):
        return "–"
    return f"{(max(v) - min(v)) / statistics.median(v) * 100:.0f}%"

def f2(v, d=2):
    return "–" if v is None else f"{v:,.{d}f}"

def fx(v, d=2):
    return "–" if v is None else f"{v:.{d}f}×"

def div(a, b):
    return a / b if a is not None and b else None

def size_name(b):
    b = int(b)
    if b >= 1073741824 and b % 1073741824 == 0:
        return f"{b // 1073741824} GiB"
    if b >= 1048576 and b % 1048576 == 0:
        return f"{b // 1048576} MiB"
    return f"{b} B"

CPU_DESC = ("the sum over its threads of `/proc/PID/task/*/schedstat`" if E["BENCH_CPU_SOURCE"] == "schedstat"
            else "utime + stime from `/proc/PID/stat`")
iomodes = {}
if os.path.exists(E["BENCH_IOMODES"]):
    for line in open(E["BENCH_IOMODES"]):
        parts = line.rstrip("\n").split("\t")
        if len(parts) == 3:
            iomodes[parts[0]] = (parts[1], parts[2])

sections, rows = [], []
PAIRS = [("crypt", "gocryptfs"), ("zstd-crypt", "gocryptfs"), ("crypt", "native"), ("zstd-crypt", "native"),
         ("gocryptfs", "native"), ("null", "native"), ("crypt", "null")]

def row(target, metric, value, need, ok):
    res = "n/a" if ok is None else ("PASS" if ok else "MISS")
    rows.append(f"| {target} | {metric} | {value} | {need} | {res} |")

def ratio_table(bench, cfgs, metrics):
    pairs = [(a, b) for a, b in PAIRS if a in cfgs and b in cfgs]
    L = ["| measure | " + " | ".join(f"{a} / {b}" for a, b in pairs) + " |",
         "| --- | " + " | ".join("---:" for _ in pairs) + " |"]
    for k, label, unit in metrics:
        L.append(f"| {label} ({unit}) | " + " | ".join(fx(div(m(bench, a, k), m(bench, b, k))) for a, b in pairs) + " |")
    return L + [""]

# ---- 1. io
io_cfgs = ["native", "gocryptfs", "crypt", "zstd-crypt", "null"]
IO_METRICS = [("write", "sequential write, no fsync", "MiB/s"), ("write_fsync", "sequential write + fsync", "MiB/s"),
              ("read_cold", "sequential read, cold", "MiB/s"), ("read_warm", "sequential read, warm (1st)", "MiB/s"),
              ("read_warm2", "sequential read, warm (2nd)", "MiB/s"), ("randread_iops", "4 KiB random read, warm", "IOPS"),
              ("randread", "4 KiB random read, warm", "MiB/s")]
if "io" in benches:
    L = ["| measure | unit | " + " | ".join(io_cfgs) + " |", "| --- | --- | " + " | ".join("---:" for _ in io_cfgs) + " |"]
    for k, label, unit in IO_METRICS:
        L.append(f"| {label} | {unit} | " + " | ".join(f2(m('io', c, k), 0) + short('io', c, k) for c in io_cfgs) + " |")
    L.append(f"| sequential read, cold: fastest | MiB/s | " + " | ".join(f2(best('io', c, 'read_cold'), 0) for c in io_cfgs) + " |")
    L += ["", "Ratios of the medians (throughput: higher is better for the first):", ""]
    L += ratio_table("io", io_cfgs, IO_METRICS[:-1])
    L += ["Daemon CPU time (s; for the random reads, CPU seconds per second), median; and the CPUs it kept busy (its CPU time "
          "over the step's wall-clock time, from the medians):", "",
          "| step | " + " | ".join(io_cfgs[1:]) + " |", "| --- | " + " | ".join("---:" for _ in io_cfgs[1:]) + " |"]
    for k, label in [("write_daemon_cpu", "write, no fsync"), ("write_fsync_daemon_cpu", "write + fsync"),
                     ("read_cold_daemon_cpu", "read, cold"), ("read_warm_daemon_cpu", "read, warm (1st)"),
                     ("read_warm2_daemon_cpu", "read, warm (2nd)"), ("randread_daemon_cpu_per_s", "4 KiB random read (per s)")]:
        L.append(f"| {label} | " + " | ".join(f2(m('io', c, k), 3) for c in io_cfgs[1:]) + " |")
    # The daemon's CPU time over the wall-clock time of the step: how many CPUs it kept busy.
    mib = int(E["BENCH_IO_SIZE"]) / 1048576
    for k, label in [("write", "write, no fsync"), ("write_fsync", "write + fsync"), ("read_cold", "read, cold")]:
        L.append(f"| CPUs busy in the daemon, {label} | " + " | ".join(
            f2(div(m('io', c, k + '_daemon_cpu'), div(mib, m('io', c, k))), 2) for c in io_cfgs[1:]) + " |")
    L += ["", "Spread ((max − min) / median) over the repetitions:", "",
          "| measure | " + " | ".join(io_cfgs) + " |", "| --- | " + " | ".join("---:" for _ in io_cfgs) + " |"]
    for k, label, unit in IO_METRICS[:-1]:
        L.append(f"| {label} | " + " | ".join(sp('io', c, k) for c in io_cfgs) + " |")
    logical = int(E["BENCH_IO_SIZE"]) + int(E["BENCH_RAND_SIZE"])
    L += ["", f"Space in the lower directory after the first repetition (the {size_name(E['BENCH_IO_SIZE'])} and "
          f"{size_name(E['BENCH_RAND_SIZE'])} files of incompressible data, {logical:,} bytes; volume configuration included):", "",
          "| configuration | du -sb (bytes) | / data | du -sB1, allocated (bytes) | / data |", "| --- | ---: | ---: | ---: | ---: |"]
    for c in io_cfgs:
        a, b = m("io", c, "lower_apparent"), m("io", c, "lower_allocated")
        L.append(f"| {c} | {f2(a, 0)} | {f2(div(a, logical), 4)} | {f2(b, 0)} | {f2(div(b, logical), 4)} |")
    modes = "; ".join(f"`{c}` (`{v[0]}`): \"{v[1]}\"" for c, v in iomodes.items())
    sections.append(("Large-file I/O",
        f"All five configurations mounted side by side (each over its own fresh lower directory, the encrypting ones "
        f"new volumes), every step done in each configuration in turn, in a rotated order. **Writes**: a "
        f"{size_name(E['BENCH_IO_SIZE'])} file `big.dat` written sequentially in 1 MiB `pwrite(2)`s (what fio's psync "
        "engine does) of incompressible data (a 16 MiB pool of random bytes, cycled), by a small python3 program that "
        "times from `open(2)` to after `close(2)`: the close is part of the write, and on a FUSE mount with the "
        "writeback cache it is where the dirty pages go to the daemon. (fio itself is not used for the writes: its own "
        "bandwidth leaves the close out, and a wall clock around the fio process adds about 0.3 s of its start-up and "
        "shutdown, quantised to 0.1 s.) Before each write the old file is removed, then `sync` and caches dropped. "
        "Once without fsync and once with an `fsync(2)` before the close (fio's `--end_fsync=1`). Then a "
        f"{size_name(E['BENCH_RAND_SIZE'])} file `rand.dat` is written (untimed), everything unmounted, caches dropped "
        "and mounted again. **Reads**, in each configuration in turn: caches dropped, `fio --rw=read --bs=1M "
        "--ioengine=psync --readonly --invalidate=0` (fio's bandwidth, which includes its open of the file), then the "
        "same read twice more, warm. **Random reads**: `rand.dat` read once with `cat` (so it is in whatever cache the "
        f"configuration keeps), then `fio --rw=randread --bs=4k --ioengine=psync --time_based --runtime={E['BENCH_RAND_TIME']} "
        "--norandommap --invalidate=0`. MiB/s or IOPS, median over the repetitions; the daemon's CPU time "
        f"({CPU_DESC}) beside. Before the first repetition, one untimed write of the same size on the lower disk."
        + (f" The plyfs mounts report how data moves: {modes}." if modes else ""),
        "\n".join(L)))
    # The targets.
    for k, label in [("write", "sequential write, no fsync"), ("write_fsync", "sequential write + fsync"),
                     ("read_cold", "sequential read, cold"), ("read_warm", "sequential read, warm")]:
        a, b = m("io", "crypt", k), m("io", "gocryptfs", k)
        r = div(a, b)
        row(f"{label} ≥ 2× gocryptfs", f"{size_name(E['BENCH_IO_SIZE'])}, 1 MiB blocks, MiB/s: crypt / gocryptfs",
            f"{fx(r)} ({f2(a, 0)} / {f2(b, 0)} MiB/s; crypt / native {fx(div(a, m('io', 'native', k)))}, "
            f"gocryptfs / native {fx(div(b, m('io', 'native', k)))})", "≥ 2×", None if r is None else r >= 2)
    for k, label, unit in [("read_warm", "sequential read, warm (1st)", "MiB/s"), ("read_warm2", "sequential read, warm (2nd)", "MiB/s"),
                           ("randread_iops", "4 KiB random read, warm", "IOPS")]:
        a, b = m("io", "crypt", k), m("io", "native", k)
        r = div(a, b)
        row(f"{label} ≥ 0.8× native", f"{unit}: crypt / native",
            f"{fx(r)} ({f2(a, 0)} / {f2(b, 0)} {unit}; crypt / gocryptfs {fx(div(a, m('io', 'gocryptfs', k)))}, "
            f"gocryptfs / native {fx(div(m('io', 'gocryptfs', k), b))})", "≥ 0.8×", None if r is None else r >= 0.8)
    a, b = best("io", "crypt", "read_cold"), best("io", "gocryptfs", "read_cold")
    r = div(a, b)
    row("(for information) sequential read, cold, fastest of the repetitions ≥ 2× gocryptfs", "MiB/s: crypt / gocryptfs",
        f"{fx(r)} ({f2(a, 0)} / {f2(b, 0)} MiB/s)", "≥ 2×", None if r is None else r >= 2)
    for k, label in [("write", "sequential write, no fsync"), ("write_fsync", "sequential write + fsync"),
                     ("read_cold", "sequential read, cold"), ("read_warm", "sequential read, warm")]:
        a, b = m("io", "zstd-crypt", k), m("io", "gocryptfs", k)
        r = div(a, b)
        row(f"(for information) zstd,crypt on incompressible data: {label} ≥ 2× gocryptfs", "MiB/s: zstd-crypt / gocryptfs",
            f"{fx(r)} ({f2(a, 0)} / {f2(b, 0)} MiB/s)", "≥ 2×", None if r is None else r >= 2)

# ---- 2. tree
tree_cfgs = ["native", "gocryptfs", "crypt", "zstd-crypt", "null"]
TREE_METRICS = [("untar", "untar (`tar -xf`)", "s"), ("untar_sync", "`sync` after the untar", "s"),
                ("read", "read every file, cold", "s"), ("ls_cold", "`ls -lR`, cold", "s"),
                ("ls_warm", "`ls -lR`, warm", "s"), ("rm", "`rm -rf`", "s"), ("rm_sync", "`sync` after the rm", "s")]
nfiles, nlinks = int(E["BENCH_TREE_FILES"]), int(E["BENCH_TREE_LINKS"])
tree_bytes, tar_bytes = int(E["BENCH_TREE_BYTES"]), int(E["BENCH_TAR_BYTES"])
if "tree" in benches:
    L = ["| phase | " + " | ".join(f"{c} (s)" for c in tree_cfgs) + " |", "| --- | " + " | ".join("---:" for _ in tree_cfgs) + " |"]
    for k, label, _ in TREE_METRICS:
        L.append(f"| {label} | " + " | ".join(f2(m('tree', c, k), 3) + short('tree', c, k) for c in tree_cfgs) + " |")
    L += ["", "Ratios of the medians (times: lower is better for the first):", ""]
    L += ratio_table("tree", tree_cfgs, TREE_METRICS)
    L += ["Spread ((max − min) / median) over the repetitions:", "",
          "| phase | " + " | ".join(tree_cfgs) + " |", "| --- | " + " | ".join("---:" for _ in tree_cfgs) + " |"]
    for k, label, _ in TREE_METRICS:
        L.append(f"| {label} | " + " | ".join(sp('tree', c, k) for c in tree_cfgs) + " |")
    L += ["", f"What is stored below (first repetition, after the untar and a `sync`): the space of the lower directory "
          f"(`du -sb`: apparent sizes, directories included; `du -sB1`: allocated), against the same for `native` and "
          f"against the {tree_bytes:,} bytes of the tree's files; and the plaintext check: files below containing the line "
          f"`{'extern int fprintf (FILE *__restrict __stream'}` of `stdio.h`, and names below containing `stdio.h`:", "",
          "| configuration | du -sb (bytes) | / native | / file bytes | du -sB1 (bytes) | / native | files with plaintext | plaintext names |",
          "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for c in tree_cfgs:
        a, b = m("tree", c, "lower_apparent"), m("tree", c, "lower_allocated")
        L.append(f"| {c} | {f2(a, 0)} | {f2(div(a, m('tree', 'native', 'lower_apparent')), 3)} | {f2(div(a, tree_bytes), 3)} | "
                 f"{f2(b, 0)} | {f2(div(b, m('tree', 'native', 'lower_allocated')), 3)} | "
                 f"{f2(m('tree', c, 'plain_data_files'), 0)} | {f2(m('tree', c, 'plain_names'), 0)} |")
    sections.append(("Source tree: untar, ls -lR, read, rm -rf",
        f"The tarball of /usr/include ({nfiles:,} files, {nlinks} symlinks, {tree_bytes / 1048576:.0f} MiB of file data; "
        f"the tarball {tar_bytes / 1048576:.0f} MiB) in each configuration in turn (rotated order), each repetition in a "
        "fresh lower directory (a new volume for the encrypting ones): caches dropped, mounted, the tarball read once (so "
        "it comes from memory), then `tar -xf` timed alone and the `sync` after it timed apart; unmount, drop caches, "
        "mount: every file read with `find . -type f -exec cat {} + >/dev/null`; unmount, drop caches, mount: `ls -lR` "
        "cold, then again warm, then `rm -rf` of the tree (its `sync` timed apart). Seconds (median). In the first "
        "repetition, after the untar, every file is read back through a fresh mount and checked against the md5 sums "
        "of the tarball's files, the symlinks' targets are compared, and the lower directory is measured and searched "
        "for plaintext.", "\n".join(L)))
    a, b = m("tree", "crypt", "untar"), m("tree", "gocryptfs", "untar")
    r = div(a, b)
    row("untar time ≤ 0.6× gocryptfs", f"/usr/include ({nfiles:,} files), `tar -xf`, s: crypt / gocryptfs",
        f"{fx(r)} ({f2(a, 3)} / {f2(b, 3)} s; crypt / native {fx(div(a, m('tree', 'native', 'untar')))}, "
        f"gocryptfs / native {fx(div(b, m('tree', 'native', 'untar')))}; with the sync after it: "
        f"{fx(div((a or 0) + (m('tree', 'crypt', 'untar_sync') or 0), (b or 0) + (m('tree', 'gocryptfs', 'untar_sync') or 0)))})",
        "≤ 0.6×", None if r is None else r <= 0.6)
    for k, label in [("ls_cold", "ls -lR cold"), ("ls_warm", "ls -lR warm"), ("read", "read every file, cold"), ("rm", "rm -rf")]:
        a, b = m("tree", "crypt", k), m("tree", "gocryptfs", k)
        row(f"(for information) {label} against gocryptfs", f"s: crypt / gocryptfs",
            f"{fx(div(a, b))} ({f2(a, 3)} / {f2(b, 3)} s; crypt / native {fx(div(a, m('tree', 'native', k)))})", "none set", None)
    a, b = m("tree", "zstd-crypt", "untar"), m("tree", "gocryptfs", "untar")
    r = div(a, b)
    row("(for information) zstd,crypt: untar time ≤ 0.6× gocryptfs", "s: zstd-crypt / gocryptfs",
        f"{fx(r)} ({f2(a, 3)} / {f2(b, 3)} s)", "≤ 0.6×", None if r is None else r <= 0.6)

# ---- 3. comp
comp_cfgs = ["native", "gocryptfs", "crypt", "zstd-crypt"]
COMP_METRICS = [("write", "write (open to close)", "MiB/s"), ("read_cold", "read, cold", "MiB/s"), ("read_warm", "read, warm", "MiB/s")]
if "comp" in benches or "tree" in benches:
    csize = int(E["BENCH_COMP_SIZE"])
    L = []
    if "comp" in benches:
        L += ["| measure | " + " | ".join(comp_cfgs) + " |", "| --- | " + " | ".join("---:" for _ in comp_cfgs) + " |"]
        for k, label, unit in COMP_METRICS:
            L.append(f"| {label} ({unit}) | " + " | ".join(f2(m('comp', c, k), 0) + short('comp', c, k) for c in comp_cfgs) + " |")
        def wsync(c):
            w, s = m("comp", c, "write"), m("comp", c, "write_sync")
            return None if w is None or s is None else csize / 1048576 / (csize / 1048576 / w + s)
        L.append("| write + `sync` after it (MiB/s) | " + " | ".join(f2(wsync(c), 0) for c in comp_cfgs) + " |")
        L.append("| daemon CPU, write (s) | – | " + " | ".join(f2(m('comp', c, 'write_daemon_cpu'), 3) for c in comp_cfgs[1:]) + " |")
        L.append("| daemon CPU, cold read (s) | – | " + " | ".join(f2(m('comp', c, 'read_cold_daemon_cpu'), 3) for c in comp_cfgs[1:]) + " |")
        L.append("| lower space, du -sb (bytes) | " + " | ".join(f2(m('comp', c, 'lower_apparent'), 0) for c in comp_cfgs) + " |")
        L.append("| … / logical size | " + " | ".join(f2(div(m('comp', c, 'lower_apparent'), csize), 3) for c in comp_cfgs) + " |")
        L.append("| lower space, du -sB1 (bytes) | " + " | ".join(f2(m('comp', c, 'lower_allocated'), 0) for c in comp_cfgs) + " |")
        L.append("| … / logical size | " + " | ".join(f2(div(m('comp', c, 'lower_allocated'), csize), 3) for c in comp_cfgs) + " |")
        L += ["", "Ratios of the medians:", ""]
        L += ratio_table("comp", comp_cfgs, COMP_METRICS)
    if "tree" in benches:
        L += [f"The text tree of the `tree` benchmark in the same terms ({tree_bytes / 1048576:.1f} MiB of files; throughput = "
              "file bytes / time):", "",
              "| measure | " + " | ".join(tree_cfgs) + " |", "| --- | " + " | ".join("---:" for _ in tree_cfgs) + " |"]
        L.append("| untar (MiB/s) | " + " | ".join(f2(div(tree_bytes / 1048576, m('tree', c, 'untar')), 1) for c in tree_cfgs) + " |")
        L.append("| read every file, cold (MiB/s) | " + " | ".join(f2(div(tree_bytes / 1048576, m('tree', c, 'read')), 1) for c in tree_cfgs) + " |")
        L.append("| lower space du -sb / file bytes | " + " | ".join(f2(div(m('tree', c, 'lower_apparent'), tree_bytes), 3) for c in tree_cfgs) + " |")
        L.append("| lower space du -sB1 / native's | " + " | ".join(f2(div(m('tree', c, 'lower_allocated'), m('tree', 'native', 'lower_allocated')), 3) for c in tree_cfgs) + " |")
    zr = E.get("BENCH_COMP_ZSTD", "")
    sections.append(("zstd,crypt on compressible data",
        f"A {size_name(csize)} text file (the headers of /usr/include concatenated and repeated; `zstd -3` of the whole "
        f"file gives {zr if zr else '–'} of its size, for reference; the layer compresses each 4 KiB chunk on its own) in "
        "`native`, `gocryptfs`, `crypt` and `zstd-crypt`, each in turn (rotated order), in a fresh lower directory: "
        "caches dropped, the source read into memory, then written as in the large-file writes (1 MiB `pwrite(2)`s, open "
        "to close, no fsync) and the `sync` after it timed apart; the space the file takes below (`du` of the lower "
        "directory after the sync minus before the write); unmount, drop caches, mount: a cold fio read (1 MiB blocks) "
        "and a warm one. In the first repetition the file is read back through a fresh mount and compared with the source.",
        "\n".join(L)))
    if "comp" in benches:
        a, b = m("comp", "zstd-crypt", "lower_apparent"), m("comp", "crypt", "lower_apparent")
        row("(for information) zstd,crypt: space of compressible text against crypt", "du -sb below: zstd-crypt / crypt",
            f"{fx(div(a, b), 3)} ({f2(a, 0)} / {f2(b, 0)} B; gocryptfs {f2(m('comp', 'gocryptfs', 'lower_apparent'), 0)} B)", "none set", None)
        for k, label in [("write", "write"), ("read_cold", "read, cold")]:
            a, b, g = m("comp", "zstd-crypt", k), m("comp", "crypt", k), m("comp", "gocryptfs", k)
            row(f"(for information) zstd,crypt on compressible text: {label}", "MiB/s: zstd-crypt / crypt, zstd-crypt / gocryptfs",
                f"{fx(div(a, b))}, {fx(div(a, g))} ({f2(a, 0)} / {f2(b, 0)} / {f2(g, 0)} MiB/s)", "none set", None)

counted = [r for r in rows if not r.startswith("| (for information)")]
rows = counted + [r for r in rows if r.startswith("| (for information)")]
targets = "| target | metric | measured (median unless stated) | required | result |\n| --- | --- | --- | --- | --- |\n" + "\n".join(rows)
npass = sum(r.endswith("PASS |") for r in counted)
nmiss = sum(r.endswith("MISS |") for r in counted)

faillog = open(E["BENCH_FAILLOG"]).read().strip() if os.path.exists(E["BENCH_FAILLOG"]) else ""
mism = open(E["BENCH_MISMATCH"]).read().strip() if os.path.exists(E["BENCH_MISMATCH"]) else ""
warnings = E.get("BENCH_WARNINGS", "").strip()

print()
for title, _, table in sections:
    print(f"== {title}\n{table}\n")
print(f"Targets: {npass} PASS, {nmiss} MISS")
print(targets)
if mism:
    print("\n!!! DATA MISMATCHES:\n" + mism)
else:
    print("\nData checks: everything read back through the mounts matched, and nothing showed in the clear below.")
if faillog:
    print("\nFailures:\n" + faillog)
if warnings:
    print("\nplyfs daemon warnings (count, line):\n" + warnings)

if E["BENCH_WRITE_DOC"] != "1":
    raise SystemExit(0)

doc = E["BENCH_DOC"]
BEGIN, END = "<!-- crypt:begin -->", "<!-- crypt:end -->"
text = open(doc).read() if os.path.exists(doc) else "# plyfs benchmarks\n"
if BEGIN not in text or END not in text:
    text = text.rstrip("\n") + "\n\n## Encryption: the crypt layer (issue #5)\n\n" + BEGIN + "\n" + END + "\n"

now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z").strip()
secs = int(E["BENCH_SECONDS"])
sec = [BEGIN, "",
       "`bench/crypt.sh` measures the crypt layer (issue #5) against gocryptfs and the plain directory, all in the same "
       "run: large-file I/O, a source tree, and `zstd,crypt` on compressible data. It rewrites this section; the rest of "
       "the file is left alone.", "",
       f"### Results of {now}", "",
       f"- command: `{E['BENCH_CMD']}` ({secs // 60} min {secs % 60} s in all, data preparation included)",
       f"- commit: `{E['BENCH_HEAD']}` (`git rev-parse --short HEAD` when the run started; plyfs under test: {E['BENCH_REV']})",
       f"- machine: {E['BENCH_CPU']} (AES-NI: {E['BENCH_AES']}), nproc {E['BENCH_NCPU']}, {E['BENCH_MEM']} RAM; kernel {E['BENCH_KERNEL']}; "
       f"lower directories on {E['BENCH_FSTYPE']} ({E['BENCH_FSOPTS']})",
       f"- tools: {E['BENCH_FIO']}; {E['BENCH_GOCRYPTFS']}",
       "- configurations: `native` (the directory itself); `gocryptfs` (`gocryptfs -init -scryptn 10`, mounted with its "
       "defaults: AES-256-GCM, encrypted names); `crypt` (`plyfs init --layer crypt --kdf-memory 1024`, `plyfs mount "
       "--stack crypt`: AES-256-GCM, encrypted names); `zstd-crypt` (the same volume, `--stack zstd,crypt`: compress, "
       "then seal, one layer); `null` (`--stack null`, passthrough on; no encryption, for reference)",
       f"- runs: {runs} per measurement, median reported; in every repetition the configurations run in a rotated order",
       "- benchmarks: " + ", ".join(f"`{b}`" for b in benches)]
if E["BENCH_QUICK"] == "1":
    sec.append("- **--quick run**: fewer runs and smaller sizes than the default")
sec += ["", f"#### Targets ({npass} PASS, {nmiss} MISS)", "", targets]
if mism:
    sec += ["", "#### DATA MISMATCHES", "", "```", mism, "```"]
else:
    checks = []
    if "tree" in benches:
        checks.append(f"every file ({nfiles:,}) and symlink ({nlinks}) of the tree read back through a fresh mount matched "
                      "the tarball's, in every configuration; below the encrypting ones no file held the plaintext line "
                      "searched for and no name held `stdio.h` (in `native` and `null` both were found)")
    if "comp" in benches:
        checks.append("the compressible file read back through a fresh mount matched its source")
    sec += ["", "Data checks (first repetition): " + "; ".join(checks) + "." if checks else ""]
for title, intro, table in sections:
    sec += ["", f"#### {title}", "", intro, "", table]
if faillog:
    sec += ["", "#### Failures during this run", "", "```", faillog, "```"]
if warnings:
    sec += ["", "#### plyfs daemon warnings (count, message)", "", "```", warnings, "```"]
sec += ["", END]
pre, rest = text.split(BEGIN, 1)
post = rest.split(END, 1)[1]
with open(doc + ".tmp", "w") as f:
    f.write(pre + "\n".join(sec) + post)
os.replace(doc + ".tmp", doc)
print(f"\nwrote the crypt section of {doc}")
PY
