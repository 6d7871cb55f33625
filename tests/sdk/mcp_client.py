"""Drives the official MCP Python SDK (`mcp`) through turnguard's MCP front (tests/it/mcp.rs).

Usage: mcp_client.py PLAN_JSON

PLAN: {"url": "http://127.0.0.1:PORT/mcp/NAME", "mode": "legacy" | "2026-07-28",
       "headers": {...}, "elicit": null | {"action": "accept", "content": {...}},
       "steps": [{"op": "list"} | {"op": "call", "name": ..., "arguments": {...}}]}

Prints one JSON document: {"steps": [...], "elicitations": [messages asked], "session": bool}.
A `list` step gives the tools' names and annotations; a `call` step gives the result
(`isError`, `content` texts, `structuredContent`) or the JSON-RPC error (`code`, `message`,
`data`) the SDK raised, and the progress notifications seen during the call.
"""

import asyncio
import json
import sys

import httpx2
from mcp.client import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
import mcp_types as types


async def main(plan):
    elicitations = []
    elicit = plan.get("elicit")

    async def on_elicit(context, params):
        elicitations.append(params.message)
        return types.ElicitResult(action=elicit["action"], content=elicit.get("content"))

    http = httpx2.AsyncClient(headers=plan.get("headers", {}), timeout=httpx2.Timeout(30.0, read=60.0))
    transport = streamable_http_client(plan["url"], http_client=http)
    kwargs = {"mode": plan.get("mode", "legacy"), "cache": None}
    if elicit is not None:
        kwargs["elicitation_callback"] = on_elicit
    out = []
    async with Client(transport, **kwargs) as client:
        for step in plan["steps"]:
            if step["op"] == "list":
                result = await client.list_tools()
                out.append({
                    "tools": [
                        {"name": t.name,
                         "annotations": t.annotations.model_dump(exclude_none=True) if t.annotations else None}
                        for t in result.tools
                    ]
                })
            elif step["op"] == "call":
                progress = []

                async def on_progress(p, total, message):
                    progress.append(p)

                try:
                    r = await client.call_tool(step["name"], step.get("arguments", {}), progress_callback=on_progress)
                    out.append({
                        "isError": bool(r.is_error),
                        "texts": [c.text for c in r.content if getattr(c, "type", "") == "text"],
                        "structuredContent": r.structured_content,
                        "progress": progress,
                    })
                except MCPError as e:
                    out.append({"error": {"code": e.code, "message": e.message, "data": e.error.data}})
            else:
                raise SystemExit(f"unknown step {step!r}")
    print(json.dumps({"steps": out, "elicitations": elicitations}))


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
