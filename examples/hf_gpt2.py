"""Train a Hugging Face GPT-2 data-parallel with fddp, put it back into the module and sample from it.

    pip install -e ".[examples,hf]"
    torchrun --standalone --nproc-per-node=2 examples/hf_gpt2.py

A tiny GPT-2 with a random configuration (nothing is downloaded) learns generated text: stretches
of the alphabet, ``"klmnopq"``, of random lengths, padded to one length with an attention mask and
with the padding left out of the loss. What it shows:

* ``fddp.functionalize`` on a ``transformers`` model: GPT-2 ties its output layer to the token
  embedding, so ``lm_head.weight`` is the same leaf as ``transformer.wte.weight`` (one gradient, one
  update, sent once);
* the model's ``ModelOutput``: the loss is ``out.loss``;
* ``fddp.load_into(model, params)``: the trained values back in the module, tied weights included,
  for ``model.generate`` and ``model.save_pretrained``, which need the module itself.

Writes ``<out-dir>/metrics.json`` and the trained model, ``<out-dir>/model`` (``save_pretrained``;
``GPT2LMHeadModel.from_pretrained`` loads it back).
"""

from __future__ import annotations

import argparse
import json
import os
import string
import time

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

import fddp
import fddp.optim

LETTERS = string.ascii_lowercase
PAD = len(LETTERS)  # one token past the letters, for padding (and as GPT-2's bos/eos)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="A tiny Hugging Face GPT-2 trained data-parallel with fddp.")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=32, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="runs/hf_gpt2")
    return p.parse_args()


def make_batch(n: int, seq_len: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """``n`` stretches of the alphabet (wrapping after z) of random lengths, right-padded.

    Returns ``input_ids``, the ``attention_mask`` (0 on padding) and ``labels`` (the inputs, -100 on
    padding, which Hugging Face's loss ignores).
    """
    start = torch.randint(0, len(LETTERS), (n, 1), generator=gen)
    ids = (start + torch.arange(seq_len)) % len(LETTERS)
    lengths = torch.randint(seq_len // 2, seq_len + 1, (n, 1), generator=gen)
    mask = (torch.arange(seq_len) < lengths).long()
    return {
        "input_ids": ids.masked_fill(mask == 0, PAD),
        "attention_mask": mask,
        "labels": ids.masked_fill(mask == 0, -100),
    }


def main() -> None:
    args = parse_args()
    t0 = time.perf_counter()
    transformers.logging.set_verbosity_error()  # no notes on the default loss, no progress bars
    transformers.utils.logging.disable_progress_bar()
    fddp.init()
    rank, world = fddp.rank(), fddp.world_size()

    torch.manual_seed(args.seed)
    config = GPT2Config(
        vocab_size=len(LETTERS) + 1, n_positions=args.seq_len, n_embd=64, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=PAD, eos_token_id=PAD, pad_token_id=PAD,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)  # random weights, from the seed: nothing is downloaded
    apply_fn, params = fddp.functionalize(model)  # lm_head.weight is transformer.wte.weight: one leaf
    params = fddp.broadcast(params)
    opt = fddp.optim.adamw(lr=args.lr, weight_decay=0.01)
    opt_state = opt.init(params)

    def loss_fn(params, batch):
        return apply_fn(params, **batch).loss  # a ModelOutput: the loss is one of its fields

    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own batches
    losses = []
    for step in range(1, args.steps + 1):
        grads, loss = fddp.grad_and_value(loss_fn)(params, make_batch(args.batch_size, args.seq_len, gen))
        params, opt_state = fddp.optim.apply_gradients(opt, grads, opt_state, params)
        losses.append(loss.item())
        if fddp.is_main() and (step % 20 == 0 or step == args.steps):
            print(f"step {step:4d}  loss {loss.item():.4f} (rank 0's batch)", flush=True)
    fddp.verify_replicas(params)

    # The module itself again, with the trained values, for generate and save_pretrained.
    fddp.load_into(model, params)
    model.eval()
    prompt = torch.tensor([[LETTERS.index(c) for c in "klm"]])
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False)
    sample = "".join(LETTERS[i] if i < len(LETTERS) else "_" for i in out[0].tolist())
    if fddp.is_main():
        os.makedirs(args.out_dir, exist_ok=True)
        model.save_pretrained(os.path.join(args.out_dir, "model"))
        with open(os.path.join(args.out_dir, "metrics.json"), "w") as f:
            json.dump({"world_size": world, "loss": losses, "sample": sample}, f)
        print(f"{args.steps} steps on {world} process(es) in {time.perf_counter() - t0:.1f} s; "
              f"greedy continuation of 'klm': {sample}; model saved to {os.path.join(args.out_dir, 'model')}",
              flush=True)  # fmt: skip
    fddp.shutdown()  # every rank together: none leaves while another still communicates or writes


if __name__ == "__main__":
    main()
