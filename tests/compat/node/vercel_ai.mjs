// The Vercel AI SDK (`ai`) as the agent: `generateText` / `streamText` with two tools and
// `stopWhen: stepCountIs(MAX_STEPS)`, the SDK running the tool loop itself, on
// `@ai-sdk/openai` Responses (`--api openai-responses`, the provider's default), Chat
// (`--api openai-chat`) or `@ai-sdk/anthropic` (`--api anthropic`). See common.mjs.
globalThis.AI_SDK_LOG_WARNINGS = false;
import { generateText, jsonSchema, stepCountIs, streamText, tool } from 'ai';
import { createOpenAI } from '@ai-sdk/openai';
import { createAnthropic } from '@ai-sdk/anthropic';
import { ALL_CASES, MAX_STEPS, PROMPT, TOOLS_SPEC, isStream, main, modelOf } from './common.mjs';

function model(base, c, api) {
  if (api === 'anthropic') return createAnthropic({ baseURL: `${base}/v1`, apiKey: 'sk-ant-compat' })(modelOf(c));
  const openai = createOpenAI({ baseURL: `${base}/v1`, apiKey: 'sk-compat' });
  return api === 'openai-chat' ? openai.chat(modelOf(c)) : openai.responses(modelOf(c));
}

await main(async (base, c, agent, api) => {
  const tools = Object.fromEntries(
    TOOLS_SPEC.map((t) => [
      t.name,
      tool({ description: t.description, inputSchema: jsonSchema(t.parameters), execute: async (args) => agent.runTool(t.name, args) }),
    ]),
  );
  const opts = { model: model(base, c, api), tools, prompt: PROMPT, stopWhen: stepCountIs(MAX_STEPS), maxRetries: 0, maxOutputTokens: 1024 };
  if (isStream(c)) {
    let failure;
    const r = streamText({ ...opts, onError: ({ error }) => { failure = error; } });
    await r.consumeStream();
    if (failure) throw failure;
    return await r.text;
  }
  return (await generateText(opts)).text;
}, ALL_CASES);
