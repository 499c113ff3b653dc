"""Shared lowers (issue #13): stacks mounted with -o shared over GlusterFS against the volume
itself and gocryptfs -sharedstorage, and what -o shared costs on a local lower. Took over from
bench/shared.sh."""
import os
import subprocess
import time

from plyfsbench import REPO, BenchError, Lower, Metric, Scenario, Suite, Target, custom, native, plyfs, sh
import workloads as w

GLUSTER = os.path.join(REPO, "scripts/gluster.sh")


class GlusterLower(Lower):
    """Fresh directories on a single-node GlusterFS volume (replica 2, two bricks on this disk;
    `scripts/gluster.sh up`), taken down at the end if this run brought it up."""

    about = "directories on a GlusterFS volume (one node, replica 2, two bricks on the same disk; scripts/gluster.sh)"

    def __init__(self, work):
        super().__init__("gluster", work)
        self.started = subprocess.run([GLUSTER, "status"], capture_output=True).returncode != 0
        mounts = sh(GLUSTER, "up", timeout=600).split()
        if not mounts:
            raise BenchError("scripts/gluster.sh up named no mount point")
        self.work = os.path.join(mounts[0], f"bench-{os.getpid()}")
        os.makedirs(self.work, exist_ok=True)

    def close(self):
        if self.work:
            sh("rm", "-rf", self.work)
        if self.started:
            subprocess.run([GLUSTER, "down"], capture_output=True)
        self.work = None
        self.started = False


def gocryptfs_shared_start(m):
    pw = m.run.passfile
    if not os.path.exists(os.path.join(m.lower, "gocryptfs.conf")):
        sh("gocryptfs", "-init", "-q", "-passfile", pw, "-scryptn", "10", m.lower, timeout=120)
    sh("gocryptfs", "-q", "-sharedstorage", "-passfile", pw, m.lower, m.mnt, timeout=60)


def mirror(name, *options):
    def start(m):
        a, b = os.path.join(m.lower, "a"), os.path.join(m.lower, "b")
        os.makedirs(a, exist_ok=True)
        os.makedirs(b, exist_ok=True)
        opts = [x for o in options for x in ("-o", o)]
        sh(m.run.plyfs, "mount", a, m.mnt, "--stack", "mirror", "--branch", b, *opts, timeout=60)
    return custom(name, f"`--stack mirror` of two directories{' -o ' + ','.join(options) if options else ''}", start)


def over_gluster(m, ctx):
    """A sequential write with fsync (1 MiB blocks), a cold read after a remount, untar + sync."""
    n = (256 if ctx["quick"] else 1024) << 20
    r = w.write(m, ctx, "big", n, 1 << 20)
    m.remount()
    r["read_cold"] = w.fio(os.path.join(m.path, "big"), "read", "1M", n)
    os.unlink(os.path.join(m.path, "big"))
    os.mkdir(os.path.join(m.path, "tree"))
    r["untar"] = w.timed("sh", "-c", f"tar -C '{m.path}/tree' -xf '{w.tarball(ctx)}' && sync", timeout=1800)
    return r


def sharing_cost(m, ctx):
    """2,000 appends of a line (open, write, close each, like `echo >> log`), then untar + sync."""
    t = time.perf_counter()
    for i in range(2000):
        with open(os.path.join(m.path, "appends"), "a") as f:
            f.write(f"line {i} of the appends benchmark\n")
    r = {"appends": time.perf_counter() - t}
    os.mkdir(os.path.join(m.path, "tree"))
    r["untar"] = w.timed("sh", "-c", f"tar -C '{m.path}/tree' -xf '{w.tarball(ctx)}' && sync", timeout=1800)
    return r


SHARED = "shared"
LOCAL = [plyfs("zstd", "zstd"), plyfs("zstd-shared", "zstd", SHARED), plyfs("crypt", "crypt"),
         plyfs("crypt-shared", "crypt", SHARED), mirror("mirror"), mirror("mirror-shared", SHARED)]

SUITE = Suite(
    name="shared",
    title="Shared lowers (issue #13)",
    intro="`bench/bench shared` measures stacks mounted with `-o shared` over GlusterFS against the volume itself and "
          "gocryptfs `-sharedstorage`, and the cost of `-o shared` on a local lower (tmpfs).",
    needs=("glusterd:glusterfs-server", "mount.glusterfs:glusterfs-client"),
    runs=3,
    lowers={"gluster": GlusterLower},
    scenarios=[
        Scenario("gluster", "Over GlusterFS: 1 GiB written and read cold, untar of /usr/include",
                 [native("gluster", about="the GlusterFS volume itself"), plyfs("null", "null", SHARED),
                  plyfs("zstd", "zstd", SHARED), plyfs("crypt", "crypt", SHARED),
                  custom("gocryptfs", "`gocryptfs -sharedstorage` (`gocryptfs -init -scryptn 10`)", gocryptfs_shared_start)],
                 [Metric("write", "write + fsync", "MiB/s", "higher"), Metric("read_cold", "cold read", "MiB/s", "higher"),
                  Metric("untar", "untar + sync", "s")],
                 run=over_gluster, baseline="gluster", lower="gluster"),
        Scenario("local", "The cost of -o shared on a local lower: 2,000 appends, untar of /usr/include", LOCAL,
                 [Metric("appends", "2,000 appends", "s"), Metric("untar", "untar + sync", "s")],
                 run=sharing_cost, baseline="zstd"),
    ],
    targets=[
        *[Target(f"`null -o shared` over GlusterFS ≥ 0.9× GlusterFS: {t}", "gluster", k, "null", "gluster", op, v)
          for k, t, op, v in (("write", "write", ">=", 0.9), ("read_cold", "cold read", ">=", 0.9),
                              ("untar", "untar", "<=", 1.11))],
        *[Target(f"`-o shared` costs ≤ 10% on a local lower: {s}, {t}", "local", k, f"{s}-shared", s, "<=", 1.1)
          for s in ("zstd", "crypt", "mirror") for k, t in (("appends", "appends"), ("untar", "untar"))],
        *[Target(f"`crypt -o shared` faster than `gocryptfs -sharedstorage` over GlusterFS: {t}", "gluster", k, "crypt",
                 "gocryptfs", op, 1) for k, t, op in (("write", "write", ">="), ("read_cold", "cold read", ">="),
                                                      ("untar", "untar", "<="))],
    ],
)
