"""Hugging Face ``transformers`` models (tiny random configurations, nothing downloaded), as the docs'
"Using Hugging Face models" page describes them: tied weights back into the module, gradient
checkpointing, constant buffers, attention masks under ``vmap``. Skipped without ``transformers``
(the ``hf`` extra)."""

from __future__ import annotations

import copy

import pytest
import torch

import fddp

transformers = pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[hf]'")
transformers.logging.set_verbosity_error()


@pytest.fixture(scope="module", autouse=True)
def _world():
    fddp.init()


def gpt2(**kw) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=32, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, **kw,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def ids(n: int = 4, t: int = 10, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 32, (n, t), generator=torch.Generator().manual_seed(seed))


def test_load_into_gives_gpt2_its_trained_tied_head_back():
    model = gpt2()
    apply_fn, params = fddp.functionalize(model)
    assert "lm_head.weight" not in params and "transformer.wte.weight" in params
    trained = {k: v + 0.5 for k, v in params.items()}
    with pytest.raises(RuntimeError, match="lm_head.weight"):
        copy.deepcopy(model).load_state_dict(trained)
    fddp.load_into(model, trained)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(model.lm_head.weight, trained["transformer.wte.weight"])
    model.eval()
    x = ids()
    assert torch.equal(model(x).logits, apply_fn(trained, x).logits)


def checkpointing(model: torch.nn.Module, on: bool) -> None:
    """transformers 5 renamed gradient_checkpointing_enable/disable to activation_checkpointing_*."""
    if hasattr(model, "activation_checkpointing_enable"):
        if on:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.activation_checkpointing_disable()
    elif on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def test_gradient_checkpointing_works_with_grad_and_value_not_with_torch_func_grad():
    model = gpt2()
    apply_fn, params = fddp.functionalize(model)
    x = ids()

    def loss_fn(p):
        return apply_fn(p, input_ids=x, labels=x).loss  # a ModelOutput's loss field

    plain, loss = fddp.grad_and_value(loss_fn)(params)
    checkpointing(model, True)
    assert model.is_gradient_checkpointing
    checkpointed, loss2 = fddp.grad_and_value(loss_fn)(params)
    assert torch.equal(loss, loss2)
    for k in plain:
        assert torch.equal(plain[k], checkpointed[k]), k
    # transformers' hook calls requires_grad_() on the embeddings' output: torch.func forbids that.
    with pytest.raises(RuntimeError, match="requires_grad_"):
        torch.func.grad(loss_fn)(params)
    checkpointing(model, False)
    model.disable_input_require_grads()  # the hook outlives turning checkpointing off
    torch.func.grad(loss_fn)(params)


def test_bert_constant_buffers_are_passed_through_not_copied():
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    model = transformers.BertForMaskedLM(config)
    apply_fn, params, buffers = fddp.functionalize_with_buffers(model)
    assert sorted(buffers) == ["bert.embeddings.position_ids", "bert.embeddings.token_type_ids"]
    x = ids(t=8)
    mask = torch.ones_like(x).index_fill(1, torch.tensor([6, 7]), 0)
    for _ in range(2):
        out, new = apply_fn(params, buffers, input_ids=x, attention_mask=mask)
    assert all(new[k] is buffers[k] for k in buffers), "constant buffers were copied"
    assert torch.equal(out.logits, model(input_ids=x, attention_mask=mask).logits)


def test_per_sample_gradients_with_an_attention_mask_under_vmap_need_eager_attention():
    model = gpt2(attn_implementation="eager").double()
    apply_fn, params = fddp.functionalize(model)
    x = ids()
    mask = torch.ones_like(x)
    mask[:, 7:] = 0

    def loss_fn(p, xi, mi):
        labels = xi.masked_fill(mi == 0, -100)
        return apply_fn(p, input_ids=xi[None], attention_mask=mi[None], labels=labels[None]).loss

    per_sample = torch.func.vmap(torch.func.grad(loss_fn), in_dims=(None, 0, 0))(params, x, mask)
    for i in range(len(x)):
        one = torch.func.grad(loss_fn)(params, x[i], mask[i])
        for k in one:  # vmap and a loop run different kernels: float64 keeps them far below the tolerance
            torch.testing.assert_close(per_sample[k][i], one[k], rtol=1e-9, atol=1e-12, msg=k)


def test_has_aux_with_a_model_output_comes_back_detached_as_torch_func_does():
    model = gpt2()
    apply_fn, params = fddp.functionalize(model)
    x = ids()

    def loss_fn(p, x):
        out = apply_fn(p, input_ids=x, labels=x, use_cache=False)  # torch.func refuses a cache object in aux
        return out.loss, out

    grads, (loss, out) = fddp.grad_and_value(loss_fn, has_aux=True)(params, x)
    ref_grads, (ref_loss, ref_out) = torch.func.grad_and_value(loss_fn, has_aux=True)(params, x)
    assert type(out) is type(ref_out) and not out.logits.requires_grad and not ref_out.logits.requires_grad
    out.logits.numpy()  # detached: no "Can't call numpy() on Tensor that requires grad"
    assert torch.equal(out.logits, ref_out.logits) and torch.equal(loss, ref_loss)
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-5, atol=1e-7)
