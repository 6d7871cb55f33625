// openai-node as the agent: a manual tool loop on Chat Completions (`--api chat`; stream with
// `chat.completions.stream()`, which assembles the chunks) or the Responses API
// (`--api responses`; stream with `responses.stream()`). See common.mjs.
import OpenAI from 'openai';
import { ALL_CASES, MAX_STEPS, PROMPT, TOOLS_SPEC, isStream, main, modelOf } from './common.mjs';

async function runChat(client, c, agent) {
  const messages = [{ role: 'user', content: PROMPT }];
  const tools = TOOLS_SPEC.map((t) => ({ type: 'function', function: t }));
  for (let i = 0; i < MAX_STEPS; i++) {
    const req = { model: modelOf(c), messages, tools };
    let msg;
    if (isStream(c)) {
      const s = client.chat.completions.stream({ ...req, stream_options: { include_usage: true } });
      for await (const _ of s);
      msg = (await s.finalChatCompletion()).choices[0].message;
    } else {
      msg = (await client.chat.completions.create(req)).choices[0].message;
    }
    if (!msg.tool_calls?.length) return msg.content ?? '';
    messages.push({ role: 'assistant', content: msg.content, tool_calls: msg.tool_calls });
    for (const tc of msg.tool_calls) {
      messages.push({ role: 'tool', tool_call_id: tc.id, content: agent.runTool(tc.function.name, tc.function.arguments) });
    }
  }
  throw new Error('no final answer within MAX_STEPS');
}

async function runResponses(client, c, agent) {
  const items = [{ role: 'user', content: PROMPT }];
  const tools = TOOLS_SPEC.map((t) => ({ type: 'function', ...t }));
  for (let i = 0; i < MAX_STEPS; i++) {
    const req = { model: modelOf(c), input: items, tools, store: false };
    let resp;
    if (isStream(c)) {
      const s = client.responses.stream(req);
      for await (const _ of s);
      resp = await s.finalResponse();
    } else {
      resp = await client.responses.create(req);
    }
    const calls = resp.output.filter((o) => o.type === 'function_call');
    if (!calls.length) return resp.output_text;
    items.push(...resp.output);
    for (const call of calls) {
      items.push({ type: 'function_call_output', call_id: call.call_id, output: agent.runTool(call.name, call.arguments) });
    }
  }
  throw new Error('no final answer within MAX_STEPS');
}

await main(async (base, c, agent, api) => {
  const client = new OpenAI({ baseURL: `${base}/v1`, apiKey: 'sk-compat', maxRetries: 0, timeout: 60_000 });
  return api === 'responses' ? runResponses(client, c, agent) : runChat(client, c, agent);
}, ALL_CASES);
