"""The exodisk volume and exofs (issue #12) against the thesis (Grimm, chapter 5), against the
service's own raw path, and against ext4 made on an image of the same size. Took over from
bench/exodisk.sh."""
import os
import random
import re
import subprocess
import tempfile
import time

from plyfsbench import (BenchError, Lower, Metric, Scenario, Suite, Target, custom, end_process, is_mounted, plyfs,
                        ratio_of, sh)
import workloads as w

SERVICE = {}


def service(run):
    """A 2 GiB volume image on the disk, served by `plyfs exodisk serve` for the whole run."""
    if SERVICE.get("work") != run.work:
        vol, sock = os.path.join(run.work, "vol.img"), os.path.join(run.work, "exodisk.sock")
        sh("dd", "if=/dev/zero", f"of={vol}", "bs=1M", "count=2048", "oflag=direct", "status=none")
        sh(run.plyfs, "exodisk", "format", vol)
        line = sh(run.plyfs, "exodisk", "serve", vol, "--socket", sock, "--daemon", "--log", os.path.join(run.work, "serve.log"))
        pid = re.search(r"\(pid (\d+)\)", line)
        if not pid:
            raise BenchError(f"the exodisk service did not start: {line.strip()}")
        SERVICE.update(work=run.work, sock=sock, pid=int(pid.group(1)))
    return SERVICE


def stop_service():
    if SERVICE.get("pid"):
        end_process(SERVICE["pid"])
    SERVICE.clear()


def tool(group, *args):
    """`plyfs exodisk bench SOCK GROUP`: each line `group,config,metric,value`."""
    def run(m, ctx):
        out = sh(m.run.plyfs, "exodisk", "bench", service(m.run)["sock"], group, *args, timeout=900)
        got = {}
        for line in out.splitlines():
            _, cfg, metric, value = line.split(",")
            got[f"{cfg}/{metric}"] = float(value)
        return got
    return run


def names(*configs, about="measured by `plyfs exodisk bench` in one run"):
    return [custom(c, about, start=lambda m: None) for c in configs]


class Ext4Image(Lower):
    """Fresh directories on ext4 made on a 2 GiB image through a loop device."""

    about = "ext4 on a 2 GiB image through a loop device, and the exodisk volume (a 2 GiB image on the disk)"

    def __init__(self, work):
        super().__init__("ext4img", work)
        self.image = os.path.join(work, "ext4.img")
        sh("dd", "if=/dev/zero", f"of={self.image}", "bs=1M", "count=2048", "oflag=direct", "status=none")
        self.loop = sh("losetup", "-f", "--show", self.image).strip()
        sh("mkfs.ext4", "-q", self.loop)
        self.top = tempfile.mkdtemp(prefix="ext4img-", dir=work)
        sh("mount", self.loop, self.top)
        self.work = self.top

    def close(self):
        if self.top and is_mounted(self.top):
            subprocess.run(["umount", self.top], capture_output=True)
        if self.loop:
            subprocess.run(["losetup", "-d", self.loop], capture_output=True)
        self.top = self.loop = None


