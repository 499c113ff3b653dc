#!/usr/bin/env python3
"""bench/uring.py: FUSE over io_uring against the /dev/fuse loop, with native, bindfs and gocryptfs
in the same run (issue #14).

    bench/uring.py [--runs N] [--size MIB] [--no-write-doc]

Every configuration runs every workload in each repetition, in a rotated order; the report gives
medians and ratios. The lower directory is a fresh tmpfs for each measurement (metadata times on
the VM's ext4 swing tenfold with the disk's state).

Configurations:  native, bindfs, null and crypt over /dev/fuse (`-o io_uring=off`) and over
io_uring (`-o io_uring=on`), gocryptfs (`-init -scryptn 10`).
Workloads:  untar (/usr/include), ls -lR cold (after a remount) and warm, rm -rf; then 128 KiB
sequential writes of SIZE MiB with fsync, through `null -o passthrough=off` and through the
encrypting configurations.

Needs root. Turns /sys/module/fuse/parameters/enable_uring on for the run and restores it.
Environment: PLYFS_BIN (default target/release/plyfs, built first).
"""
import argparse, os, shutil, statistics, subprocess, sys, tempfile, time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARAM = "/sys/module/fuse/parameters/enable_uring"
META = ["untar", "ls_cold", "ls_warm", "rm"]


def sh(*cmd, **kw):
    return subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **kw)


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Target:
    """A configuration mounted over a fresh tmpfs lower; `path` is where the workload runs."""

    def __init__(self, cfg, plyfs, work):
        self.cfg, self.plyfs = cfg, plyfs
        self.lower, self.mnt = os.path.join(work, "lower"), os.path.join(work, "mnt")
        self.pw = os.path.join(work, "pw")
        for d in (self.lower, self.mnt):
            os.makedirs(d, exist_ok=True)
        sh("mount", "-t", "tmpfs", "-o", "size=4g", "tmpfs", self.lower)
        with open(self.pw, "w") as f:
            f.write("benchmark password\n")
        if cfg.startswith("crypt"):
            sh(plyfs, "init", self.lower, "--passfile", self.pw)
        if cfg == "gocryptfs":
            sh("gocryptfs", "-init", "-q", "-extpass", f"cat {self.pw}", "-scryptn", "10", self.lower)
        self.up()

    def up(self):
        c = self.cfg
        if c == "native":
            self.path = self.lower
            return
        self.path = self.mnt
        if c == "bindfs":
            sh("bindfs", self.lower, self.mnt)
        elif c == "gocryptfs":
            sh("gocryptfs", "-q", "-extpass", f"cat {self.pw}", self.lower, self.mnt)
        else:
            stack, transport = c.split("-", 1)
            opts = ["-o", f"io_uring={'on' if transport == 'uring' else 'off'}"]
            if stack == "nullnopt":
                stack, opts = "null", opts + ["-o", "passthrough=off"]
            extra = ["--passfile", self.pw] if stack == "crypt" else []
            out = subprocess.run([self.plyfs, "mount", self.lower, self.mnt, "--stack", stack, *opts, *extra],
                                 check=True, capture_output=True, text=True).stderr
            if transport == "uring" and "requests over io_uring" not in out:
                sys.exit(f"bench/uring.py: {c} did not get io_uring: {out.strip()}")

    def down(self):
        if self.cfg == "native":
            return
        if self.cfg.startswith(("null", "crypt")):
            sh(self.plyfs, "umount", self.mnt)
        else:
            sh("fusermount3", "-u", self.mnt)
            time.sleep(0.2)

    def close(self):
        self.down()
        # A FUSE daemon may still hold the lower for a moment after its unmount returns.
        for _ in range(100):
            if subprocess.run(["umount", self.lower], stderr=subprocess.DEVNULL).returncode == 0:
                return
            time.sleep(0.1)
        sys.exit(f"bench/uring.py: {self.lower} stays busy after {self.cfg}")


def timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def metadata(t, tarball):
    r = {"untar": timed(lambda: sh("tar", "xf", tarball, "-C", t.path))}
    t.down()
    t.up()
    r["ls_cold"] = timed(lambda: sh("ls", "-lR", t.path))
    r["ls_warm"] = timed(lambda: sh("ls", "-lR", t.path))
    r["rm"] = timed(lambda: sh("rm", "-rf", os.path.join(t.path, "include")))
    return r


