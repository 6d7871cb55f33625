// Shared by the Node clients of the compatibility suite (tests/compat/node/*.mjs); the same
// protocol as tests/compat/py/common.py:
//
//   node CLIENT.mjs --base-url http://127.0.0.1:PORT --cases loop,loop-stream,... [--api API]
//
// Case `C` uses the model `compat-C`; for each case one line
//   RESULT {"case", "ok", "text", "calls", "error"}
// is printed. tests/it/compat.rs decides pass or fail.

export const PROMPT = 'Look up the weather in Paris and save a note about it. Use the tools.';
export const MAX_STEPS = 6;

export const TOOLS_SPEC = [
  {
    name: 'get_weather',
    description: 'The current weather in a city.',
    parameters: {
      type: 'object',
      properties: { city: { type: 'string', description: 'City name' } },
      required: ['city'],
      additionalProperties: false,
    },
  },
  {
    name: 'save_note',
    description: 'Save a note for the user (a write: turnguard gates it in an untrusted turn).',
    parameters: {
      type: 'object',
      properties: { text: { type: 'string', description: 'The note' } },
      required: ['text'],
      additionalProperties: false,
    },
  },
];

const FUNCS = {
  get_weather: ({ city }) => `sunny, 21 C in ${city}`,
  save_note: ({ text }) => `saved: ${text}`,
};

export class Agent {
  constructor() {
    this.calls = [];
  }
  runTool(name, args) {
    if (typeof args === 'string') args = args.trim() ? JSON.parse(args) : {};
    this.calls.push(name);
    const fn = FUNCS[name];
    return fn ? fn(args ?? {}) : `unknown tool ${name}`;
  }
}

export const modelOf = (c) => `compat-${c}`;
export const isStream = (c) => c.endsWith('-stream');

function parseArgs(argv) {
  const out = {};
  for (let i = 0; i < argv.length; i += 2) out[argv[i].replace(/^--/, '')] = argv[i + 1];
  return out;
}

export async function main(runCase, supported) {
  const args = parseArgs(process.argv.slice(2));
  const base = (args['base-url'] ?? '').replace(/\/$/, '');
  for (const c of (args.cases ?? '').split(',')) {
    const agent = new Agent();
    const out = { case: c, ok: false, text: '', calls: agent.calls, error: null };
    if (!supported.has(c)) {
      out.error = 'unsupported case';
    } else {
      try {
        out.text = (await runCase(base, c, agent, args.api ?? '')) ?? '';
        out.ok = true;
      } catch (e) {
        out.error = `${e?.constructor?.name ?? 'Error'}: ${e?.message ?? e}`;
        console.error(e);
      }
    }
    console.log('RESULT ' + JSON.stringify(out));
  }
}

export const ALL_CASES = new Set(['loop', 'loop-stream', 'truncated', 'truncated-stream', 'error', 'error-stream']);
