#!/usr/bin/env bash
# bench/shared.sh: the benchmarks of shared lowers (issue #13), every baseline in the same run.
#
#   bench/shared.sh [--quick] [--runs N] [--local-runs N] [--only gluster|local] [--no-write-doc]
#
# Over GlusterFS (scripts/gluster.sh: one node, replica 2, set up for sharing), each configuration
# in a directory of its own on the volume:
#   gluster     the volume itself
#   null        plyfs --stack null  -o shared
#   zstd        plyfs --stack zstd  -o shared
#   crypt       plyfs --stack crypt -o shared   (a volume made by `plyfs init --layer crypt`)
#   gocryptfs   gocryptfs -sharedstorage        (`gocryptfs -init -scryptn 10`)
# workloads: a sequential write of SIZE of incompressible data (dd, 1 MiB blocks, fsync before
# the close), a cold sequential read of it (caches dropped), and the untar of /usr/include's
# tarball (then sync).
#
# On a local lower (a tmpfs, so that the disk's own swings stay out), the cost of the sharing
# mode: zstd, crypt and a mirror of two directories mounted with and without -o shared, for
# 2,000 appends of a line each (`echo line >> file`, an open, a write and a close each) and the
# same untar.
#
# Each repetition over GlusterFS runs the configurations in a rotated order (--runs, 3 by
# default); the local pairs run back to back, alternating which goes first (--local-runs, 7 by
# default). Medians are reported. The report
# replaces the section between <!-- shared:begin --> and <!-- shared:end --> in docs/benchmarks.md.
#
# Environment: PLYFS_BIN, BENCH_OUT (as the other scripts).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CMDLINE="bench/shared.sh${*:+ $*}"
. "$REPO/bench/common.sh"
exec 3>&2

runs=3 local_runs=7 size_mb=1024 write_doc=1 only=
while (($#)); do
    case $1 in
        --quick) runs=2 local_runs=3 size_mb=256; shift ;;
        --runs) runs=$2; shift 2 ;;
        --local-runs) local_runs=$2; shift 2 ;;
        --no-write-doc) write_doc=0; shift ;;
        --only) only=$2; shift 2 ;;
        -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "bench/shared.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
[[ $(id -u) -eq 0 ]] || { echo "bench/shared.sh: run as root (mounts, dropping caches, GlusterFS)" >&2; exit 1; }

install_missing gocryptfs python3
set_out_dir bench/shared.sh
WORK=$(mktemp -d "$OUT/shared.XXXXXX")
use_plyfs bench/shared.sh "$WORK/bin" 1
RESULTS=$OUT/shared-results.csv
echo "workload,config,run,seconds" >"$RESULTS"

MOUNTS=()
GLUSTER_STARTED=0
cleanup() {
    local m
    for m in "${MOUNTS[@]}"; do
        is_mounted "$m" && { "$PLYFS" umount "$m" 2>/dev/null || fusermount3 -uz "$m" 2>/dev/null || umount -l "$m"; }
    done
    [[ -n ${LOCAL:-} ]] && mountpoint -q "$LOCAL" && umount "$LOCAL"
    rm -rf "${GDIR:-/nonexistent}" "$WORK" 2>/dev/null || true
    ((GLUSTER_STARTED)) && "$REPO/scripts/gluster.sh" down >/dev/null 2>&1 || true
}
trap cleanup EXIT
trap 'exit 130' INT TERM

scripts_gluster=$REPO/scripts/gluster.sh
"$scripts_gluster" status >/dev/null 2>&1 || GLUSTER_STARTED=1
GMOUNTS=$("$scripts_gluster" up)
G1=${GMOUNTS%%$'\n'*}
GDIR=$G1/bench-shared-$$
mkdir -p "$GDIR"

# The inputs: incompressible data and the tarball.
log "making $size_mb MiB of random data and the /usr/include tarball"
head -c "$((size_mb << 20))" /dev/urandom >"$WORK/data"
TARBALL=$WORK/include.tar
tar -C /usr -cf "$TARBALL" include
echo "benchmark" >"$WORK/pass"

# mount_config NAME LOWER MNT: mount one configuration (plyfs stacks take -o shared, or not with
# a -local suffix).
mount_config() {
    local name=$1 lower=$2 mnt=$3
    mkdir -p "$lower" "$mnt"
    MOUNTS+=("$mnt")
    case $name in
        gluster) ;;
        gocryptfs)
            gocryptfs -q -init -scryptn 10 -passfile "$WORK/pass" "$lower" >/dev/null
            gocryptfs -q -sharedstorage -passfile "$WORK/pass" "$lower" "$mnt" ;;
        crypt*)
            "$PLYFS" init "$lower" --layer crypt --kdf-memory 1024 --passfile "$WORK/pass" >/dev/null 2>&1
            "$PLYFS" mount "$lower" "$mnt" --stack crypt --passfile "$WORK/pass" $(opts "$name") >/dev/null ;;
        mirror*)
            mkdir -p "$lower-b"
            "$PLYFS" mount "$lower" "$mnt" --stack mirror --branch "$lower-b" $(opts "$name") >/dev/null ;;
        *) "$PLYFS" mount "$lower" "$mnt" --stack "${name%%-*}" $(opts "$name") >/dev/null ;;
    esac
}
opts() { [[ $1 == *-unshared ]] && echo "" || echo "-o shared"; }

# where CONFIG: the directory to work in.
where() { if [[ $1 == gluster ]]; then echo "$GDIR/gluster"; else echo "$WORK/mnt-$1"; fi; }

record() { echo "$1,$2,$3,$ELAPSED" >>"$RESULTS"; log "$1 $2 run $3: ${ELAPSED}s"; }

