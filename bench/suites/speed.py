"""Issues #14 and #33: metadata and transformed-data speed, against native, bindfs, gocryptfs,
fuse-overlayfs and kernel overlayfs, over both FUSE transports; a 2-branch mirror against one
branch; a remote stack over TLS against sshfs."""
import os

from plyfsbench import Metric, Scenario, Suite, Target, bindfs, custom, gocryptfs, native, per_layer, plyfs, sh
import workloads as w
from suites.fanout import mirror, mirror_io
from suites.transport import SSHFS, remote, stop_all

GiB = 1 << 30
OFF, ON = "io_uring=off", "io_uring=on"

TREE = [Metric("untar", "untar", "s"), Metric("ls_cold", "ls -lR cold", "s"),
        Metric("ls_warm", "ls -lR warm", "s"), Metric("rm", "rm -rf", "s")]


def overlay(name, mount):
    """An overlay with an empty read-only layer over the lower as its upper directory: the
    peers' pass-through case, where every name lives in the upper directory."""
    def start(m):
        up, lo, work = (os.path.join(m.lower, d) for d in ("up", "lo", "work"))
        for d in (up, lo, work):
            os.makedirs(d, exist_ok=True)
        sh(*mount(up, lo, work, m.mnt), timeout=60)
    return custom(name, f"`{' '.join(mount('UP', 'EMPTY', 'WORK', 'MNT'))}`", start)


OVERLAYFS = overlay("overlayfs", lambda up, lo, wd, mnt: ["mount", "-t", "overlay", "overlay", "-o",
                                                          f"lowerdir={lo},upperdir={up},workdir={wd}", mnt])
FUSE_OVERLAYFS = overlay("fuse-overlayfs", lambda up, lo, wd, mnt: ["fuse-overlayfs", "-o",
                                                                    f"lowerdir={lo},upperdir={up},workdir={wd}", mnt])


def size(ctx, full=GiB):
    return full // 4 if ctx["quick"] else full


def compressible(m, ctx):
    """A compressible file written through zstd, against `zstd -3` on the command line writing
    the same file into the bare lower (the source file in the page cache for both)."""
    src = w.text_file(ctx, size(ctx, 512 << 20))
    open(src, "rb").read()
    if m.cfg.name == "zstd-cli":
        secs = w.timed("zstd", "-3", "-q", "-f", src, "-o", f"{m.path}/text.zst")
    else:
        secs = w.timed("cp", src, f"{m.path}/text")
    return {"write_text": size(ctx, 512 << 20) / (1 << 20) / secs}


