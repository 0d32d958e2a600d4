#!/usr/bin/env python3
"""Fail when the rules or the dashboard use a cardworker metric the binary does not export.

    python3 deploy/check_metric_names.py SCRAPE.txt

SCRAPE.txt is the text of a worker's GET /metrics. Every `cardworker_*` metric name in the
`expr` fields of deploy/prometheus/rules.yml and in the `expr` fields of
deploy/grafana/cardworker.json must appear in it (as a `# TYPE` line or as a sample). Histogram
suffixes `_bucket`, `_sum`, `_count` are stripped. Recording-rule names (`cardworker:...`) and the
unit-test input series in rules_test.yml are not checked.

Note: a labelled metric appears in a scrape only once it has been touched; the binary must
register (describe and zero-initialise) every metric at start-up for this check to be meaningful.
"""
import json
import pathlib
import re
import sys

import yaml  # PyYAML (in the lint venv; also a dependency of yamllint)

DEPLOY = pathlib.Path(__file__).resolve().parent
RULES = DEPLOY / "prometheus" / "rules.yml"
DASHBOARD = DEPLOY / "grafana" / "cardworker.json"

NAME = re.compile(r"(?<![A-Za-z0-9_:])cardworker_[A-Za-z0-9_]+")
SUFFIXES = ("_bucket", "_sum", "_count")


def exprs_from_rules(path):
    doc = yaml.safe_load(path.read_text())
    for group in doc.get("groups", []):
        for rule in group.get("rules", []):
            yield rule["expr"]


def exprs_from_dashboard(path):
    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "expr" and isinstance(value, str):
                    yield value
                else:
                    yield from walk(value)
        elif isinstance(node, list):
            for item in node:
                yield from walk(item)
    yield from walk(json.loads(path.read_text()))


def base(name):
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def used_names():
    used = {}
    for source, exprs in ((RULES, exprs_from_rules(RULES)), (DASHBOARD, exprs_from_dashboard(DASHBOARD))):
        for expr in exprs:
            for name in NAME.findall(expr):
                used.setdefault(name, set()).add(source.relative_to(DEPLOY.parent).as_posix())
    return used


def exported_names(scrape_text):
    names = set()
    for line in scrape_text.splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split()
            if len(parts) >= 3 and parts[1] in ("TYPE", "HELP"):
                names.add(parts[2])
            continue
        match = re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", line)
        if match:
            names.add(match.group(0))
    return names | {base(n) for n in names}


def main(argv):
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    exported = exported_names(pathlib.Path(argv[1]).read_text())
    used = used_names()
    missing = sorted(n for n in used if n not in exported and base(n) not in exported)
    if missing:
        print(f"metric names used but not exported by the scrape {argv[1]}:", file=sys.stderr)
        for name in missing:
            print(f"  {name}  (used in {', '.join(sorted(used[name]))})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
