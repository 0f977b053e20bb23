// Copies the console's third-party files from node_modules into ../ui/vendor (committed there, so a user
// needs neither node nor a network): `npm ci && npm run build`. Versions come from package-lock.json.
import { readFileSync, writeFileSync, mkdirSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const vendor = join(here, "..", "ui", "vendor");
mkdirSync(vendor, { recursive: true });

const files = [
  // dagre's ES module bundle (graph layout; graphlib inlined): no imports, no source map reference
  { pkg: "@dagrejs/dagre", from: "dist/dagre.esm.js", to: "dagre.esm.js", license: "dist/dagre.esm.js.LEGAL.txt" },
];
const versions = {};
for (const f of files) {
  const root = join(here, "node_modules", ...f.pkg.split("/"));
  const meta = JSON.parse(readFileSync(join(root, "package.json"), "utf8"));
  const text = readFileSync(join(root, f.from), "utf8").replace(/\n\/\/# sourceMappingURL=.*\s*$/, "\n");
  writeFileSync(join(vendor, f.to), `/* ${f.pkg} ${meta.version} (${meta.license}): see ${f.to.replace(/\.js$/, "")}.LICENSE.txt */\n` + text);
  writeFileSync(join(vendor, f.to.replace(/\.js$/, ".LICENSE.txt")), readFileSync(join(root, f.license), "utf8"));
  versions[f.pkg] = meta.version;
}
writeFileSync(join(vendor, "VERSIONS.json"), JSON.stringify(versions, null, 1) + "\n");
console.log("vendor files written:", versions);
