"""Issue #14: metadata and transformed-data speed, against native, bindfs and gocryptfs, over
both FUSE transports."""
from plyfsbench import Metric, Scenario, Suite, Target, bindfs, gocryptfs, native, per_layer, plyfs
import workloads as w

GiB = 1 << 30
OFF, ON = "io_uring=off", "io_uring=on"

TREE = [Metric("untar", "untar", "s"), Metric("ls_cold", "ls -lR cold", "s"),
        Metric("ls_warm", "ls -lR warm", "s"), Metric("rm", "rm -rf", "s")]


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
    title="Speed: metadata and transformed data (issue #14)",
    intro="`bench/bench speed` measures the targets of issue #14: metadata through `null` and `crypt` over both FUSE "
          "transports (`/dev/fuse` and io_uring), writes of transformed data, zstd against its command line, the cost "
          "of extra layers and warm reads of encoded files, with native, bindfs and gocryptfs in the same run.",
    needs=("zstd",),
    main_chart="tree",
    scenarios=[
        Scenario("tree", "Source tree: untar, ls -lR, rm -rf (/usr/include, 8.9k entries)",
                 [native(), bindfs(), gocryptfs(), plyfs("null", "null", OFF), plyfs("null-uring", "null", ON),
                  plyfs("null8", ",".join(["null"] * 8), OFF), plyfs("crypt", "crypt", OFF),
                  plyfs("crypt-uring", "crypt", ON)],
                 TREE, run=w.tree, check=w.check_tree, lower="both"),
        Scenario("write", "Sequential write, 128 KiB blocks, fsync before close (1 GiB of random data)",
                 [native(), plyfs("null-nopt", "null", "passthrough=off", OFF),
                  plyfs("null-nopt-uring", "null", "passthrough=off", ON), plyfs("crypt", "crypt", OFF),
                  plyfs("crypt-uring", "crypt", ON), gocryptfs()],
                 [Metric("write", "write 128 KiB + fsync", "MiB/s", "higher")],
                 run=lambda m, ctx: w.write(m, ctx, "big", size(ctx), 128 << 10)),
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
    ],
    targets=[
        *[Target(f"`null` {t}: ≤ 5× native (tmpfs)", "tree", k, "null-uring", "native", "<=", 5, on=("tmpfs",))
          for k, t in (("untar", "untar"), ("ls_cold", "ls -lR cold"), ("ls_warm", "ls -lR warm"), ("rm", "rm -rf"))],
        *[Target(f"`null` {t} over /dev/fuse: ≤ 5× native (tmpfs)", "tree", k, "null", "native", "<=", 5, on=("tmpfs",))
          for k, t in (("untar", "untar"), ("ls_cold", "ls -lR cold"), ("rm", "rm -rf"))],
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
        Target("`crypt` 1 GiB write with fsync: ≥ 2× gocryptfs", "write", "write", "crypt-uring", "gocryptfs", ">=", 2),
        Target("`crypt` 1 GiB write with fsync over /dev/fuse: ≥ 2× gocryptfs", "write", "write", "crypt", "gocryptfs",
               ">=", 2),
        Target("`zstd,crypt` write of incompressible data: ≥ 2× gocryptfs", "incompressible", "write", "zstd-crypt-uring",
               "gocryptfs", ">=", 2),
        Target("`zstd` write of compressible text: ≥ `zstd -3` on the command line", "compressible", "write_text",
               "zstd-uring", "zstd-cli", ">=", 1),
        Target("warm reads of `zstd` files: ≥ 0.9× native", "reads", "read_warm", "zstd", "native", ">=", 0.9),
        Target("warm reads of `crypt` files: ≥ 0.9× native", "reads", "read_warm", "crypt", "native", ">=", 0.9),
    ],
)
