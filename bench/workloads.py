"""Workloads the suites share. Each takes a mounted configuration (`m.path` is where it runs) and
the run's context, and returns {metric key: value}. Data sets are built once per run and kept in
the context."""
import atexit
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time

from plyfsbench import BenchError, drop_caches, sh, timed

MiB = 1 << 20


# --- Data sets ----------------------------------------------------------------------------------


def in_memory(ctx):
    """A directory on tmpfs for the run's sources, removed when the run ends: what a metadata
    workload reads must not be read from the disk while it is timed (the caches are dropped
    before each untar, and tmpfs keeps its pages), or a cold read of the source dominates the
    native time and flatters every ratio."""
    if "memory" not in ctx:
        ctx["memory"] = tempfile.mkdtemp(prefix="plyfsbench-", dir="/dev/shm")
        atexit.register(shutil.rmtree, ctx["memory"], True)
    return ctx["memory"]


def tarball(ctx):
    """A tarball of /usr/include (about 9k entries, 40 MB): the source tree of the metadata
    workloads, kept in memory (see `in_memory`)."""
    if "tarball" not in ctx:
        path = os.path.join(in_memory(ctx), "include.tar")
        sh("tar", "cf", path, "-C", "/usr", "include")
        ctx["tarball"] = path
    return ctx["tarball"]


def random_block(ctx):
    """64 MiB of random bytes, written over and over: incompressible data from memory."""
    if "random" not in ctx:
        ctx["random"] = os.urandom(64 * MiB)
    return ctx["random"]


def text_file(ctx, size):
    """A file of `size` bytes of C headers repeated: compressible text, as real as it gets."""
    key = f"text-{size}"
    if key not in ctx:
        path = os.path.join(ctx["work"], f"text-{size}")
        chunk = bytearray()
        for root, _, files in os.walk("/usr/include"):
            for name in sorted(files):
                try:
                    chunk += open(os.path.join(root, name), "rb").read()
                except OSError:
                    pass
                if len(chunk) >= 32 * MiB:
                    break
            if len(chunk) >= 32 * MiB:
                break
        with open(path, "wb") as f:
            written = 0
            while written < size:
                n = min(len(chunk), size - written)
                f.write(chunk[:n])
                written += n
        ctx[key] = path
    return ctx[key]


# --- Workloads ----------------------------------------------------------------------------------


def tree(m, ctx, cold_ls=True, partial=False):
    """untar of /usr/include, `ls -lR` cold (after a remount and dropped caches) and warm, `rm -rf`.
    With `partial`, tar and ls may report entries they could not make or read (sshfs)."""
    tb = tarball(ctx)
    ok = (0, 1, 2) if partial else (0,)
    drop_caches()
    r = {"untar": timed("tar", "xf", tb, "-C", m.path, ok=ok)}
    if cold_ls:
        m.remount()
        r["ls_cold"] = timed("ls", "-lR", m.path, ok=ok)
    r["ls_warm"] = timed("ls", "-lR", m.path, ok=ok)
    r["rm"] = timed("rm", "-rf", os.path.join(m.path, "include"))
    return r


def tree_and_reads(m, ctx):
    """untar of /usr/include (the sync after it timed apart), every file read cold (after a
    remount), `ls -lR` cold (after another) and warm, `rm -rf`."""
    drop_caches()
    r = {"untar": timed("tar", "xf", tarball(ctx), "-C", m.path)}
    r["sync"] = timed("sync")
    m.remount()
    r["read_all"] = timed("find", m.path, "-type", "f", "-exec", "cat", "{}", "+")
    m.remount()
    r["ls_cold"] = timed("ls", "-lR", m.path)
    r["ls_warm"] = timed("ls", "-lR", m.path)
    r["rm"] = timed("rm", "-rf", os.path.join(m.path, "include"))
    return r


