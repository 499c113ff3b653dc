"""A layer that adds an extended operation: `plyfs op MNT/FILE words` counts a file's words.

    plyfs mount LOWER MNT --stack 'py:script=examples/python/hello_op.py'
    plyfs op MNT/notes.txt words
"""
import plyfs


class Words(plyfs.Layer):
    extended_ops = {"words": "count the words of a file"}

    def ext_words(self, req):
        node = req.args["node"]
        opened = req.call("open", {"node": node, "flags": 0}).value
        total, offset = 0, 0
        try:
            while True:
                data = req.call("read", {"node": node, "fh": opened["fh"], "offset": offset, "size": 1 << 20}).data
                if not data:
                    break
                total += len(data.split())
                offset += len(data)
        finally:
            req.call("release", {"node": node, "fh": opened["fh"]})
        return {"words": total, "bytes": offset}


plyfs.run(Words())
