"""The tree layers (issue #10): union against the peers people use instead (kernel overlayfs,
fuse-overlayfs, mergerfs, unionfs-fuse), mirror, resync and version. Took over from
bench/fanout.sh."""
import os
import shutil
import subprocess
import tempfile

from plyfsbench import BenchError, Lower, Metric, Scenario, Suite, Target, custom, is_mounted, native, plyfs, ratio_of, sh
import workloads as w


def branches(m):
    """The union's two branches in the fresh lower: `up` (written) and `lo` (read-only, holding
    a tree of its own), and overlayfs's work directory."""
    up, lo, work = (os.path.join(m.lower, d) for d in ("up", "lo", "work"))
    for d in (up, lo, work):
        os.makedirs(d, exist_ok=True)
    if not os.path.isdir(os.path.join(lo, "base")):
        shutil.copytree("/usr/include/linux", os.path.join(lo, "base", "linux"), symlinks=True)
    return up, lo, work


def peer(name, mount):
    def start(m):
        up, lo, work = branches(m)
        sh(*mount(up, lo, work, m.mnt), timeout=60)
    return custom(name, f"`{' '.join(mount('UP', 'LO', 'WORK', 'MNT'))}`", start)


def plyfs_union(name="union"):
    def start(m):
        up, lo, _ = branches(m)
        sh(m.run.plyfs, "mount", up, m.mnt, "--stack", "union", "--branch", f"{lo}=ro", timeout=60)
    return custom(name, "`plyfs mount UP MNT --stack union --branch LO=ro`", start)


UNION_PEERS = [
    peer("overlayfs", lambda up, lo, wd, mnt: ["mount", "-t", "overlay", "overlay", "-o",
                                               f"lowerdir={lo},upperdir={up},workdir={wd}", mnt]),
    peer("fuse-overlayfs", lambda up, lo, wd, mnt: ["fuse-overlayfs", "-o", f"lowerdir={lo},upperdir={up},workdir={wd}", mnt]),
    peer("mergerfs", lambda up, lo, wd, mnt: ["mergerfs", "-o", "category.create=ff", f"{up}=RW:{lo}=RO", mnt]),
    peer("unionfs-fuse", lambda up, lo, wd, mnt: ["unionfs-fuse", "-o", "cow", f"{up}=RW:{lo}=RO", mnt]),
]


def size(ctx):
    return (256 if ctx["quick"] else 1024) << 20


def union_reads(m, ctx):
    """Warm sequential and 4 KiB random reads of a file on the union's read-only branch."""
    if m.cfg.name == "native":
        f = os.path.join(m.lower, "lo", "big")
        os.makedirs(os.path.dirname(f), exist_ok=True)
        w.fio(f, "write", "1M", size(ctx))
    else:
        f = os.path.join(m.path, "big")
    w.fio(f, "read", "1M", size(ctx))
    return {"read_warm": w.fio(f, "read", "128k", size(ctx), 3),
            "randread_warm": w.fio(f, "randread", "4k", size(ctx), 5)}


def union_over_big_file(m):
    """The union over a read-only branch holding one large file (made first, untimed)."""
    lo, up = os.path.join(m.lower, "lo"), os.path.join(m.lower, "up")
    os.makedirs(up, exist_ok=True)
    if not os.path.exists(os.path.join(lo, "big")):
        os.makedirs(lo, exist_ok=True)
        w.fio(os.path.join(lo, "big"), "write", "1M", size(m.run.ctx))
    sh(m.run.plyfs, "mount", up, m.mnt, "--stack", "union", "--branch", f"{lo}=ro", timeout=60)


def copy_up(m, ctx):
    """A 1-byte write into a large file of the read-only branch (the union copies it up), made
    durable, against `cp` of the same file and a sync; caches cold."""
    lo = os.path.join(m.lower, "lo")
    if m.cfg.name == "cp":
        os.makedirs(lo, exist_ok=True)
        w.fio(os.path.join(lo, "big"), "write", "1M", size(ctx))
        w.drop_caches()
        secs = w.timed("sh", "-c", f"cp '{lo}/big' '{m.lower}/copy' && sync")
    else:
        w.drop_caches()
        secs = w.timed("sh", "-c", f"printf x | dd of='{m.path}/big' bs=1 count=1 conv=notrunc status=none && sync")
        if os.path.getsize(os.path.join(m.lower, "up", "big")) != size(ctx):
            raise BenchError("union: the copied-up file has the wrong size")
    return {"copy": secs}