def small_tree(ctx):
    """A tarball of 4,000 files of 1-8 KB of text in 40 directories."""
    if "small-tree" not in ctx:
        top = tempfile.mkdtemp(dir=ctx["work"])
        rnd = random.Random(12)
        words = open("/usr/share/dict/words").read().split() if os.path.exists("/usr/share/dict/words") else \
            [f"w{i}" for i in range(5000)]
        for d in range(40):
            os.makedirs(f"{top}/d{d:02}")
            for f in range(100):
                n = rnd.randint(1024, 8192)
                with open(f"{top}/d{d:02}/f{f:03}.txt", "w") as out:
                    out.write(" ".join(rnd.choice(words) for _ in range(n // 5))[:n])
        ctx["small-tree"] = os.path.join(ctx["work"], "small-tree.tar")
        sh("tar", "-C", top, "-cf", ctx["small-tree"], ".")
        sh("rm", "-rf", top)
    return ctx["small-tree"]


def fs(m, ctx):
    """Create (untar, then unmount, which writes back), read cold (a fresh mount) and delete
    (rm -rf, then unmount) 4,000 small files."""
    tree = small_tree(ctx)
    os.mkdir(os.path.join(m.path, "t"))
    t = time.perf_counter()
    sh("tar", "-C", os.path.join(m.path, "t"), "-xf", tree)
    m.down()
    os.sync()
    r = {"create": time.perf_counter() - t}
    w.drop_caches()
    m.up()
    r["read"] = w.timed("sh", "-c", f"tar -C '{m.path}/t' -cf - . | cat >/dev/null")
    t = time.perf_counter()
    sh("rm", "-rf", os.path.join(m.path, "t"))
    m.down()
    os.sync()
    r["delete"] = time.perf_counter() - t
    m.up()
    return r


def exofs_start(m):
    sh(m.run.plyfs, "mount", f"exodisk:{service(m.run)['sock']}", m.mnt, "--stack", "null", timeout=60)


SMALL = [Metric("alloc_write_ms", "alloc + write", "ms"), Metric("read_ms", "read", "ms"), Metric("dealloc_ms", "dealloc", "ms")]
MIBS = [Metric(f"{k}_mibs", k.replace("_", " "), "MiB/s", "higher") for k in ("seq_write", "seq_read", "rand_write", "rand_read")]
TWO = [Metric(f"{k}_ms", k.replace("_", " "), "ms") for k in ("seq_write", "seq_read", "rand_write", "rand_read")]
PERSIST = ("memory", "metadata", "data")

SUITE = Suite(
    name="exodisk",
    title="Exodisk and exofs (issue #12)",
    intro="`bench/bench exodisk` runs the thesis's micro-benchmarks (Grimm, chapter 5) against a 2 GiB volume image "
          "served by `plyfs exodisk serve` (direct I/O, io_uring), and exofs under a `null` stack against ext4 on a "
          "loop device. The thesis measured a 1 GB SCSI disk in 1996; its figures are in the targets.",
    needs=("mkfs.ext4:e2fsprogs", "losetup:mount"),
    lower="ext4",
    lowers={"ext4img": Ext4Image},
    cleanup=stop_service,
    scenarios=[
        Scenario("small-10k", "1,000 files of 10 KB, ms per file", names("raw", "extent", "exonode"), SMALL,
                 run=tool("small", "--files", "1000", "--size", "10000"), baseline="raw", together=True),
        Scenario("small-1k", "10,000 files of 1 KB, ms per file", names("raw", "extent", "exonode"), SMALL,
                 run=tool("small", "--files", "10000", "--size", "1000"), baseline="raw", together=True),
        Scenario("large", "One 80 MB file, sequential (1 MiB) and random (4 KiB)", names("raw", "exofs"), MIBS,
                 run=tool("large", "--size", "80M"), baseline="raw", together=True),
        Scenario("two", "Two clients, 1,000 × 10 KB each, ms per file: interleaved against partitioned 250 MB apart",
                 names("partitioned", "interleaved"), TWO, run=tool("two", "--files", "1000", "--size", "10000"),
                 baseline="partitioned", together=True),
        Scenario("insert", "16 bytes inserted in the middle, made durable: indexed insert against copying the second half",
                 names("copy", "indexed"), [Metric(f"ms_{k}kb", f"{k} KB file", "ms") for k in (10, 100, 1000)],
                 run=tool("insert"), baseline="copy", together=True),
        Scenario("ddio", "Disk-directed I/O: random 4 KiB reads per second with N outstanding",
                 names("n1", "n32", "n128"), [Metric("requests_per_s", "requests", "1/s", "higher")], run=tool("ddio"),
                 baseline="n1", together=True),
        Scenario("persist", "Persistence models: ms per file (alloc + write, 4 KiB)",
                 names(*[f"{k}-{p}" for k in ("exofs", "extent") for p in PERSIST]), [Metric("ms_per_file", "alloc + write", "ms")],
                 run=tool("persist", "--files", "200", "--size", "4096"), baseline="exofs-memory", together=True),
        Scenario("fs", "exofs under `null` against ext4 on a loop device under `null`: 4,000 files of 1-8 KB",
                 [plyfs("ext4", "null"), plyfs("ext4-fuse-io", "null", "passthrough=off"),
                  custom("exofs", "`plyfs mount exodisk:SOCK MNT --stack null`", exofs_start)],
                 [Metric("create", "create + unmount", "s"), Metric("read", "read cold", "s"), Metric("delete", "delete + unmount", "s")],
                 run=fs, baseline="ext4", lower="ext4img"),
    ],
    targets=[
        *[Target(f"exonode over raw ≤ 5%, {n}, {m}", sc, k, "exonode", "raw", "<=", 1.05)
          for sc, n in (("small-10k", "10 KB files"), ("small-1k", "1 KB files"))
          for k, m in (("alloc_write_ms", "alloc + write"), ("read_ms", "read"))],
        *[Target(f"exofs ≥ 0.95× raw, {m.label}", "large", m.key, "exofs", "raw", ">=", 0.95) for m in MIBS],
        *[Target(f"interleaved faster than partitioned (thesis: 7–45% better), {m.label}", "two", m.key, "interleaved",
                 "partitioned", "<=", 1) for m in TWO],
        Target("indexed insert constant: 1000 KB ≤ 1.5× 10 KB", "insert", "ms_1000kb", "", "", "<=", 1.5,
               derive=ratio_of("insert", ("indexed", "ms_1000kb"), ("indexed", "ms_10kb"), "ms")),
        Target("indexed insert no worse than the copy at 10 KB", "insert", "ms_10kb", "indexed", "copy", "<=", 1),
        Target("disk-directed I/O: +24% at 32 outstanding", "ddio", "requests_per_s", "n32", "n1", ">=", 1.24),
        Target("disk-directed I/O: +39% at 128 outstanding", "ddio", "requests_per_s", "n128", "n1", ">=", 1.39),
        Target("exofs files: memory ≥ 10× faster than data", "persist", "ms_per_file", "exofs-data", "exofs-memory", ">=", 10),
        Target("extents: memory ≥ 10× faster than data", "persist", "ms_per_file", "extent-data", "extent-memory", ">=", 10),
        *[Target(f"exofs faster than ext4: {k}", "fs", k, "exofs", "ext4", "<=", 1) for k in ("create", "read", "delete")],
    ],
)
