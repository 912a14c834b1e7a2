"""Ratios against the baseline, the targets, and the printed table.

Targets (ratios are Conveyor / raw baseline measured in the same run; each
raw figure is the strongest raw loop of its kind, and the table names it):

* drain at defaults >= 0.9 x the raw mark loop at the same batch size (100)
  and the worker's own commit setting (asynchronous: its claim and ack
  connections run ``synchronous_commit=off``);
* drain at the best settings >= 0.9 x the strongest raw drain: the fastest
  of the raw loops (mark or DELETE, synchronous or asynchronous commit,
  batch 100/500/1000; the few fastest of a one-run search measured again
  beside Conveyor's best), named in ``raw_drain_strongest_variant``;
* drain at defaults >= 0.8 x drain at the best settings;
* worker CPU per event (the client process alone) <= 1.5 x the raw loop's
  that the defaults are compared with;
* WAL bytes per drained event <= 1.1 x the raw loop's compared with (defaults
  with the same-commit loop, best settings with the strongest);
* one event per transaction >= 0.9 x a raw INSERT of the same shape, both in
  its own transaction (BEGIN, INSERT, COMMIT) and on an autocommit connection;
* the outbox's marginal cost: what ``enqueue`` adds to a business
  transaction (an order INSERT) <= 1.3 x what a raw event INSERT adds;
* batch enqueue (``enqueue_bulk``, which like COPY returns no ids) >= 0.9 x raw COPY;
* WAL per bulk-enqueued event <= 280 bytes (what the event table, its indexes
  and the features a user did not declare cost every write; the raw COPY's
  figure is beside it);
  ``enqueue_many``, which returns every id, is reported beside it;
* wake-up p50 < 1 ms and p99 < 5 ms;
* worker peak RSS < 60 MB.

Kept from earlier runs for comparison, without targets: the raw mark loop at
the same batch with the server's commit (``raw_drain_same_batch_per_s``) and
at batch 1000 with the server's commit (``raw_drain_best_per_s``), and
``enqueue_single_ratio`` (the same figure as ``enqueue_one_tx_ratio``).
"""

from __future__ import annotations

from typing import Any

from conveyor.config import BATCH_SIZE_DEFAULT, CONCURRENCY_DEFAULT

# (key, description, comparison, threshold); {same_commit} and {strongest} name the variants.
TARGETS: tuple[tuple[str, str, str, float], ...] = (
    ("drain_default_ratio", "drain at defaults / raw {same_commit}", ">=", 0.9),
    ("drain_best_ratio", "drain at best settings / strongest raw, {strongest}", ">=", 0.9),
    ("drain_default_vs_best_ratio", "drain at defaults / drain at best settings", ">=", 0.8),
    ("worker_cpu_ratio", "worker CPU per event / raw {same_commit}", "<=", 1.5),
    ("drain_default_wal_ratio", "WAL per event at defaults / raw {same_commit}", "<=", 1.1),
    ("drain_best_wal_ratio", "WAL per event at best settings / raw {strongest}", "<=", 1.1),
    ("enqueue_one_tx_ratio", "enqueue + COMMIT / raw INSERT + COMMIT", ">=", 0.9),
    ("enqueue_autocommit_ratio", "enqueue / raw INSERT, autocommit", ">=", 0.9),
    ("outbox_marginal_cost_ratio", "enqueue's cost in a business tx / a raw INSERT's", "<=", 1.3),
    ("enqueue_batch_ratio", "batch enqueue / raw COPY", ">=", 0.9),
    ("enqueue_bulk_wal_bytes", "WAL per bulk-enqueued event (bytes)", "<=", 280.0),
    ("wake_p50_ms", "wake-up p50 (ms)", "<", 1.0),
    ("wake_p99_ms", "wake-up p99 (ms)", "<", 5.0),
    ("worker_rss_mb", "worker peak RSS (MB)", "<", 60.0),
)