GLUSTER_CONFIGS=(gluster null zstd crypt gocryptfs)
LOCAL_STACKS=(zstd crypt mirror)
[[ $only == local ]] && GLUSTER_CONFIGS=()
[[ $only == gluster ]] && LOCAL_STACKS=()
LOCAL_CONFIGS=()
for s in "${LOCAL_STACKS[@]}"; do LOCAL_CONFIGS+=("$s-unshared" "$s-shared"); done
for c in "${GLUSTER_CONFIGS[@]}"; do
    if [[ $c == gluster ]]; then mkdir -p "$GDIR/gluster"; else mount_config "$c" "$GDIR/lower-$c" "$WORK/mnt-$c"; fi
done
if ((${#LOCAL_CONFIGS[@]})); then
    LOCAL=$WORK/tmpfs
    mkdir -p "$LOCAL"
    mount -t tmpfs -o size=2g tmpfs "$LOCAL"
fi
for c in "${LOCAL_CONFIGS[@]}"; do mount_config "$c" "$LOCAL/lower-$c" "$WORK/mnt-$c"; done

APPENDS='for i in $(seq 2000); do echo "line $i of the appends benchmark" >>"$1/appends"; done'
UNTAR='tar -C "$1" -xf "$2" && sync'

for run in $(seq "$runs"); do
    # Rotate the order from one repetition to the next.
    rot=$(((run - 1) % (${#GLUSTER_CONFIGS[@]} + 1)))
    order=("${GLUSTER_CONFIGS[@]:rot}" "${GLUSTER_CONFIGS[@]:0:rot}")
    for c in "${order[@]}"; do
        d=$(where "$c")
        run_timed 1800 dd if="$WORK/data" of="$d/big" bs=1M conv=fsync status=none; record write "$c" "$run"
        drop_caches
        run_timed 1800 dd if="$d/big" of=/dev/null bs=1M status=none; record read "$c" "$run"
        rm -f "$d/big"
        rm -rf "$d/tree"; mkdir "$d/tree"
        run_timed 1800 bash -c "$UNTAR" _ "$d/tree" "$TARBALL"; record untar "$c" "$run"
        rm -rf "$d/tree"
    done
done

# The local costs are differences of a few per cent between runs of a few seconds: each stack's
# unshared and shared mounts run back to back (which goes first alternates), more times.
for run in $(seq "$local_runs"); do
    for s in "${LOCAL_STACKS[@]}"; do
        pair=("$s-unshared" "$s-shared")
        ((run % 2)) || pair=("$s-shared" "$s-unshared")
        for c in "${pair[@]}"; do
            d=$(where "$c")
            rm -f "$d/appends"
            run_timed 600 bash -c "$APPENDS" _ "$d"; record appends-local "$c" "$run"
            rm -rf "$d/tree"; mkdir "$d/tree"
            run_timed 1800 bash -c "$UNTAR" _ "$d/tree" "$TARBALL"; record untar-local "$c" "$run"
            rm -rf "$d/tree"
        done
    done
done

REPORT=$WORK/report.md
python3 - "$RESULTS" "$size_mb" "$runs" "$PLYFS_REV" "$CMDLINE" "$local_runs" >"$REPORT" <<'PY'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
size_mb, runs, rev, cmd, local_runs = int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
med = {}
for w in {r["workload"] for r in rows}:
    for c in {r["config"] for r in rows if r["workload"] == w}:
        med[w, c] = statistics.median(float(r["seconds"]) for r in rows if r["workload"] == w and r["config"] == c)
def cell(w, c, base, mbs=False):
    if (w, c) not in med: return "—"
    t = med[w, c]
    v = f"{size_mb / t:.0f} MiB/s" if mbs else f"{t:.2f} s"
    if base and (w, base) in med and c != base:
        v += f" ({med[w, base] / t:.2f}×)"
    return v
print(f"`{cmd}` (plyfs {rev}; medians of {runs} runs over GlusterFS and {local_runs} on the local lower; {size_mb} MiB files; GlusterFS 1 node, replica 2, two bricks on the same disk).\n")
print("Over GlusterFS (speed relative to GlusterFS itself; for crypt, relative to gocryptfs -sharedstorage in the last column):\n")
print("| workload | GlusterFS | plyfs null | plyfs zstd | plyfs crypt | gocryptfs -sharedstorage | crypt vs gocryptfs |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for w, label, mbs in [("write", "sequential write, fsync", True), ("read", "sequential read, cold", True), ("untar", "untar /usr/include, sync", False)]:
    vs = f"{med[w, 'gocryptfs'] / med[w, 'crypt']:.2f}×" if (w, "crypt") in med and (w, "gocryptfs") in med else "—"
    print(f"| {label} | " + " | ".join(cell(w, c, "gluster", mbs) for c in ["gluster", "null", "zstd", "crypt", "gocryptfs"]) + f" | {vs} |")
print("\nThe cost of -o shared on a local lower (tmpfs), time with / time without (each pair run back to back):\n")
print("| stack | 2,000 appends (`echo >>`) | with -o shared | cost | untar /usr/include, sync | with -o shared | cost |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for s, label in [("zstd", "zstd"), ("crypt", "crypt"), ("mirror", "mirror (two branches)")]:
    out = [label]
    for w in ["appends-local", "untar-local"]:
        a, b = med.get((w, f"{s}-unshared")), med.get((w, f"{s}-shared"))
        out += [f"{a:.2f} s", f"{b:.2f} s", f"{(b / a - 1) * 100:+.0f}%"] if a and b else ["—"] * 3
    print("| " + " | ".join(out) + " |")
PY
cat "$REPORT"
if ((write_doc)); then write_doc_section shared "Shared lowers (bench/shared.sh)" "$REPORT"; fi
