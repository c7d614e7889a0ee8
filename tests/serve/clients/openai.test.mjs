// `kiln serve` as the official `openai` npm client meets it: /v1/completions streamed and not, n,
// stop, max_tokens, usage, logprobs, models, and errors raised as the client's APIError classes; a
// second server with --api-key for 401; SIGTERM with a stream in flight; byte tokens that split a
// UTF-8 character (streamed text, logprobs). Each server is stopped with SIGTERM and must exit 0.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';

import { client, modelName, OpenAI, sse, startServer } from './harness.mjs';

const prompt = 'Once upon a time';

// The text and usage of a stream of completion chunks from the client, per choice index.
async function collect(stream) {
  const texts = [];
  const finishes = [];
  const chunks = [];
  for await (const chunk of stream) {
    chunks.push(chunk);
    for (const c of chunk.choices) {
      texts[c.index] = (texts[c.index] ?? '') + c.text;
      if (c.finish_reason) {
        assert.equal(finishes[c.index], undefined, `choice ${c.index} finished twice`);
        finishes[c.index] = c.finish_reason;
      }
    }
  }
  return { texts, finishes, chunks };
}

describe('openai client: /v1/completions', () => {
  let server;
  let openai;
  before(async () => {
    server = await startServer();
    openai = client(server);
  });
  after(async () => {
    if (server) await server.stop();
  });

  test('models.list names the model', async () => {
    const models = [];
    for await (const m of openai.models.list()) models.push(m);
    assert.equal(models.length, 1);
    assert.equal(models[0].id, modelName);
    assert.equal(models[0].object, 'model');
    assert.equal(typeof models[0].created, 'number');
    assert.equal(typeof models[0].owned_by, 'string');
  });

  // OpenAI's GET /v1/models/{model}.
  test('models.retrieve names the model', async () => {
    const m = await openai.models.retrieve(modelName);
    assert.equal(m.id, modelName);
    assert.equal(m.object, 'model');
  });

  test('a completion: the response shape, usage totals, finish_reason length at max_tokens', async () => {
    const r = await openai.completions.create({ model: modelName, prompt, max_tokens: 12, temperature: 0 });
    assert.equal(r.object, 'text_completion');
    assert.equal(r.model, modelName);
    assert.equal(typeof r.id, 'string');
    assert.equal(typeof r.created, 'number');
    assert.equal(r.choices.length, 1);
    assert.equal(r.choices[0].index, 0);
    assert.equal(typeof r.choices[0].text, 'string');
    assert.ok(r.choices[0].text.length > 0);
    assert.equal(r.choices[0].finish_reason, 'length');
    assert.equal(r.usage.completion_tokens, 12);
    assert.ok(r.usage.prompt_tokens > 0);
    assert.equal(r.usage.prompt_tokens + r.usage.completion_tokens, r.usage.total_tokens);
  });

  test('max_tokens 1..5: exactly that many tokens, finish_reason length', async () => {
    for (const max_tokens of [1, 2, 5]) {
      const r = await openai.completions.create({ model: modelName, prompt, max_tokens, temperature: 0 });
      assert.equal(r.choices[0].finish_reason, 'length', `max_tokens ${max_tokens}`);
      assert.equal(r.usage.completion_tokens, max_tokens);
      assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + max_tokens);
    }
  });

  test('greedy is deterministic, and a shorter max_tokens is a prefix', async () => {
    const a = await openai.completions.create({ model: modelName, prompt, max_tokens: 16, temperature: 0 });
    const b = await openai.completions.create({ model: modelName, prompt, max_tokens: 16, temperature: 0 });
    const c = await openai.completions.create({ model: modelName, prompt, max_tokens: 6, temperature: 0 });
    assert.equal(a.choices[0].text, b.choices[0].text);
    assert.ok(a.choices[0].text.startsWith(c.choices[0].text), `${JSON.stringify(c.choices[0].text)} is not a prefix of ${JSON.stringify(a.choices[0].text)}`);
  });

  test('streaming: the chunks concatenate to the non-streamed text (temperature 0, seed)', async () => {
    const params = { model: modelName, prompt, max_tokens: 20, temperature: 0, seed: 7 };
    const whole = await openai.completions.create(params);
    const { texts, finishes, chunks } = await collect(await openai.completions.create({ ...params, stream: true }));
    assert.ok(chunks.length > 1, 'one chunk per step, not one at the end');
    for (const chunk of chunks) {
      assert.equal(chunk.object, 'text_completion');
      assert.equal(chunk.model, modelName);
      assert.equal(chunk.id, chunks[0].id);
    }
    assert.equal(texts[0], whole.choices[0].text);
    assert.equal(finishes[0], whole.choices[0].finish_reason);
    assert.equal(chunks.at(-1).choices[0].finish_reason, whole.choices[0].finish_reason, 'the finish is on the last chunk');
  });

  test('streaming with a seed at temperature 1 equals the non-streamed text too', async () => {
    const params = { model: modelName, prompt: 'The dog', max_tokens: 24, temperature: 1, seed: 1234 };
    const whole = await openai.completions.create(params);
    const { texts } = await collect(await openai.completions.create({ ...params, stream: true }));
    assert.equal(texts[0], whole.choices[0].text);
  });

  test('stream_options.include_usage: the last chunk has empty choices and the usage', async () => {
    const stream = await openai.completions.create({
      model: modelName, prompt, max_tokens: 9, temperature: 0, stream: true, stream_options: { include_usage: true },
    });
    const { chunks, texts } = await collect(stream);
    const last = chunks.at(-1);
    assert.deepEqual(last.choices, []);
    assert.ok(last.usage, 'the last chunk carries usage');
    assert.equal(last.usage.completion_tokens, 9);
    assert.equal(last.usage.prompt_tokens + last.usage.completion_tokens, last.usage.total_tokens);
    for (const chunk of chunks.slice(0, -1)) assert.ok(chunk.usage == null, 'only the last chunk has usage');
    assert.ok(texts[0].length > 0);
  });

  test('n: 3 with a seed: distinct indices, each choice equals a single request seeded seed + i', async () => {
    const params = { model: modelName, prompt: 'A cat', max_tokens: 12, temperature: 1, seed: 42 };
    const r = await openai.completions.create({ ...params, n: 3 });
    assert.equal(r.choices.length, 3);
    assert.deepEqual(r.choices.map((c) => c.index).sort(), [0, 1, 2]);
    let completion = 0;
    for (const c of r.choices) {
      const single = await openai.completions.create({ ...params, seed: params.seed + c.index });
      assert.equal(c.text, single.choices[0].text, `choice ${c.index}`);
      assert.equal(c.finish_reason, single.choices[0].finish_reason);
      completion += single.usage.completion_tokens;
      assert.equal(r.usage.prompt_tokens, single.usage.prompt_tokens, 'the prompt is counted once');
    }
    assert.equal(r.usage.completion_tokens, completion);
    assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + completion);
    assert.ok(new Set(r.choices.map((c) => c.text)).size > 1, 'different seeds give different choices');
  });

  test('n: 3 streamed equals n: 3 not streamed', async () => {
    const params = { model: modelName, prompt: 'A cat', max_tokens: 10, temperature: 1, seed: 9, n: 3 };
    const whole = await openai.completions.create(params);
    const { texts, finishes } = await collect(await openai.completions.create({ ...params, stream: true }));
    for (const c of whole.choices) {
      assert.equal(texts[c.index], c.text, `choice ${c.index}`);
      assert.equal(finishes[c.index], c.finish_reason);
    }
  });

  test('stop: the text ends before the stop string, finish_reason stop', async () => {
    const full = (await openai.completions.create({ model: modelName, prompt, max_tokens: 24, temperature: 0 }))
      .choices[0].text;
    // A stop string from the middle of the greedy text (three characters that are not all blank).
    let at = Math.floor(full.length / 2);
    while (at < full.length - 3 && full.slice(at, at + 3).trim().length < 2) ++at;
    const stop = full.slice(at, at + 3);
    assert.ok(stop.trim().length >= 2, `no stop string in ${JSON.stringify(full)}`);
    const cut = full.indexOf(stop);
    for (const stopParam of [stop, ['never-generated-string', stop]]) {
      const r = await openai.completions.create({ model: modelName, prompt, max_tokens: 24, temperature: 0, stop: stopParam });
      assert.equal(r.choices[0].text, full.slice(0, cut), `stop ${JSON.stringify(stopParam)} in ${JSON.stringify(full)}`);
      assert.equal(r.choices[0].finish_reason, 'stop');
      assert.ok(!r.choices[0].text.includes(stop));
      assert.ok(r.usage.completion_tokens < 24);
    }
    const { texts, finishes } = await collect(await openai.completions.create({
      model: modelName, prompt, max_tokens: 24, temperature: 0, stop, stream: true,
    }));
    assert.equal(texts[0], full.slice(0, cut), 'streamed, the stop string is never sent either');
    assert.equal(finishes[0], 'stop');
  });

  test('logprobs: tokens, token_logprobs, top_logprobs and text_offset per token', async () => {
    const r = await openai.completions.create({ model: modelName, prompt, max_tokens: 8, temperature: 0, logprobs: 3 });
    const { text, logprobs } = r.choices[0];
    assert.ok(logprobs, 'logprobs present');
    const { tokens, token_logprobs, top_logprobs, text_offset } = logprobs;
    assert.equal(tokens.length, 8);
    assert.equal(token_logprobs.length, 8);
    assert.equal(top_logprobs.length, 8);
    assert.equal(text_offset.length, 8);
    assert.equal(tokens.join(''), text);
    let offset = 0;
    for (let i = 0; i < tokens.length; ++i) {
      assert.equal(text_offset[i], offset);
      offset += tokens[i].length;
      assert.ok(token_logprobs[i] <= 0, `logprob ${token_logprobs[i]}`);
      const top = Object.values(top_logprobs[i]);
      assert.ok(top.length >= 1 && top.length <= 3, `${top.length} top logprobs`);
      // Greedy: the chosen token is the most likely one.
      assert.ok(Math.abs(Math.max(...top) - token_logprobs[i]) < 1e-5, `token ${i}: ${token_logprobs[i]} vs ${top}`);
    }
    const plain = await openai.completions.create({ model: modelName, prompt, max_tokens: 8, temperature: 0 });
    assert.equal(plain.choices[0].logprobs, null, 'no logprobs unless asked');
    assert.equal(plain.choices[0].text, text);
  });

  test('a token-id prompt and a one-string array prompt', async () => {
    const a = await openai.completions.create({ model: modelName, prompt: [prompt], max_tokens: 5, temperature: 0 });
    const b = await openai.completions.create({ model: modelName, prompt, max_tokens: 5, temperature: 0 });
    assert.equal(a.choices[0].text, b.choices[0].text);
    const ids = await openai.completions.create({ model: modelName, prompt: [1, 2, 3, 4], max_tokens: 5, temperature: 0 });
    assert.ok(['stop', 'length'].includes(ids.choices[0].finish_reason));
    assert.equal(ids.usage.prompt_tokens, 4);
    assert.ok(ids.usage.completion_tokens >= 1 && ids.usage.completion_tokens <= 5);
  });

  test('a bad field is a BadRequestError (400) naming it in param', async () => {
    const cases = [
      [{ temperature: 5 }, 'temperature'],
      [{ top_p: 0 }, 'top_p'],
      [{ n: 0 }, 'n'],
      [{ max_tokens: -1 }, 'max_tokens'],
      [{ presence_penalty: 3 }, 'presence_penalty'],
      [{ logprobs: 99 }, 'logprobs'],
      [{ stop: [1] }, 'stop'],
      [{ prompt: '' }, 'prompt'],
    ];
    for (const [fields, param] of cases) {
      await assert.rejects(
        openai.completions.create({ model: modelName, prompt, max_tokens: 4, ...fields }),
        (e) => {
          assert.ok(e instanceof OpenAI.APIError, `${JSON.stringify(fields)}: ${e}`);
          assert.ok(e instanceof OpenAI.BadRequestError);
          assert.equal(e.status, 400, JSON.stringify(fields));
          assert.equal(e.param, param, `${JSON.stringify(fields)}: ${e.message}`);
          assert.equal(e.type, 'invalid_request_error');
          assert.ok(e.message.includes(param), e.message);
          return true;
        });
    }
  });

  test('an unknown model is a NotFoundError (404)', async () => {
    await assert.rejects(openai.completions.create({ model: 'gpt-4o', prompt, max_tokens: 4 }), (e) => {
      assert.ok(e instanceof OpenAI.NotFoundError, String(e));
      assert.equal(e.status, 404);
      assert.equal(e.param, 'model');
      return true;
    });
  });

  test('the server still serves after the errors', async () => {
    const r = await openai.completions.create({ model: modelName, prompt, max_tokens: 3, temperature: 0 });
    assert.equal(r.usage.completion_tokens, 3);
  });

  test('a raw stream ends with data: [DONE] and nothing after it', async () => {
    const r = await sse(`${server.baseURL}/completions`, { model: modelName, prompt, max_tokens: 5, temperature: 0, stream: true });
    assert.equal(r.status, 200);
    assert.match(r.contentType, /^text\/event-stream/);
    assert.ok(r.done, 'saw [DONE]');
    assert.equal(r.raw.at(-1), '[DONE]');
    assert.ok(!r.afterDone);
    assert.equal(r.events.at(-1).choices[0].finish_reason, 'length');
  });
});

