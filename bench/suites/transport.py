"""The transport (issue #11): remote stacks over a Unix socket and TLS against a local stack and
sshfs over loopback, and a layer written in Python against its Rust counterpart. Took over from
bench/transport.sh."""
import os
import socket
import subprocess
import tempfile
import time

from plyfsbench import REPO, BenchError, Metric, Scenario, Suite, Target, custom, end_process, excess_of, plyfs, sh
import workloads as w

NO_CACHE = "attr_timeout=0,entry_timeout=0"


def wait_for(what, test):
    for _ in range(200):
        if test():
            return
        time.sleep(0.05)
    raise BenchError(f"{what} did not come up")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERVERS = set()  # `plyfs serve` processes still running: stopped by `stop_servers` however the run ends


def serve(m, directory, kind="unix", name="serve", stack="null"):
    """`plyfs serve DIRECTORY --stack STACK` on a Unix socket (WORK/NAME.sock) or on TCP with TLS
    (a pre-shared key), kept in `m.server`; returns the address and the arguments a client needs
    besides it (`--psk FILE`, for TLS)."""
    if kind == "unix":
        sock = os.path.join(m.run.work, f"{name}.sock")
        addr, args = f"unix:{sock}", []
        if os.path.exists(sock):
            os.unlink(sock)
    else:
        psk = os.path.join(m.run.work, "psk")
        if not os.path.exists(psk):
            with open(psk, "wb") as f:
                f.write(os.urandom(32))
            os.chmod(psk, 0o600)
        port = free_port()
        addr, args = f"tcp:127.0.0.1:{port}", ["--psk", psk, "--no-root-squash"]
    log = open(os.path.join(m.run.work, "server.log"), "a")
    # A session of its own: a Ctrl-C must not end the server before its mounts are gone (a remote
    # mount whose server is gone retries for ever, and its unmount waits with it).
    m.server = subprocess.Popen([m.run.plyfs, "serve", directory, "--listen", addr, "--stack", stack, *args],
                                stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    log.close()
    SERVERS.add(m.server)
    if kind == "unix":
        wait_for("plyfs serve", lambda: os.path.exists(sock) or m.server.poll() is not None)
    else:
        wait_for("plyfs serve (TLS)", lambda: socket.socket().connect_ex(("127.0.0.1", port)) == 0
                 or m.server.poll() is not None)
    if m.server.poll() is not None:
        raise BenchError(f"plyfs serve {directory} ended at once (status {m.server.returncode}; see server.log)")
    return addr, args[:2]


def end_server(server):
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
    SERVERS.discard(server)


def stop_server(m):
    if getattr(m, "server", None):
        end_server(m.server)
        m.server = None


def stop_servers():
    for server in list(SERVERS):
        end_server(server)


def remote(name, kind, options=None):
    """`plyfs serve LOWER` on a Unix socket or on TCP with TLS (a pre-shared key), and the mount
    `--stack remote` of it."""
    def start(m):
        addr, args = serve(m, m.lower, kind)
        opts = ["-o", options] if options else []
        sh(m.run.plyfs, "mount", addr, m.mnt, "--stack", "remote", *opts, *args, timeout=60)

    return custom(name, f"`plyfs serve LOWER` over {'a Unix socket' if kind == 'unix' else 'TLS on loopback'}, "
                  f"mounted with `--stack remote`{' -o ' + options if options else ''}", start, stop_server)


SSHD = {}


def sshd(work):
    """One sshd on loopback for the run, with keys of its own."""
    if SSHD.get("work") == work and SSHD.get("pid"):
        return SSHD
    stop_sshd()  # one that did not come up in full
    d = tempfile.mkdtemp(prefix="ssh-", dir=work)
    for key in ("host_key", "id"):
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", os.path.join(d, key))
    os.makedirs("/run/sshd", exist_ok=True)
    SSHD.update(work=work, dir=d)  # from here on stop_sshd finds it, by its pid file
    port = free_port()
    with open(os.path.join(d, "sshd_config"), "w") as f:
        f.write(f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d}/host_key\nPidFile {d}/sshd.pid\n"
                f"AuthorizedKeysFile {d}/id.pub\nPermitRootLogin prohibit-password\nPasswordAuthentication no\n"
                "StrictModes no\nUsePAM no\nSubsystem sftp internal-sftp\n")
    sh("/usr/sbin/sshd", "-f", os.path.join(d, "sshd_config"))
    wait_for("sshd", lambda: os.path.exists(os.path.join(d, "sshd.pid")))
    SSHD.update(work=work, dir=d, port=port, pid=int(open(os.path.join(d, "sshd.pid")).read()))
    return SSHD


