"""Render a status snapshot as one self-contained HTML page.

No scripts, no external assets: a `meta refresh` reloads it, so it works behind any
proxy. With API keys set the page needs the bearer header like `/v1/*` (curl, or a
browser extension that adds it). Every value is escaped; reasons appear as tooltips.
"""

from __future__ import annotations

from html import escape
from typing import Any

REFRESH_S = 5

_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em}h2{font-size:1.05em;margin-top:1.5em}
table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left}
th{background:#f3f3f3}.ok{color:#176f2c;font-weight:600}.bad{color:#b00020;font-weight:600}
.muted{color:#777}
"""


def _cell(value: Any) -> str:
    if value is None:
        return '<td class="muted">-</td>'
    if isinstance(value, bool):
        return f'<td class="{"ok" if value else "bad"}">{"yes" if value else "no"}</td>'
    return f"<td>{escape(str(value))}</td>"


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    if not rows:
        return '<p class="muted">none</p>'
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(_cell(v) for v in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _decisions(decisions: dict[str, Any]) -> str:
    parts = []
    for name, decision in sorted(decisions.items()):
        if not isinstance(decision, dict):
            decision = {"value": decision}
        reason = escape(str(decision.get("reason", "")), quote=True)
        value = escape(str(decision.get("value")))
        rule = escape(str(decision.get("rule", "")))
        parts.append(f'<span title="{reason}">{escape(name)} = <b>{value}</b> ({rule})</span>')
    return "<br>".join(parts)


def _plan_section(plan: dict[str, Any] | None) -> str:
    if plan is None:
        return '<p class="muted">no engine has reported a plan yet</p>'
    facts = _table(
        ["plan hash", "world size", "backend", "composition", "simulated"],
        [[str(plan["plan_hash"])[:12], plan["world_size"], plan["backend"],
          plan["composition"], plan["simulated"]]],
    )  # fmt: skip
    rows = "".join(
        f"<tr>{_cell(r['rank'])}{_cell(r['chip'])}{_cell(r['nax'])}"
        f"<td>{_decisions(r['decisions'])}</td></tr>"
        for r in plan["ranks"]
    )
    ranks = (
        "<table><tr><th>rank</th><th>chip</th><th>NAX</th><th>decisions (hover: why)</th></tr>"
        f"{rows}</table>"
    )
    return facts + "<br>" + ranks


def render(status: dict[str, Any]) -> str:
    traffic = status["traffic"]
    state = "ok" if status["ready"] else "bad"
    backends = _table(
        ["name", "kind", "healthy", "active", "in flight", "last ok (s ago)", "pid"],
        [
            [b["name"], b["kind"], b["healthy"], b["name"] == status["active_backend"],
             b["in_flight"], b["last_ok_seconds_ago"], b["pid"]]
            for b in status["backends"]
        ],
    )  # fmt: skip
    counters = _table(
        ["running", "waiting", "prompt tokens", "completion tokens", "MTP acceptance",
         "failovers", "retries"],
        [[f"{traffic['running']} / {traffic['max_running']}",
          f"{traffic['waiting']} / {traffic['max_queue']}",
          traffic["prompt_tokens"], traffic["completion_tokens"],
          traffic["speculative_acceptance_rate"], traffic["failovers"], traffic["retries"]]],
    )  # fmt: skip
    incidents = _table(
        ["backend", "kind", "exit code", "plan hash", "at"],
        [[i["backend"], i["kind"], i["exit_code"], str(i["plan_hash"] or "")[:12], i["at"]]
         for i in status["incidents"]],
    )  # fmt: skip
    draining = " (draining)" if status["draining"] else ""
    return (
        "<!doctype html><html><head><meta charset=utf-8>"
        f'<meta http-equiv="refresh" content="{REFRESH_S}">'
        f"<title>mlxserve: {escape(str(status['model']))}</title><style>{_STYLE}</style>"
        "</head><body>"
        f"<h1>mlxserve: {escape(str(status['model']))}</h1>"
        f'<p>Status: <span class="{state}">{escape(status["status"])}</span>{draining}'
        f" · up {status['uptime_s']} s · "
        '<a href="/status?format=json">JSON</a> · <a href="/metrics">metrics</a></p>'
        f"<h2>Traffic</h2>{counters}"
        f"<h2>Backends</h2>{backends}"
        f"<h2>Kernel policy plan</h2>{_plan_section(status['plan'])}"
        f"<h2>Incidents</h2>{incidents}"
        "</body></html>"
    )
