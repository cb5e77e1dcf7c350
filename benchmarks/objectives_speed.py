"""Forward+backward time and peak memory of each objective for global batches 512 ... 65,536, against
sentence-transformers' CoSENTLoss (its O(B log B) form) and raoe's own dense form, in the same run.

  python benchmarks/objectives_speed.py [--quick]

Each (objective, batch) runs in a fresh subprocess so its peak RSS is its own.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DIM = 128
DENSE_LIMIT = 16384  # B x B float32 masks beyond this need > 1 GB each


def build(name: str, batch: int, device="cpu"):
    """A closure computing loss(embeddings) for objective ``name`` and its inputs (on ``device``)."""
    import torch

    from objectives import angle_ibn_loss, angle_loss, cosent_loss, gated_angle_loss, infonce_loss, rank_margin_loss

    g = torch.Generator().manual_seed(0)
    e1 = torch.randn(batch, DIM, generator=g)
    e2 = torch.randn(batch, DIM, generator=g)
    scores = torch.rand(batch, generator=g)
    labels = torch.randint(0, 3, (batch,), generator=g)
    e1, e2, scores, labels = (t.to(device) for t in (e1, e2, scores, labels))

    from objectives._common import pair_cosine as cos  # what the composite's EmbeddingBatch.cosines() uses

    if name == "st_cosent":
        try:
            from sentence_transformers.sentence_transformer.losses import CoSENTLoss
        except ImportError:  # sentence-transformers before 6.1 (the GPU machine's 6.0.1)
            from sentence_transformers.losses import CoSENTLoss

        st = CoSENTLoss(torch.nn.Identity(), scale=20.0)
        fn = lambda a, b: st.compute_loss_from_embeddings([a, b], scores)
    elif name.startswith(("rank_margin", "cosent", "gated_angle", "raoe")):
        method = "dense" if name.endswith("_dense") else "sorted"
        base = name.removesuffix("_dense").removesuffix("_sorted")
        fn = {
            "rank_margin": lambda a, b: rank_margin_loss(cos(a, b), scores, margin=2, method=method),
            "cosent": lambda a, b: cosent_loss(cos(a, b), scores, method=method),
            "gated_angle": lambda a, b: gated_angle_loss(cos(a, b), labels, scores, method=method),
            "raoe": lambda a, b: (
                rank_margin_loss(c := cos(a, b), scores, method=method) + gated_angle_loss(c, labels, scores, method=method)
            ),
        }[base]
    elif name == "angle":
        fn = lambda a, b: angle_loss(a, b, scores)
    elif name == "angle_ibn":
        fn = lambda a, b: angle_ibn_loss(a, b, scores > 0.8)
    elif name == "infonce":
        fn = lambda a, b: infonce_loss(a, b)
    else:
        raise ValueError(name)
    return fn, e1, e2


def measure_one(name: str, batch: int, repeats: int) -> dict:
    import torch

    torch.set_num_threads(2)
    fn, e1, e2 = build(name, batch)

    def step():
        a, b = e1.clone().requires_grad_(), e2.clone().requires_grad_()
        loss = fn(a, b)
        loss.backward()
        return loss

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # inputs exist; nothing of the loss yet
    for _ in range(3):  # warm-up: the first calls pay for allocator growth and lazy kernel set-up (counted in the peak)
        step()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"objective": name, "batch": batch, "seconds": statistics.median(times),
            "peak_rss_increase_mb": (peak - before) / 1024, "repeats": repeats}


def measure_paired(batch: int, repeats: int) -> dict:
    """rank_margin (sorted) and CoSENTLoss alternately in one process: the ratio is immune to the machine's drift
    between separate cells (this VM's timings wander by 30-50% over minutes)."""
    import torch

    torch.set_num_threads(2)
    fns = {name: build(name, batch) for name in ("st_cosent", "rank_margin_sorted")}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(repeats + 3):
        for name, (fn, e1, e2) in fns.items():
            a, b = e1.clone().requires_grad_(), e2.clone().requires_grad_()
            t = time.perf_counter()
            fn(a, b).backward()
            if i >= 3:
                times[name].append(time.perf_counter() - t)
    st, ours = (statistics.median(times[n]) for n in ("st_cosent", "rank_margin_sorted"))
    return {"batch": batch, "st_cosent_seconds": st, "rank_margin_seconds": ours, "ratio": ours / st, "repeats": repeats}


def run_in_subprocess(name: str, batch: int, repeats: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--one", name, str(batch), str(repeats)],
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        return {"objective": name, "batch": batch, "error": out.stderr.strip().splitlines()[-1][:200]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def encoder_step_seconds(pairs: int = 64, tokens: int = 32) -> float:
    """Forward+backward of the MiniLM student on ``pairs`` pairs (both sides), the unit the loss is compared to."""
    import torch
    from transformers import AutoModel

    from encoders.sources import resolve_model_source

    torch.set_num_threads(2)
    model = AutoModel.from_pretrained(resolve_model_source("pypi:all-minilm-l6-v2"))
    ids = torch.randint(1000, 20000, (2 * pairs, tokens))
    mask = torch.ones_like(ids)
    model(input_ids=ids, attention_mask=mask).last_hidden_state.mean().backward()  # warm-up
    t = time.perf_counter()
    model(input_ids=ids, attention_mask=mask).last_hidden_state.mean().backward()
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="three batch sizes, fewer repeats")
    parser.add_argument("--one", nargs=3, metavar=("OBJECTIVE", "BATCH", "REPEATS"), help=argparse.SUPPRESS)
    parser.add_argument("--paired", nargs=2, metavar=("BATCH", "REPEATS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure_one(args.one[0], int(args.one[1]), int(args.one[2]))))
        return
    if args.paired:
        print(json.dumps(measure_paired(int(args.paired[0]), int(args.paired[1]))))
        return

    from benchmarks.common import machine, write_results

    sizes = [512, 4096, 65536] if args.quick else [512, 2048, 8192, 32768, 65536]
    objectives = ["st_cosent", "cosent_sorted", "cosent_dense", "rank_margin_sorted", "rank_margin_dense",
                  "gated_angle_sorted", "gated_angle_dense", "raoe_sorted", "raoe_dense", "angle", "angle_ibn", "infonce"]
    rows = []
    for batch in sizes:
        for name in objectives:
            if batch > DENSE_LIMIT and (name.endswith("_dense") or name in ("angle_ibn", "infonce")):
                continue  # B x B forms: ~B^2 * 4 bytes per matrix
            slow = name.endswith("_dense") or name in ("angle_ibn", "infonce")
            # Small batches take a millisecond or two: many repeats, so the median is not one scheduler hiccup.
            repeats = 3 if batch >= 32768 or (slow and batch >= 8192) else (30 if batch <= 2048 else 10)
            repeats = min(repeats, 7) if args.quick else repeats
            row = run_in_subprocess(name, batch, repeats)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    encoder_64 = encoder_step_seconds()
    by = {(r["objective"], r["batch"]): r for r in rows if "seconds" in r}
    paired = []
    for b in sizes:
        out = subprocess.run([sys.executable, __file__, "--paired", str(b), str(60 if b <= 8192 else 9)],
                             capture_output=True, text=True, timeout=900)
        paired.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(paired[-1]), file=sys.stderr, flush=True)
    ratios = {str(p["batch"]): p["ratio"] for p in paired}
    encoder_512 = encoder_64 * 512 / 64
    raoe_512 = min(by[(n, 512)]["seconds"] for n in ("raoe_sorted", "raoe_dense") if (n, 512) in by)
    headline = {
        "rank_margin_vs_st_cosent_time_ratio": ratios,
        "rank_margin_goal_met": all(r <= 1.2 for r in ratios.values()),
        "raoe_loss_512_seconds": raoe_512,
        "encoder_step_512_pairs_seconds_estimated": encoder_512,
        "raoe_loss_share_of_encoder_step_512": raoe_512 / encoder_512,
        "raoe_65536_seconds": by.get(("raoe_sorted", 65536), {}).get("seconds"),
        "raoe_65536_peak_rss_increase_mb": by.get(("raoe_sorted", 65536), {}).get("peak_rss_increase_mb"),
    }
    lines = [
        "# Objectives: forward+backward time (ms) and peak RSS increase (MB)", "",
        f"Machine: {machine()}; embeddings dim {DIM}; median of 30 repeats (B <= 2048), 10 (8192) or 3 (larger "
        "or dense at 8192), after 3 warm-up steps; each cell in a fresh process.", "",
        "| objective | " + " | ".join(f"B={b}" for b in sizes) + " |", "|---|" + "---|" * len(sizes),
    ]
    for name in objectives:
        cells = []
        for b in sizes:
            r = by.get((name, b))
            cells.append("-" if r is None else f"{r['seconds'] * 1000:.1f} ms / {r['peak_rss_increase_mb']:.0f} MB")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "rank_margin (sorted, I = 2) / sentence-transformers CoSENTLoss time ratio, measured alternately in one "
              "process (median of 60 pairs of runs, 9 above B = 8192): "
              + ", ".join(f"B={b}: {r:.2f}x" for b, r in ratios.items()),
              f"RAOE composite at B=512: {raoe_512 * 1000:.2f} ms = {100 * raoe_512 / encoder_512:.3f}% of one MiniLM "
              f"encoder step on 512 pairs x 32 tokens ({encoder_512:.1f} s, measured on 64 pairs and scaled).", ""]
    payload = {"machine": machine(), "dim": DIM, "rows": rows, "paired": paired, "headline": headline,
               "quick": args.quick}
    path = write_results("objectives_quick" if args.quick else "objectives", payload, "\n".join(lines))
    _plot(rows, sizes, path.with_suffix(".png"))
    print(json.dumps({"benchmark": "objectives", "results": str(path), **headline}))


def _plot(rows, sizes, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in sorted({r["objective"] for r in rows}):
        pts = [(r["batch"], r["seconds"] * 1000) for r in rows if r["objective"] == name and "seconds" in r]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=name)
    ax.set(xscale="log", yscale="log", xlabel="global batch (pairs)", ylabel="forward+backward (ms)",
           title="raoe objectives vs sentence-transformers CoSENTLoss")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
