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
        return zlib.decompress(data)


plyfs.run(Zlib(int(plyfs.params.get("level", "6"))))
