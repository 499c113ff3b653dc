"""The size-changing layers against the benchmarks of Fast Indexing (Zadok et al., USENIX 2001,
§7; seeds/003): file copies, appends with and without fast tails, a build-like workload, the
command-line compressors, compression ratios and reads of encoded files. Took over from
bench/sca.sh."""
import os
import time

from plyfsbench import BenchError, Metric, Scenario, Suite, Target, native, plyfs
import workloads as w

NOPT = plyfs("null-nopt", "null", "passthrough=off", about="`--stack null -o passthrough=off` (cached FUSE I/O, the "
             "fair baseline: size-changing layers never use passthrough)")
LAYERS = [plyfs("copy", "copy"), plyfs("uuencode", "uuencode"), plyfs("gzip9", "gzip:level=9"), plyfs("zstd", "zstd"),
          plyfs("lz4", "lz4")]
TYPES = ("aaa", "text", "bin", "comp")
SIZES = {"0": 0, "1K": 1 << 10, "4K": 4 << 10, "64K": 64 << 10, "1M": 1 << 20, "4M": 4 << 20, "32M": 32 << 20}
COUNTS = {"0": 200, "1K": 200, "4K": 200, "64K": 200, "1M": 32, "4M": 8, "32M": 1}
UNITS = (10, 100, 1000)


def data_size(ctx):
    return (8 if ctx["quick"] else 32) << 20


