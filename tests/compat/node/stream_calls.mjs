// Streams one request through turnguard with the official Node SDK and reports which tool
// calls the SDK assembled: the Node twin of tests/sdk/stream_calls.py (what the agent would
// execute; tests/it/attacks/upstream_bytes.rs).
//
//   node stream_calls.mjs --url http://HOST:PORT --api chat|messages --request JSON
//
// Prints one JSON line: {"calls": [tool names the SDK assembled], "error": "<name>: <message>"
// or null}. The Node SDKs decode the stream differently from the Python ones (each line
// through a WHATWG TextDecoder, which drops a leading byte-order mark), so a stream can read
// one way to one and another way to the other.
import Anthropic from '@anthropic-ai/sdk';
import OpenAI from 'openai';

process.env.NO_PROXY = [process.env.NO_PROXY, '127.0.0.1', 'localhost'].filter(Boolean).join(',');

function arg(name) {
  const i = process.argv.indexOf(name);
  if (i < 0 || i + 1 >= process.argv.length) throw new Error(`missing ${name}`);
  return process.argv[i + 1];
}

async function chat(url, req) {
  const client = new OpenAI({ baseURL: `${url}/v1`, apiKey: 'sk-test', maxRetries: 0, timeout: 60000 });
  const names = new Map();
  const stream = await client.chat.completions.create({ ...req, stream: true });
  for await (const chunk of stream) {
    for (const choice of chunk.choices ?? []) {
      for (const tc of choice.delta?.tool_calls ?? []) {
        if (tc.function?.name) names.set(tc.index, (names.get(tc.index) ?? '') + tc.function.name);
      }
    }
  }
  return [...names.keys()].sort((a, b) => a - b).map((k) => names.get(k));
}

async function messages(url, req) {
  const client = new Anthropic({ baseURL: url, apiKey: 'sk-ant-test', maxRetries: 0, timeout: 60000 });
  const { stream: _, ...rest } = req;
  const final = await client.messages.stream(rest).finalMessage();
  return final.content.filter((b) => b.type === 'tool_use').map((b) => b.name);
}

const url = arg('--url');
const api = arg('--api');
const req = JSON.parse(arg('--request'));
let calls = [];
let error = null;
try {
  calls = api === 'chat' ? await chat(url, req) : await messages(url, req);
} catch (e) {
  error = `${e?.name ?? 'Error'}: ${e?.message ?? e}`;
}
console.log(JSON.stringify({ calls, error }));
