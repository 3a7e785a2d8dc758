"""Report: one self-contained HTML page and one markdown table over every result in a results directory."""

from __future__ import annotations

import base64
import html
from pathlib import Path

from ..core.io import atomic_write_text, read_json


def load_results(out: Path) -> list[dict]:
    """Every result file under ``out`` (``ROOM/SPEC.json``), sorted by room then spec."""
    results = []
    for path in sorted(Path(out).glob("*/*.json")):
        try:
            data = read_json(path)
        except ValueError:
            continue
        if isinstance(data, dict) and "spec" in data and "comparator" in data:
            data["_path"] = path
            results.append(data)
    return results


def _fmt(stat: dict | None) -> str:
    if not stat or not isinstance(stat.get("mean"), (int, float)):
        return "n/a"
    return f"{stat['mean']:.4g} ± {stat['std']:.2g}"


def _measurement(result: dict) -> str:
    name = result["comparator"]["statistic"]
    return f"{name} = {_fmt(result.get('statistics', {}).get(name))} (n={len(result.get('seed_results', []))})"


def _baseline(result: dict) -> str:
    """The baseline arm's headline metrics (first two), so a reader sees what the method was compared with."""
    arm = result.get("arms", {}).get(result.get("baseline"), {})
    shown = [f"{k} {_fmt(v)}" for k, v in list(arm.items())[:2]]
    return f"{result.get('baseline')}: " + "; ".join(shown) if shown else str(result.get("baseline"))


def _verdict(result: dict) -> str:
    return result.get("verdict") or result.get("status", "unknown")


def markdown_table(results: list[dict]) -> str:
    lines = ["| room | spec | claim (paper) | our measurement | baseline | tier | verdict |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        claim = f"{r['claim']} ({r['paper_ref']})".replace("|", "/")
        lines.append(f"| {r['room']} | {r['spec']} | {claim} | {_measurement(r)} | {_baseline(r)} | {r['tier']} | "
                     f"**{_verdict(r)}** |")
    return "\n".join(lines) + "\n"


_CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;width:100%;font-size:14px}td,th{border:1px solid #ccc;padding:6px;vertical-align:top}
th{background:#f3f3f3}.reproduced{color:#1a7f37;font-weight:600}.not_reproduced{color:#b42318;font-weight:600}
.inconclusive{color:#9a6700;font-weight:600}section{margin:2em 0;border-top:1px solid #ddd}img{max-width:100%}
code{background:#f6f6f6;padding:0 3px}"""


def html_page(results: list[dict]) -> str:
    """A single HTML file: the verdict table, then per claim its rule, config provenance and embedded plot."""
    rows, sections = [], []
    for r in results:
        verdict = _verdict(r)
        anchor = f"{r['room']}-{r['spec']}"
        rows.append(f"<tr><td>{html.escape(r['room'])}<br><small>{html.escape(r['spec'])}</small></td><td><a href='#{anchor}'>{html.escape(r['claim'])}</a>"
                    f"<br><small>{html.escape(r['paper_ref'])}</small></td><td>{html.escape(_measurement(r))}</td>"
                    f"<td>{html.escape(_baseline(r))}</td><td>{r['tier']}</td>"
                    f"<td class='{verdict}'>{verdict}</td></tr>")
        image = ""
        png = Path(r["_path"]).with_suffix(".png")
        if png.exists():
            data = base64.b64encode(png.read_bytes()).decode()
            image = f"<img alt='plot for {html.escape(r['spec'])}' src='data:image/png;base64,{data}'>"
        arms = "".join(f"<li><b>{html.escape(arm)}</b>: " + ", ".join(
            f"{html.escape(k)} {_fmt(v)}" for k, v in metrics.items()) + "</li>" for arm, metrics in r.get("arms", {}).items())
        info = r.get("run_info", {})
        sections.append(
            f"<section id='{anchor}'><h2>{html.escape(r['room'])} / {html.escape(r['spec'])}</h2>"
            f"<p><b>Claim</b>: {html.escape(r['claim'])} ({html.escape(r['paper_ref'])})</p>"
            f"<p><b>Metric</b>: {html.escape(r['metric'])}</p>"
            f"<p><b>Rule</b>: {html.escape(r['comparator']['description'])}. "
            f"<span class='{verdict}'>{verdict}</span>: {html.escape(r.get('verdict_rule', ''))}</p>"
            f"<ul>{arms}</ul>{image}"
            f"<p><small>tier {r['tier']}, seeds {r['seeds']}, wall {r.get('wall_time_s', 0):.1f} s, peak RSS "
            f"{r.get('peak_rss_bytes', 0) / 2**20:.0f} MiB, git {html.escape(str(info.get('git_sha', ''))[:10])}"
            f"{' (dirty)' if info.get('git_dirty') else ''}</small></p>"
            + (f"<p><small>{html.escape(r['notes'])}</small></p>" if r.get("notes") else "") + "</section>")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>icml26 reproduction report</title>"
            f"<style>{_CSS}</style></head><body><h1>icml26 reproduction report</h1>"
            f"<p>{len(results)} claim(s). Verdict rule: reproduced when the mean claim statistic satisfies the "
            f"comparator fixed in code and at least 2/3 of seeds do; not reproduced when the mean fails and at most "
            f"1/3 of seeds pass; inconclusive otherwise (and always at the smoke tier).</p>"
            f"<table><tr><th>room</th><th>paper claim</th><th>our measurement</th><th>baseline</th><th>tier</th>"
            f"<th>verdict</th></tr>{''.join(rows)}</table>{''.join(sections)}</body></html>\n")


def write_report(out: Path) -> tuple[Path, Path]:
    """Write ``out/report.html`` and ``out/report.md``; returns their paths."""
    results = load_results(out)
    if not results:
        raise FileNotFoundError(f"no result files (ROOM/SPEC.json) found under {out}")
    md = atomic_write_text(Path(out) / "report.md", "# icml26 reproduction report\n\n" + markdown_table(results))
    page = atomic_write_text(Path(out) / "report.html", html_page(results))
    return page, md
