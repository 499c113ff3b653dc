#!/usr/bin/env bash
# bench/transport.sh: the transport's benchmarks (issue #11) against sshfs over loopback (Debian's
# sshfs and openssh-server) and against a local plyfs `null` stack, side by side in one run;
# medians of several runs.
#
#   bench/transport.sh [--runs N] [--size SIZE] [--only GROUPS] [--no-write-doc]
#
# Groups:
#   crossing  the cost of one crossing: fstat of an open file with attr_timeout=0 (each one a
#             getattr that reaches the far side), through `remote` on a Unix socket and over
#             TLS, against the local null stack          target: <= 15 us and <= 30 us more
#   seq       sequential write (dd 1 MiB blocks, then fsync) and cold read of a SIZE file over TLS
#             on loopback, against sshfs and the local null stack
#                                                        target: >= 2x sshfs, >= 0.5x local
#   meta      untar and ls -lR of /usr/include over TLS, against sshfs (lowers on tmpfs)
#                                                        target: >= 2x faster than sshfs
#   python    the Python zlib codec (examples/python/zlib_codec.py) against the Rust gzip layer,
#             both at level 6, gzip with its default chunks (4 KiB) and with the Python codec's
#             (64 KiB): sequential write and cold read of SIZE of text
#                                                        target: within 2x of gzip
#
# Raw values go to bench-out/transport/results.csv; a full run rewrites the section between the
# transport markers in docs/benchmarks.md. Needs root. Environment: PLYFS_BIN, BENCH_OUT,
# PLYFS_PYTHON (the interpreter with the plyfs package; default python3).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CMDLINE="${PLYFS_BIN:+PLYFS_BIN=$PLYFS_BIN }bench/transport.sh${*:+ $*}"
ALL_GROUPS=(crossing seq meta python)
RUNS=5 SIZE=1g ONLY="" WRITE_DOC=1
while (($#)); do
    case $1 in
        --runs) RUNS=${2:?}; shift ;;
        --size) SIZE=${2:?}; shift ;;
        --only) ONLY=${2:?}; shift ;;
        --no-write-doc) WRITE_DOC=0 ;;
        -h | --help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "transport.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
    shift
done
[[ $RUNS =~ ^[1-9][0-9]*$ ]] || { echo "transport.sh: --runs must be a positive integer" >&2; exit 2; }
[[ $SIZE =~ ^[0-9]+[mMgG]$ ]] || { echo "transport.sh: --size must look like 256m or 1g" >&2; exit 2; }
GROUPS_RUN=("${ALL_GROUPS[@]}")
[[ -n $ONLY ]] && IFS=, read -r -a GROUPS_RUN <<<"$ONLY"
[[ $(id -u) -eq 0 ]] || { echo "transport.sh: run as root" >&2; exit 1; }
SIZE_MB=$(awk -v s="$SIZE" 'BEGIN { n = s + 0; if (s ~ /[gG]$/) n *= 1024; print n }')

exec 3>&2
. "$REPO/bench/common.sh"
install_missing sshfs /usr/sbin/sshd:openssh-server
set_out_dir transport.sh
OUT=$OUT/transport
mkdir -p "$OUT"
use_plyfs transport.sh "$OUT/bin" 1
CSV=$OUT/results.csv
echo "group,config,metric,run,value" >"$CSV"
PYTHON=${PLYFS_PYTHON:-python3}

