"""The crypt layer (issue #5) against gocryptfs and the plain directory: large files, a source
tree, and zstd,crypt on compressible text. Took over from bench/crypt.sh."""
import os
import subprocess

from plyfsbench import BenchError, Metric, Scenario, Suite, Target, gocryptfs, native, plyfs
import workloads as w

GiB = 1 << 30
CONFIGS = [native(), gocryptfs(), plyfs("crypt", "crypt"), plyfs("zstd-crypt", "zstd,crypt"),
           plyfs("null", "null", about="`plyfs mount LOWER MNT --stack null` (no encryption; for reference)")]


def size(ctx, full):
    return full // 4 if ctx["quick"] else full


def io(m, ctx):
    """1 GiB of random data written in 1 MiB blocks, without and with an fsync before the close;
    a cold read after a remount, two warm reads; then warm 4 KiB random reads of a 256 MiB file."""
    n = size(ctx, GiB)
    r = w.write(m, ctx, "big", n, 1 << 20, fsync=False, key="write")
    r |= w.write(m, ctx, "big", n, 1 << 20, fsync=True, key="write_fsync")
    r |= w.reads(m, ctx, "big", n)
    os.unlink(os.path.join(m.path, "big"))
    small = os.path.join(m.path, "small")
    w.write(m, ctx, "small", 256 << 20, 1 << 20)
    w.fio(small, "read", "1M", "256m")
    r["randread_warm"] = w.fio(small, "randread", "4k", "256m", 5 if ctx["quick"] else 10)
    return r


def tree(m, ctx):
    """The source tree's workloads, with the untar counted up to the end of the sync after it."""
    r = w.tree_and_reads(m, ctx)
    return r | {"untar_sync": r["untar"] + r["sync"]}


def check_sealed(m, ctx):
    """The tree reads back; below an encrypting configuration, no name or data is in the clear."""
    w.check_tree(m, ctx)
    if m.cfg.name in ("native", "null"):
        return
    w.sh("tar", "xf", w.tarball(ctx), "-C", m.path)
    os.sync()
    names = subprocess.run(["find", m.lower, "-name", "stdio.h"], capture_output=True, text=True).stdout
    data = subprocess.run(["grep", "-rl", "--", "#include <bits/stdio_lim.h>", m.lower], capture_output=True, text=True).stdout
    w.sh("rm", "-rf", os.path.join(m.path, "include"))
    if names.strip() or data.strip():
        raise BenchError(f"{m.cfg.name}: plaintext below the mount: {(names or data).split()[0]}")


def comp(m, ctx):
    """A compressible text file (C headers): written, read cold and warm, and its space below."""
    n = size(ctx, 256 << 20)
    r = w.write(m, ctx, "text", n, 1 << 20, data="text", fsync=False)
    os.sync()
    r["space"] = float(w.sh("du", "-sb", m.lower).split()[0])
    r |= w.reads(m, ctx, "text", n)
    if w.digest(os.path.join(m.path, "text")) != w.cycled_digest(w.text_file(ctx, 64 << 20), n):
        raise BenchError(f"{m.cfg.name}: the text read back differs from what was written")
    return r


def vs(text, sc, metric, cfg, against, op, value):
    return Target(text, sc, metric, cfg, against, op, value)


SUITE = Suite(
    name="crypt",
    title="Encryption: the crypt layer (issue #5)",
    intro="`bench/bench crypt` measures the crypt layer against gocryptfs and the plain directory, all in the same run: "
          "large-file I/O on the disk, a source tree on a tmpfs, and `zstd,crypt` on compressible text. Volumes are made "
          "by `plyfs init --layer crypt --kdf-memory 1024` and `gocryptfs -init -scryptn 10`; both use AES-256-GCM and "
          "encrypted names.",
    scenarios=[
        Scenario("io", "Large files (1 GiB of random data, 1 MiB blocks)", CONFIGS,
                 [Metric("write", "write", "MiB/s", "higher"), Metric("write_fsync", "write + fsync", "MiB/s", "higher"),
                  Metric("read_cold", "cold read", "MiB/s", "higher"), Metric("read_warm", "warm read", "MiB/s", "higher"),
                  Metric("read_warm2", "warm read again", "MiB/s", "higher"),
                  Metric("randread_warm", "warm random read 4k", "IOPS", "higher")],
                 run=io, lower="ext4"),
        Scenario("tree", "Source tree (/usr/include)", CONFIGS,
                 [Metric("untar", "untar", "s"), Metric("untar_sync", "untar + sync", "s"),
                  Metric("read_all", "read every file, cold", "s"), Metric("ls_cold", "ls -lR cold", "s"),
                  Metric("ls_warm", "ls -lR warm", "s"), Metric("rm", "rm -rf", "s")],
                 run=tree, check=check_sealed),
        Scenario("comp", "Compressible text (256 MiB of C headers)", CONFIGS[:4],
                 [Metric("write", "write", "MiB/s", "higher"), Metric("read_cold", "cold read", "MiB/s", "higher"),
                  Metric("read_warm", "warm read", "MiB/s", "higher"), Metric("space", "space below", "B")],
                 run=comp, lower="ext4"),
    ],
    targets=[
        vs("sequential write ≥ 2× gocryptfs", "io", "write", "crypt", "gocryptfs", ">=", 2),
        vs("sequential write + fsync ≥ 2× gocryptfs", "io", "write_fsync", "crypt", "gocryptfs", ">=", 2),
        vs("cold sequential read ≥ 2× gocryptfs", "io", "read_cold", "crypt", "gocryptfs", ">=", 2),
        vs("warm sequential read ≥ 2× gocryptfs", "io", "read_warm", "crypt", "gocryptfs", ">=", 2),
        vs("warm sequential read ≥ 0.8× native", "io", "read_warm", "crypt", "native", ">=", 0.8),
        vs("warm sequential read, again, ≥ 0.8× native", "io", "read_warm2", "crypt", "native", ">=", 0.8),
        vs("warm 4 KiB random read ≥ 0.8× native", "io", "randread_warm", "crypt", "native", ">=", 0.8),
        vs("untar ≤ 0.6× gocryptfs", "tree", "untar", "crypt", "gocryptfs", "<=", 0.6),
        vs("`zstd,crypt` untar ≤ 0.6× gocryptfs", "tree", "untar", "zstd-crypt", "gocryptfs", "<=", 0.6),
        vs("`zstd,crypt` write of random data ≥ 2× gocryptfs", "io", "write", "zstd-crypt", "gocryptfs", ">=", 2),
        vs("`zstd,crypt` space of compressible text ≤ 0.5× crypt", "comp", "space", "zstd-crypt", "crypt", "<=", 0.5),
    ],
)