def seqwrite(t, mib):
    f = os.path.join(t.path, "big")
    secs = timed(lambda: sh("dd", "if=/dev/zero", f"of={f}", "bs=128k", f"count={mib * 8}", "conv=fsync", "status=none"))
    os.unlink(f)
    return {"seqwrite": mib / secs}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--size", type=int, default=1024, help="MiB written by the sequential-write workload")
    ap.add_argument("--no-write-doc", action="store_true")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/uring.py: needs root (tmpfs lowers, the kernel's io_uring permission)")
    plyfs = os.environ.get("PLYFS_BIN")
    if not plyfs:
        subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=REPO, check=True)
        plyfs = os.path.join(REPO, "target/release/plyfs")
    rev = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    was = open(PARAM).read().strip()
    open(PARAM, "w").write("1")
    work = tempfile.mkdtemp(prefix="plyfs-bench-uring-", dir="/var/tmp")
    tarball = os.path.join(work, "include.tar")
    sh("tar", "cf", tarball, "-C", "/usr", "include")
    meta_cfgs = ["native", "bindfs", "null-devfuse", "null-uring", "crypt-devfuse", "crypt-uring", "gocryptfs"]
    write_cfgs = ["native", "nullnopt-devfuse", "nullnopt-uring", "crypt-devfuse", "crypt-uring", "gocryptfs"]
    res = {}
    try:
        for rep in range(a.runs):
            for i in range(len(meta_cfgs)):
                cfg = meta_cfgs[(i + rep) % len(meta_cfgs)]
                t = Target(cfg, plyfs, os.path.join(work, "m"))
                try:
                    for k, v in metadata(t, tarball).items():
                        res.setdefault((cfg, k), []).append(v)
                finally:
                    t.close()
            for i in range(len(write_cfgs)):
                cfg = write_cfgs[(i + rep) % len(write_cfgs)]
                t = Target(cfg, plyfs, os.path.join(work, "w"))
                try:
                    for k, v in seqwrite(t, a.size).items():
                        res.setdefault((cfg, k), []).append(v)
                finally:
                    t.close()
            log(f"repetition {rep + 1}/{a.runs} done")
    finally:
        open(PARAM, "w").write("1" if was == "Y" else "0")
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    names = {"native": "native tmpfs", "bindfs": "bindfs", "null-devfuse": "`null` /dev/fuse", "null-uring": "`null` io_uring",
             "crypt-devfuse": "`crypt` /dev/fuse", "crypt-uring": "`crypt` io_uring", "gocryptfs": "gocryptfs",
             "nullnopt-devfuse": "`null -o passthrough=off` /dev/fuse", "nullnopt-uring": "`null -o passthrough=off` io_uring"}
    out = [f"`bench/uring.py --runs {a.runs} --size {a.size}` on {rev} ({time.strftime('%Y-%m-%d')}; tmpfs lower, "
           f"medians of {a.runs} rotated runs, {os.cpu_count()} CPUs). Times in seconds; × native in brackets.\n",
           "| workload | " + " | ".join(names[c] for c in meta_cfgs) + " |", "|---" * (len(meta_cfgs) + 1) + "|"]
    for w in META:
        base = med[("native", w)]
        out.append(f"| {w.replace('_', ' ')} | " + " | ".join(
            f"{med[(c, w)]:.3f}" + ("" if c == "native" else f" ({med[(c, w)] / base:.1f}×)") for c in meta_cfgs) + " |")
    out += ["", f"Sequential write, {a.size} MiB in 128 KiB blocks, with fsync (MiB/s; × native in brackets):", "",
            "| " + " | ".join(names[c] for c in write_cfgs) + " |", "|---" * len(write_cfgs) + "|",
            "| " + " | ".join(f"{med[(c, 'seqwrite')]:.0f}" + ("" if c == "native" else f" ({med[(c, 'seqwrite')] / med[('native', 'seqwrite')]:.2f}×)")
                              for c in write_cfgs) + " |", ""]
    report = "\n".join(out) + "\n"
    print(report)
    if not a.no_write_doc:
        doc = os.path.join(REPO, "docs/benchmarks.md")
        text = open(doc).read()
        begin, end = "<!-- uring:begin -->", "<!-- uring:end -->"
        section = f"{begin}\n{report}{end}"
        if begin in text:
            text = text[:text.index(begin)] + section + text[text.index(end) + len(end):]
        else:
            text += f"\n## FUSE over io_uring (issue #14)\n\n{section}\n"
        open(doc, "w").write(text)


if __name__ == "__main__":
    main()
