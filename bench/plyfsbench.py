"""The benchmark harness: configurations, lowers, workloads, rotation, medians, targets, reports,
charts and a dated history. A benchmark is a short declaration in `bench/suites/`; `bench/bench`
runs it.

A run of a suite:
- builds plyfs (or takes PLYFS_BIN) and copies the binary, so that a rebuild during the run does
  not change what is measured;
- for every repetition, runs each scenario in each of its configurations, in an order rotated by
  one per repetition (slow drifts of a noisy machine then hit every configuration alike), each on
  a fresh lower directory: a tmpfs by default, or a directory on the disk (`--lower ext4`);
- reports medians, ratios to the scenario's baseline and the spread, judges the targets, draws one
  chart per table, and appends the medians to `bench/history/SUITE.jsonl`, whose recent entries
  the report shows next to the targets, so that a regression shows.

Every mount is unmounted when the run ends, however it ends.
"""
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
URING_PARAM = "/sys/module/fuse/parameters/enable_uring"
# Where reports go (tests point them elsewhere).
DOC = os.path.join(REPO, "docs/benchmarks.md")
CHARTS = os.path.join(REPO, "docs/charts")
HISTORY = os.path.join(REPO, "bench/history")
PASSWORD = "benchmark password\n"


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class BenchError(Exception):
    """A step failed: the message names the configuration, the step and the cause."""


