// Live refresh of the pages that ask for it (<main data-live="SECONDS">):
// re-read the page and put its new <main> in place of the old one, while the
// tab is visible and no form field on the page is focused or filled in. The
// pages are whole documents without this script (no JavaScript: reload them).
(function () {
  "use strict";
  var main = document.querySelector("main[data-live]");
  if (!main || !window.fetch || !window.DOMParser) { return; }
  var seconds = parseFloat(main.getAttribute("data-live"));
  if (!(seconds >= 1)) { return; }
  // A notice (?done=...) is said once: later reads of the page leave it out.
  var url = new URL(window.location.href);
  url.searchParams.delete("done");
  url.searchParams.delete("n");
  var source = url.toString();
  var paused = false;
  var toggle = document.createElement("button");
  toggle.type = "button";
  toggle.className = "live-toggle";
  function label() {
    toggle.textContent = paused ? "Live: off" : "Live: every " + seconds + " s";
    toggle.setAttribute("aria-pressed", paused ? "false" : "true");
  }
  toggle.addEventListener("click", function () { paused = !paused; label(); });
  label();
  var header = document.querySelector("header.top");
  if (header) { header.appendChild(toggle); }

  function busy(root) {
    if (root.contains(document.activeElement) && document.activeElement !== root) { return true; }
    var fields = root.querySelectorAll("input:not([type=hidden]), select, textarea");
    for (var i = 0; i < fields.length; i++) {
      var f = fields[i];
      if (f.type === "checkbox" || f.type === "radio") {
        if (f.checked !== f.defaultChecked) { return true; }
      } else if (f.tagName === "SELECT") {
        for (var j = 0; j < f.options.length; j++) {
          if (f.options[j].selected !== f.options[j].defaultSelected) { return true; }
        }
      } else if (f.value !== f.defaultValue) { return true; }
    }
    return false;
  }

  function refresh() {
    var current = document.querySelector("main[data-live]");
    if (paused || document.hidden || !current || busy(current)) { return; }
    fetch(source, {credentials: "same-origin", headers: {"Accept": "text/html"}})
      .then(function (response) { return response.ok ? response.text() : null; })
      .then(function (text) {
        if (text === null) { return; }
        var page = new DOMParser().parseFromString(text, "text/html");
        var fresh = page.querySelector("main[data-live]");
        var now = document.querySelector("main[data-live]");
        if (fresh && now && !busy(now)) {
          now.innerHTML = fresh.innerHTML;
          var footer = page.querySelector("footer");
          var old = document.querySelector("footer");
          if (footer && old) { old.textContent = footer.textContent; }
        }
      })
      .catch(function () { /* the next turn tries again */ });
  }
  window.setInterval(refresh, seconds * 1000);
}());
