#!/usr/bin/env bash
# Build the Debian package of plyfs with cargo-deb: target/debian/plyfs_VERSION_ARCH.deb, with the
# binary, the mount(8) helper /usr/sbin/mount.fuse.plyfs, the manual pages and the bash, zsh and
# fish completions (made by the binary just built), and the binary's debug information apart in
# target/debian/plyfs.debug. Installs cargo-deb if it is missing.
#
#   scripts/deb.sh            # then: apt-get install ./target/debian/plyfs_*.deb
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
if ! command -v cargo-deb >/dev/null; then
  echo "plyfs: installing cargo-deb" >&2
  timeout 1200 cargo install cargo-deb --locked --quiet >&2
fi
# The commit goes into `plyfs --version` (the build script asks git; a tarball has none).
cargo build --release -p plyfs >&2
assets=target/release/deb-assets
rm -rf "$assets"
mkdir -p "$assets/man" "$assets/completions"
# The package's binary without its debug information (98 MB with it, as the release profile keeps
# it for backtraces in the build tree); the information goes beside the package, as
# target/debian/plyfs.debug, for a debugger to load (the binary names it in .gnu_debuglink).
mkdir -p target/debian
objcopy --only-keep-debug --compress-debug-sections=zlib target/release/plyfs target/debian/plyfs.debug
objcopy --strip-debug --strip-unneeded --add-gnu-debuglink=target/debian/plyfs.debug target/release/plyfs "$assets/plyfs"
target/release/plyfs manpages "$assets/man"
gzip -9n "$assets"/man/*.1
target/release/plyfs completions bash > "$assets/completions/plyfs"
target/release/plyfs completions zsh > "$assets/completions/_plyfs"
target/release/plyfs completions fish > "$assets/completions/plyfs.fish"
# The same helper `plyfs install-helper` installs for a plyfs from `cargo install`.
target/release/plyfs install-helper --dir "$assets" --exec /usr/bin/plyfs --for-package
cargo deb -p plyfs --no-build >&2
ls target/debian/plyfs_*.deb
