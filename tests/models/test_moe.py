"""Mixture-of-experts in training (models/moe.py): routing replay forces the engine's routes in the trainer's
forward; the load-balancing loss (CPU, fp32)."""

from __future__ import annotations

import pytest
import torch

from relayrl.models.forward import token_logprobs
from relayrl.models.moe import install_moe, moe_pass
from relayrl.rollout import GenerationRequest, SamplingParams, build_engine, generate_all
from tests.helpers.moe_models import MOE_LAYOUTS, lively_moe

pytestmark = pytest.mark.timeout(60)
TEXTS = ["12+34=", "hello world, how are you", "The quick brown fox jumps"]


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    return [tiny_tokenizer(t)["input_ids"] for t in TEXTS]


def _rollout(model, tok, prompts):
    """Sampled sequences, the engine's log-probs of their completion tokens and the recorded routes."""
    engine = build_engine("native", model, tok, max_seq_len=64, max_slots=8, record_routes=True)
    reqs = [
        GenerationRequest(prompt_ids=list(p), params=SamplingParams(max_new_tokens=10, seed=i))
        for i, p in enumerate(prompts)
    ]
    results = generate_all(engine, reqs)
    engine.close()
    seqs, lps, routes, masks = [], [], [], []
    for p, res in zip(prompts, results, strict=True):
        c = res.completions[0]
        seqs.append(torch.tensor(list(p) + c.token_ids))
        lps.append(torch.tensor([0.0] * len(p) + c.logprobs))
        masks.append(torch.tensor([False] * len(p) + [True] * len(c.token_ids)))
        routes.append(c.routes)
    return seqs, torch.cat(lps), torch.cat(routes), torch.cat(masks)


def _trainer(model, seqs, routes=None, layout="padded"):
    with torch.no_grad(), moe_pass([len(s) for s in seqs], routes=routes) as p:
        lp, _ = token_logprobs(model, seqs, layout)
    return lp, torch.stack(p.taken, dim=1)  # [N, layers, k]


def _perturb_router(model, std=0.1, seed=1):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            w = layer.mlp.gate.weight
            w.add_(torch.randn(w.shape, generator=gen) * std)


@pytest.mark.parametrize("layout", MOE_LAYOUTS)
def test_routing_replay_makes_the_trainer_route_like_the_engine(layout, tiny_tokenizer, prompts):
    model = lively_moe(layout)
    seqs, engine_lp, routes, mask = _rollout(model, tiny_tokenizer, prompts)
    install_moe(model)
    fed = routes[:, 0, 0] >= 0  # tokens the engine fed (all but each sequence's last)
    lp, taken = _trainer(model, seqs, routes)
    assert torch.equal(taken[fed], routes[fed].long())
    torch.testing.assert_close(lp[mask], engine_lp[mask], atol=1e-4, rtol=0)
    _, free_taken = _trainer(model, seqs)  # fp32: the same routes without replay
    assert torch.equal(free_taken[fed].sort(-1).values, routes[fed].long().sort(-1).values)
    # forcing other experts changes the log-probs: the forced routes are what the forward uses
    wrong = torch.where(routes >= 0, (routes + 1) % 8, routes)
    wrong_lp, wrong_taken = _trainer(model, seqs, wrong)
    assert torch.equal(wrong_taken[fed], wrong[fed].long())
    assert (wrong_lp[mask] - engine_lp[mask]).abs().mean() > 0.05


@pytest.mark.parametrize("layout", MOE_LAYOUTS)
def test_replay_removes_what_a_route_flip_changes(layout, tiny_tokenizer, prompts):
    """Top-1 routing (renormalised: the chosen expert's weight is 1 whatever the router says), so a router
    perturbation changes routes only: without replay routes flip and log-probs move; with replay every
    route and every log-prob is the engine's (atol 1e-4)."""
    model = lively_moe(layout, top_k=1)
    seqs, engine_lp, routes, mask = _rollout(model, tiny_tokenizer, prompts)
    install_moe(model)
    fed = routes[:, 0, 0] >= 0
    _perturb_router(model, std=0.3)
    free_lp, free_taken = _trainer(model, seqs)
    replay_lp, replay_taken = _trainer(model, seqs, routes)
    assert (free_taken[fed] != routes[fed].long()).any(-1).float().mean() > 0.1  # routes flipped
    assert (free_lp[mask] - engine_lp[mask]).abs().mean() > 0.05
    assert torch.equal(replay_taken[fed], routes[fed].long())
    torch.testing.assert_close(replay_lp[mask], engine_lp[mask], atol=1e-4, rtol=0)


