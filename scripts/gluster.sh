#!/usr/bin/env bash
# scripts/gluster.sh: a single-node GlusterFS volume (replica 2, two bricks) for plyfs's shared-lower
# tests and benchmarks (issue #13), from Debian's glusterfs-server and glusterfs-client.
#
#   scripts/gluster.sh up [MOUNTPOINT...]   start glusterd (if this script has not), make and start
#                                           the volume, mount it with one GlusterFS client per mount
#                                           point (default: /var/tmp/plyfs-gluster/mnt and .../mnt2,
#                                           two clients as on two machines), print the mount points
#   scripts/gluster.sh down                 unmount, stop and delete the volume, stop the glusterd
#                                           this script started, remove the bricks
#   scripts/gluster.sh status               say whether it is up, and where
#
# The volume is set up for mounts that share files across clients (plyfs -o shared): clients keep
# no copies of file contents or attributes past a lock (performance.quick-read and stat-prefetch
# off), and hand a file over to another client at once (cluster.post-op-delay-secs 0).
#
# State lives in PLYFS_GLUSTER_DIR (default /var/tmp/plyfs-gluster): the bricks, the mount points
# and the pid of the glusterd it started. A glusterd already running (started by systemd, say) is
# used and left running. Needs root.
set -euo pipefail

DIR=${PLYFS_GLUSTER_DIR:-/var/tmp/plyfs-gluster}
VOL=${PLYFS_GLUSTER_VOLUME:-plyfs}
say() { echo "gluster.sh: $*" >&2; }
die() { say "$*"; exit 1; }

[[ $(id -u) -eq 0 ]] || die "run as root"

install_missing() {
    command -v glusterd >/dev/null && command -v mount.glusterfs >/dev/null && return
    say "installing glusterfs-server and glusterfs-client"
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q glusterfs-server glusterfs-client >/dev/null
}

# The address bricks are named by: the first non-loopback address (glusterd refuses localhost).
host() { hostname -I 2>/dev/null | awk '{ print $1 }' | grep . || hostname; }

is_mounted() { awk -v p="$1" '$5 == p { found = 1 } END { exit !found }' /proc/self/mountinfo; }

glusterd_running() { pgrep -x glusterd >/dev/null; }

start_glusterd() {
    glusterd_running && return
    glusterd --pid-file="$DIR/glusterd.pid" || die "glusterd did not start"
    local i
    for i in $(seq 100); do gluster --mode=script pool list >/dev/null 2>&1 && return; sleep 0.1; done
    die "glusterd did not answer in 10 s"
}

up() {
    local h mnt
    [[ $# -gt 0 ]] || set -- "$DIR/mnt" "$DIR/mnt2"
    install_missing
    mkdir -p "$DIR/brick1" "$DIR/brick2"
    start_glusterd
    h=$(host)
    if ! gluster --mode=script volume info "$VOL" >/dev/null 2>&1; then
        gluster --mode=script volume create "$VOL" replica 2 "$h:$DIR/brick1" "$h:$DIR/brick2" force >/dev/null ||
            die "could not create volume $VOL on $h"
    fi
    local opt
    for opt in performance.quick-read=off performance.stat-prefetch=off cluster.post-op-delay-secs=0; do
        gluster --mode=script volume set "$VOL" "${opt%%=*}" "${opt#*=}" >/dev/null || die "could not set $opt on $VOL"
    done
    if ! gluster --mode=script volume info "$VOL" | grep -q '^Status: Started'; then
        gluster --mode=script volume start "$VOL" >/dev/null || die "could not start volume $VOL"
    fi
    : >"$DIR/mountpoint"
    for mnt in "$@"; do
        mkdir -p "$mnt"
        if ! is_mounted "$mnt"; then
            local i
            for i in $(seq 50); do
                mount -t glusterfs "$h:/$VOL" "$mnt" 2>/dev/null && break
                sleep 0.2
            done
            is_mounted "$mnt" || die "could not mount $h:/$VOL on $mnt"
        fi
        echo "$mnt" >>"$DIR/mountpoint"
        echo "$mnt"
    done
}

down() {
    local mnt
    for mnt in $(cat "$DIR/mountpoint" 2>/dev/null || echo "$DIR/mnt $DIR/mnt2"); do
        if is_mounted "$mnt"; then umount "$mnt" 2>/dev/null || umount -l "$mnt"; fi
    done
    if glusterd_running && gluster --mode=script volume info "$VOL" >/dev/null 2>&1; then
        gluster --mode=script volume stop "$VOL" force >/dev/null 2>&1 || true
        gluster --mode=script volume delete "$VOL" >/dev/null 2>&1 || true
    fi
    if [[ -f $DIR/glusterd.pid ]]; then
        local pid
        pid=$(cat "$DIR/glusterd.pid")
        # Only the glusterd this script started, and the brick and client processes of its volume.
        pkill -f "glusterfsd.*$DIR/brick" 2>/dev/null || true
        pkill -f "glusterfs.*--volfile-id.*$VOL" 2>/dev/null || true
        kill "$pid" 2>/dev/null || true
        local i
        for i in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        rm -f "$DIR/glusterd.pid"
    fi
    rm -rf "$DIR/brick1" "$DIR/brick2" "$DIR/mountpoint"
    # The bricks' extended attributes mark them as used; new directories next time.
}

status() {
    local mnt up=()
    for mnt in $(cat "$DIR/mountpoint" 2>/dev/null); do
        is_mounted "$mnt" && up+=("$mnt")
    done
    if [[ ${#up[@]} -gt 0 ]]; then echo "up: $VOL mounted on ${up[*]}"; else echo "down"; return 1; fi
}

case ${1:-} in
    up) shift; up "$@" ;;
    down) down ;;
    status) status ;;
    *) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
