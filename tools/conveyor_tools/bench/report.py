"""Ratios against the baseline, the targets, and the printed table.

Targets (ratios are Conveyor / raw baseline measured in the same run):

* drain at defaults >= 0.8 x raw at the same batch size (100);
* drain at the best settings >= 0.8 x raw at batch 1000;
* batch enqueue (``enqueue_bulk``, which like COPY returns no ids) >= 0.9 x raw COPY;
  ``enqueue_many``, which returns every id, is reported beside it;
* wake-up p50 < 1 ms and p99 < 5 ms;
* worker peak RSS < 60 MB.
"""

from __future__ import annotations

from typing import Any

from conveyor.config import BATCH_SIZE_DEFAULT, CONCURRENCY_DEFAULT

# (key, description, comparison, threshold)
TARGETS: tuple[tuple[str, str, str, float], ...] = (
    ("drain_default_ratio", "drain at defaults / raw same batch", ">=", 0.8),
    ("drain_best_ratio", "drain at best settings / raw batch 1000", ">=", 0.8),
    ("enqueue_batch_ratio", "batch enqueue / raw COPY", ">=", 0.9),
    ("wake_p50_ms", "wake-up p50 (ms)", "<", 1.0),
    ("wake_p99_ms", "wake-up p99 (ms)", "<", 5.0),
    ("worker_rss_mb", "worker peak RSS (MB)", "<", 60.0),
)

RATIOS = {
    "enqueue_single_ratio": ("enqueue_single_per_s", "raw_single_per_s"),
    "enqueue_batch_ratio": ("enqueue_batch_per_s", "raw_copy_per_s"),
    "enqueue_batch_in_tx_ratio": ("enqueue_batch_in_tx_per_s", "raw_copy_per_s"),
    "enqueue_batch_ids_ratio": ("enqueue_batch_ids_per_s", "raw_copy_per_s"),
    "drain_default_ratio": ("drain_default_per_s", "raw_drain_same_batch_per_s"),
    "drain_best_ratio": ("drain_best_per_s", "raw_drain_best_per_s"),
}


def _met(value: float, op: str, threshold: float) -> bool:
    return value >= threshold if op == ">=" else value < threshold


def complete(result: dict[str, Any]) -> dict[str, Any]:
    """Add ratios and the target verdicts to a suite result (in place; returned)."""
    for key, (mine, theirs) in RATIOS.items():
        result[key] = result[mine] / result[theirs]
    result["targets"] = {
        key: {"target": f"{op} {threshold:g}", "value": result[key],
              "met": _met(result[key], op, threshold), "what": what}
        for key, what, op, threshold in TARGETS
    }
    result["targets_met"] = all(t["met"] for t in result["targets"].values())
    # CPU efficiency: raw CPU per event / Conveyor's (like a throughput ratio when
    # the machine is CPU-bound, but far less sensitive to other tenants' load).
    cpu = result["cpu_us_per_event"]
    for mine, theirs in (("drain_default", "raw_drain_same_batch"),
                         ("drain_best", "raw_drain_best")):
        a, b = cpu[mine]["total"], cpu[theirs]["total"]
        result[f"{mine}_cpu_ratio"] = b / a if a and b else None
    return result


def rounded(value: Any) -> Any:
    """Floats to 4 significant-ish places for the JSON output, recursively."""
    if isinstance(value, float):
        return round(value, 4) if abs(value) < 100 else round(value, 1)
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value


def _rate(value: float) -> str:
    return f"{value:,.0f}/s"


def _verdict(result: dict[str, Any], key: str) -> str:
    target = result["targets"].get(key)
    if target is None:
        return ""
    return f"{target['target']:>7}  {'ok' if target['met'] else 'MISSED'}"


