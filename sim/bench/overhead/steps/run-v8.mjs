// Runs the wasm32-wasip1 build of the steps program under node's V8 with WASI.
//   node run-v8.mjs steps.wasm BODIES.jsonl [ROUNDS]
import { readFile } from 'node:fs/promises';
import { WASI } from 'node:wasi';
import { dirname, basename, resolve } from 'node:path';

const [wasmPath, bodies, rounds] = process.argv.slice(2);
const dir = dirname(resolve(bodies));
const wasi = new WASI({
  version: 'preview1',
  args: ['steps', `/data/${basename(bodies)}`, rounds ?? '7'],
  preopens: { '/data': dir },
});
const module = await WebAssembly.compile(await readFile(wasmPath));
const instance = await WebAssembly.instantiate(module, wasi.getImportObject());
wasi.start(instance);
