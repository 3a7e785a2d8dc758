"""Report: one self-contained HTML page and one markdown table over every result in a results directory.

At the top, a summary picture of every claim (per-seed statistic, mean and confidence bound against the
threshold, coloured by verdict, grouped by room); then the table; then one section per claim with its rule,
mechanism checks, arms, provenance and plot. Result files that cannot be read are listed first, never dropped.
"""

from __future__ import annotations

import base64
import html
import io
import math
from pathlib import Path

from ..core.io import atomic_write_bytes, atomic_write_text
from .runner import ResultFileError, read_result

COLOURS = {"reproduced": "#1a7f37", "not_reproduced": "#b42318", "inconclusive": "#9a6700"}


NOT_RESULTS = frozenset({"benchmarks"})
"""Folders of a results directory that hold other JSON: ``make bench`` writes ``results/benchmarks/``."""


def load_results(out: Path) -> tuple[list[dict], list[str]]:
    """Every result file under ``out`` (``ROOM/SPEC.json``, outside ``NOT_RESULTS``) sorted by room then spec, and
    the problems of the files that could not be read (one sentence each, naming the file)."""
    results, unreadable = [], []
    for path in sorted(p for p in Path(out).glob("*/*.json") if p.parent.name not in NOT_RESULTS):
        try:
            data = read_result(path)
        except ResultFileError as err:
            unreadable.append(str(err))
            continue
        data["_path"] = path
        results.append(data)
    return results, unreadable


