"""`python -m colo.grpo`: a colocated GRPO run from the command line.

    python -m colo.grpo --steps 40 --json log.jsonl --out ckpt/ [--resume] [--model PATH] [--trace trace.json]

Without --model it trains a small random Qwen2 model (written to OUT/toy-model) on the toy task of
colo.grpo.toy_task: reward = share of completion tokens that obey a token rule. With --model it trains
that Hugging Face model on the same verifiable task. The run's settings are saved in OUT/run.json;
--resume continues from the newest checkpoint in OUT with those settings.
Exit status: 0 done, 2 bad arguments or unreadable checkpoint, 1 the run failed, 143 stopped by
SIGTERM after a checkpointed step (continue with --resume).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..checks import int_kind
from .checkpoint import CheckpointError, latest_checkpoint, list_checkpoints, load_checkpoint
from .config import DTYPES, GRPOConfig

OFFLOAD_CHOICES = {"auto": None, "on": True, "off": False}
TOY_DEFAULTS = dict(prompts_per_step=8, num_generations=8, max_new_tokens=16, ignore_eos=True,
                    learning_rate=3e-3, temperature=1.0)


def _int_at_least(minimum: int):
    """An argparse type: an integer no smaller than `minimum`."""
    kind = int_kind(minimum)

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m colo.grpo", description=__doc__.split("\n", 1)[1].strip(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=_positive_int, required=True, help="total steps of the run (a resumed run counts those done)")
    p.add_argument("--json", dest="log", required=True, metavar="LOG", help="JSON-lines file, one record per step")
    p.add_argument("--out", required=True, metavar="CKPT_DIR", help="directory for checkpoints and run.json")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    p.add_argument("--model", metavar="PATH", help="Hugging Face causal LM directory (default: a small random Qwen2)")
    p.add_argument("--trace", metavar="FILE", help="Chrome-trace/Perfetto timeline of the phases")
    p.add_argument("--save-every", type=_non_negative_int, default=10, metavar="N", help="checkpoint period (0: only at the end)")
    p.add_argument("--keep-checkpoints", type=_non_negative_int, default=2, metavar="K", help="newest checkpoints kept (0: all)")
    p.add_argument("--prompts-per-step", type=_positive_int, default=TOY_DEFAULTS["prompts_per_step"], metavar="P",
                   help="prompts per step over all ranks (default %(default)s)")
    p.add_argument("--num-generations", type=_positive_int, default=TOY_DEFAULTS["num_generations"], metavar="G",
                   help="completions per prompt, the GRPO group (default %(default)s)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=TOY_DEFAULTS["max_new_tokens"], metavar="T",
                   help="completion length (default %(default)s)")
    p.add_argument("--lr", type=float, default=TOY_DEFAULTS["learning_rate"], help="AdamW learning rate (default %(default)s)")
    p.add_argument("--offload-optimizer", choices=sorted(OFFLOAD_CHOICES), default="auto",
                   help="optimizer state to host memory while generating (auto: only where the pool cannot hold "
                        "it beside the engine's weights and KV cache)")
    p.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                   help="weights the engine serves and the trainer shares: bf16 (fp32 master weights and AdamW "
                        "moments with the optimizer) or fp32; auto (default): the one that makes a whole step "
                        "fastest here (bf16 where the device computes in bf16 natively: GPUs since Ampere, CPUs "
                        "with AVX512_BF16 or AMX; fp32 elsewhere)")
    p.add_argument("--shard-optimizer", action="store_true",
                   help="ZeRO-1: each rank keeps 1/world of the fp32 master weights and AdamW moments; the "
                        "updated weights are all-gathered straight into every rank's engine weights")
    p.add_argument("--lora-rank", type=_non_negative_int, default=0, metavar="R",
                   help="train a LoRA adapter of rank R on the frozen base instead of every weight (0, the "
                        "default: full fine-tuning); the adapter is the engine's LoRA slot, so nothing is copied "
                        "per step, and OUT/adapter holds it in PEFT's format")
    p.add_argument("--lora-alpha", type=float, default=8.0, metavar="A", help="LoRA alpha (scaling A/R; default %(default)s, as PEFT)")
    p.add_argument("--lora-targets", nargs="+", metavar="NAME", default=list(GRPOConfig.lora_targets),
                   help="linear layers the adapter adapts (default: all of them)")
    p.add_argument("--tensor-parallel", type=_positive_int, default=None, metavar="N",
                   help="ranks per engine (under torchrun; each holds only its shards of the weights, views of its "
                        "engine's; default 1, or the resumed run's)")
    p.add_argument("--seed", type=_non_negative_int, default=0, help="seeds the toy model, prompts and sampling")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _settings(args, parser) -> tuple[Path, GRPOConfig]:
    """Model directory and config: from the flags for a new run, from OUT/run.json when resuming."""
    out = Path(args.out)
    run_file = out / "run.json"
    if args.resume:
        if not run_file.is_file():
            parser.error(f"--resume: {run_file} not found; is {out} the --out of an earlier run?")
        try:
            saved = json.loads(run_file.read_text())
            config = GRPOConfig.from_dict(saved["config"])
            model_dir = Path(args.model) if args.model else Path(saved["model_dir"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            parser.error(f"--resume: cannot read {run_file}: {e}")
        newest = latest_checkpoint(out)
        if newest is None:
            parser.error(f"--resume: no checkpoint (step-*.pt) in {out}")
        try:
            load_checkpoint(newest)  # fail here, with a clear message, before any engine starts
        except CheckpointError as e:
            parser.error(f"--resume: {e}")
        if args.tensor_parallel not in (None, config.tensor_parallel):
            parser.error(f"--resume: the run in {out} was trained with --tensor-parallel {config.tensor_parallel}; "
                         f"colo does not re-slice its optimizer state for --tensor-parallel {args.tensor_parallel}: "
                         f"resume with --tensor-parallel {config.tensor_parallel}")
        return model_dir, config
    if list_checkpoints(out):
        parser.error(f"{out} already holds checkpoints of a run; pass --resume to continue it or choose another --out")
    try:
        config = GRPOConfig(**{**TOY_DEFAULTS, "prompts_per_step": args.prompts_per_step,
                               "num_generations": args.num_generations, "max_new_tokens": args.max_new_tokens,
                               "learning_rate": args.lr, "seed": args.seed, "save_every": args.save_every,
                               "keep_checkpoints": args.keep_checkpoints,
                               "offload_optimizer": OFFLOAD_CHOICES[args.offload_optimizer],
                               "shard_optimizer": args.shard_optimizer, "lora_rank": args.lora_rank,
                               "lora_alpha": args.lora_alpha, "lora_targets": tuple(args.lora_targets),
                               "tensor_parallel": args.tensor_parallel or 1,
                               "dtype": None if args.dtype == "auto" else args.dtype})
    except (ValueError, NotImplementedError) as e:
        parser.error(str(e))
    if args.model:
        model_dir = Path(args.model)
        if not model_dir.is_dir():
            parser.error(f"--model: {model_dir} is not a directory")
        if not (model_dir / "config.json").is_file():
            parser.error(f"--model: {model_dir} is not a Hugging Face model directory (no config.json)")
        _check_model_architecture(model_dir, parser)
    else:
        model_dir = out / "toy-model"
    return model_dir, config


def _check_model_architecture(model_dir: Path, parser) -> None:
    """Refuse a model colo cannot share with the engine now, rather than after the engine has started."""
    from ..weights import check_architecture

    try:
        architectures = json.loads((model_dir / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError) as e:
        parser.error(f"--model: cannot read {model_dir / 'config.json'}: {e}")
    for arch in architectures:
        try:
            check_architecture(arch)
        except NotImplementedError as e:
            parser.error(f"--model: {model_dir}: {e}")


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    model_dir, config = _settings(args, parser)

    from ..engine import quiet_vllm_logs
    from . import distributed as D

    quiet_vllm_logs()  # the progress bar and the summary, not a vLLM INFO line per step
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    world = D.init_world("cuda" if _cuda() else "cpu")  # the scheduler makes the tensor-parallel groups
    out = Path(args.out)
    if world.is_main:
        out.mkdir(parents=True, exist_ok=True)
        if not args.model and not args.resume:
            from .toy_task import build_toy_model

            build_toy_model(model_dir, seed=config.seed)
    D.barrier(world)
    if config.dtype:
        why = "as in run.json" if args.resume else "as asked"
    else:
        from ..dtype_choice import fastest_dtype

        why = f"auto: {fastest_dtype(world.device).reason}; --dtype to choose"
    config = config.resolve_dtype(world.device)
    if world.is_main:
        print(f"colo.grpo: weights in {config.dtype} ({why})", flush=True)
        if config.tensor_parallel > 1:
            print(f"colo.grpo: tensor parallel {config.tensor_parallel} x data parallel "
                  f"{world.size // config.tensor_parallel}: each rank trains its shards of the weights, views of "
                  "its engine's", flush=True)
        if config.lora_rank:
            print(f"colo.grpo: LoRA rank {config.lora_rank}, alpha {config.lora_alpha:g} on "
                  f"{', '.join(config.lora_targets)}; the base is frozen; adapter in PEFT's format in {out / 'adapter'}",
                  flush=True)
        if not args.resume:
            (out / "run.json").write_text(json.dumps({"model_dir": str(model_dir), "config": config.to_dict(),
                                                      "dtype_chosen_because": why}, indent=2))

    from .scheduler import GRPOScheduler
    from .toy_task import ToyTask

    vocab = json.loads((model_dir / "config.json").read_text()).get("vocab_size")
    task = ToyTask(vocab, seed=config.seed)
    scheduler = GRPOScheduler(model_dir, task.rewards, task.prompts, config, out_dir=out, log_path=args.log,
                              trace_path=args.trace, resume=args.resume)
    records = []
    try:
        if scheduler.step >= args.steps:
            if world.is_main:
                print(f"colo.grpo: the run in {out} has already done {scheduler.step} steps (--steps {args.steps})")
        else:
            records = scheduler.run(args.steps, progress=not args.no_progress)
    finally:
        scheduler.close()
    D.leave_world()  # every rank got here: nothing is left to say to the others
    if world.is_main and records:
        first, last = records[0], records[-1]
        print(f"colo.grpo: steps {first['step']}-{last['step']} done; reward {first['reward_mean']:.3f} -> "
              f"{last['reward_mean']:.3f}; checkpoints in {out}")
    return 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def run_cli(argv=None) -> int:
    """main() with failures turned into a one-line message and exit status 1 (2 for bad checkpoints)."""
    from .rollout_engine import EngineFailure
    from .scheduler import Terminated

    try:
        return main(argv)
    except CheckpointError as e:
        print(f"colo.grpo: error: {e}", file=sys.stderr)
        return 2
    except (EngineFailure, FileNotFoundError, ValueError, MemoryError, NotImplementedError) as e:
        print(f"colo.grpo: error: {e}", file=sys.stderr)
        return 1
    except Terminated as e:
        print(f"colo.grpo: {e}; continue with --resume", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("colo.grpo: interrupted; the last finished step is checkpointed, continue with --resume",
              file=sys.stderr)
        return 130
