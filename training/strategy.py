"""The two ways a worker group shares one model: DDP through Ray Train's torch backend, or a DeepSpeed engine
(ZeRO stage from config). Both expose the same small surface to the loop: forward module, autocast, backward,
step (returning the global gradient norm before clipping), learning rate, full parameters for evaluation and
export, and checkpoint save/load, so the loop itself has no strategy branches.

``trainer.bf16`` means one thing under both: the encoder's forward runs under bf16 autocast, while weights,
gradients, optimizer state, checkpoints and exports stay fp32 (DeepSpeed through its ``torch_autocast`` section
with fp32 gradient communication, not its ``bf16`` section, which would make the weights themselves bf16)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from jobconfig.schema import TrainerConfig
from training.kinds import ModelAdditions

TRAINER_STATE = "trainer_state.pt"
DEEPSPEED_DIR = "deepspeed"
DEEPSPEED_TAG = "latest_step"


def grad_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm of the parameters' gradients, accumulated in fp32 whatever their dtype."""
    return torch.nn.utils.get_total_norm([p.grad.float() for p in params])


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float,
                    additions: ModelAdditions | None = None) -> torch.optim.Optimizer:
    """AdamW; no weight decay on biases and norm weights (the BERT recipe). The parameter groups of a kind's additions
    (RSE's randomly initialised relation table, at its own learning rate) are taken as they are."""
    additions = additions or ModelAdditions()
    own = {id(param) for group in additions.param_groups for param in group["params"]}
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad and id(param) not in own:
            (no_decay if param.ndim < 2 or "norm" in name.lower() else decay).append(param)
    if not decay and not no_decay:
        raise ValueError("the model has no trainable parameters (a LoRA adapter start model needs model.lora set)")
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0},
              *additions.param_groups]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr)


def build_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int):
    from transformers import get_linear_schedule_with_warmup

    return get_linear_schedule_with_warmup(optimizer, warmup_steps, total_steps)


class TorchStrategy:
    """One process, or DDP over the worker group (gloo on CPU, nccl on GPU)."""

    name = "ddp"

    def __init__(self, model, trainer: TrainerConfig, plan, world: int, additions: ModelAdditions | None = None):
        self.model = model
        self.device = next(model.parameters()).device
        self.module = model
        if world > 1:  # on the process group Ray Train opened (or any other: the tests open one without Ray)
            from torch.nn.parallel import DistributedDataParallel

            cuda = self.device.type == "cuda"
            self.module = DistributedDataParallel(model, device_ids=[self.device] if cuda else None,
                                                  output_device=self.device if cuda else None)
        additions = additions or ModelAdditions()  # a kind's trainable state beside the encoder, if any
        self.watched = additions.watched
        self.optimizer = build_optimizer(model, trainer.lr, trainer.weight_decay, additions)
        self.scheduler = build_scheduler(self.optimizer, plan.warmup_steps, plan.total_steps)
        self.grad_clip = trainer.grad_clip
        self.grad_accum = plan.grad_accum
        self.world = world
        self.bf16 = trainer.bf16
        self.watched_norms: dict[str, float] = {}

    evaluates_on_every_rank = False  # rank 0 holds the full model

    def autocast(self):
        """bf16 autocast around the encoder only (never the objective)."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)

    def full_parameters(self):
        """Every rank holds the full weights already."""
        return contextlib.nullcontext()

    def sync_context(self, last_backward: bool):
        """DDP all-reduces gradients only on the last backward pass of an optimizer step."""
        if self.world > 1 and not last_backward:
            return self.module.no_sync()
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """Gradients of ``loss`` / grad_accum added to the parameters' (a micro-batch's loss, or one chunk's part of
        it with cached embeddings)."""
        (loss / self.grad_accum).backward()

    def step(self) -> float:
        """Clip, step, and return the norm of the (all-reduced, so global) gradient before clipping."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = grad_norm(params)
        self.watched_norms = {k: float(grad_norm([p])) for k, p in self.watched.items() if p.grad is not None}
        if self.grad_clip:
            torch.nn.utils.clip_grads_with_norm_(params, self.grad_clip, norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def micro_step(self) -> None:
        """Called after every backward pass; only DeepSpeed needs it."""

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def save(self, folder: Path, rank: int, state: dict[str, Any]) -> bool:
        """Write this rank's part of a checkpoint; True if it wrote anything (only rank 0 does under DDP)."""
        if rank != 0:
            return False
        torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(), **state},
                   folder / TRAINER_STATE)
        return True

    def load(self, folder: Path) -> dict[str, Any]:
        # weights_only: tensors and plain containers only, never arbitrary pickled objects from the storage path
        saved = torch.load(folder / TRAINER_STATE, map_location=self.device, weights_only=True)
        self.optimizer.load_state_dict(saved.pop("optimizer"))
        self.scheduler.load_state_dict(saved.pop("scheduler"))
        return saved


