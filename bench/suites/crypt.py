"""The crypt layer (issue #5) against gocryptfs and the plain directory: large files, a source
tree, and zstd,crypt on compressible text (took over from bench/crypt.sh); reverse views against
`gocryptfs -reverse` (a source tree, and a directory of long names), and what size padding costs
(issue #15); and what binding files to their places costs (issue #28)."""
import os
import subprocess
import time

from plyfsbench import BenchError, Metric, Scenario, Suite, Target, custom, gocryptfs, native, plyfs, sh, timed
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


# --- Reverse views (issue #15) -------------------------------------------------------------------


def plaintext(m):
    """The plaintext tree a reverse view shows: /usr/include, untarred into the fresh lower."""
    if not os.path.isdir(os.path.join(m.lower, "include")):
        sh("tar", "xf", w.tarball(m.run.ctx), "-C", m.lower)


def long_names(m):
    """A plaintext directory of LONG_NAMES files whose names (205 bytes) are too long to seal
    within NAME_MAX, so both views show them hashed, with a companion each."""
    d = os.path.join(m.lower, "long")
    if not os.path.isdir(d):
        os.makedirs(d)
        for i in range(LONG_NAMES):
            with open(os.path.join(d, "n" * 200 + f"{i:05}"), "w") as f:
                f.write("x")


LONG_NAMES = 1000


def plyfs_reverse_start(m, fill=plaintext):
    fill(m)
    if not os.path.exists(os.path.join(m.lower, ".plyfs-crypt.reverse.conf")):
        sh(m.run.plyfs, "init", m.lower, "--reverse", "--passfile", m.run.passfile, "--kdf-memory", "1024", timeout=120)
    sh(m.run.plyfs, "mount", m.lower, m.mnt, "--reverse", "--passfile", m.run.passfile, timeout=60)


def gocryptfs_reverse_start(m, fill=plaintext):
    fill(m)
    if not os.path.exists(os.path.join(m.lower, ".gocryptfs.reverse.conf")):
        sh("gocryptfs", "-init", "-reverse", "-q", "-extpass", f"cat {m.run.passfile}", "-scryptn", "10", m.lower, timeout=120)
    sh("gocryptfs", "-reverse", "-q", "-extpass", f"cat {m.run.passfile}", m.lower, m.mnt, timeout=60)


REVERSE = [
    custom("plain", "the plaintext tree itself (what a backup of it reads unencrypted)", lambda m: plaintext(m), path_is_lower=True),
    custom("gocryptfs-reverse", "`gocryptfs -init -reverse -scryptn 10`, mounted with `gocryptfs -reverse` (AES-SIV)",
           gocryptfs_reverse_start),
    custom("plyfs-reverse", "`plyfs init PLAIN --reverse`, mounted with `plyfs mount PLAIN MNT --reverse`", plyfs_reverse_start),
]


REVERSE_LONG = [
    custom("plain", f"a plaintext directory of {LONG_NAMES} files with 205-byte names", long_names, path_is_lower=True),
    custom("gocryptfs-reverse", "`gocryptfs -reverse` of it", lambda m: gocryptfs_reverse_start(m, long_names)),
    custom("plyfs-reverse", "`plyfs mount --reverse` of it", lambda m: plyfs_reverse_start(m, long_names)),
]


def reverse_long(m, ctx):
    """`ls -lR` of the view of a directory of long names, cold and warm: each hashed name is
    looked up after the listing."""
    m.remount()
    r = {"ls_cold": timed("ls", "-lR", m.path)}
    r["ls_warm"] = timed("ls", "-lR", m.path)
    return r


def reverse(m, ctx):
    """What a backup of the encrypted view does: `ls -lR` cold and warm, then every file read
    cold (after a remount), and read again warm (an incremental backup that compares contents)."""
    m.remount()
    r = {"ls_cold": timed("ls", "-lR", m.path)}
    r["ls_warm"] = timed("ls", "-lR", m.path)
    m.remount()
    r["read_all"] = timed("find", m.path, "-type", "f", "-exec", "cat", "{}", "+")
    r["read_all_warm"] = timed("find", m.path, "-type", "f", "-exec", "cat", "{}", "+")
    return r


def check_reverse(m, ctx):
    """The view, copied out, mounts as a crypt volume and reads back the tree."""
    if m.cfg.name != "plyfs-reverse":
        return
    copy, back = os.path.join(ctx["work"], "reverse-copy"), os.path.join(ctx["work"], "reverse-back")
    sh("rm", "-rf", copy)
    os.makedirs(copy)
    os.makedirs(back, exist_ok=True)
    sh("cp", "-a", m.path + "/.", copy)
    sh(ctx["plyfs"], "mount", copy, back, "--stack", "crypt", "-o", "ro", "--passfile", m.run.passfile, timeout=60)
    try:
        out = subprocess.run(["diff", "-r", "--no-dereference", "-q", os.path.join(m.lower, "include"), os.path.join(back, "include")],
                             capture_output=True, text=True)
    finally:
        sh(ctx["plyfs"], "umount", back, ok=(0, 1))
        sh("rm", "-rf", copy)
    if out.returncode != 0:
        raise BenchError(f"plyfs-reverse: the copied view reads back differently: {(out.stdout + out.stderr).strip().splitlines()[:1]}")


