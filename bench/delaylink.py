#!/usr/bin/env python3
"""A slow link for benchmarks: forwards every connection made to LISTEN on to TO, holding what
crosses it, each way, for DELAY milliseconds (a round trip of twice that), in order and without
limiting the rate. Where the kernel has no netem (this one has none), this is how a remote branch
or sshfs is measured over a link whose round trip is not a local socket's.

    delaylink.py --delay-ms 1 --listen unix:/path/link.sock --to unix:/path/server.sock
    delaylink.py --delay-ms 1 --listen tcp:127.0.0.1:7001 --to tcp:127.0.0.1:22

It prints `ready` once it listens, and runs until it is ended (SIGTERM)."""
import argparse
import os
import queue
import signal
import socket
import sys
import threading
import time


def parse(addr):
    kind, _, rest = addr.partition(":")
    if kind == "unix" and rest:
        return ("unix", rest)
    if kind == "tcp":
        host, _, port = rest.rpartition(":")
        if host and port.isdigit():
            return ("tcp", host, int(port))
    raise SystemExit(f"delaylink: '{addr}' is not unix:PATH or tcp:HOST:PORT")


def connect(to):
    if to[0] == "unix":
        s = socket.socket(socket.AF_UNIX)
        s.connect(to[1])
    else:
        s = socket.create_connection((to[1], to[2]))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def pump(src, dst, delay):
    """Bytes read at t are written at t + delay, in the order read: a reader thread and a writer
    thread (threads, not an event loop: its timers wake a millisecond late)."""
    q = queue.SimpleQueue()

    def deliver():
        try:
            while True:
                at, data = q.get()
                if data is None:
                    break
                wait = at - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                dst.sendall(data)
        except OSError:
            pass
        for s in (dst, src):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    threading.Thread(target=deliver, daemon=True).start()
    try:
        while True:
            data = src.recv(1 << 20)
            if not data:
                break
            q.put((time.monotonic() + delay, data))
    except OSError:
        pass
    q.put((0, None))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--delay-ms", type=float, required=True)
    ap.add_argument("--listen", required=True)
    ap.add_argument("--to", required=True)
    a = ap.parse_args()
    listen, to, delay = parse(a.listen), parse(a.to), a.delay_ms / 1000
    if listen[0] == "unix":
        if os.path.exists(listen[1]):
            os.unlink(listen[1])
        server = socket.socket(socket.AF_UNIX)
        server.bind(listen[1])
        os.chmod(listen[1], 0o600)
    else:
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((listen[1], listen[2]))
    server.listen(64)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    print("ready", flush=True)
    while True:
        client, _ = server.accept()
        if listen[0] == "tcp":
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            far = connect(to)
        except OSError as e:
            print(f"delaylink: cannot reach {a.to}: {e}", file=sys.stderr)
            client.close()
            continue
        threading.Thread(target=pump, args=(client, far, delay), daemon=True).start()
        threading.Thread(target=pump, args=(far, client, delay), daemon=True).start()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        pass
