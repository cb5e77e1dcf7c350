"""Exports of the MiniLM student: parity with the torch model and texts/s, for the merged folder (torch fp32), ONNX
fp32, ONNX int8 and OpenVINO fp32 (where the openvino package is installed), in one run of the export job.

  python benchmarks/export.py [--pairs 1500]

Every export embeds the texts of the first ``--pairs`` STS-B dev pairs beside the source model (batch 32, this
machine's CPUs): per-text cosine to the source (min, mean), STS-B dev Spearman and its change, texts/s. The job's
thresholds apply (fp32 0.9999, int8 0.99, score change 0.5); an export they refuse is still reported here, marked.
Results: ``benchmarks/results/export.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "ray_jobs"))

from benchmarks.common import machine, write_results  # noqa: E402
from encoders.export_formats import openvino_missing  # noqa: E402

MODEL = "pypi:all-minilm-l6-v2"
SENTEVAL = ROOT.parent / "shared" / "data" / "senteval"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=1500, help="STS-B dev pairs whose texts are embedded")
    args = parser.parse_args()
    import export

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp}/mlflow.db"
        os.environ["RAOE_MLFLOW_ARTIFACTS"] = f"{tmp}/artifacts"
        formats = ["merged", "onnx", "onnx_int8"] + ([] if openvino_missing() else ["openvino"])
        every = {"sample_pairs": args.pairs, "formats": formats}
        cfg = export.ExportJobConfig(model={"source": MODEL}, export=every,
                                     eval={"data_dir": str(SENTEVAL)}, output_dir=f"{tmp}/exports",
                                     tracking={"experiment": "bench-export"})
        try:
            result = export.main(cfg)
            figures, refused = result["exports"], set()
        except export.ExportRefused as exc:
            figures, refused = exc.figures, set(exc.refused)
            result = None
        from encoders.backbone import load_encoder
        from encoders.model_uris import resolve_model
        from evaluation.parity import source_embeddings
        from evaluation.sts import load_task

        pairs = load_task(SENTEVAL, "STSBenchmark", "dev").head(args.pairs)
        source = source_embeddings(load_encoder(resolve_model(MODEL)), pairs, 32)
    names = {"merged": "merged folder (torch fp32)", "onnx": "ONNX fp32",
             "onnx_int8": "ONNX int8 (up-projections, per-channel)", "openvino": "OpenVINO fp32 (from the ONNX graph)"}
    lines = ["# Exports of the MiniLM student: parity and speed", "",
             f"`{MODEL}`; the texts of the first {args.pairs} STS-B dev pairs ({len(source.texts):,} texts), batch 32, "
             f"{os.cpu_count()} CPUs. Cosine: each text's export embedding against the torch model's.", "",
             "| export | min cosine | mean cosine | STS-B dev | change | texts/s | vs torch | kept by the job |",
             "|---|---|---|---|---|---|---|---|",
             f"| source (torch fp32) | 1 | 1 | {source.score:.2f} | | {source.texts_per_s:.0f} | 1.00x | |"]
    for fmt, f in figures.items():
        lines.append(f"| {names[fmt]} | {f['min_cosine']:.6f} | {f['mean_cosine']:.6f} | {f['score']:.2f} | "
                     f"{f['score_delta']:+.2f} | {f['texts_per_s']:.0f} | {f['texts_per_s'] / source.texts_per_s:.2f}x | "
                     f"{'no: refused' if fmt in refused else 'yes'} |")
    payload = {"machine": machine(), "model": MODEL, "pairs": args.pairs, "texts": len(source.texts),
               "source": {"score": source.score, "texts_per_s": source.texts_per_s}, "exports": figures,
               "refused": sorted(refused), "job_ok": result is not None}
    print(write_results("export", payload, "\n".join(lines) + "\n").read_text())


if __name__ == "__main__":
    main()