def _finite(value) -> float | None:
    """``value`` as a float when it is a finite number, else None (results store nan/inf as strings)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _fmt(stat: dict | None) -> str:
    """``mean ± std`` over seeds; a single seed prints its value alone (no "± 0")."""
    mean = _finite((stat or {}).get("mean"))
    if mean is None:
        return "n/a"
    n = len([v for v in stat.get("per_seed", []) if _finite(v) is not None])
    std = _finite(stat.get("std"))
    return f"{mean:.4g}" if n <= 1 or std is None else f"{mean:.4g} ± {std:.2g}"


def _measurement(result: dict) -> str:
    name = result["comparator"]["statistic"]
    text = f"{name} = {_fmt(result.get('statistics', {}).get(name))} (n={len(result.get('seed_results', []))})"
    bound = result.get("bound") or {}
    lower, upper = _finite(bound.get("lower")), _finite(bound.get("upper"))
    if lower is not None and upper is not None:
        text += f"; {100 * bound['confidence']:g}% one-sided bounds [{lower:.4g}, {upper:.4g}]"
    return text


def _threshold(result: dict) -> str:
    return f"{result['comparator']['op']} {result['comparator']['threshold']:g}"


def _arms(result: dict) -> str:
    """Every arm but the method (the first), each with its first two metrics."""
    arms = result.get("arms", {})
    shown = []
    for arm in result.get("arms_order", list(arms))[1:]:
        metrics = arms.get(arm)
        if metrics:
            shown.append(f"{arm}: " + ", ".join(f"{k} {_fmt(v)}" for k, v in list(metrics.items())[:2]))
    return "; ".join(shown) or str(result.get("baseline"))


def _checks(result: dict) -> str:
    checks = result.get("mechanism_checks") or []
    if not checks:
        return "none declared"
    return "; ".join(f"{'✓' if c['passed'] else '✗'} {c['name']}" for c in checks)


def _verdict(result: dict) -> str:
    return result.get("verdict") or result.get("status", "unknown")


def markdown_table(results: list[dict], unreadable: list[str] = ()) -> str:
    lines = [f"**Unreadable result file**: {problem}\n" for problem in unreadable]
    lines += ["| room | spec | claim (paper) | our measurement | threshold | other arms | mechanism checks | tier | "
              "verdict |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        cells = [r["room"], f"`{r['spec']}`", f"{r['claim']} ({r['paper_ref']})", _measurement(r), _threshold(r),
                 _arms(r), _checks(r), r["tier"], f"**{_verdict(r)}**"]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def summary_figure(results: list[dict]) -> bytes | None:
    """PNG: one row per claim, grouped by room. Each row shows the per-seed statistic (dots), the mean (bar)
    and the one-sided bounds (line) as a signed distance from the threshold, scaled per row so that the
    farthest point sits at 1, and oriented so that right of 0 is the claim's side."""
    rows = [r for r in results if _finite(r.get("statistics", {}).get(r["comparator"]["statistic"], {}).get("mean"))
            is not None]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(13.0, 0.32 * len(rows) + 1.4))
    labels = []
    for i, r in enumerate(rows):
        comp = r["comparator"]
        stat = r["statistics"][comp["statistic"]]
        sign = 1.0 if comp["op"] in (">=", ">") else -1.0
        mean = _finite(stat["mean"])
        # Result JSON stores non-finite numbers as strings ("nan"); a seed whose statistic is undefined is not drawn.
        seeds = [v for v in map(_finite, stat.get("per_seed", [])) if v is not None]
        bound = r.get("bound") or {}
        ends = [v for v in (_finite(bound.get(k)) for k in ("lower", "upper")) if v is not None]
        points = [sign * (v - comp["threshold"]) for v in seeds + ends + [mean]]
        scale = max([abs(p) for p in points] + [1e-12])
        y = len(rows) - 1 - i
        colour = COLOURS.get(_verdict(r), "#666")
        if len(ends) == 2:
            ax.plot([sign * (e - comp["threshold"]) / scale for e in ends], [y, y], color=colour, lw=2)
        ax.scatter([sign * (v - comp["threshold"]) / scale for v in seeds], [y] * len(seeds), s=10, color=colour,
                   alpha=0.6)
        ax.scatter([sign * (mean - comp["threshold"]) / scale], [y], marker="|", s=140, color=colour)
        failed = [c["name"] for c in r.get("mechanism_checks") or [] if not c["passed"]]
        note = f"  (check failed: {', '.join(failed)})" if failed else ""
        ax.text(1.08, y, f"{mean:.3g} {comp['op']} {comp['threshold']:g}?{note}", va="center", fontsize=7)
        labels.append(f"{r['room']} / {r['spec']} [{r['tier']}]")
        if i and r["room"] != rows[i - 1]["room"]:  # a rule between rooms
            ax.axhline(y + 0.5, color="#ddd", lw=0.8)
    ax.axvline(0, color="k", lw=1)
    ax.set_yticks(range(len(rows)), labels[::-1], fontsize=7)
    ax.set_xlim(-1.1, 2.2)
    ax.set_xlabel("distance from the threshold, per-row scale (right of 0: the claim's side)")
    handles = [plt.Line2D([], [], color=c, lw=2, label=v.replace("_", " ")) for v, c in COLOURS.items()]
    ax.set_title("Every claim: seeds (dots), mean (tick), one-sided bounds (line)", fontsize=9)
    ax.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.04 - 0.6 / len(rows)),
              ncol=3, frameon=False)
    # The per-row verdict notes are drawn right of the axes (x > 1.08): keep the right third of the figure free.
    fig.tight_layout(rect=(0, 0, 0.6, 1))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


_CSS = """body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;width:100%;font-size:13px}td,th{border:1px solid #ccc;padding:6px;vertical-align:top}
th{background:#f3f3f3}.reproduced{color:#1a7f37;font-weight:600}.not_reproduced{color:#b42318;font-weight:600}
.inconclusive{color:#9a6700;font-weight:600}section{margin:2em 0;border-top:1px solid #ddd}img{max-width:100%}
code{background:#f6f6f6;padding:0 3px}.error{background:#fde8e8;border:1px solid #b42318;padding:8px}"""


def _png(data: bytes, alt: str) -> str:
    return f"<img alt='{html.escape(alt)}' src='data:image/png;base64,{base64.b64encode(data).decode()}'>"