def mirror(n):
    def start(m):
        a = os.path.join(m.lower, "a")
        os.makedirs(a, exist_ok=True)
        extra = []
        if n == 2:
            os.makedirs(os.path.join(m.lower, "b"), exist_ok=True)
            extra = ["--branch", os.path.join(m.lower, "b")]
        sh(m.run.plyfs, "mount", a, m.mnt, "--stack", "mirror", *extra, timeout=60)
    return custom(f"mirror{n}", f"`--stack mirror` with {n} branch(es) on one disk", start)


def mirror_io(m, ctx):
    f = os.path.join(m.path, "f")
    r = {"write": w.fio(f, "write", "128k", size(ctx), None, "--end_fsync=1")}
    w.fio(f, "read", "1M", size(ctx))
    r["read_warm"] = w.fio(f, "read", "128k", size(ctx), 3)
    return r


def resync_start(m):
    a, b = os.path.join(m.lower, "a"), os.path.join(m.lower, "b")
    os.makedirs(a)
    os.makedirs(b)
    sh(m.run.plyfs, "mount", a, m.mnt, "--stack", "mirror[|fault]", "--branch", b, timeout=60)


def resync(m, ctx):
    """A tree of N 4 KiB files; 1% rewritten while the second branch fails; then `resync`
    against a full `scrub`, both from cold caches."""
    n = 2000 if ctx["quick"] else 20000
    for i in range(n):
        d = os.path.join(m.path, f"d{i // 100:03}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"f{i:05}"), "wb") as f:
            f.write(os.urandom(4096))
    sh(m.run.plyfs, "op", m.mnt, "fault-add@mirror.1.fault", "error=EIO")
    for j in range(n // 100):
        i = j * 100
        with open(os.path.join(m.path, f"d{i // 100:03}", f"f{i:05}"), "wb") as f:
            f.write(os.urandom(4096))
    sh(m.run.plyfs, "op", m.mnt, "fault-clear@mirror.1.fault")
    w.drop_caches()
    r = {"resync": w.timed(m.run.plyfs, "op", m.mnt, "resync")}
    w.drop_caches()
    r["scrub"] = w.timed(m.run.plyfs, "op", m.mnt, "scrub")
    m.down()
    diff = subprocess.run(["diff", "-rq", "--exclude=.plyfs-mirror.log", os.path.join(m.lower, "a"), os.path.join(m.lower, "b")],
                          capture_output=True, text=True)
    if diff.returncode != 0:
        raise BenchError(f"resync: the branches differ: {diff.stdout.splitlines()[:1]}")
    return r


def overwrite(m, ctx):
    """A large file overwritten (O_TRUNC, then fdatasync) through `version:keep=1`, which keeps
    the old content by a reflink, against `null`; XFS with reflinks."""
    mib = size(ctx) >> 20
    dd = ["dd", "if=/dev/zero", f"of={m.path}/big", "bs=1M", f"count={mib}", "conv=fdatasync", "status=none"]
    sh(*dd)
    return {"overwrite": w.timed(*dd)}


class XfsLower(Lower):
    """Fresh directories on an XFS image with reflinks, mounted through a loop device."""

    about = "directories on an XFS image with reflinks (loop device)"

    def __init__(self, work):
        super().__init__("xfs", work)
        self.image = os.path.join(work, "xfs.img")
        self.top = tempfile.mkdtemp(prefix="xfs-", dir=work)
        sh("truncate", "-s", "6G", self.image)
        sh("mkfs.xfs", "-q", "-m", "reflink=1", self.image)
        sh("mount", "-o", "loop", self.image, self.top)
        self.work = self.top

    def release(self):
        super().release()
        # XFS frees a removed file's blocks in the background; the next measurement must not
        # pay for the last one's (syncfs waits for it).
        os.sync()

    def close(self):
        if self.top and is_mounted(self.top):
            subprocess.run(["umount", self.top], capture_output=True)
        self.top = None


TREE = [Metric("untar", "untar", "s"), Metric("ls_warm", "ls -lR", "s"), Metric("rm", "rm -rf", "s")]


def fastest_peer(metric):
    def derive(v):
        u = v("meta", "union", metric)
        peers = [x for p in ("fuse-overlayfs", "mergerfs", "unionfs-fuse") if (x := v("meta", p, metric))]
        if not u or not peers:
            return None
        return u / min(peers), f"{u / min(peers):.2f}× the fastest FUSE peer ({u:.3f} / {min(peers):.3f} s)"
    return derive


SUITE = Suite(
    name="fanout",
    title="Trees: union, mirror, version (issue #10)",
    intro="`bench/bench fanout` measures the tree layers against the tools people use instead, all in one run: a "
          "2-branch union against kernel overlayfs, fuse-overlayfs, mergerfs and unionfs-fuse; a 2-branch mirror "
          "against one branch; `resync` against a full `scrub`; and `version` against `null`.",
    needs=("fuse-overlayfs", "mergerfs", "unionfs-fuse", "mkfs.xfs:xfsprogs"),
    lowers={"xfs": XfsLower},
    scenarios=[
        Scenario("meta", "Source tree on a 2-branch union (the read-only branch holds a tree of its own)",
                 [native(), *UNION_PEERS, plyfs_union(), plyfs("null", "null")], TREE,
                 run=lambda m, ctx: w.tree(m, ctx, cold_ls=False)),
        Scenario("reads", "Reads of a file on the union's read-only branch",
                 [native(), custom("union", "`--stack union`, the file on the read-only branch", union_over_big_file)],
                 [Metric("read_warm", "warm read 128k", "MiB/s", "higher"),
                  Metric("randread_warm", "warm random read 4k", "IOPS", "higher")],
                 run=union_reads, lower="ext4"),
        Scenario("copyup", "Copy-up of a large file for a 1-byte write (cold caches)",
                 [native("cp", about="`cp` of the file, then `sync`"),
                  custom("union", "a 1-byte write through `--stack union`, then `sync`", union_over_big_file)],
                 [Metric("copy", "copy", "s")], run=copy_up, baseline="cp", lower="ext4"),
        Scenario("mirror", "Mirror: 2 branches on one disk against 1", [mirror(1), mirror(2)],
                 [Metric("write", "write 128k + fsync", "MiB/s", "higher"), Metric("read_warm", "warm read", "MiB/s", "higher")],
                 run=mirror_io, baseline="mirror1", lower="ext4"),
        Scenario("resync", "Resync after 1% of a 20,000-file tree changed, against a full scrub",
                 [custom("mirror", "`--stack 'mirror[|fault]'` with 2 branches; the fault layer fails the second", resync_start)],
                 [Metric("resync", "resync", "s"), Metric("scrub", "scrub", "s")], run=resync, baseline="mirror", lower="ext4"),
        Scenario("version", "Overwrite of a large file, version against null (XFS with reflinks)",
                 [plyfs("null", "null"), plyfs("version", "version:keep=1")], [Metric("overwrite", "overwrite + fdatasync", "s")],
                 run=overwrite, baseline="null", lower="xfs"),
    ],
    targets=[
        *[Target(f"union {t} ≤ 1.1× plyfs null", "meta", k, "union", "null", "<=", 1.1) for k, t in
          (("untar", "untar"), ("ls_warm", "ls -lR"), ("rm", "rm -rf"))],
        *[Target(f"union {t} faster than the FUSE peers", "meta", k, "", "", "<=", 1, derive=fastest_peer(k)) for k, t in
          (("untar", "untar"), ("ls_warm", "ls -lR"), ("rm", "rm -rf"))],
        Target("union warm sequential read ≥ 0.9× native", "reads", "read_warm", "union", "native", ">=", 0.9),
        Target("union warm random read ≥ 0.9× native", "reads", "randread_warm", "union", "native", ">=", 0.9),
        Target("copy-up ≤ 1.1× cp", "copyup", "copy", "union", "cp", "<=", 1.1),
        Target("mirror write ≥ 0.45× one branch", "mirror", "write", "mirror2", "mirror1", ">=", 0.45),
        Target("mirror warm read ≥ 0.9× one branch", "mirror", "read_warm", "mirror2", "mirror1", ">=", 0.9),
        Target("resync ≤ 5% of a full scrub", "resync", "resync", "mirror", "mirror", "<=", 0.05,
               derive=ratio_of("resync", ("mirror", "resync"), ("mirror", "scrub"), "s")),
        Target("overwrite through version ≤ 1.1× null", "version", "overwrite", "version", "null", "<=", 1.1),
    ],
)
