"""Write plyfs layers and codecs in Python.

A codec changes the bytes of each chunk of a file; plyfs's fast-indexing machinery (index,
fast tails, recovery, holes) does the rest::

    import plyfs, zlib

    class Zlib(plyfs.Codec):
        tag = b"zlib"
        def encode(self, chunk): return zlib.compress(chunk)
        def decode(self, data): return zlib.decompress(data)

    plyfs.run(Zlib())

A layer answers the operations it has a method for; every other operation bypasses it inside
the mount, without reaching Python. A method gets a request (``req.op``, ``req.args``,
``req.caller``, ``req.data``) and returns ``None`` to send it on unchanged, or the reply:
``req.forward()`` sends it on and returns the reply of the level below. Extended operations
are methods named ``ext_NAME``, listed in ``extended_ops``::

    class Audit(plyfs.Layer):
        def open(self, req):
            print(req.caller, "opens", req.args["node"])

    plyfs.run(Audit())

Mount with ``--stack 'py:script=FILE'`` (parameters after it, ``py:script=FILE:level=9``,
are in ``plyfs.params``), or run ``python3 FILE --socket PATH`` and mount with
``--stack 'ext:socket=PATH'``.
"""

import json
import os
import sys

from . import _native
from ._native import Reply, Request

__all__ = ["Codec", "Layer", "Reply", "Request", "run", "params", "OPERATIONS"]

#: The parameters given after the script in the stack (``py:script=F:key=value``), as strings.
params = json.loads(os.environ.get("PLYFS_PARAMS", "{}"))

#: The operations a layer may answer, by the name of the method that answers each.
OPERATIONS = (
    "lookup", "forget", "getattr", "setattr", "readlink", "mknod", "mkdir", "unlink", "rmdir",
    "symlink", "rename", "link", "open", "create", "read", "write", "flush", "fsync", "release",
    "opendir", "readdir", "releasedir", "fsyncdir", "statfs", "access", "getxattr", "setxattr",
    "listxattr", "removexattr", "fallocate", "lseek",
)


class Codec:
    """A size-changing algorithm applied to one chunk at a time."""

    #: Four bytes stored in every file the codec writes, so no file is read with another one.
    tag = b"pyc0"
    #: Equal chunks always encode to equal bytes (False for a cipher with random nonces).
    deterministic = True
    #: A compressor: a chunk it cannot shrink is stored as it is.
    compresses = False

    def encode(self, chunk):
        raise NotImplementedError

    def decode(self, data):
        raise NotImplementedError


class Layer:
    """A layer: methods named after operations, ``ext_NAME`` for extended operations."""

    #: What the layer does to file data: "transparent" (nothing, and it need not see it),
    #: "observes" (nothing, but it wants to see reads and writes) or "transforms".
    data = "transparent"
    #: Extended operations: name -> one line of help. ``ext_NAME(self, req)`` answers each,
    #: with anything JSON can hold.
    extended_ops = {}


def _info(obj, name):
    if isinstance(obj, Codec):
        tag = obj.tag if isinstance(obj.tag, bytes) else str(obj.tag).encode()
        if len(tag) != 4:
            raise ValueError(f"{type(obj).__name__}.tag must be 4 bytes, not {tag!r}")
        return {"name": name, "kind": "codec", "tag": tag, "deterministic": bool(obj.deterministic),
                "compresses": bool(obj.compresses)}
    if isinstance(obj, Layer):
        ops = [op for op in OPERATIONS if callable(getattr(obj, op, None))]
        ext = [(op, str(help)) for op, help in obj.extended_ops.items()]
        for op, _ in ext:
            if not callable(getattr(obj, "ext_" + op.replace("-", "_"), None)):
                raise ValueError(f"extended operation {op!r} has no method ext_{op.replace('-', '_')}")
        return {"name": name, "kind": "layer", "ops": ops, "data": obj.data, "ext_ops": ext}
    raise TypeError("plyfs.run wants a plyfs.Codec or a plyfs.Layer")


def _handler(obj):
    if isinstance(obj, Codec):
        # The native part calls obj.encode and obj.decode itself, chunk by chunk.
        return obj

    ext = {op: getattr(obj, "ext_" + op.replace("-", "_")) for op in obj.extended_ops}

    def handle(req):
        method = ext.get(req.op) or getattr(obj, req.op, None)
        if method is None:
            return req.forward()
        return method(req)
    return handle


def run(obj, name=None):
    """Serve ``obj`` to the mount that started this script, or on ``--socket PATH``."""
    name = name or type(obj).__name__.lower()
    info = _info(obj, name)
    handler = _handler(obj)
    if "--socket" in sys.argv:
        path = sys.argv[sys.argv.index("--socket") + 1]
        _native.serve_socket(path, info, handler)
        return
    fd = os.environ.get("PLYFS_FD")
    if fd is None:
        sys.exit(f"{sys.argv[0]}: a plyfs layer: mount it with --stack 'py:script={sys.argv[0]}', "
                 f"or run it with --socket PATH and mount with --stack 'ext:socket=PATH'")
    _native.serve_fd(int(fd), info, handler)