# --- Cleanup: whatever this script started or mounted goes, whatever happens --------------------
MOUNTS=() PIDS=() TMPDIRS=()
cleanup() {
    local i
    [[ -n $CHILD ]] && kill "$CHILD" 2>/dev/null
    for ((i = ${#MOUNTS[@]} - 1; i >= 0; i--)); do
        is_mounted "${MOUNTS[$i]}" && { umount "${MOUNTS[$i]}" 2>/dev/null || umount -l "${MOUNTS[$i]}" 2>/dev/null || true; }
    done
    for i in ${PIDS[@]+"${PIDS[@]}"}; do kill "$i" 2>/dev/null || true; done
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

unmount() { # MNT
    local m=$1
    if [[ $(awk -v p="$m" '$5 == p { print $9 }' /proc/self/mountinfo) == fuse.plyfs ]]; then
        "$PLYFS" umount "$m" >/dev/null
    else
        umount "$m" 2>/dev/null || umount -l "$m"
    fi
}

wait_for() { # WHAT TEST...
    local what=$1 i
    shift
    for i in $(seq 200); do "$@" && return 0; sleep 0.05; done
    echo "transport.sh: $what did not come up" >&2
    exit 1
}

# A plyfs server over LOWER: "unix" or "tls"; sets ADDR (and PSK for tls).
start_server() { # KIND LOWER DIR
    local kind=$1 lower=$2 dir=$3
    if [[ $kind == unix ]]; then
        ADDR=unix:$dir/s.sock
        "$PLYFS" serve "$lower" --listen "$ADDR" --stack null 2>>"$OUT/server.log" &
        PIDS+=("$!")
        wait_for "plyfs serve" test -S "$dir/s.sock"
    else
        PSK=$dir/psk
        head -c 32 /dev/urandom >"$PSK"
        chmod 600 "$PSK"
        local port
        port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
        ADDR=tcp:127.0.0.1:$port
        "$PLYFS" serve "$lower" --listen "$ADDR" --psk "$PSK" --no-root-squash --stack null 2>>"$OUT/server.log" &
        PIDS+=("$!")
        wait_for "plyfs serve (TLS)" bash -c "exec 9<>/dev/tcp/127.0.0.1/$port" 2>/dev/null
    fi
    SERVER_PID=${PIDS[-1]}
}

stop_server() {
    kill "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
}

# sshd on a port of its own with keys of its own, for sshfs to root@127.0.0.1.
SSH_DIR=""
start_sshd() {
    [[ -n $SSH_DIR ]] && return
    SSH_DIR=$(mktemp -d /tmp/plyfs-bench-ssh.XXXXXX); TMPDIRS+=("$SSH_DIR")
    ssh-keygen -q -t ed25519 -N "" -f "$SSH_DIR/host_key"
    ssh-keygen -q -t ed25519 -N "" -f "$SSH_DIR/id"
    mkdir -p /run/sshd
    SSH_PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    cat >"$SSH_DIR/sshd_config" <<EOF
Port $SSH_PORT
ListenAddress 127.0.0.1
HostKey $SSH_DIR/host_key
PidFile $SSH_DIR/sshd.pid
AuthorizedKeysFile $SSH_DIR/id.pub
PermitRootLogin prohibit-password
PasswordAuthentication no
StrictModes no
UsePAM no
Subsystem sftp internal-sftp
EOF
    /usr/sbin/sshd -f "$SSH_DIR/sshd_config"
    wait_for sshd test -s "$SSH_DIR/sshd.pid"
    PIDS+=("$(cat "$SSH_DIR/sshd.pid")")
}

mount_sshfs() { # DIR MNT
    start_sshd
    sshfs -p "$SSH_PORT" -o IdentityFile="$SSH_DIR/id",StrictHostKeyChecking=no,UserKnownHostsFile=/dev/null,allow_other \
        "root@127.0.0.1:$1" "$2"
    MOUNTS+=("$2")
}

mount_plyfs() { # LOWER MNT STACK [OPTS]
    "$PLYFS" mount "$1" "$2" --stack "$3" ${PSK:+--psk "$PSK"} ${4:+-o "$4"} >/dev/null
    MOUNTS+=("$2")
}

# --- crossing --------------------------------------------------------------------------------------
group_crossing() {
    local tmp r cfg n=50000
    tmp=$(mktemp -d /dev/shm/plyfs-transport.XXXXXX); TMPDIRS+=("$tmp")
    mkdir -p "$tmp/lower" "$tmp/mnt"
    echo x >"$tmp/lower/f"
    log "crossing: $n fstat calls per run, $RUNS runs"
    for ((r = 1; r <= RUNS; r++)); do
        for cfg in local unix tls; do
            PSK=""
            case $cfg in
                local) mount_plyfs "$tmp/lower" "$tmp/mnt" null attr_timeout=0,entry_timeout=0 ;;
                *) start_server "$cfg" "$tmp/lower" "$tmp"; mount_plyfs "$ADDR" "$tmp/mnt" remote attr_timeout=0,entry_timeout=0 ;;
            esac
            local us
            us=$(python3 - "$tmp/mnt/f" "$n" <<'PY'
import os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
n = int(sys.argv[2])
for _ in range(1000):
    os.fstat(fd)
t = time.perf_counter()
for _ in range(n):
    os.fstat(fd)
print(f"{(time.perf_counter() - t) / n * 1e6:.2f}")
PY
)
            record crossing "$cfg" us_per_getattr "$r" "$us"
            unmount "$tmp/mnt"
            [[ $cfg == local ]] || stop_server
        done
    done
    local l u t
    l=$(median crossing local us_per_getattr); u=$(median crossing unix us_per_getattr); t=$(median crossing tls us_per_getattr)
    local du dt
    du=$(awk -v a="$u" -v b="$l" 'BEGIN { printf "%.1f", a - b }'); dt=$(awk -v a="$t" -v b="$l" 'BEGIN { printf "%.1f", a - b }')
    RESULTS+=("| one crossing (getattr), Unix socket | local null $l us | remote $u us | +$du us | $(verdict "$du" "<=" 15) (<= +15 us) |")
    RESULTS+=("| one crossing (getattr), TLS on loopback | local null $l us | remote $t us | +$dt us | $(verdict "$dt" "<=" 30) (<= +30 us) |")
}

# --- seq -------------------------------------------------------------------------------------------
group_seq() {
    local tmp r cfg
    tmp=$(mktemp -d "$OUT/seq.XXXXXX"); TMPDIRS+=("$tmp")
    mkdir -p "$tmp/lower" "$tmp/mnt"
    log "seq: $SIZE write and cold read, $RUNS runs, configurations local tls sshfs"
    for ((r = 1; r <= RUNS; r++)); do
        for cfg in local tls sshfs; do
            PSK=""
            rm -f "$tmp/lower/f"
            case $cfg in
                local) mount_plyfs "$tmp/lower" "$tmp/mnt" null ;;
                tls) start_server tls "$tmp/lower" "$tmp"; mount_plyfs "$ADDR" "$tmp/mnt" remote ;;
                sshfs) mount_sshfs "$tmp/lower" "$tmp/mnt" ;;
            esac
            run_timed 900 dd if=/dev/zero of="$tmp/mnt/f" bs=1M count="$SIZE_MB" conv=fsync status=none
            record seq "$cfg" write_mibs "$r" "$(awk -v s="$SIZE_MB" -v t="$ELAPSED" 'BEGIN { printf "%.1f", s / t }')"
            drop_caches
            run_timed 900 dd if="$tmp/mnt/f" of=/dev/null bs=1M status=none
            record seq "$cfg" read_mibs "$r" "$(awk -v s="$SIZE_MB" -v t="$ELAPSED" 'BEGIN { printf "%.1f", s / t }')"
            unmount "$tmp/mnt"
            [[ $cfg == tls ]] && stop_server
        done
    done
    local m
    for m in write_mibs read_mibs; do
        local l t s; l=$(median seq local "$m"); t=$(median seq tls "$m"); s=$(median seq sshfs "$m")
        local xs xl; xs=$(ratio "$t" "$s"); xl=$(ratio "$t" "$l")
        local what=write; [[ $m == read_mibs ]] && what="cold read"
        RESULTS+=("| sequential $what, $SIZE, TLS on loopback | sshfs $s MiB/s; local null $l MiB/s | $t MiB/s | ${xs}x sshfs, ${xl}x local | $(verdict "$xs" ">=" 2) / $(verdict "$xl" ">=" 0.5) |")
    done
}