# ratio key: (numerator rate, denominator rate)
RATIOS = {
    "enqueue_single_ratio": ("enqueue_single_per_s", "raw_single_per_s"),
    "enqueue_one_tx_ratio": ("enqueue_one_tx_per_s", "raw_insert_one_tx_per_s"),
    "enqueue_autocommit_ratio": ("enqueue_autocommit_per_s", "raw_insert_autocommit_per_s"),
    "enqueue_batch_ratio": ("enqueue_batch_per_s", "raw_copy_per_s"),
    "enqueue_batch_in_tx_ratio": ("enqueue_batch_in_tx_per_s", "raw_copy_per_s"),
    "enqueue_batch_ids_ratio": ("enqueue_batch_ids_per_s", "raw_copy_per_s"),
    "drain_default_ratio": ("drain_default_per_s", "raw_drain_same_commit_per_s"),
    "drain_default_server_commit_ratio": ("drain_default_per_s", "raw_drain_same_batch_per_s"),
    "drain_best_ratio": ("drain_best_per_s", "raw_drain_strongest_per_s"),
    "drain_best_vs_raw_best_ratio": ("drain_best_per_s", "raw_drain_best_per_s"),
    "drain_default_vs_best_ratio": ("drain_default_per_s", "drain_best_per_s"),
    "drain_window_ratio": ("drain_window_per_s", "raw_drain_same_commit_per_s"),
}


def _met(value: float | None, op: str, threshold: float) -> bool:
    if value is None:  # not measurable in this run (e.g. no CPU figures): not met
        return False
    if op == ">=":
        return value >= threshold
    return value <= threshold if op == "<=" else value < threshold


