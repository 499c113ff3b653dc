"""Per-file policies (issue #4): a tree where a rule compresses about 10% of the files, a large
untouched file inside such a mount, and what rules and directory attributes cost on create and
open. Took over from bench/policy.sh."""
import fnmatch
import os
import time

from plyfsbench import BenchError, Metric, Scenario, Suite, Target, native, plyfs
import workloads as w

MIXED = '''# The mixed tree: a glob without '/' matches the file name in any directory.
[[rule]]
glob = "c*"
layers = "zstd"
'''
# Five rules of the usual kinds, none of which matches the names the lookup scenario creates:
# every create walks the whole list and falls through to the default.
FIVE = '''[[rule]]
glob = "*.log"
layers = "zstd"

[[rule]]
extension = ["mp4", "mkv", "jpg", "png", "gz"]
layers = "none"

[[rule]]
glob = "docs/**"
layers = "gzip:level=9"

[[rule]]
glob = "[A-Z]*.txt"
layers = "lz4"

[[rule]]
min_size = "1G"
layers = "none"
'''
MIXED_ARGS = ("--rules", "{work}/mixed.toml")
PIN = 0


def check_routing(m, ctx):
    """The tree reads back; below `mixed`, exactly the files the rule matches are encoded and
    every other file is byte-identical to the source."""
    w.check_tree(m, ctx)
    if m.cfg.name != "mixed":
        return
    w.sh("tar", "xf", w.tarball(ctx), "-C", m.path)
    m.down()
    ref = os.path.join(ctx["work"], "reference")
    try:
        for root, _, files in os.walk(os.path.join(m.lower, "include")):
            for name in files:
                below = os.path.join(root, name)
                if os.path.islink(below):
                    continue
                encoded = open(below, "rb").read(6) == b"PLYSCA"
                if encoded != fnmatch.fnmatchcase(name, "c*"):
                    raise BenchError(f"mixed: {below} is {'' if encoded else 'not '}encoded below")
                if not encoded and open(below, "rb").read() != open(os.path.join(ref, os.path.relpath(below, m.lower)), "rb").read():
                    raise BenchError(f"mixed: {below} differs from its source below the mount")
    finally:
        m.up()
        w.sh("rm", "-rf", os.path.join(m.path, "include"))


def untouched(m, ctx):
    """A large file no rule matches: a write with fsync, then a cold read after a remount."""
    n = (256 if ctx["quick"] else 1024) << 20
    r = w.write(m, ctx, "big.dat", n, 1 << 20, key="write")
    m.remount()
    r["read_cold"] = w.fio(os.path.join(m.path, "big.dat"), "read", "1M", n)
    return r


def lookups(m, ctx):
    """Empty files created, opened and closed in the same mount, then again after a remount
    (lookups included); µs per file, the loop and the daemon on the same CPU."""
    n = 2000 if ctx["quick"] else 10000
    d = os.path.join(m.path, "d")
    os.mkdir(d)
    if m.cfg.name == "dirnone":
        os.setxattr(d, "user.plyfs.layers", b"none")
    names = [os.path.join(d, f"f{i:05}") for i in range(n)]
    was = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {PIN})
    try:
        def loop(flags):
            t = time.perf_counter()
            for p in names:
                os.close(os.open(p, flags, 0o644))
            return (time.perf_counter() - t) / n * 1e6
        r = {"create": loop(os.O_CREAT | os.O_WRONLY)}
        os.sync()
        r["open_warm"] = loop(os.O_RDONLY)
        m.remount()
        r["open_cold"] = loop(os.O_RDONLY)
    finally:
        os.sched_setaffinity(0, was)
    return r


SUITE = Suite(
    name="policy",
    title="Per-file policies (issue #4)",
    intro="`bench/bench policy` measures per-file policies: a tree where a rule (`glob = \"c*\"` → zstd) compresses "
          "about 10% of the files, a large untouched file inside such a mount, and what five rules or a directory "
          "attribute cost on create and open.",
    files={"mixed.toml": MIXED, "five.toml": FIVE},
    scenarios=[
        Scenario("tree", "Mixed tree: /usr/include with 10% of the files compressed by a rule",
                 [native(), plyfs("null", "null"), plyfs("mixed", "null", args=MIXED_ARGS,
                                                         about="`--stack null --rules mixed.toml` (`c*` → zstd)"),
                  plyfs("zstd-all", "zstd")],
                 [Metric("untar", "untar", "s"), Metric("sync", "sync after it", "s"), Metric("ls_cold", "ls -lR cold", "s"),
                  Metric("ls_warm", "ls -lR warm", "s"), Metric("read_all", "read every file, cold", "s")],
                 run=w.tree_and_reads, check=check_routing),
        Scenario("untouched", "A large file no rule matches (1 GiB, 1 MiB blocks)",
                 [native(), plyfs("null", "null"), plyfs("mixed", "null", args=MIXED_ARGS)],
                 [Metric("write", "write + fsync", "MiB/s", "higher"), Metric("read_cold", "cold read", "MiB/s", "higher")],
                 run=untouched, lower="ext4"),
        Scenario("lookup", "Policy cost on create and open (10,000 empty files, one CPU)",
                 [native(), plyfs("norules", "null", pin=PIN),
                  plyfs("rules5", "null", args=("--rules", "{work}/five.toml"), pin=PIN,
                        about="`--stack null --rules five.toml` (five rules, none matching)"),
                  plyfs("dirnone", "null", pin=PIN, about="`--stack null`, `user.plyfs.layers=none` on the directory")],
                 [Metric("create", "create + close", "µs"), Metric("open_warm", "open + close", "µs"),
                  Metric("open_cold", "open + close after a remount", "µs")],
                 run=lookups),
    ],
    targets=[
        Target("untouched-file write in the mixed mount ≥ 0.9× native", "untouched", "write", "mixed", "native", ">=", 0.9),
        Target("untouched-file cold read in the mixed mount ≥ 0.9× native", "untouched", "read_cold", "mixed", "native",
               ">=", 0.9),
        Target("five rules cost ≤ 5% on create", "lookup", "create", "rules5", "norules", "<=", 1.05),
        Target("five rules cost ≤ 5% on open", "lookup", "open_warm", "rules5", "norules", "<=", 1.05),
        Target("a directory attribute costs ≤ 5% on create", "lookup", "create", "dirnone", "norules", "<=", 1.05),
        Target("a directory attribute costs ≤ 5% on open", "lookup", "open_warm", "dirnone", "norules", "<=", 1.05),
    ],
)
