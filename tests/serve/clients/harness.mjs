// The harness of the client tests: starts the real `kiln serve` binary on a free loopback port,
// hands the tests its URL and the official `openai` npm client, and stops it with SIGTERM at the end,
// checking that it exits 0. Run by ctest (CMakeLists.txt: ServeClients.*), or by hand:
//
//   KILN_BIN=build/kiln node tests/serve/clients/openai.test.mjs
//
// Environment: KILN_BIN (the kiln binary; default build/kiln), KILN_SOURCE_DIR (the repository;
// default: found from this file), KILN_TEST_DEPS (tools/test-deps, where `npm ci` put the clients).
// Nothing beyond node's own modules and tools/test-deps is used.
import { spawn } from 'node:child_process';
import { existsSync } from 'node:fs';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';

export const sourceDir = resolve(process.env.KILN_SOURCE_DIR ?? join(dirname(fileURLToPath(import.meta.url)), '../../..'));
export const kilnBin = resolve(process.env.KILN_BIN ?? join(sourceDir, 'build/kiln'));
export const testDeps = resolve(process.env.KILN_TEST_DEPS ?? join(sourceDir, 'tools/test-deps'));
export const modelDir = join(sourceDir, 'models/kiln-tiny');
export const modelName = 'kiln-tiny';
export const chatTemplate = join(sourceDir, 'tests/data/chat/chatml.jinja');

// A missing prerequisite fails the test program at once, saying how to get it (never a silent pass).
function requireFile(path, what) {
  if (!existsSync(path)) {
    console.error(`kiln client tests: ${what} not found at ${path}.\n` +
                  'Run tools/bootstrap.sh (it installs node, npm and the test clients: npm ci in tools/test-deps) ' +
                  'and build kiln_cli.');
    process.exit(1);
  }
}
requireFile(kilnBin, 'the kiln binary (KILN_BIN)');
requireFile(join(testDeps, 'node_modules/openai/package.json'), "the openai npm client (tools/test-deps' node_modules)");

// A module of tools/test-deps, by its package directory and entry file.
export async function importDep(entry) {
  const path = join(testDeps, 'node_modules', entry);
  requireFile(path, `the test dependency ${entry}`);
  return import(pathToFileURL(path).href);
}

export const { default: OpenAI } = await importDep('openai/index.mjs');

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// Starts `kiln serve` on port 0 and waits until GET /health answers. `extraArgs` are more flags.
// Returns { url, baseURL, port, proc, log(), stop() }; stop() sends SIGTERM and resolves once the
// process has exited, throwing unless it exited 0 within `graceMs`.
export async function startServer({ extraArgs = [], apiKey, chat = true, startTimeoutMs = 60000 } = {}) {
  const args = ['serve', '--model', modelDir, '--port', '0', '--threads', '2', ...extraArgs];
  if (apiKey) args.push('--api-key', apiKey);
  if (chat) args.push('--chat-template', chatTemplate);
  const env = { ...process.env };
  env.KILN_CACHE_DIR ??= join(dirname(kilnBin), 'test-compile-cache');  // never the user's ~/.cache
  // KILN_LAUNCHER: a command to run kiln under (the TSan build's `setarch x86_64 -R`).
  const launcher = (process.env.KILN_LAUNCHER ?? '').split(' ').filter(Boolean);
  const proc = spawn(launcher[0] ?? kilnBin, [...launcher.slice(1), ...(launcher.length ? [kilnBin] : []), ...args],
                     { stdio: ['ignore', 'pipe', 'pipe'], env });
  let stderr = '';
  let stdout = '';
  proc.stdout.setEncoding('utf8').on('data', (d) => (stdout += d));
  proc.stderr.setEncoding('utf8');
  const exited = new Promise((r) => proc.on('exit', (code, signal) => r({ code, signal })));
  const log = () => `$ ${kilnBin} ${args.join(' ')}\n--- stderr ---\n${stderr}--- stdout ---\n${stdout}`;

  const port = await new Promise((resolvePort, reject) => {
    const timer = setTimeout(() => reject(new Error(`kiln serve did not print its port in ${startTimeoutMs} ms\n${log()}`)),
                             startTimeoutMs);
    proc.stderr.on('data', (d) => {
      stderr += d;
      const m = stderr.match(/kiln: serving '([^']*)' on http:\/\/127\.0\.0\.1:(\d+)/);
      if (m) {
        clearTimeout(timer);
        resolvePort(Number(m[2]));
      }
    });
    exited.then(({ code, signal }) => {
      clearTimeout(timer);
      reject(new Error(`kiln serve exited (code ${code}, signal ${signal}) before serving\n${log()}`));
    });
  });
  const url = `http://127.0.0.1:${port}`;
  const deadline = Date.now() + startTimeoutMs;
  for (;;) {
    try {
      const res = await fetch(`${url}/health`, { headers: { connection: 'close' } });  // no idle keep-alive left
      if (res.status === 200 && (await res.json()).status === 'ok') break;
    } catch {}
    if (Date.now() > deadline) throw new Error(`GET /health never answered 200\n${log()}`);
    await sleep(50);
  }
  let stopped = null;
  const stop = (graceMs = 10000) => {
    stopped ??= (async () => {
      proc.kill('SIGTERM');
      let timer;
      const timeout = new Promise((r) => (timer = setTimeout(() => r('timeout'), graceMs)));
      const result = await Promise.race([exited, timeout]);
      clearTimeout(timer);
      if (result === 'timeout') {
        proc.kill('SIGKILL');
        throw new Error(`kiln serve did not exit within ${graceMs} ms of SIGTERM\n${log()}`);
      }
      if (result.code !== 0)
        throw new Error(`kiln serve exited with code ${result.code} (signal ${result.signal}) after SIGTERM, not 0\n${log()}`);
      return result;
    })();
    return stopped;
  };
  // Never leave a server behind, even when the test program dies.
  process.on('exit', () => proc.exitCode === null && proc.signalCode === null && proc.kill('SIGKILL'));
  return { url, baseURL: `${url}/v1`, port, proc, log, stop, exited };
}

