// Imports trace files with @tracerbench/trace-model, an importer independent of
// steptrace (issue 27), and checks what it built: every event has "cat" and "ts", and on
// each thread the complete events ("X") nest: a child lies inside the parent the model
// gave it, and siblings (same parent) never overlap, with times as the model computes
// them (doubles, end = ts + dur). Prints one summary line per file; exit status 1 on any
// problem or import error.
//
// Usage: node trace_model_check.js NODE_MODULES_DIR FILE...
'use strict';
const fs = require('fs');
const path = require('path');

const [modules, ...files] = process.argv.slice(2);
if (!modules || files.length === 0) {
  console.error('usage: node trace_model_check.js NODE_MODULES_DIR FILE...');
  process.exit(2);
}
const { buildModel } = require(path.join(modules, '@tracerbench', 'trace-model'));

let failed = false;
for (const file of files) {
  const problems = [];
  let doc;
  let model;
  try {
    doc = JSON.parse(fs.readFileSync(file, 'utf8'));
    model = buildModel(doc);
  } catch (e) {
    console.log(`${file}: trace-model could not import it: ${e && e.stack ? e.stack : e}`);
    failed = true;
    continue;
  }
  doc.traceEvents.forEach((e, i) => {
    if (typeof e.cat !== 'string') problems.push(`event ${i} has no "cat": ${JSON.stringify(e)}`);
    if (typeof e.ts !== 'number') problems.push(`event ${i} has no "ts": ${JSON.stringify(e)}`);
  });
  let threads = 0;
  let complete = 0;
  let nested = 0;
  for (const proc of model.processes) {
    for (const thread of proc.threads) {
      ++threads;
      const spans = thread.events.filter((e) => e.isComplete());
      complete += spans.length;
      const children = new Map();  // parent (or null) -> its children, in model order
      for (const span of spans) {
        const parent = span.parent || null;
        if (parent) {
          ++nested;
          if (span.start < parent.start || span.end > parent.end) {
            problems.push(`pid ${proc.id} tid ${thread.id}: ${span.name} [${span.start}, ${span.end}] ` +
                          `sticks out of its parent ${parent.name} [${parent.start}, ${parent.end}]`);
          }
        }
        if (!children.has(parent)) children.set(parent, []);
        children.get(parent).push(span);
      }
      for (const siblings of children.values()) {
        siblings.sort((a, b) => a.start - b.start || a.ord - b.ord);
        for (let i = 1; i < siblings.length; ++i) {
          const a = siblings[i - 1];
          const b = siblings[i];
          if (b.start < a.end) {
            problems.push(`pid ${proc.id} tid ${thread.id}: siblings overlap: ${a.name} ` +
                          `[${a.start}, ${a.end}] and ${b.name} [${b.start}, ${b.end}]`);
          }
        }
      }
    }
  }
  if (complete === 0) problems.push('no complete events at all');
  console.log(`${file}: trace-model imported ${doc.traceEvents.length} events, ` +
              `${model.processes.length} processes, ${threads} threads, ${complete} spans ` +
              `(${nested} nested); ${problems.length} problems`);
  for (const p of problems.slice(0, 20)) console.log(`  ${p}`);
  if (problems.length > 0) failed = true;
}
process.exit(failed ? 1 : 0);
