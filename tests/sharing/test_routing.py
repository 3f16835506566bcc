"""Routing replay: the experts a MoE engine routed each token to (colo.vllm_compat.routing, captured in
colo's worker on a CPU), and the trainer made to route the same way (colo.moe_routing)."""
from __future__ import annotations

import pytest
import torch

import colo
from colo.bench.models import MOE_ARCHITECTURES, random_model
from colo.moe_routing import RouterOutput, RouterReplay, router_modules
from conftest import TINY_CONFIG


def experts_used(model):
    """Per MoE layer, the (expert indices, gate weights) its experts module was called with last."""
    seen = {}
    for name, module in model.named_modules():
        if name.endswith("mlp.experts"):
            module.register_forward_hook(lambda m, args, out, name=name: seen.__setitem__(name, (args[1], args[2])))
    return seen


@pytest.mark.slow
def test_the_engine_returns_each_tokens_experts_and_the_trainer_replays_them(tiny_model_dir, build_engine):
    from vllm import SamplingParams

    from colo.engine import release_llm
    from colo.vllm_compat import recording_routes, routed_experts

    llm = build_engine(tiny_model_dir("qwen3_moe", vocab_size=1000), enable_prefix_caching=False)
    try:
        model = colo.shared_model(llm).hf_model
        prompt = list(range(5, 25))
        with recording_routes(llm):
            (request,) = llm.enqueue([{"prompt_token_ids": prompt}],
                                     [SamplingParams(max_tokens=12, n=2, temperature=1.0, seed=1)], use_tqdm=False)
            finished = []
            while llm.llm_engine.get_num_unfinished_requests():
                finished += [out for out in llm.llm_engine.step() if out.finished]
            (output,) = finished
            routes = routed_experts(llm, output, request)
        completions = sorted(output.outputs, key=lambda c: c.index)
        replay = RouterReplay.attach(model)
        for completion, route in zip(completions, routes):
            # Every position the engine ran: the prompt and the completion but its last token; 2 MoE layers, top 2.
            assert route.shape == (len(prompt) + len(completion.token_ids) - 1, 2, 2) and (route >= 0).all()
            ids = torch.tensor([prompt + list(completion.token_ids)])
            padded = torch.full((1, ids.shape[1], 2, 2), -1, dtype=torch.int16)
            padded[0, :route.shape[0]] = route
            with replay.measuring(padded):
                model(input_ids=ids)
            # fp32: the trainer's router picks the engine's experts for every token of every layer.
            assert replay.stats() == {"router_mismatch": 0.0, "router_compared": route.shape[0] * 2}
    finally:
        release_llm(llm)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_forcing_routes_through_the_given_experts_with_the_routers_own_gates(arch):
    """Other experts than the router's own: the experts module gets exactly those, with the gate weights
    the router's rule gives them (Qwen3-MoE: softmax then top-k; Mixtral: renormalized over the top-k;
    GPT-OSS, whose router is `mlp.router`: top-k, then softmax), and the router still gets a gradient
    through them."""
    model = random_model({**TINY_CONFIG, "vocab_size": 100}, arch=arch)
    replay = RouterReplay.attach(model)
    used = experts_used(model)
    ids = torch.arange(3, 19).reshape(2, 8)
    with torch.no_grad():
        model(input_ids=ids)
    own = {name: indices.clone() for name, (indices, _) in used.items()}
    forced = torch.stack([(indices + 1) % 4 for _, indices in sorted(own.items())], dim=1).view(2, 8, 2, 2)
    forced[1, :3] = -1    # the trainer's own choice there
    with replay.forcing(forced.to(torch.int16)):
        model(input_ids=ids, labels=ids).loss.backward()
    for column, (name, (indices, weights)) in enumerate(sorted(used.items())):
        expected = forced[:, :, column].reshape(-1, 2)
        free = expected[:, 0] < 0
        torch.testing.assert_close(indices[~free], expected[~free].long())
        torch.testing.assert_close(indices[free], own[name][free])
        sums = weights.sum(-1)
        if arch in ("mixtral", "gpt_oss"):  # renormalized over the chosen experts
            torch.testing.assert_close(sums, torch.ones_like(sums))
        else:
            assert (sums < 1).all()
    routers = [getattr(layer.mlp, "gate", None) or layer.mlp.router for layer in model.model.layers]
    assert all(router.weight.grad.abs().sum() > 0 for router in routers)
    # Every forced token differs from its router's choice in the first MoE layer; a later layer's router sees
    # the forced layers' outputs, and may by chance choose the experts forced on it.
    assert replay.stats()["router_mismatch"] > 0.9


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_every_moe_familys_router_replays_its_own_choice_exactly_and_takes_others(arch):
    """Each MoE family's router, whatever its rule (softmax or sigmoid, over every expert or the chosen,
    renormalized, scaled: DeepSeek-V3's routed_scaling_factor, Gemma 4's per_expert_scale) and output form
    (GraniteMoE's indices first, Llama 4's scores over every expert): forced to the experts it chooses
    itself, the model computes exactly what it computes unforced, so the rule read off its output is its
    own; forced to others, it routes through them and its router still learns."""
    fields = {"num_key_value_heads": 2} if arch == "deepseek_v3" else {}  # (MLA: as many KV heads as heads)
    model = random_model({**TINY_CONFIG, "vocab_size": 100, **fields}, arch=arch)
    with torch.no_grad():   # scales away from 1, where a rule without them would match too
        for name, param in model.named_parameters():
            if name.endswith("per_expert_scale"):
                param.uniform_(0.5, 2.0)
    routers = [module for _, module in router_modules(model)]
    seen = {}
    for column, router in enumerate(routers):
        router.register_forward_hook(lambda m, args, out, column=column: seen.__setitem__(column, out))
    ids = torch.arange(3, 19).reshape(2, 8)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    reads = [RouterOutput.read(seen[c], getattr(routers[c], "top_k", None)) for c in range(len(routers))]
    experts = reads[0].scores.shape[-1]
    own = torch.stack([read.indices for read in reads], dim=1).view(2, 8, len(routers), -1)
    replay = RouterReplay.attach(model)
    with torch.no_grad(), replay.forcing(own.to(torch.int16)):
        torch.testing.assert_close(model(input_ids=ids).logits, plain, atol=1e-5, rtol=1e-5)
    assert replay.forced == own.shape[0] * own.shape[1] * len(routers)
    replay.stats()
    with replay.forcing(((own + 1) % experts).to(torch.int16)):
        model(input_ids=ids, labels=ids).loss.backward()
        assert not torch.allclose(model(input_ids=ids).logits, plain, atol=1e-4)
    assert replay.stats()["router_mismatch"] > 0.9
    assert all(any(p.grad is not None and p.grad.abs().sum() > 0 for p in router.parameters()) for router in routers)


