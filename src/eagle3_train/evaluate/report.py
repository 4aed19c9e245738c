"""Evaluation reports: `DIR/results.json`, a printed table and a PNG bar chart of acceptance by draft position.

Works on offline results (`benchmarks: {name: summary}` plus `overall`) and on served results (`acceptance`:
one summary for the whole run). A summary carries vLLM's metric names: `mean_acceptance_length`,
`per_position_acceptance` (list), `num_drafts`, and optionally `tokens_per_verifier_forward`, `tokens_per_s`.

Python API: `acceptance_rows(results) -> list[(label, summary)]`, `format_table(results) -> str`,
`plot_acceptance(results, path) -> Path | None`, `write_report(results, out_dir) -> dict[str, str]`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3_train.utils.display import first_few, number
from eagle3_train.utils.io import atomic_path, write_json

RESULTS = "results.json"
CHART = "acceptance_by_position.png"
REPORT_FILES = (RESULTS, CHART)  # what `write_report` writes, as an evaluation directory's marker lists it


def acceptance_rows(results: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(label, summary) per benchmark, then the overall row when there is more than one benchmark."""
    benchmarks = results.get("benchmarks")  # offline: {name: summary}; served: a list of benchmark names
    rows = [(name, s) for name, s in benchmarks.items() if isinstance(s, dict)] if isinstance(benchmarks, dict) else []
    if results.get("overall") and len(rows) != 1:
        rows.append(("overall", results["overall"]))
    for name, s in ((results.get("overall") or {}).get("by_region") or {}).items():  # a thinking model's output
        rows.append((f"  in {name}", s))
    temperatures = results.get("at_temperature") or {}
    served = []
    if not rows and len(temperatures) > 1:  # served at several temperatures: one row each
        served = [(f"{results.get('mode', 'served')} T={t}", s) for t, s in temperatures.items()]
    elif not rows and isinstance(results.get("acceptance"), dict):
        served = [(results.get("mode", "served"),
                   {**results["acceptance"], "tokens_per_s": results.get("tokens_per_s")})]
    for label, s in served:  # each followed by its reasoning / answer rows (a thinking model)
        rows += [(label, s)] + [(f"  in {name}", r) for name, r in (s.get("by_region") or {}).items()]
    return rows


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_table(results: dict[str, Any]) -> str:
    rows = acceptance_rows(results)
    if not rows:
        return "(no acceptance data)"
    k = max(len(s.get("per_position_acceptance") or []) for _, s in rows)
    head = ["benchmark", "drafts", "mean acc. len"] + [f"acc@{i + 1}" for i in range(k)] + ["tok/fwd", "tok/s"]
    body = []
    for name, s in rows:
        per = list(s.get("per_position_acceptance") or [])
        per += [None] * (k - len(per))
        body.append([name, _fmt(s.get("num_drafts")), _fmt(s.get("mean_acceptance_length"))]
                    + [_fmt(x) for x in per]
                    + [_fmt(s.get("tokens_per_verifier_forward")), number(s.get("tokens_per_s"))])
    widths = [max(len(r[i]) for r in [head] + body) for i in range(len(head))]

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    out = [line(head), "  ".join("-" * w for w in widths)] + [line(r) for r in body]
    extra = []
    if results.get("held_out_check", {}).get("checked"):
        h = results["held_out_check"]
        extra.append(f"held out: {h['held_out']} ({len(h['prompts_in_train'])} prompt(s) found in the training data)")
    elif "held_out_check" in results:
        extra.append(f"held out: unknown ({results['held_out_check'].get('reason')})")
    g = results.get("greedy_check")
    if g and g.get("checked"):
        extra.append("greedy check: " + ("identical to greedy decoding" if g["passed"] else
                                         f"{len(g['mismatches'])} near-tie difference(s): "
                                         + first_few([_mismatch(m) for m in g["mismatches"]], 3, RESULTS)))
    same = results.get("greedy_identical")
    if isinstance(same, dict):  # served at temperature 0: the outputs against the verifier alone
        extra.append(f"greedy outputs vs baseline: {same.get('identical')} of {same.get('compared')} identical"
                     + (f"; differing: {first_few(same['differing_ids'], 5, RESULTS)}"
                        if same.get("differing_ids") else ""))
    return "\n".join(out + extra)


def _mismatch(m: dict[str, Any]) -> str:
    """One difference from greedy decoding, short: where, and by how much the verifier preferred its token."""
    gap = m.get("full_forward_logit_gap")
    return (f"prompt {m.get('prompt')} turn {m.get('turn')} at new token {m.get('position')}"
            + (f" (logit gap {number(gap, 3)})" if gap is not None else " (lengths differ)"))


def plot_acceptance(results: dict[str, Any], path: str | Path) -> Path | None:
    """Grouped bars: acceptance rate at each draft position, one group per benchmark; None without data."""
    rows = [(n, s) for n, s in acceptance_rows(results) if s.get("per_position_acceptance")]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = max(len(s["per_position_acceptance"]) for _, s in rows)
    width = 0.8 / len(rows)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * k + 2), 3.8))
    try:
        for j, (name, s) in enumerate(rows):
            rates = s["per_position_acceptance"]
            xs = [i + 1 + (j - (len(rows) - 1) / 2) * width for i in range(len(rates))]
            tau = s.get("mean_acceptance_length")
            label = f"{name} (mean acc. len {tau:.2f})" if tau is not None else name
            ax.bar(xs, rates, width=width, label=label)
        ax.set_xticks(range(1, k + 1))
        ax.set_xlabel("draft position")
        ax.set_ylabel("acceptance rate (accepted / drafts)")
        ax.set_ylim(0, 1.05)
        ax.set_title("EAGLE-3 draft acceptance by position")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = Path(path)
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=120, format="png")
    finally:
        plt.close(fig)
    return path


def write_report(results: dict[str, Any], out_dir: str | Path) -> dict[str, str]:
    """Write results.json and the chart into `out_dir`; return their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"results": str(out_dir / RESULTS)}
    chart = plot_acceptance(results, out_dir / CHART)
    if chart is not None:
        paths["chart"] = str(chart)
        results = {**results, "chart": chart.name}
    write_json(out_dir / RESULTS, results)
    return paths
