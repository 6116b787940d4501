"""``summary.html``: what a merged set took, for Snakemake's report (``snakemake --report report.html``).

Written by the merge beside the merged files (before ``merged.json``), from the plan and every shard's
``done``: shards, items, audio hours, the shards' compute time and its real-time factor (compute seconds
per second of audio: below 1 is faster than real time), and one row per shard, so a slow or odd shard shows.
"""

from __future__ import annotations

import html
import os

SUMMARY_FILE = "summary.html"


def set_summary(stage: str, dataset: str, plan: dict, dones: list[dict]) -> dict:
    """Totals and per-shard rows of a merged set (numbers; None where the audio length is unknown)."""
    rows = []
    for shard, done in zip(plan["shards"], dones):
        took = done["end"] - done["start"]
        audio = shard.get("seconds") if shard.get("seconds") is not None else done.get("seconds")
        rows.append({"shard": shard["shard"], "items": done["items"], "audio_s": audio, "compute_s": took,
                     "rtf": took / audio if audio else None, "host": done.get("host", "")})
    audio_known = all(r["audio_s"] is not None for r in rows)
    audio = sum(r["audio_s"] for r in rows) if audio_known else None
    compute = sum(r["compute_s"] for r in rows)
    return {"stage": stage, "dataset": dataset, "shards": len(rows), "items": sum(r["items"] for r in rows),
            "audio_h": audio / 3600 if audio is not None else None, "compute_h": compute / 3600,
            "rtf": compute / audio if audio else None,
            "wall_s": max(d["end"] for d in dones) - min(d["start"] for d in dones), "rows": rows}


def _number(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _duration(hours) -> str:
    """Seconds under an hour, hours from there on; unknown as such."""
    if hours is None:
        return "unknown"
    return f"{hours * 3600:.2f} s" if hours < 1 else f"{hours:.2f} h"


def summary_html(summary: dict) -> str:
    """The summary as one small HTML page (the report shows it as it is)."""
    s = summary
    head = (f"<h3>stage {html.escape(s['stage'])}, dataset {html.escape(s['dataset'])}</h3>\n"
            f"<p>{s['shards']} shards done, {s['items']} items, audio {_duration(s['audio_h'])}; compute "
            f"{_duration(s['compute_h'])} over the shard jobs (first start to last end: {s['wall_s']:.1f} s); "
            f"real-time factor {_number(s['rtf'], 4)} (compute seconds per second of audio)</p>\n")
    cells = "".join(
        f"<tr><td>{r['shard']}</td><td>{r['items']}</td><td>{_number(r['audio_s'], 1)}</td>"
        f"<td>{r['compute_s']:.2f}</td><td>{_number(r['rtf'], 4)}</td><td>{html.escape(r['host'])}</td></tr>\n"
        for r in s["rows"])
    table = ("<table border=\"1\" cellpadding=\"3\"><tr><th>shard</th><th>items</th><th>audio s</th>"
             f"<th>compute s</th><th>RTF</th><th>host</th></tr>\n{cells}</table>\n")
    return f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"></head><body>\n{head}{table}</body></html>\n"


def write_set_summary(set_dir, stage: str, dataset: str, plan: dict, dones: list[dict]) -> str:
    from snakeshard.io.atomic import atomic_write_text

    atomic_write_text(os.path.join(set_dir, SUMMARY_FILE), summary_html(set_summary(stage, dataset, plan, dones)))
    return SUMMARY_FILE
