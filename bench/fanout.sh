#!/usr/bin/env bash
# bench/fanout.sh: the benchmarks of the tree layers (union, mirror, version) against the peers
# people use instead (kernel overlayfs, fuse-overlayfs, mergerfs, unionfs-fuse) and against
# single-branch plyfs and native, side by side in one run; medians of several runs.
#
#   bench/fanout.sh [--runs N] [--size SIZE] [--files N] [--only GROUPS] [--no-write-doc]
#
# Groups (targets of issue #10):
#   meta      untar, ls -lR, rm -rf of /usr/include on a 2-branch union (tmpfs; a read-only lower
#             branch holding a tree of its own): plyfs union against overlayfs, fuse-overlayfs,
#             mergerfs, unionfs-fuse and a 1-branch plyfs null     target: faster than the FUSE
#             peers, <= 1.1x plyfs null
#   reads     warm sequential and 4 KiB random reads of a file on the union's read-only branch
#                                                                   target: >= 0.9x native
#   copyup    copy-up of a SIZE file for a 1-byte write, against cp of it on the same disk
#                                                                   target: <= 1.1x cp
#   mirror    sequential write (fio, 128 KiB, end fsync) and warm read through a 2-branch mirror
#             on one disk, against a 1-branch mirror    target: write >= 0.45x, reads >= 0.9x
#   resync    resync after 1% of an N-file tree changed, against a full scrub (both with cold
#             caches)                                               target: <= 5% of the scrub
#   version   overwrite (O_TRUNC, fdatasync) of a SIZE file on an XFS image with reflinks, through
#             version and through null                              target: <= 1.1x
#
# Raw values go to bench-out/fanout/results.csv; a full run rewrites the section between the
# fanout markers in docs/benchmarks.md. Needs root (kernel overlayfs, loop devices, passthrough).
# Environment: PLYFS_BIN, BENCH_OUT (as bench/run.sh).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CMDLINE="${PLYFS_BIN:+PLYFS_BIN=$PLYFS_BIN }bench/fanout.sh${*:+ $*}"
ALL_GROUPS=(meta reads copyup mirror resync version)
RUNS=3 SIZE=1g FILES=10000 ONLY="" WRITE_DOC=1
while (($#)); do
    case $1 in
        --runs) RUNS=${2:?}; shift ;;
        --size) SIZE=${2:?}; shift ;;
        --files) FILES=${2:?}; shift ;;
        --only) ONLY=${2:?}; shift ;;
        --no-write-doc) WRITE_DOC=0 ;;
        -h | --help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "fanout.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
    shift
done
[[ $RUNS =~ ^[1-9][0-9]*$ ]] || { echo "fanout.sh: --runs must be a positive integer" >&2; exit 2; }
[[ $SIZE =~ ^[0-9]+[mMgG]$ ]] || { echo "fanout.sh: --size must look like 256m or 1g" >&2; exit 2; }
GROUPS_RUN=("${ALL_GROUPS[@]}")
[[ -n $ONLY ]] && IFS=, read -r -a GROUPS_RUN <<<"$ONLY"
[[ $(id -u) -eq 0 ]] || { echo "fanout.sh: run as root" >&2; exit 1; }
SIZE_MB=$(awk -v s="$SIZE" 'BEGIN { n = s + 0; if (s ~ /[gG]$/) n *= 1024; print n }')

exec 3>&2
. "$REPO/bench/common.sh"
install_missing fio bindfs fuse-overlayfs mergerfs unionfs-fuse mkfs.xfs:xfsprogs
set_out_dir fanout.sh
OUT=$OUT/fanout
mkdir -p "$OUT"
use_plyfs fanout.sh "$OUT/bin" 1
CSV=$OUT/results.csv
echo "group,config,metric,run,value" >"$CSV"

