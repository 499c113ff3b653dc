#!/usr/bin/env bash
# Dependency advisories (#28): every crate in Cargo.lock is checked against the RustSec advisory
# database with cargo-audit. Vulnerabilities, and unmaintained, unsound or yanked crates, fail.
#
#   scripts/audit.sh                        check (the live database when github.com answers, else the snapshot)
#   scripts/audit.sh --refresh-snapshot DB  copy the advisories for the crates in Cargo.lock from a clone of
#                                           github.com/rustsec/advisory-db into .ci/advisory-db
#
# The snapshot in .ci/advisory-db holds the advisories of the crates plyfs depends on, so that CI
# checks something real on a machine that reaches crates.io but not GitHub; .ci/advisory-db/SOURCE
# says which commit of the database it was taken from. Refresh it when Cargo.lock gains a crate.
set -euo pipefail
cd "$(dirname "$0")/.."

SNAPSHOT=.ci/advisory-db
AUDIT_VERSION=0.22.2

if [ "${1:-}" = --refresh-snapshot ]; then
  db=${2:?give the path of a clone of github.com/rustsec/advisory-db}
  rm -rf "$SNAPSHOT/crates"
  for name in $(sed -n 's/^name = "\(.*\)"$/\1/p' Cargo.lock | sort -u); do
    [ -d "$db/crates/$name" ] || continue
    mkdir -p "$SNAPSHOT/crates/$name"
    cp "$db/crates/$name"/*.md "$SNAPSHOT/crates/$name/"
  done
  echo "rustsec/advisory-db $(git -C "$db" log -1 --format='%H %cs' 2>/dev/null || echo 'commit unknown')" > "$SNAPSHOT/SOURCE"
  echo "$(find "$SNAPSHOT/crates" -name '*.md' | wc -l) advisories copied into $SNAPSHOT" >&2
  exit 0
fi

if ! cargo audit --version 2>/dev/null | grep -q "$AUDIT_VERSION"; then
  echo "installing cargo-audit $AUDIT_VERSION (cargo install)" >&2
  timeout 1200 cargo install --quiet --locked cargo-audit --version "$AUDIT_VERSION" >&2
fi

# Allowed advisories, each with its reason (none today). Add as: IGNORE+=(--ignore RUSTSEC-YYYY-NNNN)  # why
IGNORE=()

if timeout 10 git ls-remote https://github.com/rustsec/advisory-db HEAD >/dev/null 2>&1; then
  echo "advisories: the live RustSec database" >&2
  exec cargo audit --deny warnings "${IGNORE[@]}"
else
  echo "advisories: github.com is out of reach; the snapshot in $SNAPSHOT ($(cat "$SNAPSHOT/SOURCE"))" >&2
  exec cargo audit --no-fetch --db "$PWD/$SNAPSHOT" --deny warnings "${IGNORE[@]}"
fi
