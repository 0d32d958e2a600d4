// Validates KEDA ScaledObjects against KEDA's API schema as the npm package
// @kubernetes-models/keda publishes it (generated from KEDA's Go API types), plus the checks that
// schema leaves out: unknown fields (its objects allow any) and the prometheus trigger's required
// metadata.
//   node deploy/check_keda.mjs NPM_DIR FILE.yaml...
// NPM_DIR holds node_modules with @kubernetes-models/keda and js-yaml (deploy/lint.sh installs them).
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const [dir, ...files] = process.argv.slice(2);
const mod = (p) => import(pathToFileURL(join(dir, "node_modules", p)).href);
const yaml = (await mod("js-yaml/dist/js-yaml.mjs")).default;
const keda = join(dir, "node_modules/@kubernetes-models/keda/keda.sh/v1alpha1");
const { ScaledObject } = await import(pathToFileURL(join(keda, "ScaledObject.js")).href);

// The property names of the interface a .d.ts file declares first.
function fields(type) {
  const text = readFileSync(join(keda, `${type}.d.ts`), "utf8");
  const body = text.match(/export interface I\w+ \{([\s\S]*?)\n\}/)[1];
  return new Set([...body.matchAll(/^\s{4}"(\w+)"\??:/gm)].map((m) => m[1]));
}

const problems = [];
function known(obj, type, path) {
  if (obj === undefined) return;
  const allowed = fields(type);
  for (const key of Object.keys(obj)) {
    if (!allowed.has(key)) problems.push(`${path}.${key}: not a field of KEDA's ${type}`);
  }
}

for (const file of files) {
  for (const doc of yaml.loadAll(readFileSync(file, "utf8")).filter(Boolean)) {
    const at = `${file}: ${doc.kind}/${doc.metadata?.name}`;
    if (doc.apiVersion !== "keda.sh/v1alpha1" || doc.kind !== "ScaledObject") {
      problems.push(`${at}: only keda.sh/v1alpha1 ScaledObject is checked here`);
      continue;
    }
    try {
      new ScaledObject(doc).validate();
    } catch (e) {
      problems.push(`${at}: ${e.message}`);
    }
    const spec = doc.spec ?? {};
    known(spec, "ScaledObjectSpec", `${at} spec`);
    known(spec.scaleTargetRef, "ScaleTarget", `${at} spec.scaleTargetRef`);
    known(spec.advanced, "AdvancedConfig", `${at} spec.advanced`);
    known(spec.advanced?.horizontalPodAutoscalerConfig, "HorizontalPodAutoscalerConfig",
      `${at} spec.advanced.horizontalPodAutoscalerConfig`);
    (spec.triggers ?? []).forEach((t, i) => {
      known(t, "ScaleTriggers", `${at} spec.triggers[${i}]`);
      if (t.type === "prometheus") {
        for (const key of ["serverAddress", "query", "threshold"]) {
          if (!t.metadata?.[key]) problems.push(`${at} spec.triggers[${i}]: prometheus needs metadata.${key}`);
        }
      }
    });
  }
}
if (problems.length) {
  console.error(problems.join("\n"));
  process.exit(1);
}
