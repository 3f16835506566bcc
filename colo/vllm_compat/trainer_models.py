"""Trainer models of the families vLLM serves through its Transformers modeling backend.

For a family vLLM has no model of its own for (OLMo-2, SmolLM3, ...: `TransformersForCausalLM` in its
registry), vLLM builds transformers' own model and, to compile it, decorates transformers' decoder class
with `support_torch_compile` (vllm/model_executor/models/transformers/base.py): the class itself, for the
whole process. From then on, building that class asks for a current vLLM config, and calling an
instance goes through vLLM's compile wrapper, which reads `do_not_compile` from the instance. A
trainer's model of the same family is built (colo.shared_model) or was built before the engine (TRL's
model, colo.share_weights) from that class, and must run as plain transformers code:

- `building_trainer_models()`: build them under a copy of the engine's config whose compilation is
  off (colo's worker remembers the last engine's), so the decorator's __init__ marks them
  `do_not_compile`;
- `run_as_plain_modules(model)`: an instance built before the class was decorated is marked the same
  way (it has no `do_not_compile` of its own).
"""
from __future__ import annotations

import contextlib
import copy


_plain_config = None   # the last engine's vLLM config, compilation off (remember_engine_config)


def _is_decorated(cls) -> bool:
    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper

    return TorchCompileWithNoGuardsWrapper in cls.__bases__


def remember_engine_config(vllm_config) -> None:
    """Called as each engine starts (colo's worker): trainer models are built under a copy of its config
    with compilation off, also after the engine is gone (the class stays decorated)."""
    from vllm.config import CompilationMode

    global _plain_config
    plain = copy.copy(vllm_config)
    plain.compilation_config = copy.copy(vllm_config.compilation_config)
    plain.compilation_config.mode = CompilationMode.NONE
    _plain_config = plain


@contextlib.contextmanager
def building_trainer_models():
    """Inside, transformers models of a class vLLM decorated build without compilation (nothing to do
    before colo's first engine in this process)."""
    if _plain_config is None:
        yield
        return
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(_plain_config):
        yield


def run_as_plain_modules(model) -> int:
    """Mark `model`'s submodules of a class vLLM decorated (built before it was) to run uncompiled;
    returns how many were marked."""
    if _plain_config is None:
        return 0
    marked = 0
    for module in model.modules():
        if _is_decorated(type(module)) and "do_not_compile" not in vars(module):
            module.do_not_compile = True
            marked += 1
    return marked
