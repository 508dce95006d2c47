"""PNG plots of a bench run: per-position acceptance, inter-token latency CDF, speedup vs gamma."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plots(results: dict[str, dict], outdir: str) -> list[Path]:
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    spec = {k: v for k, v in results.items() if "baseline" not in k}
    files = []

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in spec.items():
        pp = [x for x in r["per_position_acceptance"] if x is not None]
        ax.plot(range(1, len(pp) + 1), pp, marker="o", label=name)
    ax.set(xlabel="draft position", ylabel="acceptance", ylim=(0, 1), title="Per-position acceptance")
    ax.legend(fontsize=7)
    files.append(out / "acceptance_per_position.png")
    fig.savefig(files[-1], dpi=120, bbox_inches="tight")

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in results.items():
        xs = sorted(r.get("_itl", []))
        if xs:
            ax.plot([x * 1e3 for x in xs], [i / len(xs) for i in range(1, len(xs) + 1)], label=name)
    ax.set(xlabel="inter-token latency (ms)", ylabel="CDF", title="Inter-token latency")
    ax.legend(fontsize=7)
    files.append(out / "latency_cdf.png")
    fig.savefig(files[-1], dpi=120, bbox_inches="tight")

    fig, ax = plt.subplots(figsize=(6, 4))
    pts = sorted((r["gamma"], r.get("speedup", 0), r.get("bound", 0)) for r in spec.values())
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label="measured speedup")
    ax.plot([p[0] for p in pts], [p[2] for p in pts], marker="x", linestyle="--", label="Leviathan bound")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set(xlabel="gamma", ylabel="speedup over target-only", title="Speedup vs gamma")
    ax.legend(fontsize=7)
    files.append(out / "speedup_vs_gamma.png")
    fig.savefig(files[-1], dpi=120, bbox_inches="tight")
    plt.close("all")
    return files