def _quotient(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def marginal_us(rate: float, business_rate: float) -> float:
    """Microseconds per transaction a shape spends beyond the business INSERT alone."""
    return (1 / rate - 1 / business_rate) * 1e6


def _outbox(result: dict[str, Any]) -> None:
    business = result["outbox_business_per_s"]
    extra = {"enqueue": marginal_us(result["outbox_business_enqueue_per_s"], business),
             "raw_insert": marginal_us(result["outbox_business_raw_insert_per_s"], business)}
    result["outbox_marginal_us"] = extra
    # A raw INSERT measured as free (noise above the effect) leaves no ratio.
    result["outbox_marginal_cost_ratio"] = (extra["enqueue"] / extra["raw_insert"]
                                            if extra["raw_insert"] > 0 else None)


def complete(result: dict[str, Any]) -> dict[str, Any]:
    """Add ratios and the target verdicts to a suite result (in place; returned)."""
    for key, (mine, theirs) in RATIOS.items():
        result[key] = result[mine] / result[theirs]
    _outbox(result)
    result["worker_cpu_ratio"] = _quotient(result["worker_cpu_us_per_event"],
                                           result["raw_cpu_us_per_event"])
    wal = result["wal_bytes_per_event"]
    result["drain_default_wal_ratio"] = _quotient(wal["drain_default"], wal["raw_same_commit"])
    result["drain_best_wal_ratio"] = _quotient(wal["drain_best"], wal["raw_strongest"])
    result["drain_window_wal_ratio"] = _quotient(wal.get("drain_window"),
                                                 wal["raw_same_commit"])
    # Results from before the enqueue's WAL was measured have none.
    result["enqueue_bulk_wal_bytes"] = wal.get("enqueue_bulk")
    result["enqueue_bulk_wal_ratio"] = _quotient(wal.get("enqueue_bulk"), wal.get("raw_copy"))
    result["enqueue_single_wal_ratio"] = _quotient(wal.get("enqueue_single"),
                                                   wal.get("raw_insert_one_tx"))
    names = {"same_commit": result["raw_drain_same_commit_variant"],
             "strongest": result["raw_drain_strongest_variant"]}
    result["targets"] = {
        key: {"target": f"{op} {threshold:g}", "value": result[key],
              "met": _met(result[key], op, threshold), "what": what.format(**names)}
        for key, what, op, threshold in TARGETS
    }
    result["targets_met"] = all(t["met"] for t in result["targets"].values())
    # CPU efficiency: raw CPU per event / Conveyor's (like a throughput ratio when
    # the machine is CPU-bound, but far less sensitive to other tenants' load).
    cpu = result["cpu_us_per_event"]
    for mine, theirs in (("drain_default", "raw_drain_same_batch"),
                         ("drain_window", "raw_drain_same_batch"),
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


def _ratio(value: float | None) -> str:
    return f"{value:>6.2f}" if value is not None else f"{'-':>6}"


def _amount(value: float | None, unit: str) -> str:
    return f"{value:>10.1f} {unit:<2}" if value is not None else f"{'-':>13}"


def _rows(r: dict[str, Any]) -> list[tuple[str, str, str, str, float | None, str]]:
    """(figure, Conveyor, baseline, which baseline, ratio, verdict) for each compared rate."""
    best_label = _settings_label(r["drain_best_settings"])
    same_commit, strongest = r["raw_drain_same_commit_variant"], r["raw_drain_strongest_variant"]
    server_same = f"mark batch={BATCH_SIZE_DEFAULT} commit=server"
    extra = r["outbox_marginal_us"]
    return [
        ("enqueue, 1 event, own tx", _rate(r["enqueue_one_tx_per_s"]),
         _rate(r["raw_insert_one_tx_per_s"]), "raw INSERT + COMMIT", r["enqueue_one_tx_ratio"],
         _verdict(r, "enqueue_one_tx_ratio")),
        ("enqueue, 1 event, autocommit", _rate(r["enqueue_autocommit_per_s"]),
         _rate(r["raw_insert_autocommit_per_s"]), "raw INSERT, autocommit",
         r["enqueue_autocommit_ratio"], _verdict(r, "enqueue_autocommit_ratio")),
        ("outbox: added to an order INSERT tx", _amount(extra["enqueue"], "us"),
         _amount(extra["raw_insert"], "us"), "raw event INSERT", r["outbox_marginal_cost_ratio"],
         _verdict(r, "outbox_marginal_cost_ratio")),
        ("enqueue, 1000 events/tx (bulk)", _rate(r["enqueue_batch_per_s"]),
         _rate(r["raw_copy_per_s"]), "raw COPY", r["enqueue_batch_ratio"],
         _verdict(r, "enqueue_batch_ratio")),
        ("enqueue, 1000 events/tx (bulk, tx open)", _rate(r["enqueue_batch_in_tx_per_s"]),
         _rate(r["raw_copy_per_s"]), "raw COPY", r["enqueue_batch_in_tx_ratio"], ""),
        ("enqueue, 1000 events/tx (ids)", _rate(r["enqueue_batch_ids_per_s"]),
         _rate(r["raw_copy_per_s"]), "raw COPY", r["enqueue_batch_ids_ratio"], ""),
        (f"drain, defaults (b{BATCH_SIZE_DEFAULT} c{CONCURRENCY_DEFAULT})",
         _rate(r["drain_default_per_s"]), _rate(r["raw_drain_same_commit_per_s"]),
         same_commit, r["drain_default_ratio"], _verdict(r, "drain_default_ratio")),
        ("  same, server's commit", _rate(r["drain_default_per_s"]),
         _rate(r["raw_drain_same_batch_per_s"]), server_same,
         r["drain_default_server_commit_ratio"], ""),
        (f"drain, best ({best_label})", _rate(r["drain_best_per_s"]),
         _rate(r["raw_drain_strongest_per_s"]), f"strongest: {strongest}",
         r["drain_best_ratio"], _verdict(r, "drain_best_ratio")),
        ("  same, raw mark loop b1000", _rate(r["drain_best_per_s"]),
         _rate(r["raw_drain_best_per_s"]), "mark batch=1000 commit=server",
         r["drain_best_vs_raw_best_ratio"], ""),
        ("drain, defaults vs best", _rate(r["drain_default_per_s"]), _rate(r["drain_best_per_s"]),
         "Conveyor at best", r["drain_default_vs_best_ratio"],
         _verdict(r, "drain_default_vs_best_ratio")),
        ("WAL/event, defaults", _amount(r["wal_bytes_per_event"]["drain_default"], "B"),
         _amount(r["wal_bytes_per_event"]["raw_same_commit"], "B"), same_commit,
         r["drain_default_wal_ratio"], _verdict(r, "drain_default_wal_ratio")),
        ("WAL/event, claim window", _amount(r["wal_bytes_per_event"].get("drain_window"), "B"),
         _amount(r["wal_bytes_per_event"]["raw_same_commit"], "B"), same_commit,
         r.get("drain_window_wal_ratio"), ""),
        ("WAL/event, best", _amount(r["wal_bytes_per_event"]["drain_best"], "B"),
         _amount(r["wal_bytes_per_event"]["raw_strongest"], "B"), strongest,
         r["drain_best_wal_ratio"], _verdict(r, "drain_best_wal_ratio")),
        ("WAL/event, bulk enqueue", _amount(r["wal_bytes_per_event"].get("enqueue_bulk"), "B"),
         _amount(r["wal_bytes_per_event"].get("raw_copy"), "B"), "raw COPY, 1000 a transaction",
         r["enqueue_bulk_wal_ratio"], _verdict(r, "enqueue_bulk_wal_bytes")),
        ("WAL/event, enqueue", _amount(r["wal_bytes_per_event"].get("enqueue_single"), "B"),
         _amount(r["wal_bytes_per_event"].get("raw_insert_one_tx"), "B"),
         "raw INSERT + COMMIT", r["enqueue_single_wal_ratio"], ""),
        ("worker CPU/event, defaults", _amount(r["worker_cpu_us_per_event"], "us"),
         _amount(r["raw_cpu_us_per_event"], "us"), f"client, {same_commit}",
         r["worker_cpu_ratio"], _verdict(r, "worker_cpu_ratio")),
    ]


def format_table(result: dict[str, Any]) -> str:
    r = result
    rows = _rows(r)
    w = max(len(row[0]) for row in rows) + 2
    v = max(len(row[3]) for row in rows) + 2
    rule = "-" * (w + v + 50)
    lines = [f"{'':<{w}}{'Conveyor':>13}  {'baseline':>13}  {'':<{v}}{'ratio':>6}  target", rule]
    for name, mine, theirs, what, ratio, verdict in rows:
        lines.append(f"{name:<{w}}{mine:>13}  {theirs:>13}  {what:<{v}}{_ratio(ratio)}  {verdict}")
    lines += [
        f"{'wake-up p50':<{w}}{r['wake_p50_ms']:>10.2f} ms  {r['raw_wake_p50_ms']:>10.2f} ms"
        f"  {'raw LISTEN loop':<{v}}{'':>6}  {_verdict(r, 'wake_p50_ms')}",
        f"{'wake-up p99':<{w}}{r['wake_p99_ms']:>10.2f} ms  {r['raw_wake_p99_ms']:>10.2f} ms"
        f"  {'raw LISTEN loop':<{v}}{'':>6}  {_verdict(r, 'wake_p99_ms')}",
        f"{'chord callback':<{w}}{r['chord_callback_after_last_ms']:>10.1f} ms"
        f"  {'':>13}  {'after the last of ' + format(r['chord_members'], ',') + ' members':<{v}}",
        f"{'worker peak RSS':<{w}}{r['worker_rss_mb']:>10.1f} MB"
        f"  {r['raw_worker_rss_mb']:>10.1f} MB  {'raw drainer':<{v}}{'':>6}  "
        f"{_verdict(r, 'worker_rss_mb')}",
    ]
    cpu = r["cpu_us_per_event"]
    if cpu["drain_default"]["total"] is not None:
        lines.append(f"{'CPU/event, defaults':<{w}}{_us(cpu['drain_default'])}"
                     f"  {_us(cpu['raw_drain_same_batch'])}  {'worker+db / raw':<{v}}"
                     f"{r['drain_default_cpu_ratio'] or 0:>6.2f}")
        lines.append(f"{'CPU/event, best':<{w}}{_us(cpu['drain_best'])}"
                     f"  {_us(cpu['raw_drain_best'])}  {'(raw/Conveyor)':<{v}}"
                     f"{r['drain_best_cpu_ratio'] or 0:>6.2f}")
    met = sum(t["met"] for t in r["targets"].values())
    lines.append(rule)
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
    variants = ", ".join(f"{v['variant']} {v['per_s']:,.0f}/s"
                         for v in r["runs"]["raw_drain_variants"])
    return "\n".join([
        f"wake-up: {r['wake_samples']} samples (+{plan['wake_warmup']} warm-up), "
        f"{plan['wake_gap_ms']:.0f} ms apart; p95 {r['wake_p95_ms']:.2f} ms, "
        f"max {r['wake_max_ms']:.2f} ms, missing {r['wake_missing']}",
        f"drains: {plan['events']:,} events, median of {plan['reps']}; "
        f"settings tried (first run each): {candidates}",
        f"raw loops tried (one run each): {variants}",
        f"outbox: {plan['outbox_events']:,} transactions of each shape; order INSERT alone "
        f"{_rate(r['outbox_business_per_s'])}, + enqueue {_rate(r['outbox_business_enqueue_per_s'])}"
        f", + raw INSERT {_rate(r['outbox_business_raw_insert_per_s'])}",
        f"PostgreSQL {env['postgresql']}, {env['cpus']} CPUs, load {env['load_avg_1m_start']}"
        f" -> {env['load_avg_1m_end']}, synchronous_commit={env['synchronous_commit']} "
        f"(worker: {r['worker_synchronous_commit']}); took {r['elapsed_s']:.0f}s",
    ])
