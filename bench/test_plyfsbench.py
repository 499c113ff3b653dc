"""Tests of the benchmark harness without mounts: rotation, medians, failures, measurements made
together, targets, the report and the doc section. Run by scripts/test.sh (pytest); needs root
(dropping caches)."""
import os
import sys
import tempfile
import types
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plyfsbench as pb  # noqa: E402


class PlainLower(pb.Lower):
    about = "plain directories"

    def __init__(self, work):
        super().__init__("plain", work)


def args(**kw):
    a = dict(quick=False, runs=None, lower=None, only=None, keep=False, no_write_doc=True)
    a.update(kw)
    return types.SimpleNamespace(**a)


def run_of(suite, **kw):
    run = pb.Run(suite, args(**kw))
    run.work = tempfile.mkdtemp()
    run.plyfs, run.rev, run.passfile = "/bin/false", "test", os.path.join(run.work, "pw")
    run.ctx.update(work=run.work, plyfs=run.plyfs)
    run.execute()
    return run


class Harness(unittest.TestCase):
    def test_rotation_medians_and_failures(self):
        order = []
        times = {"a": [1.0, 3.0, 2.0], "b": [10.0, 30.0, 20.0], "c": [5.0, 5.0, 6.0]}

        def work(m, ctx):
            order.append(m.cfg.name)
            n = sum(1 for x in order if x == m.cfg.name) - 1
            if m.cfg.name == "c" and n == 1:
                raise pb.BenchError("c broke")
            return {"t": times[m.cfg.name][n]}

        sc = pb.Scenario("s", "S", [pb.native("a"), pb.native("b"), pb.native("c")], [pb.Metric("t", "t", "s")], run=work,
                         baseline="a", lower="plain")
        run = run_of(pb.Suite("x", "X", "", [sc], runs=3, lowers={"plain": PlainLower}))
        self.assertEqual(order, ["a", "b", "c", "b", "c", "a", "c", "a", "b"])
        med = pb.Report(run, charts=False).med
        self.assertEqual(med[("plain", "s", "a", "t")], 2.0)
        self.assertEqual(med[("plain", "s", "b", "t")], 20.0)
        self.assertEqual(med[("plain", "s", "c", "t")], 5.5)
        self.assertEqual(len(run.failures), 1)
        self.assertIn("c, repetition 2: c broke", run.failures[0])

    def test_together_splits_values_by_configuration(self):
        calls = []

        def tool(m, ctx):
            calls.append(m.cfg.name)
            return {"raw/ms": 1.0, "exo/ms": 1.5}

        sc = pb.Scenario("s", "S", [pb.native("raw"), pb.native("exo")], [pb.Metric("ms", "ms", "ms")], run=tool,
                         baseline="raw", lower="plain", together=True)
        run = run_of(pb.Suite("x", "X", "", [sc], runs=2, lowers={"plain": PlainLower}))
        self.assertEqual(calls, ["raw", "raw"])
        self.assertEqual(run.values[("plain", "s", "exo", "ms")], [1.5, 1.5])

    def test_targets_report_history_and_doc(self):
        sc = pb.Scenario("s", "S", [pb.native("a"), pb.native("b")],
                         [pb.Metric("t", "time", "s"), pb.Metric("r", "rate", "MiB/s", "higher")],
                         run=lambda m, ctx: {"t": 1.0 if m.cfg.name == "a" else 3.0, "r": 100.0 if m.cfg.name == "a" else 50.0},
                         lower="plain", baseline="a")
        targets = [pb.Target("b within 4× of a", "s", "t", "b", "a", "<=", 4),
                   pb.Target("b at least as fast as a", "s", "r", "b", "a", ">=", 1),
                   pb.Target("derived", "s", "", "", "", "<=", 10, unit="%", derive=lambda v: (12.5, "+12.5%")),
                   pb.Target("elsewhere", "other", "t", "b", "a", "<=", 1)]
        suite = pb.Suite("x", "X", "intro", [sc], targets=targets, runs=1, lowers={"plain": PlainLower})
        run = run_of(suite)
        with tempfile.TemporaryDirectory() as d:
            pb.HISTORY = d
            report = pb.Report(run, charts=False)
            text = report.markdown("bench/bench x")
            self.assertIn("1 PASS, 2 MISS", text)
            self.assertIn("| b within 4× of a | 3.00× (3.000 / 1.000 s) | ≤ 4× | PASS |", text)
            self.assertIn("| b at least as fast as a | 0.50× (50.0 / 100.0 MiB/s) | ≥ 1× | MISS |", text)
            self.assertIn("| derived | +12.5% | ≤ 10% | MISS |", text)
            self.assertNotIn("elsewhere", text, "a target whose scenario did not run is left out")
            self.assertIn("| time | s, lower is better | 1.000 | 3.000 (3.00×) |", text)
            pb.append_history("x", report.history_entry("bench/bench x"))
            again = pb.Report(run, charts=False).markdown("bench/bench x")
            self.assertIn("| ≤ 4× | PASS | 3.0 |", again, "the earlier run shows in the last column")
            doc = os.path.join(d, "benchmarks.md")
            with open(doc, "w") as f:
                f.write("before\n<!-- x:begin -->\nold\n<!-- x:end -->\nafter\n")
            pb.DOC = doc
            pb.write_doc_section("x", "X", "new\n")
            self.assertEqual(open(doc).read(), "before\n<!-- x:begin -->\nnew\n<!-- x:end -->\nafter\n")

    def test_configurations_not_available_are_left_out_and_reported(self):
        asked = []

        def available(run):
            asked.append(1)
            return "no such layer"

        later = pb.custom("later", "a layer still to come", start=lambda m: None, available=available)
        sc = pb.Scenario("s", "S", [pb.native("a"), later], [pb.Metric("t", "time", "s")],
                         run=lambda m, ctx: {"t": 1.0}, lower="plain", baseline="a")
        suite = pb.Suite("x", "X", "intro", [sc], targets=[pb.Target("later within 2× of a", "s", "t", "later", "a", "<=", 2)],
                         runs=2, lowers={"plain": PlainLower})
        run = run_of(suite)
        self.assertEqual(len(asked), 1, "asked once per run")
        self.assertEqual(run.failures, [])
        self.assertNotIn(("plain", "s", "later", "t"), run.values)
        with tempfile.TemporaryDirectory() as d:
            pb.HISTORY = d
            text = pb.Report(run, charts=False).markdown("bench/bench x")
        self.assertIn("| later within 2× of a | not available yet (`later`, see the configurations) | ≤ 2× | – | |", text)
        self.assertIn("- `later`: a layer still to come — **not available yet**: no such layer", text)
        self.assertIn("Not available yet, so not measured: `later`", text)

    def test_a_failed_start_stops_what_it_started(self):
        stopped = []

        def start(m):
            raise pb.BenchError("half started")

        cfg = pb.custom("c", "c", start=start, stop=lambda m: stopped.append(m.cfg.name))
        sc = pb.Scenario("s", "S", [cfg], [pb.Metric("t", "time", "s")], run=lambda m, ctx: {"t": 1.0}, lower="plain",
                         baseline="c")
        run = run_of(pb.Suite("x", "X", "", [sc], runs=1, lowers={"plain": PlainLower}))
        self.assertEqual(stopped, ["c"])
        self.assertIn("half started", run.failures[0])

    def test_every_suite_declares_known_configurations_and_metrics(self):
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import importlib
        for name in sorted(f[:-3] for f in os.listdir(os.path.join(os.path.dirname(__file__), "suites"))
                           if f.endswith(".py") and not f.startswith("_")):
            suite = importlib.import_module(f"suites.{name}").SUITE
            names = {sc.name: sc for sc in suite.scenarios}
            for sc in suite.scenarios:
                self.assertIn(sc.baseline, [c.name for c in sc.configs], f"{name}/{sc.name}: baseline")
            for t in suite.targets:
                self.assertIn(t.scenario, names, f"{name}: target '{t.text}' names no scenario")
                if t.derive is None:
                    sc = names[t.scenario]
                    self.assertIn(t.metric, [m.key for m in sc.metrics], f"{name}: target '{t.text}'")
                    for c in (t.config, t.against):
                        self.assertIn(c, [x.name for x in sc.configs], f"{name}: target '{t.text}'")


if __name__ == "__main__":
    unittest.main()
