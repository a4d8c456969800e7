#!/usr/bin/env python3
"""Renders the JSON of a scripts/bench-table.sh run as the table that opens
docs/BENCHMARKS.md (between the bench-table markers), and checks the
benches' contract on the way: every `*_vs_baseline` value is a number
beside its measured value and baseline, and no bench lost a block.

Exit status: 0 when every bench ran and kept its contract, 1 otherwise
(the table is still written, with the failures in it).
"""
import argparse
import json
import os
import statistics
import sys

BEGIN = "<!-- bench-table:begin (scripts/bench-table.sh writes this; do not edit) -->"
END = "<!-- bench-table:end -->"

# Issue 31's targets: (bench, figure) -> (min ratio, at 64 KiB).
TARGETS = {
    ("io", "offload_gbps"): (0.9, 0.7),
    ("io", "onboard_gbps"): (0.95, 0.7),
    ("g3", "write"): (0.9, 0.7),
    ("g3", "read"): (0.95, 0.7),
    ("fs", "fallback"): (0.8, 0.8),
    ("fs", "passthrough"): (0.9, 0.9),
    ("g4", "get"): (0.9, 0.9),
    ("g4", "put"): (0.9, 0.9),
    ("crossnode", "any"): (0.9, 0.9),
    ("peers", "any"): (1.0, 1.0),
    ("replay", "daemon.offload"): (0.8, 0.8),
    ("replay", "daemon.onboard"): (0.8, 0.8),
}


def target(bench, figure, size):
    t = TARGETS.get((bench, figure))
    if t is None:
        for (b, f), v in TARGETS.items():
            if b == bench and (f == "any" or f in figure):
                t = v
                break
    if t is None:
        return None
    return t[1] if size == "64KiB" else t[0]


def fmt(x, nd=2):
    if x is None:
        return ""
    if isinstance(x, (int, float)):
        if abs(x) >= 100:
            return f"{x:.0f}"
        return f"{x:.{nd}f}"
    return str(x)


def ratio_range(j, fig):
    """Per-round quotients (measured / baseline) where the bench reports
    rounds: (min, max), else None."""
    pairs = {
        "offload_gbps": ("offload_gbps_rounds", "baseline_write_gbps_rounds"),
        "onboard_gbps": ("onboard_gbps_rounds", "baseline_read_gbps_rounds"),
    }
    if fig not in pairs:
        return None
    m, b = j.get(pairs[fig][0]), j.get(pairs[fig][1])
    if not m or not b or len(m) != len(b):
        return None
    q = [x / y for x, y in zip(m, b) if y]
    return (min(q), max(q)) if q else None


def comparisons(j):
    """Every comparison of a report (nested objects too): keys
    `<name>_vs_baseline` and `<name>_vs_<peer>_baseline`, as (figure,
    measured, baseline, quotient)."""
    out = []

    def walk(o, path):
        if isinstance(o, dict):
            for k, v in o.items():
                if "_vs_" in k and k.endswith("baseline") and isinstance(v, (int, float)):
                    name = k[: k.index("_vs_")]
                    peer = k[k.index("_vs_") + 4 : -len("baseline")].rstrip("_")
                    base = o.get(f"{name}_{peer}_baseline") if peer else o.get(name + "_baseline")
                    m = o.get(name)
                    if m is None and base is None:
                        # Derived quotients: `X_speedup` = X_ms_baseline /
                        # X_ms (a time, lower is better); `g4_write_savings`
                        # = g4_written_blocks_baseline / g4_written_blocks.
                        for stem, unit in (("_speedup", "_ms"), ("_savings", "_blocks")):
                            if name.endswith(stem):
                                x = name[: -len(stem)]
                                x = x if x + unit in o else x[:-1] + "ten"
                                m, base = o.get(x + unit), o.get(x + unit + "_baseline")
                    fig = path + name + (f" vs {peer}" if peer else "")
                    out.append((fig, m, base, v))
                elif isinstance(v, (dict, list)):
                    walk(v, path + k + ".")
        elif isinstance(o, list):
            for i, v in enumerate(o):
                if isinstance(v, dict):
                    label = v.get("variant") or str(i)
                    walk(v, path + str(label) + ".")
        return out

    return walk(j, "")


def lost_blocks(j):
    """Acknowledged blocks kvtier lost (the report's top-level count)."""
    v = j.get("lost_blocks", 0)
    return v if isinstance(v, int) else 0