describe('openai client: --api-key', () => {
  const key = 'sk-kiln-test-key';
  let server;
  before(async () => {
    server = await startServer({ apiKey: key, chat: false });
  });
  after(async () => {
    if (server) await server.stop();
  });

  test('the right key is served, a wrong one is an AuthenticationError (401)', async () => {
    const good = client(server, { apiKey: key });
    const r = await good.completions.create({ model: modelName, prompt, max_tokens: 2, temperature: 0 });
    assert.equal(r.usage.completion_tokens, 2);
    const models = [];
    for await (const m of good.models.list()) models.push(m.id);
    assert.deepEqual(models, [modelName]);

    const bad = client(server, { apiKey: 'wrong' });
    for (const call of [() => bad.completions.create({ model: modelName, prompt, max_tokens: 2 }),
                        () => bad.models.list()]) {
      await assert.rejects(call(), (e) => {
        assert.ok(e instanceof OpenAI.AuthenticationError, String(e));
        assert.equal(e.status, 401);
        return true;
      });
    }
    // /health needs no key.
    assert.equal((await fetch(`${server.url}/health`)).status, 200);
  });
});

describe('SIGTERM with a stream in flight', () => {
  // The grace is short so that the stream is still running when it ends, however slow the build
  // (200 tokens under ASan take longer than the default 10 s): the server must then cut it and exit.
  test('the stream ends (no hang) and kiln serve exits 0 once the grace is over', async () => {
    const server = await startServer({ chat: false, extraArgs: ['--shutdown-grace', '0.5'] });
    const stream = sse(`${server.baseURL}/completions`, {
      model: modelName, prompt, max_tokens: 200, ignore_eos: true, stream: true,
    }).catch((e) => ({ broken: e.message }));
    await new Promise((r) => setTimeout(r, 20));
    const t = Date.now();
    await server.stop(5000);
    const r = await stream;
    assert.ok(Date.now() - t < 5000);
    // Never a hang. A stream that finished has no error event; one cut after the grace ends, as
    // docs/serving.md says, with one error event saying it was cancelled, then [DONE].
    if (!r.broken) {
      const errors = r.events.filter((e) => e.error);
      if (errors.length) {
        assert.equal(errors.length, 1, JSON.stringify(errors));
        assert.equal(r.events.at(-1), errors[0], 'the error event is the last one');
        assert.match(errors[0].error.message, /cancelled/);
      }
      assert.ok(r.done && !r.afterDone, 'the stream ends with [DONE]');
    }
  });
});

