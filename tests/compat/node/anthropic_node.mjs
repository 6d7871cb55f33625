// @anthropic-ai/sdk as the agent: a manual tool loop on the Messages API, non-stream
// (`messages.create`) and stream (`messages.stream()` + `finalMessage()`). See common.mjs.
import Anthropic from '@anthropic-ai/sdk';
import { ALL_CASES, MAX_STEPS, PROMPT, TOOLS_SPEC, isStream, main, modelOf } from './common.mjs';

await main(async (base, c, agent) => {
  const client = new Anthropic({ baseURL: base, apiKey: 'sk-ant-compat', maxRetries: 0, timeout: 60_000 });
  const tools = TOOLS_SPEC.map((t) => ({ name: t.name, description: t.description, input_schema: t.parameters }));
  const messages = [{ role: 'user', content: PROMPT }];
  for (let i = 0; i < MAX_STEPS; i++) {
    const req = { model: modelOf(c), max_tokens: 1024, messages, tools };
    const msg = isStream(c) ? await client.messages.stream(req).finalMessage() : await client.messages.create(req);
    const uses = msg.content.filter((b) => b.type === 'tool_use');
    if (!uses.length) return msg.content.filter((b) => b.type === 'text').map((b) => b.text).join('');
    messages.push({ role: 'assistant', content: msg.content });
    messages.push({
      role: 'user',
      content: uses.map((u) => ({ type: 'tool_result', tool_use_id: u.id, content: agent.runTool(u.name, u.input) })),
    });
  }
  throw new Error('no final answer within MAX_STEPS');
}, ALL_CASES);
