#!/usr/bin/env python3
"""The approval page in headless Chromium (tests/it/approval_ui.rs starts turnguard, the
scripted OpenID Connect provider and the mock model, then runs this once).

    python approval_page.py --admin URL --data URL --tokens JSON --request JSON \
        --screenshot PNG --chromium /usr/bin/chromium

One browser, two contexts (alice on a phone-sized viewport, bob). The waiting agents are the
official openai SDK streaming a chat completion (in threads), with alice's data-plane token.
Scenarios, in order: sign in; a held call appears with its reason, arguments, policy revision
and countdown (screenshot); bob signs in, sees nothing and cannot resolve alice's call by id;
a POST without the CSRF token fails; accept -> the agent receives the call; reject -> the
agent's call is refused; edit the arguments and accept -> the agent receives the edited call.

Prints `{"checks": {...}, "agents": {...}}` as JSON; exits non-zero on any failed step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

os.environ["NO_PROXY"] = ",".join(filter(None, [os.environ.get("NO_PROXY"), "127.0.0.1", "localhost"]))
os.environ["no_proxy"] = os.environ["NO_PROXY"]

import openai  # noqa: E402
from playwright.sync_api import sync_playwright  # noqa: E402

# Debian's Chromium on this machine's closed network (see the project's env notes).
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def run_agent(data: str, token: str, run: str, request: dict, out: dict, key: str) -> threading.Thread:
    """Streams one chat completion through turnguard with the official SDK (in a thread)."""

    def go() -> None:
        try:
            client = openai.OpenAI(
                base_url=data + "/v1",
                api_key="sk-test",
                max_retries=0,
                timeout=180,
                default_headers={"Turnguard-Principal-Token": token, "Turnguard-Run": run},
            )
            stream = client.chat.completions.create(
                model=request["model"], messages=request["messages"], tools=request["tools"], stream=True
            )
            text, calls = [], {}
            for chunk in stream:
                for choice in chunk.choices:
                    if choice.delta.content:
                        text.append(choice.delta.content)
                    for tc in choice.delta.tool_calls or []:
                        c = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                        if tc.function and tc.function.name:
                            c["name"] += tc.function.name
                        if tc.function and tc.function.arguments:
                            c["arguments"] += tc.function.arguments
            out[key] = {
                "text": "".join(text),
                "tool_calls": [
                    {"name": c["name"], "arguments": json.loads(c["arguments"] or "{}")}
                    for _, c in sorted(calls.items())
                ],
                "error": None,
            }
        except Exception as e:  # reported to the Rust side
            out[key] = {"text": "", "tool_calls": [], "error": repr(e)}

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def sign_in(page, admin: str, user: str) -> str:
    page.goto(admin + "/ui/approvals")
    page.click("#sign-in")
    page.wait_for_selector("#user")
    page.fill("#user", user)
    page.click("#login")
    page.wait_for_selector("#who", timeout=30_000)
    return page.inner_text("#who")


def wait_card(page, seen: set, timeout: float = 90.0):
    """Waits for a card not seen before (the page reloads itself on the SSE event; reload by
    hand too, in case the event came before the page listened)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for _ in range(2):
            for card in page.query_selector_all("article.card"):
                iid = card.get_attribute("data-interrupt")
                if iid not in seen:
                    seen.add(iid)
                    return card, iid
            page.wait_for_timeout(500)
        page.reload()
    raise AssertionError("no new held call appeared on the page")


def flash(page) -> str:
    """The message the page shows after a resolution (with the page, when it does not)."""
    try:
        page.wait_for_selector("#flash", timeout=30_000)
    except Exception:
        sys.stderr.write(f"no flash at {page.url}:\n{page.content()}\n")
        raise
    return page.inner_text("#flash")


def post_status(page, iid: str, fields: dict) -> int:
    """A POST from the page itself (same origin, the session cookie goes with it)."""
    return page.evaluate(
        """async ([id, fields]) => (await fetch('/ui/approvals/' + id,
               {method: 'POST', body: new URLSearchParams(fields), redirect: 'manual'})).status""",
        [iid, fields],
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--admin", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--request", required=True)
    ap.add_argument("--screenshot", required=True)
    ap.add_argument("--chromium", required=True)
    args = ap.parse_args()
    tokens = json.loads(args.tokens)
    request = json.loads(args.request)
    checks: dict = {}
    agents: dict = {}
    seen: set = set()

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=args.chromium, headless=True, args=CHROMIUM_FLAGS)
        phone = browser.new_context(
            viewport={"width": 390, "height": 844}, device_scale_factor=2, is_mobile=True, has_touch=True
        )
        page = phone.new_page()
        dialogs: list = []
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        checks["signed_in_as"] = sign_in(page, args.admin, "alice")
        resp = page.goto(args.admin + "/ui/approvals")
        checks["csp"] = resp.headers.get("content-security-policy")

        # 1. A held call appears, with why it was held; then accept.
        t = run_agent(args.data, tokens["alice"], "ui-accept", request, agents, "accept")
        card, iid = wait_card(page, seen)
        checks["card_text"] = card.inner_text()
        checks["countdown"] = card.query_selector("time[data-expires]").inner_text()
        page.screenshot(path=args.screenshot, full_page=True)

        # Another person: nothing to see, and alice's call cannot be resolved by its id.
        other = browser.new_context(viewport={"width": 1024, "height": 768})
        bob = other.new_page()
        checks["bob_signed_in_as"] = sign_in(bob, args.admin, "bob")
        checks["bob_cards"] = len(bob.query_selector_all("article.card"))
        bob_csrf = bob.get_attribute("input[name=csrf]", "value")
        checks["bob_post_status"] = post_status(bob, iid, {"csrf": bob_csrf, "action": "accept"})
        other.close()

        # A POST without the session's CSRF token fails and resolves nothing.
        checks["csrf_less_status"] = post_status(page, iid, {"action": "accept"})
        page.reload()
        checks["still_pending_after_csrf_less"] = page.query_selector(f'article.card[data-interrupt="{iid}"]') is not None

        card = page.query_selector(f'article.card[data-interrupt="{iid}"]')
        card.query_selector("textarea[name=feedback]").fill("Fine, send it.")
        card.query_selector("button.accept").click()
        checks["accept_flash"] = flash(page)
        t.join(60)

        # 2. Reject: the agent's call is refused.
        t = run_agent(args.data, tokens["alice"], "ui-reject", request, agents, "reject")
        card, iid = wait_card(page, seen)
        # The model wrote markup into the arguments: shown as text, never run or rendered.
        checks["reject_card_text"] = card.inner_text()
        checks["reject_card_has_img"] = card.query_selector("img") is not None
        card.query_selector("button.reject").click()
        checks["reject_flash"] = flash(page)
        t.join(60)

        # 3. Edit the arguments, then accept with the edits.
        t = run_agent(args.data, tokens["alice"], "ui-edit", request, agents, "edit")
        card, iid = wait_card(page, seen)
        card.query_selector("details.edit summary").click()
        box = card.query_selector("details.edit textarea")
        checks["edit_box_shown"] = box.is_visible()
        edited = json.loads(box.input_value())
        edited["to"] = "bob@example.test"
        edited["body"] = "Your ticket PIN-5678 is attached. Regards"
        box.fill(json.dumps(edited, indent=2))
        card.query_selector("button.edit").click()
        checks["edit_flash"] = flash(page)
        t.join(60)
        checks["dialogs"] = dialogs
        browser.close()

    for k in ("accept", "reject", "edit"):
        if k not in agents:
            raise AssertionError(f"the {k} agent did not finish")
    json.dump({"checks": checks, "agents": agents}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