def check_tree(m, ctx):
    """Every file and symlink of the untarred tree reads back as in the tarball, through a fresh
    mount (`diff -r` against the tarball extracted once into the scratch directory)."""
    tb = tarball(ctx)
    ref = os.path.join(ctx["work"], "reference")
    if not os.path.isdir(ref):
        os.makedirs(ref)
        sh("tar", "xf", tb, "-C", ref)
    sh("tar", "xf", tb, "-C", m.path)
    m.remount()
    out = subprocess.run(["diff", "-r", "--no-dereference", "-q", os.path.join(ref, "include"), os.path.join(m.path, "include")],
                         capture_output=True, text=True)
    sh("rm", "-rf", os.path.join(m.path, "include"))
    if out.returncode != 0:
        first = (out.stdout + out.stderr).strip().splitlines()[:1]
        raise BenchError(f"{m.cfg.name}: the tree read back differs from the tarball: {first}")


def write(m, ctx, name, size, block, data="random", fsync=True, key=None):
    """Sequential write of `size` bytes in `block`-sized write(2)s from memory, timed from open
    to close (an fsync before the close when `fsync`); MiB/s."""
    src = random_block(ctx) if data == "random" else open(text_file(ctx, 64 * MiB), "rb").read()
    path = os.path.join(m.path, name)
    drop_caches()
    view = memoryview(src)
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < size:
            at = done % len(src)
            n = min(block, size - done, len(src) - at)
            done += os.write(fd, view[at:at + n])
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    secs = time.perf_counter() - t
    return {key or "write": size / MiB / secs}


def fio(path, rw, bs, size, seconds=None, *extra):
    """One fio job (psync, one thread, no cache invalidation); MiB/s, or IOPS for random reads."""
    args = ["fio", f"--name={rw}", f"--filename={path}", f"--rw={rw}", f"--bs={bs}", f"--size={size}",
            "--ioengine=psync", "--numjobs=1", "--invalidate=0", "--fallocate=none", "--output-format=json", *extra]
    if "write" not in rw:
        args.append("--readonly")
    if seconds:
        args += ["--time_based", f"--runtime={seconds}"]
    job = json.loads(sh(*args, timeout=900))["jobs"][0]
    if job["error"]:
        raise BenchError(f"fio {rw} on {path}: error {job['error']}")
    part = job["read"] if "read" in rw else job["write"]
    return part["iops"] if rw == "randread" else part["bw_bytes"] / MiB


def reads(m, ctx, name, size):
    """Cold sequential read after a remount, then two warm ones (1 MiB blocks); MiB/s."""
    m.remount()
    path = os.path.join(m.path, name)
    r = {"read_cold": fio(path, "read", "1M", size)}
    r["read_warm"] = fio(path, "read", "1M", size)
    r["read_warm2"] = fio(path, "read", "1M", size)
    return r


def digest(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(4 * MiB):
            h.update(block)
    return h.hexdigest()


def cycled_digest(path, size):
    """The digest of the file at `path` repeated up to `size` bytes, as `write` writes it."""
    src = open(path, "rb").read()
    h = hashlib.sha256()
    done = 0
    while done < size:
        n = min(len(src), size - done)
        h.update(src[:n])
        done += n
    return h.hexdigest()


def dataset(ctx, kind, size):
    """`size` bytes of one of the data types of the Fast Indexing paper's benchmarks (§7.2.2):
    `aaa` (one byte repeated), `text` (English: licenses and copyright files), `bin` (ELF files
    from /usr/bin) and `comp` (xz -1 of binaries, incompressible)."""
    key = f"data-{kind}-{size}"
    if key in ctx:
        return ctx[key]
    path = os.path.join(ctx["work"], key)
    if kind == "aaa":
        body = b"a" * size
    elif kind in ("text", "bin", "comp"):
        if kind == "text":
            sources = [os.path.join(r, f) for top in ("/usr/share/common-licenses", "/usr/share/doc")
                       for r, _, fs in os.walk(top) for f in sorted(fs) if top.endswith("licenses") or f == "copyright"]
        else:
            sources = sorted(os.path.join("/usr/bin", f) for f in os.listdir("/usr/bin"))
        buf = bytearray()
        for s in sources:
            if os.path.isfile(s) and not os.path.islink(s):
                buf += open(s, "rb").read()
            if len(buf) >= 2 * size:
                break
        if kind == "comp":
            buf = subprocess.run(["xz", "-1", "-c"], input=bytes(buf), capture_output=True, check=True).stdout
        body = (bytes(buf) * (size // max(1, len(buf)) + 1))[:size]
    else:
        raise ValueError(kind)
    with open(path, "wb") as f:
        f.write(body)
    ctx[key] = path
    return path
