"""Serve a registered model (or an alias, followed as it moves) over HTTP with Ray Serve: POST /v1/embeddings in
OpenAI's shape ({"input": str | [str], "model", "dimensions", "encoding_format": float | base64, "prompt_name"}),
GET /healthz. Binds to 127.0.0.1 unless serve.host says otherwise.

On a running cluster (RAY_ADDRESS, or under `ray job submit`) the job deploys, prints its JSON line with the url and
returns; `serve shutdown` stops the endpoint. Without one it starts a local Ray, prints the JSON line and serves until
interrupted (Ctrl-C).

  python ray_jobs/serve.py --config configs/serve/default.yaml --set model.source=models:/raoe-s2@champion
  python ray_jobs/serve.py --config configs/tiny/serve.yaml --set serve.port=8011
"""

import os
from typing import Literal

from pydantic import Field, field_validator, model_validator

import _bootstrap  # noqa: F401  (project on sys.path, safe Ray environment)
from encoders.export_formats import runs_here
from jobconfig import parse_job_args
from jobconfig.schema import Section
from runtime.result import run_job


class ServeModel(Section):
    source: str = Field("pypi:all-minilm-l6-v2", description="what to serve: a path, pypi:<package>, HF id or MLflow "
                        "model URI; an alias (models:/raoe-s2@champion) is followed: a moved alias is served within "
                        "serve.reload_s, without a restart")


class Autoscaling(Section):
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(2, ge=1)
    target_ongoing_requests: float = Field(8.0, gt=0, description="requests in flight per replica Serve aims at")


class ServeSection(Section):
    host: str = Field("127.0.0.1", description="address the HTTP proxy binds to (0.0.0.0 exposes it)")
    port: int = Field(8000, ge=1, le=65535)
    format: Literal["torch", "merged", "onnx", "onnx_int8", "openvino"] = Field(
        "torch", description="what replicas run: the model itself, or an export built once per model into the cache "
        "(check its parity with ray_jobs/export.py first; openvino: where the openvino package is installed)")
    replicas: int = Field(1, ge=1, description="replicas when serve.autoscaling is not set")
    autoscaling: Autoscaling | None = Field(None, description="{min_replicas, max_replicas, target_ongoing_requests}")
    cpus_per_replica: float = Field(1.0, gt=0)
    max_texts: int = Field(256, ge=1, description="texts one request may hold (more: 413)")
    max_batch_size: int = Field(32, ge=1, description="requests one encoder call may take (@serve.batch)")
    batch_wait_s: float = Field(0.005, ge=0, description="how long a batch waits for more requests")
    batch_size: int = Field(64, ge=1, description="texts per forward pass")
    reload_s: float = Field(30.0, ge=0, description="how often a replica serving an alias checks where it points; 0: "
                            "never")
    token_env: str | None = Field(None, description="name of an environment variable holding the bearer token "
                                  "requests must carry (never the token itself in a config file); null: open")
    app_name: str = Field("raoe-embeddings", description="the Serve application's name (serve shutdown, status)")

    @field_validator("format")
    @classmethod
    def _runs_here(cls, fmt: str) -> str:
        return runs_here(fmt, "serve.format")

    @model_validator(mode="after")
    def _token_is_set(self):
        if self.token_env and not os.environ.get(self.token_env):
            raise ValueError(f"serve.token_env={self.token_env!r} names an environment variable that is not set")
        return self


class ServeJobConfig(Section):
    model: ServeModel = Field(default_factory=ServeModel)
    serve: ServeSection = Field(default_factory=ServeSection)


def main(cfg: ServeJobConfig, block: bool | None = None) -> dict:
    """Deploy; ``block``: serve here until interrupted (default: when this job started the Ray it serves on)."""
    from ray import serve

    from encoders.model_uris import resolve_alias, resolve_model
    from runtime.local_ray import start_ray, worker_env
    from serving.embeddings import EmbeddingServer, ServeSettings

    s = cfg.serve
    resolve_model(resolve_alias(cfg.model.source) if cfg.model.source.startswith("models:/") else cfg.model.source)
    started_here = start_ray()
    settings = ServeSettings(cfg.model.source, s.format, s.max_texts, s.max_batch_size, s.batch_wait_s, s.reload_s,
                             os.environ.get(s.token_env) if s.token_env else None, s.batch_size)
    scale = {"autoscaling_config": s.autoscaling.model_dump()} if s.autoscaling else {"num_replicas": s.replicas}
    # the driver's MLflow store, caches and hub settings reach the replicas (a cluster's workers do not see them)
    actor = {"num_cpus": s.cpus_per_replica, "runtime_env": {"env_vars": worker_env()}}
    # A replica takes up to two batches' requests at once (Serve's default is 5): with fewer, Serve's router holds
    # the rest back and retries with a backoff, and 32 single-text clients waited seconds for batches of five.
    deployment = EmbeddingServer.options(ray_actor_options=actor, max_ongoing_requests=2 * s.max_batch_size, **scale)
    serve.start(http_options={"host": s.host, "port": s.port})
    serve.run(deployment.bind(settings), name=s.app_name, route_prefix="/", blocking=False)
    url = f"http://{s.host}:{s.port}"
    result = {"url": url, "embeddings_url": f"{url}/v1/embeddings", "app": s.app_name, "model": cfg.model.source,
              "format": s.format, "stop": "serve shutdown -y (or Ctrl-C here)"}
    if block if block is not None else started_here:
        from runtime.result import emit_result

        emit_result({"job": "serve", "status": "ok", **result})  # the JSON line, then serve until interrupted
        _serve_until_interrupted()
    return result


def _serve_until_interrupted() -> None:
    import time

    while True:
        time.sleep(3600)


if __name__ == "__main__":
    config = parse_job_args(ServeJobConfig, __doc__)
    run_job(lambda: main(config), "serve")