# --- meta ------------------------------------------------------------------------------------------
group_meta() {
    local tmp r cfg tarball entries
    tmp=$(mktemp -d /dev/shm/plyfs-transport.XXXXXX); TMPDIRS+=("$tmp")
    tarball=$tmp/include.tar
    tar -C /usr -cf "$tarball" include
    entries=$(tar -tf "$tarball" | wc -l)
    log "meta: $entries entries, $RUNS runs, configurations tls sshfs"
    for ((r = 1; r <= RUNS; r++)); do
        for cfg in tls sshfs; do
            PSK=""
            rm -rf "$tmp/lower" && mkdir -p "$tmp/lower" "$tmp/mnt"
            case $cfg in
                tls) start_server tls "$tmp/lower" "$tmp"; mount_plyfs "$ADDR" "$tmp/mnt" remote ;;
                sshfs) mount_sshfs "$tmp/lower" "$tmp/mnt" ;;
            esac
            # sshfs cannot set the times of a symlink whose target is not there yet, which tar
            # reports (and exits 2 for); the tree is there all the same.
            run_timed 900 tar -C "$tmp/mnt" -xf "$tarball" 2>>"$OUT/tar-$cfg.log" || [[ $cfg == sshfs ]]
            record meta "$cfg" untar "$r" "$ELAPSED"
            unmount "$tmp/mnt"
            # ls -lR with cold client caches.
            case $cfg in
                tls) mount_plyfs "$ADDR" "$tmp/mnt" remote ;;
                sshfs) mount_sshfs "$tmp/lower" "$tmp/mnt" ;;
            esac
            # sshfs fails to read some of the symlinks (EPERM): counted all the same.
            run_timed 900 sh -c "ls -lR '$tmp/mnt' >/dev/null 2>>'$OUT/ls-$cfg.log'" || [[ $cfg == sshfs ]]
            record meta "$cfg" ls_lR "$r" "$ELAPSED"
            unmount "$tmp/mnt"
            [[ $cfg == tls ]] && stop_server
        done
    done
    local w
    for w in untar ls_lR; do
        local t s x; t=$(median meta tls "$w"); s=$(median meta sshfs "$w"); x=$(ratio "$s" "$t")
        RESULTS+=("| $w of /usr/include ($entries entries), TLS on loopback | sshfs $s s | $t s | ${x}x faster than sshfs | $(verdict "$x" ">=" 2) |")
    done
}

