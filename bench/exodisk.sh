#!/usr/bin/env bash
# bench/exodisk.sh: the exodisk volume and exofs (issue #12) against the thesis (Grimm, chapter 5),
# against the service's own raw path, and against ext4 made on an image of the same size and
# mounted through a loop device; medians of several runs, in one run.
#
#   bench/exodisk.sh [--runs N] [--only GROUPS] [--no-write-doc]
#
# Groups (each one `plyfs exodisk bench` group, except fs):
#   small    1,000 x 10 KB and 10,000 x 1 KB: alloc+write, read, dealloc, as self-protected extents,
#            as exonodes and on the raw path              target: exonode overhead <= 5% over raw
#   large    one 80 MB file, sequential (1 MiB) and random (4 KiB) writes and reads, exofs against
#            the raw path                                 target: >= 0.95x raw
#   two      two clients at once, 1,000 x 10 KB each, interleaved ten files at a time against
#            partitioned 250 MB apart                     target: the thesis's gain or better
#   insert   16 bytes in the middle of 10 KB, 100 KB and 1000 KB files, exofs's indexed insert
#            against copying the second half, each made durable
#                                                         target: constant, no worse than the copy at 10 KB
#   ddio     random 4 KiB reads with N = 1, 32, 128 outstanding
#                                                         target: >= +24% at 32, >= +39% at 128
#   persist  per-file alloc+write (4 KiB) under memory, metadata and data: exofs files whose
#            directory picks the model, and self-protected extents
#                                                         target: memory >= 10x faster than data
#   fs       exofs under a plyfs null stack against ext4 (loop device) under the same stack: create
#            (untar of 4,000 files of 1-8 KB, then unmount, which writes back), read (fresh
#            mount, caches dropped) and delete (rm -rf, then unmount)
#                                                         target: faster than ext4
#
# The volume is a 2 GiB image written full of zeros first, so that no first write pays for the host
# file system's allocation. Raw values go to bench-out/exodisk/results.csv; a full run rewrites the
# section between the exodisk markers in docs/benchmarks.md. Needs root (loop device, mounts).
# Environment: PLYFS_BIN, BENCH_OUT.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CMDLINE="${PLYFS_BIN:+PLYFS_BIN=$PLYFS_BIN }bench/exodisk.sh${*:+ $*}"
ALL_GROUPS=(small large two insert ddio persist fs)
RUNS=3 ONLY="" WRITE_DOC=1
while (($#)); do
    case $1 in
        --runs) RUNS=${2:?}; shift ;;
        --only) ONLY=${2:?}; shift ;;
        --no-write-doc) WRITE_DOC=0 ;;
        -h | --help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "exodisk.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
    shift
done
[[ $RUNS =~ ^[1-9][0-9]*$ ]] || { echo "exodisk.sh: --runs must be a positive integer" >&2; exit 2; }
GROUPS_RUN=("${ALL_GROUPS[@]}")
[[ -n $ONLY ]] && IFS=, read -r -a GROUPS_RUN <<<"$ONLY"
for g in "${GROUPS_RUN[@]}"; do
    [[ " ${ALL_GROUPS[*]} " == *" $g "* ]] || { echo "exodisk.sh: unknown group '$g' (${ALL_GROUPS[*]})" >&2; exit 2; }
done
[[ $(id -u) -eq 0 ]] || { echo "exodisk.sh: run as root" >&2; exit 1; }

exec 3>&2
. "$REPO/bench/common.sh"
install_missing mkfs.ext4:e2fsprogs losetup:mount fusermount3:fuse3
set_out_dir exodisk.sh
OUT=$OUT/exodisk
mkdir -p "$OUT"
use_plyfs exodisk.sh "$OUT/bin" 1
CSV=$OUT/results.csv
echo "group,config,metric,run,value" >"$CSV"

