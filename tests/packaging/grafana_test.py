"""config/grafana/steptrace.json: a dashboard Grafana can import, whose every query is
PromQL that promtool accepts, that reads the recording rules of
config/prometheus/steptrace.rules.yml (only rules defined there) and otherwise only
series a steptraced exposes (DASHBOARD_INPUTS, which prometheus_test.py checks against a
live daemon), and that the install puts beside the Prometheus files."""
import json
import os
import re
import unittest

from packaging_util import SOURCE_DIR, TempDirTestCase, check_run, run, tool
from prometheus_test import DASHBOARD_INPUTS, PROM_DIR

DASHBOARD = os.path.join(SOURCE_DIR, "config/grafana/steptrace.json")
RULES = os.path.join(PROM_DIR, "steptrace.rules.yml")

# Series Prometheus itself makes, which a panel or annotation may read.
PROMETHEUS_SERIES = {"ALERTS", "ALERTS_FOR_STATE", "up", "scrape_duration_seconds"}

# What the check puts in place of Grafana's variables: the dashboard's own ("$node",
# "${job_id}", "${job_id:regex}"...) and Grafana's built-in ones.
VARIABLE_VALUES = {
    "node": "gpu-node-01",
    "job_id": "llama-7b",
    "step": "Forward",
    "compute_steps": "Matmul",
    "overhead_steps": "Transpose|Alloc",
    "__rate_interval": "1m",
    "__rate_interval_ms": "60000",
    "__interval": "30s",
    "__interval_ms": "30000",
    "__range": "3h",
    "__range_s": "10800",
    "__range_ms": "10800000",
}
VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)(?::\w+)?\]\]")

PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
                   "unless", "bool", "offset", "inf", "nan", "atan2"}


def load_dashboard():
    with open(DASHBOARD) as f:
        return json.load(f)


def all_panels(dashboard):
    """Every panel, those inside collapsed rows included."""
    out = []
    for panel in dashboard.get("panels", []):
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def variable_query_promql(variable):
    """The PromQL of a query variable: label_values(EXPR, label) and query_result(EXPR)
    hold some; label_values(label), label_names() and metrics(re) hold none."""
    query = variable.get("query", "")
    if isinstance(query, dict):
        query = query.get("query", "")
    query = query.strip()
    m = re.fullmatch(r"label_values\((.*),\s*\w+\s*\)", query, re.S)
    if m:
        return m.group(1).strip()
    m = re.fullmatch(r"query_result\((.*)\)", query, re.S)
    if m:
        return m.group(1).strip()
    return None


def dashboard_queries(dashboard):
    """[(where, expr)] for every PromQL expression of the dashboard: panel targets,
    annotations and query variables."""
    out = []
    for panel in all_panels(dashboard):
        for n, target in enumerate(panel.get("targets", [])):
            if target.get("expr", "").strip():
                out.append((f"panel_{panel['id']}_{n}", target["expr"]))
    for n, annotation in enumerate(dashboard.get("annotations", {}).get("list", [])):
        if annotation.get("expr", "").strip():
            out.append((f"annotation_{n}", annotation["expr"]))
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            expr = variable_query_promql(variable)
            if expr:
                out.append((f"variable_{variable['name']}", expr))
    return out


def substitute(expr):
    """expr with every Grafana variable replaced by a concrete value."""
    def value(m):
        name = next(g for g in m.groups() if g)
        if name not in VARIABLE_VALUES:
            raise AssertionError(f"${name} in {expr!r}: not a variable of the dashboard "
                                 f"(or add a value for it to VARIABLE_VALUES)")
        return VARIABLE_VALUES[name]
    return VARIABLE.sub(value, expr)


def referenced_variables(expr):
    return {next(g for g in m.groups() if g) for m in VARIABLE.finditer(expr)}