# --- python ----------------------------------------------------------------------------------------
group_python() {
    local tmp r cfg src stack
    tmp=$(mktemp -d "$OUT/python.XXXXXX"); TMPDIRS+=("$tmp")
    mkdir -p "$tmp/lower" "$tmp/mnt"
    src=$tmp/text
    # Text that compresses about as source code does: /usr/include, repeated to SIZE.
    tar -C /usr -cf - include 2>/dev/null | head -c $((SIZE_MB << 20)) >"$src" || true
    while (($(stat -c %s "$src") < (SIZE_MB << 20))); do { cat "$src" "$src" | head -c $((SIZE_MB << 20)) >"$src.2"; } || true; mv "$src.2" "$src"; done
    log "python: $SIZE of text, $RUNS runs, Python zlib against Rust gzip, level 6"
    for ((r = 1; r <= RUNS; r++)); do
        for cfg in gzip gzip64 pyzlib; do
            PSK=""
            rm -rf "$tmp/lower" && mkdir -p "$tmp/lower"
            case $cfg in
                gzip) stack="gzip:level=6" ;;
                gzip64) stack="gzip:level=6:chunk=64k" ;;
                pyzlib) stack="py:script=$REPO/examples/python/zlib_codec.py:level=6:python=$PYTHON" ;;
            esac
            mount_plyfs "$tmp/lower" "$tmp/mnt" "$stack"
            drop_caches
            run_timed 900 dd if="$src" of="$tmp/mnt/f" bs=1M conv=fsync status=none
            record python "$cfg" write_mibs "$r" "$(awk -v s="$SIZE_MB" -v t="$ELAPSED" 'BEGIN { printf "%.1f", s / t }')"
            drop_caches
            run_timed 900 dd if="$tmp/mnt/f" of=/dev/null bs=1M status=none
            record python "$cfg" read_mibs "$r" "$(awk -v s="$SIZE_MB" -v t="$ELAPSED" 'BEGIN { printf "%.1f", s / t }')"
            cmp -s "$src" "$tmp/mnt/f" || { echo "transport.sh: $cfg read back something else" >&2; exit 1; }
            unmount "$tmp/mnt"
        done
    done
    local m
    for m in write_mibs read_mibs; do
        local g g64 p x x64; g=$(median python gzip "$m"); g64=$(median python gzip64 "$m"); p=$(median python pyzlib "$m")
        x=$(ratio "$p" "$g"); x64=$(ratio "$p" "$g64")
        local what=write; [[ $m == read_mibs ]] && what="cold read"
        RESULTS+=("| Python zlib codec (64 KiB chunks, its default), sequential $what of $SIZE of text | Rust gzip $g MiB/s (4 KiB chunks, its default); $g64 MiB/s (64 KiB chunks) | $p MiB/s | ${x}x gzip; ${x64}x gzip at 64 KiB | $(verdict "$x" ">=" 0.5) / $(verdict "$x64" ">=" 0.5) (within 2x) |")
    done
}

RESULTS=()
for g in "${GROUPS_RUN[@]}"; do
    [[ " ${ALL_GROUPS[*]} " == *" $g "* ]] || { echo "transport.sh: unknown group '$g' (${ALL_GROUPS[*]})" >&2; exit 2; }
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
    write_doc_section transport 'Transport: remote stacks and Python layers (`bench/transport.sh`)' "$REPORT"
fi