def stop_sshd():
    pid = SSHD.get("pid")
    pidfile = os.path.join(SSHD.get("dir", ""), "sshd.pid")
    if not pid and SSHD.get("dir") and os.path.exists(pidfile):
        pid = int(open(pidfile).read() or 0)
    if pid:
        end_process(pid)
    SSHD.clear()


def stop_all():
    """The run's cleanup: every server and the sshd, whatever state they were left in."""
    stop_servers()
    stop_sshd()


def sshfs_start(m):
    sshfs_mount(m, sshd(m.run.work)["port"])


def sshfs_mount(m, port):
    """sshfs of the lower on the mount point, through `port` on loopback to the run's sshd."""
    s = sshd(m.run.work)
    sh("sshfs", "-p", str(port), "-o", f"IdentityFile={s['dir']}/id,StrictHostKeyChecking=no,"
       "UserKnownHostsFile=/dev/null,allow_other", f"root@127.0.0.1:{m.lower}", m.mnt, timeout=60)


SSHFS = custom("sshfs", "sshfs over loopback (Debian's sshfs and openssh-server)", sshfs_start)


def crossing(m, ctx):
    """µs per fstat of an open file with attr_timeout=0: each one a getattr to the far side."""
    with open(os.path.join(m.path, "f"), "w") as f:
        f.write("x\n")
    n = 10000 if ctx["quick"] else 50000
    fd = os.open(os.path.join(m.path, "f"), os.O_RDONLY)
    try:
        for _ in range(1000):
            os.fstat(fd)
        t = time.perf_counter()
        for _ in range(n):
            os.fstat(fd)
        return {"getattr": (time.perf_counter() - t) / n * 1e6}
    finally:
        os.close(fd)


def size(ctx):
    return (128 if ctx["quick"] else 512) << 20


def seq(m, ctx):
    """A sequential write with fsync (1 MiB blocks), then a cold read after a remount."""
    r = w.write(m, ctx, "f", size(ctx), 1 << 20)
    m.remount()
    r["read_cold"] = w.fio(os.path.join(m.path, "f"), "read", "1M", size(ctx))
    return r


def text_round_trip(m, ctx):
    """Text written with fsync, read back cold and compared."""
    src = w.text_file(ctx, 64 << 20)
    r = w.write(m, ctx, "f", size(ctx), 1 << 20, data="text")
    m.remount()
    r["read_cold"] = w.fio(os.path.join(m.path, "f"), "read", "1M", size(ctx))
    if w.digest(os.path.join(m.path, "f")) != w.cycled_digest(src, size(ctx)):
        raise BenchError(f"{m.cfg.name}: the text read back differs from what was written")
    return r


PY = os.environ.get("PLYFS_PYTHON") or os.path.join(REPO, "target/pyenv/bin/python")


def python_env(run):
    """The interpreter of Python layers, with the plyfs package (as scripts/test.sh makes it)."""
    if not os.path.exists(PY) and "PLYFS_PYTHON" not in os.environ:
        sh("python3", "-m", "venv", os.path.dirname(os.path.dirname(PY)), timeout=300)
        sh(PY, "-m", "pip", "install", "-q", os.path.join(REPO, "python"), timeout=900)
