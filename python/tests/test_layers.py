"""The Python examples through real plyfs mounts (needs root for FUSE, and the plyfs binary:
PLYFS_BIN, or target/release/plyfs of this checkout)."""

import errno
import json
import socket
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "python"
PLYFS = os.environ.get("PLYFS_BIN", str(REPO / "target" / "release" / "plyfs"))


def mounted(path):
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == str(path) for line in f)


class Mount:
    def __init__(self, tmp, stack, lower=None):
        self.lower = lower or tmp / "lower"
        self.mnt = tmp / "mnt"
        self.lower.mkdir(exist_ok=True)
        self.mnt.mkdir(exist_ok=True)
        self.log = tmp / "daemon.log"
        self.proc = subprocess.Popen(
            [PLYFS, "mount", str(self.lower), str(self.mnt), "--stack", stack, "--foreground"],
            stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.time() + 20
        while not (mounted(self.mnt) and "mounted " in self.log.read_text()):
            if self.proc.poll() is not None:
                raise RuntimeError(f"plyfs exited: {self.log.read_text()}")
            if time.time() > deadline:
                raise RuntimeError(f"not mounted after 20 s: {self.log.read_text()}")
            time.sleep(0.02)

    def close(self):
        if mounted(self.mnt):
            subprocess.run([PLYFS, "umount", str(self.mnt)], capture_output=True)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if mounted(self.mnt):
            subprocess.run(["umount", "-l", str(self.mnt)], capture_output=True)


@pytest.fixture
def mount(tmp_path):
    made = []

    def make(stack, lower=None):
        m = Mount(tmp_path, stack, lower)
        made.append(m)
        return m
    yield make
    for m in reversed(made):
        m.close()


def script(name, **params):
    extra = "".join(f":{k}={v}" for k, v in params.items())
    return f"py:script={EXAMPLES / name}{extra}"


def test_rot13_round_trips_and_rotates_the_lower_file(mount):
    m = mount(script("rot13.py"))
    text = b"Hello, World! " * 10000
    (m.mnt / "f").write_bytes(text)
    assert (m.mnt / "f").read_bytes() == text
    assert b"Uryyb, Jbeyq!" in (m.lower / "f").read_bytes()
    assert b"Hello, World!" not in (m.lower / "f").read_bytes()


def test_zlib_compresses_and_reads_back_after_a_remount(mount, tmp_path):
    m = mount(script("zlib_codec.py", level=9))
    text = b"the same words again and again " * 50000
    (m.mnt / "f").write_bytes(text)
    m.close()
    assert (m.lower / "f").stat().st_size < len(text) // 20
    m = mount(script("zlib_codec.py", level=9), lower=m.lower)
    assert (m.mnt / "f").read_bytes() == text


def test_an_extended_operation_defined_in_python(mount):
    m = mount(script("hello_op.py"))
    (m.mnt / "notes").write_text("one two three four\nfive")
    out = subprocess.run([PLYFS, "op", str(m.mnt / "notes"), "words"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"words": 5, "bytes": 23}
    listed = subprocess.run([PLYFS, "op", str(m.mnt), "--list"], capture_output=True, text=True).stdout
    assert "words" in listed


def test_the_audit_layer_logs_who_opened_what(mount, tmp_path):
    log = tmp_path / "audit.jsonl"
    m = mount(script("audit.py", log=log))
    (m.mnt / "secret").write_text("x")
    (m.mnt / "secret").read_text()
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert {(e["op"], e["path"]) for e in entries} >= {("create", "secret"), ("open", "secret")}
    assert all(e["uid"] == os.getuid() for e in entries)


def python_pids(script_path):
    """The Python processes running `script_path` (not the mount, whose arguments name it too)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if len(argv) > 1 and b"python" in Path(argv[0].decode()).name.encode() and argv[1] == str(script_path).encode():
            pids.append(int(entry.name))
    return pids


def test_a_killed_python_process_gives_eio_and_the_mount_lives_on(mount):
    m = mount(script("rot13.py"))
    (m.mnt / "f").write_bytes(b"before")
    pids = python_pids(EXAMPLES / "rot13.py")
    assert pids
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)
    # A new file's data must go through the codec: its flush fails.
    with pytest.raises(OSError) as e:
        with open(m.mnt / "g", "wb") as f:
            f.write(b"while it is dead")
            f.flush()
            os.fsync(f.fileno())
    assert e.value.errno == errno.EIO
    assert "rot13.py" in m.log.read_text()
    time.sleep(1.1)
    # Started again on the next use.
    (m.mnt / "h").write_bytes(b"after")
    assert (m.mnt / "h").read_bytes() == b"after"
    assert (m.mnt / "f").read_bytes() == b"before"
    assert mounted(m.mnt)


def test_a_layer_on_a_socket_reached_with_ext(mount, tmp_path):
    sock = tmp_path / "words.sock"
    server = subprocess.Popen([sys.executable, str(EXAMPLES / "hello_op.py"), "--socket", str(sock)])
    try:
        # Ready once it accepts a connection: the socket file appears at bind(), before listen().
        deadline = time.time() + 10
        while True:
            assert time.time() < deadline and server.poll() is None
            try:
                with socket.socket(socket.AF_UNIX) as probe:
                    probe.connect(str(sock))
                break
            except OSError:
                time.sleep(0.02)
        m = mount(f"ext:socket={sock},zstd")
        (m.mnt / "doc").write_text("a b c")
        out = subprocess.run([PLYFS, "op", str(m.mnt / "doc"), "words"], capture_output=True, text=True)
        assert json.loads(out.stdout)["words"] == 3, out.stderr
    finally:
        server.kill()
        server.wait()
