// The GGUF oracle: Hugging Face's own GGUF reader (@huggingface/gguf, from tools/test-deps) on a local
// file. tests/pipelines/test_gguf.cpp writes files with its test writer, runs this once per file and
// compares kiln's GGUFFile with it.
//
//   node tests/tools/gguf_dump.mjs FILE.gguf
//     -> {"version": 3, "tensor_count": "2", "kv_count": "5", "tensor_data_offset": "448",
//         "metadata": {"KEY": {"type": 4, "sub_type": 0, "value": ...}, ...},   (sub_type: arrays only)
//         "tensors": [{"name", "n_dims", "shape": ["4", "3"], "dtype": 0, "offset": "0"}, ...]}
//
// 64-bit integers (JS BigInts) are written as decimal strings, so none loses precision; other numbers
// as JSON numbers (JS prints a double's shortest round-trip form). Environment: KILN_TEST_DEPS
// (default: tools/test-deps of this repository).
import { existsSync } from 'node:fs';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';

const sourceDir = resolve(join(dirname(fileURLToPath(import.meta.url)), '../..'));
const testDeps = resolve(process.env.KILN_TEST_DEPS ?? join(sourceDir, 'tools/test-deps'));

function fail(message) {
  console.error(`gguf_dump: ${message}`);
  process.exit(2);
}

// As hf_tokenize.mjs does: the module by its file, so no node_modules resolution from here is needed.
async function importDep(entry) {
  const path = join(testDeps, 'node_modules', entry);
  if (!existsSync(path)) {
    fail(`the test dependency ${entry} is not at ${path}: run tools/bootstrap.sh ` +
         '(it runs `npm ci --prefix tools/test-deps`)');
  }
  return import(pathToFileURL(path).href);
}

const args = process.argv.slice(2);
if (args.length !== 1) fail('usage: gguf_dump.mjs FILE.gguf');
const file = resolve(args[0]);
if (!existsSync(file)) fail(`${file} not found`);

const { gguf } = await importDep('@huggingface/gguf/dist/index.mjs');
let parsed;
try {
  parsed = await gguf(file, { allowLocalFile: true, typedMetadata: true });
} catch (e) {
  fail(`@huggingface/gguf refuses ${file}: ${e.message}`);
}

const plain = (v) => {
  if (typeof v === 'bigint') return v.toString();
  if (Array.isArray(v)) return v.map(plain);
  return v;
};

const { typedMetadata, tensorInfos, tensorDataOffset } = parsed;
const metadata = {};
for (const [key, entry] of Object.entries(typedMetadata)) {
  if (key === 'version' || key === 'tensor_count' || key === 'kv_count') continue;
  metadata[key] = { type: entry.type, value: plain(entry.value) };
  if (entry.subType !== undefined) metadata[key].sub_type = entry.subType;
}
const out = {
  version: Number(typedMetadata.version.value),
  tensor_count: typedMetadata.tensor_count.value.toString(),
  kv_count: typedMetadata.kv_count.value.toString(),
  tensor_data_offset: tensorDataOffset.toString(),
  metadata,
  tensors: tensorInfos.map((t) => ({
    name: t.name,
    n_dims: t.n_dims,
    shape: t.shape.map((d) => d.toString()),
    dtype: t.dtype,
    offset: t.offset.toString(),
  })),
};
process.stdout.write(JSON.stringify(out) + '\n');
