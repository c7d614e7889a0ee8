// The tokenizer oracle: Hugging Face's own JS tokenizers (@huggingface/tokenizers, from
// tools/test-deps) on a model's tokenizer.json + tokenizer_config.json. The oracle test
// (tests/pipelines/test_tokenizer_oracle.cpp) runs it once per tokenizer and compares kiln with it.
//
//   node tests/tools/hf_tokenize.mjs DIR TEXTS.json [--no-special]  -> [[ids of text 0], ...]
//   node tests/tools/hf_tokenize.mjs decode DIR IDS.json [--skip-special]  -> ["text 0", ...]
//   node tests/tools/hf_tokenize.mjs all DIR TEXTS.json
//     -> {"encode": [[...]], "encode_no_special": [[...]],
//         "decode": [...], "decode_skip_special": [...]}   (decodes of the "encode" ids)
//
// DIR holds tokenizer.json and tokenizer_config.json; TEXTS.json is a JSON list of strings, IDS.json
// a JSON list of id lists. `all` loads the tokenizer once (Gemma's takes ~20 s to load here).
// Environment: KILN_TEST_DEPS (default: tools/test-deps of this repository).
import { existsSync, readFileSync } from 'node:fs';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';

const sourceDir = resolve(join(dirname(fileURLToPath(import.meta.url)), '../..'));
const testDeps = resolve(process.env.KILN_TEST_DEPS ?? join(sourceDir, 'tools/test-deps'));

function fail(message) {
  console.error(`hf_tokenize: ${message}`);
  process.exit(2);
}

function readJson(path, what) {
  if (!existsSync(path)) fail(`${what} not found at ${path}`);
  try {
    return JSON.parse(readFileSync(path, 'utf8'));
  } catch (e) {
    fail(`${what} ${path}: ${e.message}`);
  }
}

// As tests/serve/clients/harness.mjs does: a module of tools/test-deps by its file, so no
// node_modules resolution from this directory is needed.
async function importDep(entry) {
  const path = join(testDeps, 'node_modules', entry);
  if (!existsSync(path)) {
    fail(`the test dependency ${entry} is not at ${path}: run tools/bootstrap.sh ` +
         '(it runs `npm ci --prefix tools/test-deps`)');
  }
  return import(pathToFileURL(path).href);
}

const args = process.argv.slice(2);
const flags = new Set(args.filter((a) => a.startsWith('--')));
const positional = args.filter((a) => !a.startsWith('--'));
let mode = 'encode';
if (positional[0] === 'decode' || positional[0] === 'all') mode = positional.shift();
if (positional.length !== 2) {
  fail('usage: hf_tokenize.mjs [decode|all] DIR TEXTS_OR_IDS.json [--no-special] [--skip-special]');
}
const [dir, inputFile] = positional;

const { Tokenizer } = await importDep('@huggingface/tokenizers/dist/tokenizers.mjs');
const tokenizer = new Tokenizer(readJson(join(dir, 'tokenizer.json'), 'tokenizer.json'),
                                readJson(join(dir, 'tokenizer_config.json'), 'tokenizer_config.json'));
const input = readJson(inputFile, 'the input');
if (!Array.isArray(input)) fail(`${inputFile} is not a JSON list`);

const encode = (texts, add_special_tokens) =>
  texts.map((text) => tokenizer.encode(text, { add_special_tokens }).ids);
// The JS decode refuses an empty list where Python's returns "" (the empty text's ids, without BOS).
const decode = (idLists, skip_special_tokens) =>
  idLists.map((ids) => (ids.length ? tokenizer.decode(ids, { skip_special_tokens }) : ''));

let out;
if (mode === 'encode') {
  out = encode(input, !flags.has('--no-special'));
} else if (mode === 'decode') {
  out = decode(input, flags.has('--skip-special'));
} else {
  const ids = encode(input, true);
  out = {
    encode: ids,
    encode_no_special: encode(input, false),
    decode: decode(ids, false),
    decode_skip_special: decode(ids, true),
  };
}
process.stdout.write(JSON.stringify(out) + '\n');
