#!/usr/bin/env python3
"""Judge an xfstests run against a stack's known failures (tests/xfstests/STACK.known).

A known-failures file has one test per line, `generic/NNN  reason`; a line that starts with `#`
is a comment (a reason may name an issue, `#30`), and `include FILE` reads another file of the same directory. A reason that starts with `skip:` keeps
the test out of the run (one that hangs or outlasts any run), and `--excludes` lists those for
check's -E. Exit status 1 when a test failed that the file does not list.
"""
import os
import re
import sys


def read_known(path, seen=None, origin=None):
    """The tests `path` lists (and the files it includes), with their reasons; `origin`, if
    given, is filled with the file that lists each test."""
    seen = seen if seen is not None else set()
    if path in seen:
        return {}
    seen.add(path)
    known = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith("include "):
                known.update(read_known(os.path.join(os.path.dirname(path), line.split(None, 1)[1]), seen, origin))
                continue
            parts = line.split(None, 1)
            if len(parts) < 2 or not re.fullmatch(r"[a-z0-9]+/\d+", parts[0]):
                sys.exit(f"{path}:{n}: expected `TEST REASON`, got `{line}`")
            known[parts[0]] = parts[1]
            if origin is not None:
                origin[parts[0]] = os.path.basename(path)
    return known


def last_list(text, label):
    """The tests after `label:` on the last line that starts with it."""
    found = []
    for line in text.splitlines():
        if line.startswith(label + ":"):
            found = line[len(label) + 1:].split()
    return found


def main():
    if sys.argv[1] == "--excludes":
        for test, reason in read_known(sys.argv[2]).items():
            if reason.startswith("skip:"):
                print(test)
        return 0
    known_path, out_path, stack = sys.argv[1:4]
    origin = {}
    known = read_known(known_path, origin=origin)
    text = open(out_path, errors="replace").read()
    ran = last_list(text, "Ran")
    not_run = last_list(text, "Not run")
    failed = last_list(text, "Failures")
    skipped = [t for t, r in known.items() if r.startswith("skip:")]
    if not ran:
        print(f"xfstests on {stack}: no test ran (see the output above)", file=sys.stderr)
        return 1
    unexpected = [t for t in failed if t not in known]
    now_pass = [t for t in ran if t in known and t not in failed and t not in not_run and not known[t].startswith("skip:")]
    # check's `Ran:` lists every test it tried, those that said `[not run]` included.
    run = len(ran) - len(not_run)
    passed = run - len(failed)
    print(f"xfstests on {stack}: {len(ran)} tried, {run} run, {passed} passed, {len(failed)} failed "
          f"({len(failed) - len(unexpected)} known), {len(not_run)} not run, {len(skipped)} left out by the known-failures file",
          file=sys.stderr)
    for t in now_pass:
        print(f"  {t} passed but is listed as failing ({known[t]}): take it out of {origin[t]}", file=sys.stderr)
    for t in unexpected:
        print(f"  {t} FAILED and is not a known failure", file=sys.stderr)
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
