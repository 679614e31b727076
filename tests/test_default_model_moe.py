"""The training model's MoE layer (grouped matmuls over expert-sorted rows) against a slow,
obvious reference: every token through its k experts one at a time. Outputs, expert ids, the
load-balancing loss and every gradient agree on random inputs (float32: grouped_mm takes no
float64). Skipped where torch is not installed (CI installs only what inference needs)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from saem_gguf.defaultmodel.model import Config, MoE  # noqa: E402


def naive_moe(moe: MoE, x):
    """Per token: softmax router, top-k, weights renormalised, a weighted sum of SwiGLU experts."""
    c = moe.c
    probs = F.softmax(x @ moe.router.weight.T, dim=-1)
    w, idx = probs.topk(c.n_expert_used, dim=-1)
    w = w / w.sum(-1, keepdim=True).clamp_min(6.103515625e-5)
    rows = []
    for t in range(x.shape[0]):
        y = x.new_zeros(x.shape[1])
        for j in range(c.n_expert_used):
            e = int(idx[t, j])
            h = F.silu(moe.gate[e] @ x[t]) * (moe.up[e] @ x[t])
            y = y + w[t, j] * (moe.down[e] @ h)
        rows.append(y)
    share = torch.bincount(idx.reshape(-1), minlength=c.n_expert).to(x.dtype) / idx.numel()
    aux = c.n_expert * (share * probs.mean(0)).sum()
    return torch.stack(rows), aux, idx


@pytest.mark.parametrize("seed,n_tok,n_expert,k", [(0, 37, 8, 2), (1, 64, 32, 4), (2, 5, 16, 4)])
def test_moe_matches_the_per_token_reference(seed, n_tok, n_expert, k):
    torch.manual_seed(seed)
    c = Config(n_vocab=16, n_embd=24, n_ff_exp=12, n_expert=n_expert, n_expert_used=k)
    moe = MoE(c)
    for p in moe.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    x = torch.randn(n_tok, c.n_embd)
    y, aux, idx = moe(x)
    y_ref, aux_ref, idx_ref = naive_moe(moe, x)
    assert torch.equal(idx, idx_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(aux, aux_ref, rtol=1e-6, atol=1e-7)
    # gradients of one scalar of both through every parameter and the input
    g_out = torch.randn_like(y)
    xa = x.clone().requires_grad_()
    xb = x.clone().requires_grad_()
    grads_a = torch.autograd.grad(((moe(xa)[0] * g_out).sum()), [xa, *moe.parameters()])
    grads_b = torch.autograd.grad(((naive_moe(moe, xb)[0] * g_out).sum()), [xb, *moe.parameters()])
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(ga, gb, rtol=1e-4, atol=1e-5)


def test_an_expert_no_token_chose_gets_no_gradient():
    torch.manual_seed(3)
    c = Config(n_vocab=16, n_embd=8, n_ff_exp=4, n_expert=8, n_expert_used=1)
    moe = MoE(c)
    for p in moe.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    x = torch.randn(3, c.n_embd)  # 3 tokens, one expert each: >= 5 idle
    y, _, idx = moe(x)
    y.sum().backward()
    idle = sorted(set(range(c.n_expert)) - set(idx.reshape(-1).tolist()))
    assert len(idle) >= 5
    assert float(moe.gate.grad[idle].abs().sum()) == 0.0 and float(moe.down.grad[idle].abs().sum()) == 0.0