def file_copy(m, ctx):
    """`cp` of text files of each size into the mount (sources in memory); ms per file."""
    src = w.dataset(ctx, "text", 32 << 20)
    body = open(src, "rb").read()
    r = {}
    for label, size in SIZES.items():
        srcdir = os.path.join(ctx["work"], f"copy-{label}")
        n = max(1, COUNTS[label] // (4 if ctx["quick"] else 1))
        if not os.path.isdir(srcdir):
            os.makedirs(srcdir)
            for i in range(COUNTS[label]):
                with open(os.path.join(srcdir, f"f{i}"), "wb") as f:
                    f.write(body[(i * 4099) % (1 << 20):][:size] if size <= 16 << 20 else body[:size])
        files = [os.path.join(srcdir, f"f{i}") for i in range(n)]
        for f in files:
            open(f, "rb").read()
        dest = os.path.join(m.path, f"copy-{label}")
        os.mkdir(dest)
        r[f"copy_{label}"] = w.timed("cp", *files, dest) / n * 1000
    return r


def check_copies(m, ctx):
    m.remount()
    for label in SIZES:
        dest = os.path.join(m.path, f"copy-{label}")
        for name in os.listdir(dest):
            if open(os.path.join(dest, name), "rb").read() != open(os.path.join(ctx["work"], f"copy-{label}", name), "rb").read():
                raise BenchError(f"{m.cfg.name}: copy-{label}/{name} read back differs from its source")


def appends(kind):
    """Appends of 10, 100 and 1000 bytes of one data type, `held` (one write(2) per append on a
    file kept open) and `reopen` (open(O_APPEND), write, close per append, like `echo >> log`);
    µs per append. The files are checked after a remount."""
    def run(m, ctx):
        body = open(w.dataset(ctx, kind, 1 << 20), "rb").read()
        r = {}
        for mode in ("held", "reopen"):
            for unit in UNITS:
                total = (1 << 20 if unit >= 100 else 256 << 10) // (4 if ctx["quick"] else 1)
                n = total // unit
                path = os.path.join(m.path, f"{mode}-{unit}")
                t = time.perf_counter()
                if mode == "held":
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                    for i in range(n):
                        os.write(fd, body[i * unit:(i + 1) * unit])
                    os.close(fd)
                else:
                    for i in range(n):
                        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                        os.write(fd, body[i * unit:(i + 1) * unit])
                        os.close(fd)
                r[f"{mode}_{unit}"] = (time.perf_counter() - t) / n * 1e6
        m.remount()
        for mode in ("held", "reopen"):
            for unit in UNITS:
                total = (1 << 20 if unit >= 100 else 256 << 10) // (4 if ctx["quick"] else 1)
                want = body[:total // unit * unit]
                if open(os.path.join(m.path, f"{mode}-{unit}"), "rb").read() != want:
                    raise BenchError(f"{m.cfg.name}: {mode}-{unit} ({kind}) read back differs from what was appended")
        return r
    return run


def build(m, ctx):
    """A build-like workload (in place of the paper's am-utils build): untar, read every file,
    rewrite every tenth file, sync; then ls -lR cold and warm."""
    w.drop_caches()
    t = time.perf_counter()
    w.sh("tar", "xf", w.tarball(ctx), "-C", m.path)
    w.sh("find", m.path, "-type", "f", "-exec", "cat", "{}", "+")
    for i, (root, _, files) in enumerate(os.walk(os.path.join(m.path, "include"))):
        for j, name in enumerate(files):
            if (i + j) % 10 == 0 and not os.path.islink(os.path.join(root, name)):
                p = os.path.join(root, name)
                data = open(p, "rb").read()
                with open(p, "wb") as f:
                    f.write(data + b"\n/* rebuilt */\n")
    os.sync()
    r = {"build": time.perf_counter() - t}
    m.remount()
    r["ls_cold"] = w.timed("ls", "-lR", m.path)
    r["ls_warm"] = w.timed("ls", "-lR", m.path)
    return r


def compress(tool):
    """`cp` into the layer, or the command-line tool writing its output into the bare lower:
    seconds for each data type at 1 MiB and at the data size, and the size ratio."""
    def run(m, ctx):
        r = {}
        for kind in TYPES:
            for label, size in (("1M", 1 << 20), ("big", data_size(ctx))):
                src = w.dataset(ctx, kind, size)
                open(src, "rb").read()
                out = os.path.join(m.path, f"{kind}-{label}")
                if tool:
                    secs = w.timed("sh", "-c", f"{tool} < '{src}' > '{out}'")
                    stored = os.path.getsize(out)
                else:
                    secs = w.timed("cp", src, out)
                    os.sync()
                    stored = os.path.getsize(os.path.join(m.lower, f"{kind}-{label}"))
                r[f"{kind}_{label}"] = secs
                if label == "big":
                    r[f"ratio_{kind}"] = stored / size
        return r
    return run


def reads(m, ctx):
    """A file of text written, then read cold after a remount and twice warm (fio, 1 MiB)."""
    n = (256 if ctx["quick"] else 1024) << 20
    w.write(m, ctx, "big", n, 1 << 20, data="text")
    return w.reads(m, ctx, "big", n)


def cli(name, tool):
    return native(name, about=f"`{tool}` writing into the bare lower directory")


COPY_METRICS = [Metric(f"copy_{k}", f"cp of {k} files", "ms") for k in SIZES]
APPEND_METRICS = [Metric(f"{mode}_{u}", f"{u}-byte appends, {mode}", "µs") for mode in ("held", "reopen") for u in UNITS]
TOOL_METRICS = [Metric(f"{k}_{s}", f"{k}, {s}", "s") for k in TYPES for s in ("1M", "big")] + \
               [Metric(f"ratio_{k}", f"size ratio, {k}", "×") for k in TYPES]
GZIP_CLI, ZSTD_CLI = cli("gzip-cli", "gzip -9"), cli("zstd-cli", "zstd -3")

SUITE = Suite(
    name="sca",
    title="Size-changing layers (issue #3)",
    intro="`bench/bench sca` runs the benchmarks of Fast Indexing (Zadok et al., USENIX 2001, §7; `seeds/003`) on the "
          "size-changing layers: file copies, appends with fast tails off and on, a build-like workload, the layers "
          "against the command-line compressors, and reads of encoded files. Files are checked after each workload, "
          "through a fresh mount.",
    lower="ext4",
    needs=("xz:xz-utils", "zstd", "gzip"),
    scenarios=[
        Scenario("copy", "File-copy (§7.2.2): cp of English-text files, ms per file", [native(), NOPT, *LAYERS],
                 COPY_METRICS, run=file_copy, check=check_copies, baseline="null-nopt"),
        *[Scenario(f"append-{kind}", f"File-append (§7.2.2, §7.4.2), {kind} data: µs per append",
                   [NOPT, plyfs("gzip9", "gzip:level=9"), plyfs("gzip9-ft", "gzip:level=9:fast_tails=on"),
                    plyfs("zstd", "zstd"), plyfs("zstd-ft", "zstd:fast_tails=on")],
                   APPEND_METRICS, run=appends(kind), baseline="null-nopt") for kind in TYPES],
        Scenario("build", "Build-like workload and file attributes (§7.3.1, §7.4.3): /usr/include",
                 [native(), NOPT, plyfs("copy", "copy"), plyfs("zstd", "zstd"), plyfs("gzip9", "gzip:level=9")],
                 [Metric("build", "untar, read all, rewrite 10%, sync", "s"), Metric("ls_cold", "ls -lR cold", "s"),
                  Metric("ls_warm", "ls -lR warm", "s")],
                 run=build, baseline="null-nopt"),
        Scenario("tools", "The layers against the command-line tools (§7.2.3, §7.5): seconds, and size ratios",
                 [GZIP_CLI, plyfs("gzip9", "gzip:level=9"), plyfs("gzip9-c64k", "gzip:level=9:chunk=64k"),
                  ZSTD_CLI, plyfs("zstd", "zstd"), plyfs("zstd-c64k", "zstd:chunk=64k"), plyfs("lz4", "lz4")],
                 TOOL_METRICS, run=lambda m, ctx: compress({"gzip-cli": "gzip -9", "zstd-cli": "zstd -3 -q"}.get(m.cfg.name))(m, ctx),
                 baseline="gzip-cli"),
        Scenario("read", "Reading an encoded file (1 GiB of text)", [native(), NOPT, plyfs("zstd", "zstd"), plyfs("lz4", "lz4")],
                 [Metric("read_cold", "cold read", "MiB/s", "higher"), Metric("read_warm", "warm read", "MiB/s", "higher"),
                  Metric("read_warm2", "warm read again", "MiB/s", "higher")],
                 run=reads),
    ],
    targets=[
        Target("fast tails speed up 10-byte appends to `gzip:level=9` ≥ 3× (text, held)", "append-text", "held_10",
               "gzip9", "gzip9-ft", ">=", 3),
        *[Target(f"(for information) the same, {k}", f"append-{k}", "held_10", "gzip9", "gzip9-ft", ">=", 3)
          for k in ("aaa", "bin", "comp")],
        Target("`copy` at most 3% slower than `null-nopt` on the build-like workload", "build", "build", "copy",
               "null-nopt", "<=", 1.03),
        *[Target(f"the gzip9 layer faster than `gzip -9`, {k} {s}", "tools", f"{k}_{s}", "gzip9", "gzip-cli", "<=", 1)
          for k in TYPES for s in ("1M", "big")],
        *[Target(f"the zstd layer faster than `zstd -3`, {k} {s}", "tools", f"{k}_{s}", "zstd", "zstd-cli", "<=", 1)
          for k in TYPES for s in ("1M", "big")],
        *[Target(f"warm read of a {c} file ≥ 0.8× native", "read", "read_warm", c, "native", ">=", 0.8)
          for c in ("zstd", "lz4")],
    ],
)
