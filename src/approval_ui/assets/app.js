// turnguard approval page: the expiry countdown and live updates (GET /approvals/events).
// No state changes here: accepting and rejecting are plain form posts with the CSRF token.
"use strict";
(function () {
  var list = document.getElementById("approvals");
  var skew = 0;
  if (list && list.dataset.now) {
    skew = Number(list.dataset.now) - Date.now();
  }
  function tick() {
    var now = Date.now() + skew;
    document.querySelectorAll("time[data-expires]").forEach(function (t) {
      var left = Math.max(0, Math.floor((Number(t.dataset.expires) - now) / 1000));
      if (left === 0) {
        t.textContent = "now: the calls are refused unless you answered";
        var card = t.closest(".card");
        if (card) card.classList.add("expired");
        return;
      }
      var m = Math.floor(left / 60), s = left % 60;
      t.textContent = "in " + m + ":" + (s < 10 ? "0" : "") + s;
    });
  }
  tick();
  setInterval(tick, 1000);

  // Live updates: reload when the list changes, unless the person is typing.
  if (!list || typeof EventSource === "undefined") return;
  var busy = false;
  document.addEventListener("input", function () { busy = true; });
  document.addEventListener("submit", function () { busy = true; es.close(); });
  var shown = {};
  document.querySelectorAll("[data-interrupt]").forEach(function (c) { shown[c.dataset.interrupt] = true; });
  var live = document.getElementById("live");
  var es = new EventSource("/approvals/events");
  function changed(text) {
    if (!busy) { window.location.reload(); return; }
    if (live) { live.textContent = text; live.hidden = false; }
  }
  es.addEventListener("interrupt.requested", function (e) {
    var d = JSON.parse(e.data);
    if (!shown[d.interruptId]) changed("A new call waits for your approval: reload the page to see it.");
  });
  es.addEventListener("interrupt.resolved", function (e) {
    var d = JSON.parse(e.data);
    if (shown[d.interruptId]) changed("An approval on this page was resolved elsewhere: reload the page.");
  });
})();
