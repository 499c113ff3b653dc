"""rot13: the letters of every file are rotated by 13 in the lower directory.

    plyfs mount LOWER MNT --stack 'py:script=examples/python/rot13.py'
"""
import plyfs

PLAIN = bytes(range(256))
ROTATED = bytearray(PLAIN)
for first in (ord("a"), ord("A")):
    for i in range(26):
        ROTATED[first + i] = first + (i + 13) % 26
TABLE = bytes.maketrans(PLAIN, bytes(ROTATED))


class Rot13(plyfs.Codec):
    tag = b"rt13"

    def encode(self, chunk):
        return chunk.translate(TABLE)

    def decode(self, data):
        # Rotating by 13 twice gives the letters back.
        return data.translate(TABLE)


plyfs.run(Rot13())