def series_names(expr):
    """Metric and recording-rule names an expression reads (after substitution)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)
    s = re.sub(r"\{[^}]*\}", "", s)       # label matchers
    s = re.sub(r"\[[^\]]*\]", "", s)      # ranges and subqueries
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r"\1", s)
    s = re.sub(r"\b(by|without)\b", "", s)  # "sum by (l) (x)" -> "sum (x)": a call
    names = set()
    for m in re.finditer(r"(?<![\w:.])([A-Za-z_:][\w:]*)(\s*\()?", s):
        if m.group(2) or m.group(1) in PROMQL_KEYWORDS:
            continue  # a function or aggregation, or a keyword
        names.add(m.group(1))
    return names


def defined_rules():
    with open(RULES) as f:
        return set(re.findall(r"^\s*-\s*record:\s*(\S+)\s*$", f.read(), re.M))


def defined_alerts():
    with open(RULES) as f:
        return set(re.findall(r"^\s*-\s*alert:\s*(\S+)\s*$", f.read(), re.M))


def straggler_thresholds():
    """The ratios to the median past which SteptraceStragglerRank fires: (above, below)."""
    with open(RULES) as f:
        text = f.read()
    start = text.index("- alert: SteptraceStragglerRank")
    expr = text[start:text.index("for:", start)]
    above = {float(m) for m in re.findall(r"ratio_median[15]m(?:\{[^}]*\})? > ([\d.]+)", expr)}
    below = {m for m in re.findall(r"ratio_median[15]m(?:\{[^}]*\})? < ([\d. /]+?)\n", expr)}
    assert len(above) == 1 and len(below) == 1, (above, below)
    num, _, den = below.pop().partition("/")
    return above.pop(), float(num) / float(den or 1)


class DashboardStructureTest(unittest.TestCase):
    def setUp(self):
        self.dashboard = load_dashboard()

    def test_is_a_dashboard(self):
        d = self.dashboard
        self.assertIsInstance(d, dict)
        self.assertEqual(d["uid"], "steptrace")
        self.assertTrue(d["title"])
        self.assertGreaterEqual(d["schemaVersion"], 36)
        self.assertIsNone(d.get("id"))  # an id belongs to one Grafana's database
        self.assertTrue(all_panels(d))

    def test_every_panel_queries_something(self):
        ids = [p.get("id") for p in all_panels(self.dashboard)]
        self.assertEqual(len(ids), len(set(ids)), f"panel ids not unique: {ids}")
        self.assertTrue(all(isinstance(i, int) for i in ids), ids)
        for panel in all_panels(self.dashboard):
            with self.subTest(panel=panel.get("title")):
                self.assertTrue(panel.get("title"))
                gp = panel["gridPos"]
                self.assertTrue(0 <= gp["x"] and gp["w"] >= 1 and gp["x"] + gp["w"] <= 24, gp)
                if panel["type"] == "row":
                    continue
                targets = panel.get("targets", [])
                self.assertTrue(targets)
                self.assertTrue(all(t.get("expr", "").strip() for t in targets), targets)
                refs = [t.get("refId") for t in targets]
                self.assertEqual(len(refs), len(set(refs)), refs)

    def test_panels_do_not_overlap(self):
        cells = {}
        for panel in self.dashboard["panels"]:
            gp = panel["gridPos"]
            for x in range(gp["x"], gp["x"] + gp["w"]):
                for y in range(gp["y"], gp["y"] + gp["h"]):
                    self.assertNotIn((x, y), cells,
                                     f"{panel['title']} overlaps {cells.get((x, y))}")
                    cells[(x, y)] = panel["title"]

    def test_datasource_is_chosen_on_import(self):
        variables = {v["name"]: v for v in self.dashboard["templating"]["list"]}
        self.assertEqual(variables["datasource"]["type"], "datasource")
        self.assertEqual(variables["datasource"]["query"], "prometheus")
        # Every datasource reference, wherever it is, names the variable, not one uid.
        found = []

        def walk(node, where):
            if isinstance(node, dict):
                for key, value in node.items():
                    if key == "datasource":
                        found.append((where, value))
                    else:
                        walk(value, f"{where}.{key}")
            elif isinstance(node, list):
                for i, value in enumerate(node):
                    walk(value, f"{where}[{i}]")
        walk(self.dashboard, "")
        self.assertTrue(found)
        for where, ds in found:
            with self.subTest(where=where):
                self.assertIsInstance(ds, dict)
                self.assertEqual(ds.get("type"), "prometheus")
                self.assertIn(ds.get("uid"), ("${datasource}", "$datasource"))
        self.assertNotIn("__inputs", self.dashboard)

    def test_node_and_job_variables_come_from_recording_rules(self):
        variables = {v["name"]: v for v in self.dashboard["templating"]["list"]}
        for name in ("node", "job_id", "step"):
            with self.subTest(variable=name):
                v = variables[name]
                self.assertEqual(v["type"], "query")
                expr = variable_query_promql(v)
                self.assertIsNotNone(expr, v)
                self.assertTrue(all(":" in n for n in series_names(expr)), expr)
                # "All" must also match series without the label (no job id).
                self.assertEqual(v.get("allValue"), ".*")

    def test_variables_used_are_defined(self):
        defined = {v["name"] for v in self.dashboard["templating"]["list"]}
        for where, expr in dashboard_queries(self.dashboard):
            with self.subTest(where=where):
                self.assertEqual({n for n in referenced_variables(expr)
                                  if not n.startswith("__")} - defined, set(), expr)
                substitute(expr)  # no variable the check does not know

    def test_panels_read_only_defined_rules(self):
        rules = defined_rules()
        self.assertIn("cluster:steptrace_job_step_seconds:rate5m", rules)
        used = set()
        for where, expr in dashboard_queries(self.dashboard):
            names = {n for n in series_names(substitute(expr)) if ":" in n}
            with self.subTest(where=where):
                self.assertEqual(names - rules, set(), expr)
            used |= names
        self.assertIn("cluster:steptrace_job_step_seconds:rate5m", used)

    def test_panels_read_only_metrics_the_daemon_exposes(self):
        used = set()
        for where, expr in dashboard_queries(self.dashboard):
            names = {n for n in series_names(substitute(expr)) if ":" not in n}
            with self.subTest(where=where):
                self.assertEqual(names - set(DASHBOARD_INPUTS) - PROMETHEUS_SERIES, set(),
                                 f"{expr}: add the metric to DASHBOARD_INPUTS in "
                                 f"prometheus_test.py if steptraced exposes it")
            used |= names
        # The list stays exactly what the panels read (prometheus_test.py checks it
        # against a live daemon).
        self.assertEqual(set(DASHBOARD_INPUTS) - used, set())

    def test_alert_queries_name_defined_alerts(self):
        alerts = defined_alerts()
        self.assertIn("SteptraceStragglerRank", alerts)
        named = set()
        for where, expr in dashboard_queries(self.dashboard):
            for name in re.findall(r'alertname="(\w+)"', expr):
                with self.subTest(where=where):
                    self.assertIn(name, alerts, expr)
                named.add(name)
        self.assertIn("SteptraceStragglerRank", named)

    def test_ranks_row_shows_what_the_straggler_alert_reads(self):
        panels = all_panels(self.dashboard)
        rows = [p for p in panels if p["type"] == "row" and p["title"].startswith("Ranks")]
        self.assertEqual(len(rows), 1, [p["title"] for p in panels if p["type"] == "row"])
        row_y = rows[0]["gridPos"]["y"]
        next_row_y = min((p["gridPos"]["y"] for p in self.dashboard["panels"]
                          if p["type"] == "row" and p["gridPos"]["y"] > row_y), default=10**6)
        in_row = [p for p in self.dashboard["panels"]
                  if p["type"] != "row" and row_y < p["gridPos"]["y"] < next_row_y]
        exprs = {p["title"]: " ".join(t["expr"] for t in p["targets"]) for p in in_row}
        reads = set().union(*(series_names(substitute(e)) for e in exprs.values()))
        for rule in ("rank:steptrace_job_rank_step_seconds:mean5m",
                     "job:steptrace_job_rank_step_seconds:median5m",
                     "rank:steptrace_job_rank_step_seconds:ratio_median5m", "ALERTS"):
            with self.subTest(rule=rule):
                self.assertIn(rule, reads)
        # Per rank: the panels keep the labels the alert names.
        for title, expr in exprs.items():
            if "rank:" in expr:
                with self.subTest(panel=title):
                    legends = " ".join(t.get("legendFormat", "") for t in
                                       next(p for p in in_row if p["title"] == title)["targets"])
                    for label in ("job_id", "uid", "rank", "step"):
                        self.assertIn(label, legends + expr)
        # The ratio panel draws the alert's thresholds, read from the rules.
        above, below = straggler_thresholds()
        ratio = [p for p in in_row if "ratio_median" in exprs[p["title"]]
                 and p["type"] == "timeseries"]
        self.assertEqual(len(ratio), 1)
        steps = [s["value"] for s in ratio[0]["fieldConfig"]["defaults"]["thresholds"]["steps"]
                 if s["value"] is not None]
        self.assertEqual(ratio[0]["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"],
                         "line")
        self.assertIn(above, steps)
        self.assertTrue(any(abs(v - below) < 0.001 for v in steps), (steps, below))
        # The rank panels follow the dashboard's job filter.
        for title, expr in exprs.items():
            if "rank:" in expr or "job:" in expr:
                with self.subTest(panel=title):
                    self.assertIn("$job_id", expr)

    def test_overhead_panel_takes_its_steps_from_the_rule_variables(self):
        # The 50% rule's steps are the operator's (issue 28): two textbox variables whose
        # defaults are the reference's, read by every query of the panel.
        variables = {v["name"]: v for v in self.dashboard["templating"]["list"]}
        for name, default in (("compute_steps", "Matmul"), ("overhead_steps", "Transpose|Alloc")):
            self.assertEqual(variables[name]["type"], "textbox", name)
            self.assertEqual(variables[name]["query"], default, name)
            self.assertEqual(variables[name]["current"]["value"], default, name)
        panels = [p for p in all_panels(self.dashboard) if p.get("title") == "CPU overhead ratio"]
        self.assertEqual(len(panels), 1)
        for target in panels[0]["targets"]:
            used = referenced_variables(target["expr"])
            self.assertIn("compute_steps", used, target["expr"])
            self.assertIn("overhead_steps", used, target["expr"])
            # Without compute time the ratio is left out (`> 0`), never 0/0.
            self.assertIn("> 0)", target["expr"])
            self.assertNotIn("Matmul", target["expr"])

    def test_job_legends_name_the_uid(self):
        # A job is (uid, job_id): two users' "llama" must not share a legend entry.
        for panel in all_panels(self.dashboard):
            for target in panel.get("targets", []):
                legend = target.get("legendFormat", "")
                if "{{job_id}}" in legend:
                    with self.subTest(panel=panel["title"]):
                        self.assertIn("{{uid}}", legend)

    def test_series_names_parser(self):
        self.assertEqual(series_names(
            'sum by (job_id, step) (rate(a_total{x="y:z"}[5m] offset 1h))'
            ' / on (job) group_left (v) b:c:d * 2 and bool histogram_quantile(0.9, e)'),
            {"a_total", "b:c:d", "e"})


class DashboardPromtoolTest(TempDirTestCase):
    def setUp(self):
        super().setUp()
        self.promtool = tool("promtool", "prometheus")

    def test_every_query_passes_promtool(self):
        queries = dashboard_queries(load_dashboard())
        self.assertGreater(len(queries), 20)
        # Every expression as a recording rule; JSON is YAML.
        rules = [{"record": f"dashboard:{where}", "expr": substitute(expr)}
                 for where, expr in queries]
        self.assertFalse([r for r in rules if "$" in r["expr"]])
        path = os.path.join(self.tmp, "dashboard.rules.yml")
        with open(path, "w") as f:
            json.dump({"groups": [{"name": "steptrace.dashboard", "rules": rules}]}, f,
                      indent=2)
        result = check_run(self, [self.promtool, "check", "rules", path])
        self.assertIn(f"SUCCESS: {len(rules)} rules found", result.stdout)

    def test_promtool_catches_a_broken_query(self):
        # The check above would fail on a bad expression (guards against a promtool that
        # accepts anything).
        path = os.path.join(self.tmp, "bad.rules.yml")
        with open(path, "w") as f:
            json.dump({"groups": [{"name": "bad", "rules": [
                {"record": "dashboard:bad", "expr": "sum by (node (x)"}]}]}, f)
        self.assertNotEqual(run([self.promtool, "check", "rules", path]).returncode, 0)


class DashboardInstallTest(TempDirTestCase):
    def test_installed_beside_the_prometheus_files(self):
        share = os.path.join(self.install_prefix(), "share/steptrace")
        self.assertTrue(os.path.isfile(os.path.join(share, "prometheus/steptrace.rules.yml")))
        for name in ("steptrace.json", "README.md"):
            with self.subTest(name=name):
                installed = os.path.join(share, "grafana", name)
                self.assertTrue(os.path.isfile(installed), installed)
                with open(installed, "rb") as a, \
                        open(os.path.join(SOURCE_DIR, "config/grafana", name), "rb") as b:
                    self.assertEqual(a.read(), b.read())


if __name__ == "__main__":
    unittest.main()
