#!/usr/bin/env bash
# Check an installed plyfs package: the binary names its commit, the manual pages and the
# completions are where man(1) and the shells look, and the mount(8) helper is there.
set -euo pipefail
cd "$(dirname "$0")/.."
fail() { echo "check-deb: $*" >&2; exit 1; }
[ -x /usr/bin/plyfs ] || fail "/usr/bin/plyfs is missing"
version=$(/usr/bin/plyfs --version)
if head=$(git rev-parse --short=12 HEAD 2>/dev/null); then
  case $version in *"$head"*) ;; *) fail "plyfs --version says '$version', not commit $head" ;; esac
fi
# Stripped: its debug information stays beside the package (target/debian/plyfs.debug).
if readelf -S /usr/bin/plyfs | grep -q '\.debug_info'; then fail "/usr/bin/plyfs carries its debug information"; fi
size=$(stat -c %s /usr/bin/plyfs)
[ "$size" -lt 40000000 ] || fail "/usr/bin/plyfs is $size bytes"
[ -x /usr/sbin/mount.fuse.plyfs ] || fail "the mount helper /usr/sbin/mount.fuse.plyfs is missing"
man -w plyfs >/dev/null || fail "man cannot find plyfs(1)"
MANPAGER=cat man plyfs 2>/dev/null | grep -q "fuse.plyfs" || fail "plyfs(1) does not tell of mount -t fuse.plyfs"
MANPAGER=cat man plyfs-mount 2>/dev/null | grep -q -- "--stack" || fail "plyfs-mount(1) does not list --stack"
bash -c '. /usr/share/bash-completion/completions/plyfs && complete -p plyfs' | grep -q "_plyfs" \
  || fail "the bash completion does not complete plyfs"
[ -s /usr/share/zsh/vendor-completions/_plyfs ] || fail "the zsh completion is missing"
[ -s /usr/share/fish/vendor_completions.d/plyfs.fish ] || fail "the fish completion is missing"
echo "check-deb: $version installed with its manual pages, completions and mount helper" >&2
