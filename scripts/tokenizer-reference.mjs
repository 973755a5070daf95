// Independent references for the tokenizer tests, run with Node (20 or newer) and npm's
// js-tiktoken 1.0.21 (MIT; OpenAI's o200k_base / cl100k_base ranks and patterns). Not needed to
// build or test: it writes the files the tests compare against (scripts/tokenizer-reference).
//
//   node tokenizer-reference.mjs ranks OUT_DIR          o200k_base.tiktoken, cl100k_base.tiktoken
//   node tokenizer-reference.mjs ids o200k|cl100k FILE  ids of FILE, one line, space-separated
//   node tokenizer-reference.mjs ids-lines o200k|cl100k FILE.jsonl   ids of each JSON string line
//   node tokenizer-reference.mjs kimi-pieces FILE       Kimi pieces of each line of FILE, JSON
//
// The Kimi pattern has no JavaScript engine of its own: kimiRegex below is our translation of
// the vendor's pat_str (docs/spec/TOKENIZER.md 3.1) into JavaScript syntax: \p{Script=Han} for
// \p{Han}, the v flag for the && set intersections, (?i:...) written out case by case with
// U+017F for s, and \s replaced by an explicit White_Space class (JS \s adds U+FEFF and lacks
// U+0085). It is a translation, not vendor code.
import fs from "node:fs";
import path from "node:path";
import { createRequire } from "node:module";

const require = createRequire(path.resolve(process.env.JS_TIKTOKEN_DIR || ".", "x.js"));
const [cmd, a, b] = process.argv.slice(2);

function load(name) {
  return require(`js-tiktoken/ranks/${name}`);
}

if (cmd === "ranks") {
  // js-tiktoken stores ranks as lines "! OFFSET tok tok ..." (base64 tokens, consecutive ranks)
  for (const name of ["o200k_base", "cl100k_base"]) {
    const out = [];
    for (const line of load(name).bpe_ranks.split("\n")) {
      if (!line) continue;
      const [, off, ...toks] = line.split(" ");
      toks.forEach((t, i) => out.push(`${t} ${Number(off) + i}`));
    }
    fs.writeFileSync(path.join(a, `${name}.tiktoken`), out.join("\n") + "\n");
  }
} else if (cmd === "ids") {
  const { Tiktoken } = require("js-tiktoken/lite");
  const enc = new Tiktoken(load(a === "o200k" ? "o200k_base" : "cl100k_base"));
  const text = fs.readFileSync(b, "utf8");
  process.stdout.write(enc.encode(text, [], []).join(" ") + "\n");
} else if (cmd === "ids-lines") {
  const { Tiktoken } = require("js-tiktoken/lite");
  const enc = new Tiktoken(load(a === "o200k" ? "o200k_base" : "cl100k_base"));
  for (const line of fs.readFileSync(b, "utf8").split("\n")) {
    if (line) process.stdout.write(enc.encode(JSON.parse(line), [], []).join(" ") + "\n");
  }
} else if (cmd === "kimi-pieces") {
  const WS = "\\t\\n\\v\\f\\r \\u0085\\u00a0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000";
  const C = "(?:'[sSſ]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])";
  const U = "[[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]--\\p{Script=Han}]";
  const W = "[[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]--\\p{Script=Han}]";
  const P = "[^\\r\\n\\p{L}\\p{N}]";
  const kimiRegex = new RegExp(
    [
      "\\p{Script=Han}+",
      `${P}?${U}*${W}+${C}?`,
      `${P}?${U}+${W}*${C}?`,
      "\\p{N}{1,3}",
      ` ?[^${WS}\\p{L}\\p{N}]+[\\r\\n]*`,
      `[${WS}]*[\\r\\n]+`,
      `[${WS}]+(?![^${WS}])`,
      `[${WS}]+`,
    ].join("|"),
    "gv",
  );
  for (const line of fs.readFileSync(a, "utf8").split("\n")) {
    const text = JSON.parse(line || '""');
    if (!line) continue;
    const pieces = text.match(kimiRegex) || [];
    if (pieces.join("") !== text) throw new Error(`pieces do not cover ${line}`);
    process.stdout.write(JSON.stringify(pieces) + "\n");
  }
} else {
  console.error("usage: tokenizer-reference.mjs ranks OUT_DIR | ids o200k|cl100k FILE | kimi-pieces FILE");
  process.exit(2);
}
