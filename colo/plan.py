"""`python -m colo.plan`: per-GPU bytes of colocated GRPO, phase by phase, for colo and the usual layouts.

    python -m colo.plan --params 7e9 --gpus 8 --gpu-memory 80GiB [--dtype bf16] [--seq-len 4096] [--json]
    python -m colo.plan --params 32e9 --gpus 8 --tensor-parallel 8 [--train-tokens 1024]

For each layout: what each GPU holds while the engine generates and while the trainer trains
(weights, an engine copy, gradients, optimizer state, activations), what is left for the KV cache,
and how many sequences of --seq-len fit in it. Every figure is printed with its arithmetic.

Layouts (W = number of GPUs, P = parameters, d = bytes per weight in --dtype):
- colo: the trainer's parameters are the engine's weights (d P, one copy); gradients in fp32 (4 P)
  and the optimizer state (bf16: fp32 masters and two AdamW moments, 12 P; fp32: the moments, 8 P)
  sleep while the engine generates (the optimizer state offloaded to host memory); the KV cache
  sleeps while the trainer trains. This is what `colo.grpo` does on every rank by default.
- TRL colocate: a replicated fp32 trainer (weights, gradients, AdamW moments: 16 P) beside a separate
  engine copy in --dtype (d P), everything resident in both phases, and the KV cache too.
- verl (FSDP + engine copy): fp32 weights, gradients and moments sharded over the GPUs (16 P / W)
  beside a full engine copy (d P, tensor parallel 1), which vLLM's sleep mode (level 1) moves to host
  memory while training, with the KV cache freed.
- colo, overlapped (`colo.grpo --overlap on`): as colo, but groups train while the engine still
  decodes others, so the gradients (4 P) and one micro-batch's activations are awake beside the
  KV cache while generating, which leaves the KV cache that much less.
- colo-ZeRO-1 (`colo.grpo --shard-optimizer`): as colo, but each GPU keeps only its 1/W shard of the
  optimizer state (12 P / W in bf16); gradients stay whole (4 P) until reduce-scattered, and the
  updated weights are all-gathered into the engine's weights, so there is still one copy.

With --tensor-parallel T (T GPUs per engine, W / T data-parallel groups), P_T = (P - R - K) / T + R
+ K / min(T, KV heads) parameters per rank (R: the norm weights every rank holds whole; K: the k/v
projections, of which each rank holds whole KV heads):
- colo-TP, tensor parallelism with one copy (colo.tensor_parallel builds the model; colo.grpo does
  not run it yet, nor ZeRO-1 over its data-parallel ranks): each rank's trainer shard is a view of its engine shard (d P_T), fp32 gradients of the shard (4 P_T),
  the optimizer state of the shard split over the data-parallel ranks (ZeRO-1) and on the host while
  generating, activations of a Megatron-style tensor-parallel layer, logits split over the vocabulary.
- verl (FSDP + tensor-parallel engine copy): FSDP's shards (16 P / W) beside a T-way engine copy
  (d P_T), asleep on the host while training; FSDP keeps every layer's whole activations.

The same byte counts are what colo's pool measures on a CPU at small sizes (tests/bench/test_plan.py
compares them with the regions of a real colo.grpo run).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass

from .kv_sizing import kv_bytes

# Model shapes for the KV cache and activation estimates: the nearest by parameter count is used
# unless --config names a Hugging Face config.json. Public Qwen2.5 and Llama 3 configurations.
SHAPES = {
    "Qwen2.5-0.5B": dict(params=0.49e9, layers=24, heads=14, hidden=896, kv_heads=2, head_dim=64, vocab=151936),
    "Qwen2.5-1.5B": dict(params=1.54e9, layers=28, heads=12, hidden=1536, kv_heads=2, head_dim=128, vocab=151936),
    "Qwen2.5-3B": dict(params=3.09e9, layers=36, heads=16, hidden=2048, kv_heads=2, head_dim=128, vocab=151936),
    "Qwen2.5-7B": dict(params=7.62e9, layers=28, heads=28, hidden=3584, kv_heads=4, head_dim=128, vocab=152064),
    "Qwen2.5-14B": dict(params=14.7e9, layers=48, heads=40, hidden=5120, kv_heads=8, head_dim=128, vocab=152064),
    "Qwen2.5-32B": dict(params=32.8e9, layers=64, heads=40, hidden=5120, kv_heads=8, head_dim=128, vocab=152064),
    "Llama-3-70B": dict(params=70.6e9, layers=80, heads=64, hidden=8192, kv_heads=8, head_dim=128, vocab=128256),
}
DTYPE_BYTES = {"bf16": 2, "fp32": 4}
# Activations kept for backward per token and layer, in bytes: 34 x hidden for a transformer layer
# in 16-bit without recomputation (Korthikanti et al. 2022, "Reducing Activation Recomputation in
# Large Transformer Models", sec. 4.1; FlashAttention removes their 5 a s term). Logits: bf16, their
# fp32 upcast and the fp32 log-softmax, 10 bytes per token and vocabulary entry.
ACTIVATION_BYTES_PER_TOKEN_LAYER_HIDDEN = 34
LOGIT_BYTES_PER_TOKEN_VOCAB = 10
DEFAULT_RESERVE = 4 << 30  # CUDA context, NCCL buffers, allocator slack: kept free on every GPU


@dataclass
class Shape:
    name: str
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    vocab: int
    heads: int = 0  # attention heads (0: unknown, tensor parallelism not checked)

    def kv_bytes_per_token(self, dtype_bytes: int, tensor_parallel: int = 1) -> int:
        """K and V of one token on one GPU: vLLM gives each tensor-parallel rank kv_heads / tp heads,
        or one (replicated) when there are fewer KV heads than ranks."""
        return kv_bytes(self.layers, self.kv_heads, self.head_dim, dtype_bytes, tensor_parallel)

    @property
    def replicated_params(self) -> int:
        """Parameters every tensor-parallel rank holds whole: the RMSNorm weights (two per layer and
        the final one). Everything else is split over the ranks."""
        return (2 * self.layers + 1) * self.hidden

    @property
    def kv_projection_params(self) -> int:
        """The k_proj and v_proj weights: with fewer KV heads than tensor-parallel ranks, vLLM gives
        every rank a whole KV head, so they split kv_heads ways, not tp ways."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.hidden

    def params_per_rank(self, params: int, tensor_parallel: int) -> int:
        """P_T = (P - R - K) / T + R + K / min(T, kv_heads): R the replicated norms, K the k/v weights."""
        r, k = self.replicated_params, self.kv_projection_params
        return (params - r - k) // tensor_parallel + r + k // min(tensor_parallel, self.kv_heads)

    def check_tensor_parallel(self, tensor_parallel: int) -> None:
        """What vLLM requires of a tensor-parallel size (attention heads divisible; KV heads divisible
        or dividing it), as a ValueError."""
        if self.heads and self.heads % tensor_parallel:
            raise ValueError(f"{self.name}: {self.heads} attention heads do not split over tensor parallel "
                             f"{tensor_parallel}")
        if self.kv_heads % tensor_parallel and tensor_parallel % self.kv_heads:
            raise ValueError(f"{self.name}: {self.kv_heads} KV heads neither split over nor divide tensor "
                             f"parallel {tensor_parallel}")


