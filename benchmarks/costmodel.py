"""An alpha-beta cost model of all-reduce, ring and tree, fitted to measurements of the test bed.

A message of ``b`` bytes all-reduced over ``n`` ranks, on links with a per-message latency
``alpha`` (seconds) and a per-byte time ``beta`` (seconds per byte, 1 / bandwidth), takes

    ring:  2 (n - 1) alpha + 2 (n - 1) / n * b * beta     reduce-scatter, then all-gather
    tree:  2 ceil(log2 n) (alpha + b * beta)               binomial reduce, then broadcast

(Thakur, Rabenseifner and Gropp, "Optimization of collective communication operations in MPICH",
2005; Patarasuk and Yuan, 2009, for the ring's bandwidth term). The ring is bandwidth-optimal and
is what gloo runs for CPU tensors; the tree has fewer latency terms and wins for small messages
on many ranks.

``fit`` finds ``alpha`` and ``beta`` from measured (n, bytes, seconds) by least squares on the
relative error (small messages count as much as large ones). Run as a script on the sweep that
``benchmarks/allreduce.py`` writes:

    python benchmarks/costmodel.py benchmarks/results/allreduce.json

It fits each link rate on the 2-host runs alone, predicts the 4-host runs from that fit (and the
2-host runs back), and prints the error of every prediction.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Iterable, NamedTuple, Sequence

ALGORITHMS = ("ring", "tree")


class Link(NamedTuple):
    """A link as the model sees it."""

    alpha: float  # seconds per message step (latency plus per-message software cost)
    beta: float  # seconds per byte (1 / bandwidth)

    @property
    def bandwidth_bps(self) -> float:
        return 8 / self.beta if self.beta > 0 else math.inf


def _terms(algo: str, n: int, nbytes: float) -> tuple[float, float]:
    """The coefficients of alpha and beta in the time of one all-reduce."""
    if n < 2:
        return 0.0, 0.0
    if algo == "ring":
        return 2 * (n - 1), 2 * (n - 1) / n * nbytes
    if algo == "tree":
        steps = 2 * math.ceil(math.log2(n))
        return steps, steps * nbytes
    raise ValueError(f"algorithm {algo!r}: expected one of {ALGORITHMS}")


def allreduce_time(n: int, nbytes: float, link: Link, algo: str = "ring") -> float:
    """Predicted seconds for one all-reduce of ``nbytes`` over ``n`` ranks.

    Example:
        >>> round(allreduce_time(2, 8e6, Link(alpha=50e-6, beta=8 / 1e9)), 4)  # 8 MB, 1 Gbit/s
        0.0641
    """
    a, b = _terms(algo, n, nbytes)
    return a * link.alpha + b * link.beta


def fit(samples: Iterable[tuple[int, float, float]], algo: str = "ring", beta: float | None = None) -> Link:
    """Least-squares ``alpha`` and ``beta`` (both >= 0) from (ranks, bytes, seconds) samples,
    minimising the relative error of the predictions; with ``beta`` given (say, from the measured
    TCP rate), only ``alpha``.

    Example:
        >>> link = Link(alpha=100e-6, beta=8 / 1e9)
        >>> samples = [(n, b, allreduce_time(n, b, link)) for n in (2, 4) for b in (4e3, 1e6, 64e6)]
        >>> fitted = fit(samples)
        >>> round(fitted.alpha * 1e6, 3), round(fitted.bandwidth_bps / 1e9, 3)
        (100.0, 1.0)
    """
    rows = [(*_terms(algo, n, b), t) for n, b, t in samples if n >= 2 and t > 0]
    if len(rows) < 2:
        raise ValueError("fit needs at least two samples with two or more ranks")
    if beta is not None:
        alpha = sum(a / t * (1 - b * beta / t) for a, b, t in rows) / sum((a / t) ** 2 for a, _, t in rows)
        return Link(max(alpha, 0.0), beta)
    # Normal equations of min sum ((a_i alpha + b_i beta) / t_i - 1)^2.
    saa = sum((a / t) ** 2 for a, _, t in rows)
    sbb = sum((b / t) ** 2 for _, b, t in rows)
    sab = sum(a * b / t**2 for a, b, t in rows)
    sa = sum(a / t for a, _, t in rows)
    sb = sum(b / t for _, b, t in rows)
    det = saa * sbb - sab**2
    alpha, beta = ((sa * sbb - sb * sab) / det, (sb * saa - sa * sab) / det) if det > 0 else (-1.0, -1.0)
    if alpha < 0 or beta < 0:  # clamp one term at zero and refit the other
        only_beta = (0.0, sb / sbb if sbb > 0 else 0.0)
        only_alpha = (sa / saa if saa > 0 else 0.0, 0.0)
        alpha, beta = min((only_beta, only_alpha), key=lambda ab: _loss(rows, *ab))
    return Link(alpha, beta)


def _loss(rows: Sequence[tuple[float, float, float]], alpha: float, beta: float) -> float:
    return sum(((a * alpha + b * beta) / t - 1) ** 2 for a, b, t in rows)


def samples_of(run: dict, stat: str = "median", min_bytes: int = 0) -> list[tuple[int, float, float]]:
    """(ranks, bytes, seconds) of one run of benchmarks/allreduce.py, messages of ``min_bytes`` or
    more; ``stat``: "median" or "min" of its repeats (the minimum is the least disturbed by other
    work on the machine)."""
    return [(run["world_size"], s["bytes"], s[f"{stat}_s"]) for s in run["sizes"] if s["bytes"] >= min_bytes]


def validate(
    record: dict,
    fit_hosts: int | None = 2,
    algo: str = "ring",
    stat: str = "median",
    beta_from_tcp: bool = False,
    min_bytes: int = 0,
) -> dict:
    """Fit every link rate on its ``fit_hosts``-host run (None: on all); predict every run of that rate.

    With ``beta_from_tcp`` the bandwidth is not fitted but taken from the TCP rate measured on the
    same links (the slowest of the fitted runs): only the latency comes from the all-reduces.
    Messages under ``min_bytes`` are left out of the fit and the errors.

    Returns ``{rate: {"link": Link, "fitted_on": ..., "runs": [{"hosts", "world_size", "rows":
    [(bytes, measured_s, predicted_s, error)], "max_abs_error", "mean_abs_error"}]}}``.
    """
    out: dict = {}
    for rate in dict.fromkeys(r["rate"] for r in record["runs"]):
        runs = [r for r in record["runs"] if r["rate"] == rate]
        basis = [r for r in runs if fit_hosts is None or r["hosts"] == fit_hosts] or runs
        beta = 8 / min(r["tcp_bps"] for r in basis) if beta_from_tcp else None
        link = fit([s for r in basis for s in samples_of(r, stat, min_bytes)], algo, beta)
        checked = []
        for r in runs:
            rows = []
            for n, b, t in samples_of(r, stat, min_bytes):
                p = allreduce_time(n, b, link, algo)
                rows.append((b, t, p, p / t - 1))
            errs = [abs(e) for *_, e in rows]
            checked.append({
                "hosts": r["hosts"], "world_size": r["world_size"], "rows": rows,
                "max_abs_error": max(errs), "mean_abs_error": sum(errs) / len(errs),
                "fitted": r in basis,
            })  # fmt: skip
        out[rate] = {"link": link, "fitted_on": "all runs" if fit_hosts is None else f"{fit_hosts} hosts", "runs": checked,
                     "rate_bps": runs[0].get("rate_bps"), "tcp_bps": runs[0].get("tcp_bps")}  # fmt: skip
    return out


def _size(b: float) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:g} {unit}"
    return f"{b:g} B"


def report(
    record: dict,
    algos: Sequence[str] = ALGORITHMS,
    stat: str = "median",
    fit_hosts: int | None = 2,
    detail: bool = True,
    min_bytes: int = 0,
) -> str:
    """The fits, a summary of their errors and the measured-vs-predicted tables, as text."""
    basis = "all runs" if fit_hosts is None else f"the {fit_hosts}-host run"
    sizes = f", messages of {_size(min_bytes)} or more" if min_bytes else ""
    lines = [
        f"alpha-beta fits on {basis} of each link rate ({stat} of the repeats{sizes}); error = model / measured - 1",
        "",
    ]
    lines.append(f"  {'model':<22}{'rate':>8}{'alpha us':>10}{'Gbit/s':>8}   mean |error| (max) per run")
    fits = {}
    for algo in algos:
        for beta_from_tcp in (False, True):
            v = fits[algo, beta_from_tcp] = validate(record, fit_hosts, algo, stat, beta_from_tcp, min_bytes)
            name = f"{algo}, {'beta = TCP rate' if beta_from_tcp else 'both fitted'}"
            for rate, f in v.items():
                errs = "  ".join(
                    f"{r['hosts']} hosts{'*' if r['fitted'] else ''}: {100 * r['mean_abs_error']:.0f}% ({100 * r['max_abs_error']:.0f}%)"
                    for r in f["runs"]
                )
                lines.append(
                    f"  {name:<22}{rate:>8}{1e6 * f['link'].alpha:10.1f}{f['link'].bandwidth_bps / 1e9:8.3f}   {errs}"
                )
    lines.append("  (* the run the model was fitted on; the others are predictions)")
    if not detail:
        return "\n".join(lines)
    for (algo, beta_from_tcp), v in fits.items():
        lines.append(f"\n== {algo}, {'beta from the TCP rate' if beta_from_tcp else 'alpha and beta fitted'} ==")
        for rate, f in v.items():
            link = f["link"]
            nominal = f"; link {f['rate_bps'] / 1e9:g} Gbit/s" if f.get("rate_bps") else ""
            tcp = f", TCP {f['tcp_bps'] / 1e9:.2f} Gbit/s" if f.get("tcp_bps") else ""
            lines.append(
                f"{rate}: alpha {1e6 * link.alpha:.1f} us, {link.bandwidth_bps / 1e9:.3f} Gbit/s{nominal}{tcp}"
            )
            for run in f["runs"]:
                tag = "fitted" if run["fitted"] else "predicted"
                lines.append(f"  {run['hosts']} hosts ({run['world_size']} ranks, {tag})")
                lines.append(f"    {'size':>9}{'measured ms':>13}{'model ms':>10}{'error':>8}")
                for b, t, p, e in run["rows"]:
                    lines.append(f"    {_size(b):>9}{1e3 * t:13.3f}{1e3 * p:10.3f}{100 * e:7.1f}%")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="?", default=str(Path(__file__).parent / "results" / "allreduce.json"))
    p.add_argument("--algo", choices=ALGORITHMS, nargs="+", default=list(ALGORITHMS))
    p.add_argument("--stat", choices=("median", "min"), default="median")
    p.add_argument(
        "--fit-hosts",
        type=lambda s: None if s == "all" else int(s),
        default=2,
        help="fit on the runs with this many hosts ('all': on every run)",
    )
    p.add_argument("--summary", action="store_true", help="only the fits and their errors")
    p.add_argument("--min-bytes", type=int, default=0, help="leave smaller messages out of the fit and the errors")
    args = p.parse_args()
    record = json.loads(Path(args.results).read_text())
    print(report(record, args.algo, args.stat, args.fit_hosts, not args.summary, args.min_bytes))


if __name__ == "__main__":
    main()
