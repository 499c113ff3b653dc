"""The cache layer (issue #34): a fast branch (a directory) in front of a slow one, a remote plyfs
server (on a local socket, or behind a slow link) or a local disk made slow for real, against the
slow branch alone, the fast branch alone and sshfs.

The layer: `plyfs mount FAST MNT --stack cache:mode=write-through|write-back --branch SLOW`, or
with a remote slow branch `plyfs mount - MNT --stack 'cache:mode=...[@FAST|remote:addr=ADDR]'`.
Configurations the plyfs measured cannot mount yet (no `cache` layer, no remote branches) are
left out and reported as not available yet; the baselines are measured all the same.

The slow disk is ext4 on a loop device (direct I/O, so the backing file is not cached) made slow
for reads by dm-delay where the kernel has device-mapper, and otherwise by the block layer's
throttling (cgroup v1 blkio: a read rate and a number of reads a second, which makes each
synchronous read wait about as dm-delay would). Everything made for it is undone when the run
ends, however it ends."""
import hashlib
import os
import shutil
import subprocess
import tempfile

from plyfsbench import (BenchError, Lower, Metric, Mounted, Scenario, Suite, Target, custom, drop_caches, is_mounted,
                        log, sh, timed)
import workloads as w
from plyfsbench import REPO
from suites.transport import SSHFS, free_port, serve, sshd, sshfs_mount, stop_all, stop_server

MiB = 1 << 20

# The slow disk: dm-delay's read latency, or else blk-throttle's read limits (about the same wait
# per synchronous read, and a sequential rate of a slow disk).
DELAY_MS = 10
THROTTLE_IOPS = 100
THROTTLE_BPS = 64 * MiB
IMAGE = 3 << 30  # sparse
BLKIO = "/sys/fs/cgroup/blkio"


def size(ctx):
    return (256 if ctx["quick"] else 1024) << 20


# --- Branches -----------------------------------------------------------------------------------

PAIRS = {}  # a slow-disk lower -> {"slow": its directory on the slow disk, "tmpfs": one on a tmpfs}


def sides(m, fast_on="disk"):
    """The fast branch's directory and the slow branch's (what the server exports, for a remote
    slow branch): both in the fresh lower; for a slow-disk lower, the slow one on the slow disk
    and the fast one in the lower (on the disk) or, with `fast_on="tmpfs"`, on a tmpfs."""
    pair = PAIRS.get(m.lower, {})
    fast = os.path.join(pair[fast_on] if fast_on in pair else m.lower, "fast")
    slow = pair.get("slow") or os.path.join(m.lower, "slow")
    for d in (fast, slow):
        os.makedirs(d, exist_ok=True)
    return fast, slow


