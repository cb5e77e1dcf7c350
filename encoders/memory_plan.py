"""Plan per-GPU micro-batch and gradient accumulation for a backbone, quantisation, LoRA rank, sequence length and
GPU memory, so a recipe's numbers are computed rather than guessed.

  python -m encoders.memory_plan --model qwen2.5-7b --quantization nf4 --lora-r 16 --seq-len 64 \
      --gpu-gb 80 --gpus 4 --global-batch 512 --gradient-checkpointing

The estimate: frozen base weights at the quantised width (NF4 with double quantisation = 4.127 bits/param; the
unquantised token embeddings in fp32, as PEFT's k-bit preparation casts them; an encoder loads no LM head), LoRA
weights, gradients and AdamW states in fp32 (ZeRO-2 shards gradients and optimizer states over the GPUs),
activations per sequence from Korthikanti et al. 2022 (bf16: s*h*(34 + 5*a*s/h) bytes per layer; with
gradient checkpointing, one layer's worth plus 2*s*h bytes per layer), two sequences per pair (both sides), plus
a fixed CUDA context and a 10% fragmentation margin. It is a planning estimate; measure before a long run.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Arch:
    params: float  # total parameters
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    gated_mlp: bool = True  # gate/up/down (LLaMA/Qwen) vs up/down (BERT)
    tied_embeddings: bool = True  # False: ``params`` also counts an LM head, which an encoder does not load


ARCHS = {
    "qwen2.5-7b": Arch(7.62e9, 3584, 28, 28, 4, 18944, 152064, tied_embeddings=False),
    "smollm2-135m": Arch(1.35e8, 576, 30, 9, 3, 1536, 49152),
    "bert-base": Arch(1.10e8, 768, 12, 12, 12, 3072, 30522, gated_mlp=False),
    "modernbert-base": Arch(1.49e8, 768, 22, 12, 12, 1152, 50368),
    "minilm-l6": Arch(2.27e7, 384, 6, 12, 12, 1536, 30522, gated_mlp=False),
}
BITS = {"nf4": 4.127, "int8": 8.0, "none": 16.0}  # frozen-base storage; "none" = bf16 weights
CUDA_CONTEXT_GB = 1.5


def lora_params(arch: Arch, r: int) -> int:
    """Trainable LoRA parameters with adapters on every linear layer of every block ('all-linear')."""
    head_dim = arch.hidden // arch.heads
    kv = arch.kv_heads * head_dim
    shapes = [(arch.hidden, arch.hidden), (arch.hidden, kv), (arch.hidden, kv), (arch.hidden, arch.hidden)]
    shapes += ([(arch.hidden, arch.intermediate)] * (2 if arch.gated_mlp else 1)) + [(arch.intermediate, arch.hidden)]
    return arch.layers * r * sum(i + o for i, o in shapes)


def encoder_params(arch: Arch) -> float:
    """Parameters an encoder loads (AutoModel: an untied LM head stays behind)."""
    return arch.params - (0 if arch.tied_embeddings else arch.vocab * arch.hidden)


def base_weights_bytes(arch: Arch, quantization: str) -> float:
    """The frozen base as raoe loads it. bitsandbytes quantises the linear layers only, and PEFT's
    prepare_model_for_kbit_training then casts every parameter it did not quantise (token embeddings, norms) to
    fp32; without quantisation the base is bf16."""
    if quantization == "none":
        return encoder_params(arch) * 2
    embedding = arch.vocab * arch.hidden
    return (encoder_params(arch) - embedding) * BITS[quantization] / 8 + embedding * 4


def activation_bytes_per_sequence(arch: Arch, seq_len: int, checkpointing: bool) -> float:
    per_layer = seq_len * arch.hidden * (34 + 5 * arch.heads * seq_len / arch.hidden)
    if checkpointing:
        return arch.layers * 2 * seq_len * arch.hidden + per_layer
    return arch.layers * per_layer


@dataclass
class Plan:
    model: str
    quantization: str
    lora_r: int | None
    seq_len: int
    gpu_gb: float
    gpus: int
    global_batch: int
    gradient_checkpointing: bool
    base_weights_gb: float
    trainable_params: int
    trainable_states_gb: float
    activations_gb_per_pair: float
    micro_batch_per_gpu: int
    grad_accum: int
    pairs_per_optimizer_step: int
    fits: bool

    def as_dict(self) -> dict:
        return asdict(self)


def plan(model: str, *, quantization: str = "nf4", lora_r: int | None = 16, seq_len: int = 64, gpu_gb: float = 80.0,
         gpus: int = 1, global_batch: int = 512, gradient_checkpointing: bool = True, zero_stage: int = 2) -> Plan:
    arch = ARCHS[model]
    base_gb = base_weights_bytes(arch, quantization) / 1e9
    trainable = lora_params(arch, lora_r) if lora_r else int(encoder_params(arch))
    # fp32 master weights + grads + AdamW m and v = 16 bytes per trainable parameter; ZeRO-2 shards grads + states.
    shard = gpus if zero_stage >= 2 else 1
    states_gb = trainable * (4 + 12 / shard) / 1e9 if zero_stage >= 1 else trainable * 16 / 1e9
    if not lora_r:
        base_gb = 0.0  # full fine-tuning: the weights are the trainable states
    per_pair_gb = 2 * activation_bytes_per_sequence(arch, seq_len, gradient_checkpointing) / 1e9
    free_gb = gpu_gb * 0.9 - CUDA_CONTEXT_GB - base_gb - states_gb
    micro = 0 if free_gb <= 0 else int(free_gb // per_pair_gb)
    micro = min(micro, global_batch // gpus)
    if micro > 0:
        micro = 2 ** int(math.log2(micro))  # powers of two divide the global batch
    accum = math.ceil(global_batch / (micro * gpus)) if micro else 0
    return Plan(model, quantization, lora_r, seq_len, gpu_gb, gpus, global_batch, gradient_checkpointing,
                round(base_gb, 2), trainable, round(states_gb, 2), round(per_pair_gb, 4), micro, accum,
                micro * gpus * accum, micro > 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(ARCHS), required=True)
    parser.add_argument("--quantization", choices=sorted(BITS), default="nf4")
    parser.add_argument("--lora-r", type=int, default=16, help="0 = full fine-tuning")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--gpu-gb", type=float, default=80.0)
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--global-batch", type=int, default=512)
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    a = parser.parse_args()
    p = plan(a.model, quantization=a.quantization, lora_r=a.lora_r or None, seq_len=a.seq_len, gpu_gb=a.gpu_gb,
             gpus=a.gpus, global_batch=a.global_batch, gradient_checkpointing=a.gradient_checkpointing,
             zero_stage=a.zero_stage)
    print(f"{a.model} {a.quantization} LoRA r={a.lora_r}: base {p.base_weights_gb} GB, {p.trainable_params:,} trainable "
          f"({p.trainable_states_gb} GB states/GPU), {p.activations_gb_per_pair * 1000:.1f} MB activations per pair")
    if p.fits:
        print(f"-> trainer.global_batch_size={a.global_batch} on {a.gpus} GPU(s): micro-batch {p.micro_batch_per_gpu} "
              f"pairs/GPU x grad_accum {p.grad_accum}")
    else:
        print("-> does not fit: lower the sequence length, quantise, or add GPUs")
    print(json.dumps(p.as_dict()))


if __name__ == "__main__":
    main()