def main():
    ap = argparse.ArgumentParser()
    for a in ["out", "mode", "start", "end", "machine", "load", "commit", "command"]:
        ap.add_argument("--" + a, required=True)
    ap.add_argument("--docs")
    a = ap.parse_args()
    rows, problems = [], []
    groups = {}
    with open(os.path.join(a.out, "manifest.tsv")) as f:
        for line in f:
            name, bench, variant, size, clients, status, secs, *why = line.rstrip("\n").split("\t")
            path = os.path.join(a.out, "json", name + ".json")
            if status == "skipped":
                reason = (why[0] if why else "")[:200].replace("|", "/")
                rows.append((bench, variant, size, clients, "**not run**", "", "", reason, "", "", ""))
                continue
            if status != "ok":
                err = open(os.path.join(a.out, "json", name + ".err")).read().strip().splitlines()
                why = (err[-1] if err else "no output")[:160].replace("|", "/")
                rows.append((bench, variant, size, clients, "**did not run**", "", "", why, "", "", ""))
                problems.append(f"{name}: failed: {why}")
                continue
            try:
                j = json.load(open(path))
            except ValueError as e:
                problems.append(f"{name}: not one JSON document: {e}")
                rows.append((bench, variant, size, clients, "**bad JSON**", "", "", "", "", "", ""))
                continue
            lost = lost_blocks(j)
            if lost:
                problems.append(f"{name}: {lost} acknowledged blocks lost")
            comps = comparisons(j)
            if not comps:
                problems.append(f"{name}: no *_vs_baseline in its JSON")
            if bench == "g4":
                # One row per figure over the invocations (each is a round).
                for fig, m, b, q in comps:
                    groups.setdefault((bench, variant, size, clients, fig), []).append((m, b, q))
                continue
            for fig, m, b, q in comps:
                if fig.startswith("lookup64"):
                    continue  # latency rows: in the JSON, not the table
                if bench == "io" and "cpu" in fig:
                    continue  # shown beside the throughput row
                if " vs " not in fig and not (isinstance(m, (int, float)) and isinstance(b, (int, float))):
                    problems.append(f"{name}: {fig}_vs_baseline without its measured value and baseline")
                rr = ratio_range(j, fig)
                cpu = ""
                if bench == "io" and fig in ("offload_gbps", "onboard_gbps"):
                    k = fig.split("_")[0] + "_cpu_s_per_gb"
                    if k in j:
                        cpu = f"{fmt(j[k])} / {fmt(j[k + '_baseline'])}"
                # The targets against foyer are its durable configuration's:
                # its defaults lose acknowledged blocks (a get of a lost block
                # serves nothing: a baseline of 0, no quotient to read).
                t = None if "foyer_default" in fig else target(bench, fig, size)
                met = "" if t is None else ("yes" if q >= t else "no")
                rng = f" ({fmt(rr[0])}-{fmt(rr[1])})" if rr else ""
                cell = f"**{fmt(q)}**{rng}"
                # A baseline of 0 (nothing served) or of 1e9 per s (the
                # peers bench's figure for a rate with no operation timed):
                # no quotient to read.
                if isinstance(b, (int, float)) and (b == 0 or b >= 1e9):
                    cell, met = f"n/a (baseline {fmt(b)})", ""
                rows.append((bench, variant, size, clients, fig, fmt(m), fmt(b), cell, cpu,
                             "" if t is None else f">= {t}", met))
    for (bench, variant, size, clients, fig), v in groups.items():
        qs = [x[2] for x in v]
        med = statistics.median(qs)
        t = target(bench, fig, size)
        met = "" if t is None else ("yes" if min(qs) >= t else "no")
        rows.append((bench, variant, size, clients, fig, fmt(statistics.median([x[0] for x in v if isinstance(x[0], (int, float))] or [0])),
                     fmt(statistics.median([x[1] for x in v if isinstance(x[1], (int, float))] or [0])),
                     f"**{fmt(med)}** ({fmt(min(qs))}-{fmt(max(qs))}, {len(qs)} runs)", "", "" if t is None else f">= {t} every run", met))
    lines = [
        BEGIN,
        "",
        f"Regenerated by `{a.command}` at commit {a.commit}, {a.start} to {a.end}; "
        f"machine: {a.machine}; load average before -> after: {a.load}. "
        + ("**This machine is shared and was loaded: read only the ratios, and only as a floor.** " if a.mode != "tiny" else "")
        + ("Mode `" + a.mode + "`: " + {
            "full": "5 rounds per invocation, 256 MiB per round.",
            "quick": "5 rounds per invocation, 32 MiB per round (bounded time on a shared machine).",
            "tiny": "contract check only (1 round, tiny sizes): figures mean nothing.",
        }[a.mode]),
        "",
        "Ratio = measured / baseline from the same invocation (higher is better): median over rounds, "
        "per-round range in brackets. `io`: client -> socket -> kvtierd -> G3 vs raw O_DIRECT "
        "(offload: durable writes, one fdatasync per round; onboard: cold reads); variants: `per_block` (the "
        "default data flush: each block's own), `group` (opt-in: one syncfs per window across clients), "
        "`direct_fd` (onboard by passed fd). CPU: seconds per GB, clients + kvtierd / the raw baseline.",
        "",
        "| bench | variant | size | clients | figure | kvtier | baseline | ratio (range) | CPU s/GB kvtier / raw | target | met? |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append("| " + " | ".join(str(x) for x in r) + " |")
    if problems:
        lines += ["", "Problems in this run:", ""] + [f"- {p}" for p in problems]
    lines += ["", END]
    table = "\n".join(lines) + "\n"
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write(table)
    if a.docs:
        doc = open(a.docs).read()
        if BEGIN in doc and END in doc:
            i, k = doc.index(BEGIN), doc.index(END) + len(END) + 1
            doc = doc[:i] + table + doc[k:]
        else:
            print(f"{a.docs} has no bench-table markers; table in {a.out}/table.md", file=sys.stderr)
        with open(a.docs, "w") as f:
            f.write(doc)
    sys.stdout.write(table)
    for p in problems:
        print("PROBLEM: " + p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