# --- Size padding (issue #15) ---------------------------------------------------------------------

PADDING = [plyfs("crypt", "crypt"), plyfs("crypt-padme", "crypt:pad=padme"), gocryptfs()]


def padding(m, ctx):
    """The source tree untarred (with the sync after it) and the space it takes below; then 1 GiB
    of random data written in 1 MiB blocks, and its space below."""
    r = {"untar": timed("tar", "xf", w.tarball(ctx), "-C", m.path)}
    r["untar_sync"] = r["untar"] + timed("sync")
    r["tree_space"] = float(sh("du", "-sb", m.lower).split()[0])
    sh("rm", "-rf", os.path.join(m.path, "include"))
    n = size(ctx, GiB)
    r |= w.write(m, ctx, "big", n, 1 << 20, fsync=True, key="write_fsync")
    os.sync()
    r["big_space"] = float(sh("du", "-sb", m.lower).split()[0])
    os.unlink(os.path.join(m.path, "big"))
    return r


# --- Files bound to their places (issue #28) -------------------------------------------------------

BIND = [plyfs("crypt", "crypt"), plyfs("crypt-bound", "crypt", init_args=("--bind-paths",)), gocryptfs()]


def rename_all(root):
    """Rename every file under `root` within its directory, then into a sibling directory made
    for it (each a rename(2), as `mv` makes); returns (seconds same-directory, seconds across)."""
    files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
    t = time.perf_counter()
    for f in files:
        os.rename(f, f + ".mv")
    same = time.perf_counter() - t
    os.makedirs(root + ".moved")
    t = time.perf_counter()
    for i, f in enumerate(files):
        os.rename(f + ".mv", os.path.join(root + ".moved", f"{i}"))
    return same, time.perf_counter() - t


def bind(m, ctx):
    """What binding costs where it works: the source tree untarred (each new file bound when its
    header is first written), every file renamed in place and then across directories (a tag
    written before each rename), `ls -lR` cold (a decoded size not yet known opens the file), every
    file read cold (a check at each open), `rm -rf`; then
    1 GiB of random data written in 1 MiB blocks with an fsync."""
    r = {"untar": timed("tar", "xf", w.tarball(ctx), "-C", m.path)}
    r["untar_sync"] = r["untar"] + timed("sync")
    m.remount()
    r["mv_same"], r["mv_across"] = rename_all(os.path.join(m.path, "include"))
    os.sync()
    m.remount()
    r["ls_cold"] = timed("ls", "-lR", m.path)
    m.remount()
    r["read_all"] = timed("find", m.path, "-type", "f", "-exec", "cat", "{}", "+")
    r["rm"] = timed("rm", "-rf", os.path.join(m.path, "include"), os.path.join(m.path, "include.moved"))
    n = size(ctx, GiB)
    r |= w.write(m, ctx, "big", n, 1 << 20, fsync=True, key="write_fsync")
    os.unlink(os.path.join(m.path, "big"))
    return r


OPS_FILES = 2000


def bind_ops(m, ctx):
    """The cost per operation, where binding adds work: OPS_FILES files of 100 bytes made (a tag
    per new file), then after a remount each opened, read and closed (a check per open), and each
    renamed within its directory (a tag per rename); microseconds per file."""
    n = OPS_FILES // 4 if ctx["quick"] else OPS_FILES
    d = os.path.join(m.path, "ops")
    os.makedirs(d)
    t = time.perf_counter()
    for i in range(n):
        with open(os.path.join(d, f"f{i}"), "wb") as f:
            f.write(b"x" * 100)
    r = {"create_us": (time.perf_counter() - t) / n * 1e6}
    os.sync()
    m.remount()
    t = time.perf_counter()
    for i in range(n):
        with open(os.path.join(d, f"f{i}"), "rb") as f:
            f.read()
    r["open_us"] = (time.perf_counter() - t) / n * 1e6
    t = time.perf_counter()
    for i in range(n):
        os.rename(os.path.join(d, f"f{i}"), os.path.join(d, f"g{i}"))
    r["rename_us"] = (time.perf_counter() - t) / n * 1e6
    sh("rm", "-rf", d)
    return r


def vs(text, sc, metric, cfg, against, op, value):
    return Target(text, sc, metric, cfg, against, op, value)