def backward_passes(trainer: TrainerConfig, plan) -> int:
    """Backward passes per optimizer step on each worker: one per micro-batch, or with cached embeddings one per
    chunk (training.step)."""
    return plan.grad_accum * (plan.chunks_per_micro if trainer.cache_embeddings else 1)


def deepspeed_config(trainer: TrainerConfig, plan) -> dict[str, Any]:
    """DeepSpeed counts a backward pass as a micro-step: its accumulation boundary is the step's last backward."""
    passes = backward_passes(trainer, plan)
    return {
        "train_micro_batch_size_per_gpu": plan.global_batch // (plan.world * passes),
        "gradient_accumulation_steps": passes,
        "train_batch_size": plan.global_batch,
        "gradient_clipping": trainer.grad_clip or 0.0,
        "zero_optimization": {"stage": trainer.zero_stage},
        # bf16 = autocast with fp32 weights, as under DDP; no Linear is "lower-precision safe", so gradients are
        # all-reduced in fp32 too. (The "bf16" section would keep the weights and checkpoints in bf16.)
        "torch_autocast": {"enabled": trainer.bf16, "dtype": "bfloat16",
                           "lower_precision_safe_modules": []},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def weights_only_checkpoint_engine(config):
    """DeepSpeed's torch checkpoint engine, loading with ``torch.load(weights_only=True)`` (DeepSpeed's own passes
    ``weights_only=False``, which runs any pickled code a checkpoint on shared storage carries). Its files hold
    tensors, numbers, strings and containers, plus these DeepSpeed types, allowed by name: the ZeRO optimizer's loss
    scaler, its stage enum and the fragment addresses of its flat partitions."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    allowed = [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]

    class WeightsOnlyCheckpointEngine(TorchCheckpointEngine):
        def load(self, path: str, map_location=None):
            with torch.serialization.safe_globals(allowed):
                return torch.load(path, map_location=map_location, weights_only=True)

    return WeightsOnlyCheckpointEngine(config)


SHM_OP = "deepspeed_shm_comm"


def without_inference_shm_op() -> None:
    """DeepSpeed's communication backend compiles its shared-memory all-reduce with g++ the first time it starts on a
    CPU node (35-80 s per node and per fresh cache here) though only ``inference_all_reduce`` uses it; training's
    collectives are the process group's. Marking the op unavailable (DeepSpeed keeps the probed table in
    ``deepspeed.ops``, meant to be edited) skips the build; every collective raoe issues is unchanged."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[SHM_OP] = False