def sh(*cmd, timeout=900, env=None, quiet=False, ok=(0,)):
    """Run `cmd`; its stdout is returned (discarded with `quiet`), an exit status not in `ok`
    raises BenchError with its stderr."""
    try:
        p = subprocess.run(cmd, stdout=subprocess.DEVNULL if quiet else subprocess.PIPE, stderr=subprocess.PIPE,
                           timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise BenchError(f"'{' '.join(map(str, cmd))}' took more than {timeout} s")
    if p.returncode not in ok:
        last = (p.stderr.decode(errors="replace").strip().splitlines() or ["(no message)"])[-1]
        raise BenchError(f"'{' '.join(map(str, cmd))}' failed (status {p.returncode}): {last}")
    return "" if quiet else p.stdout.decode(errors="replace")


def timed(*cmd, timeout=900, ok=(0,)):
    """Seconds `cmd` took (its output discarded)."""
    t = time.perf_counter()
    sh(*cmd, timeout=timeout, quiet=True, ok=ok)
    return time.perf_counter() - t


def end_process(pid):
    """SIGTERM to a process this run started, if it still runs."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass


def drop_caches():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


def is_mounted(path):
    path = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == path for line in f)


# --- Configurations -----------------------------------------------------------------------------


@dataclass
class Config:
    """How to mount one thing that a workload runs in.

    kind: `native` (the lower itself), `bindfs`, `gocryptfs`, `plyfs` (with `stack`, `options`
    given as `-o` values, `args` added to `plyfs mount` with `{work}` standing for the run's
    scratch directory, and `init` true for a volume made by `plyfs init --layer crypt`, with
    `init_args` added to that command), or
    `custom`, mounted by `start(m)` and unmounted by `stop(m)` (after which a FUSE mount at
    `m.mnt`, if any, is unmounted). `pin`: a CPU the daemon is started on (`taskset`).
    `available(run)`, if given, is asked once per run before the configuration is first mounted:
    None, or why it cannot be measured with this plyfs (a layer or feature not there yet); such
    a configuration is left out without failing the run, and the report says why."""

    name: str
    kind: str
    stack: str = ""
    options: tuple = ()
    init: bool = False
    init_args: tuple = ()
    about: str = ""
    args: tuple = ()
    pin: Optional[int] = None
    start: Optional[Callable] = None
    stop: Optional[Callable] = None
    available: Optional[Callable] = None

    @property
    def uring(self):
        return "io_uring=on" in self.options

    def describe(self):
        if self.about:
            return self.about
        if self.kind == "native":
            return "the lower directory itself"
        if self.kind == "bindfs":
            return "`bindfs LOWER MNT`"
        if self.kind == "gocryptfs":
            return "`gocryptfs -init -scryptn 10`, mounted with its defaults (AES-256-GCM, encrypted names)"
        opts = "".join(f" -o {o}" for o in self.options)
        made = f" (a volume made by `plyfs init --layer crypt{''.join(' ' + a for a in self.init_args)}`)" if self.init else ""
        return f"`plyfs mount LOWER MNT --stack {self.stack}{opts}`{made}"


def native(name="native", about=""):
    return Config(name, "native", about=about)


def bindfs(name="bindfs"):
    return Config(name, "bindfs")


def gocryptfs(name="gocryptfs"):
    return Config(name, "gocryptfs")


def plyfs(name, stack, *options, about="", args=(), pin=None, init_args=()):
    """A plyfs stack; a stack with `crypt` in it mounts a volume made by `plyfs init` (with
    `init_args`)."""
    crypt = any(s.split(":")[0] == "crypt" for s in stack.split(","))
    return Config(name, "plyfs", stack, tuple(options), init=crypt, init_args=tuple(init_args), about=about,
                  args=tuple(args), pin=pin)


def custom(name, about, start, stop=None, path_is_lower=False, available=None):
    """A configuration a suite mounts itself; with `path_is_lower` the workloads run in the lower."""
    return Config(name, "native" if path_is_lower else "custom", about=about, start=start, stop=stop,
                  available=available)


class Mounted:
    """A configuration mounted over a fresh lower; workloads run in `path`."""

    def __init__(self, run, cfg: Config, lower: str, mnt: str):
        self.run, self.cfg, self.lower, self.mnt = run, cfg, lower, mnt
        self.path = lower if cfg.kind == "native" else mnt
        os.makedirs(mnt, exist_ok=True)
        pw = run.passfile
        if cfg.init:
            sh(run.plyfs, "init", lower, "--layer", "crypt", "--passfile", pw, "--kdf-memory", "1024", *cfg.init_args,
               timeout=120)
        elif cfg.kind == "gocryptfs":
            sh("gocryptfs", "-init", "-q", "-extpass", f"cat {pw}", "-scryptn", "10", lower, timeout=120)
        try:
            self.up()
        except BaseException:
            self.down()  # what `up` started before it failed (a server, a half-made mount)
            raise

    def up(self):
        c, pw = self.cfg, self.run.passfile
        if c.start:
            self.run.mounted.add(self.mnt)
            c.start(self)
            return
        if c.kind == "native":
            return
        self.run.mounted.add(self.mnt)
        if c.kind == "bindfs":
            sh("bindfs", self.lower, self.mnt, timeout=60)
        elif c.kind == "gocryptfs":
            sh("gocryptfs", "-q", "-extpass", f"cat {pw}", self.lower, self.mnt, timeout=60)
        else:
            args = [self.run.plyfs, "mount", self.lower, self.mnt, "--stack", c.stack]
            for o in c.options:
                args += ["-o", o]
            if c.init:
                args += ["--passfile", pw]
            args += [a.replace("{work}", self.run.work) for a in c.args]
            if c.pin is not None:
                args = ["taskset", "-c", str(c.pin)] + args
            p = subprocess.run(args, capture_output=True, text=True, timeout=60)
            if p.returncode != 0:
                raise BenchError(f"{c.name}: mount failed: {p.stderr.strip()}")
            if c.uring and "requests over io_uring" not in p.stderr:
                raise BenchError(f"{c.name}: the mount did not get io_uring: {p.stderr.strip()}")

    def down(self):
        if self.cfg.kind != "native" or self.cfg.start:
            unmount(self.run.plyfs, self.mnt, self.cfg.kind)
            self.run.mounted.discard(self.mnt)
        if self.cfg.stop:
            self.cfg.stop(self)

    def remount(self):
        """Unmount, drop the caches and mount again: what follows runs cold."""
        self.down()
        drop_caches()
        self.up()


def unmount(plyfs_bin, mnt, kind):
    if not is_mounted(mnt):
        return
    tries = [[plyfs_bin, "umount", mnt]] if kind == "plyfs" else [["fusermount3", "-u", mnt], ["umount", mnt]]
    tries += [["fusermount3", "-uz", mnt], ["umount", "-l", mnt]]
    for cmd in tries:
        if shutil.which(cmd[0]) is None:  # e.g. no fusermount3 where only FUSE 2's tools are installed
            continue
        if subprocess.run(cmd, capture_output=True, timeout=60).returncode == 0 and not is_mounted(mnt):
            break
    if kind != "plyfs":
        time.sleep(0.2)  # other FUSE daemons return before they let go of the lower


# --- Lowers -------------------------------------------------------------------------------------


class Lower:
    """Fresh lower directories of one kind: `tmpfs` (a tmpfs mounted for each measurement) or
    `ext4` (a directory on the disk under BENCH_OUT, caches dropped before each measurement)."""

    def __init__(self, kind, work):
        self.kind, self.work, self.n = kind, work, 0
        if kind == "ext4":
            fs = sh("stat", "-f", "-c", "%T", work).strip()
            if fs == "tmpfs":
                raise BenchError(f"--lower ext4: {work} is on tmpfs; set BENCH_OUT to a directory on the disk")
        self.current = None

    def fresh(self):
        self.release()
        self.n += 1
        path = os.path.join(self.work, f"lower{self.n}")
        os.makedirs(path)
        if self.kind == "tmpfs":
            sh("mount", "-t", "tmpfs", "-o", "size=6g", "tmpfs", path)
        self.current = path
        drop_caches()
        return path

    def close(self):
        """The run is over: nothing of this kind of lower is needed any more."""

    def release(self):
        path, self.current = self.current, None
        if path is None:
            return
        if self.kind == "tmpfs":
            # A FUSE daemon may hold the lower for a moment after its unmount returns.
            for _ in range(100):
                if subprocess.run(["umount", path], capture_output=True).returncode == 0:
                    break
                time.sleep(0.1)
            else:
                subprocess.run(["umount", "-l", path], capture_output=True)
        shutil.rmtree(path, ignore_errors=True)


# --- Declarations -------------------------------------------------------------------------------


@dataclass
class Metric:
    key: str
    label: str
    unit: str  # "s", "MiB/s", "IOPS", "B"
    better: str = "lower"  # or "higher"


@dataclass
class Scenario:
    """Workloads that run one after another in one mounted configuration.

    `run(m, ctx)` returns {metric key: value}; `check(m, ctx)`, if given, runs in the first
    repetition after `run` and raises BenchError when the data read back is wrong."""

    name: str
    title: str
    configs: list
    metrics: list
    run: Callable
    baseline: str = "native"
    check: Optional[Callable] = None
    note: str = ""
    lower: Optional[str] = None  # where it runs unless --lower says otherwise; default: the suite's
    # One run measures every configuration at once (a tool that interleaves them itself): `run`
    # gets the first configuration's mount and returns {"CONFIG/metric": value}.
    together: bool = False


@dataclass
class Target:
    """`config`'s `metric` against `against` (a configuration), as a ratio of values (times or
    rates as they are), compared with `value` by `op` ("<=" or ">="). `derive`, if given,
    measures instead: called with `v(scenario, config, metric)` (a median, or None), it returns
    `(number, text)`, or None when not measured; `unit` names the number in the required column."""

    text: str
    scenario: str
    metric: str
    config: str
    against: str
    op: str
    value: float
    derive: Optional[Callable] = None
    unit: str = "×"
    on: Optional[tuple] = None  # the lowers it is judged on (default: every lower)


@dataclass
class Suite:
    name: str
    title: str
    intro: str
    scenarios: list
    targets: list = field(default_factory=list)
    runs: int = 5
    lower: str = "tmpfs"
    needs: tuple = ()  # commands the suite needs: "cmd" or "cmd:debian-package"
    main_chart: Optional[str] = None  # the scenario whose chart the README shows
    files: dict = field(default_factory=dict)  # written into the scratch directory first
    lowers: dict = field(default_factory=dict)  # more kinds of lower: name -> class like Lower
    cleanup: Optional[Callable] = None  # called once when the run ends, however it ends
    prepare: Optional[Callable] = None  # called with the run before anything is measured


def ratio_of(scenario, a, b, unit):
    """A `derive` for a target comparing two measurements of one scenario, each `(config,
    metric)`: `a` over `b`."""
    def derive(v):
        x, y = v(scenario, *a), v(scenario, *b)
        return (x / y, f"{ratio_text(x / y)} ({fmt(x, unit)} / {fmt(y, unit)} {unit})") if x is not None and y else None
    return derive


def excess_of(scenario, a, b, unit):
    """The same, `a` minus `b`."""
    def derive(v):
        x, y = v(scenario, *a), v(scenario, *b)
        return (x - y, f"{x - y:+.1f} {unit} ({fmt(x, unit)} / {fmt(y, unit)} {unit})") if x and y else None
    return derive


def per_layer(one, eight, scenarios):
    """The worst added time per layer, (t8 - t1) / 7 / t1, over the scenarios' workloads; for
    rates, t = 1 / rate."""
    def derive(v):
        worst = None
        for sc, keys, rate in scenarios:
            for k in keys:
                a, b = v(sc, one, k), v(sc, eight, k)
                if not (a and b):
                    continue
                if rate:
                    a, b = 1 / a, 1 / b
                per = (b - a) / 7 / a * 100
                if worst is None or per > worst[0]:
                    worst = (per, k)
        return None if worst is None else (worst[0], f"{worst[0]:+.2f}% per layer ({worst[1]})")
    return derive


# --- Running ------------------------------------------------------------------------------------


class Run:
    def __init__(self, suite: Suite, args):
        self.suite, self.args = suite, args
        self.mounted = set()
        self.ctx = {"quick": args.quick}
        self.unavailable = {}  # configuration name -> why it was left out (Config.available)
        self.ran_on = set()  # (lower, scenario) pairs run

    def prepare(self):
        install_missing(("fio", "bindfs", "gocryptfs", "tar") + tuple(self.suite.needs))
        out = os.environ.get("BENCH_OUT", os.path.join(REPO, "bench-out"))
        os.makedirs(out, exist_ok=True)
        self.work = tempfile.mkdtemp(prefix=f"{self.suite.name}-", dir=out)
        self.rev = git_rev()
        if os.environ.get("PLYFS_BIN"):
            self.plyfs = os.environ["PLYFS_BIN"]
        else:
            log("building plyfs (cargo build --release)")
            subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=REPO, check=True)
            self.plyfs = os.path.join(self.work, "plyfs")
            target = os.path.join(REPO, os.environ.get("CARGO_TARGET_DIR") or "target")  # an absolute one stays
            shutil.copy(os.path.join(target, "release/plyfs"), self.plyfs)
        self.passfile = os.path.join(self.work, "password")
        with open(self.passfile, "w") as f:
            f.write(PASSWORD)
        for name, text in self.suite.files.items():
            with open(os.path.join(self.work, name), "w") as f:
                f.write(text)
        if self.suite.prepare:
            try:
                self.suite.prepare(self)
            except BaseException:
                if self.suite.cleanup:
                    self.suite.cleanup()  # what it started before it failed
                raise
        self.ctx.update(work=self.work, plyfs=self.plyfs)

    def execute(self):
        suite, args = self.suite, self.args
        runs = args.runs or (2 if args.quick else suite.runs)
        chosen = [s for s in suite.scenarios if not args.only or s.name in args.only]

        def where(sc):
            if args.lower:
                return ["tmpfs", "ext4"] if args.lower == "both" else [args.lower]
            own = sc.lower or suite.lower
            return ["tmpfs", "ext4"] if own == "both" else [own]

        kinds = ["tmpfs", "ext4", *suite.lowers]
        lowers = [k for k in kinds if any(k in where(s) for s in chosen)]
        uring_was = None
        if any(c.uring for s in suite.scenarios for c in s.configs):
            uring_was = open(URING_PARAM).read().strip() if os.path.exists(URING_PARAM) else None
            if uring_was is not None:
                open(URING_PARAM, "w").write("1")
        values = {}  # (lower, scenario, config, metric) -> [values]
        failures = []
        opened = []
        started = time.time()
        try:
            for lower_kind in lowers:
                try:
                    lower = suite.lowers[lower_kind](self.work) if lower_kind in suite.lowers else Lower(lower_kind, self.work)
                except (BenchError, OSError, subprocess.SubprocessError) as e:
                    # The lower cleans up after itself; the other lowers' results stand.
                    failures.append(f"{lower_kind}: the lower could not be made: {e}")
                    log(f"FAILED {failures[-1]}")
                    continue
                opened.append(lower)
                mnt = os.path.join(self.work, "mnt")
                for rep in range(runs):
                    for sc in chosen:
                        if lower_kind not in where(sc):
                            continue
                        n = 1 if sc.together else len(sc.configs)
                        self.ran_on.add((lower_kind, sc.name))
                        for i in range(n):
                            cfg = sc.configs[(i + rep) % n]
                            if self.left_out(cfg):
                                continue
                            try:
                                got = self.measure(sc, cfg, lower, mnt, first=rep == 0)
                            except (BenchError, OSError, subprocess.SubprocessError, ValueError, KeyError, UnicodeError) as e:
                                failures.append(f"{lower_kind}, {sc.name}, {cfg.name}, repetition {rep + 1}: {e}")
                                log(f"FAILED {failures[-1]}")
                                continue
                            for k, v in got.items():
                                c, _, k = k.rpartition("/") if sc.together else (cfg.name, "", k)
                                values.setdefault((lower_kind, sc.name, c, k), []).append(v)
                    log(f"{suite.name} on {lower_kind}: repetition {rep + 1}/{runs} done")
        finally:
            for m in list(self.mounted):
                unmount(self.plyfs, m, "plyfs")
            for lower in opened:
                lower.release()
                lower.close()
            if suite.cleanup:
                suite.cleanup()
            if uring_was is not None:
                open(URING_PARAM, "w").write("1" if uring_was == "Y" else "0")
        self.values, self.failures, self.runs, self.lowers = values, failures, runs, lowers
        self.minutes = (time.time() - started) / 60

    def left_out(self, cfg):
        """Whether `cfg` cannot be measured with this plyfs (asked once per run)."""
        if cfg.available is None:
            return False
        if cfg.name not in self.unavailable:
            try:
                why = cfg.available(self)
            except (BenchError, OSError, subprocess.SubprocessError) as e:
                why = f"the check failed: {e}"
            self.unavailable[cfg.name] = why
            if why:
                log(f"{cfg.name}: not available yet: {why}")
        return bool(self.unavailable[cfg.name])

    def measure(self, sc, cfg, lower, mnt, first):
        path = lower.fresh()
        m = Mounted(self, cfg, path, mnt)
        try:
            got = sc.run(m, self.ctx)
            if first and sc.check:
                sc.check(m, self.ctx)
            return got
        finally:
            m.down()
            lower.release()


def install_missing(tools):
    need = []
    for t in tools:
        cmd, _, pkg = t.partition(":")
        if shutil.which(cmd) is None:
            need.append(pkg or cmd)
    if need:
        log(f"installing {' '.join(need)}")
        subprocess.run(["apt-get", "update", "-q"], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["apt-get", "install", "-y", "-q", *need], check=True, stdout=subprocess.DEVNULL,
                       env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))


def git_rev():
    rev = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--", "crates", "Cargo.toml", "Cargo.lock"],
                           capture_output=True, text=True).stdout.strip()
    return (rev or "unknown") + (" + uncommitted changes" if dirty else "")


# --- Reporting ----------------------------------------------------------------------------------


def fmt(v, unit):
    if unit == "s":
        return f"{v:.3f}" if v < 10 else f"{v:.1f}"
    if unit == "B" or v >= 1000:
        return f"{v:,.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.3g}"


def ratio_text(r):
    return f"{r:.2f}×" if r < 10 else f"{r:.1f}×"


class Report:
    def __init__(self, run: Run, charts=True):
        self.run, self.suite, self.draw = run, run.suite, charts
        self.med = {k: statistics.median(v) for k, v in run.values.items()}
        self.spread = {k: (max(v) - min(v)) / statistics.median(v) if statistics.median(v) else 0
                       for k, v in run.values.items() if len(v) > 1}
        self.date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        self.charts = []

    def value(self, lower, sc, cfg, metric):
        return self.med.get((lower, sc, cfg, metric))

    def judge(self, t: Target, lower):
        """(measured text, number, passed) for target `t` on `lower`, or None if not measured."""
        derive = t.derive
        if derive is None:
            unit = next((m.unit for s in self.suite.scenarios if s.name == t.scenario for m in s.metrics if m.key == t.metric), "")
            derive = ratio_of(t.scenario, (t.config, t.metric), (t.against, t.metric), unit)
        got = derive(lambda sc, cfg, metric: self.value(lower, sc, cfg, metric))
        if got is None:
            return None
        number, shown = got
        passed = number <= t.value if t.op == "<=" else number >= t.value
        return shown, number, passed

    def markdown(self, command):
        run, suite = self.run, self.suite
        cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        out = [f"{suite.intro}\n", f"### Results of {self.date}\n",
               f"- command: `{command}` ({run.minutes:.0f} min)",
               f"- plyfs: {run.rev}",
               f"- machine: {cpu}, {os.cpu_count()} CPUs, {mem:.0f} GiB RAM; kernel {platform.release()}",
               f"- lower: {' and '.join(describe_lower(l, suite) for l in run.lowers)}",
               f"- runs: {run.runs} per measurement, median reported; every repetition runs each configuration once, "
               f"in an order rotated by one per repetition",
               "", "Configurations:", ""]
        seen = {}
        for sc in suite.scenarios:
            for c in sc.configs:
                seen.setdefault(c.name, c)
        out += [f"- `{c.name}`: {c.describe()}" + (f" — **not available yet**: {run.unavailable[c.name]}"
                                                   if run.unavailable.get(c.name) else "")
                for c in seen.values()]
        out.append("")
        for lower in run.lowers:
            suffix = f" ({lower} lower)" if len(run.lowers) > 1 else ""
            if suite.targets:
                out += self.targets_table(lower, suffix)
            for sc in suite.scenarios:
                if any(k[0] == lower and k[1] == sc.name for k in self.med):
                    out += self.scenario_table(lower, sc, suffix)
        if run.failures:
            out += ["### Failures", ""] + [f"- {f}" for f in run.failures] + [""]
        return "\n".join(out) + "\n"

    def targets_table(self, lower, suffix):
        rows, passed, missed = [], 0, 0
        history = load_history(self.suite.name)[-6:]
        for t in self.suite.targets:
            if t.on and lower not in t.on:
                continue
            j = self.judge(t, lower)
            missing = [c for c in (t.config, t.against) if self.run.unavailable.get(c)]
            if j is None and missing and self.ran(t.scenario, lower):
                rows.append(f"| {t.text} | not available yet (`{missing[0]}`, see the configurations) | {required(t)} | – | |")
                continue
            if j is None and not any(k[0] == lower and k[1] == t.scenario for k in self.med):
                continue  # its scenario did not run on this lower
            if j is None:
                rows.append(f"| {t.text} | not measured | {required(t)} | – | |")
                continue
            shown, _, ok = j
            passed, missed = passed + ok, missed + (not ok)
            before = " · ".join(f"{h['targets'].get(lower, {}).get(t.text, '–')}" for h in history
                                if h["targets"].get(lower, {}).get(t.text) is not None)
            rows.append(f"| {t.text} | {shown} | {required(t)} | {'PASS' if ok else 'MISS'} | {before} |")
        return ([f"#### Targets{suffix}: {passed} PASS, {missed} MISS", "",
                 "The last column: the same ratio in earlier runs of this suite (`bench/history/`), oldest first.", "",
                 "| target | measured (median) | required | result | earlier runs |", "| --- | --- | --- | --- | --- |"]
                + rows + [""])

    def ran(self, scenario, lower):
        """Whether `scenario` was run on `lower` (if only to find its configurations left out)."""
        return (lower, scenario) in self.run.ran_on

    def scenario_table(self, lower, sc: Scenario, suffix):
        cfgs = [c.name for c in sc.configs if any(k[:3] == (lower, sc.name, c.name) for k in self.med)]
        out = [f"#### {sc.title}{suffix}", ""]
        if sc.note:
            out += [sc.note, ""]
        left = [c.name for c in sc.configs if self.run.unavailable.get(c.name)]
        if left:
            out += ["Not available yet, so not measured: " + ", ".join(f"`{c}`" for c in left) + " (see the configurations).", ""]
        out += [f"Median; in brackets the ratio to `{sc.baseline}`; spread ((max − min) / median) in the last column.", "",
                "| workload | unit | " + " | ".join(f"`{c}`" for c in cfgs) + " | spread |",
                "| --- | --- |" + " ---: |" * len(cfgs) + " --- |"]
        for m in sc.metrics:
            base = self.value(lower, sc.name, sc.baseline, m.key)
            cells = []
            for c in cfgs:
                v = self.value(lower, sc.name, c, m.key)
                if v is None:
                    cells.append("–")
                elif c == sc.baseline or not base:
                    cells.append(fmt(v, m.unit))
                else:
                    cells.append(f"{fmt(v, m.unit)} ({ratio_text(v / base)})")
            spreads = [self.spread.get((lower, sc.name, c, m.key)) for c in cfgs]
            worst = max((s for s in spreads if s is not None), default=None)
            spread = "–" if worst is None else f"≤ {worst * 100:.0f}%"
            out.append(f"| {m.label} | {m.unit}, {m.better} is better | " + " | ".join(cells) + f" | {spread} |")
        chart = self.chart(lower, sc, cfgs)
        if chart:
            out += ["", f"![{sc.title}]({chart})"]
        return out + [""]

    def chart(self, lower, sc, cfgs):
        """A bar chart of the ratios to the baseline: docs/charts/SUITE-SCENARIO[-LOWER].png."""
        if not self.draw:
            return None
        plt = pyplot()
        if plt is None:
            return None
        metrics = [m for m in sc.metrics if self.value(lower, sc.name, sc.baseline, m.key)]
        others = [c for c in cfgs if c != sc.baseline]
        if not metrics or not others:
            return None
        fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(metrics) * max(1, len(others)) / 3 + 3), 3.6))
        width = 0.8 / len(others)
        top = 0
        for i, c in enumerate(others):
            ys = []
            for m in metrics:
                v, base = self.value(lower, sc.name, c, m.key), self.value(lower, sc.name, sc.baseline, m.key)
                ys.append(0 if v is None else (v / base if m.better == "lower" else base / v))
            top = max(top, *ys)
            xs = [j + (i - (len(others) - 1) / 2) * width for j in range(len(metrics))]
            ax.bar(xs, ys, width, label=c)
        ax.axhline(1, color="black", linewidth=0.8)
        if top > 20:
            ax.set_yscale("log")
        ax.set_xticks(range(len(metrics)), [m.label for m in metrics])
        ax.set_ylabel(f"time relative to {sc.baseline} (lower is better)")
        ax.set_title(f"{sc.title} — {lower} lower, {self.date[:10]}", fontsize=10)
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
        fig.tight_layout()
        name = f"{self.suite.name}-{sc.name}" + ("" if lower == self.run.lowers[0] else f"-{lower}") + ".png"
        os.makedirs(CHARTS, exist_ok=True)
        fig.savefig(os.path.join(CHARTS, name), dpi=90)
        plt.close(fig)
        self.charts.append(name)
        return f"charts/{name}"

    def history_entry(self, command):
        targets = {}
        for lower in self.run.lowers:
            for t in self.suite.targets:
                j = self.judge(t, lower) if not t.on or lower in t.on else None
                if j is not None:
                    targets.setdefault(lower, {})[t.text] = round(j[1], 3)
        medians = {"/".join(k): round(v, 6) for k, v in self.med.items()}
        return {"date": self.date, "plyfs": self.run.rev, "command": command, "runs": self.run.runs,
                "targets": targets, "medians": medians}


def required(t):
    return f"{'≤' if t.op == '<=' else '≥'} {t.value:g}{t.unit}"


def describe_lower(kind, suite):
    if kind in suite.lowers:
        return suite.lowers[kind].about
    return "a fresh tmpfs for each measurement" if kind == "tmpfs" else "a fresh directory on the disk (ext4), caches dropped"


def pyplot():
    try:
        import matplotlib
    except ImportError:
        log("installing matplotlib for the charts (pip install matplotlib)")
        if subprocess.run([sys.executable, "-m", "pip", "install", "-q", "matplotlib"]).returncode != 0:
            log("no charts: matplotlib could not be installed")
            return None
        import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def load_history(suite):
    path = os.path.join(HISTORY, f"{suite}.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def append_history(suite, entry):
    os.makedirs(HISTORY, exist_ok=True)
    with open(os.path.join(HISTORY, f"{suite}.jsonl"), "a") as f:
        f.write(json.dumps(entry, ensure_ascii=False) + "\n")


def write_doc_section(marker, title, report):
    """Put `report` between the MARKER begin/end comments of docs/benchmarks.md, or append it
    under a new heading `title`."""
    doc = DOC
    text = open(doc).read()
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    section = f"{begin}\n{report}{end}"
    if begin in text:
        text = text[:text.index(begin)] + section + text[text.index(end) + len(end):]
    else:
        text += f"\n## {title}\n\n{section}\n"
    open(doc, "w").write(text)


def run_suite(suite: Suite, args, command):
    if os.geteuid() != 0:
        sys.exit(f"bench: {suite.name} needs root (tmpfs lowers, dropping caches, passthrough)")
    # SIGTERM and SIGHUP end the run like Ctrl-C, through the cleanup.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    run = Run(suite, args)
    run.prepare()
    try:
        run.execute()
    finally:
        if not args.keep:
            shutil.rmtree(run.work, ignore_errors=True)
    writes = not args.no_write_doc and not args.only
    report = Report(run, charts=writes)
    text = report.markdown(command)
    raw = os.path.join(os.path.dirname(run.work), f"{suite.name}.json")
    with open(raw, "w") as f:
        json.dump({"/".join(k): v for k, v in run.values.items()}, f, indent=1)
    print(text)
    if writes:
        write_doc_section(suite.name, suite.title, text)
        append_history(suite.name, report.history_entry(command))
        log(f"docs/benchmarks.md ({suite.name} section), bench/history/{suite.name}.jsonl and "
            f"{len(report.charts)} chart(s) in docs/charts/ updated")
    return 1 if run.failures else 0