def html_page(results: list[dict], unreadable: list[str] = (), summary: bytes | None = None) -> str:
    """A single HTML file: unreadable files, the summary picture (``summary_figure``'s PNG), the table, then one
    section per claim."""
    e = html.escape
    errors = "".join(f"<p class='error'>Unreadable result file: {e(p)}</p>" for p in unreadable)
    rows, sections = [], []
    for r in results:
        verdict = _verdict(r)
        anchor = f"{r['room']}-{r['spec']}"
        rows.append(f"<tr><td>{e(r['room'])}<br><small><code>{e(r['spec'])}</code></small></td>"
                    f"<td><a href='#{anchor}'>{e(r['claim'])}</a><br><small>{e(r['paper_ref'])}</small></td>"
                    f"<td>{e(_measurement(r))}</td><td>{e(_threshold(r))}</td><td>{e(_arms(r))}</td>"
                    f"<td>{e(_checks(r))}</td><td>{r['tier']}</td><td class='{verdict}'>{verdict}</td></tr>")
        png = Path(r["_path"]).with_suffix(".png")
        image = _png(png.read_bytes(), f"plot for {r['spec']}") if png.exists() else ""
        arms = "".join(f"<li><b>{e(arm)}</b>: " + ", ".join(f"{e(k)} {_fmt(v)}" for k, v in metrics.items())
                       + "</li>" for arm, metrics in r.get("arms", {}).items())
        checks = "".join(f"<li>{'passed' if c['passed'] else '<b>failed</b>'}: {e(c['name'])} ({e(c['description'])};"
                         f" {e(c.get('rule', ''))}; values {e(str(c['values']))})</li>"
                         for c in r.get("mechanism_checks") or [])
        info = r.get("run_info", {})
        sections.append(
            f"<section id='{anchor}'><h2>{e(r['room'])} / {e(r['spec'])}</h2>"
            f"<p><b>Claim</b>: {e(r['claim'])} ({e(r['paper_ref'])})</p><p><b>Metric</b>: {e(r['metric'])}</p>"
            f"<p><b>Rule</b>: {e(r['comparator']['description'])}. <span class='{verdict}'>{verdict}</span>: "
            f"{e(r.get('verdict_rule', ''))}</p>"
            f"<p><b>Mechanism checks</b>:</p><ul>{checks or '<li>none declared</li>'}</ul>"
            f"<ul>{arms}</ul>{image}"
            f"<p><small>tier {r['tier']}, seeds {r['seeds']}, wall {r.get('wall_time_s', 0):.1f} s, peak RSS "
            f"{r.get('peak_rss_bytes', 0) / 2**20:.0f} MiB, threads {info.get('threads')}, device "
            f"{e(str(info.get('device')))}, git {e(str(info.get('git_sha', ''))[:10])}"
            f"{' (dirty)' if info.get('git_dirty') else ''}</small></p>"
            + (f"<p><small>{e(r['notes'])}</small></p>" if r.get("notes") else "") + "</section>")
    counts = {v: sum(_verdict(r) == v for r in results) for v in COLOURS}
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>icml26 reproduction report</title>"
            f"<style>{_CSS}</style></head><body><h1>icml26 reproduction report</h1>{errors}"
            f"<p>{len(results)} claim(s): " + ", ".join(f"{n} {v.replace('_', ' ')}" for v, n in counts.items())
            + ". Verdict rule: a one-sided Student t bound (90%) on the mean of the per-seed claim statistic; "
            "reproduced when the bound on the unfavourable side still satisfies the threshold, not reproduced when "
            "the bound on the favourable side fails it, inconclusive otherwise, and inconclusive whenever a "
            "mechanism check failed (the mechanism the claim is about did not act) or at the smoke tier.</p>"
            + (_png(summary, "summary of every claim") if summary else "")
            + "<table><tr><th>room</th><th>paper claim</th><th>our measurement</th><th>threshold</th>"
            "<th>other arms</th><th>mechanism checks</th><th>tier</th><th>verdict</th></tr>"
            f"{''.join(rows)}</table>{''.join(sections)}</body></html>\n")


def write_report(out: Path) -> tuple[Path, Path]:
    """Write ``out/report.html``, ``out/report.md`` and ``out/summary.png``; returns the page and markdown."""
    results, unreadable = load_results(out)
    if not results and not unreadable:
        raise FileNotFoundError(f"no result files (ROOM/SPEC.json) found under {out}")
    summary = summary_figure(results)
    if summary:
        atomic_write_bytes(Path(out) / "summary.png", summary)
    md = atomic_write_text(Path(out) / "report.md", "# icml26 reproduction report\n\n"
                           + ("![every claim](summary.png)\n\n" if summary else "")
                           + markdown_table(results, unreadable))
    page = atomic_write_text(Path(out) / "report.html", html_page(results, unreadable, summary))
    return page, md
