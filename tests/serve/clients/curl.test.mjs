// `kiln serve` as curl meets it (the commands docs/serve.md shows): a streamed completion with
// `curl -sS -N` is `data: ` lines ending `data: [DONE]`; /health, /v1/models, /metrics; a malformed
// body is a 400 with OpenAI's error object. curl is Debian's (tools/bootstrap.sh installs it).
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';

import { modelName, startServer } from './harness.mjs';

const curlFound = spawnSync('curl', ['--version']).status === 0;
if (!curlFound) {
  console.error('kiln client tests: curl not found. Run tools/bootstrap.sh (it installs curl).');
  process.exit(1);
}

// curl with `args`; returns { status (HTTP), body, headers (lower case) }. The headers come first on
// stdout (-D -), ended by a blank line.
function curl(args, input) {
  const r = spawnSync('curl', ['-sS', '--max-time', '30', '-D', '-', ...args], { encoding: 'utf8', input });
  assert.equal(r.status, 0, `curl ${args.join(' ')} failed (${r.signal ?? r.status}): ${r.stderr}`);
  let out = r.stdout;
  let end = out.indexOf('\r\n\r\n');
  while (/^HTTP\/[\d.]+ 100/.test(out)) {  // a large body: curl's Expect: 100-continue, answered first
    out = out.slice(end + 4);
    end = out.indexOf('\r\n\r\n');
  }
  const headers = out.slice(0, end);
  return { status: Number(headers.split(' ')[1]), body: out.slice(end + 4), headers: headers.toLowerCase() };
}

describe('curl', () => {
  let server;
  before(async () => {
    server = await startServer({ chat: false });
  });
  after(async () => {
    if (server) await server.stop();
  });

  test('GET /health', () => {
    const r = curl([`${server.url}/health`]);
    assert.equal(r.status, 200);
    assert.deepEqual(JSON.parse(r.body), { status: 'ok' });
    assert.match(r.headers, /content-type: application\/json/);
  });

  test('GET /v1/models', () => {
    const r = curl([`${server.url}/v1/models`]);
    assert.equal(r.status, 200);
    const body = JSON.parse(r.body);
    assert.equal(body.object, 'list');
    assert.deepEqual(body.data.map((m) => m.id), [modelName]);
    assert.ok(body.data[0].max_model_len > 0);
  });

  test('POST /v1/completions as docs/serve.md shows it (no content type, no model)', () => {
    const r = curl([`${server.url}/v1/completions`, '-d', '{"prompt": "You will", "max_tokens": 16, "temperature": 0}']);
    assert.equal(r.status, 200);
    const body = JSON.parse(r.body);
    assert.equal(body.object, 'text_completion');
    assert.equal(body.choices[0].index, 0);
    assert.equal(typeof body.choices[0].text, 'string');
    assert.equal(body.usage.prompt_tokens + body.usage.completion_tokens, body.usage.total_tokens);
  });

  test('curl -sS -N streams data: lines ending with data: [DONE]', () => {
    const r = curl(['-N', `${server.url}/v1/completions`, '-H', 'Content-Type: application/json', '-d',
                    JSON.stringify({ model: modelName, prompt: 'You will', max_tokens: 8, temperature: 0, stream: true })]);
    assert.equal(r.status, 200);
    assert.match(r.headers, /content-type: text\/event-stream/);
    assert.ok(r.body.endsWith('data: [DONE]\n\n'), JSON.stringify(r.body.slice(-40)));
    const events = r.body.split('\n\n').filter(Boolean);
    for (const e of events) assert.ok(e.startsWith('data: '), JSON.stringify(e));
    const chunks = events.slice(0, -1).map((e) => JSON.parse(e.slice(6)));
    assert.ok(chunks.length >= 2);
    assert.equal(chunks.at(-1).choices[0].finish_reason, 'length');
    const streamed = chunks.map((c) => c.choices[0].text).join('');
    const whole = JSON.parse(curl([`${server.url}/v1/completions`, '-d',
                                   JSON.stringify({ prompt: 'You will', max_tokens: 8, temperature: 0 })]).body);
    assert.equal(streamed, whole.choices[0].text);
  });

  test('GET /metrics: Prometheus text with kiln_http_responses_total', () => {
    const r = curl([`${server.url}/metrics`]);
    assert.equal(r.status, 200);
    assert.match(r.headers, /content-type: text\/plain/);
    assert.match(r.body, /^# TYPE kiln_http_responses_total counter$/m);
    assert.match(r.body, /^kiln_http_responses_total\{path="\/v1\/completions",status="200"\} [1-9]\d*$/m);
    assert.match(r.body, /^kiln_kv_blocks_used \d+$/m);
    assert.match(r.body, /^kiln_time_to_first_token_seconds_bucket\{le="\+Inf"\} \d+$/m);
  });

  test('a malformed JSON body is a 400 with an OpenAI error object', () => {
    for (const body of ['{"prompt": "x", ', 'not json', '[1, 2]']) {
      const r = curl([`${server.url}/v1/completions`, '-H', 'Content-Type: application/json', '-d', body]);
      assert.equal(r.status, 400, body);
      assert.match(r.headers, /content-type: application\/json/);
      const { error } = JSON.parse(r.body);
      assert.equal(typeof error.message, 'string');
      assert.equal(error.type, 'invalid_request_error');
      assert.ok('param' in error && 'code' in error, JSON.stringify(error));
    }
  });

  test('a body over 1 MiB is a 413 with an OpenAI error object', () => {
    const r = curl([`${server.url}/v1/completions`, '-H', 'Content-Type: application/json', '--data-binary', '@-'],
                   JSON.stringify({ prompt: 'x'.repeat(1 << 21) }));
    assert.equal(r.status, 413);
    assert.equal(typeof JSON.parse(r.body).error.message, 'string');
  });

  test('an unknown route is a 404 with an OpenAI error object', () => {
    const r = curl([`${server.url}/v1/nothing`]);
    assert.equal(r.status, 404);
    assert.equal(typeof JSON.parse(r.body).error.message, 'string');
  });
});
