#!/usr/bin/env bash
# Install what plyfs needs on Debian/Ubuntu, if missing: FUSE 3, the attr and acl tools, and a
# Rust toolchain. Sourced by demo.sh and test.sh; extra Debian packages may be passed as args.
set -euo pipefail

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    echo "plyfs: need root (or sudo) to run: $*" >&2; return 1; fi
}

need_pkgs=()
command -v fusermount3 >/dev/null || need_pkgs+=(fuse3)
command -v setfattr >/dev/null || need_pkgs+=(attr)
command -v setfacl >/dev/null || need_pkgs+=(acl)
# The reflink test makes an XFS file system on a loop device.
command -v mkfs.xfs >/dev/null || need_pkgs+=(xfsprogs)
command -v cc >/dev/null || need_pkgs+=(build-essential)
command -v curl >/dev/null || need_pkgs+=(curl ca-certificates)
# The Python package builds in a virtual environment.
command -v python3 >/dev/null || need_pkgs+=(python3)
python3 -c 'import venv, ensurepip' 2>/dev/null || need_pkgs+=(python3-venv)
for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || need_pkgs+=("$p"); done
if [ "${#need_pkgs[@]}" -gt 0 ]; then
  echo "plyfs: installing ${need_pkgs[*]}" >&2
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_pkgs[@]}" >/dev/null
fi

# plyfs needs Rust 1.85 or later; Debian's own rustc is older, so use rustup's.
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
if ! command -v cargo >/dev/null; then
  echo "plyfs: installing Rust with rustup" >&2
  curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal >&2
  . "$HOME/.cargo/env"
fi