@dataclass
class Term:
    """One line of a layout: bytes held per GPU and how they were computed."""
    what: str
    bytes: int
    arithmetic: str
    generate: bool   # held while the engine generates
    train: bool      # held while the trainer trains
    host: bool = False  # in host memory (offloaded), not on the GPU
    estimate: bool = False  # activations: an estimate, not a count of tensors


@dataclass
class Layout:
    name: str
    terms: list[Term]
    kv_during_train: bool  # the KV cache stays allocated while training
    gpu_memory: int
    reserve: int
    kv_bytes_per_sequence: int
    tensor_parallel: int = 1
    params_per_rank: int = 0  # P_T: the parameters one tensor-parallel rank holds (0 at tensor parallel 1)

    def phase_bytes(self, phase: str, activations: bool = True) -> int:
        """Bytes on each GPU during `phase` ("generate" or "train"), without the KV cache."""
        return sum(t.bytes for t in self.terms if getattr(t, phase) and not t.host and (activations or not t.estimate))

    @property
    def host_bytes(self) -> int:
        return sum(t.bytes for t in self.terms if t.host)

    @property
    def kv_cache_bytes(self) -> int:
        usable = self.gpu_memory - self.reserve
        held = max(self.phase_bytes("generate"), self.phase_bytes("train")) if self.kv_during_train \
            else self.phase_bytes("generate")
        return max(0, usable - held)

    @property
    def fits(self) -> bool:
        usable = self.gpu_memory - self.reserve
        return self.phase_bytes("generate") <= usable and self.phase_bytes("train") <= usable

    @property
    def sequences(self) -> int:
        return self.kv_cache_bytes // self.kv_bytes_per_sequence if self.fits else 0

    def summary(self) -> dict:
        return {"layout": self.name, "terms": [asdict(t) for t in self.terms],
                "generate_bytes": self.phase_bytes("generate"), "train_bytes": self.phase_bytes("train"),
                "host_bytes": self.host_bytes, "kv_cache_bytes": self.kv_cache_bytes,
                "kv_cache_during_train": self.kv_during_train, "fits": self.fits, "sequences": self.sequences,
                "tensor_parallel": self.tensor_parallel, "params_per_rank": self.params_per_rank or None}


def gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def parse_bytes(text: str) -> int:
    """'80GiB', '80GB', '81920MiB', '8.5e10' -> bytes."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in units:
        raise ValueError(f"cannot read {text!r} as a size (examples: 80GiB, 80GB, 81920MiB)")
    return int(float(m.group(1)) * units[m.group(2).lower()])


def nearest_shape(params: float) -> Shape:
    name = min(SHAPES, key=lambda n: abs(SHAPES[n]["params"] - params) / SHAPES[n]["params"])
    s = SHAPES[name]
    return Shape(f"{name}-like", s["layers"], s["hidden"], s["kv_heads"], s["head_dim"], s["vocab"], s["heads"])


def shape_from_config(path: str) -> Shape:
    with open(path) as f:
        c = json.load(f)
    c = c.get("text_config", c)
    heads = c["num_attention_heads"]
    return Shape(path, c["num_hidden_layers"], c["hidden_size"], c.get("num_key_value_heads") or heads,
                 c.get("head_dim") or c["hidden_size"] // heads, c["vocab_size"], heads)


def activation_bytes(shape: Shape, tokens: int, tensor_parallel: int = 1) -> tuple[int, str]:
    """Activations one GPU keeps for backward. With tensor parallelism (Megatron-style, no sequence
    parallelism) a layer keeps (10 + 24 / tp) x hidden bytes per token (Korthikanti et al., table 2;
    the layer norms' and dropouts' inputs stay whole) and the vocabulary-parallel logits 1/tp."""
    t = tensor_parallel
    per_layer = ACTIVATION_BYTES_PER_TOKEN_LAYER_HIDDEN if t == 1 else 10 + 24 / t
    layers = int(per_layer * tokens * shape.layers * shape.hidden)
    logits = LOGIT_BYTES_PER_TOKEN_VOCAB * tokens * shape.vocab // t
    if t == 1:
        return layers + logits, (f"{ACTIVATION_BYTES_PER_TOKEN_LAYER_HIDDEN} x {tokens} tokens x {shape.layers} layers x "
                                 f"{shape.hidden} hidden + {LOGIT_BYTES_PER_TOKEN_VOCAB} x {tokens} x {shape.vocab} vocab")
    return layers + logits, (f"(10 + 24 / {t}) x {tokens} tokens x {shape.layers} layers x {shape.hidden} hidden + "
                             f"{LOGIT_BYTES_PER_TOKEN_VOCAB} x {tokens} x {shape.vocab} vocab / {t}")


def plan(params: float, gpus: int, gpu_memory: int, dtype: str = "bf16", seq_len: int = 4096,
         train_tokens: int | None = None, shape: Shape | None = None, reserve: int = DEFAULT_RESERVE,
         tensor_parallel: int = 1, max_num_seqs: int | None = None) -> list[Layout]:
    """The layouts for one model size and cluster; see the module docstring. max_num_seqs: the engine's
    (default: vLLM's own for a GPU of this memory), which sizes Model Runner V2's sampler buffers; 0: an
    engine without them (vLLM's V1 runner, as on a CPU)."""
    shape = shape or nearest_shape(params)
    layouts = _plan(params, gpus, gpu_memory, dtype, seq_len, train_tokens, shape, reserve, tensor_parallel)
    sequences = default_max_num_seqs(gpu_memory) if max_num_seqs is None else max_num_seqs
    if sequences:
        sampler = engine_sampler_term(shape.vocab, sequences)
        for layout in layouts:  # every layout's engine is a vLLM engine, on every GPU
            layout.terms.append(sampler)
    return layouts


def default_max_num_seqs(gpu_memory: int) -> int:
    """vLLM 0.32's max_num_seqs for an LLM on a GPU of this memory (engine/arg_utils.py, get_batch_defaults)."""
    return 1024 if gpu_memory >= 70 * (1 << 30) else 256


def engine_sampler_term(vocab: int, max_num_seqs: int) -> Term:
    """vLLM Model Runner V2's sampler buffers (colo.vllm_compat.runner_memory), held from the engine's start:
    a GPU's default runner in vLLM 0.32."""
    from .vllm_compat.runner_memory import v2_sampler_bytes

    nbytes = v2_sampler_bytes(vocab, max_num_seqs)
    return Term(f"engine sampler buffers (vLLM Model Runner V2, {max_num_seqs} sequences)", nbytes,
                f"4 x {max_num_seqs} x vocab {vocab} + bit masks + per-sequence tables", generate=True, train=True)


def _plan(params: float, gpus: int, gpu_memory: int, dtype: str, seq_len: int, train_tokens: int | None,
          shape: Shape | None, reserve: int, tensor_parallel: int) -> list[Layout]:
    if params <= 0 or gpus < 1 or gpu_memory <= 0 or seq_len < 1 or tensor_parallel < 1:
        raise ValueError(f"params, gpus, gpu_memory, seq_len and tensor_parallel must be positive (got {params}, "
                         f"{gpus}, {gpu_memory}, {seq_len}, {tensor_parallel})")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, not {dtype!r}")
    shape = shape or nearest_shape(params)
    if tensor_parallel > 1:
        return tensor_parallel_plan(params, gpus, gpu_memory, dtype, seq_len, train_tokens, shape, reserve,
                                    tensor_parallel)
    d, p, w = DTYPE_BYTES[dtype], int(params), gpus
    act, act_math = activation_bytes(shape, train_tokens or seq_len)
    kv_seq = shape.kv_bytes_per_token(d) * seq_len
    common = dict(gpu_memory=gpu_memory, reserve=reserve, kv_bytes_per_sequence=kv_seq)
    activations = Term("activations (one micro-batch)", act, act_math, generate=False, train=True, estimate=True)

    optimizer_per_param, optimizer_what = (12, "fp32 masters 4 + AdamW moments 8") if d == 2 else (8, "AdamW moments 8")
    colo = Layout("colo", [
        Term(f"weights ({dtype}, shared with the engine)", d * p, f"{d} x P", generate=True, train=True),
        Term("gradients (fp32)", 4 * p, "4 x P", generate=False, train=True),
        Term(f"optimizer ({optimizer_what})", optimizer_per_param * p, f"{optimizer_per_param} x P",
             generate=False, train=True),
        Term("optimizer, offloaded while generating", optimizer_per_param * p, f"{optimizer_per_param} x P",
             generate=True, train=False, host=True),
        activations,
    ], kv_during_train=False, **common)
    trl = Layout("TRL colocate (replicated trainer + engine copy)", [
        Term("trainer weights (fp32)", 4 * p, "4 x P", generate=True, train=True),
        Term("gradients (fp32)", 4 * p, "4 x P", generate=True, train=True),
        Term("optimizer (AdamW moments 8)", 8 * p, "8 x P", generate=True, train=True),
        Term(f"engine copy ({dtype})", d * p, f"{d} x P", generate=True, train=True),
        activations,
    ], kv_during_train=True, **common)
    verl = verl_layout("verl (FSDP + engine copy)", p, w, d, dtype, d * p, f"{d} x P", activations, common)
    shard = optimizer_per_param * p // w
    zero = Layout("colo-ZeRO-1 (--shard-optimizer)", [
        Term(f"weights ({dtype}, shared with the engine)", d * p, f"{d} x P", generate=True, train=True),
        Term("gradients (fp32, reduce-scattered)", 4 * p, "4 x P", generate=False, train=True),
        Term(f"optimizer shard ({optimizer_what}, over {w})", shard, f"{optimizer_per_param} x P / {w}",
             generate=False, train=True),
        Term("optimizer shard, offloaded while generating", shard, f"{optimizer_per_param} x P / {w}",
             generate=True, train=False, host=True),
        activations,
    ], kv_during_train=False, **common)
    # --overlap on: groups train while the engine still decodes the others, so the gradients and one
    # micro-batch's activations are awake beside the KV cache; the KV cache gets what that leaves.
    overlapped = Layout("colo, overlapped (--overlap on)", [
        Term(f"weights ({dtype}, shared with the engine)", d * p, f"{d} x P", generate=True, train=True),
        Term("gradients (fp32, awake while generating)", 4 * p, "4 x P", generate=True, train=True),
        Term(f"optimizer ({optimizer_what})", optimizer_per_param * p, f"{optimizer_per_param} x P",
             generate=False, train=True),
        Term("optimizer, offloaded while generating", optimizer_per_param * p, f"{optimizer_per_param} x P",
             generate=True, train=False, host=True),
        Term(activations.what + ", also while generating", act, act_math, generate=True, train=True, estimate=True),
    ], kv_during_train=False, **common)
    return [colo, trl, verl, zero, overlapped]


def verl_layout(name: str, p: int, w: int, d: int, dtype: str, engine: int, engine_math: str,
                activations: Term, common: dict) -> Layout:
    """FSDP's fp32 trainer sharded over every GPU, beside the engine's own copy of the weights, which
    vLLM's sleep mode (level 1) moves to host memory while the trainer trains, with the KV cache freed."""
    return Layout(name, [
        Term(f"trainer weights, gradients, moments (fp32, sharded over {w})", 16 * p // w, f"16 x P / {w}",
             generate=True, train=True),
        Term(f"engine copy ({dtype})", engine, engine_math, generate=True, train=False),
        Term("engine copy, offloaded while training (vLLM sleep level 1)", engine, engine_math,
             generate=False, train=True, host=True),
        activations,
    ], kv_during_train=False, **common)


def tensor_parallel_plan(params: float, gpus: int, gpu_memory: int, dtype: str, seq_len: int,
                         train_tokens: int | None, shape: Shape, reserve: int, tp: int) -> list[Layout]:
    """colo with tensor parallelism (colo.tensor_parallel: each rank's trainer shard is a view of its vLLM
    shard, ZeRO-1 over the data-parallel ranks) beside verl's FSDP with a tensor-parallel engine copy.
    P_T = the parameters on one rank (Shape.params_per_rank)."""
    if gpus % tp:
        raise ValueError(f"{gpus} GPUs do not split into tensor-parallel groups of {tp}")
    shape.check_tensor_parallel(tp)
    d, p, w, dp = DTYPE_BYTES[dtype], int(params), gpus, gpus // tp
    shard = shape.params_per_rank(p, tp)
    tokens = train_tokens or seq_len
    common = dict(gpu_memory=gpu_memory, reserve=reserve, kv_bytes_per_sequence=shape.kv_bytes_per_token(d, tp) * seq_len,
                  tensor_parallel=tp, params_per_rank=shard)
    optimizer_per_param, optimizer_what = (12, "fp32 masters 4 + AdamW moments 8") if d == 2 else (8, "AdamW moments 8")
    optimizer = optimizer_per_param * shard // dp
    optimizer_math = f"{optimizer_per_param} x P_T / {dp}"
    act, act_math = activation_bytes(shape, tokens, tp)
    colo = Layout(f"colo-TP (tensor parallel {tp} x ZeRO-1 over {dp}: colo.grpo --tensor-parallel {tp} --shard-optimizer)", [
        Term(f"weights ({dtype}, this rank's shard, shared with the engine's)", d * shard, f"{d} x P_T",
             generate=True, train=True),
        Term("gradients (fp32, this rank's shard)", 4 * shard, "4 x P_T", generate=False, train=True),
        Term(f"optimizer ({optimizer_what}, shard over {dp})", optimizer, optimizer_math, generate=False, train=True),
        Term("optimizer, offloaded while generating", optimizer, optimizer_math, generate=True, train=False, host=True),
        Term("activations (one micro-batch, tensor parallel)", act, act_math, generate=False, train=True, estimate=True),
    ], kv_during_train=False, **common)
    full_act, full_act_math = activation_bytes(shape, tokens)
    verl = verl_layout(f"verl (FSDP + tensor-parallel {tp} engine copy)", p, w, d, dtype, d * shard, f"{d} x P_T",
                       Term("activations (one micro-batch)", full_act, full_act_math, generate=False, train=True,
                            estimate=True), common)
    return [colo, verl]


def render(layouts: list[Layout], params: float, gpus: int, seq_len: int, shape: Shape) -> str:
    first = layouts[0]
    lines = [f"{params:.3g} parameters (P) on {gpus} GPU(s) of {gib(first.gpu_memory)}, "
             f"{gib(first.reserve)} kept free per GPU; shape {shape.name} ({shape.layers} layers, hidden "
             f"{shape.hidden}, {shape.kv_heads} KV heads x {shape.head_dim}); KV cache "
             f"{gib(first.kv_bytes_per_sequence)} per sequence of {seq_len} tokens"
             + (f" per GPU; tensor parallel {first.tensor_parallel}: P_T = (P - R - K) / {first.tensor_parallel} + R + "
                f"K / {min(first.tensor_parallel, shape.kv_heads)} = {first.params_per_rank:.4g} parameters per rank "
                "(R: the replicated norm weights, K: the k/v projections, split over the KV heads)"
                if first.tensor_parallel > 1 else ""), ""]
    for layout in layouts:
        lines.append(f"== {layout.name}")
        for t in layout.terms:
            phases = ", ".join(p for p in ("generate", "train") if getattr(t, p))
            phases = f"host, while {phases.replace('generate', 'generating').replace('train', 'training')}" \
                if t.host else phases
            lines.append(f"  {t.what:<58} {gib(t.bytes):>10}  = {t.arithmetic}  [{phases}]")
        lines.append(f"  {'per GPU while generating (without KV cache)':<58} {gib(layout.phase_bytes('generate')):>10}")
        lines.append(f"  {'per GPU while training':<58} {gib(layout.phase_bytes('train')):>10}"
                     + ("  (+ the KV cache, which stays)" if layout.kv_during_train else ""))
        if layout.fits:
            lines.append(f"  {'left for the KV cache':<58} {gib(layout.kv_cache_bytes):>10}  -> "
                         f"{layout.sequences} sequences of {seq_len} tokens")
        else:
            lines.append("  does not fit: a phase needs more than the GPU's memory minus the reserve")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m colo.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=_sizes, required=True, help="number of parameters, e.g. 7e9 (or a list: 0.5e9,7e9)")
    p.add_argument("--gpus", type=int, default=1, help="GPUs in the job (ranks)")
    p.add_argument("--gpu-memory", default="80GiB", help="memory per GPU, e.g. 80GiB")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16", help="the dtype the engine serves")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (prompt + completion)")
    p.add_argument("--train-tokens", type=int, default=None, help="tokens per training micro-batch (default: --seq-len)")
    p.add_argument("--reserve", default="4GiB", help="memory kept free per GPU (context, NCCL, slack)")
    p.add_argument("--config", default=None, help="a Hugging Face config.json for the model's shape (a vision-language "
                   "model's: its text_config)")
    p.add_argument("--image-tokens", type=int, default=0, metavar="T",
                   help="vision-language models: image placeholder tokens per prompt (all its images; e.g. 256 per "
                        "448x448 InternVL tile), counted as prompt tokens in --seq-len's sequences")
    p.add_argument("--tensor-parallel", type=int, default=1,
                   help="GPUs per tensor-parallel group: colo-TP (colo.grpo --tensor-parallel) beside verl with a tensor-parallel engine")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="the engine's max_num_seqs, which sizes vLLM's sampler buffers (default: vLLM's for the GPU)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = p.parse_args(argv)
    if args.image_tokens < 0:
        p.error("--image-tokens must be >= 0")
    # An image's placeholders are prompt tokens to the engine (KV cache) and to the trainer (activations).
    args.seq_len += args.image_tokens
    if args.train_tokens is not None:
        args.train_tokens += args.image_tokens
    plans = []
    try:
        for params in args.params:
            shape = shape_from_config(args.config) if args.config else nearest_shape(params)
            plans.append((params, shape, plan(params, args.gpus, parse_bytes(args.gpu_memory), args.dtype, args.seq_len,
                                              args.train_tokens, shape, parse_bytes(args.reserve),
                                              args.tensor_parallel, args.max_num_seqs)))
    except (ValueError, OSError, KeyError) as e:
        p.error(str(e))
    if args.json:
        results = [{"params": params, "gpus": args.gpus, "gpu_memory": parse_bytes(args.gpu_memory),
                    "dtype": args.dtype, "seq_len": args.seq_len, "tensor_parallel": args.tensor_parallel,
                    "shape": asdict(shape),
                    "layouts": [layout.summary() for layout in layouts]} for params, shape, layouts in plans]
        print(json.dumps(results[0] if len(results) == 1 else results, indent=1))
    else:
        print("\n".join(render(layouts, params, args.gpus, args.seq_len, shape) for params, shape, layouts in plans))
    return 0


def _sizes(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers such as 7e9 or 0.5e9,7e9, got {text!r}") from None


if __name__ == "__main__":
    sys.exit(main())