SUITE = Suite(
    name="speed",
    title="Speed: metadata and transformed data (issues #14 and #33)",
    intro="`bench/bench speed` measures the targets of issues #14 and #33: metadata through `null` and `crypt` over both "
          "FUSE transports (`/dev/fuse` and io_uring), writes of transformed data, zstd against its command line, the "
          "cost of extra layers, warm reads of encoded files, a 2-branch mirror against one branch and a remote stack "
          "over TLS against sshfs, with native, bindfs, gocryptfs, fuse-overlayfs and kernel overlayfs in the same run. "
          "The metadata workloads read their tarball from memory.",
    needs=("zstd", "fuse-overlayfs", "sshfs", "sshd:openssh-server"),
    main_chart="tree",
    scenarios=[
        Scenario("tree", "Source tree: untar, ls -lR, rm -rf (/usr/include, 8.9k entries)",
                 [native(), bindfs(), gocryptfs(), OVERLAYFS, FUSE_OVERLAYFS, plyfs("null", "null", OFF),
                  plyfs("null-uring", "null", ON),
                  plyfs("null8", ",".join(["null"] * 8), OFF), plyfs("crypt", "crypt", OFF),
                  plyfs("crypt-uring", "crypt", ON)],
                 TREE, run=w.tree, check=w.check_tree, lower="both"),
        Scenario("write", "Sequential write, 128 KiB blocks, fsync before close (1 GiB of random data)",
                 [native(), plyfs("null-nopt", "null", "passthrough=off", OFF),
                  plyfs("null-nopt-uring", "null", "passthrough=off", ON), plyfs("crypt", "crypt", OFF),
                  plyfs("crypt-uring", "crypt", ON), gocryptfs()],
                 [Metric("write", "write 128 KiB + fsync", "MiB/s", "higher")],
                 run=lambda m, ctx: w.write(m, ctx, "big", size(ctx), 128 << 10), lower="both"),
        Scenario("incompressible", "zstd,crypt on incompressible data: sequential write, 1 MiB blocks (1 GiB)",
                 [native(), gocryptfs(), plyfs("crypt", "crypt", OFF), plyfs("zstd-crypt", "zstd,crypt", OFF),
                  plyfs("zstd-crypt-uring", "zstd,crypt", ON)],
                 [Metric("write", "write 1 MiB blocks", "MiB/s", "higher")],
                 run=lambda m, ctx: w.write(m, ctx, "big", size(ctx), 1 << 20, fsync=False)),
        Scenario("compressible", "zstd on compressible text (512 MiB of C headers): plyfs against the zstd command line",
                 [native("zstd-cli", about="`zstd -3 SRC -o LOWER/text.zst` straight into the lower directory"),
                  plyfs("zstd", "zstd", OFF), plyfs("zstd-uring", "zstd", ON)],
                 [Metric("write_text", "cp of the file / zstd -3", "MiB/s", "higher")],
                 run=compressible, baseline="zstd-cli"),
        Scenario("reads", "Reads of encoded files (1 GiB of text): cold after a remount, then warm",
                 [native(), plyfs("zstd", "zstd", OFF), plyfs("crypt", "crypt", OFF)],
                 [Metric("read_cold", "cold read", "MiB/s", "higher"), Metric("read_warm", "warm read", "MiB/s", "higher"),
                  Metric("read_warm2", "warm read again", "MiB/s", "higher")],
                 run=lambda m, ctx: (w.write(m, ctx, "big", size(ctx), 1 << 20, data="text"),
                                     w.reads(m, ctx, "big", size(ctx)))[1]),
        Scenario("mirror", "Mirror: 2 branches on one disk against 1 (1 GiB, 128 KiB writes, fsync at the end)",
                 [mirror(1), mirror(2)],
                 [Metric("write", "write 128k + fsync", "MiB/s", "higher"), Metric("read_warm", "warm read", "MiB/s", "higher")],
                 run=mirror_io, baseline="mirror1", lower="ext4"),
        Scenario("remote", "Source tree over TLS on loopback (tmpfs export): a remote stack against sshfs",
                 [remote("tls", "tls"), SSHFS],
                 [Metric("untar", "untar", "s"), Metric("ls_cold", "ls -lR cold", "s"), Metric("ls_warm", "ls -lR warm", "s"),
                  Metric("rm", "rm -rf", "s")],
                 run=lambda m, ctx: w.tree(m, ctx, partial=m.cfg.name == "sshfs"), baseline="sshfs", lower="tmpfs"),
    ],
    targets=[
        *[Target(f"`null` {t} over /dev/fuse: ≤ 5× native (tmpfs; #33)", "tree", k, "null", "native", "<=", 5, on=("tmpfs",))
          for k, t in (("untar", "untar"), ("ls_cold", "ls -lR cold"), ("ls_warm", "ls -lR warm"), ("rm", "rm -rf"))],
        *[Target(f"`null` {t} over io_uring: ≤ 3× native (tmpfs; #33)", "tree", k, "null-uring", "native", "<=", 3, on=("tmpfs",))
          for k, t in (("untar", "untar"), ("ls_cold", "ls -lR cold"), ("ls_warm", "ls -lR warm"), ("rm", "rm -rf"))],
        *[Target(f"`null` {t}: faster than bindfs (ext4)", "tree", k, "null-uring", "bindfs", "<=", 1, on=("ext4",))
          for k, t in (("untar", "untar"), ("ls_cold", "ls -lR cold"), ("ls_warm", "ls -lR warm"), ("rm", "rm -rf"))],
        *[Target(f"`null` {t} over /dev/fuse: faster than bindfs (ext4)", "tree", k, "null", "bindfs", "<=", 1, on=("ext4",))
          for k, t in (("untar", "untar"), ("ls_cold", "ls -lR cold"), ("ls_warm", "ls -lR warm"), ("rm", "rm -rf"))],
        Target("`crypt` untar: ≤ 0.5× gocryptfs", "tree", "untar", "crypt-uring", "gocryptfs", "<=", 0.5, on=("tmpfs",)),
        Target("`crypt` ls -lR warm: ≤ 0.5× gocryptfs", "tree", "ls_warm", "crypt-uring", "gocryptfs", "<=", 0.5, on=("tmpfs",)),
        Target("`crypt` ls -lR cold: ≤ 0.5× gocryptfs", "tree", "ls_cold", "crypt-uring", "gocryptfs", "<=", 0.5, on=("tmpfs",)),
        Target("per extra `null` layer, worst metadata workload: ≤ 0.3%", "tree", "", "", "", "<=", 0.3,
               derive=per_layer("null", "null8", [("tree", [m.key for m in TREE], False)]), unit="%", on=("tmpfs",)),
        Target("128 KiB writes through `null -o passthrough=off`: ≥ 0.5× native", "write", "write", "null-nopt-uring",
               "native", ">=", 0.5),
        *[Target(f"`crypt` 1 GiB write with fsync{over}: ≥ 2× gocryptfs ({lower}; #33)", "write", "write", config,
                 "gocryptfs", ">=", 2, on=(lower,))
          for config, over in (("crypt-uring", ""), ("crypt", " over /dev/fuse")) for lower in ("tmpfs", "ext4")],
        Target("`zstd,crypt` write of incompressible data: ≥ 2× gocryptfs", "incompressible", "write", "zstd-crypt-uring",
               "gocryptfs", ">=", 2),
        *[Target(f"`zstd` write of compressible text{over}: ≥ `zstd -3` on the command line (#33)", "compressible",
                 "write_text", config, "zstd-cli", ">=", 1) for config, over in (("zstd-uring", ""), ("zstd", " over /dev/fuse"))],
        Target("warm reads of `zstd` files: ≥ 0.9× native", "reads", "read_warm", "zstd", "native", ">=", 0.9),
        Target("warm reads of `crypt` files: ≥ 0.9× native", "reads", "read_warm", "crypt", "native", ">=", 0.9),
        Target("mirror write, 2 branches: ≥ 0.8× one branch (#33)", "mirror", "write", "mirror2", "mirror1", ">=", 0.8),
        *[Target(f"TLS remote stack {t}: ≤ 0.5× sshfs (#33)", "remote", k, "tls", "sshfs", "<=", 0.5)
          for k, t in (("ls_cold", "ls -lR cold"), ("ls_warm", "ls -lR warm"))],
    ],
    cleanup=stop_all,
)
