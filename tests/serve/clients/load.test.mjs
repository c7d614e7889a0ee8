// A bounded load test of `kiln serve --max-concurrency 64`: 64 concurrent streaming clients (raw
// fetch, reading the server-sent events themselves), each looping requests for KILN_LOAD_SECONDS
// (default 30): small random max_tokens, short prompts, some with n, some aborted mid-stream. Every
// stream not aborted must end complete (a finish_reason per choice, then [DONE]); afterwards the
// engine must drain (no KV block in use, nothing running or waiting) and /health still answer.
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';

import { metrics, modelName, sseEvents, startServer } from './harness.mjs';

const seconds = Number(process.env.KILN_LOAD_SECONDS ?? 30);
const clients = Number(process.env.KILN_LOAD_CLIENTS ?? 64);
const prompts = ['Once upon a time', 'The cat', 'Hello', 'A little girl named Lily', 'One day, a boy',
                 'The sun was', 'Tom and Sue went to the park', 'She said'];

// A small deterministic generator, so a failure can be replayed (KILN_LOAD_SEED).
let state = Number(process.env.KILN_LOAD_SEED ?? 12345) >>> 0;
function random() {
  state = (state + 0x6d2b79f5) >>> 0;
  let t = state;
  t = Math.imul(t ^ (t >>> 15), t | 1);
  t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
  return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
}
const pick = (xs) => xs[Math.floor(random() * xs.length)];

let server;
before(async () => {
  server = await startServer({ extraArgs: ['--max-concurrency', '64'], chat: false });
});
after(async () => {
  if (server) await server.stop();
});

// One streamed request; resolves { aborted, tokens, error }. `abortAfter`: abort after that many chunks.
async function oneRequest(body, abortAfter) {
  const controller = new AbortController();
  const url = `${server.baseURL}/completions`;
  let res;
  try {
    res = await fetch(url, {
      method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body),
      signal: controller.signal,
    });
  } catch (e) {
    return { error: `fetch failed: ${e.cause?.message ?? e.message}` };
  }
  if (res.status !== 200) return { error: `HTTP ${res.status}: ${await res.text()}` };
  const n = body.n ?? 1;
  const finished = new Array(n).fill(null);
  let chunks = 0;
  let done = false;
  let usage = null;
  let aborted = false;
  try {
    for await (const event of sseEvents(res.body)) {
      if (!event.startsWith('data: ')) return { error: `not an SSE data line: ${JSON.stringify(event)}` };
      const data = event.slice(6);
      if (done) return { error: `data after [DONE]: ${data}` };
      if (data === '[DONE]') {
        done = true;
        continue;
      }
      const chunk = JSON.parse(data);
      if (chunk.error) return { error: `error event: ${data}` };
      if (chunk.usage) usage = chunk.usage;
      for (const c of chunk.choices) {
        if (c.index < 0 || c.index >= n) return { error: `choice index ${c.index} of n ${n}` };
        if (finished[c.index]) return { error: `choice ${c.index} continued after its finish` };
        if (c.finish_reason) finished[c.index] = c.finish_reason;
      }
      if (++chunks === abortAfter) {
        aborted = true;
        controller.abort();  // the client hangs up mid-stream: the server must cancel the request
        return { aborted: true };
      }
    }
  } catch (e) {
    if (aborted) return { aborted: true };  // leaving the loop after abort() rejects: ours
    return { error: `stream broke: ${e.cause?.message ?? e.message}` };
  }
  if (!done) return { error: `no [DONE] (after ${chunks} chunks; finishes ${finished})` };
  if (finished.some((f) => f !== 'stop' && f !== 'length')) return { error: `finish reasons ${JSON.stringify(finished)}` };
  if (!usage) return { error: 'no usage chunk' };
  if (usage.prompt_tokens + usage.completion_tokens !== usage.total_tokens) return { error: `usage ${JSON.stringify(usage)}` };
  if (usage.completion_tokens > n * body.max_tokens) return { error: `usage ${JSON.stringify(usage)} over n * max_tokens` };
  return { tokens: usage.completion_tokens };
}

test(`${clients} streaming clients for ${seconds} s: no errors, then the engine drains`, async () => {
  const stats = { requests: 0, completed: 0, aborted: 0, tokens: 0, errors: [] };
  const deadline = Date.now() + seconds * 1000;
  const started = Date.now();
  const worker = async () => {
    while (Date.now() < deadline) {
      const body = {
        model: modelName, prompt: pick(prompts), max_tokens: 1 + Math.floor(random() * 32), stream: true,
        stream_options: { include_usage: true }, temperature: pick([0, 0.7, 1]), seed: Math.floor(random() * 1e6),
      };
      if (random() < 0.2) body.n = 2 + Math.floor(random() * 3);
      const abortAfter = random() < 0.15 ? 1 + Math.floor(random() * 4) : 0;
      ++stats.requests;
      const r = await oneRequest(body, abortAfter);
      if (r.error) stats.errors.push(`${JSON.stringify(body)}${abortAfter ? ` (abort after ${abortAfter})` : ''}: ${r.error}`);
      else if (r.aborted) ++stats.aborted;
      else {
        ++stats.completed;
        stats.tokens += r.tokens;
      }
    }
  };
  await Promise.all(Array.from({ length: clients }, worker));
  const elapsed = (Date.now() - started) / 1000;
  console.log(`load: ${stats.requests} requests in ${elapsed.toFixed(1)} s (${stats.completed} complete, ` +
              `${stats.aborted} aborted mid-stream, ${stats.errors.length} errors); ${stats.tokens} tokens, ` +
              `${(stats.tokens / elapsed).toFixed(0)} tokens/s, ${(stats.completed / elapsed).toFixed(1)} requests/s`);
  assert.deepEqual(stats.errors.slice(0, 10), [], `${stats.errors.length} errors`);
  assert.ok(stats.completed > 0);

  // Aborted requests are cancelled and every block freed: the engine drains within a few seconds.
  let m;
  const drainDeadline = Date.now() + 5000;
  for (;;) {
    m = await metrics(server);
    if (m.kiln_kv_blocks_used === 0 && m.kiln_requests_running === 0 && m.kiln_requests_waiting === 0) break;
    if (Date.now() > drainDeadline) break;
    await new Promise((r) => setTimeout(r, 100));
  }
  assert.equal(m.kiln_kv_blocks_used, 0, 'KV blocks still in use after the load');
  assert.equal(m.kiln_requests_running, 0);
  assert.equal(m.kiln_requests_waiting, 0);
  const ok200 = m['kiln_http_responses_total{path="/v1/completions",status="200"}'];
  assert.ok(ok200 >= stats.completed, `/metrics counts ${ok200} completions responses, ${stats.completed} completed`);
  console.log(`load: /metrics after: ${m.kiln_generation_tokens_total} generation tokens, ` +
              `${m.kiln_engine_steps_total} engine steps, ${m.kiln_preemptions_total} preemptions`);

  const health = await fetch(`${server.url}/health`);
  assert.equal(health.status, 200);
  assert.deepEqual(await health.json(), { status: 'ok' });
});
