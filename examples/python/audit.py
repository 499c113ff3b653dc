"""audit: a log line for every file opened or created: who, which file, how.

    plyfs mount LOWER MNT --stack 'py:script=examples/python/audit.py:log=/var/log/audit.jsonl'
"""
import json
import os
import time

import plyfs


class Audit(plyfs.Layer):
    def __init__(self, path):
        self.log = open(path, "a", buffering=1)

    def path(self, req, node):
        # The level below knows where the object lives (the bottom layer's lower-info).
        info = req.call("extended", {"node": node, "name": "lower-info", "args": []}).value
        return info.get("path") if isinstance(info, dict) else None

    def record(self, req, what, node, flags):
        uid, gid, pid = req.caller
        entry = {"time": time.time(), "uid": uid, "pid": pid, "op": what, "path": self.path(req, node), "flags": oct(flags)}
        self.log.write(json.dumps(entry) + "\n")

    def open(self, req):
        reply = req.forward()
        if reply.errno == 0:
            self.record(req, "open", req.args["node"], req.args["flags"])
        return reply

    def create(self, req):
        reply = req.forward()
        if reply.errno == 0:
            self.record(req, "create", reply.value[0]["node"], req.args["flags"])
        return reply


plyfs.run(Audit(plyfs.params.get("log", os.path.expanduser("~/plyfs-audit.jsonl"))))