def format_table(result: dict[str, Any]) -> str:
    r = result
    best = r["drain_best_settings"]
    best_label = _settings_label(best)
    rows = [
        ("enqueue, 1 event/tx", _rate(r["enqueue_single_per_s"]),
         _rate(r["raw_single_per_s"]), "raw INSERT", r["enqueue_single_ratio"], ""),
        ("enqueue, 1000 events/tx (bulk)", _rate(r["enqueue_batch_per_s"]),
         _rate(r["raw_copy_per_s"]), "raw COPY", r["enqueue_batch_ratio"],
         _verdict(r, "enqueue_batch_ratio")),
        ("enqueue, 1000 events/tx (bulk, tx open)", _rate(r["enqueue_batch_in_tx_per_s"]),
         _rate(r["raw_copy_per_s"]), "raw COPY", r["enqueue_batch_in_tx_ratio"], ""),
        ("enqueue, 1000 events/tx (ids)", _rate(r["enqueue_batch_ids_per_s"]),
         _rate(r["raw_copy_per_s"]), "raw COPY",
         r["enqueue_batch_ids_ratio"], ""),
        (f"drain, defaults (b{BATCH_SIZE_DEFAULT} c{CONCURRENCY_DEFAULT})", _rate(r["drain_default_per_s"]),
         _rate(r["raw_drain_same_batch_per_s"]), "raw batch 100", r["drain_default_ratio"],
         _verdict(r, "drain_default_ratio")),
        (f"drain, best ({best_label})", _rate(r["drain_best_per_s"]),
         _rate(r["raw_drain_best_per_s"]), "raw batch 1000", r["drain_best_ratio"],
         _verdict(r, "drain_best_ratio")),
    ]
    w = max(len(row[0]) for row in rows) + 2
    lines = [f"{'':<{w}}{'Conveyor':>13}  {'baseline':>13}  {'':<15}{'ratio':>6}  target",
             "-" * (w + 64)]
    for name, mine, theirs, what, ratio, verdict in rows:
        lines.append(f"{name:<{w}}{mine:>13}  {theirs:>13}  {what:<15}{ratio:>6.2f}  {verdict}")
    lines += [
        f"{'wake-up p50':<{w}}{r['wake_p50_ms']:>10.2f} ms  {r['raw_wake_p50_ms']:>10.2f} ms"
        f"  {'raw LISTEN loop':<15}{'':>6}  {_verdict(r, 'wake_p50_ms')}",
        f"{'wake-up p99':<{w}}{r['wake_p99_ms']:>10.2f} ms  {r['raw_wake_p99_ms']:>10.2f} ms"
        f"  {'raw LISTEN loop':<15}{'':>6}  {_verdict(r, 'wake_p99_ms')}",
        f"{'worker peak RSS':<{w}}{r['worker_rss_mb']:>10.1f} MB"
        f"  {r['raw_worker_rss_mb']:>10.1f} MB  {'raw drainer':<15}{'':>6}  "
        f"{_verdict(r, 'worker_rss_mb')}",
    ]
    cpu = r["cpu_us_per_event"]
    if cpu["drain_default"]["total"] is not None:
        lines.append(f"{'CPU/event, defaults':<{w}}{_us(cpu['drain_default'])}"
                     f"  {_us(cpu['raw_drain_same_batch'])}  {'worker+db / raw':<15}"
                     f"{r['drain_default_cpu_ratio'] or 0:>6.2f}")
        lines.append(f"{'CPU/event, best':<{w}}{_us(cpu['drain_best'])}"
                     f"  {_us(cpu['raw_drain_best'])}  {'(raw/Conveyor)':<15}"
                     f"{r['drain_best_cpu_ratio'] or 0:>6.2f}")
    met = sum(t["met"] for t in r["targets"].values())
    lines.append("-" * (w + 64))
    lines.append(f"targets met: {met} of {len(r['targets'])}")
    lines.append(_notes(r))
    return "\n".join(lines)


def _us(cpu: dict[str, float | None]) -> str:
    total = cpu["total"]
    return f"{total:>10.1f} us" if total is not None else f"{'-':>13}"


def _settings_label(settings: dict[str, Any]) -> str:
    label = f"b{settings['batch_size']} c{settings['concurrency']}"
    if settings.get("retention", "default") != "default":
        label += f" retention {settings['retention']:g}"
    return label


def _notes(r: dict[str, Any]) -> str:
    env, plan = r["environment"], r["plan"]
    candidates = ", ".join(
        f"{_settings_label(c)} {c['per_s'][0]:,.0f}/s" for c in r["runs"]["drain_candidates"])
    return "\n".join([
        f"wake-up: {r['wake_samples']} samples (+{plan['wake_warmup']} warm-up), "
        f"{plan['wake_gap_ms']:.0f} ms apart; p95 {r['wake_p95_ms']:.2f} ms, "
        f"max {r['wake_max_ms']:.2f} ms, missing {r['wake_missing']}",
        f"drains: {plan['events']:,} events, median of {plan['reps']}; "
        f"settings tried (first run each): {candidates}",
        f"PostgreSQL {env['postgresql']}, {env['cpus']} CPUs, load {env['load_avg_1m_start']}"
        f" -> {env['load_avg_1m_end']}, "
        f"synchronous_commit={env['synchronous_commit']}; took {r['elapsed_s']:.0f}s",
    ])
