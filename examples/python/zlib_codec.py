"""zlib: every chunk compressed with Python's zlib (compare with the Rust `gzip` layer).

    plyfs mount LOWER MNT --stack 'py:script=examples/python/zlib_codec.py:level=6'
"""
import zlib

import plyfs


class Zlib(plyfs.Codec):
    tag = b"pyzl"
    compresses = True

    def __init__(self, level):
        self.level = level

    def encode(self, chunk):
        return zlib.compress(chunk, self.level)

    def decode(self, data):
        # A chunk decodes to 64 KiB (a Python codec's default chunk): room for it at once.
        return zlib.decompress(data, bufsize=1 << 16)


plyfs.run(Zlib(int(plyfs.params.get("level", "6"))))