CROSSING = [plyfs("local", "null", NO_CACHE, about=f"`plyfs mount LOWER MNT --stack null -o {NO_CACHE}`"),
            remote("unix", "unix", NO_CACHE), remote("tls", "tls", NO_CACHE)]

SUITE = Suite(
    name="transport",
    title="Transport: remote stacks and Python layers (issue #11)",
    intro="`bench/bench transport` measures the transport: one crossing over a Unix socket and over TLS against a "
          "local stack, sequential I/O and metadata over TLS on loopback against sshfs, and a layer written in Python "
          "against the Rust one. Environment: PLYFS_PYTHON, the interpreter with the plyfs package.",
    needs=("sshfs", "sshd:openssh-server"),
    scenarios=[
        Scenario("crossing", "One crossing: fstat with attr_timeout=0", CROSSING, [Metric("getattr", "getattr", "µs")],
                 run=crossing, baseline="local"),
        Scenario("seq", "Sequential write and cold read (512 MiB, 1 MiB blocks)",
                 [plyfs("local", "null"), remote("tls", "tls"), SSHFS],
                 [Metric("write", "write + fsync", "MiB/s", "higher"), Metric("read_cold", "cold read", "MiB/s", "higher")],
                 run=seq, baseline="sshfs", lower="ext4"),
        Scenario("meta", "Source tree over TLS on loopback", [plyfs("local", "null"), remote("tls", "tls"), SSHFS],
                 [Metric("untar", "untar", "s"), Metric("ls_cold", "ls -lR cold", "s"), Metric("ls_warm", "ls -lR warm", "s"),
                  Metric("rm", "rm -rf", "s")],
                 run=lambda m, ctx: w.tree(m, ctx, partial=m.cfg.name == "sshfs"), baseline="sshfs"),
        Scenario("python", "A codec in Python (zlib) against the Rust gzip layer, level 6 (512 MiB of text)",
                 [plyfs("gzip", "gzip:level=6"), plyfs("gzip64", "gzip:level=6:chunk=64k"),
                  plyfs("pyzlib", f"py:script={REPO}/examples/python/zlib_codec.py:level=6:python={PY}",
                        about="`--stack py:script=examples/python/zlib_codec.py:level=6` (64 KiB chunks)")],
                 [Metric("write", "write + fsync", "MiB/s", "higher"), Metric("read_cold", "cold read", "MiB/s", "higher")],
                 run=text_round_trip, baseline="gzip", lower="ext4"),
    ],
    targets=[
        Target("a crossing over a Unix socket costs ≤ 15 µs more than local", "crossing", "getattr", "", "", "<=", 15,
               unit=" µs", derive=excess_of("crossing", ("unix", "getattr"), ("local", "getattr"), "µs")),
        Target("a crossing over TLS costs ≤ 30 µs more than local", "crossing", "getattr", "", "", "<=", 30,
               unit=" µs", derive=excess_of("crossing", ("tls", "getattr"), ("local", "getattr"), "µs")),
        Target("TLS sequential write ≥ 2× sshfs", "seq", "write", "tls", "sshfs", ">=", 2),
        Target("TLS cold read ≥ 2× sshfs", "seq", "read_cold", "tls", "sshfs", ">=", 2),
        Target("TLS sequential write ≥ 0.5× local", "seq", "write", "tls", "local", ">=", 0.5),
        Target("TLS cold read ≥ 0.5× local", "seq", "read_cold", "tls", "local", ">=", 0.5),
        Target("TLS untar ≥ 2× faster than sshfs", "meta", "untar", "tls", "sshfs", "<=", 0.5),
        Target("TLS ls -lR ≥ 2× faster than sshfs", "meta", "ls_cold", "tls", "sshfs", "<=", 0.5),
        Target("Python codec write within 2× of gzip", "python", "write", "pyzlib", "gzip", ">=", 0.5),
        Target("Python codec cold read within 2× of gzip", "python", "read_cold", "pyzlib", "gzip", ">=", 0.5),
    ],
    cleanup=stop_all,
    prepare=python_env,
)