# --- Cleanup: whatever this script started or mounted goes, whatever happens --------------------
MOUNTS=() PIDS=() LOOPS=() TMPDIRS=()
cleanup() {
    local i
    [[ -n $CHILD ]] && kill "$CHILD" 2>/dev/null
    for ((i = ${#MOUNTS[@]} - 1; i >= 0; i--)); do
        is_mounted "${MOUNTS[$i]}" && { umount "${MOUNTS[$i]}" 2>/dev/null || umount -l "${MOUNTS[$i]}" 2>/dev/null || true; }
    done
    for i in ${PIDS[@]+"${PIDS[@]}"}; do kill "$i" 2>/dev/null || true; done
    for i in ${LOOPS[@]+"${LOOPS[@]}"}; do losetup -d "$i" 2>/dev/null || true; done
    for i in ${TMPDIRS[@]+"${TMPDIRS[@]}"}; do rm -rf "$i"; done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

record() { echo "$1,$2,$3,$4,$5" >>"$CSV"; }
median() { # GROUP CONFIG METRIC
    awk -F, -v g="$1" -v c="$2" -v m="$3" '$1 == g && $2 == c && $3 == m { print $5 }' "$CSV" | sort -g |
        awk '{ v[NR] = $1 } END { if (NR == 0) print "nan"; else if (NR % 2) print v[(NR + 1) / 2]; else printf "%.4f\n", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b == 0 || a == "nan" || b == "nan") print "nan"; else printf "%.2f", a / b }'; }
verdict() { # VALUE OP TARGET
    awk -v v="$1" -v op="$2" -v t="$3" 'BEGIN { if (v == "nan") print "n/a"; else if ((op == "<=" && v <= t) || (op == ">=" && v >= t)) print "PASS"; else print "MISS" }'
}
pct() { awk -v a="$1" -v b="$2" 'BEGIN { if (b == 0 || a == "nan" || b == "nan") print "nan"; else printf "%+.1f", (a / b - 1) * 100 }'; }

# --- The volume and its service ----------------------------------------------------------------------
WORK=$(mktemp -d "$OUT/work.XXXXXX"); TMPDIRS+=("$WORK")
VOL=$WORK/vol.img SOCK=$WORK/s.sock
SERVICE_PID=""
start_service() {
    local line
    rm -f "$VOL" "$VOL.key"
    dd if=/dev/zero of="$VOL" bs=1M count=2048 oflag=direct status=none
    "$PLYFS" exodisk format "$VOL" >/dev/null
    line=$("$PLYFS" exodisk serve "$VOL" --socket "$SOCK" --daemon --log "$WORK/serve.log")
    SERVICE_PID=$(sed -n 's/.*(pid \([0-9]*\)).*/\1/p' <<<"$line")
    [[ -n $SERVICE_PID ]] || { echo "exodisk.sh: the service did not start: $line" >&2; exit 1; }
    PIDS+=("$SERVICE_PID")
}
start_service
log "volume: 2 GiB image on $(df --output=source "$WORK" | tail -1), service pid $SERVICE_PID"

bench() { # RUN GROUP [ARGS...]: record each line of `plyfs exodisk bench`
    local run=$1 line
    shift
    while IFS= read -r line; do
        IFS=, read -r g c m v <<<"$line"
        [[ $1 == small ]] && c="$c-$SMALL_SHAPE"
        record "$g" "$c" "$m" "$run" "$v"
    done < <(timeout 900 "$PLYFS" exodisk bench "$SOCK" "$@")
}

RESULTS=()
row() { RESULTS+=("$1"); }

group_small() {
    local r shape files size
    for shape in 1000x10000 10000x1000; do
        files=${shape%x*} size=${shape#*x}
        log "small: $files files of $size bytes, $RUNS runs"
        for ((r = 1; r <= RUNS; r++)); do SMALL_SHAPE=$shape bench "$r" small --files "$files" --size "$size"; done
    done
    for shape in 1000x10000 10000x1000; do
        local thesis="Extent 17.8 / 8.7 / 7.4; Exonode 19.1 / 4.7 / 1.4; raw 17.7 / 4.6 / 0 (exonode +7.7%)"
        [[ $shape == 10000x1000 ]] && thesis="Exonode 15.4 / 1.8 / 1.4; raw 14.0 / 1.6 (under 10%)"
        local vals="" cfg
        for cfg in raw extent exonode; do
            vals+="$cfg $(median small "$cfg-$shape" alloc_write_ms) / $(median small "$cfg-$shape" read_ms) / $(median small "$cfg-$shape" dealloc_ms); "
        done
        local over; over=$(pct "$(median small "exonode-$shape" alloc_write_ms)" "$(median small "raw-$shape" alloc_write_ms)")
        local over_r; over_r=$(pct "$(median small "exonode-$shape" read_ms)" "$(median small "raw-$shape" read_ms)")
        row "| ${shape%x*} x ${shape#*x} B files, ms per file: alloc+write / read / dealloc | $thesis | ${vals% } | exonode over raw: ${over}% alloc+write, ${over_r}% read | $(verdict "${over#+}" "<=" 5) / $(verdict "${over_r#+}" "<=" 5) (<= 5%) |"
    done
}

group_large() {
    local r m
    log "large: one 80 MB file, $RUNS runs"
    for ((r = 1; r <= RUNS; r++)); do SMALL_SHAPE="" bench "$r" large --size 80M; done
    local vals="" ratios="" verdicts=""
    for m in seq_write_mibs seq_read_mibs rand_write_mibs rand_read_mibs; do
        local raw exo x; raw=$(median large raw "$m"); exo=$(median large exofs "$m"); x=$(ratio "$exo" "$raw")
        vals+="${m%_mibs} $exo (raw $raw); " ratios+="${x}x " verdicts+="$(verdict "$x" ">=" 0.95) "
    done
    row "| one 80 MB file, MiB/s: seq W / seq R / rand W / rand R (4 KiB) | exonode 1.56 / 2.36 / 0.23 / 0.22 MB/s, equal to raw | ${vals% } | ${ratios% } | ${verdicts% } (>= 0.95x raw) |"
}

group_two() {
    local r m
    log "two: two clients, 1,000 x 10 KB each, $RUNS runs"
    for ((r = 1; r <= RUNS; r++)); do SMALL_SHAPE="" bench "$r" two --files 1000 --size 10000; done
    local vals="" gains=""
    for m in seq_write_ms seq_read_ms rand_write_ms rand_read_ms; do
        local p i; p=$(median two partitioned "$m"); i=$(median two interleaved "$m")
        vals+="${m%_ms} $i vs $p; " gains+="$(awk -v p="$p" -v i="$i" 'BEGIN { if (p == 0) print "nan"; else printf "%.1f", (1 - i / p) * 100 }')% "
    done
    row "| two clients, 1,000 x 10 KB each, ms per file, interleaved vs partitioned 250 MB apart: seq W / seq R / rand W / rand R | interleaved 7.3-27.4% better sequential, 40.6-45.0% random | ${vals% } | interleaved better by ${gains% } | see below |"
}

group_insert() {
    local r kb
    log "insert: 16 bytes in the middle, $RUNS runs"
    for ((r = 1; r <= RUNS; r++)); do SMALL_SHAPE="" bench "$r" insert; done
    local vals="" i10 c10
    for kb in 10 100 1000; do
        vals+="${kb} KB: $(median insert indexed "ms_${kb}kb") vs $(median insert copy "ms_${kb}kb"); "
    done
    i10=$(median insert indexed ms_10kb) c10=$(median insert copy ms_10kb)
    local flat; flat=$(ratio "$(median insert indexed ms_1000kb)" "$i10")
    row "| 16 B inserted in the middle, ms, indexed vs copy (durable) | indexed about 40 constant; copy 46 / 396 / 3727; indexed 40.7% worse at 10 KB | ${vals% } | indexed at 1000 KB / at 10 KB: ${flat}x; at 10 KB $(ratio "$i10" "$c10")x the copy | $(verdict "$flat" "<=" 1.5) constant / $(verdict "$(ratio "$i10" "$c10")" "<=" 1.0) at 10 KB |"
}

group_ddio() {
    local r
    log "ddio: random 4 KiB reads, N outstanding, $RUNS runs"
    for ((r = 1; r <= RUNS; r++)); do SMALL_SHAPE="" bench "$r" ddio; done
    local n1 n32 n128; n1=$(median ddio n1 requests_per_s); n32=$(median ddio n32 requests_per_s); n128=$(median ddio n128 requests_per_s)
    local g32 g128; g32=$(pct "$n32" "$n1"); g128=$(pct "$n128" "$n1")
    row "| disk-directed I/O, random 4 KiB reads per second, N = 1 / 32 / 128 outstanding | +24% at 32, +39% at 128 | $(printf '%.0f / %.0f / %.0f' "$n1" "$n32" "$n128") | ${g32}% at 32, ${g128}% at 128 | $(verdict "${g32#+}" ">=" 24) / $(verdict "${g128#+}" ">=" 39) |"
}

group_persist() {
    local r
    log "persist: 200 files of 4 KiB per model, $RUNS runs"
    for ((r = 1; r <= RUNS; r++)); do SMALL_SHAPE="" bench "$r" persist --files 200 --size 4096; done
    local kind
    for kind in exofs extent; do
        local mem meta dat x; mem=$(median persist "$kind-memory" ms_per_file); meta=$(median persist "$kind-metadata" ms_per_file)
        dat=$(median persist "$kind-data" ms_per_file); x=$(ratio "$dat" "$mem")
        local what="exofs files (user.exofs.persistence on their directory)"
        [[ $kind == extent ]] && what="self-protected extents of each model"
        row "| persistence models, ms per file alloc+write (4 KiB): memory / metadata / data, $what | 0.41 / 1.45 / 19.1 (memory 21x faster) | $mem / $meta / $dat | memory ${x}x faster than data | $(verdict "$x" ">=" 10) (>= 10x) |"
    done
}

group_fs() {
    local r cfg tree e4img loop e4 mnt
    tree=$WORK/tree.tar
    if [[ ! -f $tree ]]; then
        # 4,000 files of 1-8 KB in 40 directories, of text-like content.
        mkdir -p "$WORK/tree"
        python3 - "$WORK/tree" <<'PY'
import os, random, sys
random.seed(12)
words = open("/usr/share/dict/words").read().split() if os.path.exists("/usr/share/dict/words") else [f"w{i}" for i in range(5000)]
for d in range(40):
    os.makedirs(f"{sys.argv[1]}/d{d:02}", exist_ok=True)
    for f in range(100):
        n = random.randint(1024, 8192)
        text = " ".join(random.choice(words) for _ in range(n // 5))[:n]
        open(f"{sys.argv[1]}/d{d:02}/f{f:03}.txt", "w").write(text)
PY
        tar -C "$WORK/tree" -cf "$tree" .
        rm -rf "$WORK/tree"
    fi
    e4img=$WORK/ext4.img
    dd if=/dev/zero of="$e4img" bs=1M count=2048 oflag=direct status=none
    loop=$(losetup -f --show "$e4img"); LOOPS+=("$loop")
    mkfs.ext4 -q "$loop"
    e4=$WORK/ext4; mnt=$WORK/mnt
    mkdir -p "$e4" "$mnt"
    mount "$loop" "$e4"; MOUNTS+=("$e4")
    log "fs: untar, read and delete 4,000 small files through null, exofs against ext4 on $loop, $RUNS runs"
    for ((r = 1; r <= RUNS; r++)); do
        for cfg in ext4 ext4-fuse-io exofs; do
            local lower=$e4 opts=()
            [[ $cfg == exofs ]] && lower="exodisk:$SOCK"
            # ext4 also without passthrough: its data then crosses FUSE as exofs's must.
            [[ $cfg == ext4-fuse-io ]] && opts=(-o passthrough=off)
            "$PLYFS" mount "$lower" "$mnt" --stack null ${opts[@]+"${opts[@]}"} >/dev/null; MOUNTS+=("$mnt")
            mkdir "$mnt/t"
            run_timed 600 sh -c "tar -C '$mnt/t' -xf '$tree' && '$PLYFS' umount '$mnt' >/dev/null && sync"
            record fs "$cfg" create_s "$r" "$ELAPSED"
            drop_caches
            "$PLYFS" mount "$lower" "$mnt" --stack null ${opts[@]+"${opts[@]}"} >/dev/null
            run_timed 600 sh -c "tar -C '$mnt/t' -cf - . | cat >/dev/null"
            record fs "$cfg" read_s "$r" "$ELAPSED"
            run_timed 600 sh -c "rm -rf '$mnt/t' && '$PLYFS' umount '$mnt' >/dev/null && sync"
            record fs "$cfg" delete_s "$r" "$ELAPSED"
        done
    done
    local m vals="" ratios="" ratios_np="" verdicts=""
    for m in create_s read_s delete_s; do
        local x e n; e=$(median fs ext4 "$m"); n=$(median fs ext4-fuse-io "$m"); x=$(median fs exofs "$m")
        vals+="${m%_s} $x s (ext4 $e s, without passthrough $n s); " ratios+="$(ratio "$e" "$x")x " ratios_np+="$(ratio "$n" "$x")x "
        verdicts+="$(verdict "$(ratio "$e" "$x")" ">=" 1.0) "
    done
    row "| exofs under null against ext4 (loop device) under null: 4,000 files of 1-8 KB, create+unmount / read cold / delete+unmount | (not in the thesis) | ${vals% } | exofs speed-up over ext4: ${ratios% }; over ext4 without passthrough: ${ratios_np% } | ${verdicts% } (faster than ext4) |"
}

for g in "${GROUPS_RUN[@]}"; do
    log "group $g"
    "group_$g"
done

REPORT=$OUT/report.md
{
    echo "Measured $(date -u +%Y-%m-%d) on $(uname -r), plyfs $PLYFS_REV, medians of $RUNS runs, with \`$CMDLINE\`."
    echo "The volume is a 2 GiB image on the VM's disk, served by \`plyfs exodisk serve\` (direct I/O, io_uring)."
    echo
    echo "| benchmark | thesis (1996, a 1 GB SCSI disk) | plyfs | comparison | target |"
    echo "| --- | --- | --- | --- | --- |"
    printf '%s\n' "${RESULTS[@]}"
} >"$REPORT"
cat "$REPORT"
if ((WRITE_DOC)) && [[ -z $ONLY ]]; then
    write_doc_section exodisk 'Exodisk and exofs (`bench/exodisk.sh`)' "$REPORT"
fi