def mount(m, *args):
    """`plyfs mount ARGS`; a failure names the configuration and plyfs's own message."""
    p = subprocess.run([m.run.plyfs, "mount", *args], capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise BenchError(f"{m.cfg.name}: mount failed: {last}")


def seed_big(m, d):
    """The large file, written into `d` before the first mount (64 MiB of random bytes over and
    over, so that its digest is known)."""
    path = os.path.join(d, "big")
    if os.path.exists(path):
        return
    ctx, block = m.run.ctx, memoryview(w.random_block(m.run.ctx))
    n = size(ctx)
    with open(path, "wb") as f:
        done = 0
        while done < n:
            done += f.write(block[:min(len(block), n - done)])
    os.sync()


def big_digest(ctx):
    key = f"big-digest-{size(ctx)}"
    if key not in ctx:
        h, block, done = hashlib.sha256(), w.random_block(ctx), 0
        while done < size(ctx):
            k = min(len(block), size(ctx) - done)
            h.update(block[:k])
            done += k
        ctx[key] = h.hexdigest()
    return ctx[key]


def no_seed(m, d):
    pass


def fast_alone(name, seed, about, fast_on="disk"):
    """The fast branch's directory itself."""
    def start(m):
        fast, _ = sides(m, fast_on)
        seed(m, fast)
        m.path = fast
    return custom(name, about, start, path_is_lower=True)


def slow_alone(name, seed, about):
    """The slow branch's directory itself (the slow disk)."""
    def start(m):
        _, slow = sides(m)
        seed(m, slow)
        m.path = slow
    return custom(name, about, start, path_is_lower=True)


def null_over_fast(name, seed):
    def start(m):
        fast, _ = sides(m)
        seed(m, fast)
        mount(m, fast, m.mnt, "--stack", "null")
    return custom(name, "`plyfs mount FAST MNT --stack null`: the fast branch through a plyfs mount", start)


def remote_alone(name, seed):
    def start(m):
        _, slow = sides(m)
        seed(m, slow)
        addr, args = serve(m, slow, "unix")
        mount(m, addr, m.mnt, "--stack", "remote", *args)
    return custom(name, "`plyfs serve SLOW --listen unix:SOCK` mounted with `plyfs mount unix:SOCK MNT --stack remote`: "
                  "the slow branch alone", start, stop_server)


def remote_stack(mode, fast, addr):
    return f"cache:mode={mode}[@{fast}|remote:addr={addr}]"


def cache_remote(name, mode, seed):
    """The cache with a remote slow branch: `plyfs serve SLOW` on a Unix socket."""
    def start(m):
        fast, slow = sides(m)
        seed(m, slow)
        addr, _ = serve(m, slow, "unix")
        mount(m, "-", m.mnt, "--stack", remote_stack(mode, fast, addr))
    return custom(name, f"`plyfs serve SLOW --listen unix:SOCK`, and `plyfs mount - MNT --stack "
                  f"'{remote_stack(mode, 'FAST', 'unix:SOCK')}'`", start, stop_server, available=remote_branches)


def cache_local(name, mode, seed, about, fast_on="disk"):
    def start(m):
        fast, slow = sides(m, fast_on)
        seed(m, slow)
        mount(m, fast, m.mnt, "--stack", f"cache:mode={mode}", "--branch", slow)
    return custom(name, f"`plyfs mount FAST MNT --stack cache:mode={mode} --branch SLOW`{about}", start,
                  available=cache_layer)


# --- A slow link -------------------------------------------------------------------------------

# Each way: a round trip of about 1.4 ms through bench/delaylink.py (its threads add 0.3 ms), a
# link between buildings rather than a local socket's 20 µs. This kernel has no netem.
LINK_DELAY_MS = 0.5
LINKS = set()  # delaylink processes still running: ended by `stop_links` however the run ends


def link(m, listen, to):
    """bench/delaylink.py from `listen` to `to`, kept in `m.link`."""
    p = subprocess.Popen(["python3", os.path.join(REPO, "bench", "delaylink.py"), "--delay-ms", str(LINK_DELAY_MS),
                          "--listen", listen, "--to", to], stdout=subprocess.PIPE, text=True, start_new_session=True)
    LINKS.add(p)
    m.link = p
    if p.stdout.readline().strip() != "ready":
        raise BenchError(f"{m.cfg.name}: bench/delaylink.py did not start")


def end_link(m):
    p = getattr(m, "link", None)
    if p:
        p.terminate()
        p.wait(timeout=30)
        LINKS.discard(p)
        m.link = None


def stop_links():
    for p in list(LINKS):
        p.terminate()
        p.wait(timeout=30)
        LINKS.discard(p)


def over_link(m):
    """`plyfs serve SLOW` on a Unix socket, and the slow link to it; returns the link's address."""
    _, slow = sides(m)
    addr, _ = serve(m, slow, "unix")
    far = os.path.join(m.run.work, "link.sock")
    link(m, f"unix:{far}", addr)
    return f"unix:{far}"


def stop_over_link(m):
    # The mount is down already: the server can go, and the link with it.
    stop_server(m)
    end_link(m)


def remote_link(name):
    def start(m):
        mount(m, over_link(m), m.mnt, "--stack", "remote")
    return custom(name, "the remote stack alone (`plyfs mount unix:LINK MNT --stack remote`) over the slow link", start,
                  stop_over_link)


def cache_link(name, mode):
    def start(m):
        fast, _ = sides(m)
        mount(m, "-", m.mnt, "--stack", remote_stack(mode, fast, over_link(m)))
    return custom(name, f"`plyfs mount - MNT --stack '{remote_stack(mode, 'FAST', 'unix:LINK')}'` over the slow link",
                  start, stop_over_link, available=remote_branches)


def sshfs_link_start(m):
    s = sshd(m.run.work)
    port = free_port()
    link(m, f"tcp:127.0.0.1:{port}", f"tcp:127.0.0.1:{s['port']}")
    sshfs_mount(m, port)


def sshfs_link_stop(m):
    end_link(m)


SSHFS_LINK = custom("sshfs", "sshfs over the slow link to an sshd on loopback", sshfs_link_start, sshfs_link_stop)


def small_tarball(ctx):
    """/usr/include/linux as a tarball in memory (about 800 entries): a tree that a slow link
    untars in seconds, not minutes."""
    if "small-tarball" not in ctx:
        path = os.path.join(w.in_memory(ctx), "linux.tar")
        sh("tar", "cf", path, "-C", "/usr/include", "linux")
        ctx["small-tarball"] = path
    return ctx["small-tarball"]


def link_tree(m, ctx):
    """The tree workload (`tree`) with /usr/include/linux, over the slow link."""
    return untar_list_remove(m, small_tarball(ctx), "linux")


# --- What this plyfs can mount ------------------------------------------------------------------

PROBES = {}


def cache_layer(run):
    """None if this plyfs has the `cache` layer, or why not."""
    key = ("cache", run.plyfs)
    if key not in PROBES:
        listed = any(line.split()[:1] == ["cache"] for line in sh(run.plyfs, "layers").splitlines())
        PROBES[key] = None if listed else "this plyfs has no `cache` layer (`plyfs layers`)"
    return PROBES[key]


def remote_branches(run):
    """None if this plyfs mounts a cache whose slow branch is a remote stack (tried in the scratch
    directory), or why not."""
    why = cache_layer(run)
    if why:
        return why
    key = ("remote", run.plyfs)
    if key not in PROBES:
        lower = tempfile.mkdtemp(prefix="probe-", dir=run.work)
        cfg = cache_remote("probe", "write-back", no_seed)
        cfg.available = None
        try:
            Mounted(run, cfg, lower, lower + ".mnt").down()
            PROBES[key] = None
        except BenchError as e:
            PROBES[key] = f"a cache over a remote slow branch does not mount ({str(e).removeprefix('probe: ')})"
        finally:
            shutil.rmtree(lower, ignore_errors=True)
            shutil.rmtree(lower + ".mnt", ignore_errors=True)
    return PROBES[key]


# --- The slow disk ------------------------------------------------------------------------------

SLOW = {}  # the slow device while any of it exists: undone by `undo_slow_disk`


def dm_delay():
    if not os.path.exists("/dev/mapper/control") or shutil.which("dmsetup") is None:
        return False
    p = subprocess.run(["dmsetup", "targets"], capture_output=True, text=True)
    return p.returncode == 0 and any(line.split()[:1] == ["delay"] for line in p.stdout.splitlines())


def throttle(devno, iops, bps):
    for name, value in (("read_iops_device", iops), ("read_bps_device", bps)):
        with open(os.path.join(BLKIO, f"blkio.throttle.{name}"), "w") as f:
            f.write(f"{devno} {value}\n")


def undo_slow_disk():
    """Unmount the slow ext4, remove the dm-delay device or the throttling, detach the loop device
    and remove the image: each step on its own, whatever was made."""
    s = dict(SLOW)
    if s.get("top") and is_mounted(s["top"]):
        if subprocess.run(["umount", s["top"]], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", s["top"]], capture_output=True)
    if s.get("dm"):
        for _ in range(50):
            if subprocess.run(["dmsetup", "remove", s["dm"]], capture_output=True).returncode == 0:
                break
            subprocess.run(["sleep", "0.1"])
    if s.get("throttled"):
        try:
            throttle(s["throttled"], 0, 0)  # 0 removes the rule
        except OSError as e:
            log(f"the throttling of {s['throttled']} could not be removed: {e}")
    if s.get("loop"):
        subprocess.run(["losetup", "-d", s["loop"]], capture_output=True)
    if s.get("image") and os.path.exists(s["image"]):
        os.unlink(s["image"])
    if s.get("top"):
        shutil.rmtree(s["top"], ignore_errors=True)
    if s.get("mem"):
        if is_mounted(s["mem"]) and subprocess.run(["umount", s["mem"]], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", s["mem"]], capture_output=True)
        shutil.rmtree(s["mem"], ignore_errors=True)
    SLOW.clear()
    PAIRS.clear()


class SlowDisk(Lower):
    """Fresh pairs of directories: the fast one on the disk the run works on (BENCH_OUT: the VM's
    disk by default), the slow one on ext4 on a slow loop device; caches dropped before each
    measurement."""

    about = "the slow disk (made when the run starts)"

    def __init__(self, work):
        super().__init__("slowdisk", work)
        try:
            self.make()
        except BaseException:
            undo_slow_disk()
            raise

    def make(self):
        SLOW["image"] = image = os.path.join(self.work, "slow.img")
        with open(image, "wb") as f:
            f.truncate(IMAGE)
        SLOW["loop"] = loop = sh("losetup", "-f", "--show", "--direct-io=on", image).strip()
        devno = open(f"/sys/block/{os.path.basename(loop)}/dev").read().strip()
        if dm_delay():
            SLOW["dm"] = name = f"plyfsbench-slow-{os.getpid()}"
            sectors = sh("blockdev", "--getsz", loop).strip()
            sh("dmsetup", "create", name, "--table", f"0 {sectors} delay {loop} 0 {DELAY_MS} {loop} 0 0")
            dev = f"/dev/mapper/{name}"
            how = f"dm-delay ({DELAY_MS} ms added to every read, none to writes)"
        elif os.path.exists(os.path.join(BLKIO, "blkio.throttle.read_iops_device")):
            dev = loop
            SLOW["throttled"] = devno
            throttle(devno, THROTTLE_IOPS, THROTTLE_BPS)
            how = (f"the block layer's throttling, as the kernel has no device-mapper for dm-delay: at most "
                   f"{THROTTLE_IOPS} reads a second (a synchronous read waits about {1000 // THROTTLE_IOPS} ms, as with "
                   f"dm-delay) and {THROTTLE_BPS // MiB} MiB/s (cgroup v1 blkio.throttle.read_iops_device and "
                   f"read_bps_device); writes are not slowed")
        else:
            raise BenchError("no way to make a slow disk here: no device-mapper with the delay target, and no "
                             f"cgroup v1 blkio throttling ({BLKIO})")
        sh("mkfs.ext4", "-q", "-E", "lazy_itable_init=0,lazy_journal_init=0", dev, timeout=300)
        SLOW["top"] = top = tempfile.mkdtemp(prefix="slowdisk-", dir=self.work)
        sh("mount", dev, top)
        SLOW["mem"] = mem = tempfile.mkdtemp(prefix="fastmem-", dir=self.work)
        sh("mount", "-t", "tmpfs", "-o", "size=4g", "tmpfs", mem)
        fast = sh("stat", "-f", "-c", "%T", self.work).strip()
        type(self).about = (f"the fast branch a fresh directory on {'the disk (ext4)' if fast.startswith('ext') else fast} "
                            f"or on a tmpfs, the slow branch a fresh directory on ext4 on a loop device over a sparse "
                            f"image on the same disk, with direct I/O (the image is not cached) and slowed by {how}; "
                            f"caches dropped before each measurement")
        log(f"slow disk: {dev} on {top}, slowed by {how.split(' (')[0].split(',')[0]}")

    def fresh(self):
        path = super().fresh()
        PAIRS[path] = {"slow": os.path.join(SLOW["top"], os.path.basename(path)),
                       "tmpfs": os.path.join(SLOW["mem"], os.path.basename(path))}
        for d in PAIRS[path].values():
            os.makedirs(d)
        return path

    def release(self):
        path = self.current
        super().release()
        for d in PAIRS.pop(path, {}).values():
            shutil.rmtree(d, ignore_errors=True)

    def close(self):
        undo_slow_disk()


def cleanup():
    stop_all()
    stop_links()
    undo_slow_disk()


# --- Workloads ----------------------------------------------------------------------------------


def big_reads(m, ctx):
    """A cold read (after a remount with the caches dropped: for a cache, the first read, through
    the slow branch), a warm one (the second: for a cache, from the fast branch), and one after
    another remount (what the cache kept); 1 MiB reads, MiB/s."""
    path = os.path.join(m.path, "big")
    m.remount()
    r = {"read_cold": w.fio(path, "read", "1M", size(ctx))}
    r["read_warm"] = w.fio(path, "read", "1M", size(ctx))
    m.remount()
    r["read_remount"] = w.fio(path, "read", "1M", size(ctx))
    return r


def check_big(m, ctx):
    if w.digest(os.path.join(m.path, "big")) != big_digest(ctx):
        raise BenchError(f"{m.cfg.name}: the large file read back differs from what was written")


def disk_reads(m, ctx):
    """The first read with the caches dropped, then the caches dropped again (so that neither the
    page cache of the slow disk nor the mount's holds the file) and the second read: for a cache,
    from its fast copy. The slow disk alone is read once."""
    path = os.path.join(m.path, "big")
    drop_caches()
    r = {"read_first": w.fio(path, "read", "1M", size(ctx))}
    if m.cfg.name != "slow-disk":
        drop_caches()
        r["read_second"] = w.fio(path, "read", "1M", size(ctx))
    return r


def tree(m, ctx):
    """untar of /usr/include (from memory), `ls -lR` right after it and again (warm), `rm -rf`."""
    return untar_list_remove(m, w.tarball(ctx), "include")


def untar_list_remove(m, tarball, top):
    ok = (0, 1, 2) if m.cfg.name == "sshfs" else (0,)  # sshfs cannot make some entries
    drop_caches()
    r = {"untar": timed("tar", "xf", tarball, "-C", m.path, ok=ok)}
    r["ls"] = timed("ls", "-lR", m.path, ok=ok)
    r["ls_warm"] = timed("ls", "-lR", m.path, ok=ok)
    r["rm"] = timed("rm", "-rf", os.path.join(m.path, top))
    return r


def check_tree(m, ctx):
    """The tree reads back as in the tarball through a fresh mount; for a cache, the slow branch
    holds it too once the mount is gone (the unmount writes back what is waiting)."""
    if m.cfg.name == "sshfs":
        return
    if not m.cfg.name.startswith("cache"):
        return w.check_tree(m, ctx)
    ref = os.path.join(ctx["work"], "reference")
    if not os.path.isdir(ref):
        os.makedirs(ref)
        sh("tar", "xf", w.tarball(ctx), "-C", ref)
    sh("tar", "xf", w.tarball(ctx), "-C", m.path)
    m.remount()
    diff(m, os.path.join(ref, "include"), os.path.join(m.path, "include"), "through a fresh mount")
    m.down()
    diff(m, os.path.join(ref, "include"), os.path.join(sides(m)[1], "include"), "on the slow branch after the unmount")
    m.up()
    sh("rm", "-rf", os.path.join(m.path, "include"))


def diff(m, a, b, where):
    out = subprocess.run(["diff", "-r", "--no-dereference", "-q", a, b], capture_output=True, text=True)
    if out.returncode != 0:
        lines = (out.stdout + out.stderr).strip().splitlines()
        raise BenchError(f"{m.cfg.name}: the tree {where} differs from the tarball ({len(lines)} differences; "
                         f"first: {lines[:1]})")


# --- The suite ----------------------------------------------------------------------------------


def tree_targets(scenario, over):
    """Issue #34's tree targets for the write-back cache in `scenario`: 3× faster than the remote
    stack alone, and faster than sshfs, at untar and at a warm `ls -lR`."""
    return [Target(f"write-back {label} over {over}: {text}", scenario, metric, "cache-wb", against, "<=", value)
            for against, text, value in (("remote", "≥ 3× faster than the remote stack alone", 0.333),
                                         ("sshfs", "faster than sshfs", 1))
            for metric, label in (("untar", "untar"), ("ls_warm", "ls -lR warm"))]

DISK_READS = [Metric("read_first", "first read", "MiB/s", "higher"), Metric("read_second", "second read", "MiB/s", "higher")]
READS = [Metric("read_cold", "cold read (first)", "MiB/s", "higher"), Metric("read_warm", "warm read (second)", "MiB/s", "higher"),
         Metric("read_remount", "read after a remount", "MiB/s", "higher")]

SUITE = Suite(
    name="cache",
    title="Cache: a fast branch in front of a slow one (issue #34)",
    intro="`bench/bench cache` measures the targets of issue #34 for the `cache` layer: reads of a large file over a "
          "remote slow branch (`plyfs serve` on a Unix socket) cold and warm, against the fast branch alone and the "
          "remote stack alone; untar and `ls -lR` over the remote slow branch with write-back, against the remote stack "
          "alone and sshfs, and again over a slow link (a round trip of about 1.4 ms, made by `bench/delaylink.py`); "
          "and the second read of a large file on a slow disk made slow for real (dm-delay where the "
          "kernel has it, the block layer's throttling where it does not), against the fast disk. Configurations this "
          "plyfs cannot mount yet are listed as not available yet, and the baselines measured all the same.",
    needs=("sshfs", "sshd:openssh-server", "losetup:mount", "mkfs.ext4:e2fsprogs", "blockdev:util-linux"),
    main_chart="tree",
    scenarios=[
        Scenario("big", "A large file over a remote slow branch (1 GiB; tmpfs on both sides)",
                 [fast_alone("fast", seed_big, "the fast branch's directory itself (tmpfs): the file read with 1 MiB reads"),
                  null_over_fast("null", seed_big), remote_alone("remote", seed_big),
                  cache_remote("cache-wb", "write-back", seed_big), cache_remote("cache-wt", "write-through", seed_big)],
                 READS, run=big_reads, check=check_big, baseline="fast",
                 note="The first read of a cache comes through the slow branch (the fast branch starts empty); the "
                      "second from the fast branch; the third after a remount. The fast branch, the server's directory "
                      "and the lower of `null` are tmpfs: what is slow is the remote stack."),
        Scenario("tree", "Source tree over a remote slow branch: untar, ls -lR (/usr/include, 8.9k entries)",
                 [remote_alone("remote", no_seed), SSHFS, cache_remote("cache-wb", "write-back", no_seed),
                  cache_remote("cache-wt", "write-through", no_seed), null_over_fast("null", no_seed)],
                 [Metric("untar", "untar", "s"), Metric("ls", "ls -lR after the untar", "s"),
                  Metric("ls_warm", "ls -lR warm", "s"), Metric("rm", "rm -rf", "s")],
                 run=tree, check=check_tree, baseline="remote",
                 note="The tarball is read from memory; sshfs exports a tmpfs through an sshd on loopback. `null` is "
                      "the floor of any FUSE mount here: a plyfs mount that only passes requests on to a local tmpfs, "
                      "with no server and no cache. A cache that answered every request itself could come near it, "
                      "no nearer."),
        Scenario("link", "A source tree over a slow link (about 1.4 ms a round trip): untar, ls -lR "
                 "(/usr/include/linux, about 800 entries)",
                 [remote_link("remote"), SSHFS_LINK, cache_link("cache-wb", "write-back")],
                 [Metric("untar", "untar", "s"), Metric("ls", "ls -lR after the untar", "s"),
                  Metric("ls_warm", "ls -lR warm", "s"), Metric("rm", "rm -rf", "s")],
                 run=link_tree, baseline="remote",
                 note="The server (or sshd) is on this machine; what it is reached by holds every byte 0.5 ms each "
                      "way (`bench/delaylink.py`; this kernel has no netem), so a round trip costs about 1.4 ms, as "
                      "between buildings. Here what counts is how many requests wait for the far side, not the CPU "
                      "a request costs here."),
        Scenario("disk", "A large file on a slow disk, the fast branch on the VM's disk: read twice with the caches "
                 "dropped in between (1 GiB)",
                 [fast_alone("fast-disk", seed_big, "the fast branch's directory itself, on the disk"),
                  slow_alone("slow-disk", seed_big, "the slow branch's directory itself, on the slow disk"),
                  cache_local("cache-wt-disk", "write-through", seed_big, " (FAST on the disk, SLOW on the slow disk)")],
                 DISK_READS, run=disk_reads, check=check_big, baseline="fast-disk", lower="slowdisk",
                 note="The caches are dropped before each read: the second read of the cache comes from its fast copy, "
                      "not from the page cache of either disk."),
        Scenario("disk-tmpfs", "A large file on a slow disk, the fast branch on tmpfs: read twice with the caches dropped "
                 "in between (1 GiB)",
                 [fast_alone("fast-tmpfs", seed_big, "the fast branch's directory itself, on a tmpfs", fast_on="tmpfs"),
                  cache_local("cache-wt-tmpfs", "write-through", seed_big, " (FAST on a tmpfs, SLOW on the slow disk)",
                              fast_on="tmpfs")],
                 DISK_READS, run=disk_reads, check=check_big, baseline="fast-tmpfs", lower="slowdisk",
                 note="As above with the fast branch on a tmpfs, which dropping the caches leaves alone: what the cache "
                      "costs over its fast branch, without the VM disk's own swings."),
    ],
    targets=[
        Target("warm read over a remote slow branch: ≥ 0.9× the fast branch alone", "big", "read_warm", "cache-wb", "fast",
               ">=", 0.9),
        Target("warm read over a remote slow branch: ≥ 0.9× `null` over the fast branch", "big", "read_warm", "cache-wb",
               "null", ">=", 0.9),
        Target("cold read over a remote slow branch: ≥ the remote stack alone", "big", "read_cold", "cache-wb", "remote",
               ">=", 1),
        *tree_targets("tree", "a remote slow branch"),
        *tree_targets("link", "a slow link"),
        Target("second read from a slow disk: ≥ 0.9× the fast branch (the VM's disk)", "disk", "read_second",
               "cache-wt-disk", "fast-disk", ">=", 0.9),
        Target("second read from a slow disk: ≥ 0.9× the fast branch (tmpfs)", "disk-tmpfs", "read_second",
               "cache-wt-tmpfs", "fast-tmpfs", ">=", 0.9),
        Target("first read from a slow disk: ≥ 0.9× the slow disk alone", "disk", "read_first", "cache-wt-disk",
               "slow-disk", ">=", 0.9),
    ],
    lowers={"slowdisk": SlowDisk},
    cleanup=cleanup,
)