// Byte-level tokens that split a character: the text holds them back (or replaces what never
// completes), and logprobs must list them without breaking the JSON (and the server).
describe('openai client: tokens that split UTF-8 characters', () => {
  let server;
  let openai;
  before(async () => {
    server = await startServer({ chat: false });
    openai = client(server);
  });
  after(async () => {
    if (server) await server.stop();
  });
  // Greedy kiln-tiny answers this prompt with byte tokens that never make a whole character.
  const params = { model: modelName, prompt: '🙂 café', max_tokens: 4, temperature: 0 };

  test('streamed text equals the non-streamed text', async () => {
    const whole = await openai.completions.create(params);
    const { texts } = await collect(await openai.completions.create({ ...params, stream: true }));
    assert.equal(texts[0], whole.choices[0].text);
  });

  test('logprobs, not streamed: 200, one entry per token', async () => {
    const r = await openai.completions.create({ ...params, logprobs: 1 });
    assert.equal(r.choices[0].logprobs.tokens.length, 4);
    assert.equal(r.choices[0].logprobs.token_logprobs.length, 4);
  });

  test('logprobs, streamed: the stream completes, and the server still serves', async () => {
    const r = await sse(`${server.baseURL}/completions`, { ...params, logprobs: 1, stream: true })
      .catch((e) => ({ broken: e.message }));
    let health;
    try {
      health = (await fetch(`${server.url}/health`)).status;
    } catch (e) {
      health = `no answer (${e.cause?.code ?? e.message}): kiln serve died`;
    }
    assert.equal(health, 200);
    assert.ok(!r.broken, `the stream broke: ${r.broken}`);
    assert.ok(r.done, 'saw [DONE]');
  });
});
