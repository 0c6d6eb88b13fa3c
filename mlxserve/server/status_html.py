"""Render a status snapshot as the dashboard: one self-contained HTML page.

Everything it needs is inline (its script and style are files beside this module,
read once): no CDN, nothing from outside this server, so it works on an offline
Mac. The server renders every table, so `curl /status` reads without a browser;
the script (`status_page.js`) then polls `/status?format=json` and draws the
history as SVG charts. Every value is escaped here and reaches the page through
`textContent` there; reasons appear as tooltips. Colours carry meaning: green for
health, red for faults, amber for what needs a look (warnings, overrides,
failovers); facts such as "simulated" or "NAX" are plain text.
"""

from __future__ import annotations

import functools
import json
from html import escape
from importlib import resources
from typing import Any

#: Charts, in the page's order: element id, title.
CHARTS = (
    ("chart-tokens", "Tokens per second"),
    ("chart-requests", "Requests per second"),
    ("chart-ttft", "Time to first token (percentiles)"),
    ("chart-itl", "Inter-token latency (percentiles)"),
    ("chart-steps", "Step time per backend (engine's p99)"),
    ("chart-memory", "Memory per backend (rank 0's MLX memory)"),
    ("chart-acceptance", "MTP acceptance per draft position"),
    ("chart-depth", "Speculative depth in use"),
    ("chart-queue", "Slots and queue"),
)
TILES = (
    ("tile-tokens", "generating"),
    ("tile-running", "running / slots"),
    ("tile-waiting", "waiting / queue"),
    ("tile-ttft", "TTFT p50"),
    ("tile-itl", "inter-token p50"),
    ("tile-acceptance", "MTP acceptance"),
    ("tile-completion", "tokens generated"),
    ("tile-failovers", "failovers / failbacks"),
)


@functools.cache
def _asset(name: str) -> str:
    return resources.files("mlxserve.server").joinpath(name).read_text(encoding="utf-8")


def _cell(value: Any, css: str = "") -> str:
    if value is None:
        return '<td class="muted">-</td>'
    if isinstance(value, bool):
        value = "yes" if value else "no"
    attr = f' class="{css}"' if css else ""
    return f"<td{attr}>{escape(str(value))}</td>"


def _health(value: bool | None) -> str:
    """A yes/no that means health: green when good, red when not."""
    if value is None:
        return _cell(None)
    return _cell(value, "ok" if value else "bad")


def _active(active: bool) -> str:
    """Green for the backend serving; "no" is the normal state of a standby, not a fault."""
    return _cell(active, "ok" if active else "")


def _table(table_id: str, headers: list[str], rows: list[str], hidden: bool = False) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    style = ' style="display:none"' if hidden else ""
    return (
        f'<table id="{table_id}"{style}><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table>"
    )


def _decisions(decisions: dict[str, Any]) -> str:
    parts = []
    for name, decision in sorted(decisions.items()):
        if not isinstance(decision, dict):
            decision = {"value": decision}
        reason = escape(str(decision.get("reason", "")), quote=True)
        value = escape(str(decision.get("value")))
        rule = escape(str(decision.get("rule", "")))
        css = ' class="warn"' if decision.get("rule") == "override" else ""
        parts.append(f'<span title="{reason}"{css}>{escape(name)} = <b>{value}</b> ({rule})</span>')
    return "<br>".join(parts)


def _gib(count: Any) -> str | None:
    return f"{count / 2**30:.1f} GiB" if isinstance(count, int | float) else None


def _plan_section(plan: dict[str, Any] | None) -> str:
    if plan is None:
        return '<p class="muted">no engine has reported a plan yet</p>'
    split = plan.get("split") or {}
    shares = "+".join(str(s) for s in split.get("shares") or []) or None
    facts = _table(
        "plan-facts",
        ["plan hash", "world size", "backend", "composition", "simulated", "split"],
        [
            "<tr>"
            + _cell(str(plan["plan_hash"])[:12])
            + _cell(plan["world_size"])
            + _cell(plan["backend"])
            + _cell(str(plan["composition"]).replace("_", " "))
            + _cell(plan["simulated"])
            + f'<td title="{escape(str(split.get("reason", "")), quote=True)}">'
            f"{escape(str(shares or '-'))} ({escape(str(split.get('rule', '-')))})</td>" + "</tr>"
        ],
    )
    rows = [
        "<tr>"
        + _cell(r["rank"])
        + _cell(r["chip"])
        + _cell(r["nax"])
        + _cell(_gib(r.get("memory_bytes")))
        + _cell(_gib(r.get("held_bytes")))
        + f"<td>{_decisions(r['decisions'])}</td></tr>"
        for r in plan["ranks"]
    ]
    ranks = _table(
        "plan-ranks",
        ["rank", "chip", "NAX", "memory", "weights held", "decisions (hover: why)"],
        rows,
    )
    world = _decisions(plan.get("world") or {})
    notes = [
        f'<li class="warn">override {escape(str(o.get("key")))}={escape(str(o.get("value")))} '
        f"({escape(str(o.get('source')))}) on "
        + escape(
            "the cluster"
            if o.get("applied_to") is None
            else "rank(s) " + ", ".join(str(r) for r in o["applied_to"])
            if o.get("applied_to")
            else "no rank (the targeted decisions are not overridable)"
        )
        + "</li>"
        for o in plan.get("overrides") or []
    ]
    notes += [
        f'<li class="warn">warning [{escape(str(w.get("rule")))}]: '
        f"{escape(str(w.get('message')))}</li>"
        for w in plan.get("warnings") or []
    ]
    listed = f"<ul>{''.join(notes)}</ul>" if notes else ""
    return f"{facts}<br>{ranks}<p>world: {world}</p>{listed}"