class DeepSpeedStrategy:
    """``deepspeed.initialize`` in the loop (not Ray's prepare_model), on the process group Ray Train opened.
    The optimizer is torch's AdamW, so nothing needs DeepSpeed's compiled CPU-Adam; ZeRO shards its state."""

    name = "deepspeed"

    def __init__(self, model, trainer: TrainerConfig, plan, world: int, additions: ModelAdditions | None = None):
        import deepspeed

        without_inference_shm_op()
        self.model = model
        additions = additions or ModelAdditions()  # a kind's trainable state beside the encoder, if any
        self.watched = additions.watched
        optimizer = build_optimizer(model, trainer.lr, trainer.weight_decay, additions)
        scheduler = build_scheduler(optimizer, plan.warmup_steps, plan.total_steps)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=deepspeed_config(trainer, plan),
            dist_init_required=False,
        )
        self.engine.checkpoint_engine = weights_only_checkpoint_engine(self.engine._config)
        self.module = self.engine
        self.device = self.engine.device
        self.zero_stage = trainer.zero_stage
        self.grad_accum = plan.grad_accum
        self.world = world
        self.evaluates_on_every_rank = self.zero_stage == 3  # a ZeRO-3 forward all-gathers weights on every rank
        self.grad_norm = None
        self.watched_norms: dict[str, float] = {}

    def autocast(self):
        """The engine autocasts its own forward (``torch_autocast`` in its config)."""
        return contextlib.nullcontext()

    def full_parameters(self):
        """ZeRO-3 partitions every weight: gather them on all ranks (a collective) while rank 0 exports."""
        if self.zero_stage != 3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(self.model.parameters()), modifier_rank=None)

    def sync_context(self, last_micro_batch: bool):
        return contextlib.nullcontext()  # the engine knows the accumulation boundary itself

    def backward(self, loss: torch.Tensor) -> None:
        """As TorchStrategy's: ``loss`` / grad_accum (the engine's own scale would divide by its backward passes)."""
        self.engine.backward(loss / self.grad_accum, scale_wrt_gas=False)

    def micro_step(self) -> None:
        boundary = self.engine.is_gradient_accumulation_boundary()
        if boundary:  # before the step consumes them: the full (reduced) gradient, wherever ZeRO keeps it
            from deepspeed.utils import safe_get_full_grad

            grads = {k: safe_get_full_grad(p) for k, p in self.watched.items()}
            self.watched_norms = {k: float(torch.linalg.vector_norm(g.float())) for k, g in grads.items()
                                  if g is not None}
        if boundary and self.zero_stage == 0:  # no ZeRO optimizer to compute it: the grads are all-reduced here
            self.grad_norm = float(grad_norm([p for p in self.model.parameters() if p.grad is not None]))
        self.engine.step()  # steps optimizer and scheduler only at the accumulation boundary
        if boundary and self.zero_stage > 0:
            self.grad_norm = float(self.engine.get_global_grad_norm())

    def step(self) -> float:
        """The engine already stepped in micro_step at the boundary; the ZeRO optimizer's norm before clipping."""
        return self.grad_norm

    def lr(self) -> float:
        return self.engine.get_lr()[0]

    def save(self, folder: Path, rank: int, state: dict[str, Any]) -> bool:
        """Every rank writes its ZeRO partition; Ray Train merges the ranks' files into one checkpoint."""
        self.engine.save_checkpoint(str(folder / DEEPSPEED_DIR), tag=DEEPSPEED_TAG, client_state=state)
        return True

    def load(self, folder: Path) -> dict[str, Any]:
        check_zero_partitions(folder, self.zero_stage, self.world)
        _, client_state = self.engine.load_checkpoint(str(folder / DEEPSPEED_DIR), tag=DEEPSPEED_TAG)
        return dict(client_state or {})


def check_zero_partitions(folder: Path, zero_stage: int, world: int) -> None:
    """A ZeRO checkpoint holds one optimizer partition per worker: resuming it on another worker count is refused by
    name (a DDP checkpoint, or ZeRO-0's, resumes on any count)."""
    saved = len(list((Path(folder) / DEEPSPEED_DIR / DEEPSPEED_TAG).glob("*zero_pp_rank_*optim_states.pt")))
    if zero_stage > 0 and saved and saved != world:
        raise ValueError(f"this run's last checkpoint holds ZeRO-{zero_stage} optimizer partitions for {saved} workers "
                         f"and trainer.num_workers is {world}: resume it on {saved} workers (re-partitioning through "
                         f"DeepSpeed's universal checkpoints is not supported), or train with trainer.strategy=ddp, "
                         f"whose checkpoints resume on any worker count")


STRATEGIES = {"ddp": TorchStrategy, "deepspeed": DeepSpeedStrategy}