def test_the_head_probe_inside_a_steps_routes_routes_on_its_own():
    """colo.grpo asks has_plain_head the first time it computes log-probabilities, inside the step's
    forcing (or measuring) of the engine's routes: its two-token probe is no batch of the step and must
    route on its own, not meet the step's routes (it raised "the routes hold 32 tokens, the forward 2")."""
    from colo.grpo.logprobs import has_plain_head

    model = random_model({**TINY_CONFIG, "vocab_size": 100}, arch="qwen3_moe")
    replay = RouterReplay.attach(model)
    routes = torch.zeros(2, 16, 2, 2, dtype=torch.int16)
    for context in (replay.forcing, replay.measuring):
        model.__dict__.pop("_colo_plain_head", None)
        with context(routes):
            assert has_plain_head(model) is True
            assert replay._routes is not None  # the step's routes are back for the step's own forward


def test_a_router_whose_weights_follow_no_known_rule_is_refused():
    model = random_model({**TINY_CONFIG, "vocab_size": 100}, arch="qwen3_moe")
    replay = RouterReplay.attach(model)
    for layer in model.model.layers:   # weights that are no softmax of the logits over the chosen experts
        layer.mlp.gate.register_forward_hook(lambda m, args, out: (out[0], out[1] * 0.5, out[2]), prepend=True)
        break
    ids = torch.arange(3, 11).reshape(1, 8)
    with pytest.raises(NotImplementedError, match=r"layer 0: its router's weights \(Qwen3MoeTopKRouter\) are no softmax"):
        with replay.forcing(torch.zeros(1, 8, 2, 2, dtype=torch.int16)):
            model(input_ids=ids)


