// `kiln serve --chat-template tests/data/chat/chatml.jinja` as the official `openai` client's
// chat.completions meets it, against OpenAI's documented shapes ("chat.completion",
// choices[i].message, "chat.completion.chunk" with choices[i].delta). The independent truth: the same
// messages rendered here with @huggingface/jinja from the template file, encoded here with
// @lenml/tokenizers from models/kiln-tiny/tokenizer.json without special tokens (as Hugging Face's
// apply_chat_template does: the template writes them), sent to /v1/completions as token ids with
// the same sampling fields: the texts must be equal.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';

import { chatml, chatTemplate, client, importDep, modelDir, modelName, OpenAI, sse,
         startServer } from './harness.mjs';

const { Template } = await importDep('@huggingface/jinja/dist/index.js');
const { TokenizerLoader } = await importDep('@lenml/tokenizers/dist/main.mjs');
const template = new Template(readFileSync(chatTemplate, 'utf8'));
const tokenizerJSON = JSON.parse(readFileSync(join(modelDir, 'tokenizer.json'), 'utf8'));
const tokenizer = TokenizerLoader.fromPreTrained({
  tokenizerJSON,
  tokenizerConfig: { tokenizer_class: 'PreTrainedTokenizerFast', bos_token: '<|bos|>', eos_token: '<|eos|>' },
});
const bos = tokenizerJSON.added_tokens.find((t) => t.content === '<|bos|>').id;

const render = (messages) => template.render({ messages, add_generation_prompt: true });
const encode = (text) => tokenizer.encode(text, { add_special_tokens: false });

const system = { role: 'system', content: 'You are a storyteller. Keep it short.' };
const user = { role: 'user', content: 'Tell me about a cat.' };

