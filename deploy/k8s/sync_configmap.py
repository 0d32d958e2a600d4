#!/usr/bin/env python3
"""Keep deploy/k8s/configmap.yaml in step with config/production.toml.

kustomize builds the real ConfigMap from config/production.toml (configMapGenerator in
kustomization.yaml). configmap.yaml is the same content as a plain manifest, for
`kubectl apply -f` users and for the offline schema check in deploy/lint.sh.

    python3 deploy/k8s/sync_configmap.py          # rewrite configmap.yaml
    python3 deploy/k8s/sync_configmap.py --check  # exit 1 when it has drifted
"""
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCE = ROOT / "config" / "production.toml"
TARGET = ROOT / "deploy" / "k8s" / "configmap.yaml"

HEADER = """\
# GENERATED from config/production.toml by deploy/k8s/sync_configmap.py -- do not edit by hand.
# kustomize builds the same ConfigMap (with a content hash suffix) via configMapGenerator.
---
apiVersion: v1
kind: ConfigMap
metadata:
  name: cardworker-config
  namespace: cardworker
  labels:
    app.kubernetes.io/name: cardworker
    app.kubernetes.io/component: config
data:
  config.toml: |
"""


def render(toml_text: str) -> str:
    body = "".join(("    " + line if line.strip() else "") + "\n"
                   for line in toml_text.rstrip("\n").split("\n"))
    return HEADER + body


def main() -> int:
    check = "--check" in sys.argv[1:]
    if not SOURCE.exists():
        print(f"sync_configmap: {SOURCE.relative_to(ROOT)} not found; nothing to compare",
              file=sys.stderr)
        return 0 if check else 1
    wanted = render(SOURCE.read_text())
    current = TARGET.read_text() if TARGET.exists() else ""
    if check:
        if current != wanted:
            print("deploy/k8s/configmap.yaml has drifted from config/production.toml; "
                  "run: python3 deploy/k8s/sync_configmap.py", file=sys.stderr)
            return 1
        return 0
    if current != wanted:
        TARGET.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