def test_routing_replay_is_refused_for_a_dense_model_before_any_engine(tiny_model_dir):
    from colo.grpo.config import check_routing_replay

    with pytest.raises(ValueError, match="is not a MoE model"):
        check_routing_replay(tiny_model_dir("qwen2"), agentic=False)
    with pytest.raises(NotImplementedError, match="agentic rollouts"):
        check_routing_replay(tiny_model_dir("qwen3_moe", vocab_size=1000), agentic=True)


def test_llama4s_router_is_forced_through_the_given_experts_with_its_sigmoid_gates():
    """Llama 4's router returns (scores over every expert, 0 where not chosen; logits): forcing gives the
    engine's experts the sigmoid of the router's own logits, every other expert 0, and the router still
    gets a gradient through them. Its decoder sits at `.model` (get_decoder() is the causal LM itself):
    colo.grpo's log-probabilities take the chunked head."""
    from colo.grpo.logprobs import has_plain_head

    model = random_model({**TINY_CONFIG, "vocab_size": 100}, arch="llama4")
    replay = RouterReplay.attach(model)
    routers = [layer.feed_forward.router for layer in model.model.layers]
    seen = {}
    for column, router in enumerate(routers):  # registered after the replay's hooks: sees what they return
        router.register_forward_hook(lambda m, args, out, column=column: seen.__setitem__(column, out))
    ids = torch.arange(3, 19).reshape(2, 8)
    with torch.no_grad():
        model(input_ids=ids)
    own = [seen[column][1].topk(1, dim=-1).indices for column in range(len(routers))]
    forced = torch.stack([(indices + 1) % 4 for indices in own], dim=1).view(2, 8, len(routers), 1)
    forced[1, :3] = -1    # the trainer's own choice there
    with replay.forcing(forced.to(torch.int16)):
        model(input_ids=ids, labels=ids).loss.backward()
    for column, (scores, logits) in seen.items():
        expected = forced[:, :, column].reshape(-1, 1)
        free = expected[:, 0] < 0
        chosen = torch.where(free.unsqueeze(-1), own[column], expected.long())
        gates = torch.sigmoid(logits.detach().gather(-1, chosen))
        torch.testing.assert_close(scores.detach().gather(-1, chosen), gates)
        assert int((scores != 0).sum()) == scores.shape[0]   # one expert scored per token
    assert all(router.weight.grad.abs().sum() > 0 for router in routers)
    assert replay.stats()["router_mismatch"] > 0.9
    assert has_plain_head(model) is True


def test_a_router_output_replay_cannot_read_is_refused_by_name_when_forcing():
    model = random_model({**TINY_CONFIG, "vocab_size": 100}, arch="qwen3_moe")
    replay = RouterReplay.attach(model)
    model.model.layers[0].mlp.gate.register_forward_hook(lambda m, args, out: out[0], prepend=True)
    with pytest.raises(NotImplementedError, match="layer 0: routing replay needs .*; Qwen3MoeTopKRouter returns Tensor"):
        with replay.forcing(torch.zeros(1, 8, 2, 2, dtype=torch.int16)):
            model(input_ids=torch.arange(3, 11).reshape(1, 8))