describe('openai client: /v1/chat/completions', () => {
  let server;
  let openai;
  before(async () => {
    server = await startServer();
    openai = client(server);
  });
  after(async () => {
    if (server) await server.stop();
  });

  // /v1/completions on the messages as the template and tokenizer make them, here.
  async function truth(messages, params) {
    const ids = encode(render(messages));
    const r = await openai.completions.create({ model: modelName, prompt: ids, ...params });
    assert.equal(r.usage.prompt_tokens, ids.length);
    return r;
  }

  test('the truth is sound: the template rendered by @huggingface/jinja is ChatML, the JS tokenizer is kiln\'s', async () => {
    const messages = [system, user];
    const text = render(messages);
    assert.equal(text, chatml(messages));
    assert.equal(text, '<|im_start|>system\nYou are a storyteller. Keep it short.<|im_end|>\n' +
                       '<|im_start|>user\nTell me about a cat.<|im_end|>\n<|im_start|>assistant\n');
    // kiln encodes a text prompt with the BOS first; as ids, with the BOS put first, it is the same.
    const params = { model: modelName, max_tokens: 12, temperature: 0 };
    const asText = await openai.completions.create({ ...params, prompt: text });
    const asIds = await openai.completions.create({ ...params, prompt: [bos, ...encode(text)] });
    assert.equal(asText.usage.prompt_tokens, encode(text).length + 1);
    assert.equal(asText.choices[0].text, asIds.choices[0].text);
  });

  test('a chat completion: OpenAI\'s shape, and the completion of the rendered messages', async () => {
    const params = { max_tokens: 16, temperature: 0 };
    const r = await openai.chat.completions.create({ model: modelName, messages: [user], ...params });
    assert.equal(r.object, 'chat.completion');
    assert.equal(typeof r.id, 'string');
    assert.equal(typeof r.created, 'number');
    assert.equal(r.model, modelName);
    assert.equal(r.choices.length, 1);
    const [choice] = r.choices;
    assert.equal(choice.index, 0);
    assert.equal(choice.message.role, 'assistant');
    assert.equal(typeof choice.message.content, 'string');
    assert.ok(['stop', 'length'].includes(choice.finish_reason), choice.finish_reason);
    assert.equal(r.usage.prompt_tokens + r.usage.completion_tokens, r.usage.total_tokens);
    const t = await truth([user], params);
    assert.equal(choice.message.content, t.choices[0].text);
    assert.equal(choice.finish_reason, t.choices[0].finish_reason);
    assert.deepEqual(r.usage, t.usage);
  });

  test('system + user, sampled with a seed, equals the completion with that seed', async () => {
    const params = { max_tokens: 24, temperature: 1, seed: 2024 };
    const r = await openai.chat.completions.create({ model: modelName, messages: [system, user], ...params });
    const t = await truth([system, user], params);
    assert.equal(r.choices[0].message.content, t.choices[0].text);
    assert.equal(r.usage.completion_tokens, t.usage.completion_tokens);
  });

  test('a conversation (user, assistant, user) equals the completion of its rendering', async () => {
    const messages = [system, user, { role: 'assistant', content: 'The cat sat on the mat.' },
                      { role: 'user', content: 'And then?' }];
    const params = { max_tokens: 12, temperature: 0 };
    const r = await openai.chat.completions.create({ model: modelName, messages, ...params });
    assert.equal(r.choices[0].message.content, (await truth(messages, params)).choices[0].text);
  });

  test('max_completion_tokens: that many tokens, finish_reason length', async () => {
    for (const n of [1, 7]) {
      const r = await openai.chat.completions.create({
        model: modelName, messages: [user], max_completion_tokens: n, temperature: 0,
      });
      assert.equal(r.choices[0].finish_reason, 'length');
      assert.equal(r.usage.completion_tokens, n);
      assert.equal(r.choices[0].message.content, (await truth([user], { max_tokens: n, temperature: 0 })).choices[0].text);
    }
  });

  test('streaming: role first, content pieces, the finish, usage, [DONE]; equal to the non-streamed', async () => {
    const params = { model: modelName, messages: [system, user], max_tokens: 16, temperature: 0 };
    const whole = await openai.chat.completions.create(params);
    const stream = await openai.chat.completions.create({ ...params, stream: true, stream_options: { include_usage: true } });
    const chunks = [];
    for await (const chunk of stream) chunks.push(chunk);
    assert.ok(chunks.length >= 3);
    for (const chunk of chunks) {
      assert.equal(chunk.object, 'chat.completion.chunk');
      assert.equal(chunk.id, chunks[0].id);
      assert.equal(chunk.model, modelName);
    }
    assert.equal(chunks[0].choices[0].delta.role, 'assistant', 'the first delta carries the role');
    for (const chunk of chunks.slice(1)) for (const c of chunk.choices) assert.ok(!c.delta.role || c.delta.role === 'assistant');
    const usageChunk = chunks.at(-1);
    assert.deepEqual(usageChunk.choices, []);
    assert.deepEqual(usageChunk.usage, whole.usage);
    const content = chunks.flatMap((c) => c.choices).map((c) => c.delta.content ?? '').join('');
    assert.equal(content, whole.choices[0].message.content);
    const finishes = chunks.flatMap((c) => c.choices).filter((c) => c.finish_reason);
    assert.equal(finishes.length, 1);
    assert.equal(finishes[0].finish_reason, whole.choices[0].finish_reason);
    assert.ok(chunks.at(-2).choices[0].finish_reason, 'the finish is on the last chunk before the usage');

    const raw = await sse(`${server.baseURL}/chat/completions`, { ...params, stream: true });
    assert.equal(raw.status, 200, raw.body);
    assert.match(raw.contentType, /^text\/event-stream/);
    assert.equal(raw.raw.at(-1), '[DONE]');
    assert.ok(!raw.afterDone);
    assert.equal(raw.events.map((e) => e.choices[0]?.delta?.content ?? '').join(''), whole.choices[0].message.content);
  });

  test('n: 3 with a seed: distinct indices, choice i equals a single request seeded seed + i', async () => {
    const params = { model: modelName, messages: [user], max_tokens: 12, temperature: 1, seed: 77 };
    const r = await openai.chat.completions.create({ ...params, n: 3 });
    assert.equal(r.choices.length, 3);
    assert.deepEqual(r.choices.map((c) => c.index).sort(), [0, 1, 2]);
    let completion = 0;
    for (const c of r.choices) {
      const single = await openai.chat.completions.create({ ...params, seed: params.seed + c.index });
      assert.equal(c.message.content, single.choices[0].message.content, `choice ${c.index}`);
      assert.equal(c.message.role, 'assistant');
      completion += single.usage.completion_tokens;
    }
    assert.equal(r.usage.completion_tokens, completion);
    assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + completion);

    // Streamed: each index's first delta has the role, and the pieces make the same choices.
    const stream = await openai.chat.completions.create({ ...params, n: 3, stream: true });
    const contents = ['', '', ''];
    const sawRole = [false, false, false];
    for await (const chunk of stream) {
      for (const c of chunk.choices) {
        if (!sawRole[c.index]) assert.equal(c.delta.role, 'assistant', `choice ${c.index}'s first delta`);
        sawRole[c.index] = true;
        contents[c.index] += c.delta.content ?? '';
      }
    }
    for (const c of r.choices) assert.equal(contents[c.index], c.message.content, `streamed choice ${c.index}`);
  });

  test('stop: the content ends before the stop string, finish_reason stop', async () => {
    const params = { model: modelName, messages: [user], max_tokens: 24, temperature: 0 };
    const full = (await openai.chat.completions.create(params)).choices[0].message.content;
    let at = Math.floor(full.length / 2);
    while (at < full.length - 3 && full.slice(at, at + 3).trim().length < 2) ++at;
    const stop = full.slice(at, at + 3);
    assert.ok(stop.trim().length >= 2, `no stop string in ${JSON.stringify(full)}`);
    const r = await openai.chat.completions.create({ ...params, stop: [stop] });
    assert.equal(r.choices[0].message.content, full.slice(0, full.indexOf(stop)));
    assert.equal(r.choices[0].finish_reason, 'stop');
  });

  test('logprobs: per token, the completion\'s token logprobs', async () => {
    const params = { max_tokens: 6, temperature: 0 };
    const r = await openai.chat.completions.create({
      model: modelName, messages: [user], ...params, logprobs: true, top_logprobs: 2,
    });
    const content = r.choices[0].logprobs?.content;
    assert.ok(Array.isArray(content), `choices[0].logprobs.content: ${JSON.stringify(r.choices[0].logprobs)}`);
    assert.equal(content.length, 6);
    assert.equal(content.map((t) => t.token).join(''), r.choices[0].message.content);
    const t = await truth([user], { ...params, logprobs: 2 });
    for (let i = 0; i < content.length; ++i) {
      assert.ok(Math.abs(content[i].logprob - t.choices[0].logprobs.token_logprobs[i]) < 1e-5);
      assert.ok(Array.isArray(content[i].top_logprobs) && content[i].top_logprobs.length === 2);
      assert.ok(Array.isArray(content[i].bytes));
    }
  });

  test('bad requests: BadRequestError naming the field, NotFoundError for another model', async () => {
    const cases = [
      [{ messages: [] }, 'messages'],
      [{ messages: 'hi' }, 'messages'],
      [{ messages: [{ role: 'user' }] }, 'messages'],
      [{ temperature: 5 }, 'temperature'],
      [{ n: 99 }, 'n'],
      [{ max_completion_tokens: -1 }, 'max_completion_tokens'],
    ];
    for (const [fields, param] of cases) {
      await assert.rejects(openai.chat.completions.create({ model: modelName, messages: [user], max_tokens: 4, ...fields }),
        (e) => {
          assert.ok(e instanceof OpenAI.BadRequestError, `${JSON.stringify(fields)}: ${e}`);
          assert.equal(e.status, 400);
          // OpenAI names a message's own field as messages[i].field: the field or a part of it.
          assert.ok(e.param === param || e.param?.startsWith(`${param}[`), `${JSON.stringify(fields)}: param ${e.param}, ${e.message}`);
          return true;
        });
    }
    await assert.rejects(openai.chat.completions.create({ model: 'gpt-4o', messages: [user] }), (e) => {
      assert.ok(e instanceof OpenAI.NotFoundError, String(e));
      assert.equal(e.status, 404);
      return true;
    });
  });
});