def _tiles() -> str:
    return "".join(
        f'<div class="tile"><div class="label">{escape(label)}</div>'
        f'<div class="value" id="{tile}">-</div></div>'
        for tile, label in TILES
    )


def _charts() -> str:
    return "".join(
        f'<div class="chart" id="{chart}"><h3>{escape(title)}</h3>'
        f'<svg role="img" aria-label="{escape(title, quote=True)}"></svg>'
        '<div class="legend"></div></div>'
        for chart, title in CHARTS
    )


def _backends(status: dict[str, Any]) -> str:
    rows = [
        "<tr>"
        + _cell(b["name"])
        + _cell(b["kind"])
        + _health(b["healthy"])
        + _active(b["name"] == status["active_backend"])
        + _cell(b["in_flight"], "num")
        + _cell(None)
        + _cell(None)
        + _cell(b["last_ok_seconds_ago"], "num")
        + _cell(b.get("speculative_depth"))
        + _cell(b["pid"])
        + "</tr>"
        for b in status["backends"]
    ]  # fmt: skip
    headers = ["name", "kind", "healthy", "active", "in flight", "step p99 (ms)",
               "memory", "last ok (s ago)", "speculative depth", "pid"]  # fmt: skip
    return _table("backends", headers, rows)


def _incidents(status: dict[str, Any]) -> str:
    rows = []
    for i in reversed(status["incidents"]):
        evidence = ", ".join(f"{k}={v}" for k, v in (i.get("evidence") or {}).items())
        shown = "\n".join(part for part in (evidence, *i.get("output_tail", [])) if part)
        rows.append(
            "<tr>"
            + _cell(i["at"])
            + _cell(i["backend"])
            + _cell(i["kind"], "bad")
            + _cell(i["exit_code"], "num")
            + _cell(str(i["plan_hash"] or "")[:12])
            + _cell(shown or None, "evidence")
            + "</tr>"
        )
    table = _table(
        "incidents",
        ["at", "backend", "kind", "exit code", "plan hash", "evidence"],
        rows,
        hidden=not rows,
    )
    hidden = ' style="display:none"' if rows else ""
    return f'<p class="muted" id="no-incidents"{hidden}>none</p>{table}'


def _initial(status: dict[str, Any]) -> str:
    """The snapshot for the script, safe inside <script>: no '<' reaches the HTML parser."""
    return json.dumps(status).replace("<", "\\u003c").replace("&", "\\u0026")


def render(status: dict[str, Any]) -> str:
    state = "ok" if status["ready"] else "bad"
    draining = " (draining)" if status["draining"] else ""
    model = escape(str(status["model"]))
    aliases = status.get("model_aliases") or []
    also = f"also answers to: {escape(', '.join(aliases))}" if aliases else ""
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<link rel="icon" href="data:,">'  # no /favicon.ico request (a 404 in the console)
        f"<title>mlxserve: {model}</title><style>{_asset('status_page.css')}</style>"
        "</head><body>"
        f"<header><h1>mlxserve: {model}</h1>"
        f'<span>Status: <span id="status" class="{state}">'
        f"{escape(status['status'])}{draining}</span></span>"
        f'<span id="uptime">up {status["uptime_s"]} s</span>'
        f'<span class="muted">{also}</span>'
        '<span><a href="/status?format=json">JSON</a> · <a href="/v1/status">/v1/status</a>'
        ' · <a href="/metrics">metrics</a></span>'
        '<span id="offline" class="bad"></span></header><main>'
        '<div id="auth"><form id="auth-form">This server needs an API key for its status: '
        '<input id="auth-key" type="password" autocomplete="off"> '
        "<button>use it</button> (kept in this tab only)</form></div>"
        f'<div class="tiles">{_tiles()}</div>'
        f'<h2>Last minutes</h2><div class="charts">{_charts()}</div>'
        '<h2>Failovers and incidents</h2><div class="chart timeline" id="timeline">'
        '<svg role="img" aria-label="timeline of failovers and incidents"></svg></div>'
        f'<p class="muted" id="no-events">no failover or incident yet</p><ul id="events"></ul>'
        f"<h2>Backends</h2>{_backends(status)}"
        f"<h2>Kernel policy plan</h2>{_plan_section(status['plan'])}"
        f"<h2>Incidents</h2>{_incidents(status)}"
        "</main>"
        f'<script type="application/json" id="initial">{_initial(status)}</script>'
        f"<script>{_asset('status_page.js')}</script>"
        "</body></html>"
    )
