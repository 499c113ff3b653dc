"""The first benchmarks (issue #1): passthrough and cached file I/O, metadata, and the cost of a
layer, against native and bindfs. Took over from bench/run.sh."""
import os

from plyfsbench import Metric, Scenario, Suite, Target, bindfs, native, per_layer, plyfs
import workloads as w

NOPT = "passthrough=off"
EIGHT = ",".join(["null"] * 8)
CONFIGS = [native(), bindfs(), plyfs("null-pt", "null"), plyfs("null-nopt", "null", NOPT), plyfs("8null-pt", EIGHT),
           plyfs("8null-nopt", EIGHT, NOPT)]


def io(m, ctx):
    """fio: 128 KiB sequential writes (without and with an fsync at the end), a cold sequential
    read after a remount, a warm one, then 4 KiB random reads of the warm file."""
    size = "256m" if ctx["quick"] else "1g"
    f = os.path.join(m.path, "bench.dat")
    w.drop_caches()
    r = {"write": w.fio(f, "write", "128k", size)}
    os.unlink(f)
    w.drop_caches()
    r["write_fsync"] = w.fio(f, "write", "128k", size, None, "--end_fsync=1")
    m.remount()
    r["read_cold"] = w.fio(f, "read", "128k", size)
    r["read_warm"] = w.fio(f, "read", "128k", size)
    r["randread_warm"] = w.fio(f, "randread", "4k", size, 5 if ctx["quick"] else 10)
    return r


IO_KEYS = ("write", "write_fsync", "read_cold", "read_warm", "randread_warm")
TREE_KEYS = ("untar", "ls_cold", "ls_warm", "rm")


SUITE = Suite(
    name="core",
    title="Pass-through: file I/O, metadata and the cost of a layer",
    intro="`bench/bench core` runs file I/O (fio, psync, one job) on the disk and the source-tree workloads on a "
          "tmpfs, through `null` with and without FUSE passthrough, through eight `null` layers, and through bindfs, "
          "against the lower directory itself.",
    scenarios=[
        Scenario("io", "File I/O (fio, 1 GiB file)", CONFIGS,
                 [Metric("write", "seq write 128k", "MiB/s", "higher"),
                  Metric("write_fsync", "seq write 128k + fsync", "MiB/s", "higher"),
                  Metric("read_cold", "cold seq read 128k", "MiB/s", "higher"),
                  Metric("read_warm", "warm seq read 128k", "MiB/s", "higher"),
                  Metric("randread_warm", "warm random read 4k", "IOPS", "higher")],
                 run=io, lower="ext4"),
        Scenario("tree", "Source tree (/usr/include)", CONFIGS,
                 [Metric("untar", "untar", "s"), Metric("ls_cold", "ls -lR cold", "s"),
                  Metric("ls_warm", "ls -lR warm", "s"), Metric("rm", "rm -rf", "s")],
                 run=w.tree, check=w.check_tree),
    ],
    targets=[
        *[Target(f"passthrough: {label} ≥ 0.9× native", "io", k, "null-pt", "native", ">=", 0.9)
          for k, label in (("write", "seq write"), ("write_fsync", "seq write + fsync"), ("read_cold", "cold seq read"),
                           ("read_warm", "warm seq read"), ("randread_warm", "warm random read"))],
        *[Target(f"without passthrough: {label} ≥ 0.9× native", "io", k, "null-nopt", "native", ">=", 0.9)
          for k, label in (("read_warm", "warm seq read"), ("randread_warm", "warm random read"))],
        *[Target(f"`null` {label} faster than bindfs", "tree", k, "null-pt", "bindfs", "<=", 1)
          for k, label in (("untar", "untar"), ("ls_cold", "ls -lR cold"), ("ls_warm", "ls -lR warm"), ("rm", "rm -rf"))],
        Target("8 `null` layers against 1, without passthrough, file I/O: ≤ 1% per layer", "io", "", "", "", "<=", 1,
               unit="%", derive=per_layer("null-nopt", "8null-nopt", [("io", IO_KEYS, True)])),
        Target("8 `null` layers against 1, without passthrough, metadata: ≤ 1% per layer", "tree", "", "", "", "<=", 1,
               unit="%", derive=per_layer("null-nopt", "8null-nopt", [("tree", TREE_KEYS, False)])),
        Target("8 `null` layers against 1, with passthrough, metadata: ≤ 1% per layer", "tree", "", "", "", "<=", 1,
               unit="%", derive=per_layer("null-pt", "8null-pt", [("tree", TREE_KEYS, False)])),
    ],
)