def test_routes_must_cover_the_tokens():
    zeros = torch.zeros(3, 2, 2, dtype=torch.int16)
    with (
        pytest.raises(ValueError, match="routes cover 3 tokens but the sequences hold 5"),
        moe_pass([2, 3], routes=zeros),
    ):
        pass


def test_aux_loss_matches_transformers_and_has_a_gradient(tiny_tokenizer, prompts):
    """fp32 router logits collected by the pass give transformers' load_balancing_loss_func value (1e-6)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    model = lively_moe("mixtral")
    install_moe(model)
    seqs = [torch.tensor(p) for p in prompts]
    with moe_pass([len(s) for s in seqs], collect=True) as p:
        token_logprobs(model, seqs, "padded")
    aux = p.aux_loss()
    assert aux is not None
    layers = len(p.logits)
    ref = load_balancing_loss_func(tuple(p.logits), 8, 2)  # pyright: ignore[reportArgumentType]
    assert layers == 2
    torch.testing.assert_close(aux, ref, rtol=1e-6, atol=0)
    aux.backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_token_rows_of_the_varlen_and_padded_layouts():
    """A packed [1, N] row maps token i to row i; right-padded [S, T_max] rows skip the padding; another
    shape (a sequence-parallel slice) counts every row, unless routes must be placed."""
    cpu = torch.device("cpu")
    with moe_pass([2, 3]) as p:
        assert p.real_rows(1, 5, cpu).tolist() == [0, 1, 2, 3, 4]
        assert p.real_rows(2, 3, cpu).tolist() == [0, 1, 3, 4, 5]
        assert p.real_rows(1, 3, cpu) is None
    routes = torch.zeros(5, 2, 2, dtype=torch.int16)
    with (
        moe_pass([2, 3], routes=routes) as p,
        pytest.raises(ValueError, match="met a \\[1, 3\\] block input"),
    ):
        p.real_rows(1, 3, cpu)


@pytest.mark.parametrize("collect", [False, True])
def test_gradient_checkpointing_recomputes_the_forced_routes(tiny_tokenizer, prompts, collect):
    """Activation checkpointing re-runs each layer's forward during backward, after the pass has ended: the
    recompute must route as the forward did (replayed routes, the collected router logits' indexing), so the
    gradients equal those without checkpointing exactly. Forced routes that the router would not pick make a
    free-routing recompute differ (it raised torch's CheckpointError before)."""
    seqs = [torch.tensor(p) for p in prompts]
    n = sum(len(s) for s in seqs)
    routes = (torch.arange(n * 2 * 2).reshape(n, 2, 2) % 8).to(torch.int16)  # 2 layers, top-2 of 8 experts
    routes[:, :, 1] = (routes[:, :, 0] + 3) % 8
    grads = []
    for checkpointing in (False, True):
        model = lively_moe("qwen3")
        install_moe(model)
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        with moe_pass([len(s) for s in seqs], routes=routes, collect=collect) as p:
            lp, _ = token_logprobs(model, seqs, "padded")
        aux = p.aux_loss()
        loss = lp.sum() if aux is None else lp.sum() + aux
        assert (aux is not None) == collect
        loss.backward()
        assert torch.equal(torch.stack(p.taken, dim=1), routes.long())
        grads.append({k: v.grad.clone() for k, v in model.named_parameters() if v.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    for k in grads[0]:
        assert torch.equal(grads[0][k], grads[1][k]), k
