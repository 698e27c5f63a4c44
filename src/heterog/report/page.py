"""The report page: one self-contained HTML file (inline CSS and SVG, no scripts, no fonts,
no network requests) that reads in light and dark mode (prefers-color-scheme)."""

from __future__ import annotations

from html import escape

CSS = """
:root{color-scheme:light dark;--bg:#fff;--fg:#1b1f24;--muted:#57606a;--line:#d0d7de;--lane:#f3f4f6;
--forward:#2f6fdb;--backward:#8250df;--optimizer:#1a7f37;--compute:#2f6fdb;--sync:#cf222e;
--transfer:#bc4c00;--tp:#9a6700;--mem:#2f6fdb;--over:#cf222e;--share:#2f6fdb;--chosen:#fff8c5}
@media (prefers-color-scheme:dark){:root{--bg:#0d1117;--fg:#e6edf3;--muted:#9198a1;--line:#30363d;
--lane:#161b22;--forward:#4c8dff;--backward:#a371f7;--optimizer:#3fb950;--compute:#4c8dff;
--sync:#ff7b72;--transfer:#f0883e;--tp:#d29922;--mem:#4c8dff;--over:#ff7b72;--share:#4c8dff;--chosen:#3d3000}}
body{background:var(--bg);color:var(--fg);font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;
margin:24px auto;max-width:1180px;padding:0 16px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid var(--line)}
.muted,caption{color:var(--muted)}caption{text-align:left;caption-side:top;padding:4px 0}
.kpis{display:flex;gap:28px;flex-wrap:wrap;margin:12px 0}.kpis div b{display:block;font-size:20px}
table{border-collapse:collapse;margin:6px 0}th,td{padding:3px 8px;border-bottom:1px solid var(--line);
text-align:left}td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.chosen{background:var(--chosen)}.bad{color:var(--over)}
.scroll{overflow-x:auto}
table.placement td.share{min-width:22px;text-align:center;font-variant-numeric:tabular-nums;padding:2px 3px;
border-left:1px solid var(--line)}
table.placement td.share.on{background:color-mix(in srgb,var(--share) calc(var(--s)*70% + 15%),transparent)}
table.placement th.vertical{writing-mode:vertical-rl;transform:rotate(180deg);font-weight:normal;
font-size:11px;padding:4px 1px}
svg text{fill:var(--fg);font:11px system-ui,sans-serif}svg text.label{text-anchor:end}
svg text.tick{fill:var(--muted);text-anchor:middle}svg .grid{stroke:var(--line);stroke-width:1}
svg .lane-bg{fill:var(--lane)}svg .k-forward{fill:var(--forward)}svg .k-backward{fill:var(--backward)}
svg .k-optimizer{fill:var(--optimizer)}svg .k-compute{fill:var(--compute)}svg .k-sync{fill:var(--sync)}
svg .k-transfer{fill:var(--transfer)}svg .k-tp{fill:var(--tp)}
svg .k-collective{fill:var(--sync)}svg .mem{fill:var(--mem);fill-opacity:.55}
svg .mem-over{fill:var(--over);fill-opacity:.6}svg .cap{stroke:var(--fg);stroke-dasharray:3 2}
svg .memtext.bad{fill:var(--over)}
.legend span{display:inline-block;margin-right:14px}.legend i{display:inline-block;width:12px;height:10px;
margin-right:4px;vertical-align:-1px}
.side{display:flex;gap:12px;flex-wrap:wrap}.side h3{font-size:14px;margin:4px 0}
ul.find li{margin:4px 0}
"""

LEGEND_KINDS = (
    ("forward", "forward"),
    ("backward", "backward"),
    ("optimizer", "optimizer"),
    ("compute", "forward + backward (measured)"),
    ("sync", "gradient sync"),
    ("transfer", "transfers (lower lane)"),
    ("tp", "tensor-parallel all-reduces (inside computes)"),
)


def legend(measured: bool, tensor_parallel: bool = False) -> str:
    items = "".join(
        f'<span><i style="background:var(--{k})"></i>{label}</span>'
        for k, label in LEGEND_KINDS
        if (measured or k != "compute") and (tensor_parallel or k != "tp")
    )
    return f'<p class="legend">{items}<span>gaps: idle</span></p>'


def page(title: str, body: str) -> str:
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; "
        f'img-src data:"><title>{escape(title)}</title><style>{CSS}</style></head><body>{body}</body></html>'
    )
