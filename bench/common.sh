# Helpers shared by bench/run.sh and bench/sca.sh (sourced; both log on descriptor 3).

log() { printf '[%(%H:%M:%S)T] %s\n' -1 "$*" >&3; }

is_mounted() { awk -v p="$1" '$5 == p { found = 1 } END { exit !found }' /proc/self/mountinfo; }

# run_timed SECS CMD...: run CMD under timeout, in the background so that signals to this
# script are handled at once; sets ELAPSED (seconds) and returns CMD's status. The caller's
# cleanup trap kills $CHILD if it is still running.
ELAPSED=0
CHILD=""
run_timed() {
    local secs=$1 rc=0 t0 t1
    shift
    t0=$EPOCHREALTIME
    timeout --kill-after=10 "$secs" "$@" &
    CHILD=$!
    wait "$CHILD" || rc=$?
    CHILD=""
    t1=$EPOCHREALTIME
    ELAPSED=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.4f", b - a }')
    return "$rc"
}

drop_caches() {
    sync
    echo 3 >/proc/sys/vm/drop_caches
}

# install_missing CMD[:PACKAGE]...: install (with apt) the packages of the commands not found.
install_missing() {
    local need=() t
    for t; do command -v "${t%%:*}" >/dev/null || need+=("${t#*:}"); done
    if ((${#need[@]})); then
        log "installing ${need[*]}"
        apt-get update -q
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}"
    fi
}

# set_out_dir SCRIPT: OUT = $BENCH_OUT or REPO/bench-out, made and made absolute; refused on tmpfs,
# where page-cache and disk behaviour are not what is being measured.
set_out_dir() {
    OUT=${BENCH_OUT:-$REPO/bench-out}
    mkdir -p "$OUT"
    OUT=$(cd "$OUT" && pwd)
    if [[ $(stat -f -c %T "$OUT") == tmpfs ]]; then
        echo "$1: $OUT is on tmpfs; set BENCH_OUT to a directory on a real disk" >&2
        exit 1
    fi
}

# use_plyfs SCRIPT BINDIR BUILD: set PLYFS and PLYFS_REV. With PLYFS_BIN, that binary; else
# (when BUILD is 1) `cargo build --release`, and a copy in BINDIR is the program under test, so
# that a rebuild during the benchmark does not change it.
use_plyfs() {
    if [[ -n ${PLYFS_BIN:-} ]]; then
        PLYFS=$PLYFS_BIN
        [[ -x $PLYFS ]] || { echo "$1: PLYFS_BIN=$PLYFS is not executable" >&2; exit 1; }
        PLYFS_REV=${PLYFS_REV:-"PLYFS_BIN=$PLYFS"}
        return
    fi
    if (($3)); then
        log "building plyfs (cargo build --release)"
        (cd "$REPO" && cargo build --release --quiet)
    fi
    mkdir -p "$2"
    if [[ -x $REPO/target/release/plyfs ]]; then
        cp -f "$REPO/target/release/plyfs" "$2/plyfs"
    fi
    PLYFS=$2/plyfs
    PLYFS_REV=$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)
    if [[ -n $(git -C "$REPO" status --porcelain -- crates Cargo.toml Cargo.lock 2>/dev/null) ]]; then
        PLYFS_REV="$PLYFS_REV + uncommitted changes under crates/"
    fi
}

# write_doc_section MARKER TITLE REPORT: put REPORT between the MARKER begin/end comments of
# docs/benchmarks.md, or append it under a new TITLE heading if they are not there yet.
write_doc_section() {
    python3 - "$REPO/docs/benchmarks.md" "$1" "$2" "$3" <<'PY'
import sys
doc, marker, title, report = sys.argv[1], sys.argv[2], sys.argv[3], open(sys.argv[4]).read()
text = open(doc).read()
begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
section = f"{begin}\n{report}{end}"
if begin in text:
    text = text[:text.index(begin)] + section + text[text.index(end) + len(end):]
else:
    text += f"\n## {title}\n\n{section}\n"
open(doc, "w").write(text)
PY
    log "docs/benchmarks.md updated"
}