# --- Cleanup: whatever this script mounted goes, whatever happens ------------------------------
MOUNTS=() LOOPS=() TMPDIRS=()
cleanup() {
    local i
    [[ -n $CHILD ]] && kill "$CHILD" 2>/dev/null
    for ((i = ${#MOUNTS[@]} - 1; i >= 0; i--)); do
        is_mounted "${MOUNTS[$i]}" && { umount "${MOUNTS[$i]}" 2>/dev/null || umount -l "${MOUNTS[$i]}" 2>/dev/null || true; }
    done
    for i in ${LOOPS[@]+"${LOOPS[@]}"}; do umount "$i" 2>/dev/null || umount -l "$i" 2>/dev/null || true; done
    for i in ${TMPDIRS[@]+"${TMPDIRS[@]}"}; do rm -rf "$i"; done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

unmount() { # MNT
    local m=$1
    if [[ $(awk -v p="$m" '$5 == p { print $9 }' /proc/self/mountinfo) == fuse.plyfs ]]; then
        "$PLYFS" umount "$m" >/dev/null
    else
        umount "$m" 2>/dev/null || fusermount3 -u "$m"
    fi
    local i=0
    while is_mounted "$m" && ((i++ < 100)); do sleep 0.05; done
}

# mount_cfg CONFIG UPPER LOWER MNT [WORKDIR]: a union of UPPER (read-write) over LOWER (read-only).
mount_cfg() {
    local cfg=$1 up=$2 lo=$3 mnt=$4 wd=${5:-}
    MOUNTS+=("$mnt")
    case $cfg in
        overlayfs) mount -t overlay overlay -o "lowerdir=$lo,upperdir=$up,workdir=$wd" "$mnt" ;;
        fuse-overlayfs) fuse-overlayfs -o "lowerdir=$lo,upperdir=$up,workdir=$wd" "$mnt" 2>/dev/null ;;
        mergerfs) mergerfs -o category.create=ff "$up=RW:$lo=RO" "$mnt" ;;
        unionfs-fuse) unionfs-fuse -o cow "$up=RW:$lo=RO" "$mnt" ;;
        plyfs-union) "$PLYFS" mount "$up" "$mnt" --stack union --branch "$lo=ro" >/dev/null 2>&1 ;;
        plyfs-null) "$PLYFS" mount "$up" "$mnt" --stack null >/dev/null 2>&1 ;;
        *) echo "unknown configuration $cfg" >&2; return 1 ;;
    esac
}

record() { echo "$1,$2,$3,$4,$5" >>"$CSV"; }
median() { # GROUP CONFIG METRIC
    awk -F, -v g="$1" -v c="$2" -v m="$3" '$1 == g && $2 == c && $3 == m { print $5 }' "$CSV" | sort -g |
        awk '{ v[NR] = $1 } END { if (NR == 0) print "nan"; else if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b == 0 || a == "nan" || b == "nan") print "nan"; else printf "%.2f", a / b }'; }
verdict() { # VALUE OP TARGET
    awk -v v="$1" -v op="$2" -v t="$3" 'BEGIN { if (v == "nan") print "n/a"; else if ((op == "<=" && v <= t) || (op == ">=" && v >= t) || (op == "<" && v < t)) print "PASS"; else print "MISS" }'
}
fio_mibs() { # FILE RW BS [extra...]: prints MiB/s or IOPS
    local file=$1 rw=$2 bs=$3; shift 3
    local out
    # invalidate=0: a warm read must find the pages the previous read left.
    out=$(fio --name=b --filename="$file" --rw="$rw" --bs="$bs" --size="$SIZE" --ioengine=psync --invalidate=0 --output-format=json "$@" 2>/dev/null)
    python3 -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]; k="read" if j["read"]["io_bytes"] else "write"; print(round(j[k]["iops"] if sys.argv[1]=="iops" else j[k]["bw_bytes"]/1048576))' "${IOPS:-bw}" <<<"$out"
}

RESULTS=()   # markdown rows