// The official client against a server: no retries (a failure must show), a bounded timeout.
export function client(server, { apiKey = 'x', ...options } = {}) {
  return new OpenAI({ baseURL: server.baseURL, apiKey, maxRetries: 0, timeout: 60000, ...options });
}

// A raw server-sent-events request with fetch: { status, events (parsed JSON chunks), done (saw
// [DONE], last), raw (the data lines) }. `signal` aborts it.
export async function sse(url, body, { signal, headers = {} } = {}) {
  const res = await fetch(url, {
    method: 'POST',
    headers: { 'content-type': 'application/json', ...headers },
    body: JSON.stringify(body),
    signal,
  });
  const out = { status: res.status, contentType: res.headers.get('content-type'), events: [], raw: [], done: false,
                afterDone: false };
  if (res.status !== 200) {
    out.body = await res.text();
    return out;
  }
  const tail = {};
  for await (const event of sseEvents(res.body, tail)) {
    for (const line of event.split('\n')) {
      if (!line.startsWith('data: ')) continue;
      const data = line.slice(6);
      if (out.done) out.afterDone = true;
      out.raw.push(data);
      if (data === '[DONE]') out.done = true;
      else out.events.push(JSON.parse(data));
    }
  }
  out.trailing = tail.rest;
  return out;
}

// The events of a server-sent-event body as they arrive: each block before a blank line. What is
// left after the last one (nothing, from a well-formed stream) ends up in `tail.rest`.
export async function* sseEvents(body, tail = {}) {
  const decoder = new TextDecoder();
  let buffer = '';
  for await (const bytes of body) {
    buffer += decoder.decode(bytes, { stream: true });
    let end;
    while ((end = buffer.indexOf('\n\n')) >= 0) {
      yield buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
    }
  }
  tail.rest = buffer;
}

// The Prometheus text of /metrics as { 'name{labels}': value }.
export async function metrics(server) {
  const text = await (await fetch(`${server.url}/metrics`)).text();
  const out = {};
  for (const line of text.split('\n')) {
    if (!line || line.startsWith('#')) continue;
    const at = line.lastIndexOf(' ');
    out[line.slice(0, at)] = Number(line.slice(at + 1));
  }
  return out;
}

// ChatML, as tests/data/chat/chatml.jinja renders it: the independent truth the chat endpoint is
// checked against (tests/serve/clients/chat.test.mjs also renders the file itself with @huggingface/jinja).
export function chatml(messages, addGenerationPrompt = true) {
  let out = '';
  for (const m of messages) out += `<|im_start|>${m.role}\n${m.content.trim()}<|im_end|>\n`;
  if (addGenerationPrompt) out += '<|im_start|>assistant\n';
  return out;
}