SUITE = Suite(
    name="crypt",
    title="Encryption: the crypt layer (issue #5)",
    intro="`bench/bench crypt` measures the crypt layer against gocryptfs and the plain directory, all in the same run: "
          "large-file I/O on the disk, a source tree on a tmpfs, and `zstd,crypt` on compressible text. Volumes are made "
          "by `plyfs init --layer crypt --kdf-memory 1024` and `gocryptfs -init -scryptn 10`; both use AES-256-GCM and "
          "encrypted names. Reverse views (`plyfs mount --reverse`, `gocryptfs -reverse`) show an untarred /usr/include "
          "encrypted, and are read as a backup reads them (and a directory of long names, which both show hashed, is listed); the padding scenario compares `crypt:pad=padme` with `crypt` "
          "(and gocryptfs) on the disk.",
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
        Scenario("reverse", "Reverse views of a source tree (/usr/include), read as a backup reads them", REVERSE,
                 [Metric("ls_cold", "ls -lR cold", "s"), Metric("ls_warm", "ls -lR warm", "s"),
                  Metric("read_all", "read every file, cold", "s"), Metric("read_all_warm", "read every file, warm", "s")],
                 run=reverse, check=check_reverse, baseline="plain"),
        Scenario("reverse_long", f"Reverse views of a directory of {LONG_NAMES} long names (hashed in the view)", REVERSE_LONG,
                 [Metric("ls_cold", "ls -lR cold", "s"), Metric("ls_warm", "ls -lR warm", "s")],
                 run=reverse_long, baseline="plain"),
        Scenario("padding", "Size padding: `crypt:pad=padme` against `crypt`", PADDING,
                 [Metric("untar", "untar", "s"), Metric("untar_sync", "untar + sync", "s"),
                  Metric("tree_space", "source tree, space below", "B"),
                  Metric("write_fsync", "1 GiB write + fsync", "MiB/s", "higher"),
                  Metric("big_space", "1 GiB file, space below", "B")],
                 run=padding, baseline="crypt", lower="ext4"),
        Scenario("bind", "Files bound to their places: `plyfs init --bind-paths` against `crypt`", BIND,
                 [Metric("untar", "untar", "s"), Metric("untar_sync", "untar + sync", "s"),
                  Metric("mv_same", "rename every file in its directory (cold)", "s"),
                  Metric("mv_across", "rename every file into another directory", "s"),
                  Metric("ls_cold", "ls -lR cold", "s"), Metric("read_all", "read every file, cold", "s"),
                  Metric("rm", "rm -rf", "s"), Metric("write_fsync", "1 GiB write + fsync", "MiB/s", "higher")],
                 run=bind, baseline="crypt"),
        Scenario("bind_ops", f"Files bound to their places: the cost per operation ({OPS_FILES} files of 100 bytes)", BIND,
                 [Metric("create_us", "create and write a file", "µs"),
                  Metric("open_us", "open, read and close a file, cold", "µs"),
                  Metric("rename_us", "rename a file in its directory", "µs")],
                 run=bind_ops, baseline="crypt"),
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
        vs("reverse view: cold `ls -lR` faster than `gocryptfs -reverse`", "reverse", "ls_cold", "plyfs-reverse", "gocryptfs-reverse", "<=", 1),
        vs("reverse view: warm `ls -lR` faster than `gocryptfs -reverse`", "reverse", "ls_warm", "plyfs-reverse", "gocryptfs-reverse", "<=", 1),
        vs("reverse view: full cold read faster than `gocryptfs -reverse`", "reverse", "read_all", "plyfs-reverse", "gocryptfs-reverse", "<=", 1),
        vs("reverse view: full warm read faster than `gocryptfs -reverse`", "reverse", "read_all_warm", "plyfs-reverse", "gocryptfs-reverse", "<=", 1),
        vs("reverse view of long names: cold `ls -lR` faster than `gocryptfs -reverse`", "reverse_long", "ls_cold", "plyfs-reverse", "gocryptfs-reverse", "<=", 1),
        vs("reverse view of long names: warm `ls -lR` faster than `gocryptfs -reverse`", "reverse_long", "ls_warm", "plyfs-reverse", "gocryptfs-reverse", "<=", 1),
        vs("padding: source tree takes ≤ 1.12× the space of `crypt`", "padding", "tree_space", "crypt-padme", "crypt", "<=", 1.12),
        vs("padding: 1 GiB file takes ≤ 1.12× the space of `crypt`", "padding", "big_space", "crypt-padme", "crypt", "<=", 1.12),
        vs("padding: untar + sync ≤ 1.25× `crypt`", "padding", "untar_sync", "crypt-padme", "crypt", "<=", 1.25),
        vs("padding: 1 GiB write + fsync ≥ 0.85× `crypt`", "padding", "write_fsync", "crypt-padme", "crypt", ">=", 0.85),
    ],
)