# --- meta ------------------------------------------------------------------------------------------
group_meta() {
    local tmp tarball cfgs=(native overlayfs fuse-overlayfs mergerfs unionfs-fuse plyfs-union plyfs-null) r i cfg
    tmp=$(mktemp -d /dev/shm/plyfs-fanout.XXXXXX); TMPDIRS+=("$tmp")
    tarball=$tmp/include.tar
    tar -C /usr -cf "$tarball" include
    local entries; entries=$(tar -tf "$tarball" | wc -l)
    log "meta: $entries entries, $RUNS runs, configurations ${cfgs[*]}"
    for ((r = 1; r <= RUNS; r++)); do
        for ((i = 0; i < ${#cfgs[@]}; i++)); do
            cfg=${cfgs[$(((i + r) % ${#cfgs[@]}))]}
            local d=$tmp/run; rm -rf "$d"; mkdir -p "$d"/{up,lo,work,mnt}
            mkdir -p "$d/lo/base" && cp -r /usr/include/linux "$d/lo/base/" 2>/dev/null || true
            local target=$d/mnt
            if [[ $cfg == native ]]; then target=$d/up; else mount_cfg "$cfg" "$d/up" "$d/lo" "$d/mnt" "$d/work"; fi
            run_timed 600 tar -C "$target" -xf "$tarball"; record meta "$cfg" untar "$r" "$ELAPSED"
            run_timed 600 sh -c "ls -lR '$target' >/dev/null"; record meta "$cfg" ls_lR "$r" "$ELAPSED"
            run_timed 600 rm -rf "$target/include"; record meta "$cfg" rm_rf "$r" "$ELAPSED"
            [[ $cfg == native ]] || unmount "$d/mnt"
        done
    done
    for w in untar ls_lR rm_rf; do
        local u n; u=$(median meta plyfs-union "$w"); n=$(median meta plyfs-null "$w")
        local row="| $w ($entries entries, tmpfs) | native $(median meta native "$w") s; overlayfs $(median meta overlayfs "$w"); fuse-overlayfs $(median meta fuse-overlayfs "$w"); mergerfs $(median meta mergerfs "$w"); unionfs-fuse $(median meta unionfs-fuse "$w"); plyfs null $n | plyfs union $u s"
        local best; best=$(printf '%s\n' "$(median meta fuse-overlayfs "$w")" "$(median meta mergerfs "$w")" "$(median meta unionfs-fuse "$w")" | sort -g | head -1)
        local vs; vs=$(ratio "$u" "$n")
        RESULTS+=("$row | $vs x null, $(ratio "$u" "$best") x the fastest FUSE peer | $( [[ $(verdict "$vs" "<=" 1.1) == PASS && $(verdict "$(ratio "$u" "$best")" "<" 1) == PASS ]] && echo PASS || echo MISS) |")
    done
}

# --- reads -------------------------------------------------------------------------------------------
group_reads() {
    local d=$OUT/reads r cfg
    rm -rf "$d"; mkdir -p "$d"/{up,lo,mnt}
    fio --name=mk --filename="$d/lo/big" --rw=write --bs=1m --size="$SIZE" --ioengine=psync >/dev/null 2>&1
    for ((r = 1; r <= RUNS; r++)); do
        for cfg in native plyfs-union; do
            local f=$d/lo/big
            if [[ $cfg != native ]]; then mount_cfg "$cfg" "$d/up" "$d/lo" "$d/mnt"; f=$d/mnt/big; fi
            cat "$f" >/dev/null
            record reads "$cfg" seq_warm "$r" "$(fio_mibs "$f" read 128k)"
            record reads "$cfg" rand_warm "$r" "$(IOPS=iops fio_mibs "$f" randread 4k --time_based --runtime=5)"
            [[ $cfg == native ]] || unmount "$d/mnt"
        done
    done
    local s r4; s=$(ratio "$(median reads plyfs-union seq_warm)" "$(median reads native seq_warm)")
    r4=$(ratio "$(median reads plyfs-union rand_warm)" "$(median reads native rand_warm)")
    RESULTS+=("| warm sequential read, union (file on the read-only branch) | native $(median reads native seq_warm) MiB/s | $(median reads plyfs-union seq_warm) MiB/s | $s x native | $(verdict "$s" ">=" 0.9) |")
    RESULTS+=("| warm 4 KiB random read, union | native $(median reads native rand_warm) IOPS | $(median reads plyfs-union rand_warm) IOPS | $r4 x native | $(verdict "$r4" ">=" 0.9) |")
    rm -rf "$d"
}

# --- copyup ------------------------------------------------------------------------------------------
group_copyup() {
    local d=$OUT/copyup r
    rm -rf "$d"; mkdir -p "$d"/{lo,mnt,cp}
    fio --name=mk --filename="$d/lo/big" --rw=write --bs=1m --size="$SIZE" --ioengine=psync >/dev/null 2>&1
    for ((r = 1; r <= RUNS; r++)); do
        rm -rf "$d/up" "$d/cp/big"; mkdir -p "$d/up"
        drop_caches
        run_timed 600 sh -c "cp '$d/lo/big' '$d/cp/big' && sync"; record copyup cp total "$r" "$ELAPSED"
        rm -f "$d/cp/big"
        mount_cfg plyfs-union "$d/up" "$d/lo" "$d/mnt"
        drop_caches
        run_timed 600 sh -c "printf x | dd of='$d/mnt/big' bs=1 count=1 conv=notrunc 2>/dev/null && sync"; record copyup plyfs-union total "$r" "$ELAPSED"
        unmount "$d/mnt"
        [[ $(stat -c %s "$d/up/big") == $(stat -c %s "$d/lo/big") ]] || { log "copyup: the copy has the wrong size"; exit 1; }
    done
    local x; x=$(ratio "$(median copyup plyfs-union total)" "$(median copyup cp total)")
    RESULTS+=("| copy-up of a $SIZE file for a 1-byte write (ext4, cold) | cp $(median copyup cp total) s | plyfs union $(median copyup plyfs-union total) s | $x x cp | $(verdict "$x" "<=" 1.1) |")
    rm -rf "$d"
}

# --- mirror ------------------------------------------------------------------------------------------
group_mirror() {
    local d=$OUT/mirror r cfg
    for ((r = 1; r <= RUNS; r++)); do
        for cfg in mirror1 mirror2; do
            rm -rf "$d"; mkdir -p "$d"/{a,b,mnt}
            MOUNTS+=("$d/mnt")
            if [[ $cfg == mirror2 ]]; then
                "$PLYFS" mount "$d/a" "$d/mnt" --stack mirror --branch "$d/b" >/dev/null 2>&1
            else
                "$PLYFS" mount "$d/a" "$d/mnt" --stack mirror >/dev/null 2>&1
            fi
            record mirror "$cfg" write "$r" "$(fio_mibs "$d/mnt/f" write 128k --end_fsync=1)"
            cat "$d/mnt/f" >/dev/null
            record mirror "$cfg" read_warm "$r" "$(fio_mibs "$d/mnt/f" read 128k)"
            unmount "$d/mnt"
        done
    done
    local w rd; w=$(ratio "$(median mirror mirror2 write)" "$(median mirror mirror1 write)")
    rd=$(ratio "$(median mirror mirror2 read_warm)" "$(median mirror mirror1 read_warm)")
    RESULTS+=("| mirror sequential write, 2 branches on one disk | 1 branch $(median mirror mirror1 write) MiB/s | 2 branches $(median mirror mirror2 write) MiB/s | $w x one branch | $(verdict "$w" ">=" 0.45) |")
    RESULTS+=("| mirror warm sequential read | 1 branch $(median mirror mirror1 read_warm) MiB/s | 2 branches $(median mirror mirror2 read_warm) MiB/s | $rd x one branch | $(verdict "$rd" ">=" 0.9) |")
    rm -rf "$d"
}

# --- resync ------------------------------------------------------------------------------------------
group_resync() {
    local d=$OUT/resync r changed=$((FILES / 100))
    for ((r = 1; r <= RUNS; r++)); do
        rm -rf "$d"; mkdir -p "$d"/{a,b,mnt}
        MOUNTS+=("$d/mnt")
        "$PLYFS" mount "$d/a" "$d/mnt" --stack 'mirror[|fault]' --branch "$d/b" >/dev/null 2>&1
        python3 - "$d/mnt" "$FILES" <<'PY'
import os, sys
root, n = sys.argv[1], int(sys.argv[2])
for i in range(n):
    d = os.path.join(root, "d%03d" % (i // 100))
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "f%05d" % i), "wb") as f:
        f.write(os.urandom(4096))
PY
        "$PLYFS" op "$d/mnt" fault-add@mirror.1.fault error=EIO >/dev/null
        python3 - "$d/mnt" "$FILES" "$changed" <<'PY'
import os, sys
root, n, k = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for j in range(k):
    i = j * (n // k)
    with open(os.path.join(root, "d%03d" % (i // 100), "f%05d" % i), "wb") as f:
        f.write(os.urandom(4096))
PY
        "$PLYFS" op "$d/mnt" fault-clear@mirror.1.fault >/dev/null
        # Both from cold caches, as a scrub of a tree too large for memory reads it.
        drop_caches
        run_timed 900 "$PLYFS" op "$d/mnt" resync >/dev/null; record resync plyfs resync "$r" "$ELAPSED"
        drop_caches
        run_timed 1800 "$PLYFS" op "$d/mnt" scrub >/dev/null; record resync plyfs scrub "$r" "$ELAPSED"
        unmount "$d/mnt"
        diff -r --exclude=.plyfs-mirror.log "$d/a" "$d/b" >/dev/null || { log "resync: the branches differ"; exit 1; }
    done
    local x; x=$(ratio "$(median resync plyfs resync)" "$(median resync plyfs scrub)")
    RESULTS+=("| resync after 1% of a $FILES-file tree changed | full scrub $(median resync plyfs scrub) s | resync $(median resync plyfs resync) s | $x x the scrub | $(verdict "$x" "<=" 0.05) |")
    rm -rf "$d"
}

# --- version -----------------------------------------------------------------------------------------
group_version() {
    local d=$OUT/version r cfg img
    rm -rf "$d"; mkdir -p "$d"/{xfs,mnt}
    img=$d/xfs.img
    truncate -s $((SIZE_MB * 4 + 512))M "$img"
    mkfs.xfs -q -m reflink=1 "$img"
    mount -o loop "$img" "$d/xfs"; LOOPS+=("$d/xfs")
    for ((r = 1; r <= RUNS; r++)); do
        for cfg in null version; do
            local lo=$d/xfs/$cfg; rm -rf "$lo"; mkdir -p "$lo"
            MOUNTS+=("$d/mnt")
            local stack=null; [[ $cfg == version ]] && stack=version:keep=1
            "$PLYFS" mount "$lo" "$d/mnt" --stack "$stack" >/dev/null 2>&1
            dd if=/dev/zero of="$d/mnt/big" bs=1M count="$SIZE_MB" conv=fdatasync status=none
            run_timed 600 dd if=/dev/zero of="$d/mnt/big" bs=1M count="$SIZE_MB" conv=fdatasync status=none
            record version "$cfg" overwrite "$r" "$ELAPSED"
            unmount "$d/mnt"
            rm -rf "$lo"
        done
    done
    local x; x=$(ratio "$(median version version overwrite)" "$(median version null overwrite)")
    RESULTS+=("| overwrite of a $SIZE file, XFS with reflinks | null $(median version null overwrite) s | version $(median version version overwrite) s | $x x without version | $(verdict "$x" "<=" 1.1) |")
    umount "$d/xfs"
    rm -rf "$d"
}

for g in "${GROUPS_RUN[@]}"; do
    [[ " ${ALL_GROUPS[*]} " == *" $g "* ]] || { echo "fanout.sh: unknown group '$g' (${ALL_GROUPS[*]})" >&2; exit 2; }
    log "group $g"
    "group_$g"
done

REPORT=$OUT/report.md
{
    echo "Measured $(date -u +%Y-%m-%d) on $(uname -r), plyfs $PLYFS_REV, medians of $RUNS runs, with \`$CMDLINE\`."
    echo
    echo "| workload | baselines | plyfs | ratio | target |"
    echo "| --- | --- | --- | --- | --- |"
    printf '%s\n' "${RESULTS[@]}"
} >"$REPORT"
cat "$REPORT"
if ((WRITE_DOC)) && [[ -z $ONLY ]]; then
    write_doc_section fanout 'Trees: union, mirror, version (`bench/fanout.sh`)' "$REPORT"
fi
